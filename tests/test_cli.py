"""The command line fails fast and clearly: each bad input is one line with its exit status, never a traceback;
``dtrain status`` against a live coordinator (table and JSON) and a closed port; the coordinator's auth and
bad-request events. In-process (``main(argv)``) except where the exit status or stderr must be a real process's."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from conftest import TINY, initial_parameters
from coordinator.app import serve
from coordinator.streams import peer_host
from dtrain import codec
from dtrain.config.load import load_config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata, chunk_message, method_path, parse_address, serialize
from dtrain.runlog import RunLog, read_events
from dtrain_cli.logs import cli_logging
from dtrain_cli.main import COMMANDS, main
from dtrain_cli.status import plain, print_status, sections
from workers.client import CoordinatorClient

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT)


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: nothing answers there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv)'s exit status (returned, or argparse's SystemExit) and what it printed."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


# -- arguments ----------------------------------------------------------------------------------------------------

def test_version(capsys):
    from importlib.metadata import version

    rc, out, _ = _exit(["--version"], capsys)
    assert rc == 0 and out == f"dtrain {version('dtrain')}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_and_an_example(command, capsys):
    rc, out, _ = _exit([command, "--help"], capsys)
    usage, description = out.split("\n\n")[:2]
    assert rc == 0 and usage.startswith(f"usage: dtrain {command}")
    assert not description.startswith("options:") and len(description) > 40, description
    assert f"example:\n  dtrain {command} " in out


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "no port"),
    ("localhost:notaport", "the port 'notaport' is not a number"),
    ("localhost:0", "the port 0 is not in 1..65535"),
    ("localhost:65536", "the port 65536 is not in 1..65535"),
    (":50051", "no host"),
    ("", "empty"),
    ("::1:50051", "an IPv6 address goes in brackets: [::1]:50051"),
    ("[::1]", "an IPv6 address goes in brackets, then :PORT"),
    ("http://10.0.0.5:50051", "a scheme or path"),
])
@pytest.mark.parametrize("command", ["worker", "status"])
def test_a_bad_coordinator_address_is_one_line_and_exit_2(command, address, why, capsys):
    extra = ["--config", "tiny", "--island", "a"] if command == "worker" else []
    rc, out, err = _exit([command, "--coordinator", address, *extra], capsys)
    assert rc == 2 and out == ""
    assert err == (f"dtrain {command}: error: argument --coordinator: {address!r}: {why}; expected HOST:PORT, e.g. "
                   f"127.0.0.1:50051 (IPv6: [::1]:50051) (dtrain {command} --help shows the usage)\n")


@pytest.mark.parametrize(("address", "parsed"), [("127.0.0.1:50051", ("127.0.0.1", 50051)),
                                                 ("localhost:1", ("localhost", 1)),
                                                 ("[::1]:50051", ("::1", 50051)),
                                                 ("coord.example.com:65535", ("coord.example.com", 65535))])
def test_good_addresses_parse(address, parsed):
    assert parse_address(address) == parsed


def test_the_client_refuses_a_bad_address_too(tmp_path):
    with pytest.raises(ValueError, match="no port"):
        CoordinatorClient("127.0.0.1", load_config(TINY))


CONFIG_NAMES = ", ".join(sorted(p.stem for p in (TINY.parent).glob("*.toml")))


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["status", "--coordinator", "127.0.0.1:9", "--wait", "0"],
     2, "dtrain status: config error: --wait: must be a number of seconds > 0, got 0.0"),
    (["status", "--coordinator", "127.0.0.1:9", "--tls-cert", "c.pem"],
     2, "dtrain status: config error: --tls-cert and --tls-key go together (mutual TLS needs both)"),
    (["status", "--coordinator", "127.0.0.1:9", "--config", "nope"],
     2, f"dtrain status: config error: nope: config file not found, nor a config name (configs/: {CONFIG_NAMES})"),
    (["simulate", "--config", "tinny"],  # a typo: the names there are, and the nearest
     2, f"dtrain simulate: config error: tinny: config file not found, nor a config name (configs/: {CONFIG_NAMES}); "
        "did you mean tiny?"),
    (["status", "--coordinator", "127.0.0.1:9", "--tls-ca", "/nonexistent/ca.pem"],
     2, "dtrain status: config error: [security] ca: cannot read /nonexistent/ca.pem: No such file or directory"),
    (["status", "--coordinator", "127.0.0.1:9", "--set", "train.lr=1"],
     2, "dtrain status: error: unrecognized arguments: --set train.lr=1 (dtrain status --help shows the usage)"),
    (["train", "--config", str(TINY), "--set", "outer.inner_steps=100"],
     2, f"dtrain train: config error: {TINY} + --set: [outer] inner_steps: must be <= train.steps (60), got 100"),
    (["simulate", "--config", "tiny", "--set", "train.lr"],
     2, "dtrain simulate: config error: --set 'train.lr': expected section.field=value"),
    (["worker", "--config", "tiny", "--coordinator", "127.0.0.1:9", "--island", "a", "--inject", "melt@v1"],
     2, "dtrain worker: config error: --inject 'melt@v1': unknown kind 'melt' (one of nan, poison, inflate, "
        "truncate, scale, ramp)"),
    (["coordinator", "--config", "tiny", "--port", "99999"],
     2, "dtrain coordinator: error: argument --port: 99999 is not in 0..65535 (0: any free port) (dtrain coordinator "
        "--help shows the usage)"),
    (["train", "--config", "tiny", "--host-devices", "-3"],
     2, "dtrain train: error: argument --host-devices: -3: must be >= 0 (0: leave XLA_FLAGS as it is) (dtrain train "
        "--help shows the usage)"),
    (["frobnicate"], 2, "dtrain: error: argument COMMAND: invalid choice: 'frobnicate' (choose from 'train', "
                        "'simulate', 'coordinator', 'worker', 'status', 'config', 'plot', 'dashboard', 'tokenize', "
                        "'export', 'generate', 'eval', 'admin') "
                        "(dtrain --help shows the usage)"),
])
def test_bad_input_is_one_line_with_its_exit_status(argv, code, message, capsys):
    rc, out, err = _exit(argv, capsys)
    assert (rc, out, err) == (code, "", message + "\n")


def test_config_needs_no_config_file(capsys):
    rc, out, _ = _exit(["config", "--reference"], capsys)
    assert rc == 0 and out.startswith("| field | default | meaning |\n")


# -- no tracebacks: a closed pipe, the benchmarks --------------------------------------------------------------

@pytest.mark.parametrize("argv", [["config", "--reference"], ["config", "--config", "tiny"]])
def test_a_closed_stdout_ends_quietly(argv):
    """`dtrain config --reference | head -1`: the reader is gone before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "dtrain_cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == ""  # 1: Python's status for EPIPE; no traceback


def test_a_benchmark_with_a_bad_data_path_is_one_line(tmp_path):
    proc = _run(str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--set", f"data.source={tmp_path}/nope.txt")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"benchmarks/convergence.py: error: data.source '{tmp_path}/nope.txt': no such file or "
                           "folder (a store path or URL, builtin, text files or .bin shards)\n")


def test_a_store_whose_port_refuses_is_one_line_naming_it_and_the_cause(tmp_path):
    port = _closed_port()
    url = f"http://127.0.0.1:{port}/corpus"
    proc = _run("-m", "dtrain_cli", "train", "--config", "tiny", "--set", f"run.out_dir={tmp_path}",
                "--set", f"data.source={url}", "--set", "data.read_timeout_s=2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"opening token store {url} (waits up to 2 s for each answer)" in proc.stderr  # said while waiting
    assert proc.stderr.splitlines()[-1] == (f"dtrain train: error: token store {url}: reading its manifest.json "
                                            f"failed: cannot connect to 127.0.0.1 port {port}: refused (nothing "
                                            "listens there) or no route to it")


def test_a_store_over_the_models_vocabulary_is_one_line(tmp_path):
    from dtrain.data.token_store import StoreWriter

    w = StoreWriter(tmp_path / "gpt2", vocab_size=50304)
    w.add_document(np.arange(1000))
    w.close()
    proc = _run("-m", "dtrain_cli", "simulate", "--config", "tiny", "--set", f"run.out_dir={tmp_path}",
                "--set", f"data.source={tmp_path / 'gpt2'}")
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr == (f"dtrain simulate: error: data.source '{tmp_path / 'gpt2'}': the token store's "
                           "vocabulary has 50304 ids (0..50303, tokenizer bytes), more than model.vocab_size 256: set "
                           "model.vocab_size >= 50304\n")
    assert not (tmp_path / "tiny").exists()  # refused before any process started


@pytest.mark.parametrize("script", ["convergence", "faults"])
def test_a_benchmark_with_a_bad_config_is_one_line(script):
    proc = _run(str(ROOT / "benchmarks" / f"{script}.py"), "--set", "train.lr=fast")
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(rf"benchmarks/{script}.py: config error: \S+ \+ --set: \[train\] lr: [^\n]+\n", proc.stderr), \
        proc.stderr


# -- dtrain status -----------------------------------------------------------------------------------------------

@pytest.fixture
def live(tmp_path, monkeypatch):
    """A coordinator on 127.0.0.1:0 in this process (one island per round: a push merges at once)."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.lease_s=30",
                             "outer.islands=1", "train.steps=40", "outer.inner_steps=10",
                             "codec.chunk_bytes=4096", "coordinator.max_message_bytes=65536"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coord", theta, spec, port=0, quiet=True)
    yield SimpleNamespace(cfg=cfg, service=service, address=f"127.0.0.1:{port}", run_dir=tmp_path / "coord")
    server.stop(grace=None).wait()
    service.close()


def _island_with_a_merge(live) -> pb.JoinResponse:
    """Island "east" joins, sends a heartbeat and pushes one delta, which merges: version 1."""
    client = CoordinatorClient(live.address, live.cfg)
    join = client.join("east", "cpu", 8)
    client.heartbeat(island_id=join.island_id, version=0, steps=10, tokens=5120, steps_per_s=2.5, devices=8)
    n = join.tree_size
    frame = codec.encode(codec.quantize(np.full(n, 1e-3, np.float32), 8, 1024))
    header = pb.PushHeader(island_id=join.island_id, base_version=0, push_id="p1", tokens=640, inner_steps=10,
                           cursor_start=0, cursor_end=80, tree_digest=join.tree_digest, shard_index=join.shard_index)
    assert client.push(header, frame).status == pb.PUSH_STATUS_MERGED
    client.close()
    return join


def test_status_json_has_numbers_as_numbers_and_every_field(live, capsys):
    join = _island_with_a_merge(live)
    rc, out, err = _exit(["status", "--coordinator", live.address, "--json"], capsys)
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert "json" not in doc and doc["run_id"] == live.service.run_id
    assert doc["version"] == 1 and isinstance(doc["version"], int)  # protobuf's JSON writes "1"
    assert doc["tokens_merged"] == 640 and doc["bytes_in"] > 0 and doc["tokens_total"] > 640
    (isl,) = doc["islands"]
    assert isl["name"] == "east" and isl["island_id"] == join.island_id and isl["state"] == "live"
    assert isl["shard_index"] == 0  # present although 0 is the proto's default
    assert isl["steps_per_s"] == 2.5 and isl["devices"] == 8 and isl["quarantined"] == []
    assert set(doc) == {f.name for f in pb.StatusResponse.DESCRIPTOR.fields}  # every field, set or not


def test_status_table_shows_the_run_and_its_islands(live, capsys):
    _island_with_a_merge(live)
    rc, out, err = _exit(["status", "--coordinator", live.address], capsys)  # stdout is not a terminal: plain
    assert rc == 0 and err == ""
    lines = out.splitlines()
    st = live.service.status_message()
    assert lines[0] == f"run {st.run_id} (sync mode): running"
    assert lines[1] == (f"version 1 (the data decides the last one); tokens merged 640 of {st.tokens_total:,} "
                        f"({640 / st.tokens_total:.0%})")
    header = next(line for line in lines if line.startswith("island "))
    row = next(line for line in lines if line.startswith("east "))  # its name; the shard its own column
    cells = dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", row.strip()), strict=True))
    assert cells["state"] == "live" and cells["shard"] == "0" and cells["version"] == "0"
    assert cells["steps/s"] == "2.50" and cells["devices"].split()[0] == "8" and cells["quar."] == "0"
    assert "─" not in out and "\x1b" not in out  # no box drawing, no colour in a pipe


def test_status_of_a_finished_run_says_it_is_over(tmp_path, capsys):
    """A run whose every shard's data is merged (train.steps=10: one push) while the coordinator lingers for the
    islands' last pulls: the table says it is over and why, the JSON says stopped with every token merged."""
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.lease_s=30",
                             "outer.islands=1", "train.steps=10", "outer.inner_steps=10",
                             "codec.chunk_bytes=4096", "coordinator.max_message_bytes=65536"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coord", theta, spec, port=0, quiet=True)
    try:
        _island_with_a_merge(SimpleNamespace(cfg=cfg, address=f"127.0.0.1:{port}"))
        rc, out, err = _exit(["status", "--coordinator", f"127.0.0.1:{port}"], capsys)
        assert rc == 0 and err == ""
        first = out.splitlines()[0]
        assert first.startswith(f"run {service.run_id} (sync mode): over: the run is over: all 1 shards' data")
        assert f"tokens merged 640 of {80 * cfg.model.seq_len:,}" in out  # the push claimed 640 of its 80 sequences
        rc, out, _ = _exit(["status", "--coordinator", f"127.0.0.1:{port}", "--json"], capsys)
        doc = json.loads(out)
        assert rc == 0 and doc["stopped"] is True and doc["shard_cursors"] == [80] and doc["round"]["pending"] == 0
    finally:
        server.stop(grace=None).wait()
        service.close()


def test_status_table_on_a_terminal_is_drawn_by_rich(live):
    _island_with_a_merge(live)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    print_status(live.service.status_message(), as_json=False, stream=out)
    text = out.getvalue()
    assert "islands" in text and "east " in text and "east-0" not in text
    assert "─" * 20 in text and "\x1b[1m" in text  # rich: rule, bold


def test_status_sections_render_every_part():
    st = pb.StatusResponse(run_id="r", version=3, total_versions=0, tokens_merged=500, tokens_total=1000,
                           mode="async", eval_loss=2.5, eval_confirmed=True, now=100.0, run_over="",
                           round=pb.OpenRound(target_version=4, pending=1, reason="waiting for b", deadline_s=3.0),
                           evals=[pb.EvalPoint(version=3, tokens=500, loss=2.5)],
                           rounds=[pb.RoundRecord(version=3, t=90.0, pushes=2, tokens=500, bytes_in=3 << 20)],
                           faults=[pb.FaultRecord(t=95.0, kind="auth_failed", detail="[x] wrong token"),
                                   pb.FaultRecord(t=96.0, kind="island_lost", island_id="a", detail="lease"),
                                   pb.FaultRecord(t=97.0, kind="island_lost", island_id="z-1", detail="gone")],
                           islands=[pb.IslandStatus(island_id="a-0", name="a", state="lost", train_loss=2.75)])
    lines, tables = sections(st)
    assert lines[1] == "version 3 (the data decides the last one); tokens merged 500 of 1,000 (50%)"
    assert lines[2] == "global eval loss 2.5000 (version 3, 500 tokens)"
    assert lines[3] == "open round (to version 4): 1 push pending, not ready: waiting for b, acts in 3.0s"
    text = plain(lines, tables)
    assert "3.0 MiB" in text and "10s ago" in text and "[x] wrong token" in text and "2.7500" in text
    # an island by its name everywhere, its shard a column; a fault shows the name it carries, listed or not
    islands, _, faults = tables
    assert [r[:3] for r in islands.rows] == [["a", "lost", "0"]]
    assert [r[2] for r in faults.rows] == ["-", "a", "z-1"]
    st.eval_confirmed = False  # one island's word alone (docs/security.md): said so, not shown as the run's figure
    assert sections(st)[0][2] == ("global eval loss 2.5000 (version 3, 500 tokens); unconfirmed: one island's "
                                  "report, no second to check it")


def test_status_against_a_closed_port_fails_within_seconds_naming_it(capsys):
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    rc, out, err = _exit(["status", "--coordinator", address], capsys)
    assert time.monotonic() - t0 < 2.0  # refused: said at once, not after --wait's 5 s
    assert rc == 1 and out == ""
    assert err == (f"dtrain status: error: no coordinator answers at {address} (connection refused: nothing listens "
                   f"there): is it running? check --coordinator\n")


def test_status_with_a_token(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DTRAIN_TOKEN", "s3cret")
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "coordinator.port=0", "outer.islands=1"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coord", theta, spec, port=0, quiet=True)
    try:
        address = f"127.0.0.1:{port}"
        rc, out, _ = _exit(["status", "--coordinator", address, "--json"], capsys)  # $DTRAIN_TOKEN, no config
        assert rc == 0 and json.loads(out)["run_id"] == service.run_id
        monkeypatch.setenv("OTHER_TOKEN", "wrong")
        rc, out, err = _exit(["status", "--coordinator", address, "--token-env", "OTHER_TOKEN"], capsys)
        assert rc == 1 and out == ""
        assert err.startswith(f"dtrain status: error: the coordinator at {address} refused the call: wrong token: ")
        assert err.endswith("give the token in the environment variable OTHER_TOKEN (--token-env NAME names "
                            "another)\n")
    finally:
        server.stop(grace=None).wait()
        service.close()


# -- the coordinator's events: auth failures, bad requests -------------------------------------------------------

def test_auth_failures_are_events_rate_limited_per_host(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_TOKEN", "s3cret")
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "coordinator.port=0", "outer.islands=1"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coord", theta, spec, port=0, quiet=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.CoordinatorStub(channel)
        for token in ("wrong", None, "wrong", "wrong", None):  # a flood of five: one event now, the rest counted
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(pb.JoinRequest(island="x"), timeout=5, metadata=auth_metadata(token))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            list(stub.PullGlobal(pb.PullRequest(island_id="x-0"), timeout=5))
        channel.close()
        events = [e for e in read_events(tmp_path / "coord") if e["event"] == "auth_failed"]
        assert len(events) == 1
        assert events[0]["peer"].startswith("ipv4:127.0.0.1:") and events[0]["count"] == 1
        assert events[0]["method"] == method_path("Join") and events[0]["reason"] == "wrong token"
    finally:
        server.stop(grace=None).wait()
        service.close()
    events = [e for e in read_events(tmp_path / "coord") if e["event"] == "auth_failed"]
    assert [e["count"] for e in events] == [1, 5]  # closing writes the calls counted since the first event
    assert events[1]["method"] == method_path("PullGlobal") and events[1]["reason"] == "missing token"


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.7:53122") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:53122") == "[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_bad_requests_are_request_invalid_events(live):
    client = CoordinatorClient(live.address, live.cfg)
    join = client.join("east", "cpu", 8)
    client.close()
    channel = grpc.insecure_channel(live.address)
    stub = pb_grpc.CoordinatorStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.PullGlobal(pb.PullRequest(island_id=join.island_id, wait_s=5000), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Join(pb.JoinRequest(island="west", fingerprint_fields={"model.d_model": "7"}), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    push = channel.stream_unary(method_path("PushDelta"), request_serializer=serialize,
                                response_deserializer=pb.PushDeltaResponse.FromString)
    header = pb.PushHeader(island_id=join.island_id, push_id="p", tree_digest="not-the-tree")
    with pytest.raises(grpc.RpcError) as e:  # the island comes from the stream's header
        push(iter([pb.PushMessage(header=header)]), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:  # a stream without a header names no island
        push(iter([chunk_message(0, b"x", 0)]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    events = [e for e in read_events(live.run_dir) if e["event"] == "request_invalid"]
    assert [(e["method"], e["island"], e["code"]) for e in events] == [
        ("PullGlobal", "east", "INVALID_ARGUMENT"), ("Join", "west", "FAILED_PRECONDITION"),
        ("PushDelta", "east", "FAILED_PRECONDITION"), ("PushDelta", "", "INVALID_ARGUMENT")]  # names
    assert events[0]["error"] == "wait_s=5000.0: must be in [0, 3600]"
    assert events[1]["error"].startswith("config fingerprint mismatch: ") and "model.d_model" in events[1]["error"]


# -- the island's retry lines --------------------------------------------------------------------------------------

def test_retry_progress_lines_name_the_address_and_the_time_left_at_most_every_30s(tmp_path, monkeypatch):
    from workers import membership

    clock = [1000.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    log = RunLog(tmp_path)
    on_retry = membership.RetryLines("w0", load_config(TINY), log)
    what = "join: the coordinator at 127.0.0.1:9 is unavailable (UNAVAILABLE, connection refused)"
    with cli_logging(stream):  # the command line's handler: lines as a worker.log shows them
        for left in (600.0, 599.5, 598.7, 570.0, 560.0):  # the first retry, then one line 30 s later
            clock[0] = 1000.0 + 600.0 - left
            on_retry(what, 0.4, left)
    log.close()
    lines = [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]
    assert lines == [f"w0: {what}; retrying for {left:.0f}s more, then giving up (worker.retry_total_s=600)"
                     for left in (600.0, 570.0)]
    assert sum(e["event"] == "retry" for e in read_events(tmp_path)) == 5  # every retry is still an event


def test_a_worker_whose_coordinator_does_not_answer_says_so_before_it_builds(tmp_path):
    """Before the island's slow start-up (model, compile), one Status try: when nothing answers, the worker says
    so at once, naming the address and how long it will retry, instead of staying silent through its compile."""
    from workers.membership import run_over_already

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(TINY, ["worker.retry_total_s=7"])
    client = CoordinatorClient(f"127.0.0.1:{port}", cfg)
    said: list[str] = []
    try:
        assert run_over_already(client, cfg, tmp_path, said.append) == ""  # Join will decide, and retry
    finally:
        client.close()
    assert len(said) == 1 and said[0].startswith(f"the coordinator at 127.0.0.1:{port} does not answer yet (")
    assert "connection refused" in said[0] and said[0].endswith("(retried for up to 7s)")


def test_dtrain_traceback_shows_where_a_user_error_came_from(monkeypatch, capsys):
    """A user error is one line; with DTRAIN_TRACEBACK=1 its traceback comes first (a developer's aid), same status."""
    from dtrain.errors import DtrainError
    from dtrain_cli.entry import run_main

    def fails() -> None:
        raise DtrainError("the coordinator went away")

    monkeypatch.delenv("DTRAIN_TRACEBACK", raising=False)
    assert run_main("dtrain worker", fails) == 1
    assert capsys.readouterr().err == "dtrain worker: error: the coordinator went away\n"
    monkeypatch.setenv("DTRAIN_TRACEBACK", "1")
    assert run_main("dtrain worker", fails) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in fails" in err
    assert err.endswith("dtrain worker: error: the coordinator went away\n")
