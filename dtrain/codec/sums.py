"""The weighted sum of several int8 segments at once: :func:`dequantize_sum`, the coordinator's outer-step sum.

:func:`dtrain.codec.quant.dequantize_add` adds one push's segment: its codes cast to float32, times each block's
scale (a broadcast multiply, numpy's slowest step of the three: it fills a buffer with each row's scale), added to
the sum. Here a group of pushes is cast at once and summed by one ``np.einsum`` whose inner loop is a fused
multiply-by-scalar-and-add per block row: about a third less CPU per push than one ``dequantize_add`` each
(docs/benchmarks.md, Scale). The running sum enters the einsum as its first row (times 1), so each value is
``((out + w0·v0) + w1·v1) + …`` in push order: the same float32 result, bit for bit, as one ``dequantize_add`` per
push.

The group's values are cast and summed :data:`PIECE` values at a time: the float32 rows of a piece, (G + 1) x 64
KiB, stay in a core's L2 cache between the cast and the einsum that reads them back. A whole 64K-value slab of 13
rows (3.3 MiB) spilled to memory and cost a fifth more CPU for the sum (docs/benchmarks.md, "Line rate, third
pass").
"""

from __future__ import annotations

import numpy as np

__all__ = ["PIECE", "dequantize_sum", "sum_piece_values"]

PIECE = 1 << 14  # values cast and summed at once (a whole block at least)


def dequantize_sum(block: int, scales: np.ndarray, codes: np.ndarray, weights: np.ndarray, out: np.ndarray,
                   work: np.ndarray, total: np.ndarray) -> None:
    """``out += Σ_g weights[g] · values_g`` over a group of int8 segments of whole blocks (from a block boundary).

    Args:
        block: values per block.
        scales: float32 (G, blocks): each segment's block scales, already checked.
        codes: int8 (G, values): each segment's codes, already checked (no -128).
        weights: float32 (G,): each segment's factor.
        out: float32 (values,), a whole number of blocks; updated in place.
        work: float32 scratch of at least (G + 1) x P values, P = min(values, :func:`sum_piece_values` (``block``));
            total: float32 scratch of at least P values.
    """
    g, count = codes.shape
    if count % block or scales.shape != (g, count // block) or weights.shape != (g,) or out.size != count:
        raise ValueError(f"dequantize_sum: {g} segments of {count} values in blocks of {block}, scales "
                         f"{scales.shape}, weights {weights.shape}, out {out.size}")
    nb = count // block
    c = np.empty((g + 1, nb), np.float32)
    c[0] = 1.0
    np.multiply(scales, weights[:, None], out=c[1:])
    per = sum_piece_values(block) // block  # blocks per piece
    for b0 in range(0, nb, per):
        b1 = min(nb, b0 + per)
        n, lo, hi = b1 - b0, b0 * block, b1 * block
        f = work[:(g + 1) * (hi - lo)].reshape(g + 1, n, block)
        f[0] = out[lo:hi].reshape(n, block)  # the running sum first, times 1 (exact)
        np.copyto(f[1:], codes[:, lo:hi].reshape(g, n, block), casting="unsafe")  # int8 -> float32: exact
        s = total[:hi - lo].reshape(n, block)
        np.einsum("gbk,gb->bk", f, c[:, b0:b1], out=s)  # in g order: ((out + c1·v1) + c2·v2) + ...
        out[lo:hi] = s.reshape(-1)


def sum_piece_values(block: int) -> int:
    """Values :func:`dequantize_sum` casts and sums at once: whole blocks, about :data:`PIECE` (one block at least)."""
    return max(1, PIECE // block) * block
