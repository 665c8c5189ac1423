"""``dtrain simulate`` in its default mode: one coordinator and N worker processes on loopback.

:func:`run_simulation` is the entry point: it checks up front what cannot run (before any process starts), makes
the run folder and what its processes read there (the resolved config, the data store, the islands' tokens, a
sharded coordinator's secret and ports), then runs the processes (:mod:`dtrain_cli.simulate_processes`: the
coordinator, the workers, their restarts and the faults applied to them) with the driver's status line, and
returns the run's summary (:mod:`dtrain_cli.simulate_report`). The driver imports neither ``coordinator`` nor
``workers``: they meet only through the protocol.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.config.load import data_cache, replace
from dtrain.config.sections import Config, ConfigError
from dtrain.data.corpus import names_store, open_corpus, store_location
from dtrain.data.mixture import open_mixture
from dtrain.net.identity import hash_line, issue_token
from dtrain_cli.fault_spec import DEVICE_KINDS, LINK_KINDS, FaultSpec, check_devices, host_device_count
from dtrain_cli.gpu_share import memory_share_env, workers_platform
from dtrain_cli.island_spec import IslandSpec, run_config
from dtrain_cli.simulate_processes import Simulation, SimulationError, free_port
from dtrain_cli.simulate_report import Interrupted, StatusLine, interrupted, summarize


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


def resume_args(args: argparse.Namespace) -> None:
    """``simulate``: --config or --resume RUN_DIR (then the run's own config.toml, and none of the flags that
    would change the run)."""
    if args.resume is None:
        if args.config is None:
            raise ConfigError("dtrain simulate needs --config (or --resume RUN_DIR to continue an interrupted run)")
        return
    changed = [flag for flag, on in (("--config", args.config), ("--set", args.overrides), ("--fault", args.faults),
                                     ("--islands", args.islands is not None), ("--island", args.island_specs),
                                     ("--inprocess", args.inprocess), ("--link", args.link)) if on]
    if changed:
        raise ConfigError(f"--resume {args.resume}: {changed[0]} cannot be given with it (a resumed run goes on with "
                          f"its own config, {args.resume}/config.toml, islands and faults)")
    args.config = str(Path(args.resume) / "config.toml")
    if not Path(args.config).is_file():
        raise ConfigError(f"--resume {args.resume}: no config.toml there: not a run folder dtrain simulate wrote")


def run_simulation(cfg: Config, islands: int, quiet: bool = False, timeout_s: float = 3600.0,
                   env: dict[str, str] | None = None, pin: bool = True,
                   faults: Sequence[FaultSpec] = (), island_processes: int = 1,
                   island_specs: dict[str, IslandSpec] | None = None, own_tokens: bool = False,
                   coordinator_shards: int | None = None, resume_dir: str | Path | None = None) -> dict[str, Any]:
    """Runs a coordinator and ``islands`` islands of ``island_processes`` worker processes each, in a new run
    folder of ``cfg`` (``RUN_DIR``), until the run ends.

    Args:
        cfg: the run's config (``outer.islands`` is set to ``islands``; the dashboard, if on, takes a free port).
        islands: how many islands.
        quiet: no progress or status lines from the driver (its events are written all the same).
        timeout_s: raise SimulationError if workers still run this many seconds after they were started.
        env: set in the environment of every process (e.g. ``XLA_FLAGS`` for fake CPU devices).
        pin: give each island its own share of this host's CPUs (:func:`dtrain_cli.simulate_processes.cpu_shares`;
            Linux), as an island owns its hardware in production; all the processes of an island share its share.
            Unpinned, 4 workers on 2 cores drift apart by 10-20% per round under the scheduler and the fast ones
            wait for the slow ones; the coordinator is never pinned.
        faults: injected while the run goes on (:mod:`dtrain_cli.fault_spec`); each is an event in
            ``RUN_DIR/driver/events.jsonl`` (a push fault: ``fault_armed`` when its worker is started with it,
            and ``fault_injected`` in the island's events when it fires; a device fault: ``fault_armed`` each
            time its island's worker is started with it) and, scored against what the run detected
            (:mod:`dtrain_cli.fault_score`), in the summary's ``faults`` and ``device_quarantines``; the ones
            that never fired, and why, in ``faults_not_injected``; each restart of a killed island, from the kill
            to its first step, in ``restarts`` (:func:`dtrain_cli.simulate_report.restarts`).
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
        resume_dir: continue the interrupted run in this folder (``dtrain simulate --resume RUN_DIR``): ``cfg`` is
            its ``config.toml``; the coordinator starts with ``--resume`` (its last checkpoint), each island's worker
            in its own folder (its own checkpoint); the driver's events and the run's summary go on in that folder.
            Runs with islands' own tokens or settings, or a sharded coordinator, are not resumed this way.

    Ctrl-C (SIGINT) stops every process, writes a partial summary (:func:`dtrain_cli.simulate_report.interrupted`)
    and raises :class:`dtrain_cli.simulate_report.Interrupted`, whose message is the command that resumes.

    Returns the run's summary, also written to ``RUN_DIR/summary.json``. Its ``goodput`` and ``audit`` (lost
    and doubled tokens, gaps, overlaps) come from the coordinator's and every island process's events
    (:mod:`dtrain.audit`): every process that ran as an island's process 0 (its restarts included); the other
    processes of a multi-process island run the same steps in lockstep, so their events would count the
    island's steps twice. ``bit_identical_final_params``: every process of every finished island ended on the
    same θ. Raises ConfigError or SimulationError for what cannot run, before any process starts, and
    SimulationError for a process that failed."""
    from dtrain.train.runs import new_run, run_dir

    t0 = time.time()  # the driver's elapsed clock starts here, before the data is prepared
    specs = island_specs or {}
    if resume_dir is not None:
        return _resume(cfg, Path(resume_dir).resolve(), quiet, timeout_s, env, pin, island_processes)
    cfg, worker_env = _checked_run(cfg, islands, env, faults, island_processes, specs, own_tokens)
    cfg = new_run(run_config(cfg, specs))
    # Before any process starts: a source that is not a store becomes one here, once, not in every worker; the
    # processes read that store (finding it again from its source would scan the source at every start).
    cache = data_cache(cfg)
    if cfg.data.mixed:  # data.sources: every store opened and checked to mix, before any process starts
        open_mixture(cfg.data, cfg.model.vocab_size, cache)
    else:
        if not names_store(cfg.data.source):
            made = store_location(cfg.data, cache, cfg.model.vocab_size)
            cfg = replace(cfg, data={"source": str(Path(made).resolve())})
        open_corpus(cfg.data, cfg.model.vocab_size, cache)
    out = run_dir(cfg).resolve()
    out.mkdir(parents=True)
    cfg, tokens = issue_island_tokens(cfg, out, islands) if own_tokens else (cfg, {})
    cfg = shard_config(cfg, out, coordinator_shards, faults, specs, island_processes)
    if not cfg.worker.compile_cache:  # one compilation cache for the run: a restarted island loads its programs
        cfg = replace(cfg, worker={"compile_cache": str(out / "compile-cache")})
    sim = Simulation(cfg, out, islands, quiet, worker_env, pin, list(faults), island_processes, specs, tokens, t0)
    return _run(sim, timeout_s)


def _run(sim: Simulation, timeout_s: float) -> dict[str, Any]:
    """Runs ``sim`` to its summary; Ctrl-C: :class:`Interrupted`, after the partial summary."""
    try:
        sim.run(timeout_s, on_pass=StatusLine(sim).show)
    except KeyboardInterrupt:
        sim.stop_all()
        raise Interrupted(interrupted(sim)) from None
    finally:
        sim.stop_all()
    return summarize(sim)


def _resume(cfg: Config, out: Path, quiet: bool, timeout_s: float, env: dict[str, str] | None, pin: bool,
            island_processes: int) -> dict[str, Any]:
    """:func:`run_simulation` with ``resume_dir``: the run in ``out`` goes on (see there)."""
    from dtrain.config.load import run_path

    if not (out / "coordinator").is_dir():
        raise SimulationError(f"--resume {out}: no coordinator checkpoint in {out / 'coordinator'}: nothing to resume")
    not_here = [what for what, on in (("islands' own tokens", (out / "island-tokens").exists()),
                                      ("a sharded coordinator", cfg.coordinator.shards > 1),
                                      ("islands' own settings", any((out / "islands").glob("*/config.toml"))))
                if on]
    if not_here:
        raise SimulationError(f"--resume {out}: a run with {not_here[0]} is not resumed by dtrain simulate yet; "
                              f"resume it by hand (docs/faults.md, Resuming a run)")
    if run_path(cfg).resolve() != out:  # the folder was moved or renamed: it is where the run now lives
        cfg = replace(cfg, run={"out_dir": str(out.parent), "name": out.name})
    cfg, worker_env = _checked_run(cfg, cfg.outer.islands, env, (), island_processes)
    sim = Simulation(cfg, out, cfg.outer.islands, quiet, worker_env, pin, [], island_processes)
    sim.resume = True
    return _run(sim, timeout_s)


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
    # several islands on one GPU: each worker process's share of its memory (none set by the user: an equal one)
    worker_env = memory_share_env(worker_env, islands * island_processes, workers_platform(worker_env))
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
