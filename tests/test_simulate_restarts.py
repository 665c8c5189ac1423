"""`dtrain simulate` with real processes, killed and restarted: a killed worker rejoins its shard, a SIGKILLed one
is reported lost, the driver's faults fire and schedule their recovery, and each restart is timed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtrain.config.load import load_config
from dtrain.runlog import read_events
from simulate_helpers import NO_FAKE_DEVICES
from simulate_helpers import process_cfg as _cfg

ROOT = Path(__file__).resolve().parent.parent


class _Processes:
    """A ``dtrain coordinator`` and ``dtrain worker`` processes on loopback, for the tests that kill a worker
    themselves: the config written to ``out``, the coordinator started, its address read once it listens."""

    def __init__(self, cfg, out: Path, timeout_s: float):
        import subprocess
        import sys
        import time

        from dtrain.config.load import to_toml

        self.out, self.deadline = out, time.time() + timeout_s
        out.mkdir()
        (out / "config.toml").write_text(to_toml(cfg))
        self.env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
        self.cli = [sys.executable, "-m", "dtrain_cli"]
        self.conf = ["--config", str(out / "config.toml"), "--quiet"]
        self.coord = subprocess.Popen(self.cli + ["coordinator", *self.conf, "--port", "0", "--run-dir", str(out)],
                                      env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.workers: dict[str, subprocess.Popen] = {}
        try:
            while not (out / "coordinator.json").exists():
                self._in_time()
                time.sleep(0.1)
        except BaseException:
            self.kill()
            raise
        self.address = f"127.0.0.1:{json.loads((out / 'coordinator.json').read_text())['port']}"

    def _in_time(self) -> None:
        import time

        assert time.time() < self.deadline and self.coord.poll() is None

    def start(self, name: str):
        import subprocess

        self.workers[name] = subprocess.Popen(
            self.cli + ["worker", *self.conf, "--coordinator", self.address, "--island", name,
                        "--run-dir", str(self.out / "islands" / name)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self.workers[name]

    def wait_merged(self, versions: int) -> None:
        """Until the coordinator has merged ``versions`` versions."""
        import time

        while sum(1 for e in read_events(self.out) if e["event"] == "round_merged") < versions:
            self._in_time()
            time.sleep(0.05)

    def kill(self) -> None:
        for p in [self.coord, *self.workers.values()]:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_a_killed_worker_restarts_rejoins_its_shard_and_no_token_is_merged_twice(tmp_path):
    import signal

    cfg = _cfg(tmp_path, "model.d_model=96", "model.n_layers=2", "model.seq_len=64", "train.batch_size=16",
               "train.steps=200", "outer.inner_steps=20", "coordinator.lease_s=30")
    out = tmp_path / "run"
    run = _Processes(cfg, out, timeout_s=120)
    try:
        workers = {n: run.start(n) for n in ("a", "b")}
        run.wait_merged(2)
        workers["b"].send_signal(signal.SIGKILL)  # mid-run, without warning
        workers["b"].wait()
        merged_at_kill = sum(1 for e in read_events(out) if e["event"] == "round_merged")
        workers["b"] = run.start("b")  # the same island comes back
        for p in workers.values():
            assert p.wait(timeout=240) == 0
        assert run.coord.wait(timeout=60) == 0
    finally:
        run.kill()
    assert merged_at_kill < cfg.rounds  # the kill landed mid-run
    events = read_events(out)
    joins = [e for e in events if e["event"] == "island_joined" and e["name"] == "b"]
    assert len(joins) == 2 and "rejoined" in joins[1]["reason"] and joins[0]["shard"] == joins[1]["shard"]
    assert joins[1]["cursor"] > 0  # it resumed where its merged (or pending) data ended
    stopped = next(e for e in events if e["event"] == "coordinator_stopped")
    assert stopped["version"] == cfg.rounds
    # Exactly-once: every island's shard was merged in full, once.
    assert stopped["tokens_merged"] == 2 * cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len
    summaries = [json.loads((out / "islands" / n / "summary.json").read_text()) for n in ("a", "b")]
    assert summaries[0]["params_digest"] == summaries[1]["params_digest"] == stopped["params_digest"]
    # Both starts of b timed phase by phase; the restart loaded its programs from the cache the first filled
    # (worker.compile_cache's default: the island's folder), compiling none.
    first, again = [e for e in read_events(out / "islands" / "b") if e["event"] == "island_startup"]
    cache = out / "islands" / "b" / "compile-cache"
    assert first["compile_cache"] == again["compile_cache"] == str(cache) and any(cache.iterdir())
    assert first["cache_misses"] > 0 and again["cache_hits"] > 0 and again["cache_misses"] == 0
    assert list(again["phases"]) == ["imports", "devices", "check", "data", "compile", "join", "pull", "peers",
                                     "first_step"]
    assert again["cursor"] > joins[1]["cursor"]  # its first step: past where it rejoined
    # The restart restored its optimizer moments from the checkpoint the killed process saved at its last push
    # (into the state's shapes and shardings, no fresh state made first)
    b_events = read_events(out / "islands" / "b")
    restored = [e for e in b_events if e["event"] == "island_restored"]
    assert len(restored) == 1 and restored[0]["step"] > 0 and restored[0]["t"] < again["t"]


@pytest.mark.slow
def test_a_sigkilled_worker_is_reported_lost_within_5s_with_the_default_config(tmp_path):
    """Default heartbeats and lease (1 s, 4 s): a worker process SIGKILLed mid-run is reported lost by the
    coordinator within 5 s, the sync round goes on without it (no 30 s grace, no old 20 s lease), and the run
    still finishes with exit status 0 everywhere."""
    import signal
    import time

    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=300", "outer.inner_steps=20"])
    assert (cfg.coordinator.lease_s, cfg.worker.heartbeat_s) == (4.0, 1.0)  # the defaults
    out = tmp_path / "run"
    run = _Processes(cfg, out, timeout_s=180)
    try:
        workers = {n: run.start(n) for n in ("a", "b")}
        run.wait_merged(2)
        killed_at = time.time()
        workers["b"].send_signal(signal.SIGKILL)
        workers["b"].wait()
        lost: list[dict] = []
        while not lost:
            assert time.time() < killed_at + 30, "the killed island was never reported lost"
            time.sleep(0.05)
            lost = [e for e in read_events(out) if e["event"] == "island_lost"]
        assert workers["a"].wait(timeout=240) == 0
        assert run.coord.wait(timeout=60) == 0
    finally:
        run.kill()
    assert len(lost) == 1 and lost[0]["island"] == "b"
    assert lost[0]["t"] - killed_at <= 5.0, lost[0]["t"] - killed_at
    events = read_events(out)
    after = [e for e in events if e["event"] == "round_merged" and e["t"] > killed_at]
    assert after and after[0]["t"] - killed_at <= 10.0  # the open round closed without waiting for a grace
    # The survivor finished b's shard too (b never came back): every sequence of both shards merged once, in
    # more versions than the fault-free cfg.rounds.
    from dtrain.audit import AuditParams, audit

    checked = audit(events, {n: read_events(out / "islands" / n) for n in ("a", "b")}, AuditParams.from_config(cfg))
    assert checked.lost_tokens == 0 and checked.doubled_tokens == 0, checked.to_dict()
    assert [e["version"] for e in events if e["event"] == "round_merged"][-1] > cfg.rounds


def test_the_drivers_faults_fire_and_schedule_their_recovery(tmp_path):
    """The driver's fault firing without a run (islands of sleeping processes): a kill with a duration SIGKILLs the
    island and schedules its restart, one without makes it gone; a hang SIGSTOPs it until its recovery SIGCONTs
    it; each is a fired record and a fault_injected event, and a recovery a fault_recovered one."""
    import signal
    import subprocess
    import sys

    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate_processes import Simulation

    faults = [parse_fault(t, 3) for t in ("kill:island-0@v1+5s", "kill:island-1@v1", "hang:island-2@v2+5s")]
    sim = Simulation(_cfg(tmp_path), tmp_path, 3, True, dict(os.environ), False, faults)
    restarted = []
    sim._start_worker = restarted.append  # a restart recorded, nothing started
    try:
        sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
        sim.workers = {n: [subprocess.Popen(sleep)] for n in sim.names}
        for f in faults:
            sim._inject(f, 2)
        assert [p.poll() for p in sim.workers["island-0"] + sim.workers["island-1"]] == [-signal.SIGKILL] * 2
        assert sim.gone == {"island-1"} and len(sim.recoveries) == 2  # island-1's kill has no restart
        assert [(r["fault"], r["version"], r["recovered_t"]) for r in sim.fired] == \
            [(f.text, 2, None) for f in faults]
        for _, action in sim.recoveries:
            action()
        assert restarted == ["island-0"]
        assert [(r["fault"], r.get("recovery")) for r in sim.fired] == [
            ("kill:island-0@v1+5s", "restarted"), ("kill:island-1@v1", None),
            ("hang:island-2@v2+5s", "resumed (SIGCONT)")]
        assert sim._running("island-2")  # stopped, then continued: it runs on
        events = read_events(tmp_path / "driver")
        assert [e["fault"] for e in events if e["event"] == "fault_injected"] == [f.text for f in faults]
        assert [e["action"] for e in events if e["event"] == "fault_recovered"] == ["restarted", "resumed (SIGCONT)"]
    finally:
        sim.stop_all()


def test_a_kill_with_0s_restarts_the_island_at_once(tmp_path):
    """``+0s``: the island is restarted on the driver's next pass (a supervisor restarting a crashed process), not
    taken for gone (no duration) and not after a delay."""
    import signal
    import subprocess
    import sys
    import time

    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate_processes import Simulation

    fault = parse_fault("kill:island-1@v1+0s", 2)
    sim = Simulation(_cfg(tmp_path), tmp_path, 2, True, dict(os.environ), False, [fault])
    try:
        sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
        sim.workers = {n: [subprocess.Popen(sleep)] for n in sim.names}
        sim._inject(fault, 1)
        assert sim.workers["island-1"][0].poll() == -signal.SIGKILL
        assert sim.gone == set() and len(sim.recoveries) == 1
        due, _ = sim.recoveries[0]
        assert due <= time.perf_counter()  # due now: the supervising pass that fired it restarts it
    finally:
        sim.stop_all()


def test_restarts_time_each_kill_to_the_first_step_of_the_start_that_followed_it():
    from dtrain_cli.simulate_report import restarts

    def kill(t: float, recovered: float | None, target: str = "island-1") -> dict:
        return {"fault": f"kill:{target}@v1+2s", "kind": "kill", "target": target, "injected_t": t,
                "recovered_t": recovered}

    def start(t: float) -> dict:
        return {"event": "island_startup", "t": t, "phases": {"compile": 1.0}, "cpu_s": {"compile": 0.5},
                "cache_hits": 3, "cache_misses": 0}

    fired = [kill(100.0, 102.0), {"fault": "hang:island-1@v2+8s", "kind": "hang", "target": "island-1",
                                  "injected_t": 110.0, "recovered_t": 118.0},
             kill(200.0, 202.0), kill(300.0, 302.0), kill(400.0, None, "island-2")]
    # island-1: its first start, the first restart's step, none after the second kill (killed again at 300
    # before its step at 310, which is the third restart's)
    events = {"island-1": [start(50.0), {"event": "trained", "t": 105.0}, start(106.5), start(310.0)],
              "island-2": [start(60.0)]}
    out = restarts(fired, events)
    assert [(r["killed_t"], r["restart_s"]) for r in out] == [(100.0, 6.5), (200.0, None), (300.0, 10.0)]
    assert out[0]["phases"] == {"compile": 1.0} and out[0]["cpu_s"] == {"compile": 0.5}
    assert out[0]["cache_hits"] == 3 and out[1]["phases"] is None  # a kill with no restart (island-2) is none
