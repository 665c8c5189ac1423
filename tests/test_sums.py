"""codec.dequantize_sum (several int8 pushes summed by one einsum) and the merger's grouped int8 sum: the same float32
sum, bit for bit, as one dequantize_add per push in push order, and bad shapes refused."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import merge_io, merge_types
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config

BLOCK = 64


def _one_by_one(scales, codes, weights, out, block=BLOCK):
    for s, c, w in zip(scales, codes, weights, strict=True):
        codec.dequantize_add(8, block, s, c.view(np.uint8), out, weight=w)


@pytest.mark.parametrize(("group", "block", "blocks"), [
    (1, BLOCK, 40), (2, BLOCK, 40), (7, BLOCK, 40),
    (3, BLOCK, 2 * codec.sum_piece_values(BLOCK) // BLOCK + 5),  # two whole pieces and a part of one
    (2, 2 * codec.sums.PIECE, 3),  # blocks larger than a piece: one block at a time
])
def test_the_grouped_sum_is_the_one_by_one_sum_bit_for_bit(group, block, blocks):
    """Whatever the pieces it is cast and summed in (the scratch no larger than one piece: sum_piece_values)."""
    rng = np.random.default_rng(group)
    n = blocks * block
    codes = rng.integers(-127, 128, (group, n), dtype=np.int8)
    scales = (rng.random((group, blocks)) * 1e-2).astype(np.float32)
    weights = (rng.random(group) * 3).astype(np.float32)
    start = rng.normal(size=n).astype(np.float32)  # a running sum that is not zero: its rounding order counts
    want, got = start.copy(), start.copy()
    _one_by_one(scales, codes, weights, want, block)
    piece = min(n, codec.sum_piece_values(block))
    codec.dequantize_sum(block, scales, codes, weights, got, np.empty((group + 1) * piece, np.float32),
                         np.empty(piece, np.float32))
    assert np.abs(got - start).max() > 0 and np.array_equal(got, want)


def test_a_bad_shape_is_refused_and_the_sum_is_untouched():
    n = 4 * BLOCK
    out = np.ones(n, np.float32)
    codes, scales, weights = np.ones((2, n), np.int8), np.ones((2, 4), np.float32), np.ones(2, np.float32)
    work, total = np.empty(3 * n, np.float32), np.empty(n, np.float32)
    for bad in ((np.ones((2, n + 1), np.int8), scales, weights), (codes, np.ones((2, 3), np.float32), weights),
                (codes, scales, np.ones(3, np.float32))):
        with pytest.raises(ValueError, match="dequantize_sum"):
            codec.dequantize_sum(BLOCK, *bad, out, work, total)
    assert np.array_equal(out, np.ones(n, np.float32))


@pytest.mark.parametrize("slab", [256, 1 << 16])
def test_the_merger_sums_more_pushes_than_a_group_as_one_by_one(tmp_path, monkeypatch, slab):
    """More int8 pushes than merge_io.SUM_GROUP (two groups and a part), over one slab and over many (with a
    partial last block, which takes the one-by-one path): Merger.pending_sum is the one-by-one sum, bit for bit."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(merge_types, "SLAB_TARGET", slab)
    n = 50 * BLOCK + 17
    cfg = replace(Config(), codec={"up": "int8", "down": "int8", "block": BLOCK},
                  coordinator={"merge_rule": "mean", "mode": "sync"})
    m = Merger(np.zeros(n, np.float32), MergeOptions.from_config(cfg))
    rng = np.random.default_rng(5)
    want = np.zeros(n, np.float32)
    pushes = 2 * merge_io.SUM_GROUP + 3
    for i in range(pushes):
        w = float(rng.uniform(0.5, 2.0))
        q = codec.quantize(rng.normal(size=n).astype(np.float32), 8, BLOCK)
        with m.spool() as sp:
            sp.write(codec.encode(q))
            m.validate(sp)
            m.add_pending(sp, w, key=str(i))
        codec.dequantize_add(8, BLOCK, q.scales, q.payload, want, weight=np.float32(w))
    assert m.pending_count == pushes
    got = m.pending_sum()
    assert np.abs(got).max() > 0 and np.array_equal(got, want)
    m.close()
