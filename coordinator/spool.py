"""An incoming push, checked as it streams in and spooled to a temp file: :class:`Spool` (every scale and code
checked by ``codec.FrameValidator`` as zstd decompresses it; the decompressed body, scales ‖ payload, kept so
that summing it needs no second decode, and its scales in memory too once it is accepted, so that the merge
reads only the codes back) and :class:`BodyNorm` (its L2 norm, measured in the same pass from the checked
scales and codes). ``coordinator.merger`` hands out spools and sums the accepted ones.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dtrain import codec

# The checked body reaches the file and the norm in pieces of up to this many bytes: a 1 MiB chunk is one piece,
# not four (each piece costs its checks' and the norm's numpy calls, and a GIL hand-off each); the pieces of the
# pushes receiving at once (coordinator.max_receiving) are held for a moment each.
OUT_PIECE = 1 << 20


def write_from(fd: int, buf: np.ndarray | bytes | bytearray | memoryview, offset: int) -> None:
    """Writes all of ``buf`` to ``fd`` at ``offset`` (positional: the file offset is not moved)."""
    view = (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class BodyNorm:
    """The L2 norm of a frame body (scales ‖ payload, the validator's output) fed in order, piece by piece:
    Σ_b scale_b² · Σ level² per block (``codec.block_sum_squares``), float64, nothing dequantized; bits=32:
    Σ value². Pieces need not align with blocks: the bytes of a split block wait for the rest (at most one block).

    Sums are numpy's own loops (``codec.sum_squares`` for fp32 values, ``np.einsum`` for the per-block terms),
    never ``np.dot``: a dot of a 256 KiB fp32 piece goes to the BLAS library, whose threads spin while they wait
    for work; with several pushes streaming in at once they took the coordinator's cores from each other (8
    fp32 islands: 8x the CPU of 4, ~90 CPU s a round for 8 pushes that cost ~1 CPU s each alone). The
    coordinator makes no BLAS call (tests/test_merger_poison.py counts them).
    """

    def __init__(self, n: int, bits: codec.Bits, block: int):
        self.n, self.bits, self.block = n, bits, block
        self._scales_len = 4 * codec.n_scales(bits, n, block)
        self._scales = bytearray()
        self._scales_sq = np.zeros(0, np.float64)
        self._unit = 4 if bits == 32 else codec.payload_len(bits, block)  # payload bytes of one block (one value)
        self._per_unit = 1 if bits == 32 else block  # values per unit
        self._carry = bytearray()
        self._units = 0  # whole units summed so far
        self._sum_sq = 0.0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(self._scales) < self._scales_len:
            take = self._scales_len - len(self._scales)
            self._scales += view[:take]
            view = view[take:]
            if len(self._scales) == self._scales_len:
                self._scales_sq = np.square(np.frombuffer(self._scales, "<f4").astype(np.float64))
        if not view:
            return
        if self._carry:  # complete the split unit first
            take = self._unit - len(self._carry)
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < self._unit:
                return
            self._add(self._carry, self._per_unit)
            self._carry = bytearray()
        whole = len(view) - len(view) % self._unit
        if whole:
            self._add(view[:whole], whole // self._unit * self._per_unit)
        self._carry += view[whole:]

    def _add(self, payload: bytes | bytearray | memoryview, count: int) -> None:
        if self.bits == 32:
            self._sum_sq += codec.sum_squares(np.frombuffer(payload, "<f4"))
        else:
            first = self._units
            sums = codec.block_sum_squares(self.bits, self.block, payload, count)
            self._sum_sq += float(np.einsum("i,i->", self._scales_sq[first:first + sums.size], sums))
        self._units += -(-count // self._per_unit)

    @property
    def scales(self) -> np.ndarray:
        """The body's scales (float32, a read-only view of the bytes fed; empty for bits=32 or before they are all
        in)."""
        scales = np.frombuffer(self._scales, "<f4") if len(self._scales) == self._scales_len else np.empty(0, "<f4")
        scales.flags.writeable = False
        return scales

    def norm(self) -> float:
        """The norm of what was fed, counting the last, partial block still waiting (call once all is in)."""
        total = self._sum_sq
        if self._carry and self.bits != 32:
            count = self.n - self._units * self.block
            sums = codec.block_sum_squares(self.bits, self.block, self._carry, count)
            total += float(np.einsum("i,i->", self._scales_sq[self._units:self._units + 1], sums))
        return math.sqrt(total)


class Spool:
    """One incoming frame, checked as it streams in (``codec.FrameValidator``: every scale and code, as zstd
    decompresses it); what is kept, in a temp file, is the decompressed body (scales ‖ payload), so
    summing it needs no second decode. Its L2 norm is measured in the same pass (:class:`BodyNorm`)."""

    def __init__(self, directory: Path, n: int, bits: codec.Bits, block: int,
                 spare: tuple[int, Path] | None = None, release: Callable[[int, Path], bool] | None = None,
                 max_count: int | None = None):
        """``spare``: an earlier spool's (fd, path) to write over; ``release(fd, path)``: offered the file on
        close, which keeps it open and in place when it returns True; ``max_count``: a sparse push's bound on the
        entries of a chunk (the config's density)."""
        if spare is None:
            fd, name = tempfile.mkstemp(prefix="push-", suffix=".body", dir=directory)
            spare = fd, Path(name)
        self.fd, self.path = spare
        self.n = n  # values the frame must hold (a fragment's, with outer.fragments > 1)
        self._release = release
        self._offset = 0
        self._validator: codec.FrameValidator | None = codec.FrameValidator(n, bits, block, out=self._append,
                                                                            out_piece=OUT_PIECE, max_count=max_count)
        # sparse pushes: the checker measures the norm, and its layout (counts, record offsets) stays for the merge
        self._norm = None if codec.has_records(bits) else BodyNorm(n, bits, block)
        self.sparse: codec.SparseChecker | codec.MaskChecker | None = None
        self.size = 0  # frame bytes received
        self.complete = False
        self.norm = math.nan  # the L2 norm of its values, once finish() has accepted it
        # Its scales (float32, one per block; dense quantized codecs), kept in memory once finish() has accepted it
        # (4 bytes a block): the merge reads only the payload from the file. None: read them from the file.
        self.scales: np.ndarray | None = None
        self._kept = False

    def keep(self) -> None:
        """Hands the spool over to the merger: leaving its ``with`` block no longer deletes it."""
        self._kept = True

    def _append(self, data: bytes | bytearray | memoryview) -> None:
        write_from(self.fd, data, self._offset)
        if self._norm is not None:
            self._norm.feed(data)  # the piece is in cache: the norm costs no second read of the body
        self._offset += len(data)

    def write(self, data: bytes | memoryview, crc32: int | None = None) -> None:
        """Feeds frame bytes; raises CodecError as soon as something is wrong. ``crc32``: their CRC32, where the
        caller has checked it already (``codec.FrameValidator.feed``: no second pass)."""
        if self._validator is None:
            raise RuntimeError("write() on a closed spool")
        self._validator.feed(data, crc32)
        self.size += len(data)

    def finish(self) -> None:
        if self._validator is None:
            raise RuntimeError("finish() on a closed spool")
        self._validator.finish()
        self.sparse = self._validator.sparse
        if self._norm is not None:
            self.norm = self._norm.norm()
            if self._norm.bits != 32:
                self.scales = self._norm.scales
            self._norm = None  # its squared scales (8 bytes a block) go: a pending push keeps only what the merge reads
        else:
            self.norm = self.sparse.norm if self.sparse else 0.0
        self.complete = True

    def close(self) -> None:
        # The validator refers back to this spool (its output sink): dropped, so a closed spool is freed by its
        # last reference instead of waiting, with its buffers, for the cyclic GC.
        self._validator = None
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        if self._release is not None and self._release(fd, self.path):
            return
        os.close(fd)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._kept:
            self.close()
