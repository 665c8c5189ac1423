"""A range shard's server: its calls on the coordinator's event-loop data plane, where waiting costs no thread.

A range shard (``coordinator/shard.py``: :class:`coordinator.shard.RangeShard`) is served as the lead is
(``coordinator/data_plane.py``): one ``grpc.aio`` server on an event loop of its own (:class:`LoopServer`), its
PushDelta and PullGlobal driven by the same :class:`DataPlane` (the same stream bounds, reaper and receive places,
the same pull quotas and long polls on a :class:`Bell`), the same edge (``coordinator.handlers``) and the same
token interceptor. :class:`ShardService` is what the data plane serves: the shard's push path
(:class:`ShardRound`: a part's header, its chunks, its spool held for the lead), its pulls and its refusals. The
lead's Claim *awaits* its part on the bell (rung when a part is held), holding no thread; the lead's other calls
(Prepare, Commit, Abort, Restore, Release) and Join, Heartbeat, Status and the health checks are plain functions on
the control threads.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from coordinator.data_plane import DataPlane, LoopServer
from coordinator.edge import CallerIdentity, request_problem
from coordinator.handlers import (
    abort_invalid,
    aio_health_handler,
    aio_service_handler,
    control_threads,
    server_options,
    wait_threads,
    work_threads,
)
from coordinator.merger import Merger
from coordinator.push import PayloadRefused, Upload, UploadBroke, push_info
from coordinator.records import PushInfo
from coordinator.refusals import CallRefused
from coordinator.rounds_loop import Signal
from coordinator.shard import MAX_CLAIM_WAIT_S, SHARD_METHODS, RangeShard
from coordinator.spool import Spool
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import BUSY_METADATA_KEY, OPEN_METHODS, AioTokenAuthInterceptor, TokenAuthInterceptor, WireError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ShardPart:
    """One push's part arriving at a range shard, from its header to its reply."""

    info: PushInfo
    identity: str | None  # the caller's, which the lead's part must match (Claim)
    spool: Spool
    upload: Upload | None = None


class ShardSignals:
    """The shard's changes as the data plane's bell hears them (``coordinator.data_plane.Clock``): its version,
    whether it is closing; every change of the shard (``RangeShard.listeners``) tells the listeners."""

    def __init__(self, shard: RangeShard):
        self.shard = shard
        self.listeners: list[Callable[[Signal], None]] = []
        shard.listeners.append(self._changed)

    def signal(self) -> Signal:
        return Signal(version=self.shard.merger.version, over=self.shard.closing, merging=False)

    def _changed(self) -> None:  # under the shard's lock
        now = self.signal()
        for listener in list(self.listeners):
            listener(now)


class ShardRound:
    """A part's path, sans I/O (the data plane drives it, as it drives the lead's ``OpenRound``): :meth:`begin`
    (its header: a reply for a part held already, else its record), :meth:`chunk`, :meth:`finish` (the whole frame
    validated and held for the lead), :meth:`broke`, :meth:`close` (always)."""

    def __init__(self, shard: RangeShard):
        self.shard = shard

    def begin(self, h: pb.PushHeader, identity: str | None) -> pb.PushDeltaResponse | ShardPart:
        shard = self.shard
        why = request_problem(h) or ("" if h.push_id and h.island_id else "push_id and island_id must not be empty")
        if why or h.shard != shard.index:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"push {h.push_id[:64]!r}: {why or f'its header names shard {h.shard}'}")
        reply = shard.admit_part(h)
        if reply is not None:
            return reply
        try:
            receiver = shard.intake.frame_receiver(h)
        except WireError as e:
            raise CallRefused(e.code, str(e)) from None
        info = push_info(h)
        rec = ShardPart(info, identity, shard.merger.spool())  # the frame must hold exactly this shard's range
        rec.upload = shard.intake.upload(receiver, rec.spool, info, None, 0, "held")
        return rec

    def chunk(self, rec: ShardPart, msg: object) -> None:
        assert rec.upload is not None
        try:
            rec.upload.chunk(msg)  # type: ignore[arg-type]
        except PayloadRefused as e:
            raise CallRefused(e.code, str(e), busy=e.busy) from None

    def finish(self, rec: ShardPart) -> pb.PushDeltaResponse:
        assert rec.upload is not None
        try:
            rec.upload.end()
        except PayloadRefused as e:
            raise CallRefused(e.code, str(e), busy=e.busy) from None
        except UploadBroke as e:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        finally:
            rec.upload.close()
        return self.shard.hold(rec.spool, rec.info, rec.identity, rec.upload.receiver.size)

    def broke(self, rec: ShardPart) -> CallRefused:
        assert rec.upload is not None
        e = rec.upload.broke()
        log.info("shard %d: %s", self.shard.index, e)
        return CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e), record=False)

    def close(self, rec: ShardPart) -> None:
        if rec.upload is not None:
            rec.upload.close()
        rec.spool.__exit__(None, None, None)  # closes it unless it is held (Spool.keep)


class ShardService(pb_grpc.CoordinatorServicer, pb_grpc.ShardServicer):
    """A range shard as its server serves it: the Coordinator service's calls (PushDelta and PullGlobal on the data
    plane, :attr:`plane`) and the Shard service's for the lead (Claim awaiting its part on the plane's bell)."""

    def __init__(self, shard: RangeShard):
        self.shard = shard
        self.lock = shard.lock
        self.loop = ShardSignals(shard)
        self.identity = shard.identity or CallerIdentity(shard.cfg.security.identity, None)  # None: no island's
        self.push_streams, self.pulls, self.tree_digest = shard.push_streams, shard.pulls, shard.tree_digest
        self.round = ShardRound(shard)
        self.plane: DataPlane[ShardPart] | None = None  # made on the server's loop (serve)

    @property
    def merger(self) -> Merger:
        return self.shard.merger

    def refusal(self, e: CallRefused) -> tuple[tuple[str, str], ...]:
        """The trailing metadata of a refusal: a busy one says so (workers retry it). A range shard records none
        (the lead's events are the run's); its message starts with the shard's name (an island talks to several:
        every refusal of a range shard is named here, the one place)."""
        name = f"shard {self.shard.index}: "
        if not str(e).startswith(name):
            e.args = (f"{name}{e}",)
        return ((BUSY_METADATA_KEY, "1"),) if e.busy else ()

    def check_pull(self, request: pb.PullRequest, identity: str | None) -> None:
        self.shard.check_pull(request)

    def pull_messages(self, request: pb.PullRequest) -> Iterator[pb.PullMessage | bytes]:
        return self.shard.pull_messages(request)

    # -- the Coordinator service ------------------------------------------------------------------------------

    async def PushDelta(self, request_iterator: AsyncIterator[Any],
                        context: grpc.aio.ServicerContext) -> pb.PushDeltaResponse:
        assert self.plane is not None, "served by serve()"
        return await self.plane.push(request_iterator, context)

    async def PullGlobal(self, request: pb.PullRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PullMessage | bytes]:
        assert self.plane is not None, "served by serve()"
        async for message in self.plane.pull(request, context):
            yield message

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is coordinator shard {self.shard.index}: Join the "
                                                           f"lead (shard 0)")
        raise AssertionError("unreachable: abort raises")

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is coordinator shard {self.shard.index}: "
                                                           f"heartbeats go to the lead (shard 0)")
        raise AssertionError("unreachable: abort raises")

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.shard.status()

    # -- the Shard service (the lead's calls, each with the shard secret) -------------------------------------

    async def Claim(self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext) -> pb.ClaimResponse:
        """The lead's claim of a push's part: waits (on the bell, no thread) up to ``wait_s`` for a part still
        streaming in."""
        assert self.plane is not None, "served by serve()"
        why = self.shard.lead_problem(context.invocation_metadata())
        if why:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        if not 0 <= request.wait_s <= MAX_CLAIM_WAIT_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s={request.wait_s}: must be in "
                                                                  f"[0, {MAX_CLAIM_WAIT_S:g}]")
        held = self.shard.held  # read on the loop: a dict lookup, no lock; rings come after each change
        await self.plane.bell.wait(lambda s: request.push_id in held or s.over, request.wait_s)
        return await self.plane.offload(self.shard.claim, request)

    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.PrepareResponse:
        return self.shard.Prepare(request, context)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        return self.shard.Commit(request, context)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return self.shard.Abort(request, context)

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        return self.shard.Restore(request, context)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return self.shard.Release(request, context)


def serve(shard: RangeShard, address: str, creds: grpc.ServerCredentials | None, token: str | None,
          own: Callable[[str], str | None] | None) -> tuple[LoopServer, int]:
    """``shard``'s server on ``address`` (0 as its port: any free one): a ``grpc.aio`` server on a
    :class:`LoopServer`, the data plane's PushDelta and PullGlobal, the lead's Shard service, the health service
    (SERVING while it serves: the pod's probes) and the token interceptor (``token``: the shared one; ``own``: the
    islands' own tokens' names). Started; returns it and the bound port (0: it could not bind, nothing left
    running)."""
    cfg = shard.cfg
    service = ShardService(shard)
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [AioTokenAuthInterceptor(TokenAuthInterceptor(token, None, own, OPEN_METHODS | SHARD_METHODS))]
        if token or own else [])
    control = futures.ThreadPoolExecutor(max_workers=control_threads(cfg), thread_name_prefix="rpc-control")
    data = futures.ThreadPoolExecutor(max_workers=work_threads(cfg), thread_name_prefix="rpc-data")
    waits = futures.ThreadPoolExecutor(max_workers=wait_threads(cfg), thread_name_prefix="rpc-wait")
    server = LoopServer(pools=(control, data, waits))
    health = HealthServicer(experimental_non_blocking=True)
    health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def build() -> int:
        service.plane = DataPlane(service, data, waits, cfg.coordinator.max_receiving)
        server.on_stop.append(service.plane.drain)  # every part's end done before the loop and executor go
        aio = grpc.aio.server(migration_thread_pool=control, interceptors=interceptors, options=server_options(cfg))
        aio.add_generic_rpc_handlers((aio_service_handler(service, abort_invalid, service.plane.refuse_request),
                                      aio_health_handler(health)))
        pb_grpc.add_ShardServicer_to_server(service, aio)
        server.server = aio
        try:
            return aio.add_secure_port(address, creds) if creds else aio.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind to address"
            return 0

    bound = server.run(build())
    if bound == 0:
        server.stop(None)
        return server, 0
    server.start()
    return server, bound

