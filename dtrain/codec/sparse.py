"""The sparse codec: per chunk, the top entries by magnitude, their values in 2 (or 4, 8) bits, their indices as gaps.

The schemes ``"sparse2"``, ``"sparse4"`` and ``"sparse8"`` (config: ``codec.up = "sparse"`` with
``codec.sparse_bits`` 2, 4 or 8) travel in the same frames as the dense ones (``dtrain.codec.frame``: the
header's ``block`` is the chunk size C, its bits code 0x52, 0x54 or 0x58), with a body of

    scales (float32, one per chunk) ‖ counts (u16, one per chunk) ‖ record of chunk 0 ‖ record of chunk 1 ‖ …

and a chunk's record is its kept entries' index gaps (u16 each) followed by their codes (b bits each, packed
low bits first, ``ceil(count·b/8)`` bytes; the unused high bits of the last byte are 0).

Selection. An island keeps the top ``k = max(1, round(density·C))`` entries of every chunk by magnitude
(which of equal magnitudes at the cut is kept is unspecified; a last, partial chunk keeps min(k, its size));
the coordinator's update keeps exactly the entries its merged pushes touched (the union of their supports;
:func:`sparse_quantize_segment` with a ``mask``), or with ``codec.down_density`` > 0 the top
``round(down_density·C)`` non-zero entries of each chunk of the update plus its residual (:func:`top_k_mask`).

Values. With L = 2^b − 1, code c ∈ 0..L stands for s·(2c − L)/L, s the chunk's scale, i.e. for b = 2 the
levels ±s/3 and ±s (no zero level: a kept entry always moves). Every code is valid. The encoder fits s to the
kept magnitudes (:func:`fit_scales`: least squares from the largest kept magnitude, never above it; values
above s are clipped to ±s, and error feedback carries what that drops).

Indices. Kept indices are sorted; the first is stored as itself, each next one as its gap to the one before
(≥ 1), so order is implied. A gap of 0 (a duplicate) or gaps that run past the chunk's end (an index out of
range: what an unsorted list coded as gaps turns into) are refused, as are a count above the chunk's size or
above the receiver's bound (``max_count``: the density the config allows), a payload length that disagrees with
the counts, non-zero padding bits and non-finite or negative scales. A record costs 16 + b bits per kept value
before zstd; small gaps (density ≳ 1/256: most gaps under 256) leave the gaps' high bytes mostly zero, which
zstd squeezes (the measured cost is in docs/architecture.md).

Pure numpy. :class:`SparseChecker` checks a body piece by piece for the frame reader, and :func:`sparse_add` sums
a run of checked chunks into a dense slab (the coordinator's merge, O(slab) memory).
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Final, Literal

import numpy as np

from dtrain.codec.spec import CodecError

if TYPE_CHECKING:  # a typing-only import (typing.TypeIs is Python 3.13's)
    from typing_extensions import TypeIs

__all__ = [
    "MAX_CHUNK",
    "RecordChecker",
    "SPARSE_BITS",
    "SparseBits",
    "SparseChecker",
    "is_sparse",
    "kept_per_chunk",
    "max_payload_len",
    "record_len",
    "sparse_add",
    "sparse_dequantize",
    "sparse_quantize",
    "sparse_quantize_segment",
    "sparse_scheme",
    "top_k_mask",
]

SparseBits = Literal["sparse2", "sparse4", "sparse8"]
SPARSE_BITS: Final[dict[SparseBits, int]] = {"sparse2": 2, "sparse4": 4, "sparse8": 8}  # scheme → value bits
MAX_CHUNK: Final = 32768  # a count (≤ the chunk size) fits a u16; index gaps too


def is_sparse(bits: object) -> TypeIs[SparseBits]:
    """Whether ``bits`` names a sparse scheme."""
    return isinstance(bits, str) and bits in SPARSE_BITS


def sparse_scheme(value_bits: int) -> SparseBits:
    """The scheme of ``codec.sparse_bits`` (2, 4 or 8)."""
    name = f"sparse{value_bits}"
    if isinstance(value_bits, bool) or name not in SPARSE_BITS:
        raise CodecError(f"sparse value bits must be 2, 4 or 8, got {value_bits!r}")
    return name


def kept_per_chunk(density: float, chunk: int) -> int:
    """k: entries an island keeps per chunk of ``chunk`` values at ``density`` (at least 1)."""
    if not 0 < density <= 1:
        raise CodecError(f"density must be in (0, 1], got {density!r}")
    return max(1, min(chunk, round(density * chunk)))


def record_len(value_bits: int, count: np.ndarray | int) -> np.ndarray | int:
    """Bytes of a chunk's record holding ``count`` entries: 2 per index gap, then the packed codes."""
    return 2 * count + (count * value_bits + 7) // 8


def _n_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _sizes(n: int, chunk: int, first: int, end: int) -> np.ndarray:
    """Sizes of chunks [first, end) of an n-value vector (the last one may be partial)."""
    sizes = np.full(end - first, chunk, np.int64)
    if end == _n_chunks(n, chunk) and end > first:
        sizes[-1] = n - (end - 1) * chunk
    return sizes


def max_payload_len(bits: SparseBits, n: int, chunk: int, max_count: int) -> int:
    """The largest payload (counts ‖ records) of an n-value vector with at most ``max_count`` entries per chunk."""
    b, full = SPARSE_BITS[bits], n // chunk
    last = n - full * chunk
    size = 2 * _n_chunks(n, chunk) + full * int(record_len(b, min(chunk, max_count)))
    return size + (int(record_len(b, min(last, max_count))) if last else 0)


# --------------------------------------------------------------------------- encoding

def _pack(bits: SparseBits, chunk_of: np.ndarray, within: np.ndarray, codes: np.ndarray,
          counts: np.ndarray) -> np.ndarray:
    """Records of the kept entries (sorted by chunk, then index), as one uint8 array."""
    b = SPARSE_BITS[bits]
    rec = np.asarray(record_len(b, counts.astype(np.int64)))
    offsets = np.concatenate([[0], np.cumsum(rec)])
    out = np.zeros(int(offsets[-1]), np.uint8)
    first_entry = np.concatenate([[0], np.cumsum(counts.astype(np.int64))])
    local = np.arange(within.size, dtype=np.int64) - np.repeat(first_entry[:-1], counts)  # entry number in chunk
    gaps = within.astype(np.int64).copy()
    gaps[1:] -= within[:-1]
    gaps[local == 0] = within[local == 0]
    base = offsets[:-1][chunk_of]
    pos = base + 2 * local
    out[pos] = gaps & 0xFF
    out[pos + 1] = gaps >> 8
    per = 8 // b
    code_pos = base + 2 * np.repeat(counts.astype(np.int64), counts) + local // per
    shift = (local % per) * b
    for s in range(per):  # entries sharing a shift land in distinct bytes
        sel = shift == s * b
        out[code_pos[sel]] |= (codes[sel].astype(np.uint8) << (s * b)).astype(np.uint8)
    return out


def _top_k(x: np.ndarray, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk number, index within the chunk) of the top ``k`` magnitudes of each chunk of ``x`` (a last, partial
    chunk: min(k, its size)), sorted by chunk then index."""
    n = x.size
    full = n // chunk
    parts_c, parts_w = [], []
    if full:
        mag = np.abs(x[:full * chunk].reshape(full, chunk))
        kk = min(k, chunk)
        # the k largest magnitudes of each row (np.argpartition), then in index order
        top = np.argpartition(-mag, kk - 1, axis=1)[:, :kk] if kk < chunk else \
            np.broadcast_to(np.arange(chunk), (full, chunk))
        top = np.sort(top, axis=1)
        parts_w.append(top.ravel())
        parts_c.append(np.repeat(np.arange(full), kk))
    if n > full * chunk:
        tail = np.abs(x[full * chunk:])
        kk = min(k, tail.size)
        top = np.sort(np.argsort(-tail, kind="stable")[:kk])
        parts_w.append(top)
        parts_c.append(np.full(kk, full))
    within = np.concatenate(parts_w).astype(np.int64) if parts_w else np.empty(0, np.int64)
    chunk_of = np.concatenate(parts_c).astype(np.int64) if parts_c else np.empty(0, np.int64)
    return chunk_of, within


def top_k_mask(x: np.ndarray, chunk: int, k: int) -> np.ndarray:
    """Where ``x`` (1-D, starting on a chunk boundary) holds the top ``k`` non-zero magnitudes of each chunk: the
    coordinator's update with ``codec.down_density`` keeps these entries (:func:`sparse_quantize_segment` with
    this ``mask``), and a zero is never sent (a kept entry always moves)."""
    chunk_of, within = _top_k(x, chunk, k)
    mask = np.zeros(x.size, bool)
    mask[chunk_of * chunk + within] = True
    return mask & (x != 0)


def sparse_quantize_segment(bits: SparseBits, chunk: int, x: np.ndarray, k: int | None = None,
                            mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Sparse-code values that start on a chunk boundary: the top ``k`` of each chunk, or (``mask``) exactly the
    entries where ``mask`` is True.

    Args:
        bits: the scheme; chunk: values per chunk; x: finite float32, 1-D (not checked here).
        k: entries kept per chunk (top by magnitude; equal magnitudes at the cut: any of them); or None with
            ``mask``.
        mask: bool, the shape of ``x``: keep these entries (the coordinator's update: its pushes' union).

    Returns:
        ``(scales, counts, records)``: one float32 scale and one u16 count per chunk, and the chunks' records.
    """
    b = SPARSE_BITS[bits]
    levels = (1 << b) - 1
    n = x.size
    n_chunks = _n_chunks(n, chunk)
    if mask is not None:
        flat = np.flatnonzero(mask)
        chunk_of, within = flat // chunk, flat % chunk
        counts = np.bincount(chunk_of, minlength=n_chunks).astype(np.int64)
        values = x[flat]
    else:
        assert k is not None
        chunk_of, within = _top_k(x, chunk, k)
        counts = np.bincount(chunk_of, minlength=n_chunks).astype(np.int64)
        values = x[chunk_of * chunk + within]
    mags = np.abs(values)
    scales = np.zeros(n_chunks, np.float32)
    np.maximum.at(scales, chunk_of, mags)
    scales = fit_scales(scales, chunk_of, mags, levels)
    s = scales[chunk_of]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s > 0, values / np.where(s > 0, s, 1), 0).astype(np.float64)
    codes = np.clip(np.rint((t * levels + levels) / 2), 0, levels).astype(np.uint8)
    return scales, counts.astype("<u2"), _pack(bits, chunk_of, within, codes, counts).tobytes()


FIT_ROUNDS: Final = 4  # Lloyd iterations of a chunk's scale (the error barely moves after 3)


def fit_scales(largest: np.ndarray, chunk_of: np.ndarray, mags: np.ndarray, levels: int,
               rounds: int = FIT_ROUNDS) -> np.ndarray:
    """Each chunk's scale s for the level magnitudes s·{1, 3, …, L}/L (L = ``levels``), fitted to its kept
    magnitudes by Lloyd's iterations from ``largest`` (the chunk's largest magnitude): each magnitude goes to its
    nearest level, then s becomes the least-squares scale of that assignment, Σ m·ℓ / Σ ℓ², capped at the largest
    magnitude (so s stays finite). Every step lowers the chunk's squared error, so it never exceeds that of
    s = largest (the scale before 2026-11, which wastes most codes on the inner level when the kept magnitudes are
    spread: for b = 2, a Gaussian chunk's top 2% at 0.40 relative error, fitted 0.14). float32, one per chunk."""
    s = largest.astype(np.float64)
    m = mags.astype(np.float64)
    for _ in range(rounds):
        sc = s[chunk_of]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(sc > 0, m / np.where(sc > 0, sc, 1) * levels, 0)
        ell = np.clip(2 * np.floor(t / 2) + 1, 1, levels) / levels  # the nearest level, in units of s
        num = np.bincount(chunk_of, weights=m * ell, minlength=s.size)
        den = np.bincount(chunk_of, weights=ell * ell, minlength=s.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(den > 0, np.minimum(num / np.where(den > 0, den, 1), largest), largest)
    return s.astype(np.float32)


def sparse_quantize(x: np.ndarray, bits: SparseBits, chunk: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    """A whole vector, top-k per chunk: ``(scales, payload)`` with payload = counts ‖ records (uint8). Works
    slab by slab (temporaries ~O(1M values))."""
    k = kept_per_chunk(density, chunk)
    slab = max(1, (1 << 20) // chunk) * chunk
    parts = [sparse_quantize_segment(bits, chunk, x[s:s + slab], k=k) for s in range(0, x.size, slab)]
    scales = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.float32)
    counts = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, "<u2")
    return scales, np.frombuffer(b"".join([counts.tobytes(), *(p[2] for p in parts)]), np.uint8)


# --------------------------------------------------------------------------- decoding

def _unpack(bits: SparseBits, counts: np.ndarray, records: np.ndarray | bytes | memoryview
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(chunk number, raw gaps, index within chunk, code, entry number in chunk) of every entry of the records of
    consecutive chunks with ``counts``. Not checked here."""
    b = SPARSE_BITS[bits]
    counts = counts.astype(np.int64)
    rec = np.frombuffer(records, np.uint8)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(record_len(b, counts)))])
    first_entry = np.concatenate([[0], np.cumsum(counts)])
    total = int(first_entry[-1])
    chunk_of = np.repeat(np.arange(counts.size), counts)
    local = np.arange(total, dtype=np.int64) - first_entry[:-1][chunk_of]
    base = offsets[:-1][chunk_of]
    pos = base + 2 * local
    gaps = rec[pos].astype(np.int64) | (rec[pos + 1].astype(np.int64) << 8)
    cums = np.cumsum(gaps)
    start_sum = np.concatenate([[0], cums])[first_entry[:-1]]  # Σ gaps before each chunk's first entry
    within = cums - start_sum[chunk_of]
    per = 8 // b
    codes = (rec[base + 2 * counts[chunk_of] + local // per] >> ((local % per) * b)) & ((1 << b) - 1)
    return chunk_of, gaps, within, codes, local


def _level_table(bits: SparseBits) -> np.ndarray:
    levels = (1 << SPARSE_BITS[bits]) - 1
    return ((2 * np.arange(levels + 1) - levels) / levels).astype(np.float32)


def sparse_add(bits: SparseBits, chunk: int, scales: np.ndarray, counts: np.ndarray,
               records: np.ndarray | bytes | memoryview, out: np.ndarray, weight: float | np.floating = 1.0) -> None:
    """``out += weight · values`` of consecutive chunks (checked: :class:`SparseChecker` accepted them).

    Args:
        bits, chunk: the scheme and chunk size. scales, counts: the chunks' scales and counts.
        records: their records, back to back. out: float32, the chunks' values (dense), updated in place.
        weight: the factor the values are scaled by.
    """
    factors = scales.astype(np.float32) * np.float32(weight)
    if counts.size and counts.min() == counts.max():  # every chunk holds k entries (an island's top-k): 2-D
        _add_regular(bits, chunk, int(counts[0]), factors, np.frombuffer(records, np.uint8), out)
        return
    chunk_of, _, within, codes, _ = _unpack(bits, counts, records)
    values = _level_table(bits)[codes] * factors[chunk_of]
    out[chunk_of * chunk + within] += values


def _add_regular(bits: SparseBits, chunk: int, k: int, factors: np.ndarray, rec: np.ndarray, out: np.ndarray) -> None:
    """:func:`sparse_add` where every chunk holds ``k`` entries: the records are rows of one (chunks x record)
    array, so gaps, indices and codes come from whole-array operations on it instead of per-entry gathers."""
    if k == 0:
        return
    b = SPARSE_BITS[bits]
    rows = rec.reshape(factors.size, int(record_len(b, k)))
    within = np.ascontiguousarray(rows[:, :2 * k]).view("<u2").astype(np.int64)  # the index gaps
    np.cumsum(within, axis=1, out=within)  # the indices within each chunk
    within += (np.arange(factors.size, dtype=np.int64) * chunk)[:, None]  # ... and in ``out``
    per = 8 // b
    packed = rows[:, 2 * k:]
    if per == 1:
        codes = packed
    else:  # entry j of a chunk: bits (j % per)·b of its byte j // per
        shifts = (np.arange(per, dtype=np.uint8) * b)[None, None, :]
        codes = ((packed[:, :, None] >> shifts) & ((1 << b) - 1)).reshape(factors.size, -1)[:, :k]
    out[within.ravel()] += (_level_table(bits)[codes] * factors[:, None]).ravel()


def sparse_dequantize(bits: SparseBits, chunk: int, n: int, scales: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """A whole checked vector's values: payload = counts ‖ records."""
    n_chunks = _n_chunks(n, chunk)
    counts = np.frombuffer(payload, "<u2", count=n_chunks)
    out = np.zeros(n, np.float32)
    sparse_add(bits, chunk, scales, counts, np.asarray(payload)[2 * n_chunks:], out)
    return out


class RecordChecker(abc.ABC):
    """What the sparse and mask checkers share: a payload's per-chunk records, fed in pieces, each run of whole
    records checked (:meth:`_check_records`) and handed to ``out`` as soon as it is complete; a partial record
    waits in ``_buf``. ``record_offsets[i]`` is where chunk i's record starts (n_chunks + 1 offsets, from any
    origin), ``_done`` the chunks already handed out."""

    out: object
    record_offsets: np.ndarray | None
    _buf: bytearray
    _done: int

    @abc.abstractmethod
    def _check_records(self, first: int, end: int, records: memoryview) -> None:
        """Checks chunks [first, end)'s whole records (raises CodecError for a bad one)."""

    def _feed_records(self, view: memoryview) -> None:
        """Adds ``view`` (record bytes) and passes on every record it completes, checked."""
        self._buf += view
        assert self.record_offsets is not None
        have = int(self.record_offsets[self._done]) + len(self._buf)
        end = int(np.searchsorted(self.record_offsets, have, side="right")) - 1
        if end > self._done:
            take = int(self.record_offsets[end] - self.record_offsets[self._done])
            self._check_records(self._done, end, memoryview(self._buf)[:take])
            self.out(bytes(self._buf[:take]))  # type: ignore[operator]
            del self._buf[:take]
            self._done = end


class SparseChecker(RecordChecker):
    """Checks a sparse body's payload (counts ‖ records) fed in pieces, and hands out each piece once checked.

    Args:
        bits, chunk, n: the frame's scheme, chunk size and length; payload_len: the payload's declared size.
        max_count: the most entries a chunk may hold (the receiver's density bound; the chunk size at most).
        scales: the frame's checked scales (for the sum of squares).
        out: the sink of checked bytes.

    :attr:`sum_squares`: Σ value² over what was checked (float64), :attr:`counts` the chunks' counts and
    :attr:`record_offsets` where each chunk's record starts in the payload (after the counts), once known.
    """

    def __init__(self, bits: SparseBits, chunk: int, n: int, payload_len: int, max_count: int,
                 scales: np.ndarray, out: object):
        self.bits, self.chunk, self.n = bits, chunk, n
        self.b = SPARSE_BITS[bits]
        self.n_chunks = _n_chunks(n, chunk)
        self.payload_len, self.max_count = payload_len, max_count
        self.scales_sq = np.square(scales.astype(np.float64))
        self.out = out
        self.levels_sq = np.square(_level_table(bits).astype(np.float64))
        self._head = bytearray()
        self.counts: np.ndarray | None = None
        self.record_offsets: np.ndarray | None = None  # n_chunks + 1 payload offsets
        self._buf = bytearray()
        self._done = 0  # chunks checked
        self.sum_squares = 0.0

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.counts is None:
            take = 2 * self.n_chunks - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < 2 * self.n_chunks:
                return
            self._check_counts()
            self.out(bytes(self._head))  # type: ignore[operator]
        if not view:
            return
        self._feed_records(view)

    def _check_counts(self) -> None:
        counts = np.frombuffer(bytes(self._head), "<u2").astype(np.int64)
        sizes = _sizes(self.n, self.chunk, 0, self.n_chunks)
        over = counts > np.minimum(sizes, self.max_count)
        if over.any():
            j = int(np.argmax(over))
            if counts[j] > sizes[j]:
                raise CodecError(f"chunk {j} claims {counts[j]} entries, more than its {sizes[j]} values")
            raise CodecError(f"chunk {j} holds {counts[j]} entries, above the {self.max_count} per chunk of "
                             f"{self.chunk} that the receiver allows (density "
                             f"{counts[j] / self.chunk:.4g} > {self.max_count / self.chunk:.4g})")
        offsets = 2 * self.n_chunks + np.concatenate([[0], np.cumsum(np.asarray(record_len(self.b, counts)))])
        if int(offsets[-1]) != self.payload_len:
            raise CodecError(f"the counts make a {int(offsets[-1])}-byte payload, the header declares "
                             f"{self.payload_len}")
        self.counts, self.record_offsets = counts, offsets

    def _check_records(self, first: int, end: int, records: memoryview) -> None:
        assert self.counts is not None
        counts = self.counts[first:end]
        chunk_of, gaps, within, codes, local = _unpack(self.bits, counts, records)
        dup = (gaps == 0) & (local > 0)
        if dup.any():
            i = int(np.argmax(dup))
            raise CodecError(f"chunk {first + int(chunk_of[i])}: duplicate index {int(within[i])} (a zero gap)")
        sizes = _sizes(self.n, self.chunk, first, end)
        out_of_range = within >= sizes[chunk_of]
        if out_of_range.any():
            i = int(np.argmax(out_of_range))
            raise CodecError(f"chunk {first + int(chunk_of[i])}: index {int(within[i])} out of range "
                             f"[0, {int(sizes[chunk_of[i]])}) (indices must be sorted and unique)")
        used = (counts * self.b) % 8
        has_pad = (used != 0) & (counts > 0)
        if has_pad.any():
            rec = np.frombuffer(records, np.uint8)
            last_byte = np.cumsum(np.asarray(record_len(self.b, counts)))[has_pad] - 1
            bad = (rec[last_byte] >> used[has_pad].astype(np.uint8)) != 0
            if bad.any():
                j = int(np.flatnonzero(has_pad)[int(np.argmax(bad))])
                raise CodecError(f"chunk {first + j}: padding bits after the last code must be 0")
        per_chunk = np.bincount(chunk_of, weights=self.levels_sq[codes], minlength=end - first)
        self.sum_squares += float(np.dot(per_chunk, self.scales_sq[first:end]))

    def finish(self) -> None:
        """Every chunk's record arrived and was checked. The checker then keeps only its layout (counts, record
        offsets) and the sum of squares."""
        if self.counts is None or self._done != self.n_chunks or self._buf:
            raise CodecError(f"sparse body truncated: {self._done} of {self.n_chunks} chunks complete")
        self.out = None  # the sink (a spool's method) is not held past the frame: no reference cycle

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_squares)
