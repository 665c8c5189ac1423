"""The mask codec (``codec.up`` / ``codec.down = "mask"``, scheme ``"mask2"``): index-free shared selection.

Every round, sender and receiver select the SAME entries from a seed (the round's version) and a density: no
index travels. Entry i is kept under (seed, D) iff ``(h(i) + seed·D) mod 2^32 < D``, with ``h(i) = i·0x9E3779B1
mod 2^32`` (a Weyl sequence: the kept entries are spread evenly, every chunk holds about D/2^32 of its values) and
D = round(density·2^32) the density code: consecutive seeds take disjoint windows of the hash, so each entry is
kept once every ~1/density rounds, and error feedback carries it until then. Against top-k (``dtrain.codec.sparse``)
a kept value costs its 2 bits and no ~10-bit index, and the coordinator's update keeps exactly the pushes' entries
(no union growing with the islands), so at equal traffic about 5x the values move each round.

Frames (``dtrain.codec.frame``: bits code 0x4D; the header's ``block`` is the chunk C): the body is

    scales (float32, one per chunk of C values of the whole vector) ‖ seed (u32) ‖ D (u32) ‖ codes of chunk 0 ‖ …

A chunk's scale is the RMS of its kept values (0 when it keeps none); its k kept values (in index order) are 2-bit
codes c standing for (c − 1.5)·scale, the dense 2-bit levels (``dtrain.codec.int2``), packed four to a byte, low
bits first, ``ceil(k/4)`` bytes, the unused high bits of the last byte 0: every chunk starts on a byte, so a slab
of whole chunks is found without decoding the ones before it. A receiver checks the scales (finite, ≥ 0, at most
``int2.SCALE_MAX``), D (≥ 1), the payload's length against the counts the seed and D give, and the padding bits;
every code is a level. Any seed is valid; the payload is never larger than a dense 2-bit one (plus 8 bytes and a
byte a chunk), whatever D a sender claims. Pure numpy.

In a synchronous round every push and the update share the version's mask; a push from an older version (a late
push merged into the open round, or async merges) holds another mask's entries: the update still goes on the
coordinator's version's mask, and the down residual keeps what that leaves out.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Final, Literal

import numpy as np

from dtrain.codec import int2
from dtrain.codec.sparse import RecordChecker, SparseBits, is_sparse
from dtrain.codec.spec import CodecError

if TYPE_CHECKING:  # a typing-only import (typing.TypeIs is Python 3.13's)
    from typing_extensions import TypeIs

__all__ = [
    "DESCRIPTOR_SIZE",
    "MASK_BITS",
    "MaskChecker",
    "chunk_counts",
    "density_code",
    "has_records",
    "keep_mask",
    "mask_add",
    "mask_dequantize",
    "mask_quantize",
    "mask_quantize_segment",
    "max_payload_len",
]

MASK_BITS: Final = "mask2"
_GOLDEN: Final = np.uint64(0x9E3779B1)
_WORD: Final = np.uint64(0xFFFFFFFF)
_DESCRIPTOR: Final = struct.Struct("<II")  # seed, density code
DESCRIPTOR_SIZE: Final = _DESCRIPTOR.size
_SLAB: Final = 1 << 20  # values hashed at once


def has_records(bits: object) -> TypeIs[SparseBits | Literal["mask2"]]:
    """Whether the scheme ``bits``'s payload is per-chunk records whose size depends on what they hold (sparse
    and mask schemes): its frame writer needs the payload's size, its reader a checker that keeps the layout."""
    return is_sparse(bits) or bits == MASK_BITS


def density_code(density: float) -> int:
    """D: the density as a fraction of 2^32, in [1, 2^32 − 1]."""
    if not 0 < density <= 1:
        raise CodecError(f"mask density must be in (0, 1], got {density!r}")
    return min(max(1, round(density * 2 ** 32)), 2 ** 32 - 1)


def keep_mask(seed: int, code: int, start: int, end: int) -> np.ndarray:
    """Which of the entries [start, end) the mask (seed, D) keeps (bool)."""
    i = np.arange(start, end, dtype=np.uint64)
    shift = np.uint64((seed % 2 ** 32) * code % 2 ** 32)
    return ((i * _GOLDEN + shift) & _WORD) < np.uint64(code)


def chunk_counts(seed: int, code: int, n: int, chunk: int) -> np.ndarray:
    """Kept entries of each chunk of an n-value vector (int64, ceil(n/chunk) of them)."""
    counts = np.zeros(-(-n // chunk), np.int64)
    slab = max(1, _SLAB // chunk) * chunk
    for s in range(0, n, slab):
        keep = np.flatnonzero(keep_mask(seed, code, s, min(n, s + slab))) + s
        counts += np.bincount(keep // chunk, minlength=counts.size)
    return counts


def _record_lens(counts: np.ndarray) -> np.ndarray:
    return (counts + 3) // 4


def max_payload_len(n: int, chunk: int) -> int:
    """The largest payload of an n-value vector (every entry kept)."""
    full, last = divmod(n, chunk)
    return DESCRIPTOR_SIZE + full * ((chunk + 3) // 4) + (last + 3) // 4


def mask_quantize_segment(chunk: int, x: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Codes the kept entries of values that start on a chunk boundary: (one float32 scale per chunk, the chunks'
    code records back to back). ``x``: finite float32; ``keep``: bool, its shape."""
    n_chunks = -(-x.size // chunk)
    flat = np.flatnonzero(keep)
    chunk_of = flat // chunk
    values = x[flat].astype(np.float64)
    counts = np.bincount(chunk_of, minlength=n_chunks)
    sq = np.bincount(chunk_of, weights=values * values, minlength=n_chunks)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.minimum(np.sqrt(np.where(counts > 0, sq / np.maximum(counts, 1), 0)), float(int2.SCALE_MAX))
    scales = scales.astype(np.float32)
    s = scales[chunk_of].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(s > 0, values / np.where(s > 0, s, 1), 0)
    codes = np.clip(np.floor(ratio) + 2, 0, 3).astype(np.uint8)  # the nearest of ±0.5, ±1.5 (int2's rounding)
    rec = _record_lens(counts)
    offsets = np.concatenate([[0], np.cumsum(rec)])
    first_entry = np.concatenate([[0], np.cumsum(counts)])
    local = np.arange(flat.size, dtype=np.int64) - first_entry[:-1][chunk_of]
    out = np.zeros(int(offsets[-1]), np.uint8)
    pos = offsets[:-1][chunk_of] + local // 4
    shift = (local % 4) * 2
    for sh in range(4):  # entries sharing a shift land in distinct bytes
        sel = shift == 2 * sh
        out[pos[sel]] |= (codes[sel] << (2 * sh)).astype(np.uint8)
    return scales, out.tobytes()


def mask_quantize(x: np.ndarray, chunk: int, seed: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    """A whole finite float32 vector under the mask (seed, density): ``(scales, payload)``, payload = seed ‖ D ‖
    records (uint8). Slab by slab (temporaries ~O(1M values))."""
    code = density_code(density)
    slab = max(1, _SLAB // chunk) * chunk
    parts = [mask_quantize_segment(chunk, x[s:s + slab], keep_mask(seed, code, s, min(x.size, s + slab)))
             for s in range(0, x.size, slab)]
    scales = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.float32)
    head = _DESCRIPTOR.pack(seed % 2 ** 32, code)
    return scales, np.frombuffer(b"".join([head, *(p[1] for p in parts)]), np.uint8)


def mask_add(chunk: int, scales: np.ndarray, records: np.ndarray | bytes | memoryview, keep: np.ndarray,
             out: np.ndarray, weight: float | np.floating = 1.0) -> None:
    """``out += weight · values`` of consecutive chunks from a chunk boundary (checked records; ``keep``: the
    mask over them, the shape of ``out``)."""
    flat = np.flatnonzero(keep)
    if not flat.size:
        return
    chunk_of = flat // chunk
    counts = np.bincount(chunk_of, minlength=scales.size)
    offsets = np.concatenate([[0], np.cumsum(_record_lens(counts))])
    first_entry = np.concatenate([[0], np.cumsum(counts)])
    local = np.arange(flat.size, dtype=np.int64) - first_entry[:-1][chunk_of]
    rec = np.frombuffer(records, np.uint8)
    codes = (rec[offsets[:-1][chunk_of] + local // 4] >> ((local % 4) * 2).astype(np.uint8)) & 3
    factors = scales.astype(np.float32) * np.float32(weight)
    out[flat] += int2.LEVELS[codes] * factors[chunk_of]


def mask_dequantize(chunk: int, n: int, scales: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """A whole checked vector's values (the mask from the payload's seed and D)."""
    seed, code = _DESCRIPTOR.unpack_from(bytes(payload[:DESCRIPTOR_SIZE]))
    out = np.zeros(n, np.float32)
    mask_add(chunk, scales, np.asarray(payload)[DESCRIPTOR_SIZE:], keep_mask(seed, code, 0, n), out)
    return out


class MaskChecker(RecordChecker):
    """Checks a mask body's payload (seed ‖ D ‖ records) fed in pieces, and hands out each piece once checked.

    Args:
        chunk, n: the frame's chunk size and length; payload_len: the payload's declared size.
        scales: the frame's checked scales (for the sum of squares). out: the sink of checked bytes.

    Once the descriptor is in: :attr:`seed`, :attr:`code`, :attr:`counts` (kept entries per chunk) and
    :attr:`record_offsets` (where each chunk's record starts, after the descriptor); :attr:`sum_squares` over
    what was checked.
    """

    def __init__(self, chunk: int, n: int, payload_len: int, scales: np.ndarray, out: object):
        self.chunk, self.n, self.payload_len = chunk, n, payload_len
        self.scales_sq = np.square(scales.astype(np.float64))
        self.out = out
        self.seed = self.code = 0
        self.counts: np.ndarray | None = None
        self.record_offsets: np.ndarray | None = None
        self._head = bytearray()
        self._buf = bytearray()
        self._done = 0
        self.sum_squares = 0.0

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.counts is None:
            take = DESCRIPTOR_SIZE - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < DESCRIPTOR_SIZE:
                return
            self._check_descriptor()
            self.out(bytes(self._head))  # type: ignore[operator]
        self._feed_records(view)  # (even when empty: chunks that keep nothing are complete as they are)

    def _check_descriptor(self) -> None:
        self.seed, self.code = _DESCRIPTOR.unpack(bytes(self._head))
        if self.code == 0:
            raise CodecError("mask density code 0 (an empty mask) is invalid")
        counts = chunk_counts(self.seed, self.code, self.n, self.chunk)
        offsets = np.concatenate([[0], np.cumsum(_record_lens(counts))])
        if DESCRIPTOR_SIZE + int(offsets[-1]) != self.payload_len:
            raise CodecError(f"the mask (seed {self.seed}, density {self.code / 2 ** 32:.4g}) makes a "
                             f"{DESCRIPTOR_SIZE + int(offsets[-1])}-byte payload, the header declares "
                             f"{self.payload_len}")
        self.counts, self.record_offsets = counts, offsets

    def _check_records(self, first: int, end: int, records: memoryview) -> None:
        assert self.counts is not None and self.record_offsets is not None
        counts = self.counts[first:end]
        rec = np.frombuffer(records, np.uint8)
        used = (counts % 4) * 2
        last = self.record_offsets[first + 1:end + 1] - self.record_offsets[first] - 1
        pad = used > 0
        if pad.any() and ((rec[last[pad]] >> used[pad].astype(np.uint8)) != 0).any():
            j = int(np.flatnonzero(pad)[int(np.argmax((rec[last[pad]] >> used[pad].astype(np.uint8)) != 0))])
            raise CodecError(f"chunk {first + j}: padding bits after the last code must be 0")
        # Σ level² per chunk: every byte's four codes, less the padding codes (code 0: level² 2.25 each)
        per_byte = np.square(int2.levels(rec, 4 * rec.size), dtype=np.float64).reshape(-1, 4).sum(axis=1)
        csum = np.concatenate([[0.0], np.cumsum(per_byte)])
        rel = (self.record_offsets[first:end + 1] - self.record_offsets[first]).astype(np.int64)
        per_chunk = csum[rel[1:]] - csum[rel[:-1]] - 2.25 * ((4 - counts % 4) % 4)
        self.sum_squares += float(np.dot(per_chunk, self.scales_sq[first:end]))

    def finish(self) -> None:
        """Every chunk's record arrived and was checked."""
        if self.counts is None or self._done != self.counts.size or self._buf:
            raise CodecError(f"mask body truncated: {self._done} of {-(-self.n // self.chunk)} chunks complete")
        self.out = None

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_squares)
