"""The coordinator process: its checks before anything starts, its gRPC server and its run from start to stop.

Owns what comes before the service (:func:`preflight`: free ports, the telemetry exporter, the token and TLS
files; θ_0 computed in a child process: :func:`initial_parameters_file`), the gRPC server around
:class:`coordinator.service.CoordinatorService` (:func:`serve`: its threads, options, handlers, the token
interceptor, the health service and the dashboard) and ``dtrain coordinator`` itself (:func:`run_coordinator`:
serve until the run is finished or a signal, then stop and summarize).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from coordinator.dashboard import check_port_free, dashboard_port, open_dashboard
from coordinator.edge import CallerIdentity, request_problem, shown
from coordinator.init_params import UNFIT
from coordinator.memory import return_large_frees_to_the_os, stream_window
from coordinator.rounds_loop import AfterFinish
from coordinator.service import CURRENT_CALL, CoordinatorService
from coordinator.shard import SHARD_METHODS, RangeShard, read_secret, shard_ranges
from coordinator.stored import write_layout
from dtrain import codec
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.net.identity import IslandTokens
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import (
    HANDLER_KINDS,
    OPEN_METHODS,
    SERVICE,
    AuthDenied,
    RawChunk,
    TokenAuthInterceptor,
    WireError,
    channel_options,
    chunk_deserializer,
    keepalive_options,
    read_token,
    serialize,
    server_credentials,
)
from dtrain.telemetry import require_exporter

log = logging.getLogger(__name__)

_IN_USE = ("the address is already in use (another coordinator?): stop the other process, or pick another port "
           "with --port or coordinator.port")

# What preflight() read: the bearer token (None: no shared token), the server's TLS credentials (None: plaintext)
# and, with security.identity "token", the islands' own tokens (dtrain.net.identity.IslandTokens; else None).
Preflight = tuple[str | None, grpc.ServerCredentials | None, IslandTokens | None]


def preflight(cfg: Config, port: int | None) -> Preflight:
    """The checks a coordinator passes before it writes anything: its ports are free (:func:`check_ports_free`),
    the telemetry exporter is installed, its token and TLS files are readable and not deploy/'s placeholders
    (ConfigError otherwise), and so is the islands' token file with ``security.identity`` "token"; returns the
    token, the credentials and the island tokens for :func:`serve`."""
    check_ports_free(cfg, port)
    require_exporter(cfg.telemetry)
    sec = cfg.security
    token, creds = read_token(sec), server_credentials(sec)
    island_tokens = IslandTokens.read(sec.island_tokens) if sec.identity == "token" else None
    check_exposure(cfg, token is not None or island_tokens is not None, dashboard_port(cfg, port) is not None)
    if cfg.coordinator.shards > 1:
        read_secret(cfg)  # a sharded coordinator's: before θ_0 too
    return token, creds, island_tokens


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only: 127.0.0.0/8, ::1 or localhost. Any other name, and ''
    (every interface), is not."""
    import ipaddress

    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: Config, auth: bool, dashboard: bool = True) -> None:
    """Secure by default: a coordinator that listens beyond loopback (its gRPC address, or its dashboard's when
    ``dashboard``) with no ``auth`` (a token: the operator's or the islands' own) and no mutual TLS serves anyone
    who reaches the port as any island; ConfigError, one line, unless ``security.insecure`` (``dtrain coordinator
    --insecure``) says so in so many words."""
    c, sec = cfg.coordinator, cfg.security
    if auth or sec.client_auth or sec.insecure:
        return
    binds = [("coordinator.host", c.host)] + ([("the dashboard's host", c.dashboard_address)] if dashboard else [])
    exposed = [(what, host) for what, host in binds if not is_loopback(host)]
    if exposed:
        what, host = exposed[0]
        raise ConfigError(f"{what} {host or '(every interface)'} listens beyond loopback with no "
                          f"authentication: anyone who reaches it may act as any island; set a token (the "
                          f"environment variable named by security.token_env, or the islands' own: "
                          f"security.island_tokens) or mutual TLS (security.client_auth), or pass --insecure "
                          f"(security.insecure = true) to serve it open")


def check_ports_free(cfg: Config, port: int | None) -> None:
    """The gRPC address (``port``, else coordinator.port) and the dashboard's port are free to bind, or a
    DtrainError naming the one that is not."""
    c = cfg.coordinator
    check_address_free(c.host, c.port if port is None else port)
    dash_port = dashboard_port(cfg, port)
    if dash_port is not None:
        check_port_free(c.dashboard_address, dash_port)


def check_address_free(host: str, port: int) -> None:
    """Raises DtrainError naming ``host:port`` if it cannot be bound, e.g. another coordinator listens there.

    The server itself binds with SO_REUSEPORT off (:func:`server_options`), so it would fail too; checking first,
    with a plain socket bound the way gRPC binds (SO_REUSEADDR on), gives a clear error before anything is
    started or written, and keeps gRPC's own multi-line bind log off the terminal. Port 0 is always free."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise DtrainError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DtrainError(f"cannot listen on {host}:{port}: {_IN_USE}") from None
                raise DtrainError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def server_threads(cfg: Config) -> int:
    """The gRPC server's data threads, for pushes and pulls: ``coordinator.workers``, or with 0 (the default) 3 per
    expected island + 8, at least 16. An island may hold a push stream and a long-polling pull at once, each on a
    thread for its whole length, and a retried push may overlap the one it replaces: with fewer threads, pushes
    queue behind long polls (benchmarks/scale.py: 64 islands on 16 threads)."""
    return cfg.coordinator.workers or max(16, 3 * cfg.outer.islands + 8)


# The calls served on the control threads (control_threads): short, and never waiting on a client's stream.
CONTROL_METHODS = frozenset({"Join", "Heartbeat", "Status"})


def control_threads(cfg: Config) -> int:
    """The server's control threads, for Join, Heartbeat, Status and the health checks (:data:`CONTROL_METHODS`):
    a pool of their own, which no push or pull can hold, so a lease is renewed however many streams are open or
    idle. Each such call is short, but waits for the service's lock while a round merges: one per expected island
    + 8, so that a heartbeat waits for the lock only, never for a thread."""
    return cfg.outer.islands + 8


def server_options(cfg: Config) -> list[tuple[str, int | str]]:
    """The gRPC server's options. With a window (:func:`coordinator.memory.stream_window`) each incoming stream's
    receive window is fixed at that size (gRPC's BDP probing off), so data received ahead of the handlers, which
    are CPU-bound decoding pushes, is bounded by streams × window: with probing on, 8 pushes over loopback
    buffered up to 1.4 model sizes here."""
    c = cfg.coordinator
    # SO_REUSEPORT off: gRPC turns it on by default, which lets a second coordinator bind the same port and
    # share its connections at random; off, the second one's bind fails (see check_address_free).
    opts = channel_options(c.max_message_bytes) + [("grpc.so_reuseport", 0)] + keepalive_options(server=True)
    window = stream_window(cfg)
    if window:
        opts += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]
    return opts


Refuse = Callable[[grpc.ServicerContext, str], Any]  # ends a call the edge refused, with its reason


def _abort_invalid(context: grpc.ServicerContext, why: str) -> Any:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


def service_handler(service: pb_grpc.CoordinatorServicer, control: futures.ThreadPoolExecutor | None = None,
                    refuse: Refuse = _abort_invalid) -> grpc.GenericRpcHandler:
    """The Coordinator service's handlers, one per method of the proto's service: the generated
    ``add_CoordinatorServicer_to_server`` with four differences. Every request (a push: its header) passes the
    edge's bounds first (:func:`coordinator.edge.check_request`), or ``refuse(context, why)`` ends it
    (INVALID_ARGUMENT) before the handler sees it. Responses go through ``wire.serialize``, so a
    pull streams pre-encoded chunk messages (``wire.chunk_message``: one copy of the data, not three); pushed
    chunks are parsed as views into the received bytes (``wire.chunk_deserializer``: no copy, not two); and the
    :data:`CONTROL_METHODS` run on ``control`` (:func:`control_threads`), not on the server's own threads."""
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
    handlers = {m.name: HANDLER_KINDS[m.client_streaming, m.server_streaming](
        _on_pool(_noting_call(m.name, getattr(service, m.name), m.client_streaming, refuse),
                 control if m.name in CONTROL_METHODS else None),
        request_deserializer=(chunk_deserializer(pb.PushMessage) if m.name == "PushDelta"
                              else getattr(pb, m.input_type.name).FromString),
        response_serializer=serialize) for m in methods}
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def health_handler(health: HealthServicer, control: futures.ThreadPoolExecutor) -> grpc.GenericRpcHandler:
    """grpc.health.v1's handlers (the generated ``add_HealthServicer_to_server``'s) with Check and List on the
    control threads: a Kubernetes probe is answered while every data thread is busy. Watch, non-blocking, holds
    no thread."""
    def unary(method: Callable[[Any, grpc.ServicerContext], Any], request: Any, reply: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(_on_pool(lambda r, c: method(r, c), control),
                                                   request_deserializer=request.FromString,
                                                   response_serializer=reply.SerializeToString)

    handlers = {
        "Check": unary(health.Check, health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse),
        "List": unary(health.List, health_pb2.HealthListRequest, health_pb2.HealthListResponse),
        "Watch": grpc.unary_stream_rpc_method_handler(
            health.Watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", handlers)


Behavior = Callable[..., Any]


def _on_pool(behavior: Behavior, pool: futures.ThreadPoolExecutor | None) -> Behavior:
    """``behavior`` (a fresh function: the attribute is its own) served on ``pool`` instead of the server's
    threads: gRPC's sync server runs a handler whose behavior has an ``experimental_thread_pool`` there."""
    if pool is not None:
        behavior.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return behavior


def _noting_call(name: str, method: Callable[[Any, grpc.ServicerContext], Any], client_streaming: bool,
                 refuse: Refuse) -> Callable[[Any, grpc.ServicerContext], Any]:
    """``method`` behind the edge (:func:`coordinator.edge.request_problem`; ``refuse`` ends a request that fails
    it), noting first the call's method name and island in :data:`coordinator.service.CURRENT_CALL` for the
    service's events (gRPC serves each call, its streams included, on one thread): the island from the request's
    ``island_id`` (Join: ``island``, the name), or from the first message of a push stream, its header; a refused
    request's island only as a short escaped prefix."""
    if client_streaming:
        def noted_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            CURRENT_CALL.method, CURRENT_CALL.island = name, ""
            return method(_noting_header(requests), context)
        return noted_stream

    def noted(request: Any, context: grpc.ServicerContext) -> Any:
        CURRENT_CALL.method = name
        island = getattr(request, "island_id", "") or getattr(request, "island", "")
        problem = request_problem(request)
        CURRENT_CALL.island = shown(island) if problem else island
        if problem:
            return refuse(context, f"{name}: {problem}")
        return method(request, context)
    return noted


def _noting_header(requests: Iterator[Any]) -> Iterator[Any]:
    """A push stream whose header (its first message) passed the edge; WireError INVALID_ARGUMENT, which the
    handler answers as it does any bad header, when it does not."""
    first = next(requests, None)
    if first is None:
        return
    if not isinstance(first, RawChunk) and first.WhichOneof("kind") == "header":
        problem = request_problem(first.header)
        CURRENT_CALL.island = shown(first.header.island_id) if problem else first.header.island_id
        if problem:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"PushDelta: header.{problem}")
    yield first
    yield from requests


def serve(cfg: Config, run_dir: str | Path, theta: np.ndarray | Path | None, spec: codec.Spec, port: int | None = None,
          resume: bool = False, quiet: bool = False, clock: Callable[[], float] = time.time,
          after_finish: AfterFinish = "exit", checked: Preflight | None = None
          ) -> tuple[grpc.Server, CoordinatorService, int]:
    """Starts the coordinator; returns (server, service, bound port). ``port=0`` picks a free one.
    ``after_finish``: see :class:`coordinator.rounds_loop.RoundsLoop`. ``checked``: :func:`preflight`'s result when
    the caller already ran it (before θ_0's work), else it runs here, before anything is written to the run
    folder."""
    c = cfg.coordinator
    address = f"{c.host}:{c.port if port is None else port}"
    token, creds, island_tokens = checked if checked is not None else preflight(cfg, port)
    dash_port = dashboard_port(cfg, port)
    service = CoordinatorService(cfg, run_dir, theta, spec, clock=clock, resume=resume, quiet=quiet,
                                 after_finish=after_finish, island_tokens=island_tokens)
    on_denied: AuthDenied = service.auth_failures.failed
    own = island_tokens.name_of if island_tokens is not None else None  # islands' own tokens (security.identity)
    interceptors: list[grpc.ServerInterceptor] = ([TokenAuthInterceptor(token, on_denied, own)]
                                                  if token or own else [])
    # Two pools: the server's own threads for pushes and pulls, and the control threads (control_threads) for
    # Joins, heartbeats, Status and health checks, so that streams (idle ones included, until stream_idle_s
    # cancels them) can never delay a lease's renewal. No server-wide cap on concurrent calls (gRPC's
    # maximum_concurrent_rpcs would refuse heartbeats too); push streams are bounded per peer and per island
    # (coordinator/streams.py), the calls beyond the threads wait in the pool's queue.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=server_threads(cfg), thread_name_prefix="rpc"),
                         interceptors=interceptors, options=server_options(cfg))
    control = futures.ThreadPoolExecutor(max_workers=control_threads(cfg), thread_name_prefix="rpc-control")
    server.add_generic_rpc_handlers((service_handler(service, control, service.refuse_request),
                                     health_handler(service.loop.health, control)))
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind to address": taken since the check above, or not ours to bind
        bound = 0
    if bound == 0:
        service.close()
        raise DtrainError(f"cannot listen on {address}: gRPC could not bind it; if {_IN_USE}")
    if dash_port is not None:
        try:
            service.dashboard = open_dashboard(cfg, dash_port, token, service.status_message,
                                               service.auth_failures.failed, auth_on=own is not None,
                                               history=service.history.series.doc)
        except DtrainError:
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


def initial_parameters_file(cfg: Config, out_dir: str | Path, spec_only: bool = False
                            ) -> tuple[Path | None, codec.Spec]:
    """θ_0 from the run's seed (or ``model.init_from``'s Hugging Face folder) as a file of raw float32 in
    ``out_dir`` (every island builds the same tree and checks its digest), and the tree's spec. ``spec_only``:
    just the spec (from shapes; no θ_0 is built).

    Computed in a child process (coordinator/init_params.py), so JAX and the model's temporary copies
    never enter the coordinator's memory, and θ_0 itself only as a file the merger links in."""
    import subprocess
    import sys
    import tempfile

    from dtrain.config.load import to_toml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrain-init-") as tmp:
        (Path(tmp) / "config.toml").write_text(to_toml(cfg))
        done = subprocess.run([sys.executable, "-m", "coordinator.init_params", str(Path(tmp) / "config.toml"),
                               str(out), *(["--spec-only"] if spec_only else [])], capture_output=True, text=True)
    if done.returncode == UNFIT:  # model.init_from's folder does not fit the config: its one line
        raise ConfigError(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise DtrainError(f"computing θ_0 failed:\n{done.stderr[-2000:]}")
    return None if spec_only else out / "theta0.f32", json.loads((out / "spec.json").read_text())


def initial_parameters(cfg: Config) -> tuple[np.ndarray, codec.Spec]:
    """θ_0 as an array (tests and tools; the service itself uses :func:`initial_parameters_file`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtrain-theta0-") as tmp:
        path, spec = initial_parameters_file(cfg, tmp)
        assert path is not None
        return np.fromfile(path, "<f4").astype(np.float32), spec


def run_coordinator(cfg: Config, run_dir: str | Path, port: int | None = None, resume: bool = False,
                    quiet: bool = False, after_finish: AfterFinish = "exit") -> dict[str, Any]:
    """``dtrain coordinator``: serves until the run is finished (``CoordinatorState.finished``: the last version
    is merged and the live islands have it, or its linger has passed) or SIGTERM / Ctrl-C; writes
    RUN_DIR/coordinator.json with the bound address as soon as it listens.

    ``port``: the gRPC port (None: ``coordinator.port``; 0: any free one); ``resume``: from RUN_DIR's newest good
    checkpoint (θ_0 is not computed then); ``quiet``: no progress lines. ``after_finish="serve"`` (a
    Deployment's, which would restart an exited coordinator, resume the finished run and end it again, forever):
    a finished run says so (``run_finished`` event, one progress line) and keeps serving until SIGTERM / Ctrl-C.
    Returns the run's summary (version, tokens_merged, bytes_in, bytes_out, merge_s, deltas_dropped,
    params_digest), also its ``coordinator_stopped`` event; raises DtrainError if the service failed."""
    return_large_frees_to_the_os()
    checked = preflight(cfg, port)  # before θ_0's work
    init_dir = Path(run_dir) / "spool" / "init"
    theta0, spec = initial_parameters_file(cfg, init_dir, spec_only=resume)  # resuming: θ is in the checkpoint
    write_layout(cfg, run_dir, spec)  # what `dtrain export` reads θ's files with
    try:
        server, service, bound = serve(cfg, run_dir, theta0, spec, port=port, resume=resume, quiet=quiet,
                                       after_finish=after_finish, checked=checked)
    finally:
        shutil.rmtree(init_dir, ignore_errors=True)  # the merger holds its own link to θ_0
    _write_address(cfg, Path(run_dir), service, bound)
    reason = _wait_for_the_end(service, after_finish)
    if service.loop.fatal:
        server.stop(grace=1.0).wait()
        service.close()
        raise DtrainError(f"coordinator failed: {service.loop.fatal} (restart it with `dtrain coordinator --resume`)")
    server.stop(grace=2.0).wait()
    with service.lock:
        st, n = service.state, service.counters
        summary = {"version": st.version, "tokens_merged": st.tokens_merged, "bytes_in": n.bytes_in,
                   "bytes_out": n.bytes_out, "merge_s": n.merge_s, "deltas_dropped": st.deltas_dropped,
                   "params_digest": service.params_digest}
    service.log.event("coordinator_stopped", reason=reason, run_over=service.loop.stop_requested is None, **summary)
    service.close()
    return summary


def _write_address(cfg: Config, run_dir: Path, service: CoordinatorService, bound: int) -> None:
    """RUN_DIR/coordinator.json: where the coordinator listens (and its dashboard), written atomically."""
    info = run_dir / "coordinator.json"
    tmp = info.with_suffix(".tmp")
    dash = service.dashboard
    tmp.write_text(json.dumps({"host": cfg.coordinator.host, "port": bound, "run_id": service.run_id,
                               "dashboard_port": dash.port if dash else None, "dashboard": dash.url if dash else None}))
    tmp.replace(info)


def _wait_for_the_end(service: CoordinatorService, after_finish: AfterFinish) -> str:
    """Waits until the service may stop (SIGTERM and SIGINT ask it to), and says why; with
    ``after_finish="serve"`` a finished run is announced and served until a signal."""
    import signal

    loop = service.loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: loop.request_stop(f"{signal.Signals(signum).name} received"))
    reason = loop.wait_finished()
    if after_finish == "serve" and loop.fatal is None and loop.stop_requested is None:
        with service.lock:
            version = service.state.version
        service.log.event("run_finished", reason=reason, version=version)
        service.log.progress(f"run finished: {reason}; serving its final θ (version {version}), Status, health "
                             f"and the dashboard until SIGTERM (--after-finish=serve); nothing is left to train: the "
                             f"Deployment may be scaled to 0 (kubectl -n dtrain scale deployment dtrain-coordinator "
                             f"--replicas=0)")
        reason = loop.wait_stop_requested()
    return reason


def shard_preflight(cfg: Config, port: int | None) -> Preflight:
    """:func:`preflight` for a range shard: its port free, its token, TLS, island tokens and shard secret readable
    and not placeholders (ConfigError), before θ_0's work."""
    c = cfg.coordinator
    check_ports_free(dataclasses.replace(cfg, coordinator=dataclasses.replace(c, dashboard_port=-1)), port)
    sec = cfg.security
    token, creds = read_token(sec), server_credentials(sec)
    island_tokens = IslandTokens.read(sec.island_tokens) if sec.identity == "token" else None
    check_exposure(cfg, token is not None or island_tokens is not None, dashboard=False)
    read_secret(cfg)
    return token, creds, island_tokens


def serve_shard(cfg: Config, index: int, run_dir: str | Path, theta: np.ndarray | Path, spec: codec.Spec,
                port: int | None = None) -> tuple[grpc.Server, RangeShard, int]:
    """Starts range shard ``index`` (>= 1) of a sharded coordinator (``coordinator.shards``): the Coordinator
    service's PushDelta and PullGlobal for its range (the islands' token, as the lead's) and the Shard service for
    the lead (its secret); ``theta``: θ_0's values of its range. Returns (server, shard, bound port)."""
    c = cfg.coordinator
    address = f"{c.host}:{c.port if port is None else port}"
    token, creds, island_tokens = shard_preflight(cfg, port)
    sec = cfg.security
    shard = RangeShard(cfg, index, run_dir, theta, spec, read_secret(cfg),
                       identity=CallerIdentity(sec.identity, island_tokens))
    own = island_tokens.name_of if island_tokens is not None else None
    interceptors: list[grpc.ServerInterceptor] = (
        [TokenAuthInterceptor(token, None, own, OPEN_METHODS | SHARD_METHODS)] if token or own else [])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=server_threads(cfg), thread_name_prefix="rpc"),
                         interceptors=interceptors, options=server_options(cfg))
    control = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rpc-control")
    health = HealthServicer(experimental_non_blocking=True)  # SERVING while it serves (the pod's probes)
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_generic_rpc_handlers((service_handler(shard), health_handler(health, control)))
    pb_grpc.add_ShardServicer_to_server(shard, server)
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        shard.close()
        raise DtrainError(f"cannot listen on {address}: gRPC could not bind it; if {_IN_USE}")
    server.start()
    log.info("coordinator shard %d of %d listening on %s:%d (values %d..%d)", index, c.shards, c.host, bound,
             shard.range.start, shard.range.end)
    return server, shard, bound


def run_shard(cfg: Config, index: int, run_dir: str | Path, port: int | None = None) -> dict[str, Any]:
    """``dtrain coordinator --shard I`` (I >= 1): serves range shard I of a sharded coordinator until SIGTERM or
    Ctrl-C (it ends nothing itself: the lead runs the run); writes RUN_DIR/coordinator-shard-I.json with its bound
    address once it listens. θ_0 is computed from the run's seed as the lead's is, and its range taken. Returns
    its version and its range's digest."""
    import signal
    import threading

    return_large_frees_to_the_os()
    if not 1 <= index < cfg.coordinator.shards:
        raise ConfigError(f"--shard {index}: must be in 0..{cfg.coordinator.shards - 1} (coordinator.shards = "
                          f"{cfg.coordinator.shards}; 0 is the lead)")
    shard_preflight(cfg, port)  # before θ_0's work
    out = Path(run_dir)
    init_dir = out / f"shard-{index}" / "init"
    theta0, spec = initial_parameters_file(cfg, init_dir)
    assert theta0 is not None
    try:
        r = shard_ranges(spec, cfg.coordinator.shards)[index]
        theta = np.array(np.memmap(theta0, "<f4", mode="r")[r.start:r.end], np.float32)
    finally:
        shutil.rmtree(init_dir, ignore_errors=True)
    server, shard, bound = serve_shard(cfg, index, out, theta, spec, port)
    info = out / f"coordinator-shard-{index}.json"
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": cfg.coordinator.host, "port": bound, "shard": index,
                               "shards": cfg.coordinator.shards, "values": [r.start, r.end]}))
    tmp.replace(info)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    stop.wait()
    server.stop(grace=2.0).wait()
    with shard.lock:
        summary = {"shard": index, "version": shard.merger.version, "params_digest": shard.merger.digest}
    shard.close()
    return summary
