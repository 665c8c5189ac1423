"""The merger's file work: reading spooled pushes into slabs, writing update frames, installing state files.

Everything here reads or writes through file descriptors and numpy buffers a slab at a time, so no model-sized
array is held (``coordinator/merger.py`` for why).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from coordinator.merge_types import MergeOptions, SpooledPush
from coordinator.spool import write_from
from dtrain import codec
from dtrain.codec import hasher_digest, params_hasher
from dtrain.codec.masked import DESCRIPTOR_SIZE  # a mask payload's seed and density code, before its records

IO_PIECE = 1 << 22  # bytes per read when streaming a file into a frame
# int8 pushes summed at once (codec.dequantize_sum): one einsum per group instead of a broadcast multiply per push,
# a quarter less CPU for the sum; its float32 buffers, (SUM_GROUP + 1) pieces (codec.sum_piece_values), stay in L2
SUM_GROUP = 12


def read_into(fd: int, buf: np.ndarray, offset: int) -> None:
    view = buf.data.cast("B")  # ndarray.data: the array's buffer as a memoryview, no copy
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at offset {offset + got} (file truncated?)")
        got += n


def write_frame_file(path: Path, bits: codec.Bits, block: int, n: int, scales: np.ndarray, payload_file: Path,
                     level: int, payload_size: int | None = None) -> tuple[int, int]:
    """``codec.write_frame`` to ``path`` (atomically: a .tmp file, then a rename), the payload streamed from
    ``payload_file`` in pieces of IO_PIECE bytes; returns (frame size, CRC32 of the whole frame).
    ``payload_size``: the payload's bytes (a sparse scheme's)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out, open(payload_file, "rb") as src:
        size, crc = codec.write_frame(out, bits, block, n, scales, iter(lambda: src.read(IO_PIECE), b""), level,
                                      payload_size)
    tmp.replace(path)
    return size, crc


def read_sparse(pending: list[SpooledPush], bits: codec.Bits, chunk: int, start: int, outs: list[np.ndarray],
                 weights: list[np.float32]) -> None:
    """outs[i] += weights[i]·Δ_i for sparse pushes, values [start, start + outs[i].size) (whole chunks): each
    push's scales, counts and records of those chunks read from its spool (the layout its checker kept), summed
    into the dense slab (``codec.sparse_add``).
    (A mask push, ``codec.MASK_BITS``, likewise: its records after its seed and density, summed where its mask
    keeps entries, ``codec.mask_add``.)"""
    assert codec.has_records(bits)
    count = outs[0].size if outs else 0
    first, end = start // chunk, -(-(start + count) // chunk)
    scales = np.empty(end - first, "<f4")
    for p, out, weight in zip(pending, outs, weights, strict=True):
        layout = p.spool.sparse
        assert layout is not None and layout.counts is not None and layout.record_offsets is not None
        n_chunks = layout.counts.size
        read_into(p.spool.fd, scales, 4 * first)
        lo, hi = int(layout.record_offsets[first]), int(layout.record_offsets[end])
        records = np.empty(hi - lo, np.uint8)
        if isinstance(layout, codec.MaskChecker):
            read_into(p.spool.fd, records, 4 * n_chunks + DESCRIPTOR_SIZE + lo)
            keep = codec.keep_mask(layout.seed, layout.code, start, start + count)
            codec.mask_add(chunk, scales, records, keep, out, weight=weight)
            continue
        read_into(p.spool.fd, records, 4 * n_chunks + lo)
        assert codec.is_sparse(bits)
        codec.sparse_add(bits, chunk, scales, layout.counts[first:end], records, out, weight=weight)


class SparseDown:
    """The sparse update's payload file, written in order: the chunks' records after room for the counts, then
    the counts (u16 per chunk) at the front, then the file cut to its size. A mask update (``mask``: its seed and
    density code): its records after room for those two u32s, written at the front at the end."""

    def __init__(self, fd: int, n: int, chunk: int, mask: tuple[int, int] | None = None):
        self.fd, self.counts = fd, np.zeros(-(-n // chunk), "<u2")
        self.mask = mask
        self.offset = DESCRIPTOR_SIZE if mask else 2 * self.counts.size

    def append(self, first: int, counts: np.ndarray | None, records: bytes) -> None:
        if counts is not None:
            self.counts[first:first + counts.size] = counts
        write_from(self.fd, records, self.offset)
        self.offset += len(records)

    def close(self) -> None:
        write_from(self.fd, np.array(self.mask, "<u4") if self.mask else self.counts, 0)
        os.ftruncate(self.fd, self.offset)


def install_file(src: np.ndarray | Path, dest: Path, what: str, n: int | None = None) -> int:
    """Puts ``src`` at ``dest`` as raw little-endian float32 and returns its length: a file is hard-linked (copied
    where it cannot be), an array written; an empty array with ``n`` given is ``n`` zeros (a sparse file).
    ``n``: the length it must have (``what`` names it in the error)."""
    if isinstance(src, (str, Path)):
        size = Path(src).stat().st_size
        if size % 4 or (n is not None and size != 4 * n):
            raise ValueError(f"{what} file {src} holds {size} bytes, expected {4 * (n or 0) or 'a multiple of 4'}")
        try:
            os.link(src, dest)
        except OSError:  # another file system, or no hard links: copy (the kernel's copy, not via memory)
            import shutil

            shutil.copyfile(src, dest)
        return size // 4
    arr = np.asarray(src)
    if arr.size == 0 and n is not None:  # zeros: a sparse file
        with open(dest, "wb") as f:
            f.truncate(4 * n)
        return n
    arr = np.ascontiguousarray(arr, dtype="<f4").ravel()
    if n is not None and arr.size != n:
        raise ValueError(f"{what} has {arr.size} values, θ has {n}")
    arr.tofile(dest)
    return int(arr.size)


def scan_theta(path: Path) -> tuple[str, float]:
    """The digest and the L2 norm of a θ file, in one read."""
    h = params_hasher()
    sum_sq = 0.0
    with open(path, "rb") as f:
        while piece := f.read(IO_PIECE):
            h.update(piece)
            sum_sq += codec.sum_squares(np.frombuffer(piece, "<f4"))
    return hasher_digest(h), math.sqrt(sum_sq)


def read_pending(pending: list[SpooledPush], o: MergeOptions, n_values: int, start: int, outs: list[np.ndarray],
                 weights: list[np.float32]) -> None:
    """outs[i] += weights[i]·Δ_i for each pending push i (its spool holds ``n_values`` values), values
    [start, start + outs[i].size): the codes read from the spool, the scales from memory (``Spool.scales``) where
    the spool kept them."""
    count = outs[0].size if outs else 0
    if codec.has_records(o.up_bits):
        read_sparse(pending, o.up_bits, o.up_block or o.block, start, outs, weights)
        return
    first_block, end_block = start // o.block, -(-(start + count) // o.block)
    n_blocks = codec.n_scales(o.up_bits, n_values, o.block)  # the pushes' values
    scales = np.empty(end_block - first_block if o.up_bits != 32 else 0, "<f4")
    payload = np.empty(codec.payload_len(o.up_bits, count), np.uint8)
    scratch = np.empty(count, np.float32)
    for p, out, weight in zip(pending, outs, weights, strict=True):
        block_scales = _block_scales(p, n_blocks, first_block, end_block, scales)
        read_into(p.spool.fd, payload, 4 * n_blocks + codec.payload_offset(o.up_bits, start))
        codec.dequantize_add(o.up_bits, o.block, block_scales, payload, out, weight=weight, scratch=scratch)


def _block_scales(p: SpooledPush, n_blocks: int, first_block: int, end_block: int, buf: np.ndarray) -> np.ndarray:
    """Push ``p``'s scales of blocks [first_block, end_block): from memory where its spool kept them, else read
    into ``buf`` (empty for bits=32: no scales)."""
    kept = p.spool.scales  # in memory since the push was accepted: no read
    if kept is not None and kept.size == n_blocks:
        return kept[first_block:end_block]
    if buf.size:
        read_into(p.spool.fd, buf, 4 * first_block)
    return buf


def sum_pending(pending: list[SpooledPush], o: MergeOptions, n_values: int, start: int, out: np.ndarray,
                weights: list[np.float32]) -> None:
    """out += Σ weights[i]·Δ_i over the pending pushes, values [start, start + out.size): int8 pushes of whole
    blocks SUM_GROUP at a time (``codec.dequantize_sum``: the same float32 sum, bit for bit, as one
    ``dequantize_add`` per push), every other case through :func:`read_pending`."""
    count = out.size
    if o.up_bits != 8 or count % o.block or len(pending) < 2:
        read_pending(pending, o, n_values, start, [out] * len(pending), weights)
        return
    first_block, end_block = start // o.block, (start + count) // o.block
    n_blocks = codec.n_scales(8, n_values, o.block)
    blocks = end_block - first_block
    group = min(SUM_GROUP, len(pending))
    codes = np.empty((group, count), np.int8)
    scales = np.empty((group, blocks), np.float32)
    piece = min(count, codec.sum_piece_values(o.block))
    work, total = np.empty((group + 1) * piece, np.float32), np.empty(piece, np.float32)
    for at in range(0, len(pending), group):
        members = pending[at:at + group]
        g = len(members)
        for row, p in enumerate(members):
            scales[row] = _block_scales(p, n_blocks, first_block, end_block, scales[row])
            read_into(p.spool.fd, codes[row], 4 * n_blocks + codec.payload_offset(8, start))
        codec.dequantize_sum(o.block, scales[:g], codes[:g], np.asarray(weights[at:at + g], np.float32), out, work,
                             total)
