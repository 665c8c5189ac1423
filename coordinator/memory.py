"""The coordinator's memory at rest and in flight: glibc heap tuning and trimming, and the stream budget.

Owns :func:`return_large_frees_to_the_os` (glibc's mmap and arena settings, once per process), the count of
frames streaming in and out (:class:`FrameStreams`, which hands the heap's free memory back to the OS when they
end), and how ``coordinator.stream_budget_bytes`` is shared among the islands' streams (:func:`stream_share`,
:func:`stream_window`, :func:`pull_piece`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from dtrain.config.sections import Config


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None: nothing to tune."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def return_large_frees_to_the_os() -> None:
    """glibc keeps freed multi-MiB temporaries in per-thread arenas, one per gRPC thread, so the coordinator's
    resident size would creep up to a multiple of the model. A fixed 4 MiB mmap threshold hands anything
    larger back to the OS when freed, while the chunk-sized buffers of every push (1 MiB messages, 256 KiB
    zstd output, 1 MiB slabs) come from the heap and are reused instead of mmap'd and faulted in each time
    (a 1 MiB threshold made rounds ~10% slower); two arenas are enough here. What the heap keeps once the
    streams are done goes back by :class:`FrameStreams`."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-8, 2)  # M_ARENA_MAX
    # Fixing the mmap threshold also pins the trim threshold at 128 KiB, so those buffers would be given
    # back and faulted in again every time; keep up to 16 MiB of free heap.
    libc.mallopt(-1, 16 << 20)  # M_TRIM_THRESHOLD


class FrameStreams:
    """Counts the frames streaming in (pushes) and out (pulls). When the last one ends, and after each merge, the
    free memory the heap kept from their buffers (chunks, decoders, gRPC's copies: megabytes a stream, freed all
    over the heap, so glibc's trim threshold cannot return them) goes back to the OS with ``malloc_trim``, at most
    every ``TRIM_EVERY_S``. Without it a round's pushes leave the heap at their peak and the pulls that follow
    add theirs on top (benchmarks/scale.py: 64 islands, 317 MiB at rest between rounds, 85 MiB with it)."""

    TRIM_EVERY_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self._trimmed = -math.inf
        self.trims = 0

    def begin(self) -> None:
        with self._lock:
            self.active += 1

    def end(self) -> None:
        with self._lock:
            self.active -= 1
            if self.active:
                return
        self.trim()

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def trim(self) -> None:
        libc = _glibc()
        now = time.monotonic()
        with self._lock:
            if libc is None or now - self._trimmed < self.TRIM_EVERY_S:
                return
            self._trimmed = now
            self.trims += 1
        libc.malloc_trim(0)


def stream_share(cfg: Config) -> int:
    """Each island's share of ``coordinator.stream_budget_bytes`` (the budget / ``outer.islands``), at least 64 KiB,
    at most ``coordinator.stream_window_bytes`` where that is set; 0 without a budget."""
    c = cfg.coordinator
    if not c.stream_budget_bytes:
        return 0
    share = max(64 << 10, c.stream_budget_bytes // max(1, cfg.outer.islands))
    return min(share, c.stream_window_bytes) if c.stream_window_bytes else share


def stream_window(cfg: Config) -> int:
    """Each incoming stream's receive window (0: gRPC's auto-tuning): its island's :func:`stream_share`, or
    ``coordinator.stream_window_bytes`` without a budget. The bytes received ahead of the handlers stay near the
    budget however many islands push at once (benchmarks/scale.py)."""
    c = cfg.coordinator
    if not c.stream_window_bytes:
        return 0
    return stream_share(cfg) or c.stream_window_bytes


def pull_piece(cfg: Config) -> int:
    """Bytes per chunk of a pull's frames: ``codec.chunk_bytes``, at most half its island's :func:`stream_share`.
    A pull streamed from its file holds its chunk twice (the message in Python, gRPC's copy until it is on the
    wire), so the pulls of every island at once hold about the budget, not islands x 2 x chunk_bytes (64 islands,
    1 MiB chunks: +190 MiB). Pulls that share a frame in the pull cache (``coordinator.pull_cache``) hold its
    messages once between them, plus gRPC's copy of each one's current chunk. Islands accept any chunk size up to
    their own ``codec.chunk_bytes``."""
    share = stream_share(cfg)
    return min(cfg.codec.chunk_bytes, share // 2) if share else cfg.codec.chunk_bytes
