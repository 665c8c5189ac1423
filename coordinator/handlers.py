"""The coordinator's gRPC handlers and server sizing: how each RPC reaches its servicer.

Owns the server's two thread pools (:func:`server_threads` for pushes and pulls, :func:`control_threads` for
Join, Heartbeat, Status and the health checks), its options (:func:`server_options`), and the handlers that put
every request through the edge's bounds first and note the call for the service's refusal events
(:func:`service_handler`, :data:`CURRENT_CALL`), and grpc.health.v1's on the control threads
(:func:`health_handler`). Used by the composition root (``coordinator/app.py``) and a range shard's server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from coordinator.edge import request_problem, shown
from coordinator.memory import stream_window
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import (
    HANDLER_KINDS,
    SERVICE,
    RawChunk,
    WireError,
    channel_options,
    chunk_deserializer,
    keepalive_options,
    serialize,
)

# The RPC this thread serves: its method and island, set by service_handler's wrapper for the service's refusal
# events; gRPC serves each call, its streams included, on one thread.
CURRENT_CALL = threading.local()


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

