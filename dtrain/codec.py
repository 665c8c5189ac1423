"""The delta codec: tree flattening, block quantization, error feedback, zstd frames, chunks.

Everything here is pure numpy + zstandard: no JAX, no pickle. Inputs are
anything ``np.asarray`` accepts (JAX arrays are copied to the host).

Pipeline on an island, per round::

    spec, delta_vec = flatten(delta_tree)           # one float32 vector + its layout
    q = error_feedback.compress(delta_vec)          # block-quantize delta + residual
    frame = encode(q)                               # header + zstd(scales ‖ payload)
    chunks = split_chunks(frame)                    # streamed, one CRC32 per chunk

and on the coordinator either ``ChunkAssembler`` → ``decode`` → ``dequantize``,
or, to keep memory O(model), ``ChunkVerifier`` + ``StreamingDecoder``, which
hands out dequantized segments block by block.

Quantization schemes (``bits``)
-------------------------------
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
rejected on the way in (``CodecError``) and can never come out of ``decode``.

Frame layout (all integers little endian)
-----------------------------------------
::

    offset size  field
     0      4    magic        b"DTRC"
     4      1    version      u8, currently 1
     5      1    bits code    u8: 8, 4, 32, or 0xE3 for "e3m0"
     6      2    reserved     u16, must be 0
     8      4    block        u32, even, in [64, 65536]
    12      8    n            u64, number of values
    20      8    scales_len   u64, bytes of scales = 4·ceil(n/block) (0 for bits=32)
    28      8    payload_len  u64, bytes of payload = n (int8), ceil(n/2) (4-bit), 4n (bits=32)
    36      8    body_len     u64, bytes of compressed body following the header
    44      4    crc32        u32, zlib CRC32 of header bytes [0, 44) followed by the body
    48   body_len body        one zstd frame; decompresses to exactly
                              scales (float32 LE, one per block, in order) ‖ payload

The frame is exactly 48 + body_len bytes. Scales come first so a streaming
decoder can hold them (n/block floats) and then dequantize the payload block by
block as it arrives. ``decode`` checks, in this order: length ≥ header, magic,
version, reserved, bits, block, n (against ``expected_n`` if given), the two
lengths against n/block/bits, truncation / trailing bytes against body_len, the
CRC32, a decompression bounded by scales_len + payload_len (a "zip bomb" that
expands beyond it is stopped after at most one ~128 KiB output piece), the
exact decompressed size, and finally the values (scales finite, ≥ 0 and small
enough that dequantized values stay finite; no invalid codes or padding).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import zstandard

__all__ = [
    "DEFAULT_BLOCK",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BLOCK",
    "MIN_BLOCK",
    "Bits",
    "Chunk",
    "ChunkAssembler",
    "ChunkVerifier",
    "CodecError",
    "ErrorFeedback",
    "FrameValidator",
    "QuantizedVec",
    "Spec",
    "StreamingDecoder",
    "compression_ratio",
    "crc32_combine",
    "decode",
    "dequantize",
    "encode",
    "error_feedback_step",
    "flatten",
    "quantize",
    "spec_digest",
    "spec_size",
    "split_chunks",
    "unflatten",
]


class CodecError(ValueError):
    """Anything wrong with a tree, a vector, a frame or a chunk; the message names the problem."""


Bits = Literal[8, 4, 32, "e3m0"]
Spec = list[list[Any]]  # [[path: str, shape: list[int], dtype: str], ...], JSON-native

MAGIC: Final = b"DTRC"
FORMAT_VERSION: Final = 1
DEFAULT_BLOCK: Final = 1024
MIN_BLOCK: Final = 64
MAX_BLOCK: Final = 65536

_HEADER: Final = struct.Struct("<4sBBHIQQQQI")
HEADER_SIZE: Final = _HEADER.size  # 48
_CRC_OFFSET: Final = HEADER_SIZE - 4  # the CRC covers header bytes [0, 44) and the body

_BITS_CODE: Final[dict[Any, int]] = {8: 8, 4: 4, 32: 32, "e3m0": 0xE3}
_CODE_BITS: Final[dict[int, Bits]] = {8: 8, 4: 4, 32: 32, 0xE3: "e3m0"}
_QMAX: Final = {8: 127, 4: 7}

_F32_MAX: Final = float(np.finfo(np.float32).max)
_SLAB_VALUES: Final = 1 << 20  # quantize/dequantize this many values at a time: temporaries stay small
_FEED_SLICE: Final = 1 << 16  # StreamingDecoder pushes compressed input to zstd in slices of this size

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


_SCALE_MAX: Final = {qmax: _largest_scale(qmax) for qmax in (127, 7)}
_BAD_NIBBLES: Final = np.array([(b & 0x0F) == 8 or (b >> 4) == 8 for b in range(256)])  # 4-bit schemes' -8 / "-0"


# --------------------------------------------------------------------------- trees

_INT_COMPONENT = re.compile(r"0|[1-9][0-9]*")
_LEAF_DTYPES: Final = ("float32", "float16", "bfloat16")  # all exactly representable in float32


def _render_key(key: Any, where: str) -> str:
    """A dict key as a path component: ints (nnx.List indices) as decimals, strings as themselves."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise CodecError(f"key {key!r} under {where!r}: keys must be str or non-negative int")
    if isinstance(key, int):
        if key < 0:
            raise CodecError(f"key {key} under {where!r}: integer keys must be non-negative")
        return str(key)
    if not key or "/" in key:
        raise CodecError(f"key {key!r} under {where!r}: string keys must be non-empty and contain no '/'")
    if _INT_COMPONENT.fullmatch(key):
        raise CodecError(f"key {key!r} under {where!r}: a decimal string key would read back as an int")
    return key


def _sort_key(key: Any) -> tuple[int, Any]:
    return (0, key) if isinstance(key, int) and not isinstance(key, bool) else (1, str(key))


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; a JAX dependency)
    return np.dtype(name)


def _collect(node: Mapping, prefix: str, out: list[tuple[str, np.ndarray]]) -> None:
    for key in sorted(node, key=_sort_key):
        path = f"{prefix}/{_render_key(key, prefix or '/')}" if prefix else _render_key(key, "/")
        value = node[key]
        if isinstance(value, Mapping):
            _collect(value, path, out)
            continue
        leaf = np.asarray(value)
        if leaf.dtype.name not in _LEAF_DTYPES:
            raise CodecError(f"leaf {path!r} has dtype {leaf.dtype.name}; only {', '.join(_LEAF_DTYPES)} "
                             "travel exactly as float32")
        out.append((path, leaf))


def flatten(tree: Mapping) -> tuple[Spec, np.ndarray]:
    """A nested dict of arrays → (spec, one contiguous float32 vector).

    Keys are visited in sorted order (int keys numerically, before str keys),
    so equal trees give equal specs on every host. ``spec`` is a JSON-native
    list of ``[path, shape, dtype]`` with paths like ``"blocks/0/attn/qkv/kernel"``.
    Leaves must be float32, float16 or bfloat16 (float64 would lose bits
    silently and is refused). Empty sub-dicts carry no leaves and vanish.
    """
    if not isinstance(tree, Mapping):
        raise CodecError(f"tree must be a nested dict of arrays, got {type(tree).__name__}")
    leaves: list[tuple[str, np.ndarray]] = []
    _collect(tree, "", leaves)
    spec: Spec = [[path, [int(d) for d in leaf.shape], leaf.dtype.name] for path, leaf in leaves]
    vec = np.empty(sum(leaf.size for _, leaf in leaves), np.float32)
    offset = 0
    for _, leaf in leaves:
        vec[offset:offset + leaf.size] = leaf.reshape(-1)
        offset += leaf.size
    return spec, vec


def _parse_spec(spec: Any) -> list[tuple[list[str | int], tuple[int, ...], str]]:
    """Validate a spec (it may come off the wire) and split its paths into keys."""
    if not isinstance(spec, (list, tuple)):
        raise CodecError(f"spec must be a list of [path, shape, dtype], got {type(spec).__name__}")
    parsed = []
    for i, entry in enumerate(spec):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise CodecError(f"spec entry {i} must be [path, shape, dtype], got {entry!r}")
        path, shape, dtype = entry
        if not isinstance(path, str) or not path or any(not c for c in path.split("/")):
            raise CodecError(f"spec entry {i}: bad path {path!r}")
        if not isinstance(shape, (list, tuple)) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise CodecError(f"spec entry {i} ({path}): bad shape {shape!r}")
        if dtype not in _LEAF_DTYPES:
            raise CodecError(f"spec entry {i} ({path}): unsupported dtype {dtype!r}")
        keys = [int(c) if _INT_COMPONENT.fullmatch(c) else c for c in path.split("/")]
        parsed.append((keys, tuple(shape), dtype))
    return parsed


def _leaf_size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def spec_size(spec: Spec) -> int:
    """How many values the flat vector of a (validated) spec holds."""
    return sum(_leaf_size(shape) for _, shape, _ in _parse_spec(spec))


def unflatten(spec: Spec, vec: Any) -> dict:
    """Inverse of :func:`flatten`: rebuild the nested dict (decimal path components become int keys).

    float32 leaves are reshaped *views* into ``vec`` (no copy); float16/bfloat16
    leaves are cast copies. Raises CodecError if the spec is malformed, paths
    collide, or ``len(vec)`` differs from the spec's total size.
    """
    entries = _parse_spec(spec)
    vec = np.asarray(vec)
    if vec.ndim != 1 or vec.dtype != np.float32:
        raise CodecError(f"vec must be a 1-D float32 array, got shape {vec.shape} dtype {vec.dtype}")
    total = sum(_leaf_size(shape) for _, shape, _ in entries)
    if vec.size != total:
        raise CodecError(f"vec has {vec.size} values but the spec describes {total}")
    root: dict = {}
    offset = 0
    for keys, shape, dtype in entries:
        size = _leaf_size(shape)
        leaf = vec[offset:offset + size].reshape(shape)
        offset += size
        if dtype != "float32":
            leaf = leaf.astype(_np_dtype(dtype))
        node = root
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CodecError(f"spec path {'/'.join(map(str, keys))!r} runs through the leaf "
                                 f"{'/'.join(map(str, keys[:depth + 1]))!r}")
        if keys[-1] in node:
            raise CodecError(f"spec path {'/'.join(map(str, keys))!r} appears twice or collides with a subtree")
        node[keys[-1]] = leaf
    return root


def spec_digest(spec: Spec, length: int = 16) -> str:
    """First ``length`` hex digits of sha256(canonical JSON of spec): compare tree layouts across the wire."""
    canonical = json.dumps(spec, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


# --------------------------------------------------------------------------- quantization

def _canonical_bits(bits: Any) -> Bits:
    try:
        return _CODE_BITS[_BITS_CODE[bits]]
    except (KeyError, TypeError):
        raise CodecError(f"bits must be one of 8, 4, 32, 'e3m0'; got {bits!r}") from None


def _check_block(block: Any) -> int:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise CodecError(f"block must be an int, got {block!r}")
    block = int(block)
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise CodecError(f"block {block} out of range [{MIN_BLOCK}, {MAX_BLOCK}]")
    if block % 2:
        raise CodecError(f"block {block} must be even (4-bit blocks must start on a byte)")
    return block


def _n_scales(bits: Bits, n: int, block: int) -> int:
    return 0 if bits == 32 else -(-n // block)


def _payload_len(bits: Bits, n: int) -> int:
    return {8: n, 4: (n + 1) // 2, "e3m0": (n + 1) // 2, 32: 4 * n}[bits]


@dataclass(frozen=True, eq=False)
class QuantizedVec:
    """A quantized float32 vector: what a frame carries.

    ``scales``: float32, one per block (empty for bits=32, where ``block`` is
    carried but unused). ``payload``: uint8, the codes laid out as described in
    the module docstring. Arrays coming from
    :func:`decode` are read-only views of the decompressed body.
    """

    bits: Bits
    block: int
    n: int
    scales: np.ndarray
    payload: np.ndarray

    def __post_init__(self) -> None:
        _canonical_bits(self.bits)
        _check_block(self.block)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise CodecError(f"n must be a non-negative int, got {self.n!r}")
        n_scales, n_payload = _n_scales(self.bits, self.n, self.block), _payload_len(self.bits, self.n)
        if self.scales.dtype != np.float32 or self.scales.shape != (n_scales,):
            raise CodecError(f"scales must be float32 of shape ({n_scales},), "
                             f"got {self.scales.dtype} {self.scales.shape}")
        if self.payload.dtype != np.uint8 or self.payload.shape != (n_payload,):
            raise CodecError(f"payload must be uint8 of shape ({n_payload},), "
                             f"got {self.payload.dtype} {self.payload.shape}")

    @property
    def nbytes(self) -> int:
        """Uncompressed body size: scales + payload bytes."""
        return self.scales.nbytes + self.payload.nbytes


def _int_scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """absmax/qmax as float32, rounded up (so |x|/scale ≤ qmax) and capped (so qmax·scale is finite)."""
    exact = absmax.astype(np.float64) / qmax
    scale = exact.astype(np.float32)
    scale = np.where(scale.astype(np.float64) < exact, np.nextafter(scale, np.float32(np.inf)), scale)
    return np.minimum(scale, _SCALE_MAX[qmax]).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes in 0..15, even length → bytes: code 2i in the low nibble, 2i+1 in the high one."""
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    return codes[:count]


def _quantize_segment(bits: Bits, block: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize values that start on a block boundary → (scales, payload bytes). x: finite float32."""
    count = x.size
    if bits == 32:
        return np.empty(0, np.float32), x.astype("<f4").view(np.uint8)
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
    qmax = _QMAX[bits]
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


def _dequantize_segment(bits: Bits, block: int, scales: np.ndarray, payload: np.ndarray, count: int) -> np.ndarray:
    """``count`` float32 values from the scales and payload bytes of whole blocks (last one maybe partial)."""
    if bits == 32:
        return payload.view("<f4").astype(np.float32)
    scale_per_value = np.repeat(scales, block)[:count]
    if bits == 8:
        return payload.view(np.int8).astype(np.float32) * scale_per_value
    codes = _unpack_nibbles(payload, count)
    if bits == 4:
        return ((codes ^ 8).astype(np.int8) - 8).astype(np.float32) * scale_per_value  # 4-bit two's complement
    magnitude = _E3M0_LEVELS[codes & 7] * scale_per_value
    return np.where(codes & 8, -magnitude, magnitude)


def _check_segment(bits: Bits, block: int, scales: np.ndarray, payload: np.ndarray, count: int,
                   first_block: int) -> None:
    """Reject decoded values that quantize() never produces (and that could decode to non-finite)."""
    if bits != 32:
        _check_scales(bits, scales, first_block)
    _check_codes(bits, payload, first_block * block)
    if bits in (4, "e3m0") and count % 2 and payload.size and payload[-1] >> 4:
        raise CodecError("padding nibble (high nibble of the last payload byte) must be 0")


def _check_scales(bits: Bits, scales: np.ndarray, first_block: int) -> None:
    limit = np.float32(_F32_MAX) if bits == "e3m0" else _SCALE_MAX[_QMAX[bits]]
    bad = ~(np.isfinite(scales) & (scales >= 0) & (scales <= limit))
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError(f"invalid scale {scales[i]!r} for block {first_block + i}")


def _check_codes(bits: Bits, payload: np.ndarray | bytes | memoryview, first_value: int) -> None:
    """Payload bytes (starting at value ``first_value``; for 32 bits, whole float32s) hold no invalid code."""
    if bits == 8:
        if isinstance(payload, bytes):  # the one invalid byte: a memchr, no temporary
            i = payload.find(b"\x80")
        else:
            bad = np.frombuffer(payload, np.uint8) == 0x80
            i = int(np.argmax(bad)) if bad.any() else -1
        if i >= 0:
            raise CodecError(f"invalid int8 code -128 near value {first_value + i}")
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
                   weight: float = 1.0, scratch: np.ndarray | None = None) -> None:
    """out += weight · (the values of whole blocks starting at a block boundary), without a per-value scale
    array (int8: one fused multiply per block row, into ``scratch`` if given: float32, at least out.size).
    For payloads already checked (``_check_segment``)."""
    count = out.size
    w = np.float32(weight)
    if bits == 32:
        values = payload.view("<f4")[:count]
        out += values if w == 1 else values * w
        return
    scales = scales if w == 1 else scales * w
    if bits != 8:
        out += _dequantize_segment(bits, block, scales, payload, count)
        return
    codes = payload.view(np.int8)
    full = count // block
    if full:
        rows = out[:full * block].reshape(full, block)
        tmp = None if scratch is None else scratch[:full * block].reshape(full, block)
        rows += np.multiply(codes[:full * block].reshape(full, block), scales[:full, None], out=tmp,
                            dtype=np.float32)
    if count > full * block:
        out[full * block:] += codes[full * block:count].astype(np.float32) * scales[full]


# Public names for the pieces the coordinator's slab-wise outer step and frame writer use.
quantize_segment = _quantize_segment
dequantize_segment = _dequantize_segment
n_scales = _n_scales
payload_len = _payload_len


def _blocks_per_slab(block: int) -> int:
    return max(1, _SLAB_VALUES // block)


def quantize(vec: Any, bits: Bits = 8, block: int = DEFAULT_BLOCK) -> QuantizedVec:
    """Block-quantize a 1-D vector (converted with ``np.asarray(vec, np.float32)``).

    Raises CodecError on NaN/Inf (naming the first index), a non-1-D input, or
    bad bits/block. Works slab by slab, so temporaries stay ~O(1M values).
    """
    bits, block = _canonical_bits(bits), _check_block(block)
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
        s, p = _quantize_segment(bits, block, segment)
        scales.append(s)
        payloads.append(p)
    return QuantizedVec(
        bits=bits, block=block, n=n,
        scales=np.concatenate(scales) if scales else np.empty(0, np.float32),
        payload=np.concatenate(payloads) if payloads else np.empty(0, np.uint8))


def _payload_offset(bits: Bits, value_index: int) -> int:
    """Byte offset in the payload of a value index that starts a block (blocks are even: byte-aligned)."""
    return {8: value_index, 4: value_index // 2, "e3m0": value_index // 2, 32: 4 * value_index}[bits]


payload_offset = _payload_offset


def dequantize(q: QuantizedVec) -> np.ndarray:
    """The float32 vector a QuantizedVec stands for (a fresh array of length q.n)."""
    out = np.empty(q.n, np.float32)
    slab_blocks = _blocks_per_slab(q.block)
    slab = slab_blocks * q.block
    for b0, start in enumerate(range(0, q.n, slab)):
        count = min(slab, q.n - start)
        p0, p1 = _payload_offset(q.bits, start), _payload_offset(q.bits, start) + _payload_len(q.bits, count)
        scales = q.scales[b0 * slab_blocks:(b0 + 1) * slab_blocks]
        out[start:start + count] = _dequantize_segment(q.bits, q.block, scales, q.payload[p0:p1], count)
    return out


# --------------------------------------------------------------------------- error feedback

def error_feedback_step(delta: Any, residual: np.ndarray, bits: Bits = 8,
                        block: int = DEFAULT_BLOCK) -> tuple[QuantizedVec, np.ndarray]:
    """Pure error feedback: quantize delta + residual; the new residual is what quantization dropped.

    Summed over rounds, Σ dequantize(q_t) = Σ delta_t − residual_T, so the
    transmitted sum trails the true sum by one round's quantization error at
    most instead of accumulating it. On error (e.g. NaN) nothing changes.
    """
    delta = np.asarray(delta, dtype=np.float32)
    if delta.shape != residual.shape:
        raise CodecError(f"delta has shape {delta.shape}, residual has shape {residual.shape}")
    corrected = delta + residual
    q = quantize(corrected, bits, block)
    new_residual = np.subtract(corrected, dequantize(q), out=corrected)  # reuse the buffer
    return q, new_residual


class ErrorFeedback:
    """Holds an island's float32 residual (kept across rounds) and applies :func:`error_feedback_step`."""

    def __init__(self, n: int, bits: Bits = 8, block: int = DEFAULT_BLOCK):
        self.bits: Bits = _canonical_bits(bits)
        self.block = _check_block(block)
        self.residual = np.zeros(n, np.float32)

    def compress(self, delta_vec: Any) -> QuantizedVec:
        q, self.residual = error_feedback_step(delta_vec, self.residual, self.bits, self.block)
        return q

    def reset(self) -> None:
        self.residual[:] = 0


# --------------------------------------------------------------------------- frames

@dataclass(frozen=True)
class _Header:
    bits: Bits
    block: int
    n: int
    scales_len: int
    payload_len: int
    body_len: int
    crc32: int
    raw: bytes  # the 48 header bytes


def encode(q: QuantizedVec, level: int = 3) -> bytes:
    """Frame a QuantizedVec: 48-byte header + one zstd frame of scales ‖ payload (see module docstring).

    ``level``: zstd level (3 is fast and already gets what there is to get from
    quantized codes; negative levels are faster still).
    """
    if isinstance(level, bool) or not isinstance(level, int) or not -(1 << 17) <= level <= 22:
        raise CodecError(f"zstd level must be an int in [-131072, 22], got {level!r}")
    scales = np.ascontiguousarray(q.scales, dtype="<f4").tobytes()
    payload = np.ascontiguousarray(q.payload, dtype=np.uint8)
    try:
        compressor = zstandard.ZstdCompressor(level=level).compressobj(size=len(scales) + payload.nbytes)
        body = compressor.compress(scales) + compressor.compress(payload) + compressor.flush()
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd compression failed (level {level!r}): {e}") from e
    head = frame_header(q.bits, q.block, q.n, len(scales), payload.nbytes, len(body))
    crc = zlib.crc32(body, zlib.crc32(head))
    return head + struct.pack("<I", crc) + body


def frame_header(bits: Bits, block: int, n: int, scales_len: int, payload_len: int, body_len: int) -> bytes:
    """The first 44 header bytes (everything but the CRC32, which covers them and the body)."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, _BITS_CODE[bits], 0, block, n, scales_len, payload_len,
                        body_len, 0)[:_CRC_OFFSET]


def _parse_header(raw: bytes, expected_n: int | None) -> _Header:
    """Validate the fixed header (everything that does not need the body)."""
    if len(raw) < HEADER_SIZE:
        raise CodecError(f"frame truncated: {len(raw)} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, code, reserved, block, n, scales_len, payload_len, body_len, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if reserved:
        raise CodecError(f"reserved header field is {reserved}, must be 0")
    if code not in _CODE_BITS:
        raise CodecError(f"unknown bits code {code} (known: 8, 4, 32, 0xE3 for e3m0)")
    bits = _CODE_BITS[code]
    if not MIN_BLOCK <= block <= MAX_BLOCK or block % 2:
        raise CodecError(f"block {block} out of range: must be even and in [{MIN_BLOCK}, {MAX_BLOCK}]")
    if expected_n is not None and n != expected_n:
        raise CodecError(f"header says n={n}, expected n={expected_n}")
    want_scales = 4 * _n_scales(bits, n, block)
    if scales_len != want_scales:
        raise CodecError(f"scales length {scales_len} inconsistent with n={n}, block={block}, bits={bits} "
                         f"(expected {want_scales})")
    want_payload = _payload_len(bits, n)
    if payload_len != want_payload:
        raise CodecError(f"payload length {payload_len} inconsistent with n={n}, bits={bits} "
                         f"(expected {want_payload})")
    return _Header(bits, block, n, scales_len, payload_len, body_len, crc, bytes(raw[:HEADER_SIZE]))


class _BoundedSink:
    """zstd output sink that refuses to grow past the size the header declared (zip-bomb guard).

    python-zstandard hands output to ``write`` in pieces of at most ~128 KiB,
    so an over-expanding body is stopped after one piece beyond the limit.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.pending = bytearray()

    def write(self, data: bytes) -> int:
        self.total += len(data)
        if self.total > self.limit:
            raise CodecError(f"body decompresses to more than the {self.limit} bytes the header declares "
                             "(zip bomb?)")
        self.pending += data
        return len(data)


def _decompressor(sink: _BoundedSink) -> Any:
    return zstandard.ZstdDecompressor().stream_writer(sink, write_return_read=True, closefd=False)


def _push(writer: Any, data: bytes | memoryview) -> None:
    try:
        writer.write(data)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd decompression failed: {e}") from e


def decode(frame: bytes, *, expected_n: int | None = None) -> QuantizedVec:
    """Parse and fully validate a frame (see the module docstring for the checks and their order).

    ``expected_n``: the receiver's model size; pass it so a forged header cannot
    make the decoder allocate for a bigger vector than the model.
    """
    frame = memoryview(frame).cast("B")
    header = _parse_header(frame, expected_n)
    got = len(frame) - HEADER_SIZE
    if got < header.body_len:
        raise CodecError(f"frame truncated: header says {header.body_len} body bytes, got {got}")
    if got > header.body_len:
        raise CodecError(f"trailing garbage: {got - header.body_len} bytes after the {header.body_len}-byte body")
    body = frame[HEADER_SIZE:]
    crc = zlib.crc32(body, zlib.crc32(frame[:_CRC_OFFSET]))
    if crc != header.crc32:
        raise CodecError(f"CRC32 mismatch: header says {header.crc32:#010x}, computed {crc:#010x}")
    expected = header.scales_len + header.payload_len
    sink = _BoundedSink(expected)
    _push(_decompressor(sink), body)
    if sink.total != expected:
        raise CodecError(f"body decompresses to {sink.total} bytes, header declares {expected}")
    raw = bytes(sink.pending)
    scales = np.frombuffer(raw, "<f4", count=header.scales_len // 4).astype(np.float32, copy=False)
    payload = np.frombuffer(raw, np.uint8, offset=header.scales_len)
    _check_segment(header.bits, header.block, scales, payload, header.n, 0)
    return QuantizedVec(header.bits, header.block, header.n, scales, payload)


def _expect_header(raw: bytes | bytearray, n: int, bits: Bits, block: int) -> _Header:
    """A streamed frame's header, checked against what the receiver expects."""
    header = _parse_header(raw, n)
    if header.bits != bits or header.block != block:
        raise CodecError(f"frame header says bits={header.bits} block={header.block}, "
                         f"expected bits={bits} block={block}")
    return header


def _check_frame_end(header: _Header | None, head_len: int, body_received: int, crc: int) -> _Header:
    """The end of a streamed frame: header and body complete, CRC32 right."""
    if header is None:
        raise CodecError(f"frame truncated: {head_len} bytes, the header alone needs {HEADER_SIZE}")
    if body_received < header.body_len:
        raise CodecError(f"frame truncated: header says {header.body_len} body bytes, got {body_received}")
    if crc != header.crc32:
        raise CodecError(f"CRC32 mismatch: header says {header.crc32:#010x}, computed {crc:#010x}")
    return header


class StreamingDecoder:
    """Decode a frame fed in pieces, handing out dequantized float32 segments block by block.

    Feed it the frame bytes as they arrive (header included: the header is
    checked against ``expected_n``/``bits``/``block`` as soon as its 48 bytes
    are in). The body is decompressed incrementally through a bounded zstd
    stream; the scales (n/block floats) are buffered, then each completed run
    of whole blocks is dequantized and returned as ``(start_index, values)``.
    Memory: the scales, plus the output of one feed (bounded by the header's
    declared size whatever the input), never the whole decoded vector.

    The end-to-end CRC32 can only be checked in :meth:`finish`, after segments
    have been handed out: verify each chunk's own CRC first (:class:`ChunkVerifier`)
    and treat a failing ``finish()`` as "discard everything accumulated from
    this frame".
    """

    def __init__(self, expected_n: int, bits: Bits, block: int = DEFAULT_BLOCK, *, weight: float = 1.0):
        """``weight`` scales every value handed out (folded into the block scales: no extra pass). To check a
        frame without dequantizing it, use :class:`FrameValidator`."""
        self.weight = np.float32(weight)
        if isinstance(expected_n, bool) or not isinstance(expected_n, int) or expected_n < 0:
            raise CodecError(f"expected_n must be a non-negative int, got {expected_n!r}")
        self.n = expected_n
        self.bits: Bits = _canonical_bits(bits)
        self.block = _check_block(block)
        self._head = bytearray()
        self._header: _Header | None = None
        self._crc = 0
        self._body_received = 0
        self._sink: _BoundedSink | None = None
        self._writer: Any = None
        self._scales: np.ndarray | None = None
        self._next_value = 0  # index of the first value not yet handed out
        self._closed: str | None = None  # why no more input is accepted (finished, or an earlier error)

    @property
    def values_out(self) -> int:
        """How many values have been handed out so far."""
        return self._next_value

    def feed(self, data: bytes) -> list[tuple[int, np.ndarray]]:
        """Push frame bytes; return the newly completed segments ``(start_index, float32 values)``.

        After any CodecError the decoder is dead: later calls raise too.
        """
        if self._closed is not None:
            raise CodecError(f"decoder closed: {self._closed}")
        try:
            return self._feed(memoryview(data).cast("B"))
        except CodecError as e:
            self._closed = f"an earlier error ({e})"
            raise

    def _feed(self, data: memoryview) -> list[tuple[int, np.ndarray]]:
        if self._header is None:
            take = HEADER_SIZE - len(self._head)
            self._head += data[:take]
            data = data[take:]
            if len(self._head) < HEADER_SIZE:
                return []
            self._start(_expect_header(self._head, self.n, self.bits, self.block))
        header = self._header
        assert header is not None and self._sink is not None
        if self._body_received + len(data) > header.body_len:
            extra = self._body_received + len(data) - header.body_len
            raise CodecError(f"trailing garbage: {extra} bytes after the {header.body_len}-byte body")
        segments = []
        for start in range(0, len(data), _FEED_SLICE):  # small input slices keep each step's output small
            piece = data[start:start + _FEED_SLICE]
            self._crc = zlib.crc32(piece, self._crc)
            self._body_received += len(piece)
            _push(self._writer, piece)
            segment = self._drain()
            if segment is not None:
                segments.append(segment)
        return segments

    def _start(self, header: _Header) -> None:
        self._header = header
        self._crc = zlib.crc32(header.raw[:_CRC_OFFSET])
        self._sink = _BoundedSink(header.scales_len + header.payload_len)
        self._writer = _decompressor(self._sink)
        if header.scales_len == 0:
            self._scales = np.empty(0, np.float32)

    def _drain(self) -> tuple[int, np.ndarray] | None:
        """Consume whole blocks from the decompressed bytes pending in the sink."""
        header, sink = self._header, self._sink
        assert header is not None and sink is not None
        if self._scales is None:
            if len(sink.pending) < header.scales_len:
                return None
            self._scales = np.frombuffer(bytes(sink.pending[:header.scales_len]), "<f4").astype(np.float32)
            del sink.pending[:header.scales_len]
        remaining = self.n - self._next_value
        bytes_per_block = _payload_offset(self.bits, self.block)
        blocks = len(sink.pending) // bytes_per_block
        count = min(blocks * self.block, remaining)
        if count < remaining and len(sink.pending) >= _payload_len(self.bits, remaining):
            count = remaining  # the final, partial block is complete
        if count == 0:
            return None
        n_bytes = _payload_len(self.bits, count)
        payload = np.frombuffer(bytes(sink.pending[:n_bytes]), np.uint8)
        del sink.pending[:n_bytes]
        first_block = self._next_value // self.block
        scales = self._scales[first_block:first_block + -(-count // self.block)] if self.bits != 32 else self._scales
        _check_segment(self.bits, self.block, scales, payload, count, first_block)
        start = self._next_value
        self._next_value += count
        if self.weight != 1 and self.bits != 32:
            return start, _dequantize_segment(self.bits, self.block, scales * self.weight, payload, count)
        out = _dequantize_segment(self.bits, self.block, scales, payload, count)
        if self.weight != 1:
            out *= self.weight
        return start, out

    def finish(self) -> None:
        """Check the frame was complete and intact: all bytes, CRC32, exact decompressed size."""
        if self._closed is not None:
            raise CodecError(f"decoder closed: {self._closed}")
        self._closed = "finish() was called"
        header = _check_frame_end(self._header, len(self._head), self._body_received, self._crc)
        assert self._sink is not None
        expected = header.scales_len + header.payload_len
        if self._sink.total != expected or self._next_value != self.n:
            raise CodecError(f"body decompresses to {self._sink.total} bytes, header declares {expected}")


class FrameValidator:
    """Checks a frame fed in pieces, completely, without dequantizing anything: the header against the
    receiver's n/bits/block as soon as it is in, every decompressed piece as zstd hands it out (all scales
    first, then every code), and in :meth:`finish` the length, the CRC32 and the exact decompressed size.

    ``out`` receives the decompressed body (scales ‖ payload) in order, each piece only after its checks
    (the piece is not retained: copy or write it). What ``out`` has stored is the whole, checked body once
    ``finish()`` returns; if any call raises, throw it away. Decompression is bounded by the size the header
    declares (a zip bomb is stopped after one output piece). Few Python calls per input byte: whole input
    pieces go to zstd, whose output comes in pieces of up to ``out_piece`` bytes.
    """

    def __init__(self, expected_n: int, bits: Bits, block: int, out: Callable[[bytes | memoryview], Any],
                 out_piece: int = 1 << 18):
        if isinstance(expected_n, bool) or not isinstance(expected_n, int) or expected_n < 0:
            raise CodecError(f"expected_n must be a non-negative int, got {expected_n!r}")
        self.n = expected_n
        self.bits: Bits = _canonical_bits(bits)
        self.block = _check_block(block)
        self.out = out
        self._out_piece = out_piece
        self._head = bytearray()
        self._header: _Header | None = None
        self._writer: Any = None
        self._crc = 0
        self._body_received = 0
        self._total = 0  # decompressed bytes so far
        self._scales = bytearray()
        self._carry = b""  # bits=32: bytes of a float32 split across output pieces
        self._last = 0  # the last payload byte (4-bit schemes: its high nibble may be padding)
        self._closed: str | None = None

    def feed(self, data: bytes | memoryview) -> None:
        """Frame bytes, in order; raises CodecError as soon as something is wrong (then the validator is dead)."""
        if self._closed is not None:
            raise CodecError(f"validator closed: {self._closed}")
        try:
            self._feed(memoryview(data).cast("B"))
        except CodecError as e:
            self._closed = f"an earlier error ({e})"
            raise

    def _feed(self, data: memoryview) -> None:
        if self._header is None:
            take = HEADER_SIZE - len(self._head)
            self._head += data[:take]
            data = data[take:]
            if len(self._head) < HEADER_SIZE:
                return
            header = self._header = _expect_header(self._head, self.n, self.bits, self.block)
            self._crc = zlib.crc32(header.raw[:_CRC_OFFSET])
            self._writer = zstandard.ZstdDecompressor().stream_writer(
                self, write_size=self._out_piece, write_return_read=True, closefd=False)
        if not data:
            return
        if self._body_received + len(data) > self._header.body_len:
            extra = self._body_received + len(data) - self._header.body_len
            raise CodecError(f"trailing garbage: {extra} bytes after the {self._header.body_len}-byte body")
        self._crc = zlib.crc32(data, self._crc)
        self._body_received += len(data)
        _push(self._writer, data)

    def write(self, data: bytes) -> int:
        """zstd's output sink (not for callers)."""
        header = self._header
        assert header is not None
        size = len(data)
        if self._total + size > header.scales_len + header.payload_len:
            raise CodecError(f"body decompresses to more than the {header.scales_len + header.payload_len} bytes "
                             "the header declares (zip bomb?)")
        start = 0
        if self._total < header.scales_len:  # the scales (n/block floats): all checked before any code
            start = min(size, header.scales_len - self._total)
            self._scales += memoryview(data)[:start]
            self._total += start
            if self._total == header.scales_len:
                _check_scales(self.bits, np.frombuffer(self._scales, "<f4"), 0)
                self.out(self._scales)
            if start == size:
                return size
        piece = data if start == 0 else data[start:]
        first = self._total - header.scales_len  # payload byte offset of this piece
        if self.bits == 32:
            if self._carry:
                piece = self._carry + piece
                first -= len(self._carry)
            cut = len(piece) - len(piece) % 4
            piece, self._carry = piece[:cut], piece[cut:]
            _check_codes(32, piece, first // 4)
        else:
            _check_codes(self.bits, piece, first if self.bits == 8 else 2 * first)
            self._last = piece[-1]
        self.out(piece)
        self._total += size - start
        return size

    def finish(self) -> None:
        """Check the frame was complete and intact: all bytes, CRC32, exact decompressed size, padding."""
        if self._closed is not None:
            raise CodecError(f"validator closed: {self._closed}")
        self._closed = "finish() was called"
        header = _check_frame_end(self._header, len(self._head), self._body_received, self._crc)
        expected = header.scales_len + header.payload_len
        if self._total != expected or self._carry:
            raise CodecError(f"body decompresses to {self._total} bytes, header declares {expected}")
        if self.bits in (4, "e3m0") and header.n % 2 and self._last >> 4:
            raise CodecError("padding nibble (high nibble of the last payload byte) must be 0")


# --------------------------------------------------------------------------- CRC32 of concatenations

_CRC_POLY: Final = 0xEDB88320  # zlib's CRC-32, reflected


def _crc_multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial (reflected bit order, as in zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _crc_x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _crc_multmodp(p, p)
    return table


_CRC_X2N: Final = _crc_x2n_table()  # x^(2^k) mod the polynomial


@functools.lru_cache(maxsize=64)
def _crc_shift(length: int) -> int:
    """x^(8·length) mod the polynomial: appending ``length`` zero bytes, as an operator."""
    p, k, n = 1 << 31, 3, length
    while n:
        if n & 1:
            p = _crc_multmodp(_CRC_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A ‖ B from crc32(A), crc32(B) and len(B), without touching the bytes (zlib's crc32_combine,
    which Python's zlib does not expose). Lets a receiver check a whole frame's CRC from its chunks' CRCs."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    return _crc_multmodp(_crc_shift(len2), crc1) ^ crc2 if len2 else crc1


# --------------------------------------------------------------------------- chunks


@dataclass(frozen=True)
class Chunk:
    """One piece of a frame on the wire: position ``index`` of ``total``, with its own CRC32."""

    index: int
    total: int
    data: bytes
    crc32: int


def split_chunks(frame: bytes, max_chunk: int = 1 << 20) -> list[Chunk]:
    """Cut a frame into chunks of at most ``max_chunk`` bytes (an empty frame is one empty chunk)."""
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 1:
        raise CodecError(f"max_chunk must be a positive int, got {max_chunk!r}")
    view = memoryview(frame).cast("B")
    total = max(1, -(-len(view) // max_chunk))
    pieces = [bytes(view[i * max_chunk:(i + 1) * max_chunk]) for i in range(total)]
    return [Chunk(i, total, piece, zlib.crc32(piece)) for i, piece in enumerate(pieces)]


class ChunkVerifier:
    """Checks a chunk stream without keeping it: order, count, per-chunk CRC32, a size limit.

    A rejected chunk changes no state, so the sender may retry it.
    """

    def __init__(self, max_total: int):
        if isinstance(max_total, bool) or not isinstance(max_total, int) or max_total < 0:
            raise CodecError(f"max_total must be a non-negative int, got {max_total!r}")
        self.max_total = max_total
        self.total: int | None = None  # chunk count, from the first chunk
        self.received = 0  # chunks accepted
        self.size = 0  # bytes accepted

    @property
    def complete(self) -> bool:
        return self.total is not None and self.received == self.total

    def add(self, chunk: Chunk) -> bytes:
        """Verify the next chunk and return its data."""
        if self.complete:
            raise CodecError(f"duplicate chunk {chunk.index}: all {self.total} chunks already received")
        if chunk.total < 1 or not 0 <= chunk.index < chunk.total:
            raise CodecError(f"chunk index {chunk.index} out of range for total {chunk.total}")
        if self.total is not None and chunk.total != self.total:
            raise CodecError(f"chunk {chunk.index} says total {chunk.total}, earlier chunks said {self.total}")
        if chunk.index < self.received:
            raise CodecError(f"duplicate chunk {chunk.index} (expected chunk {self.received})")
        if chunk.index > self.received:
            raise CodecError(f"chunk out of order: expected chunk {self.received}, got {chunk.index}")
        if self.size + len(chunk.data) > self.max_total:
            raise CodecError(f"chunk {chunk.index} exceeds limit: {self.size + len(chunk.data)} bytes "
                             f"> max {self.max_total}")
        crc = zlib.crc32(chunk.data)
        if crc != chunk.crc32:
            raise CodecError(f"chunk {chunk.index} CRC32 mismatch: chunk says {chunk.crc32:#010x}, "
                             f"computed {crc:#010x}")
        self.total = chunk.total
        self.received += 1
        self.size += len(chunk.data)
        return chunk.data

    def finish(self) -> None:
        """Raise unless every chunk arrived."""
        if self.total is None:
            raise CodecError("missing chunks: none received")
        if self.received < self.total:
            raise CodecError(f"missing chunks: received {self.received} of {self.total}")


class ChunkAssembler:
    """Accepts chunks in order (verified as by :class:`ChunkVerifier`) and reassembles the frame."""

    def __init__(self, max_total: int):
        self._verifier = ChunkVerifier(max_total)
        self._parts: list[bytes] = []

    @property
    def complete(self) -> bool:
        return self._verifier.complete

    @property
    def size(self) -> int:
        return self._verifier.size

    def add(self, chunk: Chunk) -> None:
        self._parts.append(self._verifier.add(chunk))

    def finish(self) -> bytes:
        """The reassembled frame; raises CodecError if chunks are missing."""
        self._verifier.finish()
        return b"".join(self._parts)


def compression_ratio(n_values: int, frame_len: int) -> float:
    """Raw float32 bytes over bytes on the wire: 4·n / frame_len."""
    if frame_len <= 0:
        raise CodecError(f"frame_len must be positive, got {frame_len}")
    return 4 * n_values / frame_len
