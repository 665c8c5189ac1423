"""Multi-host islands: one island made of two ``dtrain worker`` processes (one ``jax.distributed`` job over CPU
collectives, 2 fake devices each) beside a single-process island, both merged by one real coordinator on
127.0.0.1:0. The coordinator sees two islands, one of them with 4 devices; every process ends on the coordinator's
final θ, bit for bit. And the pure resolution of the flags and the environment into the island's processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from conftest import TINY, initial_parameters
from coordinator.server import serve
from dtrain import model
from dtrain.checkpoint import Checkpointer
from dtrain.config import ConfigError, load_config, to_toml
from dtrain.runlog import read_events
from dtrain.train import InnerLoop, make_mesh
from workers.hosts import AUTO, HostGroup, Processes, resolve_processes
from workers.island import Worker, WorkerError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("multihost")
    # coordinator.checkpoint=false: the coordinator runs in this process (orbax's async checkpointing does not bear
    # two checkpoint managers at work in one process; the workers are processes of their own)
    cfg = load_config(TINY, [
        f"run.out_dir={tmp}", "coordinator.port=0", "coordinator.checkpoint=false", "outer.islands=2",
        "train.steps=40", "outer.inner_steps=20", "worker.heartbeat_s=0.5", "worker.retry_total_s=30",
        "worker.start_wait_s=60"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp / "coordinator", theta, spec, port=0, quiet=True)
    (tmp / "config.toml").write_text(to_toml(cfg))
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "dtrain_cli", "worker", "--config", str(tmp / "config.toml"), "--host-devices", "2",
            "--coordinator", f"127.0.0.1:{port}", "--quiet"]
    jax_port = _free_port()
    commands = {
        "single": [*base, "--island", "single", "--run-dir", str(tmp / "single")],
        **{f"multi-{i}": [*base, "--island", "multi", "--run-dir", str(tmp / "multi"), "--num-processes", "2",
                          "--process-id", str(i), "--jax-coordinator", f"127.0.0.1:{jax_port}"] for i in range(2)},
    }
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    out: dict[str, Any] = {}
    try:
        for name, proc in procs.items():
            printed, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"worker {name} exited {proc.returncode}: {printed[-3000:]}"
        out["islands"] = {i.name: i for i in service.state.islands.values()}
        out["digest"] = service.merger.digest
        out["version"] = service.state.version
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        server.stop(grace=None).wait()
        service.close()
    out["summaries"] = {"single": json.loads((tmp / "single" / "summary.json").read_text()),
                        "multi-0": json.loads((tmp / "multi" / "summary.json").read_text()),
                        "multi-1": json.loads((tmp / "multi" / "process-1" / "summary.json").read_text())}
    out["events"] = {"multi-0": read_events(tmp / "multi"), "multi-1": read_events(tmp / "multi" / "process-1")}
    out["tmp"], out["cfg"] = tmp, cfg
    return out


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
        Worker(cfg, "127.0.0.1:1", "a", tmp_path / "a", quiet=True, hosts=HostGroup(1, 2))


def test_worker_refuses_a_bad_process_flag(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dtrain_cli", "worker", "--config", TINY, "--coordinator",
                           "127.0.0.1:1", "--island", "a", "--num-processes", "2", "--process-id", "0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dtrain worker: config error: an island of 2 processes needs the address of its process 0's jax.distributed "
        "service: pass --jax-coordinator HOST:PORT (or DTRAIN_JAX_COORDINATOR)"]
