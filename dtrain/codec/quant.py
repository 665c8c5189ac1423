"""Block quantization of a flat float32 vector, and error feedback.

Quantization schemes (``bits``; :data:`CODEC_BITS` maps the config's codec names to them)
------------------------------------------------------------------------------------------
The vector is cut into blocks of ``block`` values (an even number in
[64, 65536]; the last block may be partial). Each block has one float32 scale.

* ``8``: symmetric absmax int8. scale = absmax/127, q = round(x/scale) ∈ [-127, 127],
  one signed byte (two's complement) per value; the byte 0x80 (-128) is invalid.
* ``4``: symmetric absmax int4. scale = absmax/7, q ∈ [-7, 7], stored as a 4-bit
  two's complement nibble; nibble 0b1000 (-8) is invalid.
* ``"e3m0"``: 4-bit sign + 3-bit exponent. scale = absmax; nibble = s<<3 | e with
  e = 0 meaning zero and e ∈ 1..7 meaning ±scale·2^(e-7), i.e. magnitudes
  scale·{1, 1/2, …, 1/64}; the nearest level (linear distance) is chosen. Relative
  error ≤ 1/3 above scale/128, absolute error ≤ scale/128 below. Nibble 0b1000
  ("-0") is invalid.
* ``2``: 2-bit codes, four levels scaled by the block's RMS (clipping, not absmax): ``dtrain.codec.int2``,
  which also gives its packing. Its block must be a multiple of 4.
* ``32``: lossless; the payload is the raw float32 values (little endian) and
  there are no scales, so the same framing carries exact parameters.

Nibble order (both 4-bit schemes): value 2i is the LOW nibble of payload byte i,
value 2i+1 the HIGH nibble. When n is odd, the high nibble of the last byte is
padding and must be 0. Blocks are even-sized so every block starts on a byte.

Scales are float32, not float16: fp16 tops out at 65504 (a block with absmax
above ~8.3e6 overflows with int8) and, more importantly, its smallest subnormal
is ~6e-8, so late-training pseudo-gradients with absmax ~1e-6 would get a zero
scale and vanish. The cost is 4 bytes per block (0.4% of the int8 payload at
block 1024). int scales are rounded *up* so that |x|/scale ≤ qmax and no value
is clipped; they are also capped so that qmax·scale stays finite. Hence for
int8 and 4-bit: |x − dequantize(quantize(x))| ≤ scale/2 · (1 + 2e-5) + 2^-149
per value, an all-zero block has scale 0 and decodes to zeros, and NaN/Inf are
rejected on the way in (``CodecError``). :func:`check_scales` and
:func:`check_codes` reject whatever :func:`quantize` never produces (so a
checked payload can never dequantize to a non-finite value).

Whole vectors go through :func:`quantize` / :func:`dequantize`; the
coordinator's slab-wise outer step uses the segment functions
(:func:`quantize_segment`, :func:`dequantize_segment`, :func:`dequantize_add`)
on runs of whole blocks, with :func:`n_scales`, :func:`payload_len` and
:func:`payload_offset` to find them in a body. Error feedback
(:func:`error_feedback_step`, :class:`ErrorFeedback`) quantizes delta +
residual and keeps what quantization dropped for the next round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from dtrain.codec import int2
from dtrain.codec.masked import DESCRIPTOR_SIZE, MASK_BITS, has_records, mask_dequantize, mask_quantize
from dtrain.codec.sparse import MAX_CHUNK, SPARSE_BITS, is_sparse, kept_per_chunk, sparse_dequantize, sparse_quantize
from dtrain.codec.spec import CodecError

__all__ = [
    "CODEC_BITS",
    "DEFAULT_BLOCK",
    "MAX_BLOCK",
    "MIN_BLOCK",
    "Bits",
    "ErrorFeedback",
    "QuantizedVec",
    "canonical_bits",
    "check_block",
    "check_codes",
    "check_scales",
    "dequantize",
    "dequantize_add",
    "dequantize_segment",
    "error_feedback_step",
    "n_scales",
    "payload_len",
    "payload_offset",
    "quantize",
    "quantize_segment",
]

Bits = Literal[8, 4, 2, 32, "e3m0", "sparse2", "sparse4", "sparse8", "mask2"]

# The config's codec names (``codec.up`` / ``codec.down``) → quantization schemes: the one table of them.
CODEC_BITS: Final[Mapping[str, Bits]] = {"fp32": 32, "int8": 8, "int4": 4, "int2": 2, "e3m0": "e3m0"}
_CANONICAL_BITS: Final[dict[Any, Bits]] = {bits: bits for bits in (*CODEC_BITS.values(), *SPARSE_BITS, MASK_BITS)}

DEFAULT_BLOCK: Final = 1024
MIN_BLOCK: Final = 64
MAX_BLOCK: Final = 65536

QMAX: Final = {8: 127, 4: 7}
_F32_MAX: Final = float(np.finfo(np.float32).max)
_SLAB_VALUES: Final = 1 << 20  # quantize/dequantize this many values at a time: temporaries stay small

# E3M0 levels, as fractions of the block scale: index e = the 3-bit exponent field.
_E3M0_LEVELS: Final = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], np.float32)
_E3M0_MIDPOINTS: Final = ((_E3M0_LEVELS[:-1] + _E3M0_LEVELS[1:]) / 2).astype(np.float32)


def _largest_scale(qmax: int) -> np.float32:
    """Largest float32 scale with qmax·scale finite in float32 (so dequantized values never overflow)."""
    s = np.float32(_F32_MAX / qmax)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(qmax) * s):
            s = np.nextafter(s, np.float32(0))
    return s


SCALE_MAX: Final = {qmax: _largest_scale(qmax) for qmax in (127, 7)}
_BAD_NIBBLES: Final = np.array([(b & 0x0F) == 8 or (b >> 4) == 8 for b in range(256)])  # 4-bit schemes' -8 / "-0"
# int4: a payload byte → its two levels (low nibble first) as int8: one table gather instead of unpacking the nibbles
# and converting them (2.7x faster).
_INT4_LEVELS: Final = np.array([[((b & 0x0F) ^ 8) - 8, ((b >> 4) ^ 8) - 8] for b in range(256)], np.int8)


def canonical_bits(bits: Any) -> Bits:
    """``bits`` as one of 8, 4, 2, 32, "e3m0", "sparse2", "sparse4", "sparse8", "mask2" (e.g. 8.0 → 8);
    CodecError for anything else."""
    try:
        return _CANONICAL_BITS[bits]
    except (KeyError, TypeError):
        raise CodecError(f"bits must be one of 8, 4, 2, 32, 'e3m0', 'sparse2', 'sparse4', 'sparse8', 'mask2'; "
                         f"got {bits!r}") from None


def check_block(block: Any) -> int:
    """``block`` as an int, or CodecError unless it is even and in [MIN_BLOCK, MAX_BLOCK]."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise CodecError(f"block must be an int, got {block!r}")
    block = int(block)
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise CodecError(f"block {block} out of range [{MIN_BLOCK}, {MAX_BLOCK}]")
    if block % 2:
        raise CodecError(f"block {block} must be even (4-bit blocks must start on a byte)")
    return block


def n_scales(bits: Bits, n: int, block: int) -> int:
    """How many float32 scales ``n`` values have: one per block (a sparse scheme's chunk; none for the lossless
    32)."""
    return 0 if bits == 32 else -(-n // block)


def payload_len(bits: Bits, n: int) -> int:
    """Payload bytes of ``n`` values: n (int8), ceil(n/2) (4-bit schemes), ceil(n/4) (2-bit), 4n (32); sparse
    schemes have no fixed size (CodecError)."""
    if has_records(bits):
        raise CodecError(f"a {bits} payload's size depends on its counts, not on n alone")
    return {8: n, 4: (n + 1) // 2, "e3m0": (n + 1) // 2, 2: (n + 3) // 4, 32: 4 * n}[bits]


def payload_offset(bits: Bits, value_index: int) -> int:
    """Byte offset in the payload of a value index that starts a block (blocks are even: byte-aligned)."""
    return {8: value_index, 4: value_index // 2, "e3m0": value_index // 2, 2: value_index // 4,
            32: 4 * value_index}[bits]


@dataclass(frozen=True, eq=False)
class QuantizedVec:
    """A quantized float32 vector: what a frame carries.

    ``scales``: float32, one per block (empty for bits=32, where ``block`` is
    carried but unused). ``payload``: uint8, the codes laid out as described in
    the module docstring. Arrays coming from ``dtrain.codec.decode`` are
    read-only views of the decompressed body.
    """

    bits: Bits
    block: int
    n: int
    scales: np.ndarray
    payload: np.ndarray

    def __post_init__(self) -> None:
        canonical_bits(self.bits)
        check_block(self.block)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise CodecError(f"n must be a non-negative int, got {self.n!r}")
        if is_sparse(self.bits) and self.block > MAX_CHUNK:
            raise CodecError(f"a sparse chunk holds at most {MAX_CHUNK} values, got {self.block}")
        if self.bits == 2 and (why := int2.check_block(self.block)):
            raise CodecError(why)
        want_scales = n_scales(self.bits, self.n, self.block)
        # sparse: at least the counts (u16 per chunk), mask: its seed and density; the frame reader checks the rest
        want_payload = 2 * want_scales if is_sparse(self.bits) else DESCRIPTOR_SIZE if self.bits == MASK_BITS else \
            payload_len(self.bits, self.n)
        if has_records(self.bits) and self.payload.dtype == np.uint8 \
                and self.payload.ndim == 1 and self.payload.size >= want_payload:
            want_payload = self.payload.size
        if self.scales.dtype != np.float32 or self.scales.shape != (want_scales,):
            raise CodecError(f"scales must be float32 of shape ({want_scales},), "
                             f"got {self.scales.dtype} {self.scales.shape}")
        if self.payload.dtype != np.uint8 or self.payload.shape != (want_payload,):
            raise CodecError(f"payload must be uint8 of shape ({want_payload},), "
                             f"got {self.payload.dtype} {self.payload.shape}")

    @property
    def nbytes(self) -> int:
        """Uncompressed body size: scales + payload bytes."""
        return int(self.scales.nbytes + self.payload.nbytes)


def _int_scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """absmax/qmax as float32, rounded up (so |x|/scale ≤ qmax) and capped (so qmax·scale is finite)."""
    exact = absmax.astype(np.float64) / qmax
    scale = exact.astype(np.float32)
    scale = np.where(scale.astype(np.float64) < exact, np.nextafter(scale, np.float32(np.inf)), scale)
    return np.minimum(scale, SCALE_MAX[qmax]).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes in 0..15, even length → bytes: code 2i in the low nibble, 2i+1 in the high one."""
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    return codes[:count]


def _int4_levels(packed: np.ndarray, count: int) -> np.ndarray:
    """The int8 levels (-8..7) of the first ``count`` values of a packed int4 payload."""
    return np.take(_INT4_LEVELS, packed, axis=0).reshape(-1)[:count]


def quantize_segment(bits: Bits, block: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize values that start on a block boundary (a run of whole blocks, the last one maybe partial).

    Args:
        bits: the scheme (8, 4, 32 or "e3m0"; already canonical, :func:`canonical_bits`).
        block: values per block (already checked, :func:`check_block`).
        x: the values, finite float32, 1-D (not checked here: :func:`quantize` checks).

    Returns:
        ``(scales, payload)``: float32 scales, one per block (empty for 32), and the uint8 payload bytes of
        ``x.size`` values, laid out as in the module docstring.
    """
    count = x.size
    if has_records(bits):
        raise CodecError(f"{bits} codes by chunks: sparse_quantize_segment or mask_quantize_segment codes it")
    if bits == 32:
        return np.empty(0, np.float32), x.astype("<f4").view(np.uint8)
    if bits == 2:
        return int2.quantize_segment(block, x)
    n_blocks = -(-count // block)
    if n_blocks * block != count:  # only the last segment has a partial block: pad it with zeros
        x = np.concatenate([x, np.zeros(n_blocks * block - count, np.float32)])
    x_BxK = x.reshape(n_blocks, block)
    absmax_B = np.max(np.abs(x_BxK), axis=1)
    nonzero_Bx1 = (absmax_B > 0)[:, None]
    if bits == "e3m0":
        scale_B = absmax_B.astype(np.float32)
        ratio_BxK = np.divide(np.abs(x_BxK), scale_B[:, None], out=np.zeros_like(x_BxK), where=nonzero_Bx1)
        exponent = np.searchsorted(_E3M0_MIDPOINTS, ratio_BxK.ravel()).astype(np.uint8)  # nearest level
        codes = exponent | (((x_BxK.ravel() < 0) & (exponent > 0)).astype(np.uint8) << 3)
        return scale_B, _pack_nibbles(codes)[:(count + 1) // 2]
    qmax = QMAX[bits]
    scale_B = _int_scales(absmax_B, qmax)
    # x · (1/scale): one multiply pass instead of a masked divide. The reciprocal may round down by half an
    # ulp, so |x|·inv can exceed qmax by ~1e-5 at most: rint still gives qmax, and the clip guarantees it.
    with np.errstate(over="ignore", invalid="ignore"):  # inf (subnormal scale) · 0 = nan: those rows are redone
        inv_B = np.divide(np.float32(1), scale_B, out=np.zeros_like(scale_B), where=scale_B > 0)
        q_BxK = np.multiply(x_BxK, inv_B[:, None])
    tiny = np.flatnonzero(np.isinf(inv_B))  # subnormal scales (1/scale overflows): divide those rows exactly
    if tiny.size:
        q_BxK[tiny] = x_BxK[tiny] / scale_B[tiny, None]
    np.rint(q_BxK, out=q_BxK)
    np.clip(q_BxK, -qmax, qmax, out=q_BxK)
    q = q_BxK.astype(np.int8).ravel()
    if bits == 8:
        return scale_B, q.view(np.uint8)[:count]
    return scale_B, _pack_nibbles(q.view(np.uint8) & 0x0F)[:(count + 1) // 2]


def dequantize_segment(bits: Bits, block: int, scales: np.ndarray, payload: np.ndarray, count: int) -> np.ndarray:
    """The inverse of :func:`quantize_segment`.

    Args:
        bits, block: the scheme and block size the segment was quantized with.
        scales: the segment's float32 scales, one per block (empty for 32).
        payload: the segment's uint8 payload bytes (:func:`payload_len` of ``count`` values), already checked
            (:func:`check_codes`).
        count: how many values the segment holds.

    Returns:
        A fresh float32 array of the ``count`` values.
    """
    if bits == 32:
        return payload.view("<f4").astype(np.float32)
    scale_per_value = np.repeat(scales, block)[:count]
    if bits == 8:
        return payload.view(np.int8).astype(np.float32) * scale_per_value
    if bits == 4:
        return _int4_levels(payload, count).astype(np.float32) * scale_per_value  # 4-bit two's complement
    if bits == 2:
        return int2.levels(payload, count) * scale_per_value
    codes = _unpack_nibbles(payload, count)
    magnitude = _E3M0_LEVELS[codes & 7] * scale_per_value
    return np.where(codes & 8, -magnitude, magnitude)


def check_scales(bits: Bits, scales: np.ndarray, first_block: int) -> None:
    """Scales (of blocks ``first_block``, …) are finite, ≥ 0 and small enough that qmax·scale is finite."""
    limit = np.float32(_F32_MAX) if bits == "e3m0" or is_sparse(bits) else \
        int2.SCALE_MAX if bits == 2 or bits == MASK_BITS else SCALE_MAX[QMAX[bits]]
    bad = ~(np.isfinite(scales) & (scales >= 0) & (scales <= limit))
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError(f"invalid scale {scales[i]!r} for block {first_block + i}")


def check_codes(bits: Bits, payload: np.ndarray | bytes | bytearray | memoryview, first_value: int) -> None:
    """Payload bytes (starting at value ``first_value``; for 32 bits, whole float32s) hold no invalid code."""
    if bits == 8:
        if isinstance(payload, bytes):  # the one invalid byte: a memchr, no temporary
            i = payload.find(b"\x80")
        else:  # -128 is the least int8: one SIMD min, no temporary, and a search only when it is there
            codes = np.frombuffer(payload, np.int8)
            i = int(np.argmax(codes == -128)) if codes.size and codes.min() == -128 else -1
        if i >= 0:
            raise CodecError(f"invalid int8 code -128 near value {first_value + i}")
        return
    if bits == 2:  # every 2-bit code is a level (the padding is checked at the frame's end)
        return
    arr = np.frombuffer(payload, np.uint8)
    if bits == 32:
        bad = ~np.isfinite(arr.view("<f4"))
        if bad.any():
            raise CodecError(f"lossless payload holds a non-finite value at index {first_value + int(np.argmax(bad))}")
        return
    bad = _BAD_NIBBLES[arr]
    if bad.any():
        raise CodecError(f"invalid nibble 0b1000 near value {first_value + 2 * int(np.argmax(bad))}")


def dequantize_add(bits: Bits, block: int, scales: np.ndarray, payload: np.ndarray, out: np.ndarray,
                   weight: float | np.floating = 1.0, scratch: np.ndarray | None = None) -> None:
    """``out += weight · values``: a segment's values (whole blocks from a block boundary) added in place, without
    a per-value scale array (int8 and int4: one multiply per block row). The coordinator's outer step sums its
    admitted deltas this way, slab by slab.

    Args:
        bits, block: the scheme and block size of the segment.
        scales, payload: its float32 scales and uint8 payload bytes, already checked (a body that
            ``FrameValidator`` accepted).
        out: float32, one entry per value of the segment (its size is the segment's value count); updated in place.
        weight: the factor the values are scaled by.
        scratch: optional float32 workspace of at least ``out.size`` values (int8, int4), reused across calls.

    Returns:
        None; ``out`` holds the sum.
    """
    count = out.size
    w = np.float32(weight)
    if bits == 32:
        values = payload.view("<f4")[:count]
        out += values if w == 1 else values * w
        return
    scales = scales if w == 1 else scales * w
    if bits in ("e3m0", 2):
        out += dequantize_segment(bits, block, scales, payload, count)
        return
    # int8 and int4: integer levels times their block's scale, one multiply per block row (no per-value scale
    # array); the same float32 products as dequantize_segment's.
    # The codes are cast to float32 first (an exact, unbuffered cast) and scaled in place: a mixed int8 x float32
    # multiply goes through numpy's buffered casting loop, which also copies the broadcast scale into its buffers
    # (a third more CPU for the merge's sum).
    codes = payload.view(np.int8) if bits == 8 else _int4_levels(payload, count)
    full = count // block
    if full:
        rows = out[:full * block].reshape(full, block)
        tmp = (np.empty(full * block, np.float32) if scratch is None else scratch[:full * block]).reshape(full, block)
        np.copyto(tmp, codes[:full * block].reshape(full, block), casting="unsafe")  # int8 -> float32: exact
        tmp *= scales[:full, None]
        rows += tmp
    if count > full * block:
        out[full * block:] += codes[full * block:count].astype(np.float32) * scales[full]


def _blocks_per_slab(block: int) -> int:
    return max(1, _SLAB_VALUES // block)


def quantize(vec: Any, bits: Bits = 8, block: int = DEFAULT_BLOCK, density: float = 0.02,
             seed: int = 0) -> QuantizedVec:
    """Block-quantize a whole vector: the encoder's first half (:func:`dtrain.codec.encode` frames the result).

    Args:
        vec: a 1-D vector of any array-like (converted with ``np.asarray(vec, np.float32)``).
        bits: the scheme: 8, 4, 32 (lossless) or "e3m0" (:data:`CODEC_BITS` maps the config's names to them).
        block: values per block (even, in [MIN_BLOCK, MAX_BLOCK]); a sparse scheme's chunk (at most MAX_CHUNK).
        density: sparse schemes only: the fraction of each chunk kept (``dtrain.codec.sparse.kept_per_chunk``);
            mask2: the mask's density (``dtrain.codec.masked``).
        seed: mask2 only: the mask's seed (the round's version).

    Returns:
        The :class:`QuantizedVec` of ``vec``: one float32 scale per block and the packed codes (sparse: the
        counts and records, ``dtrain.codec.sparse``).

    Raises:
        CodecError: NaN/Inf in ``vec`` (naming the first index), a non-1-D input, or bad ``bits``/``block``.

    Works slab by slab, so temporaries stay ~O(1M values).
    """
    bits, block = canonical_bits(bits), check_block(block)
    x = np.asarray(vec, dtype=np.float32)
    if x.ndim != 1:
        raise CodecError(f"quantize takes a 1-D vector, got shape {x.shape}")
    n = x.size
    slab = _blocks_per_slab(block) * block
    scales, payloads = [], []
    for start in range(0, n, slab):
        segment = x[start:start + slab]
        finite = np.isfinite(segment)
        if not finite.all():
            index = start + int(np.argmin(finite))
            raise CodecError(f"non-finite value {x[index]} at index {index}: refusing to encode NaN/Inf")
        if has_records(bits):
            continue
        s, p = quantize_segment(bits, block, segment)
        scales.append(s)
        payloads.append(p)
    if bits == MASK_BITS:
        sc, payload = mask_quantize(x, block, seed, density)
        return QuantizedVec(bits=bits, block=block, n=n, scales=sc, payload=payload)
    if is_sparse(bits):
        if block > MAX_CHUNK:
            raise CodecError(f"a sparse chunk holds at most {MAX_CHUNK} values, got {block}")
        kept_per_chunk(density, block)  # checks the density
        sc, payload = sparse_quantize(x, bits, block, density)
        return QuantizedVec(bits=bits, block=block, n=n, scales=sc, payload=payload)
    return QuantizedVec(
        bits=bits, block=block, n=n,
        scales=np.concatenate(scales) if scales else np.empty(0, np.float32),
        payload=np.concatenate(payloads) if payloads else np.empty(0, np.uint8))


def dequantize(q: QuantizedVec) -> np.ndarray:
    """The decoder's second half (after :func:`dtrain.codec.decode`): the values a quantized vector stands for.

    Args:
        q: the quantized vector (checked: :func:`dtrain.codec.decode` validates every scale and code).

    Returns:
        A fresh float32 array of length ``q.n``.
    """
    if is_sparse(q.bits):
        return sparse_dequantize(q.bits, q.block, q.n, q.scales, q.payload)
    if q.bits == MASK_BITS:
        return mask_dequantize(q.block, q.n, q.scales, q.payload)
    out = np.empty(q.n, np.float32)
    slab_blocks = _blocks_per_slab(q.block)
    slab = slab_blocks * q.block
    for b0, start in enumerate(range(0, q.n, slab)):
        count = min(slab, q.n - start)
        p0 = payload_offset(q.bits, start)
        scales = q.scales[b0 * slab_blocks:(b0 + 1) * slab_blocks]
        out[start:start + count] = dequantize_segment(q.bits, q.block, scales,
                                                      q.payload[p0:p0 + payload_len(q.bits, count)], count)
    return out


def error_feedback_step(delta: Any, residual: np.ndarray, bits: Bits = 8, block: int = DEFAULT_BLOCK,
                        decay: float = 1.0, density: float = 0.02, seed: int = 0) -> tuple[QuantizedVec, np.ndarray]:
    """Pure error feedback: quantize delta + decay·residual; the new residual is what quantization dropped.

    Summed over rounds, Σ dequantize(q_t) = Σ delta_t − residual_T, so the
    transmitted sum trails the true sum by one round's quantization error at
    most instead of accumulating it.

    Args:
        delta: this round's 1-D delta (converted to float32).
        residual: float32, the shape of ``delta``: what earlier rounds' quantization dropped. Its buffer is not
            modified (the new residual is a fresh array).
        bits, block, density, seed: the scheme, block size (sparse, mask: chunk), density and seed (mask), as in
            :func:`quantize`.
        decay: β, the factor the residual is carried with (1: plain error feedback; below 1: SparseLoCo's
            accumulator, e ← β·e + Δ, which lets old, unsent mass fade).

    Returns:
        ``(q, new_residual)``: the quantized ``delta + decay·residual`` and what its quantization dropped
        (with a sparse scheme: everything not sent, exactly, plus the kept values' rounding).

    Raises:
        CodecError: shapes that differ, or what :func:`quantize` raises (NaN/Inf); then nothing changes.
    """
    delta = np.asarray(delta, dtype=np.float32)
    if delta.shape != residual.shape:
        raise CodecError(f"delta has shape {delta.shape}, residual has shape {residual.shape}")
    corrected = delta + residual if decay == 1 else delta + residual * np.float32(decay)
    q = quantize(corrected, bits, block, density, seed)
    new_residual = np.subtract(corrected, dequantize(q), out=corrected)  # reuse the buffer
    return q, new_residual


class ErrorFeedback:
    """Holds an island's float32 residual (kept across rounds) and applies :func:`error_feedback_step`.

    Args:
        n: the vector's length (the model's parameter count).
        bits, block, density: the scheme, block size and (sparse) density every round is quantized with, as in
            :func:`quantize`.
        decay: β of :func:`error_feedback_step` (1: plain error feedback).

    Raises:
        CodecError: bad ``bits``, ``block``, ``density`` or ``decay``.
    """

    def __init__(self, n: int, bits: Bits = 8, block: int = DEFAULT_BLOCK, decay: float = 1.0,
                 density: float = 0.02):
        self.bits: Bits = canonical_bits(bits)
        self.block = check_block(block)
        if not 0 < decay <= 1:
            raise CodecError(f"error-feedback decay must be in (0, 1], got {decay!r}")
        if has_records(self.bits):
            kept_per_chunk(density, self.block)
        self.decay, self.density = float(decay), float(density)
        self.residual = np.zeros(n, np.float32)

    def compress(self, delta_vec: Any, seed: int = 0) -> QuantizedVec:
        """Quantizes ``delta_vec`` (1-D, length ``n``) plus the residual and keeps what was dropped as the new
        residual; returns the :class:`QuantizedVec` to frame. ``seed``: mask2's (the version the delta was trained
        from). On CodecError (NaN/Inf, a wrong length) the residual is unchanged."""
        q, self.residual = error_feedback_step(delta_vec, self.residual, self.bits, self.block, self.decay,
                                               self.density, seed)
        return q

    def reset(self) -> None:
        """Forgets the residual (zeros it in place)."""
        self.residual[:] = 0
