"""The ``dtrain simulate`` driver's processes: a coordinator (or its range shards and lead) and N islands of P
``dtrain worker`` processes on loopback, started, supervised, restarted, faulted and stopped.

:class:`Simulation` starts processes (``python -m dtrain_cli coordinator|worker``) and imports neither
``coordinator`` nor ``workers`` (they meet only through the protocol). Each worker writes
``RUN_DIR/islands/NAME/{events.jsonl,summary.json,worker.log}``; the coordinator writes ``RUN_DIR/events.jsonl``
and its checkpoints under ``RUN_DIR/coordinator``; the driver records what it does (each start, each fault fired
and recovered, each island it ended or stopped) as events in ``RUN_DIR/driver/events.jsonl``, with a progress
line for each.

With ``--island-processes P`` every island is P ``dtrain worker`` processes forming one ``jax.distributed``
job (a multi-host island, :mod:`workers.hosts`, on one machine): process 0 writes the island's files as above
and alone talks to the coordinator; process I > 0 writes ``RUN_DIR/islands/NAME/process-I/`` (its events,
summary and ``worker.log``). :func:`island_process_flags` and :func:`free_port` are how such an island is
launched (tests/test_multihost.py launches its islands with them too).

The faults the driver applies to processes (kill, hang, kill-coordinator) and links (cut, slow: through
:mod:`dtrain_cli.link_proxy`) fire here as they come due, and their recoveries after them; the ``--fault``
grammar is :mod:`dtrain_cli.fault_spec`. What the run reports (the status line, the summary, the closing line)
is :mod:`dtrain_cli.simulate_report`; the entry point, :func:`dtrain_cli.simulate.run_simulation`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dtrain.config.load import to_toml
from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.net.identity import issue_token
from dtrain.runlog import SIMULATE_CHANNEL, RunLog, process_dir, read_events
from dtrain_cli.fault_score import device_fault_reached, push_fault_event
from dtrain_cli.fault_spec import DEVICE_KINDS, LINK_KINDS, PUSH_KINDS, FaultSpec
from dtrain_cli.island_spec import IslandSpec, island_config
from dtrain_cli.link_proxy import LinkProxy

START_TIMEOUT_S = 120.0  # a coordinator or range shard not listening this long after its start: failed


class SimulationError(DtrainError):
    """A simulation that cannot start or did not finish: a process failed, timed out, or the islands disagree."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain_cli", *args]


def cpu_shares(islands: int, cpus: list[int]) -> list[list[int]]:
    """The CPUs each of ``islands`` workers gets on this host: a balanced partition of ``cpus`` (each island
    its own cores when there are enough; otherwise islands take turns over the cores, and the ones that share
    a core share only that one)."""
    if islands <= len(cpus):
        return [cpus[i::islands] for i in range(islands)]
    return [[cpus[i % len(cpus)]] for i in range(islands)]


@contextmanager
def _pinned(cpus: list[int] | None) -> Iterator[None]:
    """Processes started inside inherit ``cpus`` as their CPU affinity: this thread's own (sched_setaffinity(0) is
    per thread), set for the while. Not a preexec_fn: that runs Python in a fork of a process with JAX's threads."""
    before = None if cpus is None else os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


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


def with_host_devices(env: dict[str, str], devices: int) -> dict[str, str]:
    """``env`` with ``XLA_FLAGS`` giving a process ``devices`` fake CPU devices (any device count it gave
    replaced)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return {**env, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


class Simulation:
    """The driver's processes (a coordinator, N islands of P worker processes, their restarts) and the faults it
    injects. Its record of them (:attr:`fired`, :attr:`not_injected`, :attr:`gone`, :attr:`stopped`,
    :attr:`refused`, ...) is what :mod:`dtrain_cli.simulate_report` summarizes."""

    def __init__(self, cfg: Config, out: Path, islands: int, quiet: bool, env: dict[str, str], pin: bool,
                 faults: list[FaultSpec], processes: int = 1, specs: dict[str, IslandSpec] | None = None,
                 tokens: dict[str, str] | None = None, t0: float | None = None):
        self.cfg, self.out, self.islands, self.env = cfg, out, islands, env
        self.tokens = tokens or {}  # island -> its issued token (security.identity token)
        self.coordinator_env = env
        self.operator_token_file: Path | None = None
        if self.tokens and not env.get(cfg.security.token_env):
            # Islands' own tokens turn auth on, and the dashboard then answers only the operator's token: the
            # driver issues one for its coordinator, kept owner-only beside the islands' token hashes.
            operator = issue_token()
            self.operator_token_file = out / "operator-token"
            fd = os.open(self.operator_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(operator + "\n")
            self.coordinator_env = {**env, cfg.security.token_env: operator}
        self.refused: dict[str, str] = {}  # islands with another's credential that failed: their log's last line
        self.specs = specs or {}
        self.processes = processes
        self.resolved = out / "config.toml"
        self.resolved.write_text(to_toml(cfg))  # every process reads exactly this config
        # its clock from the command's start (t0): the lines before it (a token store built) counted from there
        self.log = RunLog(out / "driver", quiet=quiet, logger=SIMULATE_CHANNEL, t0=t0)
        self.names = [f"island-{i}" for i in range(islands)]
        self.shares: list[list[int] | None] = [None] * islands
        if pin and hasattr(os, "sched_setaffinity"):
            self.shares = list(cpu_shares(islands, sorted(os.sched_getaffinity(0))))
        self.workers: dict[str, list[subprocess.Popen[bytes]]] = {}  # island -> its processes, process 0 first
        self.jax_ports: dict[str, int] = {}  # island -> its jax.distributed port (P > 1), kept across restarts
        self.ended: dict[str, int] = {}  # island -> the process whose failure made the driver kill the others
        self.gone: set[str] = set()  # islands killed for good (no restart): not waited for
        self.stopped: set[str] = set()  # islands stopped by the driver after the run ended without them
        self.late: set[str] = set()  # islands that finished but were terminated, slow to exit: no failure
        self.coordinator: subprocess.Popen | None = None
        self.resume = False  # dtrain simulate --resume: the coordinator starts from its checkpoint
        self.shards: dict[int, subprocess.Popen[bytes]] = {}  # range shard -> its process (coordinator.shards > 1)
        self.port = 0
        self.proxies: dict[str, LinkProxy] = {}
        self.faults = faults
        self.fired: list[dict[str, Any]] = []  # one record per injected fault
        self.not_injected: list[dict[str, str]] = []  # faults that never fired, and why
        self.recoveries: list[tuple[float, Callable[[], None]]] = []  # (monotonic time, action)
        self.t0 = time.perf_counter()
        self.t_workers = 0.0
        self.logs: list[Any] = []
        self.configs = {n: self.resolved for n in self.names}  # the config file each island's worker reads
        for name, spec in self.specs.items():
            (out / "islands" / name).mkdir(parents=True, exist_ok=True)
            path = self.configs[name] = out / "islands" / name / "config.toml"
            path.write_text(to_toml(island_config(cfg, spec, f"--island {name}")))

    # -- processes ---------------------------------------------------------------------------------

    def _start_coordinator(self, resume: bool) -> None:
        """Starts the coordinator (``resume``: from its checkpoint, on the port it had) and waits for its port."""
        clog = open(self.out / "coordinator.log", "a")
        self.logs.append(clog)
        info_path = self.out / "coordinator.json"
        info_path.unlink(missing_ok=True)
        args = ["coordinator", "--config", str(self.resolved), "--port", str(self.port), "--run-dir", str(self.out)]
        self.coordinator = subprocess.Popen(_cli(*args, *(["--resume"] if resume else [])), stdout=clog,
                                            stderr=subprocess.STDOUT, env=self.coordinator_env)
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
            token = (f" (its token: {self.operator_token_file}, sent as 'Authorization: Bearer TOKEN' or opened as "
                     f"/?token=TOKEN)" if self.operator_token_file else "")
            self.log.progress(f"live dashboard at {info['dashboard']}{token}")

    def _start_shard(self, index: int) -> None:
        """Starts range shard ``index`` of a sharded coordinator on its port and waits until it listens."""
        slog = open(self.out / f"shard-{index}.log", "a")
        self.logs.append(slog)
        info_path = self.out / f"coordinator-shard-{index}.json"
        info_path.unlink(missing_ok=True)
        port = self.cfg.coordinator.shard_addresses[index - 1].rpartition(":")[2]
        proc = self.shards[index] = subprocess.Popen(
            _cli("coordinator", "--config", str(self.resolved), "--shard", str(index), "--port", port, "--run-dir",
                 str(self.out)), stdout=slog, stderr=subprocess.STDOUT, env=self.coordinator_env)
        t_start = time.perf_counter()
        while not info_path.exists():
            if proc.poll() is not None:
                raise SimulationError(f"coordinator shard {index} exited with status {proc.returncode}; see "
                                      f"{self.out / f'shard-{index}.log'}")
            if time.perf_counter() - t_start > START_TIMEOUT_S:
                raise SimulationError(f"coordinator shard {index} did not start within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.1)

    def _restart_shards(self, index: int) -> None:
        """After range shard ``index`` was killed (a failed coordinator): the lead is killed too, if it has not
        failed already, shard ``index`` starts again on its port, and the lead with ``--resume``, which restores
        every range shard to the version of its checkpoint."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.kill()
            self.coordinator.wait()
        self._start_shard(index)
        self._start_coordinator(resume=True)

    def _end_shards(self) -> None:
        """Ends the range shards (SIGTERM) once the lead has ended; SimulationError if one had failed."""
        for index, proc in self.shards.items():
            if proc.poll() is None:
                proc.terminate()
            if proc.wait(timeout=60) not in (0, -15):
                raise SimulationError(f"coordinator shard {index} failed with status {proc.returncode}; see "
                                      f"{self.out / f'shard-{index}.log'}")

    def _start_worker(self, name: str) -> None:
        """Starts island ``name``: its one worker process, or all P of them (one jax.distributed job)."""
        i = self.names.index(name)
        wdir = self.out / "islands" / name
        port = self.proxies[name].port if name in self.proxies else self.port
        share = self.shares[i]
        inject = []
        for f in self.faults:  # push faults the island injects itself; one that fired is not passed again (but
            # scale and ramp change every push: a restarted Byzantine island is still one)
            if f.kind in PUSH_KINDS and f.target == name and (f.kind in ("scale", "ramp") or not self._push_fired(f)):
                inject += ["--inject", f.inject_arg()]
                self.log.event("fault_armed", fault=f.text, fault_kind=f.kind, target=name, what=f.describe())
        for f in self.faults:  # device faults: passed on every start (a restarted worker still has the bad chip)
            if f.kind in DEVICE_KINDS and f.target == name:
                inject += ["--device-fault", f.worker_arg()]
                self.log.event("fault_armed", fault=f.text, fault_kind=f.kind, target=name, what=f.describe())
        if self.processes > 1 and name not in self.jax_ports:
            self.jax_ports[name] = free_port()
        self.ended.pop(name, None)
        spec = self.specs.get(name)
        own = ["--slowdown", f"{spec.slowdown:g}"] if spec is not None and spec.slowdown != 1.0 else []
        env = self.env if spec is None or spec.host_devices is None else with_host_devices(self.env,
                                                                                          spec.host_devices)
        if self.tokens:  # its own issued token, or (credential=OTHER) another island's
            env = {**env, self.cfg.security.token_env: self.tokens[spec.credential if spec and spec.credential
                                                                    else name]}
        procs = []
        for index in range(self.processes):
            pdir = process_dir(wdir, index)
            pdir.mkdir(parents=True, exist_ok=True)
            wlog = open(pdir / "worker.log", "a")
            self.logs.append(wlog)
            hosts = island_process_flags(self.processes, index, f"127.0.0.1:{self.jax_ports.get(name, 0)}")
            with _pinned(share):
                procs.append(subprocess.Popen(
                    _cli("worker", "--config", str(self.configs[name]), "--coordinator",
                         f"{self.cfg.coordinator.host}:{port}", "--island", name, "--run-dir", str(wdir), *hosts,
                         *inject, *own),
                    stdout=wlog, stderr=subprocess.STDOUT, env=env))
        self.workers[name] = procs
        self.log.event("worker_started", island=name, processes=self.processes, pids=[p.pid for p in procs],
                       jax_coordinator=f"127.0.0.1:{self.jax_ports[name]}" if name in self.jax_ports else None)

    def _running(self, name: str) -> bool:
        """Whether some process of island ``name`` still runs."""
        return any(p.poll() is None for p in self.workers[name])

    def running_processes(self) -> int:
        """How many worker processes (of every island) still run."""
        return sum(p.poll() is None for procs in self.workers.values() for p in procs)

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

    def run(self, timeout_s: float, on_pass: Callable[[], None] = lambda: None) -> None:
        """Starts the coordinator and every island, supervises them until every island has finished (injecting
        the faults as they come due, restarting what recovers), records the faults that never fired, then ends
        the coordinator. ``on_pass``: called after each supervising pass (about 5 a second) and once when the
        islands are done (the driver's status line). Raises SimulationError for a worker or coordinator that
        failed, or for workers still running ``timeout_s`` seconds after they were started."""
        self._start_all()
        pending = self._supervise(timeout_s, on_pass)
        self._record_not_injected(pending)
        failed = self._failures()
        if failed:
            raise SimulationError("workers failed: " + "; ".join(failed))
        coord = self.coordinator
        if coord is not None:
            if coord.poll() is None:
                coord.terminate()
            if coord.wait(timeout=60) not in (0, -15):
                raise SimulationError(f"the coordinator failed with status {coord.returncode}")
        self._end_shards()

    def _start_all(self) -> None:
        """Starts the coordinator, the link proxies of the islands that have link faults or a link of their own
        (``link=RATE/RTT``), and every island; a sharded coordinator's range shards first."""
        for index in range(1, self.cfg.coordinator.shards):
            self._start_shard(index)
        self._start_coordinator(resume=self.resume)
        address = f"{self.cfg.coordinator.host}:{self.port}"
        shaped = {name: spec.link for name, spec in self.specs.items() if spec.link is not None}
        for name in sorted({f.target for f in self.faults if f.kind in LINK_KINDS} | set(shaped)):
            self.proxies[name] = LinkProxy(self.port, self.cfg.coordinator.host, shape=shaped.get(name))
        islands = f"{self.islands} workers" if self.processes == 1 else \
            f"{self.islands} islands of {self.processes} worker processes"
        self.log.progress(f"coordinator at {address}; starting {islands}"
                          + (f", pinned to CPUs {self.shares}" if self.shares[0] is not None else "")
                          + (f"; {len(self.faults)} fault(s) to inject" if self.faults else ""))
        for name in self.names:
            self._start_worker(name)
        self.t_workers = time.perf_counter()

    def _supervise(self, timeout_s: float, on_pass: Callable[[], None]) -> list[FaultSpec]:
        """Waits for every island not killed for good, injecting the driver's faults as they come due and
        running the recoveries, calling ``on_pass`` after each pass; returns the driver's faults that never came
        due."""
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
            for due, action in [r for r in self.recoveries if r[0] <= time.perf_counter()]:  # +0s: this pass
                self.recoveries.remove((due, action))
                action()
            self._end_broken_islands()
            ended_at = self._watch_coordinator(ended_at, now)
            on_pass()
            time.sleep(0.2)
        on_pass()
        return pending

    def _watch_coordinator(self, ended_at: float, now: float) -> float:
        """Raises SimulationError if the coordinator failed (not killed by a fault that restarts it); once it
        has exited at the run's end, stops the islands still away a few leases later (:meth:`_stop_stragglers`).
        ``ended_at``: when it was first seen exited (0: not yet); returns that, updated."""
        coord = self.coordinator
        restarting = any(f["kind"] == "kill-coordinator" and f.get("recovered_t") is None for f in self.fired)
        if coord is not None and coord.poll() not in (None, 0) and not restarting:
            raise SimulationError(f"the coordinator failed with status {coord.returncode}; "
                                  f"see {self.out / 'coordinator.log'}")
        for index, proc in self.shards.items():
            if proc.poll() is not None and not restarting:
                raise SimulationError(f"coordinator shard {index} exited with status {proc.returncode}; see "
                                      f"{self.out / f'shard-{index}.log'}")
        if coord is not None and coord.poll() == 0 and not self.recoveries:
            # The run is over and the coordinator has gone: an island that was away (hung, cut off) can no
            # longer learn that from it. Give it a few leases to finish, then stop it.
            ended_at = ended_at or now
            if now - ended_at > max(5.0, 2 * self.cfg.coordinator.lease_s):
                self._stop_stragglers()
        return ended_at

    def _record_not_injected(self, pending: Sequence[FaultSpec]) -> None:
        """Records every fault that never fired, and why (a ``fault_not_injected`` event, a progress line and
        an entry of :attr:`not_injected`): ``pending`` (the driver's faults that never came due), push faults
        whose island made no push late enough, device faults whose island never ran their start step."""
        missed = [(f, "the run ended first") for f in pending]
        missed += [(f, f"{f.target} made no push based on version {f.at_version} or later") for f in self.faults
                   if f.kind in PUSH_KINDS and not self._push_fired(f)]
        for f in self.faults:
            if f.device_fault is not None and not device_fault_reached(
                    f, run_events(self.out / "islands" / f.target)):
                missed.append((f, f"{f.target} never trained past inner step {f.device_fault.start}"))
        for f, reason in missed:
            self.log.event("fault_not_injected", fault=f.text, reason=reason)
            self.log.progress(f"fault {f.text}: not injected ({reason})")
            self.not_injected.append({"fault": f.text, "reason": reason})

    def _failures(self) -> list[str]:
        """The worker processes that failed (exited non-zero) on their own, for the run's error: each one's island,
        its process (with several per island), its status, the last line of its log and where the log is. Islands
        killed for good or stopped by the driver are left out, and so are the processes the driver killed because
        another process of their island had failed (:meth:`_end_broken_islands`). An island that presents another's
        credential (``--island NAME:credential=OTHER``) and failed is recorded in :attr:`refused` instead: the
        coordinator refusing it is what such a run tests."""
        out = []
        for name, procs in self.workers.items():
            if name in self.gone | self.stopped | self.late:
                continue
            for index, p in enumerate(procs):
                if p.poll() not in (None, 0) and self.ended.get(name, index) == index:
                    log = process_dir(Path("islands") / name, index) / "worker.log"
                    spec = self.specs.get(name)
                    if spec is not None and spec.credential:
                        self.refused[name] = _last_line(self.out / log)
                        continue
                    who = name if self.processes == 1 else f"{name} process {index}"
                    out.append(f"{who} (status {p.returncode}: {_last_line(self.out / log)}; see {log})")
        return out

    def _stop_stragglers(self) -> None:
        """Terminates the islands still running after the run ended without them (a ``worker_stopped`` event).
        An island whose events already hold ``island_finished`` did finish (its summary is written; on a loaded
        machine its process can take longer than the grace to exit): it is terminated but counts as finished."""
        for name, procs in self.workers.items():
            if self._running(name):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait(timeout=30)
                if any(e.get("event") == "island_finished" for e in run_events(self.out / "islands" / name)):
                    self.late.add(name)  # its SIGTERM status is the driver's doing, not a failure (_failures)
                    self.log.progress(f"{name}: finished, but its process had not exited a few leases after the "
                                      f"coordinator's: terminated")
                    continue
                self.stopped.add(name)
                self.log.event("worker_stopped", island=name,
                               reason="the coordinator finished the run and exited; this island had not finished")
                self.log.progress(f"{name}: stopped (the run ended while it was away)")

    def stop_all(self) -> None:
        """SIGKILLs every process still running, closes the link proxies and the processes' log files."""
        for p in (p for procs in self.workers.values() for p in procs):
            if p.poll() is None:
                p.kill()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.kill()
        for proc in self.shards.values():
            if proc.poll() is None:
                proc.kill()
        for proxy in self.proxies.values():
            proxy.close()
        for f in self.logs:
            f.close()

    # -- faults ------------------------------------------------------------------------------------

    def _due(self, f: FaultSpec, version: int, now: float) -> bool:
        """Whether the driver's fault ``f`` is due: ``version`` merged, or its seconds since the workers started."""
        if f.at_version is not None:
            return version >= f.at_version
        return f.at_s is not None and now - self.t_workers >= f.at_s

    def _inject(self, f: FaultSpec, version: int) -> None:
        """Fires the driver's fault ``f`` (``version``: the version merged now) and records it (a ``fault_injected``
        event, an entry of :attr:`fired`); schedules its recovery ``f.duration_s`` later, where it has one, or
        else takes a killed island for gone."""
        record = self.log.event("fault_injected", fault=f.text, fault_kind=f.kind, target=f.target, version=version,
                                what=f.describe())
        entry = {"fault": f.text, "kind": f.kind, "target": f.target, "injected_t": record["t"], "version": version,
                 "recovered_t": None}
        self.fired.append(entry)
        self.log.progress(f"fault: {f.describe()} (version {version})")
        later = (time.perf_counter() + f.duration_s) if f.duration_s is not None else None  # +0s: at once
        what, action = self._fire(f)
        if later is not None:
            self.recoveries.append((later, lambda: self._recover(entry, what, action)))
        elif f.kind == "kill":
            self.gone.add(f.target)

    def _fire(self, f: FaultSpec) -> tuple[str, Callable[[], None]]:
        """Does what the driver's fault ``f`` does (kill, hang, kill-coordinator, cut, slow); returns its
        recovery: what it does, in words, and the action."""
        if f.kind == "kill":
            self._kill(f.target)
            return "restarted", lambda: self._start_worker(f.target)
        if f.kind == "hang":
            self._signal(f.target, signal.SIGSTOP)
            return "resumed (SIGCONT)", lambda: self._signal(f.target, signal.SIGCONT)
        if f.kind == "kill-coordinator" and f.shard:
            proc = self.shards[f.shard]
            proc.kill()
            proc.wait()
            return "every shard restarted from the checkpoints", lambda: self._restart_shards(f.shard)
        if f.kind == "kill-coordinator":
            assert self.coordinator is not None
            self.coordinator.kill()
            self.coordinator.wait()
            return "restarted with --resume", lambda: self._start_coordinator(resume=True)
        assert f.kind in LINK_KINDS, f
        proxy = self.proxies[f.target]
        if f.kind == "cut":
            proxy.cut()
        else:
            proxy.slow(f.delay_ms / 1000.0)
        return "link restored", proxy.restore

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

    def _push_fired(self, f: FaultSpec) -> bool:
        """Whether push fault ``f`` has fired: its island's events hold its ``fault_injected``."""
        return push_fault_event(f, run_events(self.out / "islands" / f.target)) is not None

    def _recover(self, entry: dict[str, Any], what: str, action: Callable[[], None]) -> None:
        """Runs a fault's recovery ``action`` and records it (``what``) in its :attr:`fired` ``entry``."""
        action()
        record = self.log.event("fault_recovered", fault=entry["fault"], action=what)
        entry["recovered_t"], entry["recovery"] = record["t"], what
        self.log.progress(f"fault {entry['fault']}: {what}")


def run_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events in ``run_dir`` ([] if none yet), less lines torn by a process the driver killed mid-write."""
    return read_events(run_dir, skip_torn=True, missing_ok=True)


def _last_line(path: Path) -> str:
    """The last non-blank line of a process's log (300 characters at most), for the run's error."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "empty log"


def _merged_versions(out: Path) -> int:
    """How many versions the coordinator in ``out`` has merged so far (0 before its events file exists)."""
    try:
        with open(out / "events.jsonl") as f:
            return sum(1 for line in f if '"round_merged"' in line)
    except OSError:
        return 0
