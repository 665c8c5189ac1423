"""The open round's pending pushes: one record per push, and one set that the ledger, the merger and the shards read.

A push is one :class:`PushRecord` from its header to its reply: the header and what the state machine decides on
it from there (:attr:`PushRecord.preview`), its upload (the receiver and the spool its payload lands in:
``coordinator.push.Upload``), whether its parts on the other shards of a sharded coordinator were claimed
(:attr:`PushRecord.parts`) and, once its payload is here, the decision made again (:attr:`PushRecord.admission`).
Its path is the open round's (``coordinator/open_round.py``).

:class:`PendingSet` is the open round's accepted pushes, by push id, and the only writer of the three places that
hold a pending push: the state's ledger (its accounting: cursors, quorum, the checkpoint), the merger's pending
spools (the sum) and the range shards' held parts (let go when a push leaves the round unmerged). A push joins
all three at once (:meth:`PendingSet.add`), leaves all three at once (:meth:`PendingSet.reject`: a round screen, a
non-finite step; :meth:`PendingSet.merged`: the commit), and :meth:`PendingSet.check` says whether they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import trace

from coordinator.merge_types import SpooledPush
from coordinator.push import Upload
from coordinator.records import Admission, PushInfo
from coordinator.spool import Spool
from coordinator.state import CoordinatorState
from coordinator.theta_store import ThetaStore
from dtrain.net.proto import dtrain_pb2 as pb


@dataclass(eq=False)
class PushRecord:
    """One push, from its header to its reply. Written by the call that drives it; the pending set holds it from its
    acceptance until it is merged or rejected (read then by the clock, under the service's lock)."""

    header: pb.PushHeader
    info: PushInfo
    identity: str | None  # the caller's (security.identity), which its parts on other shards must match
    preview: Admission  # the state's decision from the header alone
    upload: Upload | None = None  # its payload arriving (None until begin() opened it)
    spool: Spool | None = None
    parts: bool = False  # its parts on the other shards were claimed: let go unless it is merged
    admission: Admission | None = None  # the decision made again on the payload (accept: it is pending)
    spooled: SpooledPush | None = None  # the merger's entry for it, while pending
    round_span: trace.Span | None = field(default=None, repr=False)


class PendingSet:
    """The open round's accepted pushes (:attr:`records`, push id -> record, in arrival order) over the state's
    ledger, the merger and θ's store, which it alone changes for a pending push. Under the service's lock."""

    def __init__(self, state: CoordinatorState, store: ThetaStore):
        self.state, self.store, self.merger = state, store, store.merger
        self.records: dict[str, PushRecord] = {}

    def __contains__(self, push_id: str) -> bool:
        return push_id in self.records

    def add(self, rec: PushRecord, now: float, norm: float, theta_norm: float) -> Admission:
        """The state's decision on ``rec``'s received payload (``CoordinatorState.commit_push``, which records it in
        the ledger); an accepted push's spool joins the merger's sum with it, and ``rec`` this set. StateError (a
        refusal) changes nothing."""
        admission = self.state.commit_push(rec.info, now, norm=norm, theta_norm=theta_norm)
        rec.admission = admission
        if admission.status == "accept":
            assert rec.spool is not None
            self.store.add_pending(rec.spool, admission.weight, admission.scale, rec.info.push_id, norm)
            rec.spooled = self.merger.pending[-1]
            self.records[rec.info.push_id] = rec
        return admission

    def reject(self, push_ids: list[str], reason: str, now: float) -> list[PushInfo]:
        """Pending pushes rejected after all (a round screen, a non-finite step): out of the ledger (counted,
        remembered, their islands told), out of the merger's sum (spools released) and their parts on the other
        shards let go. Returns their infos."""
        infos = self.state.reject_pending(push_ids, reason, now)
        self.merger.drop_pending(push_ids)
        for push_id in push_ids:
            self.records.pop(push_id, None)
        self.store.release(push_ids)
        return infos

    def merged(self) -> None:
        """The round was committed (the ledger closed it, the merger's step released its spools, the range shards'
        Commit their parts): the set starts empty for the next round."""
        self.records.clear()

    def frame_bytes(self) -> dict[str, int]:
        """Each pending push's frame bytes, by push id."""
        return {p.key: p.spool.size for p in self.merger.pending}

    def check(self) -> str:
        """'' when the ledger, the merger and this set hold the same pending pushes, else how they differ."""
        ledger = set(self.state.ledger.pending)
        merger = {p.key for p in self.merger.pending}
        mine = set(self.records)
        if ledger == merger == mine:
            return ""
        return f"pending pushes differ: ledger {sorted(ledger)}, merger {sorted(merger)}, round {sorted(mine)}"
