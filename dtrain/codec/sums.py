"""The weighted sum of several int8 segments at once: :func:`dequantize_sum`, the coordinator's outer-step sum.

:func:`dtrain.codec.quant.dequantize_add` adds one push's segment: its codes cast to float32, times each block's
scale (a broadcast multiply, numpy's slowest step of the three: it fills a buffer with each row's scale), added to
the sum. Here a group of pushes is cast at once and summed by one ``np.einsum`` whose inner loop is a fused
multiply-by-scalar-and-add per block row: about a third less CPU per push than one ``dequantize_add`` each
(docs/benchmarks.md, Scale). The running sum enters the einsum as its first row (times 1), so each value is
``((out + w0·v0) + w1·v1) + …`` in push order: the same float32 result, bit for bit, as one ``dequantize_add`` per
push.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dequantize_sum"]


def dequantize_sum(block: int, scales: np.ndarray, codes: np.ndarray, weights: np.ndarray, out: np.ndarray,
                   work: np.ndarray, total: np.ndarray) -> None:
    """``out += Σ_g weights[g] · values_g`` over a group of int8 segments of whole blocks (from a block boundary).

    Args:
        block: values per block.
        scales: float32 (G, blocks): each segment's block scales, already checked.
        codes: int8 (G, values): each segment's codes, already checked (no -128).
        weights: float32 (G,): each segment's factor.
        out: float32 (values,), a whole number of blocks; updated in place.
        work: float32 scratch of at least (G + 1) x values; total: float32 scratch of at least ``values``.
    """
    g, count = codes.shape
    if count % block or scales.shape != (g, count // block) or weights.shape != (g,) or out.size != count:
        raise ValueError(f"dequantize_sum: {g} segments of {count} values in blocks of {block}, scales "
                         f"{scales.shape}, weights {weights.shape}, out {out.size}")
    nb = count // block
    f = work[:(g + 1) * count].reshape(g + 1, nb, block)
    f[0] = out.reshape(nb, block)  # the running sum first, times 1 (exact)
    np.copyto(f[1:], codes.reshape(g, nb, block), casting="unsafe")  # int8 -> float32: exact
    c = np.empty((g + 1, nb), np.float32)
    c[0] = 1.0
    np.multiply(scales, weights[:, None], out=c[1:])
    s = total[:count].reshape(nb, block)
    np.einsum("gbk,gb->bk", f, c, out=s)  # in g order: ((out + c1·v1) + c2·v2) + ...
    out[:] = total[:count]
