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

What the driver owns is the processes and the faults it injects (when one comes due, its recovery). The
``--fault`` grammar is :mod:`dtrain_cli.fault_spec`, link faults act through :mod:`dtrain_cli.link_proxy`,
the summary's fault entries are scored by :mod:`dtrain_cli.fault_score`, and the status line is
:mod:`dtrain_cli.run_watch`.
"""

from __future__ import annotations

import json
import math
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

from dtrain.audit import Audit, AuditError, AuditParams, audit
from dtrain.config.load import data_cache, replace, to_toml
from dtrain.config.sections import Config, ConfigError
from dtrain.data.corpus import names_store, open_corpus, store_location
from dtrain.errors import DtrainError
from dtrain.net.identity import hash_line, issue_token
from dtrain.runlog import EventTail, RunLog, process_dir, read_events
from dtrain_cli.fault_score import device_fault_reached, device_quarantines, push_fault_event, score_faults
from dtrain_cli.fault_spec import DEVICE_KINDS, LINK_KINDS, PUSH_KINDS, FaultSpec, check_devices, host_device_count
from dtrain_cli.island_spec import IslandSpec, island_config, run_config
from dtrain_cli.link_proxy import LinkProxy
from dtrain_cli.run_watch import RunWatch

START_TIMEOUT_S = 120.0
STATUS_EVERY_S = 10.0  # the driver's status line, when not on a terminal: one every this many seconds


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
                   faults: Sequence[FaultSpec] = (), island_processes: int = 1,
                   island_specs: dict[str, IslandSpec] | None = None, own_tokens: bool = False,
                   coordinator_shards: int | None = None) -> dict[str, Any]:
    """Runs a coordinator and ``islands`` islands of ``island_processes`` worker processes each, in a new run
    folder of ``cfg`` (``RUN_DIR``), until the run ends.

    Args:
        cfg: the run's config (``outer.islands`` is set to ``islands``; the dashboard, if on, takes a free port).
        islands: how many islands.
        quiet: no progress or status lines from the driver (its events are written all the same).
        timeout_s: raise SimulationError if workers still run this many seconds after they were started.
        env: set in the environment of every process (e.g. ``XLA_FLAGS`` for fake CPU devices).
        pin: give each island its own share of this host's CPUs (:func:`cpu_shares`; Linux), as an island owns
            its hardware in production; all the processes of an island share its share. Unpinned, 4 workers on
            2 cores drift apart by 10-20% per round under the scheduler and the fast ones wait for the slow
            ones; the coordinator is never pinned.
        faults: injected while the run goes on (:mod:`dtrain_cli.fault_spec`); each is an event in
            ``RUN_DIR/driver/events.jsonl`` (a push fault: ``fault_armed`` when its worker is started with it,
            and ``fault_injected`` in the island's events when it fires; a device fault: ``fault_armed`` each
            time its island's worker is started with it) and, scored against what the run detected
            (:mod:`dtrain_cli.fault_score`), in the summary's ``faults`` and ``device_quarantines``; the ones
            that never fired, and why, in ``faults_not_injected``; each restart of a killed island, from the kill
            to its first step, in ``restarts`` (:func:`restarts`).
        island_processes: P > 1 makes every island one ``jax.distributed`` job of P processes (each with the
            fake devices ``env`` gives one process, so P times that many per island), on a free port of
            127.0.0.1 chosen at the island's first start and kept across its restarts. Faults act on the whole
            island: a kill SIGKILLs (and a restart starts) all its processes, a hang stops and continues all of
            them; push faults are passed to every process (process 0 sends the pushes); link faults sit between
            process 0 and the coordinator. Device faults and chip health are refused
            (:func:`check_island_processes`). Every start of an island (a restart too) is a ``worker_started``
            event in ``RUN_DIR/driver/events.jsonl``: its processes' ids and its ``jax_coordinator`` (None for
            single-process islands).
        island_specs: islands' own settings (:mod:`dtrain_cli.island_spec`: ``--island``): each such island's
            worker reads ``RUN_DIR/islands/NAME/config.toml`` (the run's config with its overrides; with islands
            of their own batch size the run's ``train.base_batch_size`` is pinned to its batch), gets its own fake
            CPU devices and slowdown; the summary's ``island_settings`` says what each had. An island given another's
            credential (``credential=OTHER``, with ``own_tokens``) that fails (the coordinator refuses it at Join)
            is listed in the summary's ``refused_islands`` with its log's last line, not raised as a failure.
        own_tokens: an identity per island (``dtrain simulate --island-tokens``): ``security.identity = "token"``,
            each island its own issued token (:func:`issue_island_tokens`).
        coordinator_shards: S > 1 (``--coordinator-shards``; None: ``coordinator.shards``): a sharded coordinator,
            range shards 1..S-1 (``dtrain coordinator --shard I``, each on a free port chosen before they start,
            kept across restarts) started before the lead, with a shard secret the driver writes to
            ``RUN_DIR/shard-secret``; each writes ``RUN_DIR/shard-I.log``. Link faults and links are refused
            with it (the proxies sit before the lead only).

    Returns the run's summary, also written to ``RUN_DIR/summary.json``. Its ``goodput`` and ``audit`` (lost
    and doubled tokens, gaps, overlaps) come from the coordinator's and every island process's events
    (:mod:`dtrain.audit`): every process that ran as an island's process 0 (its restarts included); the other
    processes of a multi-process island run the same steps in lockstep, so their events would count the
    island's steps twice. ``bit_identical_final_params``: every process of every finished island ended on the
    same θ. Raises ConfigError or SimulationError for what cannot run, before any process starts, and
    SimulationError for a process that failed."""
    from dtrain.train.runs import new_run, run_dir

    specs = island_specs or {}
    cfg, worker_env = _checked_run(cfg, islands, env, faults, island_processes, specs, own_tokens)
    cfg = new_run(run_config(cfg, specs))
    # Before any process starts: a source that is not a store becomes one here, once, not in every worker; the
    # processes read that store (finding it again from its source would scan the source at every start).
    cache = data_cache(cfg)
    if not names_store(cfg.data.source):
        cfg = replace(cfg, data={"source": str(Path(store_location(cfg.data, cache)).resolve())})
    open_corpus(cfg.data, cfg.model.vocab_size, cache)
    out = run_dir(cfg).resolve()
    out.mkdir(parents=True)
    cfg, tokens = issue_island_tokens(cfg, out, islands) if own_tokens else (cfg, {})
    cfg = shard_config(cfg, out, coordinator_shards, faults, specs, island_processes)
    if not cfg.worker.compile_cache:  # one compilation cache for the run: a restarted island loads its programs
        cfg = replace(cfg, worker={"compile_cache": str(out / "compile-cache")})
    sim = _Simulation(cfg, out, islands, quiet, worker_env, pin, list(faults), island_processes, specs, tokens)
    try:
        sim.run(timeout_s)
    finally:
        sim.stop_all()
    return sim.summarize()


def _checked_run(cfg: Config, islands: int, env: dict[str, str] | None, faults: Sequence[FaultSpec],
                 island_processes: int, specs: dict[str, IslandSpec] | None = None,
                 own_tokens: bool = False) -> tuple[Config, dict[str, str]]:
    """What :func:`run_simulation` checks before anything starts: returns the config the run's processes read
    (``islands`` islands, the dashboard on a free port) and the workers' environment; raises ConfigError or
    SimulationError for what cannot run."""
    check_island_processes(island_processes, cfg, faults)
    if islands != cfg.outer.islands:
        cfg = replace(cfg, outer={"islands": islands})
    if cfg.coordinator.dashboard_port > 0:  # the driver's coordinator takes free ports, a restart included
        cfg = replace(cfg, coordinator={"dashboard_port": 0})
    resumed = any(f.kind == "kill-coordinator" and f.duration_s is not None for f in faults)
    if resumed and not cfg.coordinator.checkpoint:
        raise SimulationError("kill-coordinator with a restart needs coordinator.checkpoint = true (it resumes)")
    sec = cfg.security
    borrowed = [s.name for s in (specs or {}).values() if s.credential]
    if borrowed and not own_tokens:
        raise ConfigError(f"--island {borrowed[0]}:credential=...: needs --island-tokens (a token per island; "
                          f"without it every island presents the same credential already)")
    if own_tokens and not sec.token_env:
        raise ConfigError("--island-tokens: the islands' tokens are passed in security.token_env, which is empty; "
                          "set it (e.g. DTRAIN_TOKEN)")
    if sec.identity == "token" and not own_tokens:
        raise ConfigError(f"security.identity = token: dtrain simulate cannot give its islands the tokens of "
                          f"{sec.island_tokens}; pass --island-tokens (it issues one per island)")
    worker_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    check_devices(faults, host_device_count(worker_env))  # the workers' fake CPU devices, where the env says
    return cfg, worker_env


def shard_config(cfg: Config, out: Path, shards: int | None, faults: Sequence[FaultSpec],
                 specs: dict[str, IslandSpec], processes: int = 1) -> Config:
    """``cfg`` for a sharded coordinator of ``shards`` processes (None: ``coordinator.shards``): a shard secret
    written to ``out/shard-secret`` (owner-only) and a free port of 127.0.0.1 for each range shard, named in
    ``coordinator.shard_addresses``. ``cfg`` as it is for one coordinator."""
    shards = cfg.coordinator.shards if shards is None else shards
    beyond = [f.text for f in faults if f.shard >= shards]
    if beyond:
        raise ConfigError(f"--fault {beyond[0]}: the coordinator has {shards} shard(s) (--coordinator-shards), "
                          f"numbered 0..{shards - 1}")
    if shards == 1:
        return replace(cfg, coordinator={"shards": 1})
    if processes > 1:
        raise ConfigError("--coordinator-shards with --island-processes > 1 is not built yet (an island's other "
                          "processes would check θ by the unsharded digest)")
    linked = [f.text for f in faults if f.kind in LINK_KINDS] + [n for n, s in specs.items() if s.link is not None]
    if linked:
        raise ConfigError(f"--coordinator-shards with a link ({linked[0]}): the link proxies sit before the lead "
                          f"only; drop one of them")
    path = out / "shard-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(issue_token())
    host = cfg.coordinator.host
    return replace(cfg, coordinator={"shards": shards, "shard_secret_file": str(path),
                                                "shard_addresses": tuple(f"{host}:{free_port(host)}"
                                                                         for _ in range(shards - 1))})


def issue_island_tokens(cfg: Config, out: Path, islands: int) -> tuple[Config, dict[str, str]]:
    """An identity per island (``--island-tokens``): one token issued per island (``dtrain.net.identity.issue_token``),
    their hashes written to ``out/island-tokens`` (owner-only); returns ``cfg`` with ``security.identity = "token"``
    and that file as its ``island_tokens``, and the tokens by island name (each worker gets its own in
    ``security.token_env``)."""
    tokens = {f"island-{i}": issue_token() for i in range(islands)}
    path = out / "island-tokens"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(hash_line(name, token) + "\n" for name, token in tokens.items()))
    return replace(cfg, security={"identity": "token", "island_tokens": str(path)}), tokens


class _Simulation:
    """The driver's processes (a coordinator, N islands of P worker processes, their restarts) and the faults it
    injects."""

    def __init__(self, cfg: Config, out: Path, islands: int, quiet: bool, env: dict[str, str], pin: bool,
                 faults: list[FaultSpec], processes: int = 1, specs: dict[str, IslandSpec] | None = None,
                 tokens: dict[str, str] | None = None):
        self.cfg, self.out, self.islands, self.env = cfg, out, islands, env
        self.tokens = tokens or {}  # island -> its issued token (security.identity token)
        self.refused: dict[str, str] = {}  # islands with another's credential that failed: their log's last line
        self.specs = specs or {}
        self.processes = processes
        self.resolved = out / "config.toml"
        self.resolved.write_text(to_toml(cfg))  # every process reads exactly this config
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
        self.late: set[str] = set()  # islands that finished but were terminated, slow to exit: no failure
        self.coordinator: subprocess.Popen | None = None
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
        expected = cfg.rounds if cfg.coordinator.mode == "sync" else cfg.rounds * islands
        shard_end = 0 if cfg.worker.round_seconds else cfg.train.shard_sequences  # sequences per shard
        self.watch = RunWatch(islands, expected, shard_end, processes)
        self.tails = {"": EventTail(out), **{n: EventTail(out / "islands" / n) for n in self.names}}
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

    def _start_shard(self, index: int) -> None:
        """Starts range shard ``index`` of a sharded coordinator on its port and waits until it listens."""
        slog = open(self.out / f"shard-{index}.log", "a")
        self.logs.append(slog)
        info_path = self.out / f"coordinator-shard-{index}.json"
        info_path.unlink(missing_ok=True)
        port = self.cfg.coordinator.shard_addresses[index - 1].rpartition(":")[2]
        proc = self.shards[index] = subprocess.Popen(
            _cli("coordinator", "--config", str(self.resolved), "--shard", str(index), "--port", port, "--run-dir",
                 str(self.out)), stdout=slog, stderr=subprocess.STDOUT, env=self.env)
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
        """Starts the coordinator and every island, supervises them until every island has finished (injecting
        the faults as they come due, restarting what recovers), records the faults that never fired, then ends
        the coordinator. Raises SimulationError for a worker or coordinator that failed, or for workers still
        running ``timeout_s`` seconds after they were started."""
        self._start_all()
        pending = self._supervise(timeout_s)
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
        self._start_coordinator(resume=False)
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

    def _supervise(self, timeout_s: float) -> list[FaultSpec]:
        """Waits for every island not killed for good, injecting the driver's faults as they come due and
        running the recoveries; returns the driver's faults that never came due."""
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
            self._show_status()
            time.sleep(0.2)
        self._show_status()
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
            if f.device_fault is not None and not device_fault_reached(f, _events(self.out / "islands" / f.target)):
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
                if any(e.get("event") == "island_finished" for e in _events(self.out / "islands" / name)):
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
        return push_fault_event(f, _events(self.out / "islands" / f.target)) is not None

    def _recover(self, entry: dict[str, Any], what: str, action: Callable[[], None]) -> None:
        """Runs a fault's recovery ``action`` and records it (``what``) in its :attr:`fired` ``entry``."""
        action()
        record = self.log.event("fault_recovered", fault=entry["fault"], action=what)
        entry["recovered_t"], entry["recovery"] = record["t"], what
        self.log.progress(f"fault {entry['fault']}: {what}")

    # -- the summary -------------------------------------------------------------------------------

    def summarize(self) -> dict[str, Any]:
        """The run's summary (see :func:`run_simulation`), from the islands' summaries and the run's events;
        written to ``RUN_DIR/summary.json`` and the driver's log, which it closes."""
        out, wall = self.out, time.perf_counter() - self.t0
        coord_events = _events(out)
        island_events = {n: _events(out / "islands" / n) for n in self.names}
        checked = _audit(self.cfg, out, coord_events, island_events)
        summary = _run_summary(self, wall, coord_events, island_events, checked)
        self.log.event("run_finished", **{k: v for k, v in summary.items() if k != "islands"})
        self.log.write_summary(summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.log.progress(_done_line(summary, checked, out / "summary.json"))
        self.log.close()
        return summary


def _run_summary(sim: _Simulation, wall: float, coord_events: list[dict[str, Any]],
                 island_events: dict[str, list[dict[str, Any]]], checked: Audit) -> dict[str, Any]:
    """The summary of ``sim``'s run (``wall`` seconds long) from its finished islands' summaries (every
    process's) and the run's events; raises SimulationError if the islands did not end on one θ."""
    out, cfg = sim.out, sim.cfg
    unfinished = sim.gone | sim.stopped | set(sim.refused)
    # an island the coordinator quarantined (coordinator.max_rejections) was told to stop early, on its own θ
    quarantined = {n for n in sim.names for e in coord_events
                   if e.get("event") == "island_quarantined" and str(e.get("island", "")).startswith(n + "-")}
    finished = [n for n in sim.names if n not in unfinished | quarantined]
    if not finished:
        raise SimulationError(f"no island finished the run ({len(quarantined)} of {len(sim.names)} quarantined by "
                              f"the coordinator, the others lost or stopped): see {out / 'coordinator.log'}")
    per_island = [json.loads((out / "islands" / n / "summary.json").read_text()) for n in finished]
    # the other processes of each island: the same θ and eval as its process 0 (its tokens and bytes are
    # process 0's alone, the one that pushes)
    followers = [json.loads((process_dir(out / "islands" / n, i) / "summary.json").read_text())
                 for n in finished for i in range(1, sim.processes)]
    evals = {round(s["final_eval_loss"], 6) for s in per_island + followers}
    digests = {s["params_digest"] for s in per_island + followers}
    summary = {
        "mode": "simulate-processes", "final_eval_loss": per_island[0]["final_eval_loss"],
        "rounds": max(s["version"] for s in per_island), "tokens": sum(s["tokens"] for s in per_island),
        "bytes_up": sum(s["bytes_up"] for s in per_island), "bytes_down": sum(s["bytes_down"] for s in per_island),
        "wall_s": wall, "islands": per_island, "run_dir": str(out),
        "utilization": min(s["utilization"] for s in per_island),
        "compression_ratio": sum(s["compression_ratio"] for s in per_island) / len(per_island),
        "bit_identical_final_params": len(digests) == 1, "codec": {"up": cfg.codec.up, "down": cfg.codec.down},
        "worker_cpus": sim.shares, "island_processes": sim.processes,
        "faults": score_faults(sim.fired, sim.faults, coord_events, island_events),
        "device_quarantines": device_quarantines(island_events, [f for f in sim.faults if f.kind in DEVICE_KINDS]),
        "faults_not_injected": sim.not_injected,
        "restarts": restarts(sim.fired, island_events),
        "island_settings": {n: s.describe() for n, s in sim.specs.items()},
        "goodput": checked.goodput, "audit": checked.to_dict(),
        "unfinished_islands": sorted(unfinished),
        "quarantined_islands": sorted(quarantined),
        "refused_islands": dict(sorted(sim.refused.items())),
    }
    if len(digests) != 1 or len(evals) != 1:
        raise SimulationError(f"islands ended with different parameters: digests {sorted(digests)}")
    return summary


def restarts(fired: Sequence[dict[str, Any]], island_events: dict[str, list[dict[str, Any]]]
             ) -> list[dict[str, Any]]:
    """Each restart of a killed island (a ``kill`` fault with a recovery, from the driver's ``fired`` records):
    ``restart_s``, the seconds from the kill to the restarted island's first step (its ``island_startup`` event,
    :mod:`workers.startup`; None if it took none before the run ended or the island was killed again), and that
    start's phases (seconds, and CPU seconds) and compilation-cache counts."""
    out = []
    for i, f in enumerate(fired):
        if f["kind"] != "kill" or f.get("recovered_t") is None:
            continue
        again = next((g["injected_t"] for g in fired[i + 1:] if g["kind"] == "kill" and g["target"] == f["target"]),
                     math.inf)
        start = next((e for e in island_events.get(f["target"], []) if e["event"] == "island_startup"
                      and f["recovered_t"] <= e["t"] < again), None)
        out.append({"fault": f["fault"], "island": f["target"], "killed_t": f["injected_t"],
                    "restarted_t": f["recovered_t"], "first_step_t": None if start is None else start["t"],
                    "restart_s": None if start is None else round(start["t"] - f["injected_t"], 3),
                    **{k: None if start is None else start.get(k)
                       for k in ("phases", "cpu_s", "cache_hits", "cache_misses")}})
    return out


def with_host_devices(env: dict[str, str], devices: int) -> dict[str, str]:
    """``env`` with ``XLA_FLAGS`` giving a process ``devices`` fake CPU devices (any device count it gave
    replaced)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return {**env, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The events in ``run_dir`` ([] if none yet), less lines torn by a process the driver killed mid-write."""
    return read_events(run_dir, skip_torn=True, missing_ok=True)


def _audit(cfg: Config, out: Path, coord_events: list[dict[str, Any]], island_events: dict[str, list[dict[str, Any]]]
           ) -> Audit:
    """The token-range audit and goodput (:mod:`dtrain.audit`) of the run in ``out`` from the coordinator's
    events and every island's (all its processes'); raises SimulationError for events it cannot audit."""
    try:
        return audit(coord_events, island_events, AuditParams.from_config(cfg))
    except AuditError as e:
        raise SimulationError(f"token-range audit of {out}: {e}") from None


def _done_line(summary: dict[str, Any], checked: Audit, path: Path) -> str:
    """The driver's last progress line: the run's ``summary`` in one line, written to ``path``."""
    return (f"done: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, "
            f"{summary['tokens']:,} tokens, {(summary['bytes_up'] + summary['bytes_down']) / 1e6:.2f} MB "
            f"on the wire, compression {summary['compression_ratio']:.1f}x, utilization "
            f"{summary['utilization']:.3f}, goodput {_fmt_goodput(checked.goodput)}, "
            f"lost {checked.lost_tokens:,} / doubled {checked.doubled_tokens:,} tokens, "
            f"{summary['wall_s']:.1f}s -> {path}")


def _fmt_goodput(goodput: float | None) -> str:
    return "n/a (no step executed)" if goodput is None else f"{goodput:.3f}"


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
