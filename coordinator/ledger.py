"""The exactly-once ledger of the data: where each shard's merged data ends, the pushes pending in the open
round, and the push ids remembered after it (merged, dropped or rejected) so that a retry is never applied twice.

Bookkeeping only: the decision on a push is ``coordinator.admission``'s and when a round may close is
``coordinator.quorum``'s; ``coordinator.state.CoordinatorState`` records what they decided here. Nothing here
reads a clock: the time a push arrived is passed in.

Segments: each shard's sequences are one or more segments (``coordinator.records.Segment``), contiguous
ranges that cover it from 0 to its end; a shard starts as one. An island trains one segment at a time. A
segment's cursor is where its merged data ends, counting the pushes pending in the open round (they will be
merged); a push must start exactly there (``coordinator.admission``), so each segment's merged ranges always
form one prefix of it. :meth:`PushLedger.split` cuts a segment's remainder into several, in whole rounds, for
several islands to train at once. The ids of pending pushes and of the last ``StateOptions.max_push_ids``
merged, dropped or rejected ones are remembered, oldest forgotten first.
"""

from __future__ import annotations

import collections
import math

from coordinator.pending import PendingSet
from coordinator.records import Admission, PendingPush, PushInfo, SeenPush, Segment, StateError, StateOptions
from dtrain.train.fragments import fragment_of_round


class PushLedger:
    """The segments and their cursors, the open round's pending pushes and the remembered push ids. Not
    thread-safe."""

    def __init__(self, opts: StateOptions):
        self.opts = opts
        # (shard, start) -> segment, by shard then start: contiguous, each shard's from 0 to its end
        self.segments: dict[tuple[int, int], Segment] = {
            (s, 0): Segment(s, 0, opts.shard_end, 0) for s in range(opts.islands)}
        self.norms: collections.deque[float] = collections.deque(maxlen=opts.coordinator.norm_window)  # merged
        # outer.fragments > 1: the same window per fragment (fragments' norms differ; a push is screened against its
        # own fragment's). Not checkpointed: after a resume they fill again from the next merges.
        self.fragment_norms: list[collections.deque[float]] = [
            collections.deque(maxlen=opts.coordinator.norm_window) for _ in range(opts.fragments)]
        self.pending = PendingSet()  # push_id -> pending push, in arrival order: the one place it lives
        self.first_pending: float | None = None  # when the open round's first pending push arrived
        self.seen: collections.OrderedDict[str, SeenPush] = collections.OrderedDict()  # push_id -> record, oldest first
        self.rejections: dict[str, str] = {}  # island_id -> why its last push was rejected (until one is accepted)
        self.round_rejected: set[str] = set()  # islands whose push for the open round was rejected

    # -- queries ------------------------------------------------------------------------------------

    def norm_window(self, target_version: int) -> collections.deque[float]:
        """The merged norms a push for ``target_version`` is screened against: the last ``norm_window`` merged
        pushes' (of the fragment that version merges, with outer.fragments > 1)."""
        if self.opts.fragments == 1:
            return self.norms
        return self.fragment_norms[fragment_of_round(target_version, self.opts.fragments)]

    def segment(self, shard: int, start: int) -> Segment:
        """The segment of ``shard`` that starts at ``start`` (INVALID_ARGUMENT if there is none)."""
        seg = self.segments.get((shard, start))
        if seg is None:
            raise StateError("INVALID_ARGUMENT", f"shard {shard} has no segment starting at {start}: its segments "
                                                 f"start at {[k[1] for k in self.segments if k[0] == shard]}")
        return seg

    def segment_at(self, shard: int, position: int) -> Segment | None:
        """The segment of ``shard`` that holds sequence ``position``, or None (past the shard's end, or no such
        shard)."""
        for seg in self.of_shard(shard):
            if seg.start <= position and (not seg.end or position < seg.end):
                return seg
        return None

    def of_shard(self, shard: int) -> list[Segment]:
        """The segments of ``shard``, by start."""
        return sorted((seg for seg in self.segments.values() if seg.shard == shard), key=lambda seg: seg.start)

    def cursor(self, seg: Segment) -> int:
        """Where the segment's merged data ends, counting pushes pending in the open round (they will be merged)."""
        cursor = seg.merged
        for p in self.pending.values():
            if p.info.shard_index == seg.shard and seg.start <= p.info.cursor_start and (
                    not seg.end or p.info.cursor_start < seg.end):
                cursor = max(cursor, p.info.cursor_end)
        return cursor

    def data_left(self, seg: Segment) -> bool:
        """Whether the segment has data no push covers yet (merged or pending); always with wall-time rounds."""
        return not seg.end or self.cursor(seg) < seg.end

    def shard_cursor(self, shard_index: int) -> int:
        """The shard's sequences merged or pending in the open round, over all its segments: its cursor while it is
        one segment (what Status shows per shard)."""
        if not 0 <= shard_index < self.opts.islands:
            raise StateError("INVALID_ARGUMENT", f"shard_index={shard_index}: must be in [0, {self.opts.islands})")
        return sum(self.cursor(seg) - seg.start for seg in self.of_shard(shard_index))

    def all_merged(self) -> bool:
        """Whether every shard's data is merged (step rounds; never with wall-time rounds: no end to the data)."""
        return bool(self.opts.shard_end) and all(seg.merged >= seg.end for seg in self.segments.values())

    def rounds_left(self, seg: Segment) -> int:
        """Step rounds of data the segment has left (from its cursor; a shorter last round counts as one)."""
        return math.ceil(max(seg.end - self.cursor(seg), 0) / self.opts.round_sequences) if seg.end else 0

    def pending_islands(self) -> set[str]:
        """The islands with a push pending in the open round."""
        return {p.info.island_id for p in self.pending.values()}

    def pending_of(self, island_id: str) -> list[str]:
        """The ids of ``island_id``'s pushes pending in the open round."""
        return [p.info.push_id for p in self.pending.values() if p.info.island_id == island_id]

    def push_known(self, push_id: str) -> bool:
        """Whether a push id is pending or remembered as merged/dropped/rejected."""
        return push_id in self.pending or push_id in self.seen

    def rejected(self, push_id: str) -> str | None:
        """Why a push was rejected (its island's notice), or None if it was not."""
        seen = self.seen.get(push_id)
        if seen is None or seen.status != "rejected":
            return None
        return self.rejections.get(seen.island_id, f"push {push_id} was rejected")

    def notice(self, island_id: str) -> str:
        """What a heartbeat reply adds for an island whose last push was rejected ("; why"), else ""."""
        return f"; {self.rejections[island_id]}" if island_id in self.rejections else ""

    def duplicate(self, info: PushInfo) -> Admission | None:
        """The decision on a retry of a push id that is pending or remembered, or None for a new id. An id another
        island used is refused (INVALID_ARGUMENT)."""
        p = self.pending.get(info.push_id)
        if p is not None:
            owner, target, staleness = p.info.island_id, p.admission.target_version, p.admission.staleness
            what = f"is pending in the open round for version {target}"
        else:
            s = self.seen.get(info.push_id)
            if s is None:
                return None
            owner, target, staleness = s.island_id, s.target_version, s.staleness
            what = (f"was merged into version {target}" if s.status == "merged"
                    else f"was {s.status} (round for version {target})")
        if owner != info.island_id:
            raise StateError("INVALID_ARGUMENT", f"push_id {info.push_id!r} was already used by island {owner}")
        return Admission("duplicate", 0.0, staleness, target,
                         f"push {info.push_id} {what}: a retry, not applied again")

    # -- records ------------------------------------------------------------------------------------

    def remember(self, seen: SeenPush) -> None:
        """Remembers a push id that is no longer pending, forgetting the oldest beyond ``max_push_ids``."""
        self.seen[seen.push_id] = seen
        while len(self.seen) > self.opts.max_push_ids:
            self.seen.popitem(last=False)

    def add_pending(self, info: PushInfo, admission: Admission, now: float) -> None:
        """An accepted push joins the open round; its island's rejection notice ends."""
        if not self.pending:
            self.first_pending = float(now)
        self.pending.add(PendingPush(info, admission, float(now)))
        self.rejections.pop(info.island_id, None)

    def record_rejection(self, info: PushInfo, target: int, staleness: int, reason: str, version: int) -> None:
        """A rejected push: remembered, its island told (until its next accepted push) and, when it was for the
        open round (``version`` + 1), its island no longer awaited there."""
        self.remember(SeenPush(info.push_id, info.island_id, "rejected", target, staleness))
        self.rejections[info.island_id] = f"your push {info.push_id} was rejected: {reason}"
        if target == version + 1:
            self.round_rejected.add(info.island_id)

    def take_pending(self, push_ids: list[str]) -> list[PendingPush]:
        """Takes pushes out of the open round (NOT_FOUND, changing nothing, if one is not pending): their spools and
        their parts on other shards are let go (``PendingSet.take``)."""
        unknown = [p for p in push_ids if p not in self.pending]
        if unknown:
            raise StateError("NOT_FOUND", f"reject_pending: {', '.join(unknown)} not pending")
        taken = self.pending.take(push_ids)
        if not self.pending:
            self.first_pending = None
        return taken

    def split(self, seg: Segment, pieces: int) -> list[Segment]:
        """Cuts ``seg``'s data left (from its cursor) into ``pieces`` segments of whole rounds (at most one per
        round left; the first pieces get the extra rounds): ``seg`` keeps its start, its merged and pending data
        and the first piece; the others are new segments, returned. Changes nothing for ``pieces`` <= 1 or a
        segment with one round left (or no end)."""
        k = min(pieces, self.rounds_left(seg))
        if k <= 1:
            return []
        base, extra = divmod(self.rounds_left(seg), k)
        cut, cuts = self.cursor(seg), []
        for i in range(k):
            cut = min(cut + (base + (i < extra)) * self.opts.round_sequences, seg.end)
            cuts.append(cut)
        assert cuts[-1] == seg.end
        seg.end = cuts[0]
        new = [Segment(seg.shard, a, b, a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        for piece in new:
            self.segments[piece.key] = piece
        self.segments = dict(sorted(self.segments.items()))
        return new

    def merge_round(self, version: int) -> list[PendingPush]:
        """Closes the open round as merged into ``version``: each pending push moves its segment's cursor, is
        remembered as merged and its norm joins the window. Returns them, in arrival order."""
        merged = list(self.pending.values())
        for p in merged:
            info = p.info
            seg = self.segment_at(info.shard_index, info.cursor_start)
            assert seg is not None, "an accepted push lies in a segment (coordinator.admission)"
            seg.merged = max(seg.merged, info.cursor_end)
            self.remember(SeenPush(info.push_id, info.island_id, "merged", version, p.admission.staleness))
            if p.admission.norm > 0:
                self.norms.append(p.admission.norm)
                if self.opts.fragments > 1:
                    self.fragment_norms[fragment_of_round(version, self.opts.fragments)].append(p.admission.norm)
        self.pending.clear()
        self.first_pending = None
        self.round_rejected.clear()
        return merged

    def restore(self, segments: list[Segment], norms: list[float], seen: list[SeenPush],
                pending: list[PendingPush], first_pending: float | None, version: int) -> None:
        """Fills an empty ledger from a checkpoint (``coordinator.snapshot`` checked it): the rejected pushes
        for the open round (``version`` + 1) are not awaited again; the oldest ids beyond ``max_push_ids`` are
        forgotten."""
        self.segments = dict(sorted((seg.key, seg) for seg in segments))
        self.norms.extend(norms)  # the last norm_window of them
        for s in seen:
            self.seen[s.push_id] = s
            if s.status == "rejected" and s.target_version == version + 1:
                self.round_rejected.add(s.island_id)
        while len(self.seen) > self.opts.max_push_ids:
            self.seen.popitem(last=False)
        self.pending.restore(pending)
        self.first_pending = first_pending
