"""The open round: a push's whole path, sans I/O, from its header to its reply.

:class:`OpenRound` is the push's path, with no I/O of its own: :meth:`OpenRound.begin` (the header and the
identity: a reply for a retry, else the push's record, ``coordinator.pending.PushRecord``, whose payload is to be
read), :meth:`OpenRound.chunk` (one message of its payload), :meth:`OpenRound.finish` (the client half-closed: the
decision, the reply), :meth:`OpenRound.close` (always). Whatever server reads the stream drives it: the
coordinator's event loop (``coordinator/data_plane.py``) reads the stream, calls these on its executor and answers
what they return or raise (:class:`coordinator.refusals.CallRefused`). An accepted push joins the open round's
pending set (``coordinator/pending.py``), the one place a pending push lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from coordinator.history import RunHistory
from coordinator.pending import PendingSet, PushRecord
from coordinator.push import PayloadRefused, PushIntake, UploadBroke, push_info
from coordinator.records import Admission, PushInfo, StateError
from coordinator.refusals import CallRefused
from coordinator.rounds_loop import RoundsLoop
from coordinator.state import CoordinatorState
from coordinator.status_view import Counters
from coordinator.theta_store import PartsRefused, ThetaStore
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import WireError
from dtrain.runlog import RunLog
from dtrain.telemetry import RoundSpans, Telemetry

_STATUS = {"accept": pb.PUSH_STATUS_PENDING, "duplicate": pb.PUSH_STATUS_DUPLICATE, "drop": pb.PUSH_STATUS_DROPPED,
           "reject": pb.PUSH_STATUS_REJECTED}
_CODES = {"INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
          "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION, "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
          "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED}


@dataclass
class RoundParts:
    """What :class:`OpenRound` works with (the service's parts)."""

    state: CoordinatorState
    store: ThetaStore
    pending: PendingSet
    loop: RoundsLoop
    intake: PushIntake
    clock: Callable[[], float]
    log: RunLog
    history: RunHistory
    counters: Counters
    telemetry: Telemetry
    rounds: RoundSpans
    claim_wait_s: float  # how long a sharded lead waits for a push's parts on the other shards


class OpenRound:
    """A push's path through the open round, sans I/O (see the module docstring). Takes the service's lock
    (``loop.lock``) for its decisions; reading the stream and answering are its driver's."""

    def __init__(self, parts: RoundParts):
        self.p = parts
        self.lock = parts.loop.lock

    def _refuse_if_failed(self) -> None:
        if self.p.loop.fatal:  # the process is on its way out: nothing more may touch the merger
            raise CallRefused(grpc.StatusCode.UNAVAILABLE, f"coordinator failed: {self.p.loop.fatal}")

    @staticmethod
    def _refused(info: PushInfo, e: StateError) -> CallRefused:
        return CallRefused(_CODES[e.code], str(e), push=info, retry_after_s=e.retry_after_s, stopped=e.stopped)

    def begin(self, h: pb.PushHeader, identity: str | None) -> PushRecord | pb.PushDeltaResponse:
        """The push's header (it passed the edge and ``push.read_header``): refused (CallRefused), answered at once
        (a retry of a push already received: its reply), or its record with its upload open, whose payload is to
        be read (:meth:`chunk`, :meth:`finish`; :meth:`close` in any case)."""
        p, info = self.p, push_info(h)
        with self.lock:
            self._refuse_if_failed()
            try:
                p.state.authorize(info.island_id, identity)
                # A preview, to refuse the push (an unknown island is NOT_FOUND) before its payload streams in.
                preview = p.state.admit_push(info, p.clock())
                if preview.status == "duplicate":  # a retry of a push already received: nothing to receive
                    preview = p.state.commit_push(info, p.clock())  # counts the retry
            except StateError as e:
                raise self._refused(info, e) from None
            if preview.status == "duplicate":
                version, cursor = p.state.version, p.state.push_cursor(info)  # where the island's next range starts
                pending_still = info.push_id in p.pending
        if preview.status == "duplicate":
            if not pending_still:  # a merged push's parts on the other shards, sent again: let go
                p.store.release([info.push_id])
            p.log.event("push_duplicate", island=info.island_id, push_id=info.push_id)
            return pb.PushDeltaResponse(status=pb.PUSH_STATUS_DUPLICATE, merged_version=preview.target_version,
                                        version=version, reason=preview.reason, cursor=cursor)
        rec = PushRecord(h, info, identity, preview)
        # Its round's span (an accepted preview starts it); a push to be dropped or rejected is a trace of its own.
        rec.round_span = p.rounds.open(preview.target_version) if preview.status == "accept" else None
        try:
            receiver = p.intake.frame_receiver(h)
        except WireError as e:
            raise CallRefused(e.code, str(e)) from None
        rec.spool = p.store.merger.spool(h.fragment)  # the frame holds that fragment only
        rec.upload = p.intake.upload(receiver, rec.spool, info, rec.round_span, preview.target_version,
                                     preview.status)
        return rec

    def chunk(self, rec: PushRecord, msg: object) -> None:
        """One message of the push's payload (after its header). CallRefused for a bad one."""
        assert rec.upload is not None
        try:
            rec.upload.chunk(msg)  # type: ignore[arg-type]
        except PayloadRefused as e:
            raise self._payload_refused(rec, e) from None

    def broke(self, rec: PushRecord) -> CallRefused:
        """The call was cancelled, or its client's stream broke, before the payload was whole: a ``push_aborted``
        event; the exception to end it with (INVALID_ARGUMENT, which a cancelled caller never sees; not a
        refusal). The island may send the whole push again under the same push_id."""
        assert rec.upload is not None
        return self._aborted(rec, rec.upload.broke())

    def _aborted(self, rec: PushRecord, e: UploadBroke) -> CallRefused:
        info = rec.info
        self.p.log.event("push_aborted", island=info.island_id, push_id=info.push_id, chunks_received=e.received,
                         chunks=e.chunks, reason=str(e))
        self.p.log.progress(f"push {info.push_id} from {info.island_id}: upload broke off after {e.received} of "
                            f"{e.chunks} chunks; discarded")
        return CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e), record=False)

    @staticmethod
    def _payload_refused(rec: PushRecord, e: PayloadRefused) -> CallRefused:
        """A bad payload: a refusal naming the push (a busy one does not)."""
        return CallRefused(e.code, str(e), push=None if e.busy else rec.info, busy=e.busy)

    def finish(self, rec: PushRecord) -> pb.PushDeltaResponse:
        """The client half-closed: the frame validated, its parts on the other shards claimed (a sharded lead), the
        state's decision made again on the payload and applied (an accepted push joins the pending set and may
        complete its round: the reply then waits for the clock's merge), its events logged; returns the reply.
        CallRefused for a refusal. Blocks: the decision waits for a merge being computed."""
        p, info = self.p, rec.info
        assert rec.upload is not None and rec.spool is not None
        try:
            rec.upload.end()
        except PayloadRefused as e:
            raise self._payload_refused(rec, e) from None
        except UploadBroke as e:
            raise self._aborted(rec, e) from None
        finally:
            rec.upload.close()
        try:  # the whole push's norm (a sharded coordinator's: its parts on the other shards claimed)
            rec.parts = True  # claimed, or let go already by a refused claim: released below unless merged
            norm = p.store.whole_norm(info, rec.spool, rec.identity, p.claim_wait_s)
        except PartsRefused as e:
            rec.parts = False  # the refused claim let every part go
            raise CallRefused(e.code, str(e), push=info) from None
        with self.lock:
            admission, status, version, cursor = self._commit(rec, norm)
        self._log_received(rec, admission)
        with self.lock:
            p.loop.log_quarantined()
            stop_reason = p.state.stop_reason(info.island_id)  # this push's rejection quarantined its island
        return pb.PushDeltaResponse(status=status, merged_version=admission.target_version, version=version,
                                    reason=admission.reason, weight=admission.weight, cursor=cursor,
                                    stop_reason=stop_reason)

    def _commit(self, rec: PushRecord, norm: float) -> tuple[Admission, pb.PushStatus, int, int]:
        """The state's decision on a received push, made again now that the payload is here (the round may have
        closed meanwhile), with the payload's norm, and applied: an accepted one joins the pending set (summing a
        delta that validate() accepted cannot fail), and may complete its round (the clock merges it; the reply
        waits for that). Returns (admission, the reply's status, version, cursor). Under the lock."""
        p, info = self.p, rec.info
        assert rec.spool is not None
        self._refuse_if_failed()
        p.loop.wait_merged()  # a merge being computed: this push is judged against the version it makes
        self._refuse_if_failed()
        try:
            admission = p.state.commit_push(info, p.clock(), norm=norm, theta_norm=p.store.theta_norm)
        except StateError as e:
            raise self._refused(info, e) from None
        rec.admission = admission
        if admission.status == "accept":  # its spool joins the next outer step's sum (the state keeps the rest)
            p.pending.spool(info.push_id, p.store.spooled(rec.spool, admission.weight, admission.scale, info.push_id,
                                                          norm))
        assert rec.upload is not None
        size = rec.upload.receiver.size
        p.counters.bytes_in += size
        p.telemetry.record_ratio(4 * rec.spool.n, size, "up")
        view = p.history.island(info.island_id)
        view.bytes_in += size
        view.last_seen = p.clock()
        self.lock.notify_all()  # wakes the clock: a first push starts its round's grace, a last one completes it
        status = _STATUS[admission.status]
        if admission.status == "accept" and p.state.round_ready(p.clock())[0]:
            # It completed its round: the clock merges it (only the clock does); the reply says how that went.
            # The wait costs this thread the merge's time, not the lock.
            def settled() -> bool:  # the clock is done with its round: merged, or it was rejected and the rest merged
                if p.loop.fatal is not None or p.loop.closing:
                    return True
                return p.loop.merging is None and (not p.state.round_ready(p.clock())[0] or (
                    not p.state.is_pending(info.push_id) and p.state.version >= admission.target_version))

            self.lock.wait_for(settled)
            if p.loop.fatal:  # the step failed (a full disk, a coordinator shard gone): the coordinator failed,
                # and is to be resumed from its checkpoint; the island sends the push again to the resumed one
                raise CallRefused(grpc.StatusCode.UNAVAILABLE, f"coordinator failed: {p.loop.fatal}")
        version = p.state.version
        rejected = p.state.rejected(info.push_id)
        if rejected is not None and admission.status == "accept":  # the merge it completed rejected it
            status, admission = pb.PUSH_STATUS_REJECTED, dataclasses.replace(admission, reason=rejected)
        elif status == pb.PUSH_STATUS_PENDING and version >= admission.target_version:
            status = pb.PUSH_STATUS_MERGED
        return admission, status, version, p.state.push_cursor(info)

    def _log_received(self, rec: PushRecord, admission: Admission) -> None:
        info, log = rec.info, self.p.log
        log.event("push_received", island=info.island_id, push_id=info.push_id, status=admission.status,
                  base_version=info.base_version, tokens=info.tokens, weight=admission.weight,
                  staleness=admission.staleness, bytes=rec.upload.receiver.size if rec.upload else 0,
                  norm=admission.norm, scale=admission.scale, reason=admission.reason)
        if admission.status == "reject":
            log.event("push_quarantined", island=info.island_id, push_id=info.push_id, norm=admission.norm,
                      reason=admission.reason)
            log.progress(f"quarantined push {info.push_id} from {info.island_id}: {admission.reason}")

    def close(self, rec: PushRecord) -> None:
        """The call is over, however it ended: its upload uncounted, its spool closed unless the merger took it,
        its parts on the other shards let go unless it is pending (or merged)."""
        if rec.upload is not None:
            rec.upload.close()
        if rec.spool is not None:
            rec.spool.__exit__(None, None, None)  # closes it unless the merger keeps it (Spool.keep)
        pending = rec.admission is not None and rec.admission.status == "accept"
        if rec.parts and not pending:
            rec.parts = False
            self.p.store.release([rec.info.push_id])
