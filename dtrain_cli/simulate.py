"""``dtrain simulate`` in its default mode: one coordinator and N worker processes on loopback.

The driver only starts processes (``python -m dtrain_cli coordinator|worker``),
waits, and aggregates what they wrote; it imports neither ``coordinator`` nor
``workers`` (they meet only through the protocol). Each worker writes
``RUN_DIR/islands/NAME/{events.jsonl,summary.json,worker.log}``; the coordinator
writes ``RUN_DIR/events.jsonl`` and its checkpoints under ``RUN_DIR/coordinator``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain import config as config_mod
from dtrain.config import Config
from dtrain.errors import DtrainError
from dtrain.runlog import RunLog

START_TIMEOUT_S = 120.0


class SimulationError(DtrainError):
    pass


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain_cli", *args]


def cpu_shares(islands: int, cpus: list[int]) -> list[list[int]]:
    """The CPUs each of ``islands`` workers gets on this host: a balanced partition of ``cpus`` (each island
    its own cores when there are enough; otherwise islands take turns over the cores, and the ones that share
    a core share only that one)."""
    if islands <= len(cpus):
        return [cpus[i::islands] for i in range(islands)]
    return [[cpus[i % len(cpus)]] for i in range(islands)]


def _pinned(cpus: list[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cpus)


def run_simulation(cfg: Config, islands: int, quiet: bool = False, timeout_s: float = 3600.0,
                   env: dict[str, str] | None = None, pin: bool = True) -> dict[str, Any]:
    """Runs a coordinator and ``islands`` worker processes; returns (and writes) the summary.

    ``pin``: give each worker its own share of this host's CPUs (:func:`cpu_shares`; Linux), as an island
    owns its hardware in production. Unpinned, 4 workers on 2 cores drift apart by 10-20% per round under
    the scheduler and the fast ones wait for the slow ones; the coordinator is never pinned."""
    from dtrain.runs import new_run, run_dir

    if islands != cfg.outer.islands:
        cfg = config_mod.replace(cfg, outer={"islands": islands})
    if cfg.data.source != "builtin" and not Path(cfg.data.source).expanduser().exists():
        raise SimulationError(f"data.source {cfg.data.source!r}: no such file or folder")  # before any process
    cfg = new_run(cfg)
    out = run_dir(cfg).resolve()
    out.mkdir(parents=True)
    resolved = out / "config.toml"
    resolved.write_text(config_mod.to_toml(cfg))  # every process reads exactly this config
    log = RunLog(out / "driver", quiet=quiet)
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    procs: list[tuple[str, subprocess.Popen]] = []
    coord_log = open(out / "coordinator.log", "w")
    coordinator = subprocess.Popen(_cli("coordinator", "--config", str(resolved), "--port", "0", "--run-dir", str(out)),
                                   stdout=coord_log, stderr=subprocess.STDOUT, env=env)
    try:
        info_path = out / "coordinator.json"
        while not info_path.exists():
            if coordinator.poll() is not None:
                raise SimulationError(f"the coordinator exited with status {coordinator.returncode}; "
                                      f"see {out / 'coordinator.log'}")
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                raise SimulationError(f"the coordinator did not start within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
        info = json.loads(info_path.read_text())
        address = f"{cfg.coordinator.host}:{info['port']}"
        shares: list[list[int] | None] = [None] * islands
        if pin and hasattr(os, "sched_setaffinity"):
            shares = list(cpu_shares(islands, sorted(os.sched_getaffinity(0))))
        log.progress(f"coordinator at {address}; starting {islands} workers"
                     + (f", pinned to CPUs {shares}" if shares[0] is not None else ""))
        for i in range(islands):
            name = f"island-{i}"
            wdir = out / "islands" / name
            wdir.mkdir(parents=True)
            wlog = open(wdir / "worker.log", "w")
            share = shares[i]
            p = subprocess.Popen(_cli("worker", "--config", str(resolved), "--coordinator", address, "--island", name,
                                      "--run-dir", str(wdir)), stdout=wlog, stderr=subprocess.STDOUT, env=env,
                                 preexec_fn=None if share is None else _pinned(share))
            procs.append((name, p))
        deadline = time.perf_counter() + timeout_s
        last_report = 0.0
        while any(p.poll() is None for _, p in procs):
            if time.perf_counter() > deadline:
                raise SimulationError(f"workers still running after {timeout_s:.0f}s")
            if coordinator.poll() not in (None, 0):  # 0: it served the last version and shut down
                raise SimulationError(f"the coordinator failed with status {coordinator.returncode}; "
                                      f"see {out / 'coordinator.log'}")
            if time.perf_counter() - last_report > 10:
                last_report = time.perf_counter()
                log.progress(f"{sum(p.poll() is None for _, p in procs)} workers running; "
                             f"{_merged_versions(out)} versions merged")
            time.sleep(0.2)
        failed = [(n, p.returncode) for n, p in procs if p.returncode != 0]
        if failed:
            raise SimulationError("workers failed: " + "; ".join(
                f"{n} (status {rc}: {_last_line(out / 'islands' / n / 'worker.log')}; see islands/{n}/worker.log)"
                for n, rc in failed))
        if coordinator.poll() is None:
            coordinator.terminate()
        if coordinator.wait(timeout=60) not in (0, -15):
            raise SimulationError(f"the coordinator failed with status {coordinator.returncode}")
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
        if coordinator.poll() is None:
            coordinator.kill()
        coord_log.close()
    wall = time.perf_counter() - t0
    per_island = [json.loads((out / "islands" / n / "summary.json").read_text()) for n, _ in procs]
    evals = {round(s["final_eval_loss"], 6) for s in per_island}
    digests = {s["params_digest"] for s in per_island}
    summary = {
        "mode": "simulate-processes", "final_eval_loss": per_island[0]["final_eval_loss"],
        "rounds": max(s["version"] for s in per_island), "tokens": sum(s["tokens"] for s in per_island),
        "bytes_up": sum(s["bytes_up"] for s in per_island), "bytes_down": sum(s["bytes_down"] for s in per_island),
        "wall_s": wall, "islands": per_island, "run_dir": str(out),
        "utilization": min(s["utilization"] for s in per_island),
        "compression_ratio": sum(s["compression_ratio"] for s in per_island) / len(per_island),
        "bit_identical_final_params": len(digests) == 1, "codec": {"up": cfg.codec.up, "down": cfg.codec.down},
        "worker_cpus": shares,
    }
    if len(digests) != 1 or len(evals) != 1:
        raise SimulationError(f"islands ended with different parameters: digests {sorted(digests)}")
    log.event("run_finished", **{k: v for k, v in summary.items() if k != "islands"})
    log.write_summary(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.progress(f"done: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, "
                 f"{summary['tokens']:,} tokens, {(summary['bytes_up'] + summary['bytes_down']) / 1e6:.2f} MB on the "
                 f"wire, compression {summary['compression_ratio']:.1f}x, utilization {summary['utilization']:.3f}, "
                 f"{wall:.1f}s -> {out / 'summary.json'}")
    log.close()
    return summary


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "empty log"


def _merged_versions(out: Path) -> int:
    try:
        with open(out / "events.jsonl") as f:
            return sum(1 for line in f if '"round_merged"' in line)
    except OSError:
        return 0
