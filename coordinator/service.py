"""The coordinator's gRPC servicer: a thin adapter over ``state`` (decisions), the open round (pushes) and
``merger`` (math).

One lock serializes every state change and every touch of the merger (its pending pushes and state files);
receiving, spooling and validating a pushed frame (``coordinator/push.py``) happen outside it, so many islands
can stream at once. The lock is a condition, notified on every change: the ticker (``coordinator/rounds_loop.py``)
sleeps on it until the state's next deadline or a change, and merges the rounds; ``run_coordinator`` waits on it
too. After each merge the whole coordinator (θ, outer momentum, down residual, membership, cursors, applied push
ids) is checkpointed with orbax, atomically. Join, Heartbeat and Status are served here, on the server's control
threads; a push's path is the open round's (``coordinator/open_round.py``) and PushDelta and PullGlobal run on the
server's event loop (``coordinator/data_plane.py``), which calls back here for the decisions under the lock
(:meth:`CoordinatorService.check_pull`, :meth:`CoordinatorService.pull_messages`). Owns how a refusal is recorded
and answered (:meth:`CoordinatorService.refusal`); the server around it is ``coordinator/app.py``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, Protocol, TypeVar

import grpc
import grpc.aio

from coordinator.dashboard import Dashboard
from coordinator.edge import CallerIdentity, RunFingerprint, evidence_from_message, refusal_line
from coordinator.handlers import CURRENT_CALL
from coordinator.history import RunHistory, check_eval_reports, eval_progress
from coordinator.memory import FrameStreams, pull_piece
from coordinator.open_round import OpenRound, RoundParts
from coordinator.pending import PendingSet
from coordinator.pull_cache import PullCache
from coordinator.push import PushIntake
from coordinator.records import IslandRecord, PushInfo, StateError, StateOptions
from coordinator.refusals import AuthFailures, CallRefused, RefusalLog
from coordinator.rounds_loop import AfterFinish, RoundsLoop
from coordinator.state import CoordinatorState
from coordinator.status_view import Counters, status_response
from coordinator.streams import Pulls, PushStreams, Stream
from coordinator.theta_store import ThetaStore
from dtrain import codec
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import (
    BUSY_METADATA_KEY,
    MAX_EVAL_REPORTS,
    RETRY_AFTER_METADATA_KEY,
    RUN_OVER_METADATA_KEY,
    SERVICE,
    STOPPED_METADATA_KEY,
    chunk_count,
)
from dtrain.runlog import RunLog
from dtrain.telemetry import RoundSpans, Telemetry, status_gauges
from dtrain.train.fragments import leaf_sizes

if TYPE_CHECKING:
    from dtrain.checkpoint import Checkpointer

CallArgs = ParamSpec("CallArgs")  # the arguments of a state-machine decision (_decide)
Decided = TypeVar("Decided")  # what it returns

SHARD_START_WAIT_S = 120.0  # a sharded lead's start: how long it waits for its range shards to be reachable
_ACTIONS = {"continue": pb.ACTION_CONTINUE, "pull": pb.ACTION_PULL, "stop": pb.ACTION_STOP,
            "rejoin": pb.ACTION_REJOIN}
_CODES = {"INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
          "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION, "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
          "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED}
# A refusal with one of these codes is a bad request (malformed, over a bound, not matching the run): a
# `request_invalid` event; other refusals (an unknown island, a failed coordinator) are `request_rejected`.
_BAD_REQUEST = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})


class Plane(Protocol):
    """What the service asks of its data plane (``coordinator.data_plane.DataPlane``, made by ``serve``)."""

    receiving: asyncio.Semaphore | None  # coordinator.max_receiving's places

    def push(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
             ) -> Awaitable[pb.PushDeltaResponse]: ...

    def pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext
             ) -> AsyncIterator[pb.PullMessage | bytes]: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the composition root (``coordinator.app.build_service``) built for the service, in the order it did."""

    cfg: Config
    run_dir: Path
    spec: codec.Spec
    clock: Callable[[], float]
    opts: StateOptions
    log: RunLog  # the run's events and progress lines
    history: RunHistory  # the fold over them that Status shows
    ckpt: Checkpointer | None
    run_id: str
    state: CoordinatorState  # new, or restored from the newest good checkpoint
    store: ThetaStore  # θ: local, or over the range shards
    telemetry: Telemetry
    loaded_at: float  # the state's time of loading: a restored state's leases run from it
    identity: CallerIdentity
    after_finish: AfterFinish


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The Coordinator service's RPCs (Join, Heartbeat, PushDelta, PullGlobal, Status) over one run's state
    machine (:attr:`state`) and merger (:attr:`merger`), under :attr:`lock`; its ticker, merges and end are
    :attr:`loop`'s (:class:`coordinator.rounds_loop.RoundsLoop`: ``wait_finished``, ``request_stop``, ``fatal``).
    Built by :func:`coordinator.app.build_service` and served by :func:`coordinator.app.serve`; :meth:`close`
    releases everything it holds."""

    def __init__(self, parts: Parts):
        """The service over the parts the composition root built (``coordinator.app.build_service``); its own
        in-memory helpers (counters, refusal log, stream bounds, the push intake) and its clock are made here.
        Starts the clock; serves nothing yet."""
        p = parts
        self.cfg, self.clock, self.run_dir, self.spec = p.cfg, p.clock, p.run_dir, p.spec
        self.opts, self.log, self.history, self.ckpt, self.identity = p.opts, p.log, p.history, p.ckpt, p.identity
        self.run_id, self.state, self.store, self.telemetry = p.run_id, p.state, p.store, p.telemetry
        self.merger = p.store.merger
        self.loaded_at = p.loaded_at
        self.tree_size = sum(leaf_sizes(p.spec))
        self.tree_digest, self.fingerprint = codec.spec_digest(p.spec), RunFingerprint(p.cfg)
        self.started_at = p.clock()
        self.streams = FrameStreams()
        self.pull_piece = pull_piece(p.cfg)
        self.pull_cache = PullCache(p.cfg.coordinator.pull_cache_bytes)
        self.lock = threading.Condition(threading.RLock())  # notified on every change of state (see the docstring)
        self.counters = Counters()
        self.refusals = RefusalLog(p.cfg.coordinator.refusal_events)
        self.refusals.counts = self.counters.refusals  # one table: Status reports it
        self.auth_failures = AuthFailures(self.log, self.lock, self.counters.refusals)
        self.rounds = RoundSpans(self.telemetry)
        status_gauges(self.telemetry, self.status_message)
        self.log.subscribe(self.telemetry.on_event)
        self.dashboard: Dashboard | None = None  # the live view (coordinator/dashboard.py), opened by serve()
        self.plane: Plane | None = None  # PushDelta and PullGlobal on the server's event loop, made by serve()
        self.intake = PushIntake(p.cfg, self.merger, self.telemetry, self.streams)
        self.push_streams, self.pulls = PushStreams(p.cfg, self._stream_cancelled), Pulls(p.cfg)
        self.push_streams.start()
        # The open round's pushes, in one place (coordinator/pending.py): the state's ledger keeps them, the merger
        # sums their spools, and a push taken out unmerged lets its parts on the range shards go.
        self.pending: PendingSet = self.state.ledger.pending
        self.pending.on_release = self.store.release
        self.merger.read_pending_from(self.pending.spooled)
        self.loop = RoundsLoop(lock=self.lock, clock=p.clock, state=self.state, store=self.store, pending=self.pending,
                               ckpt=self.ckpt, log=self.log, telemetry=self.telemetry, rounds=self.rounds,
                               streams=self.streams, counters=self.counters, after_finish=p.after_finish)
        self.round = OpenRound(RoundParts(
            state=self.state, store=self.store, pending=self.pending, loop=self.loop, intake=self.intake,
            clock=p.clock, log=self.log, history=self.history, counters=self.counters, telemetry=self.telemetry,
            rounds=self.rounds, claim_wait_s=p.cfg.coordinator.stream_idle_s))
        self.loop.start()

    # -- refusals -----------------------------------------------------------------------------------

    def _abort(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str,
               push: PushInfo | None = None, busy: bool = False, retry_after_s: float = 0.0,
               stopped: bool = False) -> NoReturn:
        """Ends a call served on a thread (Join, Heartbeat, Status) with ``code``: :meth:`answer`."""
        self.answer(context, CallRefused(code, message, push=push, busy=busy, retry_after_s=retry_after_s,
                                         stopped=stopped))

    def answer(self, context: grpc.ServicerContext, e: CallRefused) -> NoReturn:
        """Ends a call served on a thread with refusal ``e``, recorded and marked (:meth:`refusal`); the data
        plane's calls end theirs with ``coordinator.data_plane.DataPlane.answer``."""
        metadata = self.refusal(e)
        if metadata:
            context.set_trailing_metadata(metadata)
        context.abort(e.code, str(e))
        raise AssertionError("unreachable: abort raises")

    def refusal(self, e: CallRefused) -> tuple[tuple[str, str], ...]:
        """Records a refusal (every refusal goes through here; an upload that broke off, ``record=False``, is not
        one) with the method and the island of the call (``coordinator.handlers.CURRENT_CALL``: the handlers note
        them), and returns the trailing metadata to end the call with. ``busy``: a refusal for load (a stream
        limit), not for the request: its metadata says so (:data:`dtrain.net.wire.BUSY_METADATA_KEY`), and workers
        retry it. ``retry_after_s`` > 0: the same request is refused for that many seconds more (a throttled
        island's push): its metadata says how many (:data:`dtrain.net.wire.RETRY_AFTER_METADATA_KEY`), and the
        island waits them out before it sends it again. ``stopped``: the request's island is quarantined: its
        metadata says so with the version (:data:`dtrain.net.wire.STOPPED_METADATA_KEY`), and the island stops."""
        metadata: tuple[tuple[str, str], ...] = ()
        if e.busy:
            metadata = ((BUSY_METADATA_KEY, "1"),)
        elif e.stopped:
            with self.lock:
                version = self.state.version
            metadata = ((STOPPED_METADATA_KEY, str(version)),)
        elif e.retry_after_s > 0:
            metadata = ((RETRY_AFTER_METADATA_KEY, f"{e.retry_after_s:.3f}"),)
        if e.record:
            self._record_refusal(CURRENT_CALL.method, CURRENT_CALL.island, e.code, str(e), push=e.push, busy=e.busy,
                                 retry_after_s=e.retry_after_s)
        return metadata

    @staticmethod
    def state_refusal(e: StateError) -> CallRefused:
        """A state-machine refusal as the gRPC refusal its code names."""
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.busy else _CODES[e.code]
        return CallRefused(code, str(e), busy=e.busy, stopped=e.stopped)

    def refuse_request(self, context: grpc.ServicerContext, why: str) -> NoReturn:
        """Ends a call whose request the edge refused (``coordinator/edge.py``): INVALID_ARGUMENT, recorded as
        every refusal is (:meth:`_abort`)."""
        self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, why)

    def _record_refusal(self, method: str, island: str, code: grpc.StatusCode, message: str,
                        push: PushInfo | None = None, busy: bool = False, retry_after_s: float = 0.0) -> None:
        """Records a refused (or cancelled) call: counted by kind (method and code: Status' refusals) and, at a
        bounded rate (``coordinator.refusal_events``), an event naming the method and the island:
        ``request_invalid`` for a bad request (:data:`_BAD_REQUEST`), ``request_rejected`` for the others and
        for a ``busy`` one. A refused ``push`` is also counted in pushes_refused and, logged, a ``push_refused``
        event and a progress line (with ``retry_after_s``, the seconds its island is throttled for)."""
        kind = "request_invalid" if code in _BAD_REQUEST and not busy else "request_rejected"
        with self.lock:  # reentrant; the event's listeners (history, telemetry) are updated under the lock
            if push is not None:
                self.counters.pushes_refused += 1
            log, over = self.refusals.refused(f"{method.rsplit('/', 1)[-1] or '?'}: {code.name}", self.clock())
            self._suppressed(over)
            if log:
                self.log.event(kind, method=method, island=island, code=code.name, error=message)
                if push is not None:
                    self._push_refused(push, code.name, message, retry_after_s)
                elif not busy:  # a refused Join (a fingerprint mismatch, ...), a bad request: one line, its reason
                    self.log.progress(refusal_line(method, island, code.name, message))

    def _suppressed(self, over: list[tuple[str, int]]) -> None:
        """Logs the refusals the rate limit held back in windows now over: a ``refusals_suppressed`` event each."""
        for kind, count in over:
            self.log.event("refusals_suppressed", refused=kind, count=count, window_s=self.refusals.window_s)
            self.log.progress(f"{count} more refused calls ({kind}) in {self.refusals.window_s:g}s, not logged one "
                              f"by one (coordinator.refusal_events); Status counts them in refusals")

    def _decide(self, context: grpc.ServicerContext, decision: Callable[CallArgs, Decided], *args: CallArgs.args,
                **kwargs: CallArgs.kwargs) -> Decided:
        """Calls a state-machine method; a refusal (StateError) becomes the gRPC status its code names."""
        try:
            return decision(*args, **kwargs)
        except StateError as e:
            self.answer(context, self.state_refusal(e))

    def _push_refused(self, info: PushInfo, code: str, reason: str, retry_after_s: float = 0.0) -> None:
        """Logs a refused push (:meth:`_abort`, under the lock): a ``push_refused`` event naming it (with
        ``retry_after_s``, the seconds its island is throttled for), a progress line."""
        self.log.event("push_refused", island=info.island_id, push_id=info.push_id, code=code,
                       tokens=info.tokens, cursor=[info.cursor_start, info.cursor_end], reason=reason,
                       **({"retry_after_s": round(retry_after_s, 3)} if retry_after_s > 0 else {}))
        self.log.progress(f"refused push {info.push_id} from {info.island_id}: {reason}")

    def _authorize(self, context: grpc.ServicerContext, island_id: str) -> None:
        """Refuses (PERMISSION_DENIED) a call as ``island_id`` from an identity not bound to it
        (``CoordinatorState.authorize``), before anything else of the call is read."""
        identity = self.identity.of(context)
        with self.lock:
            self._decide(context, self.state.authorize, island_id, identity)

    # -- RPCs ---------------------------------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        diff = self.fingerprint.mismatch(dict(request.fingerprint_fields))
        if diff:
            self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"config fingerprint mismatch: {diff}")
        identity = self.identity.of(context)
        with self.lock:
            if self.state.stopped():  # the refusal below says why; this tells the island's client to exit 0
                context.set_trailing_metadata(((RUN_OVER_METADATA_KEY, str(self.state.version)),))
            record, reason = self._decide(context, self.state.join, request.island, request.hardware,
                                          request.devices, self.clock(), identity)
            segment = self.state.segment(record)
            cursor, cursor_end = self.state.segment_cursor(segment), segment.end
            version = self.state.version
            view = self.history.island(record.island_id)
            view.device_kind, view.last_seen = request.device_kind, self.clock()
            self.lock.notify_all()  # a new lease: the ticker's next deadline may be sooner
        self.log.event("island_joined", island=record.island_id, name=record.name, shard=record.shard_index,
                       cursor=cursor, segment=[record.segment_start, cursor_end], hardware=record.hardware,
                       devices=record.devices,
                       device_kind=request.device_kind, reason=reason,
                       **({"identity": identity} if identity is not None else {}))  # security.identity's
        self.log.progress(f"{record.name} joined: shard {record.shard_index}, cursor {cursor} ({reason})")
        return pb.JoinResponse(island_id=record.island_id, version=version, shard_index=record.shard_index,
                               shard_count=self.opts.islands, cursor=cursor, cursor_end=cursor_end,
                               segment_start=record.segment_start,
                               lease_s=self.opts.coordinator.lease_s,
                               run_id=self.run_id, tree_size=self.tree_size, tree_digest=self.tree_digest,
                               total_versions=self.opts.end_version,
                               shard_addresses=self.store.shard_addresses)

    def _clock_view(self, record: IslandRecord | None) -> tuple[object, ...]:
        """Under the lock: what of an island's record and the state a heartbeat may change that the clock decides
        on (``coordinator/quorum.py``: the island's state and version, its devices, the run's round length). A
        heartbeat that changes none of it only renews a lease, which moves no deadline sooner, so it does not wake
        the clock: 64 islands heartbeat 64 times a second."""
        island = () if record is None else (record.state, record.version, record.devices, len(record.quarantined))
        return (*island, self.state.round_seconds)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self._authorize(context, request.island_id)
        # The reports the state machine does not judge, checked first: a refused heartbeat changes nothing.
        if request.HasField("train_loss") and not (math.isfinite(request.train_loss) and request.train_loss >= 0):
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"train_loss={request.train_loss}: must be a finite number >= 0 (or absent)")
        if not 0.0 <= request.utilization <= 1.0:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"utilization={request.utilization}: must be in [0, 1]")
        evals = [(e.version, e.loss) for e in request.evals[:MAX_EVAL_REPORTS + 1]]
        with self.lock:
            problem = check_eval_reports(evals, self.state.version)
        if problem:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        with self.lock:
            record = self.state.islands.get(request.island_id)
            known = len(record.quarantined) if record is not None else 0  # the record's list only grows
            seen = self._clock_view(record)
            action, reason = self._decide(
                context, self.state.heartbeat, request.island_id, request.version, request.steps, request.tokens,
                request.steps_per_s, request.params_digest, tuple(request.bad_devices), self.clock(),
                quarantined=[evidence_from_message(e) for e in request.quarantined], devices=request.devices,
                tokens_per_s=request.tokens_per_s, round_seconds=request.round_seconds)
            new = record.quarantined[known:] if record is not None else ()
            healthy, name = (record.devices, record.name) if record is not None else (0, "")
            version = self.state.version
            if self._clock_view(record) != seen:  # its version may finish the run, its state ready a round
                self.lock.notify_all()
            if request.params_digest and request.version == version and request.params_digest != self.params_digest:
                self.log.event("digest_mismatch", island=request.island_id, version=version)
            unknown = bool(request.pending_push_id) and not self.state.push_known(request.pending_push_id)
            settled = self._heard_from(request, evals)
        for event in settled:  # the history folds each in (RunLog.subscribe)
            self.log.progress(eval_progress(event))
            self.log.event(event.pop("event"), **event)
        for e in new:  # once per (island, device): a later report naming it again adds nothing to the record
            self.log.event("device_quarantined", island=request.island_id, name=name, **e.to_json(), healthy=healthy)
            self.log.progress(f"{request.island_id} quarantined device {e.device} (mesh index {e.index}; {e.probe} "
                              f"probe, step {e.step}): {e.detail}")
        return pb.HeartbeatResponse(action=_ACTIONS[action], version=version, lease_s=self.opts.coordinator.lease_s,
                                    reason=reason, push_unknown=unknown)

    def _heard_from(self, request: pb.HeartbeatRequest, evals: list[tuple[int, float]]) -> list[dict[str, Any]]:
        """A heartbeat's reports in the island's view of the history (utilization, train loss, last seen), and the
        events its eval reports make (``RunHistory.eval_report``, ``settle_evals``). Under the lock."""
        view = self.history.island(request.island_id)
        view.utilization, view.last_seen = request.utilization, self.clock()
        if request.HasField("train_loss"):
            view.train_loss = request.train_loss
        now, live = self.clock(), [r.island_id for r in self.state.live()]
        return [e for v, loss in evals for e in self.history.eval_report(request.island_id, v, loss, now, live)] + \
            self.history.settle_evals(now, live)

    async def PushDelta(self, request_iterator: AsyncIterator[Any],
                        context: grpc.aio.ServicerContext) -> pb.PushDeltaResponse:
        assert self.plane is not None, "served by coordinator.app.serve"
        return await self.plane.push(request_iterator, context)

    def _stream_cancelled(self, stream: Stream, why: str) -> None:
        """A push stream the reaper cancelled (:class:`coordinator.streams.PushStreams`): a refusal (CANCELLED)."""
        self._record_refusal(f"/{SERVICE}/PushDelta", stream.island, grpc.StatusCode.CANCELLED, why)

    @property
    def params_digest(self) -> str:
        """The digest of the whole global θ (a sharded coordinator's: over every range, ``fragments.joined_digest``).
        Under the lock."""
        return self.store.digest

    @property
    def theta_norm(self) -> float:
        """The L2 norm of the whole global θ. Under the lock."""
        return self.store.theta_norm

    async def PullGlobal(self, request: pb.PullRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PullMessage | bytes]:
        assert self.plane is not None, "served by coordinator.app.serve"
        async for message in self.plane.pull(request, context):
            yield message

    def check_pull(self, request: pb.PullRequest, identity: str | None) -> None:
        """Whether the pull may be served: its caller may act as its island, and the state allows it
        (``CoordinatorState.check_pull``); CallRefused if not."""
        with self.lock:
            try:
                self.state.authorize(request.island_id, identity)
                self.state.check_pull(request.island_id, request.have_version)
            except StateError as e:
                raise self.state_refusal(e) from None

    def pull_messages(self, request: pb.PullRequest) -> Iterator[pb.PullMessage | bytes]:
        """What the pull streams from now: the current version's frames (decided here, under the lock, with their
        ``pull_served`` event), as a generator of messages that reads them piece by piece."""
        with self.lock:
            version = self.state.version
            # θ itself, lossless, when the chain is not kept: written to disk once per version, streamed from there
            full, chain = self.merger.pull_frames(request.have_version, request.full)
            kind = pb.PULL_KIND_FULL if full else pb.PULL_KIND_UPDATE
            # Opened under the lock: a frame deleted by a later merge stays readable through its handle.
            frames = [(kind, u.base_version, u.version, u.size, u.crc32, u.params_digest, u.open(), u)
                      for u in chain]
            final = self.state.stopped() or version == self.opts.end_version
            live, every = [r.island_id for r in self.state.live()], self.cfg.coordinator.eval_every
            evaluate = {f[2] for f in frames if self.history.assign_eval(  # any frame's version may be one to evaluate
                request.island_id, f[2], final and f[2] == version, every, self.clock(), live)}
            self.history.island(request.island_id).last_seen = self.clock()
            pace = self.state.pace
            paced = {f[2]: pace.seconds_at(f[2]) for f in frames} if pace is not None else {}
        if not frames:
            return iter([pb.PullMessage(header=pb.PullHeader(kind=pb.PULL_KIND_CURRENT, version=version,
                                                             base_version=version, tree_digest=self.tree_digest))])
        self.log.event("pull_served", island=request.island_id, have_version=request.have_version,
                       frames=[[pb.PullKind.Name(f[0]), f[1], f[2], f[3]] for f in frames], evaluate=bool(evaluate))
        return self._frames(request.island_id, frames, evaluate, paced)

    def _frames(self, island_id: str, frames: list[Any], evaluate: set[int],
                paced: dict[int, float]) -> Iterator[pb.PullMessage | bytes]:
        """A pull's frames as messages: each one's header, then its chunks (one build shared by the pulls
        streaming it at once: ``coordinator/pull_cache.py``)."""
        piece = self.pull_piece
        with self.streams.streaming():
            for kind, base, v, size, crc, digest, handle, update in frames:
                yield pb.PullMessage(header=pb.PullHeader(
                    kind=kind, version=v, base_version=base, tree_digest=self.tree_digest, total_bytes=size,
                    frame_crc32=crc, chunks=chunk_count(size, piece), params_digest=digest,
                    evaluate=v in evaluate, round_seconds=paced.get(v, 0.0)))
                yield from self.pull_cache.messages(update, handle, piece)
                with self.lock:
                    self.counters.bytes_out += size
                    self.history.island(island_id).bytes_out += size

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.status_message()

    def status_message(self) -> pb.StatusResponse:
        """The run's status now: what the Status RPC answers and the dashboard shows
        (:func:`coordinator.status_view.status_response`)."""
        with self.lock:
            return status_response(self.state, self.history, self.opts, self.counters, run_id=self.run_id,
                                   params_digest=self.params_digest, started_at=self.started_at, now=self.clock())

    def close(self) -> None:
        """Stops the ticker and the dashboard, records what is pending (refused calls, open round spans) and
        closes the telemetry, the merger, the checkpointer and the run's log, in that order."""
        self.loop.health.enter_graceful_shutdown()  # NOT_SERVING from now on
        if self.dashboard is not None:
            self.dashboard.close()
        self.loop.stop()
        if self.plane is not None:
            self.plane.close()
        self.push_streams.stop()
        self.auth_failures.flush()  # before telemetry shuts down
        with self.lock:
            self._suppressed(self.refusals.due())
        self.rounds.close_all()
        self.telemetry.shutdown()  # its last collection reads the Status: before the merger closes
        with self.lock:
            self.merger.close()
        self.store.close()
        if self.ckpt is not None:
            self.ckpt.close()
        self.log.close()
