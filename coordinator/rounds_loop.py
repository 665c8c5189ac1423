"""The coordinator's clock and its merges: the background loop that drives the run between RPCs.

Owns the ticker thread (:meth:`RoundsLoop.run`: it expires leases, merges rounds that are ready and notes when the
run is finished), the outer step with its checkpoint and events, the run's end (finished, failed, asked to stop,
and the waits on them) and what the grpc.health.v1 service says about it. Only the clock merges: a push that
completes a round notifies the lock and wakes it. A merge is decided and snapshotted under the service's lock
(:meth:`RoundsLoop.begin_merge`), computed outside it (:meth:`RoundsLoop.step`: the slab-by-slab outer step, and
on a sharded lead the other shards' prepare and commit), and committed under it (:meth:`RoundsLoop.end_merge`);
a push whose decision falls in that window waits for the commit. Everything else here runs under the lock, a
condition notified on every change of state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from grpc_health.v1 import health, health_pb2

from coordinator.memory import FrameStreams
from coordinator.merge_types import NonFiniteResult
from coordinator.records import Admission, PushInfo
from coordinator.state import CoordinatorState
from coordinator.status_view import Counters
from dtrain.net.wire import SERVICE
from dtrain.runlog import RunLog
from dtrain.telemetry import RoundSpans, Telemetry

if TYPE_CHECKING:
    from coordinator.pending import PendingSet
    from coordinator.theta_store import ThetaStore
    from dtrain.checkpoint import Checkpointer

log = logging.getLogger(__name__)

# `dtrain coordinator --after-finish`: what the coordinator does once its run is finished (RoundsLoop)
AfterFinish = Literal["exit", "serve"]


class Signal(NamedTuple):
    """What waiters outside the lock wait for (:meth:`RoundsLoop.signal`)."""

    version: int
    over: bool  # the run is over, the service failed, or it is closing: no version will come
    merging: bool  # a merge is being computed


@dataclasses.dataclass
class MergeJob:
    """One merge in flight (:meth:`RoundsLoop.begin_merge`): the round as snapshotted under the lock, and the outer
    step's outcome (``prepared``, or ``error``) from :meth:`RoundsLoop.step`, run outside it."""

    version: int  # the version it makes
    reason: str  # why the round was ready
    t0: float  # perf_counter at its start
    round_span: Any
    pending: list[tuple[PushInfo, Admission]]
    frame_bytes: dict[str, int]  # push id -> its frame's bytes (read before the step releases the spools)
    values: int  # the update's values (its fragment's, with outer.fragments)
    fragment: dict[str, int]  # the round_merged event's fragment fields
    prepared: Any = None  # what the store's prepare() made (ThetaStore)
    error: BaseException | None = None


class RoundsLoop:
    """The service's clock, its merges and its end, over the service's ``lock``, ``state`` and ``merger``.

    ``after_finish``: what a finished run does (``dtrain coordinator --after-finish``): ``exit`` (health
    NOT_SERVING once finished, :meth:`wait_finished` returns) or ``serve`` (it keeps serving, health SERVING,
    until :meth:`request_stop`: :meth:`wait_stop_requested`). ``counters``: where merge time is added;
    ``streams``: trimmed after each merge. The ticker starts with :meth:`start` and ends with :meth:`stop`."""

    def __init__(self, *, lock: threading.Condition, clock: Callable[[], float], state: CoordinatorState,
                 store: ThetaStore, pending: PendingSet, ckpt: Checkpointer | None, log: RunLog, telemetry: Telemetry,
                 rounds: RoundSpans, streams: FrameStreams, counters: Counters, after_finish: AfterFinish):
        """``store``: θ's store (``coordinator/theta_store.py``), whose outer step the merges run: the merger's own,
        or every shard's; ``pending``: the open round's pushes (``coordinator/open_round.py``), which a merge
        closes and a screen or a non-finite step rejects from."""
        self.lock, self.clock, self.state, self.store, self.ckpt = lock, clock, state, store, ckpt
        self.pending = pending
        self.merger = store.merger
        self.log, self.telemetry, self.rounds, self.streams = log, telemetry, rounds, streams
        self.counters, self.after_finish = counters, after_finish
        self.fatal: str | None = None  # why the service failed; it then refuses pushes and run_coordinator exits
        self.finished: str | None = None  # why the service may stop serving (the state's decision, or a signal)
        self.stop_requested: str | None = None  # why request_stop was called (a signal), if it was
        self.closing = False
        # grpc.health.v1 (registered by serve()): SERVING until the run is over (after_finish="serve": until asked
        # to stop), the service failed, or it stops.
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._serving: bool | None = None  # what the health service says now (None: nothing yet)
        self._cosines: dict[str, float] = {}  # the open round's direction screen: push id -> cosine (screened_mean)
        self.merging: MergeJob | None = None  # the merge being computed outside the lock, if any
        # Told (under the lock) of every change a waiter outside the lock may wait for: the version, the run over
        # or failed or closing, a merge begun or ended (coordinator/data_plane.py's bell: the event loop's waits).
        self.listeners: list[Callable[[Signal], None]] = []
        self._ticker = threading.Thread(target=self.run, name="coordinator-tick", daemon=True)

    def start(self) -> None:
        self._ticker.start()

    def signal(self) -> Signal:
        """What a waiter outside the lock may wait for, now. Under the lock."""
        return Signal(self.state.version, self.state.stopped() or self.fatal is not None or self.closing,
                      self.merging is not None)

    def _changed(self) -> None:
        """Under the lock: wakes every waiter on it, and tells the listeners."""
        self.lock.notify_all()
        if self.listeners:
            now = self.signal()
            for listener in self.listeners:
                listener(now)

    def stop(self) -> None:
        """Ends the ticker and waits for it, up to 5 s."""
        with self.lock:
            self.closing = True
            self._changed()  # wakes the ticker, which then ends
        self._ticker.join(timeout=5)

    # -- merges -------------------------------------------------------------------------------------

    def _paced(self, version: int) -> dict[str, Any]:
        """The ``round_merged`` event's pacing fields (``worker.round_seconds = auto``, sync rounds: the length given
        to the round that starts from ``version`` and the run's tokens budget, ``coordinator.pacing``)."""
        pace = self.state.pace
        seconds = pace.seconds_at(version) if pace is not None else 0.0
        return {"next_round_s": round(seconds, 4), "budget_tokens": pace.budget} if pace is not None and seconds else {}

    def begin_merge(self, now: float) -> MergeJob | None:
        """Under the lock: if the state says the open round is ready (after the round screen), snapshots it and
        marks the merge begun (pushes that arrive meanwhile wait for its commit, :meth:`wait_merged`); the caller
        then runs :meth:`step` outside the lock and :meth:`end_merge` under it. None: nothing to merge."""
        if self.fatal or self.merging is not None:
            return None
        ready, reason = self.state.round_ready(now)
        if not ready:
            return None
        if self._screen_round(now):
            ready, reason = self.state.round_ready(now)
            if not ready:
                return None
        version = self.state.version + 1
        part = self.merger.next_fragment()  # the fragment this step merges (outer.fragments; else the whole θ)
        self.merging = MergeJob(
            version=version, reason=reason, t0=time.perf_counter(), round_span=self.rounds.ready(version, reason),
            pending=self.state.pending(), frame_bytes=self.pending.frame_bytes(),
            values=part.size, fragment={"fragment": part.index, "values": part.size} if self.merger.fragments > 1
            else {})
        self._changed()
        return self.merging

    def step(self, job: MergeJob) -> None:
        """Outside the lock: the outer step up to its commit (every shard's too, on a sharded lead), its outcome kept
        in ``job``. Nothing here is seen by a reader of the state or the merger until :meth:`end_merge`."""
        try:
            with self.telemetry.span("dtrain.merge", parent=job.round_span, version=job.version,
                                     pushes=len(job.pending)):
                job.prepared = self.store.prepare()
        except BaseException as e:
            job.error = e

    def end_merge(self, job: MergeJob, now: float) -> None:
        """Under the lock: commits :meth:`step`'s result (the new version, its ``round_merged`` event, the
        checkpoint), or rejects the push a non-finite step blamed (the round is tried again on the next turn of
        the clock), or makes any other failure fatal (:attr:`fatal`; run_coordinator then exits, and pushes are
        refused UNAVAILABLE). Wakes every waiter either way."""
        self.merging = None
        self._changed()  # pushes waiting for the merge, pulls waiting for the version, the clock
        if isinstance(job.error, NonFiniteResult):
            self._reject_blamed(job.error, now)
            return
        if job.error is not None or job.prepared is None:
            # A failed step (a full disk, say) stops the service. The step only commits at its end, so the
            # previous version's files and the pending spools are intact, but a disk that just failed is not
            # retried blindly: `dtrain coordinator --resume` restarts from the last checkpoint, and the islands
            # push the open round again (HeartbeatResponse.push_unknown).
            e = job.error or RuntimeError("the outer step returned nothing")
            self.fatal = f"outer step for version {job.version} failed: {type(e).__name__}: {e}"
            self.log.event("coordinator_failed", error=self.fatal)
            log.debug("the failed outer step", exc_info=e)
            self._changed()
            self.set_health()
            return
        update = self.store.commit(job.prepared)
        version, merged, close_reason = self.state.close_round(now, decided=job.reason)
        assert version == update.version == job.version, (version, update.version, job.version)
        pending = job.pending
        # Logged before the checkpoint: a coordinator killed between the two resumes at the previous version,
        # and its coordinator_resumed event tells a reader (dtrain.audit) that this merge was rolled back; the
        # other order would leave a checkpointed version with no record of what went into it.
        self.log.event("round_merged", version=version, reason=close_reason,  # it says why the round closed
                       pushes=[{"island": i.island_id, "push_id": i.push_id, "tokens": i.tokens,
                                "shard": i.shard_index, "start": i.cursor_start, "end": i.cursor_end,
                                "steps": i.inner_steps, "bytes": job.frame_bytes.get(i.push_id, 0),
                                "weight": a.weight, "staleness": a.staleness, "norm": a.norm, "scale": a.scale,
                                **({"cosine": round(self._cosines[i.push_id], 4)} if i.push_id in self._cosines
                                   else {})}
                               for i, a in pending],
                       update_bytes=update.size, params_digest=update.params_digest,
                       merge_s=round(time.perf_counter() - job.t0, 6), **job.fragment, **self._paced(version))
        if self.ckpt is not None:  # links the new version's files: no copy of θ or momentum
            with self.telemetry.span("dtrain.checkpoint", parent=job.round_span, version=version):
                self.ckpt.save_files(version, self.merger.state_files(),
                                     {"state": self.state.to_json(), "version": version,
                                      "params_digest": self.merger.digest, **self.store.checkpoint_meta()})
        self.counters.merge_s += time.perf_counter() - job.t0
        self._merged(version, job.reason, merged, pending, update.size, job.values)

    def wait_merged(self) -> None:
        """Under the lock: waits (the lock released) while a merge is being computed; a push's decision waits for it,
        so that it is judged against the version that merge makes (its staleness, its round)."""
        self.lock.wait_for(lambda: self.merging is None or self.fatal is not None)

    def _merged(self, version: int, reason: str, merged: list[PushInfo], pending: list[tuple[PushInfo, Admission]],
                update_bytes: int, values: int) -> None:
        """What follows a committed merge: telemetry, the round's span, a progress line, the waiters woken (the
        heap is trimmed after the lock is let go: :meth:`run`). ``values``: the update's (its fragment's, with
        outer.fragments)."""
        self.telemetry.record_ratio(4 * values, update_bytes, "down")
        self.rounds.close(version, pushes=len(pending), tokens=sum(i.tokens for i, _ in pending),
                          islands=sorted({i.island_id for i, _ in pending}), update_bytes=update_bytes)
        self.log.progress(f"v{version}: merged {len(merged)} deltas ({reason})")
        self._changed()  # wakes long-polling pulls and the ticker (the run may be over)

    def _screen_round(self, now: float) -> bool:
        """The round screen (``coordinator.admission.screen_round``; with ``screened_mean``, each pending push's
        direction from ``Merger.direction_cosines``) on the round about to close: each push it finds is rejected
        (a ``push_quarantined`` event; its island is told in its heartbeat replies) and leaves the pending set.
        Returns whether any was."""
        self._cosines, reference = {}, ""
        if self.merger.opts.rule == "screened_mean" and self.merger.pending_count:
            cosines, reference = self.merger.direction_cosines()
            if reference:
                self._cosines = dict(zip([p.key for p in self.merger.pending], cosines, strict=True))
        screened = self.state.screen_round(self._cosines or None, reference,
                                           screened=self.merger.opts.rule == "screened_mean")
        for push_id, why in screened:
            (info,) = self.state.reject_pending([push_id], why, now)
            self.log.event("push_quarantined", island=info.island_id, push_id=push_id, reason=why,
                           by="round_screen")
            self.log.progress(f"v{self.state.version + 1}: quarantined push {push_id} from {info.island_id}: {why}")
        self.log_quarantined()
        return bool(screened)

    def log_quarantined(self) -> None:
        """An ``island_quarantined`` event and a progress line for each island the state quarantined since the last
        call (too many rejected pushes in a row); wakes the ticker (a round may no longer wait for it)."""
        for island_id, why in self.state.take_quarantined():
            self.log.event("island_quarantined", island=island_id, reason=why)
            self.log.progress(f"{island_id} {why}")
            self._changed()

    def _reject_blamed(self, e: NonFiniteResult, now: float) -> None:
        """Not fatal: nothing was committed. The push to blame is rejected (its island is told in its heartbeat
        replies) and the round is tried again without it, here, if it is still ready."""
        version = self.state.version + 1
        (info,) = self.state.reject_pending([e.blame], str(e), now)
        self.log_quarantined()
        self.log.event("merge_rejected", version=version, island=info.island_id, push_id=info.push_id,
                       what=e.what, reason=str(e))
        self.log.progress(f"v{version}: not committed, rejected push {info.push_id} from {info.island_id}: {e}")
        self._changed()  # the clock tries the round again without it, if it is still ready

    # -- the ticker ---------------------------------------------------------------------------------

    def run(self) -> None:
        """The service's clock (the ticker thread): expires leases, closes rounds that are ready (the only thread
        that merges: a push that completes a round only wakes it), notes when the run is finished. The outer step
        runs outside the lock, so joins, heartbeats, Status and pulls are served while it computes. Sleeps until
        the state's next deadline, or until a join, a push, or a heartbeat that changes what it decides on
        (``CoordinatorService._clock_view``) notifies the lock (which may move that deadline sooner, make a round
        ready, or finish the run)."""
        try:
            while True:
                with self.lock:
                    if self.closing:
                        return
                    now = self.clock()
                    job = self._tick(now)
                    if job is None:
                        deadline = self.state.next_deadline(now)
                        self.lock.wait(None if deadline is None else max(0.0, deadline - now))
                        continue
                self.step(job)  # outside the lock
                with self.lock:
                    self.end_merge(job, self.clock())
                # The step's slabs and the merged spools' buffers back to the OS, outside the lock: malloc_trim
                # walks every arena, and heartbeats and Joins wait for the lock, not for the heap.
                self.streams.trim()
        except BaseException as e:  # the coordinator cannot run without it: make it fatal, not silent
            with self.lock:
                self.merging = None
                if self.fatal is None:
                    self.fatal = f"{type(e).__name__}: {e}"
                    self.log.event("coordinator_failed", error=self.fatal)
                self._changed()
                self.set_health()
            raise

    def _tick(self, now: float) -> MergeJob | None:
        """One turn of the clock at ``now``, under the lock: leases, forgotten records, the run's end and health;
        returns the merge to compute if the open round is ready."""
        for island_id, reason in self.state.expire(now):
            self.log.event("island_lost", island=island_id, reason=reason)
            self.log.progress(f"lost {island_id}: {reason}")
        forgotten = self.state.forget(now)
        if forgotten:
            self.counters.islands_forgotten += len(forgotten)
            after = self.state.opts.coordinator.forget_after_s
            self.log.event("islands_forgotten", islands=[r.island_id for r in forgotten], after_s=after)
            self.log.progress(f"forgot {len(forgotten)} island record{'s' * (len(forgotten) != 1)} lost for "
                              f"{after:g}s (coordinator.forget_after_s): {forgotten[0].island_id}"
                              + (f" and {len(forgotten) - 1} more" if len(forgotten) > 1 else ""))
        job = self.begin_merge(now)
        done, why = self.state.finished(now)
        if done and self.finished is None:
            self.finished = why
            self._changed()  # wakes run_coordinator
        self.set_health()
        return job

    def set_health(self) -> None:
        """grpc.health.v1: SERVING while the coordinator serves, including after the run's last version while it
        lingers for the islands' last pulls (a readiness probe must keep routing them here); NOT_SERVING once it is
        finished, failed or asked to stop (the ticker calls this on every change). With ``after_finish="serve"``
        a finished run still serves (late islands get its final θ or its end, Status its record), so it stays
        SERVING until it fails or is asked to stop: a liveness probe must not restart it, nor readiness hide it."""
        finished = self.stop_requested if self.after_finish == "serve" else self.finished
        serving = not (finished or self.fatal or self.closing)
        if serving == self._serving:
            return  # unchanged: a Watch hears of changes only
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):  # "": the server as a whole (what a Kubernetes gRPC probe asks by default)
            self.health.set(name, status)

    # -- the run's end ------------------------------------------------------------------------------

    def wait_finished(self) -> str:
        """Blocks until the service may stop, and says why: the state machine found the run finished (the
        ticker notes it), :meth:`request_stop` was called, or the service failed (then :attr:`fatal` is set).
        Woken by the lock's notifications, not by polling."""
        with self.lock:
            self.lock.wait_for(lambda: self.finished is not None or self.fatal is not None)
            return f"failed: {self.fatal}" if self.fatal else str(self.finished)

    def request_stop(self, reason: str) -> None:
        """Ends :meth:`wait_finished` (and :meth:`wait_stop_requested`) with ``reason``. Safe in a signal handler
        of the waiting thread: the lock is reentrant, and the wait has released it."""
        with self.lock:
            if self.finished is None:
                self.finished = reason
            if self.stop_requested is None:
                self.stop_requested = reason
                self.set_health()
            self._changed()

    def wait_stop_requested(self) -> str:
        """Blocks until :meth:`request_stop` is called or the service fails, and says why (``after_finish="serve"``:
        how a finished run's coordinator ends)."""
        with self.lock:
            self.lock.wait_for(lambda: self.stop_requested is not None or self.fatal is not None)
            return f"failed: {self.fatal}" if self.fatal else str(self.stop_requested)
