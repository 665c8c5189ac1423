"""The round screen's direction pass (``coordinator.merge_rule = "screened_mean"``): each pending push's cosine
with a reference direction, streamed over the merger's spools (:func:`direction_cosines`, what
``coordinator.merger.Merger.direction_cosines`` returns)."""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

from coordinator.merge_io import read_into
from coordinator.merge_types import SLAB_TARGET, MergeOptions, screen_budget
from dtrain.steps.outer import coordinate_median
from dtrain.train.fragments import Range


def direction_cosines(k: int, opts: MergeOptions, part: Range, momentum: Path,
                      stack: Callable[[int, int], np.ndarray]) -> tuple[list[float], str]:
    """``screened_mean``'s direction screen over the ``k`` pending pushes of the fragment ``part`` (the whole θ
    without fragments), ``stack(start, count)`` giving their rows and ``momentum`` the outer momentum's file: each
    pending push's cosine (its values times its clip factor) with
    a reference direction, in pending order, and what the reference is ("": none, every cosine 1). With 3 or
    more pending pushes the reference is their coordinate median; with fewer (no majority to take a median
    of: a round where one or two islands push, e.g. the last rounds of a shard taken over) it is the outer
    momentum, the direction of the recent merged updates (none before the first merge). One streaming pass
    over the spools, an eighth of a slab at a time on the step's threads, memory pushes × slab / 8 per thread:
    the dot products, the pushes' and the reference's sums of squares, summed over the pieces. A push or a
    reference of norm 0 gets 1 (no direction to disagree with).

    The pieces read are a sample: when the fragment holds more than :func:`screen_budget` values (about
    ``opts.screen_values``; with more than 4 pushes a share of 4 × that, at least ``opts.screen_min_values``),
    about that many of them, in pieces drawn uniformly without replacement, afresh each call from a seed of
    ``secrets`` (a pusher cannot know which coordinates are checked, so it cannot be honest on exactly
    those); otherwise every piece. The cosine of a uniform sample of ~1M coordinates estimates the whole
    vectors' to about 1e-3 (a reversed push's stays near −1), and the screen's cost stops growing with the
    model: the coordinate median runs on that many values per push, not the whole fragment, so it no longer
    keeps the coordinator's cores busy for seconds while heartbeats wait (``np.partition`` lets go of the
    GIL; what starved them was the CPU time)."""
    if not k:
        return [], ""
    # Pieces of an eighth of a slab: the pass holds two (pushes × piece) arrays per thread (the rows and the
    # median's transposed copy), 8 MiB each with 64 pushes, where whole slabs took 64 MiB each.
    whole = math.lcm(opts.up_block or opts.block, opts.down_block or opts.block)
    slab, by_median = max(1, SLAB_TARGET // 8 // whole) * whole, k >= 3
    starts = np.arange(0, part.size, slab)
    want = max(1, -(-screen_budget(opts, k) // slab))  # pieces in the budget
    if want < starts.size:
        rng = np.random.default_rng(secrets.randbits(128))  # unpredictable: fresh per round, not from θ
        starts = np.sort(rng.choice(starts, want, replace=False))  # in file order: forward reads
    fd = None if by_median else os.open(momentum, os.O_RDONLY)

    def terms(s: int) -> tuple[np.ndarray, float, np.ndarray]:
        rows = stack(s, min(s + slab, part.size) - s)
        if fd is None:
            ref = coordinate_median(rows)
        else:
            ref = np.empty(rows.shape[1], np.float32)
            read_into(fd, ref, 4 * (part.start + s))
        return (np.einsum("ij,j->i", rows, ref, dtype=np.float64),  # buffered: no float64 copy of the rows
                float(np.einsum("i,i->", ref, ref, dtype=np.float64)),
                np.einsum("ij,ij->i", rows, rows, dtype=np.float64))

    dots, ref_sq, sq = np.zeros(k), 0.0, np.zeros(k)
    try:
        with futures.ThreadPoolExecutor(max(1, opts.threads), thread_name_prefix="screen") as pool:
            for d, r, q in pool.map(terms, (int(x) for x in starts)):
                dots += d
                ref_sq += r
                sq += q
    finally:
        if fd is not None:
            os.close(fd)
    if not ref_sq > 0:
        return [1.0] * k, ""
    what = (f"the coordinate median of the {k} pushes of its round" if by_median
            else "the outer momentum (the direction of the recent merged updates)")
    return [float(d / math.sqrt(q * ref_sq)) if q > 0 else 1.0 for d, q in zip(dots, sq, strict=True)], what
