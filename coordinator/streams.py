"""Open push streams: how many each peer and each island holds, and the idle deadline that frees them.

A PushDelta is a client stream that gRPC serves on one of the server's data threads for its whole length, so a
stream that sends nothing holds a thread doing nothing. :class:`PushStreams` bounds that: a peer host holds at
most ``coordinator.max_streams_per_peer`` push streams at once and an island (named by a stream's header) at
most ``coordinator.max_streams_per_island`` (:meth:`PushStreams.open`, :meth:`PushStreams.claim`: a refusal
reason, answered RESOURCE_EXHAUSTED by the servicer), and a stream that waits more than
``coordinator.stream_idle_s`` for its client's next message (its header included) is cancelled by a reaper thread
(:meth:`PushStreams.watched`, :meth:`PushStreams.reap`). Time spent on the coordinator's side (decoding, waiting
for ``max_receiving`` or for the lock) is never idle time. Heartbeats, Joins and Status do not go through here:
they are served on threads of their own (:func:`coordinator.lifecycle.serve`), which no stream can hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

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


@dataclass(eq=False)
class Stream:
    """One open push stream. ``waiting_since`` (time.monotonic() while the handler waits for the client's next
    message, else None) is written by the handler's thread and read by the reaper, under the table's lock;
    ``island`` is set once by :meth:`PushStreams.claim`."""

    peer: str
    context: grpc.ServicerContext
    island: str = ""
    waiting_since: float | None = None
    cancelled: bool = False  # by the reaper


class PushStreams:
    """The table of open push streams (see the module docstring). ``on_idle(stream, idle_s)`` is told of each
    stream the reaper cancels, from the reaper's thread, after it is cancelled."""

    def __init__(self, cfg: Config, on_idle: Callable[[Stream, float], None],
                 clock: Callable[[], float] = time.monotonic):
        c = cfg.coordinator
        self.per_peer, self.per_island, self.idle_s = streams_per_peer(cfg), c.max_streams_per_island, c.stream_idle_s
        self.on_idle, self.clock = on_idle, clock
        self._lock = threading.Lock()
        self._open: set[Stream] = set()
        self._peers: Counter[str] = Counter()
        self._islands: Counter[str] = Counter()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_until_stopped, name="push-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join()

    def open(self, peer: str, context: grpc.ServicerContext) -> Stream | str:
        """A new stream from peer host ``peer``, counted; or, over the peer's limit, why not (nothing counted)."""
        with self._lock:
            if self._peers[peer] >= self.per_peer:
                return (f"{peer} already holds {self._peers[peer]} push streams, the most one peer may hold at once "
                        f"(coordinator.max_streams_per_peer={self.per_peer}); retry when one has ended")
            stream = Stream(peer, context)
            self._open.add(stream)
            self._peers[peer] += 1
            return stream

    def claim(self, stream: Stream, island: str) -> str:
        """Names the island the stream pushes for (from its header): '' if that island is within its limit, else
        why not (the stream stays counted for its peer until :meth:`close`)."""
        with self._lock:
            if self._islands[island] >= self.per_island:
                return (f"island {island!r} already has {self._islands[island]} push streams open, the most one "
                        f"island may hold at once (coordinator.max_streams_per_island={self.per_island}); retry "
                        f"when one has ended")
            stream.island = island
            self._islands[island] += 1
            return ""

    def close(self, stream: Stream) -> None:
        """The stream ended (answered, refused, broken or cancelled): uncounted."""
        with self._lock:
            if stream not in self._open:
                return
            self._open.discard(stream)
            self._peers[stream.peer] -= 1
            if not self._peers[stream.peer]:
                del self._peers[stream.peer]
            if stream.island:
                self._islands[stream.island] -= 1
                if not self._islands[stream.island]:
                    del self._islands[stream.island]

    def counts(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """(open streams, per peer, per island): a snapshot."""
        with self._lock:
            return len(self._open), dict(self._peers), dict(self._islands)

    def watched(self, stream: Stream, requests: Iterator[T]) -> Iterator[T]:
        """``requests`` with each wait for the client's next message marked on ``stream`` (what the reaper
        measures idle time on)."""
        while True:
            with self._lock:
                stream.waiting_since = self.clock()
            try:
                message = next(requests)
            except StopIteration:
                return
            finally:
                with self._lock:
                    stream.waiting_since = None
            yield message

    def reap(self) -> list[tuple[Stream, float]]:
        """Cancels every stream that has waited more than ``idle_s`` for its client; returns them with how long
        each waited. The handler blocked on the stream sees the cancellation as a grpc.RpcError, its client as
        CANCELLED."""
        now = self.clock()
        with self._lock:
            idle = [(s, now - s.waiting_since) for s in self._open
                    if not s.cancelled and s.waiting_since is not None and now - s.waiting_since > self.idle_s]
            for s, _ in idle:
                s.cancelled = True
        for s, _ in idle:
            s.context.cancel()
        return idle

    def _reap_until_stopped(self) -> None:
        tick = min(1.0, self.idle_s / 4)  # an idle stream is cancelled within idle_s + tick
        while not self._stop.wait(tick):
            for stream, waited in self.reap():
                try:
                    self.on_idle(stream, waited)
                except Exception:  # noqa: BLE001 - recording must not stop the reaper
                    _log.exception("recording an idle push stream failed")

