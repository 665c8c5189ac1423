"""An island's links to a sharded coordinator (``coordinator.shards = S > 1``; docs/architecture.md#shards).

θ is cut into S contiguous ranges of whole tensors (``dtrain.train.fragments.plan``, the same plan the coordinator
makes); range 0 is the lead's (the coordinator the island joins), range k shard k's, whose address the lead
names in its Join reply. The island pushes each range's slice of its Δ, a frame of its own (with that range's
own error feedback), to its shard, all S parts at once on parallel streams (:class:`ShardedPush`); the lead's
answer is the push's (it counts only when every shard holds its part). It pulls each range from its shard
(:class:`ShardedPuller`), checks each range's digest and the whole θ's (``fragments.joined_digest``), and holds
the ranges as one θ. :class:`ShardedUplink` builds the S frames of a push.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import numpy as np

from dtrain.codec import params_digest
from dtrain.config.sections import CodecConfig, Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.train import fragments
from workers.client import CoordinatorClient, PulledFrame
from workers.exchange import EventLog, GlobalParams, Puller, PushClient, ShardFrames, Uplink, WorkerError

MAX_ALIGN = 8  # pulls from the lead to catch up with a shard that committed a version the lead has not yet


class ShardLinks:
    """The clients of the range shards 1..S-1, made at Join from the lead's ``shard_addresses`` (the island's
    own client is the lead's)."""

    def __init__(self, cfg: Config, lead: CoordinatorClient, ranges: Sequence[fragments.Range],
                 make_client: Callable[[str], CoordinatorClient] | None = None):
        self.cfg, self.lead, self.ranges = cfg, lead, tuple(ranges)
        self.make_client = make_client or (lambda address: CoordinatorClient(address, cfg))
        self.addresses: list[str] = []
        self.others: list[CoordinatorClient] = []
        self._lock = threading.Lock()

    def connect(self, addresses: Sequence[str]) -> None:
        """At each Join: the range shards' addresses the lead named (WorkerError if they are not S - 1)."""
        if len(addresses) != len(self.ranges) - 1:
            raise WorkerError(f"the coordinator names {len(addresses)} shard addresses; this island's config has "
                              f"coordinator.shards = {len(self.ranges)} (it needs {len(self.ranges) - 1})")
        with self._lock:
            if list(addresses) == self.addresses:
                return
            for c in self.others:
                c.close()
            self.others = [self.make_client(a) for a in addresses]
            self.addresses = list(addresses)

    @property
    def clients(self) -> list[CoordinatorClient]:
        with self._lock:
            if len(self.others) != len(self.ranges) - 1:
                raise WorkerError("no shard addresses yet: the island has not joined")
            return [self.lead, *self.others]

    def close(self) -> None:
        for c in self.others:
            c.close()

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.others)

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.others)


class ShardedPush:
    """Pushes a push's S frames to the S shards at once; the lead's answer is the push's. A range shard that
    refuses or cannot be reached leaves its part missing: the lead then refuses the push (nothing merged), and
    the island trains the range again as after any refusal."""

    def __init__(self, links: ShardLinks):
        self.links = links

    def push(self, header: pb.PushHeader, whole: bytes) -> pb.PushDeltaResponse:
        if not isinstance(whole, ShardFrames):
            raise WorkerError("a sharded coordinator takes one frame per range (workers.exchange.ShardFrames)")
        frame = whole.frames
        clients = self.links.clients
        if len(frame) != len(clients):
            raise WorkerError(f"{len(frame)} frames for {len(clients)} coordinator shards")
        # Threads of this call's own: a pool shared with pulls could queue a part behind a long poll that waits
        # for the very version this push completes.
        with futures.ThreadPoolExecutor(len(clients) - 1, thread_name_prefix="shard-push") as pool:
            calls = []
            for k in range(1, len(clients)):
                h = pb.PushHeader()
                h.CopyFrom(header)
                h.shard = k
                calls.append(pool.submit(clients[k].push, h, frame[k]))
            h0 = pb.PushHeader()
            h0.CopyFrom(header)
            h0.shard = 0
            return clients[0].push(h0, frame[0])


class ShardedUplink(Uplink):
    """A sharded coordinator's :class:`~workers.exchange.Uplink`: each push is a
    :class:`~workers.exchange.ShardFrames`, one frame per range with that range's own error feedback, sent by a
    :class:`ShardedPush`. Push faults are not built for it (a :class:`WorkerError` if any are asked for)."""

    def __init__(self, cfg: CodecConfig, links: ShardLinks, log: EventLog, feedback_decay: float = 1.0,
                 injections: Sequence[object] = ()):
        if injections:
            raise WorkerError("push faults (--fault nan/poison/truncate/...) with coordinator.shards > 1 are not "
                              "built yet")
        super().__init__(cfg, links.ranges[-1].end, (), links.lead, log, feedback_decay, links.ranges)
        self.pusher = ShardedPush(links)

    def frame(self, delta: np.ndarray, header: pb.PushHeader) -> tuple[bytes, PushClient]:
        """The push's S frames for Δ = ``delta`` (the whole θ's), and the :class:`ShardedPush` that sends them."""
        self._seed = header.base_version  # (the mask codec's)
        frame = ShardFrames([self._encode_part(r.index, delta[r.start:r.end]) for r in self.ranges])
        self._count(frame, delta.size)
        return frame, self.pusher


class ShardedPuller(Puller):
    """Brings the island's θ up to the coordinator's latest version, range by range from each shard. The lead is
    asked first (the long poll): it commits a version after every range shard has, so every shard holds the
    version the lead serves; a shard that is one commit ahead is matched by pulling the lead again. Each range's
    frames are applied and checked by its digest as an unsharded pull's are (:class:`Puller`), and the whole θ's
    digest is the joined one."""

    def __init__(self, links: ShardLinks, n: int, max_frame: Callable[[int], int],
                 log: Callable[..., object]):
        super().__init__(links.lead, n, max_frame(n), log)
        self.links = links
        self.parts = [_RangePuller(r.size, max_frame(r.size), log) for r in links.ranges]

    def _pull_once(self, island_id: str, have: GlobalParams | None, wait_s: float,
                   full: bool) -> tuple[GlobalParams | None, str]:
        full = full or have is None
        have_v = 0 if have is None else have.version
        clients = self.links.clients
        got: list[list[PulledFrame]] = [[] for _ in clients]
        got[0] = clients[0].pull(island_id, have_v, wait_s=wait_s, full=full, max_frame=self.parts[0].max_frame)
        target = _end_version(got[0], have_v)
        with futures.ThreadPoolExecutor(len(clients) - 1, thread_name_prefix="shard-pull") as pool:
            calls = [pool.submit(clients[k].pull, island_id, have_v, wait_s=max(wait_s, 5.0) if target > have_v
                                 else 0.0, full=full, max_frame=self.parts[k].max_frame)
                     for k in range(1, len(clients))]
            for k, call in enumerate(calls, start=1):
                got[k] = call.result()
        for _ in range(MAX_ALIGN):  # a shard ahead of the lead: the lead commits that version next
            ahead = max(_end_version(frames, have_v) for frames in got)
            if ahead == target:
                break
            more = clients[0].pull(island_id, target, wait_s=5.0, max_frame=self.parts[0].max_frame)
            got[0] += more
            target = _end_version(got[0], have_v)
        else:
            return None, f"the coordinator shards did not agree on a version (lead at v{target})"
        behind = [k for k, frames in enumerate(got) if _end_version(frames, have_v) != target]
        if behind:
            return None, f"coordinator shard {behind[0]} did not reach v{target}"
        pieces: list[GlobalParams] = []
        for k, r in enumerate(self.links.ranges):
            part_have = None if have is None or full else GlobalParams(have.vec[r.start:r.end].copy(), have_v)
            g, problem = self.parts[k].apply(part_have, got[k])
            if problem:
                return None, f"coordinator shard {k} (values {r.start}..{r.end}): {problem}"
            if g is None:
                return None, f"coordinator shard {k} sent no parameters"
            pieces.append(g)
        asked = {g.version for g in self.parts[0].take_eval_requests()}
        for p in self.parts[1:]:
            p.take_eval_requests()  # only the lead asks for evals
        if have is not None and target == have_v and not full:
            if have_v in asked:
                with self._lock:
                    self._to_evaluate[have_v] = have
            return have, ""
        whole = GlobalParams(np.concatenate([g.vec for g in pieces]), target)
        whole.digest = fragments.joined_digest([g.digest or params_digest(g.vec) for g in pieces])
        whole.round_seconds = pieces[0].round_seconds
        if target in asked:
            with self._lock:
                self._to_evaluate[target] = whole
        return whole, ""


class _RangePuller(Puller):
    """One range's frames applied and checked (:meth:`Puller._apply` over the range's values)."""

    def __init__(self, n: int, max_frame: int, log: Callable[..., object]):
        super().__init__(_NoClient(), n, max_frame, log)

    def apply(self, have: GlobalParams | None, frames: list[PulledFrame]) -> tuple[GlobalParams | None, str]:
        return self._apply(have, frames)


class _NoClient:
    def pull(self, island_id: str, have_version: int, wait_s: float = 0.0, full: bool = False,
             max_frame: int | None = None) -> list[PulledFrame]:
        raise AssertionError("a range's puller applies frames pulled for it")


def _end_version(frames: list[PulledFrame], have_version: int) -> int:
    """The version a pull's frames bring the island to (``have_version`` when there are none)."""
    out = have_version
    for f in frames:
        out = f.header.version
    return out
