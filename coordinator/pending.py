"""The open round's pending pushes: one record per push on its way in, and the one set of those accepted.

A push is one :class:`PushRecord` from its header to its reply: the header and what the state machine decides on
it from there (:attr:`PushRecord.preview`), its upload (the receiver and the spool its payload lands in:
``coordinator.push.Upload``), whether its parts on the other shards of a sharded coordinator were claimed
(:attr:`PushRecord.parts`) and, once its payload is here, the decision made again (:attr:`PushRecord.admission`).
Its path is the open round's (``coordinator/open_round.py``).

:class:`PendingSet` is the one place a pending push lives: each accepted push once, by push id, in arrival order,
with what the ledger keeps of it (``coordinator.records.PendingPush``: its header's facts, the decision, when it
arrived; checkpointed) and, on the coordinator, its spool in the next outer step (``SpooledPush``). The others read
it: the ledger's accounting (``coordinator/ledger.py``: cursors, quorum, the checkpoint) as a mapping of push id to
``PendingPush``, the merger's sum through :meth:`PendingSet.spooled` (``Merger.read_pending_from``). A push joins it
when the state accepts it (:meth:`PendingSet.add`, then :meth:`PendingSet.spool` its payload), leaves it rejected
(:meth:`PendingSet.take`: its spool closed and, on a sharded lead, its parts on the range shards let go through
:attr:`PendingSet.on_release`) or merged (:meth:`PendingSet.clear`, as the round closes: the outer step released the
spools and the range shards committed their parts). Under the service's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace

from coordinator.merge_types import SpooledPush
from coordinator.push import Upload
from coordinator.records import Admission, PendingPush, PushInfo
from coordinator.spool import Spool
from dtrain.net.proto import dtrain_pb2 as pb


@dataclass(eq=False)
class PushRecord:
    """One push, from its header to its reply. Written by the call that drives it."""

    header: pb.PushHeader
    info: PushInfo
    identity: str | None  # the caller's (security.identity), which its parts on other shards must match
    preview: Admission  # the state's decision from the header alone
    upload: Upload | None = None  # its payload arriving (None until begin() opened it)
    spool: Spool | None = None
    parts: bool = False  # its parts on the other shards were claimed: let go unless it is merged
    admission: Admission | None = None  # the decision made again on the payload (accept: it is pending)
    round_span: trace.Span | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Entry:
    push: PendingPush
    spooled: SpooledPush | None = None  # None: restored from a checkpoint, or recorded by the state alone


class PendingSet(Mapping[str, PendingPush]):
    """The open round's accepted pushes (see the module docstring): push id -> ``PendingPush``, in arrival order.
    Not thread-safe: the caller serializes access."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # Told the ids of pushes taken out unmerged (a sharded lead: their parts on the range shards are let go)
        self.on_release: Callable[[list[str]], None] | None = None

    def __getitem__(self, push_id: str) -> PendingPush:
        return self._entries[push_id].push

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, push: PendingPush) -> None:
        """An accepted push joins the open round (the ledger's record of the state's decision)."""
        self._entries[push.info.push_id] = _Entry(push)

    def spool(self, push_id: str, spooled: SpooledPush) -> None:
        """The pending push's payload joins the next outer step's sum (the merger validated and took its spool)."""
        self._entries[push_id].spooled = spooled

    def spooled(self) -> list[SpooledPush]:
        """The pending pushes' spools, in arrival order: what the merger's next outer step sums."""
        return [e.spooled for e in self._entries.values() if e.spooled is not None]

    def frame_bytes(self) -> dict[str, int]:
        """Each spooled pending push's frame bytes, by push id."""
        return {k: e.spooled.spool.size for k, e in self._entries.items() if e.spooled is not None}

    def take(self, push_ids: list[str]) -> list[PendingPush]:
        """Takes pushes out unmerged (rejected after all: a round screen, a non-finite step): their spools closed,
        their parts elsewhere let go (:attr:`on_release`). Returns them; every id must be pending (the ledger
        checks)."""
        taken = [self._entries.pop(push_id) for push_id in push_ids]
        for e in taken:
            if e.spooled is not None:
                e.spooled.spool.close()
        if taken and self.on_release is not None:
            self.on_release(list(push_ids))
        return [e.push for e in taken]

    def clear(self) -> None:
        """The round closed, merged: the set starts empty for the next one (the outer step released the spools)."""
        self._entries.clear()

    def restore(self, pushes: list[PendingPush]) -> None:
        """Fills an empty set from a checkpoint's pending pushes (no payload: whoever restores holds their sum)."""
        self._entries = {p.info.push_id: _Entry(p) for p in pushes}
