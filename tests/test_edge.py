"""The coordinator's edge (issue 36, items 4 and 6): every string a client sends bounded where it enters, control
characters escaped in every log line and in `dtrain status`, Status bounded whatever was sent, and a coordinator
secure by default. Against a real server on 127.0.0.1:0 and real gRPC clients."""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import initial_parameters
from coordinator.app import serve
from coordinator.edge import ISLAND_ID_RE, MAX_ISLAND_ID_LEN, SHOWN, request_problem
from coordinator.history import MAX_DETAIL, RunHistory
from coordinator.preflight import is_loopback, preflight
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError
from dtrain.net.identity import hash_line, issue_token
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.runlog import CONTROL_RE, RunLog, printable, read_events
from dtrain_cli.main import build_parser
from dtrain_cli.status import plain, print_status, sections
from service_helpers import join_island, push_header
from workers.client import CoordinatorClient

MIB = 1 << 20
# What the issue's attacker wrote into push ids and evidence details: a forged log line, NUL, a terminal title.
FORGED = "ok\x00\n[  99.9s] run finished, all islands healthy\x1b]0;pwned\x07\x1b[2J"
BIG = 3 * MIB


@pytest.fixture
def edge_cfg(net_cfg: Config) -> Config:
    """net_cfg with gRPC's message limit at its default (8 MiB): a 3 MiB field reaches the coordinator's handlers."""
    return replace(net_cfg, coordinator={"max_message_bytes": 8 << 20})


class Served:
    """A coordinator on 127.0.0.1:0 that logs (quiet=False), its log lines captured; a raw stub to it."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        self.text = io.StringIO()
        self.handler = logging.StreamHandler(self.text)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger = logging.getLogger("dtrain")
        self.logger.addHandler(self.handler)
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        theta, spec = initial_parameters(cfg)
        self.server, self.service, port = serve(cfg, run_dir, theta, spec, port=0, quiet=False, resume=resume)
        self.address, self.run_dir = f"127.0.0.1:{port}", run_dir
        opts = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
        self.channel = grpc.insecure_channel(self.address, options=opts)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None).wait()
        self.service.close()
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)


@pytest.fixture
def served(edge_cfg: Config, tmp_path: Path) -> Iterator[Served]:
    s = Served(edge_cfg, tmp_path / "coord")
    yield s
    s.stop()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# -- the checks themselves -------------------------------------------------------------------------------------------

def test_printable_escapes_every_control_character_and_bounds_the_length():
    assert printable(FORGED) == ("ok\\x00\\n[  99.9s] run finished, all islands healthy\\x1b]0;pwned\\x07"
                                 "\\x1b[2J")
    assert printable("a\u202eb\u2028c\td\r") == "a\\u202eb\\u2028c\\td\\r"
    assert printable("θ ‖Δ‖ island-0") == "θ ‖Δ‖ island-0"  # printable text is kept as it is
    assert printable("x" * 1000, 10) == "xxxxxxxxxx...(1,000 characters)"
    assert not CONTROL_RE.search(printable("".join(map(chr, range(0x300)))))


def test_the_edge_names_the_field_and_its_limit_and_quotes_a_bounded_escaped_prefix():
    cases = {
        "island": pb.JoinRequest(island="a" * BIG),
        "fingerprint_fields['model.d_model']": pb.JoinRequest(island="a",
                                                              fingerprint_fields={"model.d_model": "6" * 2000}),
        "fingerprint_fields: key": pb.JoinRequest(island="a", fingerprint_fields={"k" * 200: "1"}),
        "fingerprint_fields: 257 items": pb.JoinRequest(island="a",
                                                        fingerprint_fields={f"k{i}": "1" for i in range(257)}),
        "device_kind": pb.JoinRequest(island="a", device_kind="H" * 129),
        "hardware": pb.JoinRequest(island="a", hardware="g" * BIG),
        "island_id": pb.HeartbeatRequest(island_id="a" * 97),
        "pending_push_id": pb.HeartbeatRequest(island_id="a-0", pending_push_id=FORGED),
        "quarantined[1].detail": pb.HeartbeatRequest(island_id="a-0", quarantined=[
            pb.DeviceEvidence(detail="fine"), pb.DeviceEvidence(detail=FORGED)]),
        "bad_devices[0]": pb.HeartbeatRequest(island_id="a-0", bad_devices=["d" * 257]),
        "evals: 17 items": pb.HeartbeatRequest(island_id="a-0", evals=[pb.EvalReport()] * 17),
        "push_id": pb.PushHeader(island_id="a-0", push_id="p" * 129),
        "tree_digest": pb.PushHeader(island_id="a-0", tree_digest="t" * BIG),
    }
    for field, request in cases.items():
        problem = request_problem(request)
        assert problem.startswith(field.split(":")[0]), (field, problem)
        assert len(problem) < 300 and not CONTROL_RE.search(problem), problem
    assert "at most 64" in request_problem(cases["island"]) and "at most 128" in request_problem(cases["push_id"])
    assert "control character" in request_problem(cases["pending_push_id"])
    assert "must match" in request_problem(pb.PullRequest(island_id="a b"))
    assert "must match" in request_problem(pb.JoinRequest(island="a/b"))
    assert ISLAND_ID_RE.fullmatch("x" * 64 + "-12.3") and MAX_ISLAND_ID_LEN >= 64 + len("-12.3")
    assert SHOWN < 64


def test_a_real_islands_requests_pass_the_edge(edge_cfg):
    assert request_problem(pb.JoinRequest(island="gpu-a", hardware="gpu", devices=8, fingerprint=edge_cfg.fingerprint(),
                                          fingerprint_fields=edge_cfg.fingerprint_fields(),
                                          device_kind="NVIDIA H100 80GB HBM3")) == ""
    assert request_problem(pb.HeartbeatRequest(
        island_id="gpu-a-0", params_digest="f" * 64, pending_push_id="gpu-a-0-v3-0123456789abcdef",
        bad_devices=["TFRT_CPU_3"], quarantined=[pb.DeviceEvidence(device=3, probe="known_answer",
                                                                   detail="sum 12.5, expected 12.0")])) == ""


# -- the attacks, against a real server ------------------------------------------------------------------------------

def test_megabyte_fields_are_refused_and_leave_the_event_log_and_the_log_small(served, edge_cfg):
    """The issue's flood: ids, names and fingerprints of 3 MiB in Join, Heartbeat, Pull and Push (it wrote ~500 MB to
    events.jsonl in 11 s). Each is refused with INVALID_ARGUMENT naming the field, and what is written stays small."""
    client = CoordinatorClient(served.address, edge_cfg)
    try:
        join = join_island(client, "real")
    finally:
        client.close()
    fields = edge_cfg.fingerprint_fields()
    big = "a" * BIG
    calls = {
        "island": lambda: served.stub.Join(pb.JoinRequest(island=big, hardware="cpu", devices=1,
                                                          fingerprint_fields=fields)),
        "fingerprint_fields": lambda: served.stub.Join(pb.JoinRequest(
            island="x", hardware="cpu", devices=1, fingerprint_fields={**fields, "model.d_model": big})),
        "fingerprint": lambda: served.stub.Join(pb.JoinRequest(island="x", hardware="cpu", devices=1,
                                                               fingerprint=big, fingerprint_fields=fields)),
        "island_id": lambda: served.stub.Heartbeat(pb.HeartbeatRequest(island_id=big)),
        "params_digest": lambda: served.stub.Heartbeat(pb.HeartbeatRequest(island_id=join.island_id,
                                                                           params_digest=big)),
        "PullGlobal: island_id": lambda: list(served.stub.PullGlobal(pb.PullRequest(island_id=big))),
        "header.push_id": lambda: served.stub.PushDelta(iter([pb.PushMessage(header=push_header(join, big))])),
    }
    for _ in range(10):
        for field, call in calls.items():
            e = _refused(call)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.code(), e.details()[:200])
            assert field.split(": ")[-1] in e.details() and "at most" in e.details() and len(e.details()) < 400
    status = served.stub.Status(pb.StatusRequest())
    assert status.refusals["Join: INVALID_ARGUMENT"] == 30 and status.refusals["PushDelta: INVALID_ARGUMENT"] == 10
    assert len(status.SerializeToString()) < 64_000
    assert [i.name for i in status.islands] == ["real"]
    size = (served.run_dir / "events.jsonl").stat().st_size
    assert size < 200_000, size  # ~500 MB before
    assert len(served.text.getvalue()) < 200_000
    for e in read_events(served.run_dir):
        assert len(json.dumps(e)) < 4000, e["event"]


def test_six_joins_with_2_mib_names_leave_status_answering_and_a_new_island_joins(served, edge_cfg, tmp_path):
    """The issue's bloat: 6 Joins with 2 MiB names made Status 12.6 MB (refused over 8 MiB), so `dtrain status`
    failed and a new worker died at start-up, and a restart replayed it from the event log."""
    for i in range(6):
        e = _refused(lambda i=i: served.stub.Join(pb.JoinRequest(island=str(i) * (2 * MIB), hardware="cpu", devices=1,
                                                                 fingerprint_fields=edge_cfg.fingerprint_fields())))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "island: 2,097,152 characters, at most 64" in e.details()
    client = CoordinatorClient(served.address, edge_cfg)
    try:
        status = client.status()
        assert len(status.SerializeToString()) < 32_000 and status.refusals["Join: INVALID_ARGUMENT"] == 6
        assert all(len(f.island_id) <= SHOWN + 40 and len(f.detail) <= MAX_DETAIL + 40 for f in status.faults)
        join = join_island(client, "newcomer")  # a new island is not hurt
        assert join.island_id.startswith("newcomer")
        out = io.StringIO()
        print_status(client.status(), as_json=False, stream=out)
        assert "newcomer" in out.getvalue()
    finally:
        client.close()


def test_a_resumed_history_does_not_reinflate_from_an_old_event_log(tmp_path):
    """Events written before the edge (2 MiB island names, control characters) replayed at --resume: the history
    keeps each island id and detail bounded and escaped, so Status stays small."""
    log = RunLog(tmp_path, quiet=True)
    for i in range(6):
        log.event("request_invalid", method="Join", island=str(i) * (2 * MIB), code="INVALID_ARGUMENT",
                  error=f"island name {str(i) * (2 * MIB)!r}: must match [A-Za-z0-9._-]{{1,64}}")
    log.event("device_quarantined", island="a-0", device=1, probe="stats", step=3, detail=FORGED * 10_000)
    log.event("eval", version=0, loss=1.0, tokens=0, island="e" * MIB)
    log.close()
    history = RunHistory()
    history.replay(tmp_path)
    status = pb.StatusResponse(faults=history.faults, evals=history.evals)
    assert len(status.SerializeToString()) < 16_000
    assert all(not CONTROL_RE.search(f.detail) and not CONTROL_RE.search(f.island_id) for f in history.faults)


def test_control_characters_never_reach_the_log_or_dtrain_status_raw(served, edge_cfg):
    """The issue's forgery: a push_id and an evidence detail holding ESC, NUL and newlines wrote forged lines, raw
    escape sequences and a terminal title into the coordinator's log, and `dtrain status` printed ESC."""
    client = CoordinatorClient(served.address, edge_cfg)
    try:
        join = join_island(client, "victim")
    finally:
        client.close()
    e = _refused(lambda: served.stub.PushDelta(iter([pb.PushMessage(header=push_header(join, FORGED))])))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.push_id: holds a control character" in e.details()
    e = _refused(lambda: served.stub.Heartbeat(pb.HeartbeatRequest(
        island_id=join.island_id, devices=1, quarantined=[pb.DeviceEvidence(device=0, probe="stats", detail=FORGED)])))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "quarantined[0].detail" in e.details()
    e = _refused(lambda: served.stub.Join(pb.JoinRequest(island="evil", hardware="cpu", devices=1,
                                                         fingerprint_fields=edge_cfg.fingerprint_fields(),
                                                         device_kind=FORGED)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    served.service.log.progress(f"a line quoting a client: {FORGED}")  # any line a later change writes: escaped
    text = served.text.getvalue()
    assert "victim" in text and "a line quoting a client: ok\\x00\\n" in text
    assert not CONTROL_RE.search(text.replace("\n", "")), "a raw control character reached the log"
    assert text.count("run finished, all islands healthy") == 1 and "\n[  99.9s] run finished" not in text
    raw = (served.run_dir / "events.jsonl").read_bytes()
    assert b"\x1b" not in raw and b"\x00" not in raw
    # dtrain status: a Status holding what an older coordinator let through prints it escaped, never raw.
    st = served.stub.Status(pb.StatusRequest())
    st.faults.append(pb.FaultRecord(kind="device_quarantined", island_id=FORGED, detail=FORGED))
    st.islands.append(pb.IslandStatus(island_id=FORGED, name=FORGED, state="live", hardware="cpu"))
    st.run_over = FORGED
    out = plain(*sections(st))
    assert not CONTROL_RE.search(out.replace("\n", "")) and "\\x1b]0;pwned\\x07" in out
    assert all("run finished, all islands" not in line or "ok\\x00" in line for line in out.splitlines())
    doc = io.StringIO()
    print_status(st, as_json=True, stream=doc)
    assert not CONTROL_RE.search(doc.getvalue().replace("\n", ""))


# -- secure by default -------------------------------------------------------------------------------------------------

def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "[::]", "10.0.0.5", "coordinator.example.com"))


def test_a_coordinator_beyond_loopback_without_a_token_refuses_to_start_unless_insecure(net_cfg, tmp_path):
    exposed = replace(net_cfg, coordinator={"host": "0.0.0.0"})
    with pytest.raises(ConfigError) as e:
        preflight(exposed, 0)
    message = str(e.value)
    assert "\n" not in message and "coordinator.host 0.0.0.0 listens beyond loopback with no authentication" in message
    assert "--insecure" in message
    with pytest.raises(ConfigError, match="the dashboard's host 0.0.0.0"):  # the dashboard serves Status too
        preflight(replace(net_cfg, coordinator={"dashboard_host": "0.0.0.0"}), 0)
    preflight(net_cfg, 0)  # loopback (tests, dtrain simulate): no token needed
    # --insecure, in so many words: it starts and serves
    args = build_parser().parse_args(["coordinator", "--config", "tiny", "--insecure"])
    assert args.insecure
    insecure = replace(exposed, security={"insecure": True})
    theta, spec = initial_parameters(insecure)
    server, service, port = serve(insecure, tmp_path / "open", theta, spec, port=0, quiet=True)
    try:
        client = CoordinatorClient(f"127.0.0.1:{port}", insecure)
        assert client.status().run_id == service.run_id
        client.close()
    finally:
        server.stop(grace=None).wait()
        service.close()


def test_a_token_or_mutual_tls_lets_it_listen_beyond_loopback(net_cfg, tmp_path, monkeypatch):
    exposed = replace(net_cfg, coordinator={"host": "0.0.0.0"})
    monkeypatch.setenv("DTRAIN_TOKEN", "operator-token")
    token, _, _ = preflight(exposed, 0)
    assert token == "operator-token"


def test_per_island_identity_is_the_default_when_island_tokens_are_given():
    assert load_config("tiny", ["security.island_tokens=tokens"]).security.identity == "token"
    assert load_config("tiny").security.identity == "shared"
    assert load_config("tiny", ["security.island_tokens=t", "security.identity=shared"]).security.identity == "shared"


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_dashboard_needs_the_operator_token_whenever_auth_is_on(net_cfg, tmp_path, monkeypatch):
    """With the islands' own tokens and no operator token it used to answer anyone; now it answers no one (an
    island's token included), and with the operator's token, the operator."""
    tokens = {"a": issue_token()}
    listing = tmp_path / "island-tokens"
    listing.write_text("".join(hash_line(n, t) + "\n" for n, t in tokens.items()))
    cfg = replace(net_cfg, security={"identity": "token", "island_tokens": str(listing)})
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    theta, spec = initial_parameters(cfg)
    server, service, _ = serve(cfg, tmp_path / "locked", theta, spec, port=0, quiet=True)
    try:
        assert service.dashboard is not None
        url = f"{service.dashboard.url}api/status"
        for token in (None, tokens["a"]):
            code, body = _get(url, token)
            assert code == 401 and b"no operator token set while auth is on" in body
    finally:
        server.stop(grace=None).wait()
        service.close()
    monkeypatch.setenv("DTRAIN_TOKEN", "operator-token")
    server, service, _ = serve(cfg, tmp_path / "operated", theta, spec, port=0, quiet=True)
    try:
        assert service.dashboard is not None
        url = f"{service.dashboard.url}api/status"
        assert _get(url, tokens["a"])[0] == 401
        code, body = _get(url, "operator-token")
        assert code == 200 and json.loads(body)["run_id"] == service.run_id
    finally:
        server.stop(grace=None).wait()
        service.close()


def test_status_stays_small_whatever_the_islands_reported():
    """Each island's quarantine evidence is bounded in Status (an island of a large mesh may report thousands of
    devices with 512-character details); the rounds, evals and faults are capped by the history."""
    from coordinator.records import DeviceEvidence
    from coordinator.status_view import MAX_STATUS_EVIDENCE, Counters, status_response
    from state_helpers import T0, join_all, make

    st = make()
    ids = join_all(st)
    for island_id in ids:
        st.islands[island_id].quarantined = [DeviceEvidence(device=d, index=d, probe="stats", step=1, detail="x" * 512)
                                             for d in range(4096)]
    history = RunHistory()
    for _ in range(10_000):
        history.observe({"event": "request_invalid", "t": T0, "island": "i" * 96, "error": "e" * 5000})
    msg = status_response(st, history, st.opts, Counters(), run_id="r", params_digest="d", started_at=T0, now=T0)
    assert all(len(i.quarantined) == MAX_STATUS_EVIDENCE for i in msg.islands) and len(msg.faults) == 100
    assert len(msg.SerializeToString()) < 1 << 20
