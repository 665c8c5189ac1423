"""What each peer and each island holds open, and the deadlines that free push streams.

A PushDelta is a client stream, and a PullGlobal a call that may park as a long poll: on the coordinator each
waits as a coroutine of its event loop (``coordinator/data_plane.py``), on a range shard's server on one of its
threads for its whole length; either way a stream that sends nothing, or a pull parked on a version that does not
come, holds a place doing nothing. One accounting bounds both (:class:`Quota`): a peer host and an
island each hold at most so many calls of a kind at once, more are refused with a reason (answered
RESOURCE_EXHAUSTED, marked busy, by the servicer). Push streams (:class:`PushStreams`): at most
``coordinator.max_streams_per_peer`` per peer host from the stream's open (:meth:`PushStreams.open`), at most
``coordinator.max_streams_per_island`` per island counted from the stream's first chunk, not its header
(:meth:`PushStreams.claim`: a stream that never sends data never holds its island's slot). Pulls (:class:`Pulls`):
at most ``coordinator.max_pulls_per_peer`` per peer host and ``coordinator.max_pulls_per_island`` per island, long
polls included, so a flood of parked pulls holds its island's share and no more.

A reaper thread cancels a push stream (:meth:`PushStreams.reap`) that waited more than
``coordinator.stream_idle_s`` for its client without the minimum rate over that wait (a message resets the idle
clock only when the bytes since the last reset kept ``coordinator.stream_min_bytes_per_s``: a 1-byte message does
not), whose average rate since its header fell below ``stream_min_bytes_per_s`` once it has waited
``coordinator.stream_rate_grace_s`` on its client, or that is still receiving ``coordinator.stream_deadline_s``
after it opened. Only time spent waiting for the client's next message counts as the client's (:meth:`waiting`,
:meth:`arrived`; :meth:`watched` for a blocking iterator): time on the coordinator's side (decoding, waiting for
``max_receiving`` or for the lock) never does. Heartbeats, Joins and Status do not go through here: they are
served on threads of their own (``coordinator/app.py``'s control threads), which no stream can hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.push import payload_bytes
from dtrain.config.sections import Config

T = TypeVar("T")
_log = logging.getLogger(__name__)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string, without its port: ``ipv4:10.0.0.7:53122`` -> ``10.0.0.7``,
    ``ipv6:[::1]:53122`` -> ``[::1]``; anything else (``unix:...``) as it is."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return rest.rpartition(":")[0]
    return peer


def streams_per_peer(cfg: Config) -> int:
    """``coordinator.max_streams_per_peer``, or with 0 (the default) outer.islands + 8: every island of a run on
    one host (``dtrain simulate``, a benchmark, islands behind one NAT) pushes at once, with room for retries."""
    return cfg.coordinator.max_streams_per_peer or cfg.outer.islands + 8


def pulls_per_peer(cfg: Config) -> int:
    """``coordinator.max_pulls_per_peer``, or with 0 (the default) outer.islands + 8: as :func:`streams_per_peer`."""
    return cfg.coordinator.max_pulls_per_peer or cfg.outer.islands + 8


class Quota:
    """How many calls of one kind (``what``: "push streams", "pulls") each peer host and each island holds at
    once, each under its limit (``peer_limit``, ``island_limit``: the settings that name them, for the reasons).
    Not locked: its owner's lock covers it."""

    def __init__(self, what: str, per_peer: int, per_island: int, peer_limit: str, island_limit: str):
        self.what, self.per_peer, self.per_island = what, per_peer, per_island
        self.peer_limit, self.island_limit = peer_limit, island_limit
        self.peers: Counter[str] = Counter()
        self.islands: Counter[str] = Counter()

    def take_peer(self, peer: str) -> str:
        """One more for ``peer``: '' if within its limit (counted), else why not (nothing counted)."""
        if self.peers[peer] >= self.per_peer:
            return (f"{peer} already holds {self.peers[peer]} {self.what}, the most one peer may hold at once "
                    f"(coordinator.{self.peer_limit}={self.per_peer}); retry when one has ended")
        self.peers[peer] += 1
        return ""

    def take_island(self, island: str) -> str:
        """One more for ``island``: '' if within its limit (counted), else why not (nothing counted)."""
        if self.islands[island] >= self.per_island:
            return (f"island {island!r} already has {self.islands[island]} {self.what} open, the most one island "
                    f"may hold at once (coordinator.{self.island_limit}={self.per_island}); retry when one has "
                    f"ended")
        self.islands[island] += 1
        return ""

    def give(self, peer: str | None = None, island: str | None = None) -> None:
        """One fewer for ``peer`` and for ``island`` (None: not counted for it)."""
        for table, key in ((self.peers, peer), (self.islands, island)):
            if key is not None:
                table[key] -= 1
                if table[key] <= 0:
                    del table[key]


@dataclass(eq=False)
class Stream:
    """One open push stream. ``waiting_since`` (time.monotonic() while the handler waits for the client's next
    message, else None) and the rest of the client's record (its bytes and the time it took, since its header;
    the idle clock's start) are written by the handler's thread and read by the reaper, under the table's lock;
    ``island`` is the island its header names (set by the servicer), ``claimed`` whether it is counted for that
    island (:meth:`PushStreams.claim`, at its first chunk)."""

    peer: str
    cancel: Callable[[], object]  # ends the call (a thread's server: its context's cancel(); an event loop's: its own)
    opened: float = 0.0
    island: str = ""
    claimed: bool = False
    waiting_since: float | None = None
    header_seen: bool = False
    received: int = 0  # payload bytes since the header
    client_s: float = 0.0  # time spent waiting on the client since the header, waits ended
    quiet_s: float = 0.0  # waits ended since the idle clock was last reset
    quiet_bytes: int = 0  # bytes since the idle clock was last reset
    done: bool = False  # the client half-closed: what is left is the coordinator's time
    cancelled: bool = False  # by the reaper


class PushStreams:
    """The table of open push streams (see the module docstring). ``on_cancel(stream, why)`` is told of each
    stream the reaper cancels, from the reaper's thread, after it is cancelled."""

    def __init__(self, cfg: Config, on_cancel: Callable[[Stream, str], None],
                 clock: Callable[[], float] = time.monotonic):
        c = cfg.coordinator
        self.quota = Quota("push streams", streams_per_peer(cfg), c.max_streams_per_island, "max_streams_per_peer",
                           "max_streams_per_island")
        self.idle_s, self.min_rate, self.grace_s, self.deadline_s = (c.stream_idle_s, c.stream_min_bytes_per_s,
                                                                     c.stream_rate_grace_s, c.stream_deadline_s)
        self.on_cancel, self.clock = on_cancel, clock
        self._lock = threading.Lock()
        self._open: set[Stream] = set()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_until_stopped, name="push-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join()

    def open(self, peer: str, cancel: Callable[[], object]) -> Stream | str:
        """A new stream from peer host ``peer``, counted; or, over the peer's limit, why not (nothing counted).
        ``cancel()``: how the reaper ends it."""
        with self._lock:
            over = self.quota.take_peer(peer)
            if over:
                return over
            stream = Stream(peer, cancel, opened=self.clock())
            self._open.add(stream)
            return stream

    def claim(self, stream: Stream, island: str) -> str:
        """Counts the stream for the island it pushes for, once its data arrives: '' if that island is within its
        limit, else why not (the stream stays counted for its peer until :meth:`close`)."""
        with self._lock:
            stream.island = island
            over = self.quota.take_island(island)
            stream.claimed = not over
            return over

    def close(self, stream: Stream) -> None:
        """The stream ended (answered, refused, broken or cancelled): uncounted."""
        with self._lock:
            if stream not in self._open:
                return
            self._open.discard(stream)
            self.quota.give(stream.peer, stream.island if stream.claimed else None)

    def counts(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """(open streams, per peer, per island): a snapshot."""
        with self._lock:
            return len(self._open), dict(self.quota.peers), dict(self.quota.islands)

    def watched(self, stream: Stream, requests: Iterator[T], size: Callable[[Any], int] = payload_bytes) -> Iterator[T]:
        """``requests`` with each wait for the client's next message marked on ``stream`` (what the reaper
        measures on), and the payload bytes of each (``size``) counted (:meth:`waiting`, :meth:`arrived`): a
        thread's driver; an event loop's calls those two around its awaits."""
        while True:
            self.waiting(stream)
            try:
                message = next(requests)
            except StopIteration:
                self.arrived(stream, None)
                return
            except BaseException:
                self.arrived(stream, None, failed=True)
                raise
            self.arrived(stream, message, size)
            yield message

    def waiting(self, stream: Stream) -> None:
        """The handler now waits for the client's next message on ``stream``."""
        with self._lock:
            stream.waiting_since = self.clock()

    def arrived(self, stream: Stream, message: Any, size: Callable[[Any], int] = payload_bytes,
                failed: bool = False) -> None:
        """The wait on ``stream`` ended: with ``message`` (its payload bytes counted: ``size``), with None (the client
        half-closed; ``failed``: the call broke instead). The header (the first message) starts the client's record;
        after it a message resets the idle clock only when the bytes since the last reset kept the minimum rate over
        the client's time since then."""
        with self._lock:
            if message is None:
                stream.done = stream.done or not failed
                stream.waiting_since = None
                return
            assert stream.waiting_since is not None
            waited, stream.waiting_since = self.clock() - stream.waiting_since, None
            if not stream.header_seen:
                stream.header_seen = True
                return
            n = size(message)
            stream.received += n
            stream.client_s += waited
            stream.quiet_s += waited
            stream.quiet_bytes += n
            if stream.quiet_bytes >= self.min_rate * stream.quiet_s:
                stream.quiet_s, stream.quiet_bytes = 0.0, 0

    def why_cancel(self, s: Stream, now: float) -> str:
        """Why the reaper cancels stream ``s`` now, or '' (under the lock)."""
        if s.cancelled or s.done:
            return ""
        waiting = now - s.waiting_since if s.waiting_since is not None else 0.0
        what = "its header" if not s.header_seen else "its next chunk"
        if now - s.opened > self.deadline_s:
            return (f"push stream from {s.peer} cancelled: still receiving {now - s.opened:.1f}s after it opened "
                    f"(coordinator.stream_deadline_s={self.deadline_s:g}), {s.received} bytes in")
        idle = s.quiet_s + waiting
        if s.waiting_since is not None and idle > self.idle_s:
            return (f"push stream from {s.peer} cancelled: {idle:.1f}s waiting for {what} with "
                    f"{s.quiet_bytes if s.header_seen else 0} bytes meanwhile (coordinator.stream_idle_s="
                    f"{self.idle_s:g}, stream_min_bytes_per_s={self.min_rate:g})")
        client = s.client_s + (waiting if s.header_seen else 0.0)
        if s.header_seen and self.min_rate and client > self.grace_s and s.received < self.min_rate * client:
            return (f"push stream from {s.peer} cancelled: {s.received} bytes in {client:.1f}s of waiting on its "
                    f"client since its header, {s.received / client:.0f} bytes/s, below coordinator."
                    f"stream_min_bytes_per_s={self.min_rate:g} (after stream_rate_grace_s={self.grace_s:g})")
        return ""

    def reap(self) -> list[tuple[Stream, str]]:
        """Cancels every stream the deadlines above are over for; returns them with why. The handler blocked on
        the stream sees the cancellation as a grpc.RpcError, its client as CANCELLED."""
        now = self.clock()
        with self._lock:
            over = [(s, why) for s in self._open if (why := self.why_cancel(s, now))]
            for s, _ in over:
                s.cancelled = True
        for s, _ in over:
            s.cancel()
        return over

    def _reap_until_stopped(self) -> None:
        # a stream is cancelled within a tick of its deadline
        tick = min(1.0, self.idle_s / 4, self.deadline_s / 4, self.grace_s / 4 if self.grace_s > 0 else 1.0)
        while not self._stop.wait(tick):
            for stream, why in self.reap():
                try:
                    self.on_cancel(stream, why)
                except Exception:  # noqa: BLE001 - recording must not stop the reaper
                    _log.exception("recording a cancelled push stream failed")


@dataclass(eq=False)
class Pull:
    """One PullGlobal being served, counted for its peer host and its island."""

    peer: str
    island: str


class Pulls:
    """The pulls being served, long polls included, bounded per peer host (``coordinator.max_pulls_per_peer``)
    and per island (``coordinator.max_pulls_per_island``) by a :class:`Quota`."""

    def __init__(self, cfg: Config):
        self.quota = Quota("pulls", pulls_per_peer(cfg), cfg.coordinator.max_pulls_per_island, "max_pulls_per_peer",
                           "max_pulls_per_island")
        self._lock = threading.Lock()

    def open(self, peer: str, island: str) -> Pull | str:
        """A pull from ``peer`` for ``island``, counted for both; or, over either's limit, why not (nothing
        counted)."""
        with self._lock:
            over = self.quota.take_peer(peer)
            if over:
                return over
            over = self.quota.take_island(island)
            if over:
                self.quota.give(peer=peer)
                return over
            return Pull(peer, island)

    def close(self, pull: Pull) -> None:
        with self._lock:
            self.quota.give(pull.peer, pull.island)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(per peer, per island): a snapshot."""
        with self._lock:
            return dict(self.quota.peers), dict(self.quota.islands)
