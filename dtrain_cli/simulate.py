"""``dtrain simulate`` in its default mode: one coordinator and N worker processes on loopback.

The driver only starts processes (``python -m dtrain_cli coordinator|worker``),
waits, and aggregates what they wrote; it imports neither ``coordinator`` nor
``workers`` (they meet only through the protocol). Each worker writes
``RUN_DIR/islands/NAME/{events.jsonl,summary.json,worker.log}``; the coordinator
writes ``RUN_DIR/events.jsonl`` and its checkpoints under ``RUN_DIR/coordinator``.

With ``--island-processes P`` every island is P ``dtrain worker`` processes forming one ``jax.distributed``
job (a multi-host island, :mod:`workers.hosts`, on one machine): process 0 writes the island's files as above
and alone talks to the coordinator; process I > 0 writes ``RUN_DIR/islands/NAME/process-I/`` (its events,
summary and ``worker.log``). :func:`island_process_flags` and :func:`free_port` are how such an island is
launched (tests/test_multihost.py launches its islands with them too).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtrain import config as config_mod
from dtrain.audit import Audit, AuditError, AuditParams, audit
from dtrain.config import Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.runlog import EventTail, RunLog, fmt_progress, process_dir, read_events
from dtrain_cli.faults import (
    DEVICE_KINDS,
    LINK_KINDS,
    PUSH_KINDS,
    FaultSpec,
    LinkProxy,
    check_devices,
    host_device_count,
)

START_TIMEOUT_S = 120.0
STATUS_EVERY_S = 10.0  # the driver's status line, when not on a terminal: one every this many seconds
# The coordinator's events that answer a bad push, and the action each means (push_refused and push_aborted
# are told apart further in _Simulation._push_detection).
PUSH_DETECTIONS = {"push_quarantined": "quarantined", "merge_rejected": "rejected: non-finite merge",
                   "push_refused": "refused", "push_aborted": "upload aborted"}


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound to port 0 and released): for a ``jax.distributed`` service."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def island_process_flags(processes: int, index: int, jax_coordinator: str) -> list[str]:
    """The ``dtrain worker`` flags that make a process process ``index`` of an island of ``processes``
    processes whose ``jax.distributed`` service (process 0's) listens on ``jax_coordinator`` (HOST:PORT, the
    same for every process of the island); none for a single-process island."""
    if processes == 1:
        return []
    return ["--num-processes", str(processes), "--process-id", str(index), "--jax-coordinator", jax_coordinator]


def check_island_processes(processes: object, cfg: Config, faults: Sequence[FaultSpec]) -> None:
    """Raises ConfigError for an island process count that is not an integer >= 1, or, with more than one
    process per island, for what a multi-process worker refuses (chip health, device faults): before anything
    starts, in one line."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"--island-processes: must be an integer >= 1 (processes per island), got {processes!r}")
    if processes == 1:
        return
    device = [f.text for f in faults if f.kind in DEVICE_KINDS]
    if device:
        raise ConfigError(f"--fault {device[0]}: device faults need single-process islands (an island of "
                          f"{processes} processes cannot inject them): drop --island-processes or the fault")
    if cfg.health.enabled:
        raise ConfigError(f"[health] enabled: chip health needs single-process islands (an island of {processes} "
                          f"processes cannot run it): drop --island-processes or set health.enabled=false")


def run_simulation(cfg: Config, islands: int, quiet: bool = False, timeout_s: float = 3600.0,
                   env: dict[str, str] | None = None, pin: bool = True,
                   faults: Sequence[FaultSpec] = (), island_processes: int = 1) -> dict[str, Any]:
    """Runs a coordinator and ``islands`` islands of ``island_processes`` worker processes each; returns (and
    writes) the summary.

    ``pin``: give each island its own share of this host's CPUs (:func:`cpu_shares`; Linux), as an island
    owns its hardware in production; all the processes of an island share its share. Unpinned, 4 workers on 2
    cores drift apart by 10-20% per round under the scheduler and the fast ones wait for the slow ones; the
    coordinator is never pinned.

    ``island_processes``: P > 1 makes every island one ``jax.distributed`` job of P processes (each with the
    fake devices ``env`` gives one process, so P times that many per island), on a free port of 127.0.0.1
    chosen at the island's first start and kept across its restarts. Faults act on the whole island: a kill
    SIGKILLs (and a restart starts) all its processes, a hang stops and continues all of them; push faults
    are passed to every process (process 0 sends the pushes); link faults sit between process 0 and the
    coordinator. Device faults and chip health are refused (:func:`check_island_processes`). Every start of an
    island (a restart too) is a ``worker_started`` event in ``RUN_DIR/driver/events.jsonl``: its processes' ids
    and its ``jax_coordinator`` (None for single-process islands).

    ``faults``: injected while the run goes on (:mod:`dtrain_cli.faults`); each is an event in
    ``RUN_DIR/driver/events.jsonl`` (a push fault: ``fault_armed`` when its worker is started with it, and
    ``fault_injected`` in the island's events when it fires; a device fault: ``fault_armed`` each time its
    island's worker is started with it) and, with when it was detected and what was done, in the summary
    (a device fault: :func:`device_fault_entry`; every device an island quarantined, matched to its fault or
    a false positive: :func:`device_quarantines`).

    The summary's ``goodput`` and ``audit`` (lost and doubled tokens, gaps, overlaps) come from the
    coordinator's and every island process's events (:mod:`dtrain.audit`): every process that ran as an island's
    process 0 (its restarts included); the other processes of a multi-process island run the same steps in
    lockstep, so their events would count the island's steps twice. ``bit_identical_final_params``: every
    process of every finished island ended on the same θ."""
    from dtrain.runs import new_run, run_dir

    check_island_processes(island_processes, cfg, faults)
    if islands != cfg.outer.islands:
        cfg = config_mod.replace(cfg, outer={"islands": islands})
    if cfg.coordinator.dashboard_port > 0:  # the driver's coordinator takes free ports, a restart included
        cfg = config_mod.replace(cfg, coordinator={"dashboard_port": 0})
    if cfg.data.source != "builtin" and not Path(cfg.data.source).expanduser().exists():
        raise SimulationError(f"data.source {cfg.data.source!r}: no such file or folder")  # before any process
    if any(f.kind == "kill-coordinator" and f.duration_s for f in faults) and not cfg.coordinator.checkpoint:
        raise SimulationError("kill-coordinator with a restart needs coordinator.checkpoint = true (it resumes)")
    worker_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    check_devices(faults, host_device_count(worker_env))  # the workers' fake CPU devices, where the env says
    cfg = new_run(cfg)
    out = run_dir(cfg).resolve()
    out.mkdir(parents=True)
    sim = _Simulation(cfg, out, islands, quiet, worker_env, pin, list(faults), island_processes)
    try:
        sim.run(timeout_s)
    finally:
        sim.stop_all()
    return sim.summarize()


class RunWatch:
    """What the driver's status line says, from the events the coordinator and the workers write: what the run
    waits for (workers compiling before they join, the first round), then the version out of the total, the latest
    global eval loss and the islands' latest train loss. Fed with new events (:class:`dtrain.runlog.EventTail`)."""

    def __init__(self, islands: int, expected_versions: int, shard_end: int, processes: int = 1):
        """``expected_versions``: the version a run ends at without faults (shown ``~N`` when the coordinator does
        not know the end ahead); ``shard_end``: sequences per shard (0: no end, wall-time rounds); ``processes``:
        worker processes per island (the line counts islands joined and processes running)."""
        self.islands, self.expected, self.shard_end = islands, expected_versions, shard_end
        self.processes = processes
        self.joined: set[str] = set()
        self.version = 0
        self.total = 0  # the version the run ends at, as the coordinator told the islands (0: the data decides)
        self.eval_loss: float | None = None
        self.eval_version = 0  # the version the latest eval loss is of
        self.train_loss: dict[str, float] = {}  # island name -> its latest train loss
        self.cursors: dict[int, int] = {}  # shard -> merged cursor (sequences)
        self.over = ""

    def coordinator(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            kind = e.get("event")
            if kind == "island_joined" and e.get("name"):
                self.joined.add(str(e["name"]))
            elif kind == "round_merged":
                self.version = max(self.version, int(e.get("version", 0)))
                for p in e.get("pushes", ()):
                    shard = int(p.get("shard", 0))
                    self.cursors[shard] = max(self.cursors.get(shard, 0), int(p.get("end", 0)))
            elif kind == "eval":
                loss = e.get("loss", e.get("eval_loss"))
                if isinstance(loss, (int, float)):
                    self.eval_loss, self.eval_version = float(loss), int(e.get("version", 0))
            elif kind == "coordinator_stopped":
                self.over = str(e.get("reason", "stopped"))

    def island(self, name: str, events: list[dict[str, Any]]) -> None:
        for e in events:
            kind = e.get("event")
            if kind == "joined":
                self.total = int(e.get("total_versions", 0) or 0)
            elif kind == "train" and isinstance(e.get("loss"), (int, float)):
                self.train_loss[name] = float(e["loss"])

    @property
    def known_total(self) -> int:
        """The version the run ends at: the coordinator's, else the expected one (0: not known)."""
        return self.total or self.expected

    def line(self, running: int) -> str:
        """The status line; ``running``: worker processes alive now."""
        n = self.islands
        # one process per island: an island is "a worker"; with several, islands join and processes run
        unit, procs = ("workers", "") if self.processes == 1 else ("islands", f"/{n * self.processes} processes")
        if not self.joined:
            return f"simulate: waiting for {n} {unit} to join (compiling; {running}{procs} running)"
        if self.version == 0 and not self.over:
            return f"simulate: {len(self.joined)}/{n} {unit} joined, waiting for the first round"
        losses = list(self.train_loss.values())
        data = (sum(self.cursors.values()), n * self.shard_end) if self.shard_end else None
        return fmt_progress("simulate", version=self.version, total=self.total or (f"~{self.expected}"),
                            data=data, loss=sum(losses) / len(losses) if losses else None, eval_loss=self.eval_loss,
                            eval_version=self.eval_version,
                            extra=(f"{running}/{n} workers" if self.processes == 1 else
                                   f"{running}/{n * self.processes} worker processes")
                            + ("; the run is over" if self.over else ""))


class _Simulation:
    """The driver's processes (a coordinator, N islands of P worker processes, their restarts) and the faults it
    injects."""

    def __init__(self, cfg: Config, out: Path, islands: int, quiet: bool, env: dict[str, str], pin: bool,
                 faults: list[FaultSpec], processes: int = 1):
        self.cfg, self.out, self.islands, self.env = cfg, out, islands, env
        self.processes = processes
        self.resolved = out / "config.toml"
        self.resolved.write_text(config_mod.to_toml(cfg))  # every process reads exactly this config
        self.log = RunLog(out / "driver", quiet=quiet, logger="dtrain.simulate")
        self.names = [f"island-{i}" for i in range(islands)]
        self.shares: list[list[int] | None] = [None] * islands
        if pin and hasattr(os, "sched_setaffinity"):
            self.shares = list(cpu_shares(islands, sorted(os.sched_getaffinity(0))))
        self.workers: dict[str, list[subprocess.Popen[bytes]]] = {}  # island -> its processes, process 0 first
        self.jax_ports: dict[str, int] = {}  # island -> its jax.distributed port (P > 1), kept across restarts
        self.ended: dict[str, int] = {}  # island -> the process whose failure made the driver kill the others
        self.gone: set[str] = set()  # islands killed for good (no restart): not waited for
        self.stopped: set[str] = set()  # islands stopped by the driver after the run ended without them
        self.coordinator: subprocess.Popen | None = None
        self.port = 0
        self.proxies: dict[str, LinkProxy] = {}
        self.faults = faults
        self.fired: list[dict[str, Any]] = []  # one record per injected fault
        self.not_injected: list[dict[str, str]] = []  # faults that never fired, and why
        self.recoveries: list[tuple[float, Callable[[], None]]] = []  # (monotonic time, action)
        self.t0 = time.perf_counter()
        self.t_workers = 0.0
        self.logs: list[Any] = []
        expected = cfg.rounds if cfg.coordinator.mode == "sync" else cfg.rounds * islands
        shard_end = 0 if cfg.worker.round_seconds else cfg.train.steps * cfg.train.batch_size  # sequences per shard
        self.watch = RunWatch(islands, expected, shard_end, processes)
        self.tails = {"": EventTail(out), **{n: EventTail(out / "islands" / n) for n in self.names}}

    # -- processes ---------------------------------------------------------------------------------

    def _start_coordinator(self, resume: bool) -> None:
        clog = open(self.out / "coordinator.log", "a")
        self.logs.append(clog)
        info_path = self.out / "coordinator.json"
        info_path.unlink(missing_ok=True)
        args = ["coordinator", "--config", str(self.resolved), "--port", str(self.port), "--run-dir", str(self.out)]
        self.coordinator = subprocess.Popen(_cli(*args, *(["--resume"] if resume else [])), stdout=clog,
                                            stderr=subprocess.STDOUT, env=self.env)
        t_start = time.perf_counter()
        while not info_path.exists():
            if self.coordinator.poll() is not None:
                raise SimulationError(f"the coordinator exited with status {self.coordinator.returncode}; "
                                      f"see {self.out / 'coordinator.log'}")
            if time.perf_counter() - t_start > START_TIMEOUT_S:
                raise SimulationError(f"the coordinator did not start within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
        info = json.loads(info_path.read_text())
        self.port = int(info["port"])
        if info.get("dashboard"):
            self.log.progress(f"live dashboard at {info['dashboard']}")

    def _start_worker(self, name: str) -> None:
        """Starts island ``name``: its one worker process, or all P of them (one jax.distributed job)."""
        i = self.names.index(name)
        wdir = self.out / "islands" / name
        port = self.proxies[name].port if name in self.proxies else self.port
        share = self.shares[i]
        inject = []
        for f in self.faults:  # push faults the island injects itself; one that fired is not passed again
            if f.kind in PUSH_KINDS and f.target == name and self._push_fault_event(f) is None:
                inject += ["--inject", f"{f.kind}@v{f.at_version}"]
                self.log.event("fault_armed", fault=f.text, fault_kind=f.kind, target=name, what=f.describe())
        for f in self.faults:  # device faults: passed on every start (a restarted worker still has the bad chip)
            if f.kind in DEVICE_KINDS and f.target == name:
                inject += ["--device-fault", f.worker_arg()]
                self.log.event("fault_armed", fault=f.text, fault_kind=f.kind, target=name, what=f.describe())
        if self.processes > 1 and name not in self.jax_ports:
            self.jax_ports[name] = free_port()
        self.ended.pop(name, None)
        procs = []
        for index in range(self.processes):
            pdir = process_dir(wdir, index)
            pdir.mkdir(parents=True, exist_ok=True)
            wlog = open(pdir / "worker.log", "a")
            self.logs.append(wlog)
            hosts = island_process_flags(self.processes, index, f"127.0.0.1:{self.jax_ports.get(name, 0)}")
            procs.append(subprocess.Popen(
                _cli("worker", "--config", str(self.resolved), "--coordinator", f"{self.cfg.coordinator.host}:{port}",
                     "--island", name, "--run-dir", str(wdir), *hosts, *inject),
                stdout=wlog, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=None if share is None else _pinned(share)))
        self.workers[name] = procs
        self.log.event("worker_started", island=name, processes=self.processes, pids=[p.pid for p in procs],
                       jax_coordinator=f"127.0.0.1:{self.jax_ports[name]}" if name in self.jax_ports else None)

    def _running(self, name: str) -> bool:
        """Whether some process of island ``name`` still runs."""
        return any(p.poll() is None for p in self.workers[name])

    def _end_broken_islands(self) -> None:
        """An island of several processes one of which failed (a non-zero status the driver did not cause) cannot
        go on: the others would wait in their next collective until jax.distributed noticed. Kill them now; the
        failed process is what the run's error names."""
        for name, procs in self.workers.items():
            if len(procs) == 1 or name in self.ended or name in self.gone | self.stopped:
                continue
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None and self._running(name):
                self.ended[name] = failed
                self._kill(name)
                self.log.event("island_ended", island=name, process=failed, status=procs[failed].returncode,
                               reason="a process of the island failed; the driver killed the others")

    def run(self, timeout_s: float) -> None:
        self._start_coordinator(resume=False)
        address = f"{self.cfg.coordinator.host}:{self.port}"
        for name in sorted({f.target for f in self.faults if f.kind in LINK_KINDS}):
            self.proxies[name] = LinkProxy(self.port, self.cfg.coordinator.host)
        islands = f"{self.islands} workers" if self.processes == 1 else \
            f"{self.islands} islands of {self.processes} worker processes"
        self.log.progress(f"coordinator at {address}; starting {islands}"
                          + (f", pinned to CPUs {self.shares}" if self.shares[0] is not None else "")
                          + (f"; {len(self.faults)} fault(s) to inject" if self.faults else ""))
        for name in self.names:
            self._start_worker(name)
        self.t_workers = time.perf_counter()
        deadline = self.t_workers + timeout_s
        # push and device faults: the workers inject them
        pending = [f for f in self.faults if f.kind not in PUSH_KINDS + DEVICE_KINDS]
        ended_at = 0.0
        while self.recoveries or any(self._running(n) for n in self.workers if n not in self.gone):
            now = time.perf_counter()
            if now > deadline:
                raise SimulationError(f"workers still running after {timeout_s:.0f}s")
            version = _merged_versions(self.out)
            for f in [f for f in pending if self._due(f, version, now)]:
                pending.remove(f)
                self._inject(f, version)
            for due, action in [r for r in self.recoveries if r[0] <= now]:
                self.recoveries.remove((due, action))
                action()
            self._end_broken_islands()
            coord = self.coordinator
            restarting = any(f["kind"] == "kill-coordinator" and f.get("recovered_t") is None for f in self.fired)
            if coord is not None and coord.poll() not in (None, 0) and not restarting:
                raise SimulationError(f"the coordinator failed with status {coord.returncode}; "
                                      f"see {self.out / 'coordinator.log'}")
            if coord is not None and coord.poll() == 0 and not self.recoveries:
                # The run is over and the coordinator has gone: an island that was away (hung, cut off) can no
                # longer learn that from it. Give it a few leases to finish, then stop it.
                ended_at = ended_at or now
                if now - ended_at > max(5.0, 2 * self.cfg.coordinator.lease_s):
                    self._stop_stragglers()
            self._show_status()
            time.sleep(0.2)
        self._show_status()
        missed = [(f, "the run ended first") for f in pending]
        missed += [(f, f"{f.target} made no push based on version {f.at_version} or later") for f in self.faults
                   if f.kind in PUSH_KINDS and self._push_fault_event(f) is None]
        for f in self.faults:
            if f.device_fault is not None and not device_fault_reached(f, _events(self.out / "islands" / f.target)):
                missed.append((f, f"{f.target} never trained past inner step {f.device_fault.start}"))
        for f, reason in missed:
            self.log.event("fault_not_injected", fault=f.text, reason=reason)
            self.log.progress(f"fault {f.text}: not injected ({reason})")
            self.not_injected.append({"fault": f.text, "reason": reason})
        failed = self._failures()
        if failed:
            raise SimulationError("workers failed: " + "; ".join(failed))
        coord = self.coordinator
        if coord is not None:
            if coord.poll() is None:
                coord.terminate()
            if coord.wait(timeout=60) not in (0, -15):
                raise SimulationError(f"the coordinator failed with status {coord.returncode}")

    def _failures(self) -> list[str]:
        """The worker processes that failed (exited non-zero) on their own, for the run's error: each one's island,
        its process (with several per island), its status, the last line of its log and where the log is. Islands
        killed for good or stopped by the driver are left out, and so are the processes the driver killed because
        another process of their island had failed (:meth:`_end_broken_islands`)."""
        out = []
        for name, procs in self.workers.items():
            if name in self.gone | self.stopped:
                continue
            for index, p in enumerate(procs):
                if p.poll() not in (None, 0) and self.ended.get(name, index) == index:
                    log = process_dir(Path("islands") / name, index) / "worker.log"
                    who = name if self.processes == 1 else f"{name} process {index}"
                    out.append(f"{who} (status {p.returncode}: {_last_line(self.out / log)}; see {log})")
        return out

    def _show_status(self) -> None:
        """The driver's status line (:class:`RunWatch`): live on a terminal, else a line every STATUS_EVERY_S."""
        for name, tail in self.tails.items():
            if name:
                self.watch.island(name, tail.read())
            else:
                self.watch.coordinator(tail.read())
        running = sum(p.poll() is None for procs in self.workers.values() for p in procs)
        total = self.watch.known_total
        self.log.status("simulate", self.watch.line(running), done=self.watch.version, total=total,
                        every_s=STATUS_EVERY_S)

    def _stop_stragglers(self) -> None:
        for name, procs in self.workers.items():
            if self._running(name):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait(timeout=30)
                self.stopped.add(name)
                self.log.event("worker_stopped", island=name,
                               reason="the coordinator finished the run and exited; this island had not finished")
                self.log.progress(f"{name}: stopped (the run ended while it was away)")

    def stop_all(self) -> None:
        for p in (p for procs in self.workers.values() for p in procs):
            if p.poll() is None:
                p.kill()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.kill()
        for proxy in self.proxies.values():
            proxy.close()
        for f in self.logs:
            f.close()

    # -- faults ------------------------------------------------------------------------------------

    def _due(self, f: FaultSpec, version: int, now: float) -> bool:
        if f.at_version is not None:
            return version >= f.at_version
        return f.at_s is not None and now - self.t_workers >= f.at_s

    def _inject(self, f: FaultSpec, version: int) -> None:
        record = self.log.event("fault_injected", fault=f.text, fault_kind=f.kind, target=f.target, version=version,
                                what=f.describe())
        self.fired.append({"fault": f.text, "kind": f.kind, "target": f.target, "injected_t": record["t"],
                           "version": version, "recovered_t": None})
        entry = self.fired[-1]
        self.log.progress(f"fault: {f.describe()} (version {version})")
        later = (time.perf_counter() + f.duration_s) if f.duration_s else None
        if f.kind == "kill":
            self._kill(f.target)
            if later is None:
                self.gone.add(f.target)
            else:
                self.recoveries.append((later, lambda: self._recover(entry, "restarted",
                                                                       lambda: self._start_worker(f.target))))
        elif f.kind == "hang":
            self._signal(f.target, signal.SIGSTOP)
            assert later is not None
            self.recoveries.append((later, lambda: self._recover(
                entry, "resumed (SIGCONT)", lambda: self._signal(f.target, signal.SIGCONT))))
        elif f.kind == "kill-coordinator":
            assert self.coordinator is not None
            self.coordinator.kill()
            self.coordinator.wait()
            if later is not None:
                self.recoveries.append((later, lambda: self._recover(
                    entry, "restarted with --resume", lambda: self._start_coordinator(resume=True))))
        elif f.kind in LINK_KINDS:
            proxy = self.proxies[f.target]
            if f.kind == "cut":
                proxy.cut()
            else:
                proxy.slow(f.delay_ms / 1000.0)
            assert later is not None
            self.recoveries.append((later, lambda: self._recover(entry, "link restored", proxy.restore)))

    def _signal(self, name: str, signum: int) -> None:
        """Sends ``signum`` to every process of island ``name`` that has not exited."""
        for p in self.workers[name]:
            if p.poll() is None:
                p.send_signal(signum)

    def _kill(self, name: str) -> None:
        """SIGKILLs every process of island ``name`` still running, then waits for them all."""
        self._signal(name, signal.SIGKILL)
        for p in self.workers[name]:
            p.wait()

    def _push_fault_event(self, f: FaultSpec) -> dict[str, Any] | None:
        """The island's ``fault_injected`` event for push fault ``f``, or None if it has not fired (yet)."""
        return next((e for e in _events(self.out / "islands" / f.target)
                     if e.get("event") == "fault_injected" and e.get("fault_kind") == f.kind
                     and e.get("at_version") == f.at_version), None)

    def _push_detection(self, f: FaultSpec, injected: dict[str, Any], coord_events: list[dict[str, Any]],
                        island_events: list[dict[str, Any]]) -> dict[str, Any]:
        """A push fault's summary entry: the coordinator's first event about the bad push (by its push id) and
        the action it took; latency from the island's ``fault_injected``; its recovery from the island's events."""
        push_id = injected["push_id"]
        about = [e for e in coord_events if e.get("push_id") == push_id]
        seen = next((e for e in about if e.get("event") in PUSH_DETECTIONS), None)
        merged = any(p.get("push_id") == push_id for e in coord_events if e.get("event") == "round_merged"
                     for p in e.get("pushes", ()))
        recovered = None
        if seen is None:
            action = "merged: not detected" if merged else "none: not detected"
        elif seen["event"] == "push_refused":
            reason = str(seen.get("reason", ""))
            action = ("refused: bad frame" if "bad frame" in reason else
                      "refused: tokens beyond its assigned range" if "exceed its cursor range" in reason else
                      f"refused: {seen.get('code')}")
        elif seen["event"] == "push_aborted":
            retry = next((e for e in about if e.get("event") == "push_received" and e["t"] >= seen["t"]), None)
            action = "upload retried" if retry is not None else "upload discarded, not retried"
            recovered = retry["t"] if retry is not None else None
        else:
            action = PUSH_DETECTIONS[seen["event"]]
        recovery = "upload sent again" if recovered is not None else None
        if seen is not None and seen["event"] != "push_aborted":  # not merged: the island trains its range again
            rewound = next((e for e in island_events
                            if e.get("event") == "rewound" and push_id in str(e.get("reason", ""))), None)
            if rewound is not None:
                recovered = rewound["t"]
                recovery = (f"the island rewound to cursor {rewound.get('to_cursor')} and trained the range again "
                            f"({rewound.get('retrained_steps')} steps)")
        t = injected["t"]
        return {"fault": f.text, "kind": f.kind, "target": f.target, "injected_t": t,
                "version": injected.get("base_version"), "recovered_t": recovered, "recovery": recovery,
                "push_id": push_id,
                "merged": merged, "detected_t": seen["t"] if seen else None,
                "detection_s": round(seen["t"] - t, 3) if seen else None,
                "detected_by": seen["event"] if seen else None, "action": action}

    def _recover(self, entry: dict[str, Any], what: str, action: Callable[[], None]) -> None:
        action()
        record = self.log.event("fault_recovered", fault=entry["fault"], action=what)
        entry["recovered_t"], entry["recovery"] = record["t"], what
        self.log.progress(f"fault {entry['fault']}: {what}")

    def _detections(self) -> list[dict[str, Any]]:
        """Each injected fault with when the system noticed it (from the coordinator's and the islands'
        events) and what it did."""
        coord_events = _events(self.out)
        island_events = {n: _events(self.out / "islands" / n) for n in self.names}
        result = []
        for f in self.fired:
            t = f["injected_t"]
            seen: dict[str, Any] | None = None
            if f["kind"] in ("kill", "hang", "cut"):
                # The coordinator notices a dead or hung island when its lease expires, or earlier when a
                # restarted one joins again under the same name (not a live island moving to another shard).
                seen = next((e for e in coord_events if e["t"] >= t and e.get("name", e.get("island")) is not None
                             and (e.get("event") == "island_lost"
                                  and str(e.get("island", "")).startswith(f["target"] + "-")
                                  or e.get("event") == "island_joined" and e.get("name") == f["target"]
                                  and "is done; took over" not in str(e.get("reason", "")))), None)
                action = {"island_lost": "lease expired: dropped from the round; its shard's unmerged data goes "
                                         "to the next island to take the shard",
                          "island_joined": "rejoined before its lease expired: kept its shard, from the "
                                           "coordinator's cursor",
                          None: "none: lease not expired"}[seen.get("event") if seen else None]
            elif f["kind"] == "kill-coordinator":
                seen = min((e for evs in island_events.values() for e in evs
                            if e.get("event") in ("retry", "heartbeat_failed") and e["t"] >= t),
                           key=lambda e: e["t"], default=None)
                action = "islands retried with backoff"
            else:  # slow: not a failure (the island keeps its lease); the island notices its round trips grow
                seen = next((e for e in island_events.get(f["target"], [])
                             if e.get("event") == "link_slow" and e["t"] >= t), None)
                action = "the island reported its link slow (heartbeat round trips); it keeps its lease"
            result.append({**f, "detected_t": seen["t"] if seen else None,
                           "detection_s": round(seen["t"] - t, 3) if seen else None,
                           "detected_by": seen.get("event") if seen else None, "action": action})
        for spec in self.faults:
            injected = self._push_fault_event(spec) if spec.kind in PUSH_KINDS else None
            if injected is not None:
                result.append(self._push_detection(spec, injected, coord_events, island_events[spec.target]))
        device_faults = [f for f in self.faults if f.kind in DEVICE_KINDS]
        result += [device_fault_entry(f, island_events[f.target], device_faults) for f in device_faults
                   if device_fault_reached(f, island_events[f.target])]
        return result

    # -- the summary -------------------------------------------------------------------------------

    def audit(self) -> Audit:
        """The token-range audit and goodput (:mod:`dtrain.audit`) from the coordinator's events and every
        island's (all its processes')."""
        try:
            return audit(_events(self.out), {n: _events(self.out / "islands" / n) for n in self.names},
                         AuditParams.from_config(self.cfg))
        except AuditError as e:
            raise SimulationError(f"token-range audit of {self.out}: {e}") from None

    def summarize(self) -> dict[str, Any]:
        out, cfg = self.out, self.cfg
        wall = time.perf_counter() - self.t0
        finished = [n for n in self.names if n not in self.gone | self.stopped]
        per_island = [json.loads((out / "islands" / n / "summary.json").read_text()) for n in finished]
        # the other processes of each island: the same θ and eval as its process 0 (its tokens and bytes are
        # process 0's alone, the one that pushes)
        followers = [json.loads((process_dir(out / "islands" / n, i) / "summary.json").read_text())
                     for n in finished for i in range(1, self.processes)]
        evals = {round(s["final_eval_loss"], 6) for s in per_island + followers}
        digests = {s["params_digest"] for s in per_island + followers}
        checked = self.audit()
        summary = {
            "mode": "simulate-processes", "final_eval_loss": per_island[0]["final_eval_loss"],
            "rounds": max(s["version"] for s in per_island), "tokens": sum(s["tokens"] for s in per_island),
            "bytes_up": sum(s["bytes_up"] for s in per_island), "bytes_down": sum(s["bytes_down"] for s in per_island),
            "wall_s": wall, "islands": per_island, "run_dir": str(out),
            "utilization": min(s["utilization"] for s in per_island),
            "compression_ratio": sum(s["compression_ratio"] for s in per_island) / len(per_island),
            "bit_identical_final_params": len(digests) == 1, "codec": {"up": cfg.codec.up, "down": cfg.codec.down},
            "worker_cpus": self.shares, "island_processes": self.processes, "faults": self._detections(),
            "device_quarantines": device_quarantines({n: _events(self.out / "islands" / n) for n in self.names},
                                                     [f for f in self.faults if f.kind in DEVICE_KINDS]),
            "faults_not_injected": self.not_injected,
            "goodput": checked.goodput, "audit": checked.to_dict(),
            "unfinished_islands": sorted(self.gone | self.stopped),
        }
        if len(digests) != 1 or len(evals) != 1:
            raise SimulationError(f"islands ended with different parameters: digests {sorted(digests)}")
        self.log.event("run_finished", **{k: v for k, v in summary.items() if k != "islands"})
        self.log.write_summary(summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.log.progress(f"done: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, "
                          f"{summary['tokens']:,} tokens, {(summary['bytes_up'] + summary['bytes_down']) / 1e6:.2f} MB "
                          f"on the wire, compression {summary['compression_ratio']:.1f}x, utilization "
                          f"{summary['utilization']:.3f}, goodput {_fmt_goodput(checked.goodput)}, "
                          f"lost {checked.lost_tokens:,} / doubled {checked.doubled_tokens:,} tokens, "
                          f"{wall:.1f}s -> {out / 'summary.json'}")
        self.log.close()
        return summary


def _quarantine_fault(island: str, evidence: dict[str, Any], device_faults: Sequence[FaultSpec]) -> FaultSpec | None:
    """The device fault of ``island`` that a ``device_quarantined`` event (``evidence``) found: one on the same
    device whose start step is not after the evidence's step; None: a false positive (a healthy device
    quarantined, or the faulty one before its fault could fire)."""
    return next((f for f in device_faults if f.target == island and f.device_fault is not None
                 and f.device_fault.found_by(evidence)), None)


def device_quarantines(island_events: dict[str, list[dict[str, Any]]], device_faults: Sequence[FaultSpec]
                       ) -> list[dict[str, Any]]:
    """Every ``device_quarantined`` event of every island, in time order, as {island, t, device, probe, step,
    detail, fault}: ``fault`` is the device fault (its spec text) that the quarantine found, or None for a false
    positive (see :func:`_quarantine_fault`)."""
    found = []
    for island, events in island_events.items():
        for e in events:
            if e.get("event") == "device_quarantined":
                f = _quarantine_fault(island, e, device_faults)
                found.append({"island": island, "t": e["t"], "device": e.get("device"), "probe": e.get("probe"),
                              "step": e.get("step"), "detail": e.get("detail"), "fault": f.text if f else None})
    return sorted(found, key=lambda q: q["t"])


def device_fault_reached(spec: FaultSpec, island_events: list[dict[str, Any]]) -> bool:
    """Whether device fault ``spec`` was injected: some process of its island ran past its start step (a
    ``trained`` event's ``executed``), or the island quarantined the device for it."""
    fault = spec.device_fault
    assert fault is not None, spec
    return any(e.get("event") == "trained" and int(e["executed"]) > fault.start
               or e.get("event") == "device_quarantined" and _quarantine_fault(spec.target, e, [spec]) is not None
               for e in island_events)


def device_fault_entry(spec: FaultSpec, island_events: list[dict[str, Any]], device_faults: Sequence[FaultSpec]
                       ) -> dict[str, Any]:
    """A device fault's summary entry from its island's events (all its worker processes'): detected by the
    island's first ``device_quarantined`` of the fault's device at or after its start step (the probe that found
    it, ``detection_steps`` = the evidence's step - the start step, ``detection_s`` from the time the island
    began the chunk that holds the start step, where its events say: :func:`_step_reached_t`); the action from
    the island's next ``remeshed`` (or ``drained``); ``false_positives``: the island's quarantines that found none
    of its device faults (``device_faults``: every device fault of the run)."""
    fault = spec.device_fault
    assert fault is not None, spec
    quarantines = [e for e in island_events if e.get("event") == "device_quarantined"]
    seen = next((e for e in quarantines if _quarantine_fault(spec.target, e, [spec]) is not None), None)
    false_positives = [{"device": e.get("device"), "probe": e.get("probe"), "step": e.get("step"), "t": e["t"],
                        "detail": e.get("detail")}
                       for e in quarantines if _quarantine_fault(spec.target, e, device_faults) is None]
    onset_t = _step_reached_t(island_events, spec)
    entry: dict[str, Any] = {
        "fault": spec.text, "kind": spec.kind, "target": spec.target, "device": fault.device,
        "start_step": fault.start, "injected_t": onset_t, "recovered_t": None, "recovery": None,
        "detected_t": None, "detection_s": None, "detection_steps": None, "detected_by": None, "probe": None,
        "action": "none: not detected", "false_positives": false_positives}
    if seen is None:
        return entry
    step = int(seen["step"])
    entry.update(detected_t=seen["t"], detected_by="device_quarantined", probe=seen.get("probe"),
                 detection_steps=step - fault.start,
                 evidence={k: v for k, v in seen.items() if k not in ("t", "elapsed_s", "event")},
                 detection_s=round(seen["t"] - onset_t, 3) if onset_t is not None else None)
    action = f"quarantined device {fault.device} ({seen.get('probe')})"
    after = next((e for e in island_events if e.get("event") in ("remeshed", "drained") and e["t"] >= seen["t"]),
                 None)
    if after is None:
        entry["action"] = action
    elif after["event"] == "remeshed":
        entry.update(action=f"{action}; remeshed on {after.get('devices')} devices", recovered_t=after["t"],
                     recovery=f"remeshed on devices {after.get('device_ids')} from {after.get('from_devices')}, "
                              f"the same global batch")
    else:
        entry["action"] = f"{action}; drained ({after.get('reason')})"
    return entry


def _step_reached_t(island_events: list[dict[str, Any]], spec: FaultSpec) -> float | None:
    """When the island's first worker process began the chunk of inner steps that holds device fault ``spec``'s
    start step: the end of its chunk before it (a ``trained`` event; ``island_started`` for the first chunk). That
    chunk is known by the first event that shows it ran: a ``trained`` event whose ``executed`` (the process's
    steps so far) passes the start step, a ``chunk_failed`` whose steps reach past it, or the fault's
    ``device_quarantined``. None where the first process's events show none (it never ran that step, or a
    restarted process did, whose step counter was restored from a checkpoint)."""
    assert spec.device_fault is not None, spec
    start = spec.device_fault.start
    last_t: float | None = None
    executed = 0
    for e in island_events:
        event = e.get("event")
        if event == "island_started" and last_t is None:
            last_t = float(e["t"])
        elif event == "trained":
            if int(e["executed"]) < executed:
                return None  # a restarted process: it counts from 0 again
            executed = int(e["executed"])
            if executed > start:
                return last_t
            last_t = float(e["t"])
        elif event == "chunk_failed" and int(e["step"]) + int(e["steps"]) > start or \
                event == "device_quarantined" and _quarantine_fault(spec.target, e, [spec]) is not None:
            return last_t
    return None


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The events in ``run_dir`` ([] if none yet), less lines torn by a process the driver killed mid-write."""
    try:
        return read_events(run_dir, skip_torn=True)
    except OSError:
        return []


def _fmt_goodput(goodput: float | None) -> str:
    return "n/a (no step executed)" if goodput is None else f"{goodput:.3f}"


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
