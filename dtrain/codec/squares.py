"""Squared L2 norms without dequantizing: :func:`sum_squares` of float32 values and :func:`block_sum_squares`, per
block, of a quantized payload's levels (times each block's scale², the norm of its dequantized values). The
coordinator measures each push's norm with these as its chunks arrive (``coordinator/spool.py``'s BodyNorm), so
they are on its data path: numpy's own loops, never BLAS, in pieces that stay in a core's cache.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from dtrain.codec import int2
from dtrain.codec.quant import _E3M0_LEVELS, _F32_MAX, _INT4_LEVELS, Bits, _unpack_nibbles

__all__ = ["SQUARES_PIECE", "SUM_SQUARES_PIECE", "block_sum_squares", "sum_squares"]

SUM_SQUARES_PIECE = 1 << 16  # values squared at once by sum_squares (256 KiB of scratch)
# The largest |value| whose piece sum_squares squares and sums in float32: a piece of at most SUM_SQUARES_PIECE such
# values sums to at most half the float32 maximum (~3.6e16 here), so neither a square nor the sum can overflow.
_SUM_SQUARES_F32_PEAK: Final = np.float32(math.sqrt(_F32_MAX / SUM_SQUARES_PIECE) / 2)


def sum_squares(values: np.ndarray) -> float:
    """Σ value² of float32 ``values`` (any size: squared piece by piece into one small scratch buffer), as a Python
    float. Each piece is summed by numpy's pairwise float32 summation (relative error about 1e-7; the pieces add
    in float64): four times the speed of a float64-accumulating ``einsum``, and never BLAS (``np.dot`` hands
    long vectors to a thread pool whose spinning threads took the coordinator's cores). A piece holding a value
    past ~3.6e16 in magnitude (whose float32 squares or sum could overflow), or a NaN, is summed in float64
    instead: finite values always give a finite sum, and nothing overflows on the way."""
    x = values.reshape(-1)
    scratch = np.empty(min(x.size, SUM_SQUARES_PIECE), np.float32)
    total = 0.0
    for s in range(0, x.size, SUM_SQUARES_PIECE):
        part = x[s:s + SUM_SQUARES_PIECE]
        # max and min: two reductions over the piece (in cache), no temporary; NaN fails both tests
        if part.max() <= _SUM_SQUARES_F32_PEAK and -part.min() <= _SUM_SQUARES_F32_PEAK:
            piece = float(np.square(part, out=scratch[:part.size], dtype=np.float32).sum())
        else:  # float64 holds any float32 square (≤ 1.2e77) and their sum
            piece = float(np.einsum("i,i->", part, part, dtype=np.float64))
        total += piece
    return total


# int4: a payload byte → the sum of its two levels' squares (at most 2·8² = 128): the push norm's one table gather per
# two values (block_sum_squares), with no level array.
_INT4_SQUARES: Final = (_INT4_LEVELS.astype(np.int32) ** 2).sum(axis=1).astype(np.uint16)


SQUARES_PIECE = 1 << 18  # int8 values squared and summed at once by block_sum_squares (512 KiB of int16)


def block_sum_squares(bits: Bits, block: int, payload: np.ndarray | bytes | bytearray | memoryview,
                      count: int) -> np.ndarray:
    """Per block, Σ level² over the ``count`` codes of ``payload`` (whole blocks, the last one maybe partial), as
    float64: times the block's scale², the squared L2 norm of its dequantized values, with no dequantization.
    Not for bits=32 (no blocks: square the values)."""
    if bits == 2:
        return int2.block_sum_squares(block, payload, count)
    arr = np.frombuffer(payload, np.uint8)
    n_blocks = -(-count // block)
    if bits == "e3m0":
        levels = _E3M0_LEVELS[_unpack_nibbles(arr, count) & 7]
        if n_blocks * block != count:
            levels = np.concatenate([levels, np.zeros(n_blocks * block - count, np.float32)])
        levels_BxK = levels.reshape(n_blocks, block)
        return np.einsum("ij,ij->i", levels_BxK, levels_BxK).astype(np.float64)
    # int8 and int4: integer levels, squared in int16 (127² fits) and summed per block in int32 (127² x 65536 fits):
    # exact, and a third less memory traffic than float32.
    if bits == 8:
        return _int8_block_sum_squares(arr[:count].view(np.int8), block)
    # int4: one table gather per byte gives its two values' squares summed (_INT4_SQUARES), half the elements to sum
    # and no level array.
    units, block_units = -(-count // 2), block // 2
    squares = np.empty(n_blocks * block_units, np.uint16)
    squares[units:] = 0  # the last block's missing values (only that block: no zeroing of whole pieces)
    np.take(_INT4_SQUARES, arr[:units], out=squares[:units])
    if count % 2:  # the last byte's high nibble is padding, not a value
        squares[units - 1] = int(_INT4_LEVELS[arr[units - 1], 0]) ** 2
    return squares.reshape(n_blocks, block_units).sum(axis=1, dtype=np.int32).astype(np.float64)


def _int8_block_sum_squares(codes: np.ndarray, block: int) -> np.ndarray:
    """block_sum_squares of int8 ``codes`` (the last block maybe partial): squared and summed SQUARES_PIECE values
    at a time, so that the int16 squares stay in a core's L2 cache for the sum that reads them back (a fifth less
    CPU than squaring a 1 MiB chunk at once)."""
    count = codes.size
    n_blocks = -(-count // block)
    per = max(1, SQUARES_PIECE // block)  # blocks per piece
    sums = np.empty(n_blocks, np.int32)
    squares = np.empty(min(n_blocks, per) * block, np.int16)
    for b0 in range(0, n_blocks, per):
        b1 = min(n_blocks, b0 + per)
        lo, hi = b0 * block, min(b1 * block, count)
        sq = squares[:(b1 - b0) * block]
        np.square(codes[lo:hi], out=sq[:hi - lo], dtype=np.int16)
        sq[hi - lo:] = 0  # the last block's missing values
        np.add.reduce(sq.reshape(b1 - b0, block), axis=1, dtype=np.int32, out=sums[b0:b1])
    return sums.astype(np.float64)
