"""The coordinator's gRPC handlers and server sizing: how each RPC reaches its servicer.

Owns the sizes of the server's thread pools (:func:`work_threads`: the work of pushes and pulls;
:func:`wait_threads`: a push's end, which may wait for a merge; :func:`control_threads`: Join, Heartbeat, Status and
the health checks), its options
(:func:`server_options`), and the handlers that put every request through the edge's bounds first and note the call
for the service's refusal events (:data:`CURRENT_CALL`), for a ``grpc.aio`` server (:func:`aio_service_handler`,
:func:`aio_health_handler`: PushDelta and PullGlobal coroutines on its event loop, the rest on the control threads).
Used by the composition root (``coordinator/app.py``) and by a range shard's server (``coordinator/shard_plane.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from coordinator.edge import request_problem, shown
from coordinator.memory import stream_window
from dtrain.config.derived import usable_cores
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import (
    HANDLER_KINDS,
    SERVICE,
    RawChunk,
    channel_options,
    chunk_deserializer,
    keepalive_options,
    serialize,
)


class _CallNote:
    """The RPC being served here: its ``method`` and ``island``, noted by the handlers' wrappers for the service's
    refusal events. A context variable each: a call served on a thread and a call served as a task on the event
    loop (``coordinator/data_plane.py``, whose work on the executor runs in the call's context) each see their
    own."""

    _method: ContextVar[str] = ContextVar("dtrain_call_method", default="")
    _island: ContextVar[str] = ContextVar("dtrain_call_island", default="")

    @property
    def method(self) -> str:
        return self._method.get()

    @method.setter
    def method(self, value: str) -> None:
        self._method.set(value)

    @property
    def island(self) -> str:
        return self._island.get()

    @island.setter
    def island(self, value: str) -> None:
        self._island.set(value)


CURRENT_CALL = _CallNote()


def work_threads(cfg: Config) -> int:
    """The data plane's work threads (``coordinator/data_plane.py``): a chunk's CRC, checks and spool write, a
    pull's messages, the open round's short decisions. ``coordinator.workers``, or with 0 (the default) one per core
    this process may use, at least 2: the work is CPU (and page-cache) bound, and more threads than cores only
    contend for the GIL and the caches (64 islands of 25.5M parameters on 2 cores: 8.2 CPU s a round with 200
    threads, 7.3 with 2; docs/benchmarks.md, Scale). A waiting call holds none of them."""
    return cfg.coordinator.workers or max(2, usable_cores())


def wait_threads(cfg: Config) -> int:
    """The data plane's waiting threads: a push's end, whose decision may wait for a merge being computed and, when
    the push completed its round, for the clock's merge (on a sharded lead, also for its parts on the other shards
    to be claimed): at most one or two per island, so 3 per expected island + 8, at least 16. Kept apart from
    :func:`work_threads`, so a push waiting for the merge never stops another push's chunks from being spooled."""
    return max(16, 3 * cfg.outer.islands + 8)


def server_threads(cfg: Config) -> int:
    """All the data plane's threads (:func:`work_threads` + :func:`wait_threads`): the most its calls ever hold,
    however many push streams and pulls wait on their clients or on the next version (they hold none)."""
    return work_threads(cfg) + wait_threads(cfg)


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


def abort_invalid(context: grpc.ServicerContext, why: str) -> Any:
    """A ``Refuse`` for a server that records no refusal (a range shard's): INVALID_ARGUMENT with ``why``."""
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


def _noting_call(name: str, method: Callable[[Any, grpc.ServicerContext], Any],
                 refuse: Refuse) -> Callable[[Any, grpc.ServicerContext], Any]:
    """A unary ``method`` behind the edge (:func:`coordinator.edge.request_problem`; ``refuse`` ends a request that
    fails it), noting first the call's method name and island in :data:`CURRENT_CALL` for the service's events: the
    island from the request's ``island_id`` (Join: ``island``, the name); a refused request's island only as a short
    escaped prefix."""
    def noted(request: Any, context: grpc.ServicerContext) -> Any:
        CURRENT_CALL.method = name
        island = getattr(request, "island_id", "") or getattr(request, "island", "")
        problem = request_problem(request)
        CURRENT_CALL.island = shown(island) if problem else island
        if problem:
            return refuse(context, f"{name}: {problem}")
        return method(request, context)
    return noted


def header_problem(first: Any) -> str:
    """The edge's check of a push stream's first message, when it is a header (:func:`request_problem`): '' or
    what is wrong. Notes the header's island in :data:`CURRENT_CALL` (a refused one as a short escaped prefix)."""
    if first is None or isinstance(first, RawChunk) or first.WhichOneof("kind") != "header":
        return ""  # not a header: the push's own reading refuses it
    problem = request_problem(first.header)
    CURRENT_CALL.island = shown(first.header.island_id) if problem else first.header.island_id
    return problem


# -- the coordinator's server on an event loop (coordinator/data_plane.py) ----------------------------------------

DATA_METHODS = frozenset({"PushDelta", "PullGlobal"})  # coroutines on the event loop; the others on the control pool


AioRefuse = Callable[[grpc.aio.ServicerContext, str], Awaitable[None]]  # Refuse's coroutine, for an aio server


def aio_service_handler(service: pb_grpc.CoordinatorServicer, refuse: Refuse,
                        refuse_async: AioRefuse) -> grpc.GenericRpcHandler:
    """The Coordinator service's handlers for a ``grpc.aio`` server: :func:`service_handler`'s (the same edge, the
    same serializers), with PushDelta and PullGlobal the service's coroutines (served on the event loop: waiting
    on a client or a version holds no thread) and the :data:`CONTROL_METHODS` plain functions, which the aio server
    runs on its migration thread pool (the control threads, :func:`control_threads`). PushDelta's header passes
    the edge in the service's own reading of it (:func:`header_problem`); a request the edge refuses ends with
    ``refuse`` (INVALID_ARGUMENT), a PullGlobal with ``refuse_async``, its coroutine."""
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
    handlers = {}
    for m in methods:
        behavior = getattr(service, m.name)
        if m.name == "PushDelta":
            wrapped: Callable[..., Any] = _noting_stream_async(m.name, behavior)
        elif m.name == "PullGlobal":
            wrapped = _noting_pull_async(m.name, behavior, refuse_async)
        else:
            wrapped = _noting_call(m.name, behavior, refuse)
        handlers[m.name] = HANDLER_KINDS[m.client_streaming, m.server_streaming](
            wrapped, request_deserializer=(chunk_deserializer(pb.PushMessage) if m.name == "PushDelta"
                                           else getattr(pb, m.input_type.name).FromString),
            response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _noting_stream_async(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    async def noted_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        CURRENT_CALL.method, CURRENT_CALL.island = name, ""
        return await method(requests, context)
    return noted_stream


def _noting_pull_async(name: str, method: Callable[..., Any], refuse: AioRefuse) -> Callable[..., Any]:
    async def noted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        CURRENT_CALL.method = name
        problem = request_problem(request)
        CURRENT_CALL.island = shown(request.island_id) if problem else request.island_id
        if problem:
            await refuse(context, f"{name}: {problem}")
            return
        async for message in method(request, context):
            yield message
    return noted


def aio_health_handler(health: HealthServicer) -> grpc.GenericRpcHandler:
    """grpc.health.v1's handlers for a ``grpc.aio`` server: Check and List plain functions (the control threads,
    the server's migration pool), Watch a coroutine fed by the servicer's own callbacks (it holds no thread)."""
    async def watch(request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[health_pb2.HealthCheckResponse | None] = asyncio.Queue()
        health.Watch(request, _Callbacks(context),  # Watch asks add_callback only
                     send_response_callback=lambda r: loop.call_soon_threadsafe(replies.put_nowait, r))
        while (reply := await replies.get()) is not None:
            yield reply

    check, reply = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(health.Check, request_deserializer=check.FromString,
                                                     response_serializer=reply.SerializeToString),
        "List": grpc.unary_unary_rpc_method_handler(
            health.List, request_deserializer=health_pb2.HealthListRequest.FromString,
            response_serializer=health_pb2.HealthListResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", handlers)


class _Callbacks:
    """What the health servicer's Watch asks of its context (``add_callback``), over an aio call's."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self.context = context

    def add_callback(self, callback: Callable[[], None]) -> None:
        self.context.add_done_callback(lambda _context: callback())  # type: ignore[arg-type]
