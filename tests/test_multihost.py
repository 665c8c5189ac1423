"""Multi-host islands: one island made of two ``dtrain worker`` processes (one ``jax.distributed`` job over CPU
collectives, 2 fake devices each) beside a single-process island, both merged by one real coordinator on
127.0.0.1:0. The coordinator sees two islands, one of them with 4 devices; every process ends on the coordinator's
final θ, bit for bit. Slow: both processes of an island SIGKILLed mid-run and restarted from the island's orbax
checkpoint; the coordinator rewinding a two-process island (a refused push, a rejoin after a hang), both processes
alike. And the pure resolution of the flags and the environment into the island's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from conftest import TINY, initial_parameters
from coordinator.app import serve
from dtrain.audit import AuditParams, audit
from dtrain.checkpoint import Checkpointer
from dtrain.config.load import load_config, to_toml
from dtrain.config.sections import ConfigError
from dtrain.models import model
from dtrain.runlog import process_dir, read_events
from dtrain.steps.inner import make_mesh
from dtrain.train.loop import InnerLoop
from dtrain_cli.simulate_processes import free_port, island_process_flags
from simulate_helpers import NO_FAKE_DEVICES
from workers.app import open_worker
from workers.exchange import WorkerError
from workers.hosts import AUTO, HostGroup, Processes, resolve_processes


class Cluster:
    """A tiny run for real: its coordinator in this process (serve() on 127.0.0.1:0; coordinator.checkpoint=false,
    since orbax's async checkpointing does not bear two checkpoint managers at work in one process) and its islands
    as ``dtrain worker`` processes, each named here ``ISLAND`` (one process) or ``ISLAND-I`` (process I of an island
    of two processes; one ``jax.distributed`` job per island, on a port that stays the island's across restarts).
    Every process's output goes to ``TMP/NAME.log`` (appended by a restart)."""

    def __init__(self, tmp: Path, overrides: Sequence[str] = ()):
        self.tmp = tmp
        self.cfg = load_config(TINY, [
            f"run.out_dir={tmp}", "coordinator.port=0", "coordinator.checkpoint=false", "outer.islands=2",
            "train.steps=40", "outer.inner_steps=20", "worker.heartbeat_s=0.5", "worker.retry_total_s=30",
            "worker.start_wait_s=60", *overrides])
        theta, spec = initial_parameters(self.cfg)
        self.server, self.service, port = serve(self.cfg, tmp / "coordinator", theta, spec, port=0, quiet=True)
        (tmp / "config.toml").write_text(to_toml(self.cfg))
        self.env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
        self.base = [sys.executable, "-m", "dtrain_cli", "worker", "--config", str(tmp / "config.toml"),
                     "--host-devices", "2", "--coordinator", f"127.0.0.1:{port}", "--quiet"]
        self.jax_ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, *names: str, extra: Sequence[str] = ()) -> None:
        """Starts each process ``names`` names (again, if it ran before), with ``extra`` arguments."""
        for name in names:
            island, _, index = name.partition("-")
            cmd = [*self.base, "--island", island, "--run-dir", str(self.tmp / island), *extra]
            if index:  # the same launch as dtrain simulate --island-processes 2
                port = self.jax_ports.setdefault(island, free_port())
                cmd += island_process_flags(2, int(index), f"127.0.0.1:{port}")
            with open(self.tmp / f"{name}.log", "ab") as out:
                self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def wait(self, timeout_s: float = 240.0) -> None:
        """Waits for every process started to exit; each must exit 0."""
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"worker {name} exited {rc}: {self.output(name)[-3000:]}"

    def until(self, what: str, ready: Callable[[], bool], timeout_s: float = 180.0) -> None:
        """Polls ``ready()`` until it holds; fails naming ``what`` if it does not within ``timeout_s`` or a process
        exits first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            ended = {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}
            assert not ended, f"waiting for {what}: worker(s) exited first: {ended}"
            assert time.monotonic() < deadline, f"waiting for {what}: not within {timeout_s:g}s"
            time.sleep(0.05)

    def run_dir(self, name: str) -> Path:
        """Where process ``name`` writes its events and summary (process 0's: the island's run folder)."""
        island, _, index = name.partition("-")
        return process_dir(self.tmp / island, int(index or 0))

    def events(self, name: str) -> list[dict[str, Any]]:
        """Process ``name``'s events so far (none before it wrote one)."""
        if not (self.run_dir(name) / "events.jsonl").exists():
            return []
        return read_events(self.run_dir(name), skip_torn=True)  # a killed process may have torn its last line

    def summary(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.run_dir(name) / "summary.json").read_text())
        return result

    def close(self) -> None:
        """Kills what still runs (a failed test), stops the coordinator."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.server.stop(grace=None).wait()
        self.service.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cluster = Cluster(tmp_path_factory.mktemp("multihost"))
    out: dict[str, Any] = {}
    try:
        cluster.start("single", "multi-0", "multi-1")
        cluster.wait()
        out["islands"] = {i.name: i for i in cluster.service.state.islands.values()}
        out["digest"] = cluster.service.merger.digest
        out["version"] = cluster.service.state.version
    finally:
        cluster.close()
    out["summaries"] = {name: cluster.summary(name) for name in ("single", "multi-0", "multi-1")}
    out["events"] = {name: cluster.events(name) for name in ("multi-0", "multi-1")}
    out["tmp"], out["cfg"] = cluster.tmp, cluster.cfg
    return out


@pytest.mark.slow
def test_one_coordinator_merges_a_two_process_island_and_a_single_one(run: dict[str, Any]) -> None:
    islands = run["islands"]
    assert sorted(islands) == ["multi", "single"]  # the two processes joined as one island
    assert islands["multi"].devices == 4 and islands["single"].devices == 2
    assert run["version"] >= 2
    for name, summary in run["summaries"].items():
        assert summary["version"] == run["version"], name
        assert summary["params_digest"] == run["digest"], name  # bit-identical to the coordinator's θ
    multi0, multi1 = run["summaries"]["multi-0"], run["summaries"]["multi-1"]
    assert multi0["devices"] == multi1["devices"] == 4
    assert (multi0["steps"], multi0["cursor"], multi0["rounds"]) == (multi1["steps"], multi1["cursor"],
                                                                     multi1["rounds"])
    assert multi0["final_eval_loss"] == multi1["final_eval_loss"]  # one eval over the island's 4 devices
    assert multi0["bytes_up"] > 0 and multi1["bytes_up"] == 0  # only process 0 talks to the coordinator
    # both processes ran the same chunks (lockstep) and wrote one orbax checkpoint folder
    trained = [[(e["steps"], e["cursor"]) for e in run["events"][p] if e["event"] == "trained"]
               for p in ("multi-0", "multi-1")]
    assert trained[0] == trained[1] and trained[0]
    assert any((run["tmp"] / "multi" / "checkpoints").iterdir())


@pytest.mark.slow
def test_the_two_process_checkpoint_restores_whole(run: dict[str, Any]) -> None:
    """Both processes wrote their shards of one orbax checkpoint (the state at the last push): it restores whole,
    here into one process's 8-device mesh."""
    cfg = run["cfg"]
    folder = run["tmp"] / "multi" / "checkpoints"
    assert sorted(p.name for p in (folder / "40" / "state").glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                                        "ocdbt.process_1"]
    built = model.build(cfg.model)
    loop = InnerLoop(cfg, built, make_mesh(cfg))
    fresh = loop.init_state(built.init(cfg.run.seed))
    ckpt = Checkpointer(folder, keep=1)
    try:
        step, restored, meta = ckpt.restore(fresh)
    finally:
        ckpt.close()
    assert (step, meta["steps"], meta["cursor"], meta["version"]) == (40, 40, 320, 1)
    assert int(restored.step) == 40
    leaves = jax.tree.leaves(jax.device_get(restored.params))
    assert all(np.isfinite(x).all() for x in leaves)
    assert any(not np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(jax.device_get(fresh.params)),
                                                        strict=True))


def _checkpoints(folder: Path) -> list[int]:
    """The finished steps of an island's orbax checkpoint folder (a save in flight is a temporary folder)."""
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _incarnations(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A process's events split where a new process of it started (its ``island_started``)."""
    out: list[list[dict[str, Any]]] = [[]]
    for e in events:
        if e["event"] == "island_started" and any(x["event"] == "island_started" for x in out[-1]):
            out.append([])
        out[-1].append(e)
    return out


def _trained(events: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """The chunks one process ran, as (steps, shard, cursor after it)."""
    return [(e["steps"], e["shard"], e["cursor"]) for e in events if e["event"] == "trained"]


def _assert_every_sequence_once(cluster: Cluster, islands: Sequence[str]) -> None:
    """Every sequence of every shard went into exactly one merged version (the coordinator's round_merged
    ranges, :func:`dtrain.audit.audit`)."""
    a = audit(read_events(cluster.tmp / "coordinator"), {name: cluster.events(name) for name in islands},
              AuditParams.from_config(cluster.cfg))
    assert (a.lost_tokens, a.doubled_tokens, a.gaps, a.overlaps, a.missing_versions) == (0, 0, (), (), ()), a


@pytest.mark.slow
def test_a_two_process_island_killed_mid_run_restarts_from_its_checkpoint(tmp_path: Path) -> None:
    """Both processes of an island SIGKILLed once its first checkpoint is written, then started again on the same
    run folder: both restore the same checkpoint and start from the same cursor, the coordinator takes the island
    back under its name, the run completes with every sequence merged exactly once, and every process ends on the
    coordinator's final θ."""
    cluster = Cluster(tmp_path, ["outer.islands=1", "train.steps=100", "outer.inner_steps=10"])
    folder = tmp_path / "multi" / "checkpoints"
    try:
        cluster.start("multi-0", "multi-1")
        cluster.until("the island's first checkpoint", lambda: bool(_checkpoints(folder)))
        for name in ("multi-0", "multi-1"):
            cluster.procs[name].kill()  # SIGKILL: no clean-up, a save or a push may be in flight
        for name in ("multi-0", "multi-1"):
            cluster.procs[name].wait()
        saved = _checkpoints(folder)[-1]
        killed_at = cluster.service.state.version
        assert killed_at < cluster.cfg.rounds, "killed mid-run"
        cluster.start("multi-0", "multi-1")
        cluster.wait()
        islands = list(cluster.service.state.islands.values())
        digest, version = cluster.service.merger.digest, cluster.service.state.version
    finally:
        cluster.close()
    assert [i.name for i in islands] == ["multi"] and islands[0].devices == 4  # rejoined, not a new island
    joins = [e for e in read_events(tmp_path / "coordinator") if e["event"] == "island_joined"]
    assert [(e["island"], e["island_id"]) for e in joins] == [("multi", islands[0].island_id)] * 2
    assert joins[1]["reason"].startswith("rejoined as multi"), joins[1]
    assert version == cluster.cfg.rounds > killed_at
    for name in ("multi-0", "multi-1"):
        events = cluster.events(name)
        (restored,) = [e for e in events if e["event"] == "island_restored"]  # the restarted process (logged first)
        assert restored["step"] == saved, (name, restored, saved)  # the checkpoint the killed processes left
        # the restarted process starts where the coordinator's merged data of the shard ends
        assert [e["cursor"] for e in events if e["event"] == "island_started"] == [0, joins[1]["cursor"]], name
        assert joins[1]["cursor"] > 0
        summary = cluster.summary(name)
        assert (summary["version"], summary["params_digest"]) == (version, digest), name
    # lockstep: before the kill one process may have run a chunk more than the other; after it, the same chunks
    (before, after) = zip(*(map(_trained, _incarnations(cluster.events(name))) for name in ("multi-0", "multi-1")),
                          strict=True)
    shorter, longer = sorted(before, key=len)
    assert shorter and longer[:len(shorter)] == shorter
    assert after[0] == after[1] and after[0][0][2] > joins[1]["cursor"]
    assert cluster.summary("multi-0")["cursor"] == cluster.summary("multi-1")["cursor"] == \
        cluster.cfg.train.steps * cluster.cfg.train.batch_size
    _assert_every_sequence_once(cluster, ["multi"])


def _rewinds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A process's rewind decisions (moved or kept), without their times."""
    return [{k: v for k, v in e.items() if k not in ("t", "elapsed_s")} for e in events
            if e["event"] in ("rewound", "rewind_kept")]


@pytest.mark.slow
def test_a_two_process_island_rewinds_in_lockstep(tmp_path: Path) -> None:
    """The coordinator rewinds a two-process island twice: (1) it refuses the island's push (process 0 sends a
    frame with a NaN: ``--inject nan@v1``), so the island trains that range again; (2) both processes hang
    (SIGSTOP) until the coordinator has declared the island lost and the single-process island, done with its own
    shard, has taken the lost island's over; woken, the island's heartbeat is told to rejoin and its Join moves it
    to the other shard. Both processes apply each rewind alike (the same rewinds, the same chunks at the same
    cursors), the run trains every sequence exactly once, and every process ends on the coordinator's final θ."""
    cluster = Cluster(tmp_path, ["train.steps=60", "outer.inner_steps=10", "coordinator.lease_s=2"])
    coordinator = tmp_path / "coordinator"
    multi = ("multi-0", "multi-1")
    try:
        cluster.start("single")
        cluster.start(*multi, extra=["--inject", "nan@v1"])  # every process gets it; process 0 pushes
        cluster.until("the refused push's rewind", lambda: any(e["event"] == "rewound"
                                                               for e in cluster.events("multi-0")))
        for name in multi:
            os.kill(cluster.procs[name].pid, signal.SIGSTOP)
        try:
            cluster.until("the single island taking over the lost island's shard", lambda: any(
                e["event"] == "island_joined" and e["name"] == "single" and "took over shard" in e["reason"]
                for e in read_events(coordinator)))
        finally:
            for name in multi:
                os.kill(cluster.procs[name].pid, signal.SIGCONT)
        cluster.wait()
        islands = {i.name: i for i in cluster.service.state.islands.values()}
        digest, version = cluster.service.merger.digest, cluster.service.state.version
    finally:
        cluster.close()
    assert sorted(islands) == ["multi", "single"]
    coordinator_events = read_events(coordinator)
    refused = [e for e in coordinator_events if e["event"] == "push_refused"]
    assert len(refused) == 1 and refused[0]["island"] == "multi", refused  # its name; the id beside it
    assert refused[0]["island_id"] == islands["multi"].island_id, refused
    assert any(e["event"] == "island_lost" and e["island"] == "multi" for e in coordinator_events)
    events = {name: cluster.events(name) for name in multi}
    assert any(e["event"] == "push_refused" for e in events["multi-0"])  # process 0 sent it
    assert any(e["event"] == "rejoin" for e in events["multi-0"])  # the heartbeat's answer after the hang
    rewinds = [_rewinds(events[name]) for name in multi]
    assert rewinds[0] == rewinds[1], rewinds  # the same decisions on both processes
    moves = [e for e in rewinds[0] if e["event"] == "rewound"]
    assert "PUSH_STATUS_REJECTED" in moves[0]["reason"] and moves[0]["retrained_steps"] > 0, moves
    assert any(e["to_shard"] != e["from_shard"] for e in moves[1:]), moves  # moved by the rejoin's Join
    assert _trained(events["multi-0"]) == _trained(events["multi-1"])  # lockstep through both rewinds
    for name in ("single", *multi):
        summary = cluster.summary(name)
        assert (summary["version"], summary["params_digest"]) == (version, digest), name
    _assert_every_sequence_once(cluster, ["single", "multi"])


def test_resolve_processes_flags_and_environment() -> None:
    assert resolve_processes(None, None, None, {}) == Processes(1, 0, "", "flags")
    # flags
    assert resolve_processes(2, 1, "10.0.0.1:8476", {}) == Processes(2, 1, "10.0.0.1:8476", "flags")
    # DTRAIN_* and a JobSet's index
    env = {"DTRAIN_NUM_PROCESSES": "4", "JOB_COMPLETION_INDEX": "3", "DTRAIN_JAX_COORDINATOR": "w-0.w:8476"}
    assert resolve_processes(None, None, None, env) == Processes(4, 3, "w-0.w:8476", "environment")
    assert resolve_processes(None, None, None, {**env, "DTRAIN_PROCESS_ID": "2"}).index == 2
    # explicit flags win
    assert resolve_processes(None, 0, "h:1", env) == Processes(4, 0, "h:1", "environment")
    assert resolve_processes(1, None, None, {**env, "JOB_COMPLETION_INDEX": "0"}) == Processes(1, 0, "", "flags")
    # an indexed Job of single-process islands: the index alone is no island of several processes
    assert resolve_processes(None, None, None, {"JOB_COMPLETION_INDEX": "0"}).count == 1
    # SLURM and a TPU slice: JAX finds the coordinator
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert resolve_processes(None, None, None, slurm) == Processes(2, 1, AUTO, "environment")
    tpu = {"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "2"}
    assert resolve_processes(None, None, None, tpu) == Processes(4, 2, AUTO, "environment")
    assert resolve_processes(None, None, None, {"TPU_WORKER_HOSTNAMES": "a", "TPU_WORKER_ID": "0"}).count == 1
    assert resolve_processes(None, None, "auto", {}).multi


@pytest.mark.parametrize(("args", "env", "message"), [
    ((0, None, None), {}, "--num-processes: the island's process count must be >= 1, got 0"),
    ((2, None, "h:1"), {}, "needs this process's id"),
    ((2, 2, "h:1"), {}, "--process-id=2: a process id of an island of 2 processes is 0..1"),
    ((2, 0, None), {}, "needs the address of its process 0's jax.distributed service"),
    ((2, 0, "nohost"), {}, "--jax-coordinator: expected HOST:PORT"),
    ((2, 0, "h:99999"), {}, "--jax-coordinator: expected HOST:PORT"),
    ((None, 1, None), {}, "--process-id=1 needs a process count"),
    ((None, None, None), {"DTRAIN_NUM_PROCESSES": "two"}, "DTRAIN_NUM_PROCESSES: expected an integer, got 'two'"),
    ((None, None, None), {"DTRAIN_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "5",
                          "DTRAIN_JAX_COORDINATOR": "h:1"}, "JOB_COMPLETION_INDEX=5: a process id"),
])
def test_resolve_processes_errors(args: tuple[Any, ...], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        resolve_processes(args[0], args[1], args[2], env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_island_of_several_processes_refuses_chip_health(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "health.enabled=true"])
    with pytest.raises(WorkerError, match=r"an island of 2 processes cannot run chip health \(\[health\] enabled\)"):
        with open_worker(cfg, "127.0.0.1:1", "a", tmp_path / "a", quiet=True, hosts=HostGroup(1, 2)):
            pass


def test_worker_refuses_a_bad_process_flag(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dtrain_cli", "worker", "--config", TINY, "--coordinator",
                           "127.0.0.1:1", "--island", "a", "--num-processes", "2", "--process-id", "0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dtrain worker: config error: an island of 2 processes needs the address of its process 0's jax.distributed "
        "service: pass --jax-coordinator HOST:PORT (or DTRAIN_JAX_COORDINATOR)"]
