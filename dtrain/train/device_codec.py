"""The push's quantization on the island's device: error feedback and block quantization in jitted code.

:class:`DeviceErrorFeedback` is :class:`dtrain.codec.ErrorFeedback` for the dense integer schemes (int8, int4)
with its residual kept on the device: each round's Δ (a device array, or a host one put on the device) plus the
residual is quantized there, a piece of :data:`PIECE` values at a time, and only the encoded bytes (the scales
and the packed codes, a quarter or an eighth of Δ's float32 size) cross to the host, piece by piece; the new
residual never leaves the device. The result is the same :class:`~dtrain.codec.QuantizedVec`, and so the same
frame (``dtrain.codec.encode``), byte for byte, as the host codec's for the same Δ and residual, and the same new
residual bit for bit (``tests/test_device_codec.py``): the block math here follows
``dtrain.codec.quant.quantize_segment`` operation by operation (the scale ``absmax / qmax`` rounded up, capped;
``x * (1 / scale)``, or ``x / scale`` where the reciprocal overflows; round half to even; clip), in float32 only
(the scale's rounding is decided exactly by a split product, where the host codec uses float64). The coordinator,
which has no JAX, keeps the host codec; an island's push uses this one on any platform (on a CPU, jitted for the
CPU). Every piece has the same length (the last one padded with zeros, whose codes are zero and whose residual
stays zero), so one program serves every Δ length.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtrain.codec import CodecError, QuantizedVec, canonical_bits, check_block, n_scales, payload_len
from dtrain.codec.quant import QMAX, SCALE_MAX

DEVICE_BITS = (8, 4)  # the schemes quantized here: int8, int4
PIECE = 1 << 22  # values quantized a program call: 4 Mi (16 MiB of float32 Δ), whole blocks of every block size
_SPLIT = np.float32(4097.0)  # Dekker's splitter for float32: 2**12 + 1
_BIG, _SMALL = np.float32(2.0 ** 100), np.float32(2.0 ** -100)  # rescaled by 2**∓64 for the exact test


def _int_scales(absmax_B: jax.Array, qmax: int, qmax_f32: jax.Array | None = None) -> jax.Array:
    """``absmax / qmax`` in float32, rounded up (so ``|x| / scale <= qmax``) and capped: the host codec's scales.

    ``s = absmax / qmax`` is correctly rounded; it is below the exact quotient iff ``s * qmax < absmax``, decided
    exactly: ``s = hi + lo`` (Dekker: 12 bits each), so ``hi * qmax`` and ``lo * qmax`` are exact (qmax has 7 bits)
    and ``hi * qmax - absmax`` is exact (Sterbenz: the two are within a factor 2). Values near float32's ends are
    rescaled by a power of two first (exact), so no product overflows or loses bits as a subnormal. ``qmax_f32``:
    qmax as a traced float32 (a compiler would turn a division by the constant into a multiplication by its
    rounded reciprocal)."""
    q = np.float32(qmax) if qmax_f32 is None else qmax_f32
    s = absmax_B / q
    factor = jnp.where(absmax_B > _BIG, np.float32(2.0 ** -64), jnp.where(absmax_B < _SMALL, np.float32(2.0 ** 64),
                                                                          np.float32(1.0)))
    a, t = absmax_B * factor, s * factor
    c = t * _SPLIT
    hi = c - (c - t)
    lo = t - hi
    below = (hi * q - a) < -(lo * q)  # s * qmax < absmax, exactly
    s = jnp.where(below, jnp.nextafter(s, np.float32(np.inf)), s)
    return jnp.minimum(s, SCALE_MAX[qmax])


def _rounded(product: jax.Array, zero: jax.Array) -> jax.Array:
    """``product`` rounded to float32 before it is used: its bits or'ed with ``zero``, a uint32 0 the compiler
    cannot see (an argument), so no fused multiply-add can take the product and what follows as one rounding
    (XLA's CPU and GPU compilers contract them; an optimization barrier does not stop it)."""
    bits = jax.lax.bitcast_convert_type(product, jnp.uint32) | zero
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@partial(jax.jit, static_argnames=("bits", "block"))
def _quantize_piece(delta_P: jax.Array, residual_P: jax.Array, decay: jax.Array, zero: jax.Array, *, bits: int,
                    block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One piece: ``(scales, payload, new_residual)`` of ``delta + decay * residual`` (decay 1: the plain sum,
    ``residual * 1`` being ``residual`` exactly)."""
    # each product rounded on its own, as numpy rounds it (_rounded): fused into the sum after it (one rounding),
    # the residual would differ from the host's in its last bits
    corrected_P = delta_P + _rounded(residual_P * decay, zero)
    x_BxK = corrected_P.reshape(-1, block)
    qmax = QMAX[bits]
    scale_B = _int_scales(jnp.max(jnp.abs(x_BxK), axis=1), qmax, (zero + qmax).astype(jnp.float32))
    positive_B = scale_B > 0
    inv_B = jnp.where(positive_B, np.float32(1) / jnp.where(positive_B, scale_B, np.float32(1)), np.float32(0))
    exact_BxK = x_BxK / jnp.where(positive_B, scale_B, np.float32(1))[:, None]  # where 1/scale overflows
    q_BxK = jnp.where(jnp.isinf(inv_B)[:, None], exact_BxK, x_BxK * inv_B[:, None])
    q_BxK = jnp.clip(jnp.round(q_BxK), -qmax, qmax)  # jnp.round: half to even, as np.rint
    residual_P = corrected_P - _rounded(q_BxK * scale_B[:, None], zero).reshape(-1)  # the host's dequantize's values
    codes = jax.lax.bitcast_convert_type(q_BxK.astype(jnp.int8), jnp.uint8).reshape(-1)
    if bits == 4:
        nibbles_Px2 = (codes & 0x0F).reshape(-1, 2)
        codes = nibbles_Px2[:, 0] | (nibbles_Px2[:, 1] << 4)
    return scale_B, codes, residual_P


class DeviceErrorFeedback:
    """An island's error feedback with its float32 residual on the device (see the module docstring).

    Args:
        n: the vector's length. bits: 8 or 4 (int8, int4). block: values per block. decay: β, as the host's.
        device: where the residual lives (default: JAX's first device).

    Raises:
        CodecError: a scheme other than int8 or int4, a bad block or decay.
    """

    def __init__(self, n: int, bits: Any = 8, block: int = 1024, decay: float = 1.0, device: Any = None):
        self.bits = canonical_bits(bits)
        if self.bits not in QMAX:
            raise CodecError(f"the device codec quantizes int8 and int4, not {self.bits!r}")
        self.block = check_block(block)
        if not 0 < decay <= 1:
            raise CodecError(f"error-feedback decay must be in (0, 1], got {decay!r}")
        self.n, self.decay = n, np.float32(decay)
        self.piece = -(-PIECE // self.block) * self.block  # whole blocks
        self.device = device or jax.devices()[0]
        self.pieces = max(1, -(-n // self.piece))
        self.residual = jax.device_put(jnp.zeros(self.pieces * self.piece, jnp.float32), self.device)

    def compress(self, delta: Any, seed: int = 0) -> QuantizedVec:
        """Quantizes ``delta`` (1-D, length ``n``: a device or host array) plus the residual, on the device, and
        keeps what was dropped as the new residual there; returns the :class:`QuantizedVec` to frame (``seed``:
        the mask codec's, which runs on the host: unused). A
        non-finite Δ raises CodecError (as the host codec) and leaves the residual unchanged."""
        delta = jnp.asarray(delta, jnp.float32)
        if delta.shape != (self.n,):
            raise CodecError(f"delta has shape {delta.shape}, residual has shape ({self.n},)")
        if not bool(jnp.isfinite(delta).all()):  # note: a host sync (one bool)
            host = np.asarray(delta)
            index = int(np.argmin(np.isfinite(host)))
            raise CodecError(f"non-finite value {host[index]} at index {index}: refusing to encode NaN/Inf")
        delta = jax.device_put(delta, self.device)
        scales, payloads, residuals = [], [], []
        for i in range(self.pieces):
            piece = delta[i * self.piece:(i + 1) * self.piece]
            if piece.size < self.piece:  # the last piece: zeros to the common length (codes 0, residual 0)
                piece = jnp.pad(piece, (0, self.piece - piece.size))
            s, p, r = _quantize_piece(piece, self.residual[i * self.piece:(i + 1) * self.piece], self.decay,
                                      np.uint32(0), bits=int(self.bits), block=self.block)
            scales.append(np.asarray(s))  # note: a host sync; the encoded bytes only cross to the host
            payloads.append(np.asarray(p))
            residuals.append(r)
        self.residual = jnp.concatenate(residuals) if len(residuals) > 1 else residuals[0]
        n = self.n
        return QuantizedVec(bits=self.bits, block=self.block, n=n,
                            scales=np.concatenate(scales)[:n_scales(self.bits, n, self.block)],
                            payload=np.concatenate(payloads)[:payload_len(self.bits, n)])

    def residual_host(self) -> np.ndarray:
        """The residual as a host float32 array of length ``n`` (a copy)."""
        return np.asarray(self.residual)[:self.n]

    def reset(self) -> None:
        """Forgets the residual."""
        self.residual = jnp.zeros_like(self.residual)
