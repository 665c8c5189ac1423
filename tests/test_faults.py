"""Fault injection for `dtrain simulate`: the --fault grammar, the link proxy, and a chaos run with real
processes and real signals."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from dtrain.config import ConfigError, load_config
from dtrain.runlog import read_events
from dtrain_cli.faults import LinkProxy, parse_fault
from dtrain_cli.main import main
from dtrain_cli.simulate import run_simulation

ROOT = Path(__file__).resolve().parent.parent
NO_FAKE_DEVICES = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def test_parse_fault_specs() -> None:
    f = parse_fault("kill:island-1@v3+10s", 4)
    assert (f.kind, f.target, f.at_version, f.at_s, f.duration_s) == ("kill", "island-1", 3, None, 10.0)
    f = parse_fault("hang:island-0@20s+30s", 2)
    assert (f.kind, f.at_version, f.at_s, f.duration_s) == ("hang", None, 20.0, 30.0)
    f = parse_fault("kill-coordinator@v5+3s", 2)
    assert (f.kind, f.target) == ("kill-coordinator", "coordinator")
    f = parse_fault("slow:island-1@1.5s+2s,delay=250", 2)
    assert (f.kind, f.delay_ms, f.at_s) == ("slow", 250.0, 1.5)
    assert parse_fault("kill:island-1@v2", 2).duration_s is None  # killed for good


@pytest.mark.parametrize("text, why", [
    ("explode:island-0@v1", "unknown kind 'explode'"),
    ("kill:island-7@v1", "'island-7' is not an island of this run"),
    ("hang:island-0@v1", "hang needs a duration"),
    ("kill-coordinator:island-0@v1", "takes no target"),
    ("kill:island-0@v1,delay=5", "unknown option(s) delay"),
    ("kill:island-0", "expected KIND[:ISLAND]@"),
])
def test_parse_fault_rejects_bad_specs(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(text, 2)
    assert why in str(e.value)


def test_cli_refuses_a_bad_fault_before_starting(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["simulate", "--config", "tiny", "--set", f"run.out_dir={tmp_path}", "--fault", "kill:island-5@v1"])
    assert rc == 2
    assert "island-5" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


class _Echo:
    """A loopback echo server for the proxy tests."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)


def _roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_link_proxy_passes_cuts_slows_and_restores() -> None:
    echo = _Echo()
    proxy = LinkProxy(echo.port)
    try:
        assert _roundtrip(proxy.port) == b"ping"
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as open_conn:
            open_conn.sendall(b"a")
            assert open_conn.recv(16) == b"a"
            proxy.cut()  # an open connection is dropped ...
            open_conn.settimeout(5)
            assert open_conn.recv(16) == b""
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:  # ... and new ones refused
            s.settimeout(5)
            try:
                s.sendall(b"x")
                got = s.recv(16)
            except OSError:
                got = b""
            assert got == b""
        proxy.slow(0.3)
        t0 = time.perf_counter()
        assert _roundtrip(proxy.port) == b"ping"
        assert time.perf_counter() - t0 >= 0.6  # held 0.3 s each way
        proxy.restore()
        assert _roundtrip(proxy.port) == b"ping"
    finally:
        proxy.close()
        echo.server.close()


@pytest.mark.slow
def test_chaos_run_with_real_processes(tmp_path: Path) -> None:
    """An island SIGKILLed and restarted, one hung (SIGSTOP) past its lease, the coordinator SIGKILLed and
    resumed, a link cut: every fault is an event with its recovery, the run finishes, survivors agree."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=80", "outer.inner_steps=10",
        "worker.heartbeat_s=0.5", "coordinator.lease_s=3", "coordinator.grace_s=60"])
    faults = [parse_fault(t, 2) for t in ("kill:island-1@v1+1s", "hang:island-0@v2+5s",
                                          "kill-coordinator@v4+1s", "cut:island-1@v5+1s")]
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=600, faults=faults)
    assert s["bit_identical_final_params"]
    _assert_every_sequence_once(Path(s["run_dir"]), 2, cfg.train.steps * cfg.train.batch_size)
    assert s["rounds"] >= cfg.rounds and not s["unfinished_islands"]
    by_fault = {f["fault"]: f for f in s["faults"]}
    assert set(by_fault) == {f.text for f in faults}
    for f in s["faults"]:
        assert f["recovered_t"] is not None and f["recovered_t"] >= f["injected_t"], f
    assert by_fault["hang:island-0@v2+5s"]["detected_by"] == "island_lost"  # hung past its 3 s lease
    assert by_fault["kill-coordinator@v4+1s"]["detected_by"] in ("retry", "heartbeat_failed")
    driver = [e["event"] for e in read_events(Path(s["run_dir"]) / "driver")]
    assert driver.count("fault_injected") == driver.count("fault_recovered") == len(faults)
    coordinator = [e["event"] for e in read_events(s["run_dir"])]
    assert "coordinator_resumed" in coordinator


def _merged_ranges(run_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """Every (shard, [start, end)) that went into a merged version, from the coordinator's round_merged events;
    a coordinator resumed at version V drops the merges logged before it past V (θ was rolled back)."""
    merged: list[tuple[int, int, int, int]] = []  # (version, shard, start, end)
    for e in read_events(run_dir):
        if e["event"] == "coordinator_resumed":
            merged = [m for m in merged if m[0] <= e["version"]]
        elif e["event"] == "round_merged":
            merged += [(e["version"], p["shard"], p["start"], p["end"]) for p in e["pushes"]]
    out: dict[int, list[tuple[int, int]]] = {}
    for _, shard, start, end in merged:
        out.setdefault(shard, []).append((start, end))
    return {s: sorted(r) for s, r in out.items()}


def _assert_every_sequence_once(run_dir: Path, shards: int, shard_end: int) -> None:
    ranges = _merged_ranges(run_dir)
    assert sorted(ranges) == list(range(shards)), ranges
    for shard, rs in ranges.items():
        cursor = 0
        for start, end in rs:
            assert start == cursor, f"shard {shard}: {'gap' if start > cursor else 'overlap'} at {cursor}: {rs}"
            cursor = end
        assert cursor == shard_end, (shard, rs)


def test_a_killed_islands_shard_is_finished_by_a_survivor(tmp_path: Path) -> None:
    """island-1 is SIGKILLed after version 1 and never comes back: once a survivor's own shard is done it takes
    over island-1's shard from its merged cursor, so the run trains every sequence of every shard exactly once
    (a version more than without the fault per round of that shard left) and the survivors end on the same θ."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", "outer.islands=3"])
    s = run_simulation(cfg, 3, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("kill:island-1@v1", 3)])
    assert s["bit_identical_final_params"]
    _assert_every_sequence_once(Path(s["run_dir"]), 3, cfg.train.steps * cfg.train.batch_size)
    joins = [e for e in read_events(s["run_dir"]) if e["event"] == "island_joined"]
    (shard,) = [e["shard"] for e in joins if e["name"] == "island-1"]  # joined once, then killed for good
    taken = [e for e in joins if e["shard"] == shard and e["name"] != "island-1"]
    assert len(taken) == 1 and f"took over shard {shard}" in taken[0]["reason"], joins
    left = (cfg.train.steps * cfg.train.batch_size - taken[0]["cursor"]) // (cfg.outer.inner_steps * 8)
    assert left >= 1 and s["rounds"] == cfg.rounds + left  # the shard's rounds left, trained by the survivor
