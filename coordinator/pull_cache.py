"""The chunk messages of the frames pulls are serving, built once per frame instead of once per island.

Every island's pull of a version streams the same update frame (and every join the same lossless θ frame). Built
per pull (:func:`dtrain.net.wire.file_chunk_messages`), each pull reads the frame from the page cache, takes each
chunk's CRC32 and copies each piece into its message: 64 islands pay that 64 times for identical bytes.
:class:`PullCache` builds a frame's chunk messages once, with that same function, and hands every pull of the
frame the same immutable ``bytes``; gRPC still copies each message it sends (into its own buffer, as for any
message), so a pull costs that one copy and no read, CRC or message build.

Bounded: an entry lives while pulls stream its frame (the last of them to end drops it), and the entries hold at
most ``coordinator.pull_cache_bytes``; a pull of a frame that does not fit beside them (e.g. the lossless θ of a
large model) streams from its file as before. So the sharing is among the pulls of a frame that overlap in time:
a sync round's pulls all wait for the same merge and stream together, sharing one build, and between those bursts
(while the next round's pushes stream in: the coordinator's peak) the cache holds nothing. A lone pull builds its
frame alone (one read, as before, but the whole frame in memory while it streams, not one piece).

Keyed safely. The merger writes a frame once (a .tmp file renamed into place) and describes it by an
:class:`coordinator.merger.Update`; a frame written again (a new version's θ frame at a reused path, a restart)
gets a new ``Update`` object and a new file. An entry matches only the very ``Update`` object it was built for
(held by the entry, so its identity is never reused) and only while the pull's open handle is the same file as
built from (device, inode, size and modification time): a stale entry is never served.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import BinaryIO

from coordinator.merge_types import Update
from dtrain.net.wire import chunk_count, file_chunk_messages

# Bytes a chunk message adds to its piece: the Chunk's tags and varints (index, CRC32, length) and the oneof's.
_CHUNK_OVERHEAD = 24


def _signature(handle: BinaryIO) -> tuple[int, int, int, int]:
    st = os.fstat(handle.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Entry:
    __slots__ = ("update", "signature", "piece", "cost", "messages", "ready", "users")

    def __init__(self, update: Update, signature: tuple[int, int, int, int], piece: int, cost: int):
        self.update, self.signature, self.piece, self.cost = update, signature, piece, cost
        self.messages: tuple[bytes, ...] | None = None  # None until built, or if building failed
        self.ready = threading.Event()
        self.users = 0  # pulls streaming it now


class PullCache:
    """The chunk messages of the frames pulls are streaming now, at most ``budget_bytes`` of them (0: nothing is
    cached). Thread-safe: concurrent pulls of a frame share one build (the first builds, the others wait)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self.builds = 0  # frames built (read, CRC'd, chunked)
        self.hits = 0  # pulls served from an entry another pull built
        self.uncached = 0  # pulls of a frame that did not fit in the budget: streamed from the file

    def cost(self, update: Update, piece: int) -> int:
        """The bytes ``update``'s frame takes cached in chunks of ``piece``."""
        return update.size + _CHUNK_OVERHEAD * chunk_count(update.size, piece)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.cost for e in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def messages(self, update: Update, handle: BinaryIO, piece: int) -> Iterator[bytes]:
        """The chunk stream of ``update``'s frame in pieces of ``piece`` bytes, byte for byte what
        ``file_chunk_messages(handle, piece)`` yields; ``handle``: the frame opened for this pull (closed here).
        Shared with the other pulls streaming the frame now; streamed from the file if it does not fit."""
        cost = self.cost(update, piece)
        signature = _signature(handle)
        with self._lock:
            entry = next((e for e in self._entries
                          if e.update is update and e.signature == signature and e.piece == piece), None)
            build = entry is None
            if entry is None and sum(e.cost for e in self._entries) + cost <= self.budget:
                entry = _Entry(update, signature, piece, cost)
                self._entries.append(entry)
            if entry is None:
                self.uncached += 1
            else:
                entry.users += 1
        if entry is None:  # over the budget (or no cache): from the file, as before
            yield from file_chunk_messages(handle, piece)
            return
        try:
            yield from self._stream(entry, build, handle)
        finally:
            with self._lock:
                entry.users -= 1
                if not entry.users and entry in self._entries:
                    self._entries.remove(entry)  # no pull streams it: its memory goes

    def _stream(self, entry: _Entry, build: bool, handle: BinaryIO) -> Iterator[bytes]:
        if build:
            try:
                size = entry.signature[2]
                if size != entry.update.size:
                    raise OSError(f"{entry.update.path}: {size} bytes on disk, {entry.update.size} recorded")
                messages = tuple(file_chunk_messages(handle, entry.piece))  # closes the handle
                entry.messages = messages
                with self._lock:
                    self.builds += 1
            except BaseException:
                handle.close()
                with self._lock:
                    if entry in self._entries:
                        self._entries.remove(entry)  # the pulls waiting for it read their own handles
                raise
            finally:
                entry.ready.set()
            yield from messages
            return
        entry.ready.wait()
        shared = entry.messages
        if shared is None:  # its builder failed: this pull reads its own handle
            yield from file_chunk_messages(handle, entry.piece)
            return
        handle.close()
        with self._lock:
            self.hits += 1
        yield from shared
