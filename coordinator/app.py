"""The coordinator's composition root: every part of a serving coordinator built in one place, in order.

:func:`build_service` decides the two things a start decides, once each: a new run or a resumed one (the state and
the merger from θ_0, or from the newest good checkpoint) and a local θ or a sharded one (``coordinator/
theta_store.py``: :class:`~coordinator.theta_store.LocalTheta` or :class:`~coordinator.theta_store.ShardedTheta`).
Nothing downstream branches on either. Every part that holds a resource is entered into one ``ExitStack``, so a
start that fails half way closes what it opened, in reverse order, and leaves the checkpoint as it was; once
built, :meth:`CoordinatorService.close` owns them. :func:`serve` puts the service behind its gRPC server (a
``grpc.aio`` server on an event loop of its own with the data plane, ``coordinator/data_plane.py``; the data
executor and the control threads; the token interceptor, the health service) and its dashboard.

The start, in order: preflight (``coordinator/preflight.py``) → the run's log and the history it folds → the
checkpointer → the state and the merger (new or resumed: ``coordinator/loading.py``) → θ's store (every range
shard brought to the version) → telemetry → the service and its clock (``coordinator/service.py``,
``coordinator/rounds_loop.py``) → the gRPC server and its handlers (``coordinator/handlers.py``) → the dashboard
→ listening.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np

from coordinator.dashboard import dashboard_port, open_dashboard
from coordinator.data_plane import DataPlane, LoopServer
from coordinator.edge import CallerIdentity
from coordinator.handlers import (
    aio_health_handler,
    aio_service_handler,
    control_threads,
    server_options,
    wait_threads,
    work_threads,
)
from coordinator.history import RunHistory
from coordinator.loading import has_checkpoint, new_run, resume_state
from coordinator.preflight import IN_USE, Preflight, preflight
from coordinator.records import StateOptions
from coordinator.rounds_loop import AfterFinish
from coordinator.service import CoordinatorService, Parts
from coordinator.theta_store import lead_theta0, open_theta_store
from dtrain import codec
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import CheckpointError, DtrainError
from dtrain.net.identity import IslandTokens
from dtrain.net.wire import AioTokenAuthInterceptor, AuthDenied, TokenAuthInterceptor
from dtrain.runlog import COORDINATOR_CHANNEL, RunLog
from dtrain.telemetry import Telemetry, require_exporter
from dtrain.train.fragments import leaf_sizes


def build_service(cfg: Config, run_dir: str | Path, theta: np.ndarray | Path | None, spec: codec.Spec,
                  clock: Callable[[], float] = time.time, resume: bool = False, quiet: bool = False,
                  after_finish: AfterFinish = "exit", island_tokens: IslandTokens | None = None) -> CoordinatorService:
    """The coordinator's service for a new run from θ_0 (``theta``: an array or a file of raw float32), or with
    ``resume`` the run in RUN_DIR's newest good checkpoint (``theta`` unused; CheckpointError if there is none).
    ``spec``: the model's parameter tree; ``clock``: the time leases and rounds run on; ``quiet``: no progress
    lines; ``after_finish``: what a finished run does (:class:`coordinator.rounds_loop.RoundsLoop`);
    ``island_tokens``: the islands' own tokens with ``security.identity`` "token". Its clock is started; it serves
    nothing yet."""
    run_dir = Path(run_dir)
    c = cfg.coordinator
    # Refused before anything is written: a resume with nothing to resume, a missing extra, a lead without its shards
    if resume and not has_checkpoint(cfg, run_dir):
        raise CheckpointError(f"--resume: no coordinator checkpoint in {run_dir / 'coordinator'}")
    require_exporter(cfg.telemetry)
    if c.shards > 1 and len(c.shard_addresses) != c.shards - 1:
        raise ConfigError(f"[coordinator] shard_addresses: the lead of {c.shards} shards needs the addresses "
                          f"of shards 1..{c.shards - 1}, got {len(c.shard_addresses)}")
    tree_size = sum(leaf_sizes(spec))
    opts = StateOptions.from_config(cfg, params=tree_size)
    with ExitStack() as stack:
        log = RunLog(run_dir, quiet=quiet, logger=COORDINATOR_CHANNEL)
        stack.callback(log.close)
        # The view Status and the dashboard show: a fold over this run's events (a resume reads back the earlier
        # coordinator's), then over each event as it is logged.
        history = RunHistory(run_dir, replay=resume)  # kept per version in history.json (coordinator/series.py)
        log.subscribe(history.observe)
        ckpt = None
        if c.checkpoint:
            from dtrain.checkpoint import Checkpointer  # orbax (and so JAX): only when checkpointing

            # Synchronous: a save hard-links the version's θ/momentum files (FileArraysHandler), O(1).
            ckpt = Checkpointer(run_dir / "coordinator", keep=2, async_save=False)
            stack.callback(ckpt.close)
        loaded_at = clock()  # the state's time of loading: a restored state's leases run from it
        if resume:  # new run or resumed: decided here, once
            assert ckpt is not None, "refused above without a coordinator checkpoint"
            loaded = resume_state(cfg, opts, run_dir, spec, ckpt, log, loaded_at)
            digests = list(loaded.meta.get("shard_digests", []))
        else:
            theta0, digests = lead_theta0(cfg, theta, spec)
            loaded = new_run(cfg, opts, run_dir, theta0, loaded_at, spec)
        stack.callback(loaded.merger.close)
        islands = loaded.state.islands  # events and log lines name an island by its name (dtrain.runlog.IslandNames)
        log.name_islands(lambda: {r.island_id: (r.name, r.shard_index) for r in list(islands.values())})
        store = open_theta_store(cfg, loaded.merger, digests)  # local or sharded: decided here, once
        stack.callback(store.close)
        if c.shards > 1:
            log.event("shards_restored", version=loaded.merger.version, shards=c.shards,
                      addresses=list(c.shard_addresses))
        telemetry = Telemetry(cfg.telemetry, "coordinator", "coordinator", loaded.run_id)
        stack.callback(telemetry.shutdown)
        service = CoordinatorService(Parts(
            cfg=cfg, run_dir=run_dir, spec=spec, clock=clock, opts=opts, log=log, history=history, ckpt=ckpt,
            run_id=loaded.run_id, state=loaded.state, store=store, telemetry=telemetry, loaded_at=loaded_at,
            identity=CallerIdentity(cfg.security.identity, island_tokens), after_finish=after_finish))
        stack.pop_all()  # the service owns them now (CoordinatorService.close)
    return service


def serve(cfg: Config, run_dir: str | Path, theta: np.ndarray | Path | None, spec: codec.Spec, port: int | None = None,
          resume: bool = False, quiet: bool = False, clock: Callable[[], float] = time.time,
          after_finish: AfterFinish = "exit", checked: Preflight | None = None
          ) -> tuple[LoopServer, CoordinatorService, int]:
    """Starts the coordinator; returns (server, service, bound port). ``port=0`` picks a free one.
    ``after_finish``: see :class:`coordinator.rounds_loop.RoundsLoop`. ``checked``: :func:`preflight`'s result when
    the caller already ran it (before θ_0's work), else it runs here, before anything is written to the run
    folder."""
    c = cfg.coordinator
    address = f"{c.host}:{c.port if port is None else port}"
    token, creds, island_tokens = checked if checked is not None else preflight(cfg, port)
    dash_port = dashboard_port(cfg, port)
    service = build_service(cfg, run_dir, theta, spec, clock=clock, resume=resume, quiet=quiet,
                            after_finish=after_finish, island_tokens=island_tokens)
    on_denied: AuthDenied = service.auth_failures.failed
    own = island_tokens.name_of if island_tokens is not None else None  # islands' own tokens (security.identity)
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [AioTokenAuthInterceptor(TokenAuthInterceptor(token, None, own), on_denied)] if token or own else [])
    # One grpc.aio server on an event loop of its own (coordinator/data_plane.py): PushDelta and PullGlobal are
    # coroutines there, waiting on their clients and on the next version without a thread, their work on the work
    # threads (work_threads: one per core) and a push's end, which may wait for a merge, on the wait threads
    # (wait_threads); Joins, heartbeats, Status and the health checks run on the control threads (the
    # server's migration pool: control_threads), which no stream can hold. No server-wide cap on concurrent calls
    # (gRPC's maximum_concurrent_rpcs would refuse heartbeats too); push streams and pulls are bounded per peer and
    # per island (coordinator/streams.py).
    control = futures.ThreadPoolExecutor(max_workers=control_threads(cfg), thread_name_prefix="rpc-control")
    data = futures.ThreadPoolExecutor(max_workers=work_threads(cfg), thread_name_prefix="rpc-data")
    waits = futures.ThreadPoolExecutor(max_workers=wait_threads(cfg), thread_name_prefix="rpc-wait")
    server = LoopServer(pools=(control, data, waits))

    async def build() -> int:
        service.plane = DataPlane(service, data, waits, c.max_receiving)
        server.on_stop.append(service.plane.drain)  # every push's end done before the loop and executor go
        aio = grpc.aio.server(migration_thread_pool=control, interceptors=interceptors,
                              options=server_options(cfg))
        handlers = aio_service_handler(service, service.refuse_request, service.plane.refuse_request)
        aio.add_generic_rpc_handlers((handlers, aio_health_handler(service.loop.health)))
        server.server = aio
        try:
            return aio.add_secure_port(address, creds) if creds else aio.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind to address": taken since the check above, or not ours to bind
            return 0

    bound = server.run(build())
    if bound == 0:
        server.stop(None)
        service.close()
        raise DtrainError(f"cannot listen on {address}: gRPC could not bind it; if {IN_USE}")
    if dash_port is not None:
        try:
            service.dashboard = open_dashboard(cfg, dash_port, token, service.status_message,
                                               service.auth_failures.failed, auth_on=own is not None,
                                               history=service.history.series.doc)
        except DtrainError:
            server.stop(None)
            service.close()
            raise
    server.start()
    if service.dashboard is not None:
        service.dashboard.start()
    if resume:  # leases were renewed to the restore's time + lease_s; the islands can reach us only from now on
        with service.lock:
            service.state.pause_leases(max(0.0, clock() - service.loaded_at))
    _log_started(cfg, service, bound, resume, token is not None or island_tokens is not None, creds is not None)
    return server, service, bound


def _log_started(cfg: Config, service: CoordinatorService, bound: int, resume: bool, auth: bool, tls: bool) -> None:
    """A new run's ``run_started`` event (once per run: what it is, for a reader of its events: dtrain plot,
    dtrain.audit), then ``coordinator_started`` and its progress line."""
    c = cfg.coordinator
    if not resume:
        o = service.opts
        service.log.event("run_started", run_id=service.run_id, mode=c.mode, islands=o.islands,
                          total_versions=o.end_version, expected_versions=o.total_versions,
                          tokens_total=o.tokens_total, params=service.tree_size,
                          fingerprint=cfg.fingerprint(), config=dataclasses.asdict(cfg))
    dash_url = service.dashboard.url if service.dashboard is not None else None
    service.log.event("coordinator_started", address=f"{c.host}:{bound}", tls=tls, auth=auth, mode=c.mode,
                      params=service.tree_size, run_id=service.run_id, dashboard=dash_url)
    service.log.progress(f"coordinator listening on {c.host}:{bound} ({'TLS' if tls else 'plaintext'}, "
                         f"{'token auth' if auth else 'no auth'}, {c.mode} mode, {service.tree_size:,} params)"
                         + (f"; dashboard at {dash_url}" if dash_url else "; no dashboard"))

