"""The dense 2-bit scheme (``bits = 2``, the config's ``int2``): four levels per block, scaled by the block's RMS.

Each block of ``block`` values (a multiple of 4 here, so that every block starts on a byte) has one float32 scale,
the root mean square of its values, and each value one 2-bit code c in 0..3 standing for the level
``(c - 1.5) · scale``, i.e. ``{-1.5, -0.5, +0.5, +1.5} · scale``: the uniform 4-level quantizer whose step is the
block's RMS, within 1% of the mean-square-optimal one (Lloyd-Max) for Gaussian values. Values are rounded to
the nearest level; those beyond ±2·RMS (about 5% of a Gaussian block) are clipped to ±1.5·RMS, and error feedback
(``dtrain.codec.quant.error_feedback_step``) carries what clipping and rounding dropped into the next round. An
absmax scale (int8's and int4's: nothing clipped) would put the inner levels at about ±1.1σ of a 1024-value
Gaussian block and waste most of the four levels on values that rarely occur.

Packing: value 4i + j is bits 2j..2j+1 of payload byte i (the first value in the lowest bits); when n is not a
multiple of 4, the last byte's unused high bits are padding and must be 0. Every code is valid; a frame's checks
are its scales (finite, ≥ 0, at most :data:`SCALE_MAX` so that 1.5·scale is finite) and its padding. An all-zero
block has scale 0 and decodes to zeros, whatever its codes. Pure numpy.
"""

from __future__ import annotations

from typing import Final

import numpy as np

__all__ = ["LEVELS", "SCALE_MAX", "block_sum_squares", "check_block", "levels", "padding_ok", "quantize_segment"]

LEVELS: Final = np.array([-1.5, -0.5, 0.5, 1.5], np.float32)  # code c → level (c - 1.5), in units of the scale
_F32_MAX: Final = float(np.finfo(np.float32).max)
SCALE_MAX: Final = np.float32(_F32_MAX / 1.5)  # the largest scale whose levels are all finite
# A payload byte → the levels of its four values (lowest bits first): one table gather decodes four values.
_BYTE_LEVELS: Final = LEVELS[(np.arange(256)[:, None] >> (2 * np.arange(4))[None, :]) & 3]


def check_block(block: int) -> str | None:
    """Why ``block`` cannot be a 2-bit block (a 2-bit block must start on a byte: a multiple of 4), or None."""
    return None if block % 4 == 0 else f"block {block} must be a multiple of 4 for 2-bit codes (each starts a byte)"


def quantize_segment(block: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize finite float32 values that start on a block boundary (whole blocks, the last maybe partial): the
    scales (one per block, its values' RMS over the values it really holds) and the packed payload,
    ``ceil(x.size / 4)`` bytes."""
    count = x.size
    n_blocks = -(-count // block)
    padded = np.zeros(n_blocks * block, np.float32)
    padded[:count] = x
    x_BxK = padded.reshape(n_blocks, block)
    real_B = np.full(n_blocks, block, np.float64)
    real_B[-1] = count - (n_blocks - 1) * block if n_blocks else block
    mean_sq_B = np.einsum("ij,ij->i", x_BxK, x_BxK, dtype=np.float64) / real_B
    scale_B = np.minimum(np.sqrt(mean_sq_B), float(SCALE_MAX)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        ratio_BxK = np.divide(x_BxK, scale_B[:, None], out=np.zeros_like(x_BxK), where=scale_B[:, None] > 0)
    # nearest of the levels -1.5, -0.5, 0.5, 1.5 (in scale units): floor(ratio) + 2, clipped to 0..3
    codes = np.clip(np.floor(ratio_BxK) + 2, 0, 3).astype(np.uint8).ravel()
    codes[count:] = 0  # padding bits are 0
    codes = np.concatenate([codes, np.zeros(-codes.size % 4, np.uint8)]).reshape(-1, 4)
    packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
    return scale_B, packed.astype(np.uint8)[:(count + 3) // 4]


def levels(payload: np.ndarray, count: int) -> np.ndarray:
    """The levels (in scale units, float32) of the first ``count`` values of a packed 2-bit payload."""
    return np.take(_BYTE_LEVELS, np.frombuffer(payload, np.uint8), axis=0).reshape(-1)[:count]


def block_sum_squares(block: int, payload: np.ndarray | bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """Per block, Σ level² over the ``count`` values of ``payload`` (whole blocks, the last maybe partial), float64:
    times the block's scale², the squared L2 norm of its dequantized values."""
    sq = np.square(levels(np.frombuffer(payload, np.uint8), count), dtype=np.float32)
    n_blocks = -(-count // block)
    padded = np.zeros(n_blocks * block, np.float32)
    padded[:count] = sq
    return padded.reshape(n_blocks, block).sum(axis=1, dtype=np.float64)


def padding_ok(last_byte: int, n: int) -> bool:
    """Whether the last payload byte of ``n`` values has its unused high bits (``n`` not a multiple of 4) at 0."""
    return n % 4 == 0 or last_byte >> (2 * (n % 4)) == 0
