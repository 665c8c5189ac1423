"""The merger with sparse pushes: SparseLoCo's outer step, sparse updates at the down density, a push over the
density refused."""

import numpy as np
import pytest

from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config
from dtrain.steps.outer import OuterHParams
from merger_helpers import BLOCK, N, in_tmp, slabs  # noqa: F401  (in_tmp, slabs: autouse fixtures)

# --------------------------------------------------------------------------- sparse pushes and SparseLoCo

SPARSE_CHUNK, DENSITY = 128, 0.05  # 6 entries per chunk; N = 3000: 23 full chunks and a partial one


def sparse_opts(down: str = "sparse", rule: str = "sparseloco", **codec_fields: object) -> MergeOptions:
    cfg = replace(Config(), codec={"up": "sparse", "down": down, "block": BLOCK, "sparse_chunk": SPARSE_CHUNK,
                                   "density": DENSITY, **codec_fields},
                  coordinator={"mode": "sync", "merge_rule": "mean"},  # exact sums (auto: clipped_mean)
                  outer={"rule": rule, "sparseloco_lr": 0.8})
    return MergeOptions.from_config(cfg)


def _sparse_frame(vec: np.ndarray, density: float = DENSITY) -> bytes:
    return codec.encode(codec.quantize(vec, "sparse2", SPARSE_CHUNK, density))


def test_sparseloco_options_come_from_the_config():
    o = sparse_opts()
    assert o.outer == OuterHParams(lr=0.8, momentum=0.0, nesterov=False, rule="sparseloco")
    assert (o.up_bits, o.down_bits, o.up_block, o.down_block, o.max_count) == ("sparse2", "sparse2", 128, 128, 6)
    assert o.slab % SPARSE_CHUNK == 0 and o.slab % BLOCK == 0


@pytest.mark.parametrize("down", ["sparse", "int8", "fp32"])
def test_sparse_pushes_merge_into_the_sparseloco_step(down):
    """Σ w·Δ of sparse pushes equals the dense sum; θ moves by −lr·mean (no momentum: it stays zero); a sparse
    update touches at most the union of the pushes' entries; islands hold the coordinator's θ bit for bit."""
    rng = np.random.default_rng(30)
    theta = rng.normal(size=N).astype(np.float32)
    m = Merger(theta.copy(), sparse_opts(down=down, error_feedback=False))
    island = theta.copy()
    for _ in range(2):
        deltas = [rng.normal(size=N).astype(np.float32) for _ in range(3)]
        sent = [codec.dequantize(codec.decode(_sparse_frame(d))) for d in deltas]
        for d, w in zip(deltas, (1.0, 2.0, 1.0), strict=True):
            with m.spool() as sp:
                sp.write(_sparse_frame(d))
                m.validate(sp)
                m.add_pending(sp, w)
        dense = sent[0] + 2 * sent[1] + sent[2]
        np.testing.assert_allclose(m.pending_sum(), dense, rtol=1e-6, atol=1e-6)
        before = m.theta
        update = m.outer_step()
        applied = codec.dequantize(codec.decode(update.frame, expected_n=N))
        island = island + applied
        assert np.array_equal(island, m.theta)
        if down == "fp32":
            np.testing.assert_allclose(m.theta, before - 0.8 * dense / 4, rtol=0, atol=1e-6)
        if down == "sparse":
            assert not np.any(applied[dense == 0])  # density at most the union's
            touched = dense != 0
            levels_err = np.abs(applied[touched] + 0.8 * dense[touched] / 4)
            assert levels_err.max() <= 0.8 * np.abs(dense).max() / 4  # 2-bit levels of a per-chunk scale
        np.testing.assert_array_equal(m.momentum, 0)


def test_a_sparse_update_with_down_density_sends_the_top_of_each_chunk_and_keeps_the_rest():
    """codec.down_density: the update holds at most k = round(down_density·C) entries per chunk, the largest of
    u + residual; what it leaves out (union or not) waits in the down residual, so that over rounds the broadcast
    sum trails the exact updates by the residual alone; islands hold the coordinator's θ bit for bit."""
    rng = np.random.default_rng(33)
    theta = rng.normal(size=N).astype(np.float32)
    o = sparse_opts(error_feedback=True, down_density=2 / SPARSE_CHUNK)
    assert o.down_count == 2 and sparse_opts().down_count == 0
    m = Merger(theta.copy(), o)
    exact = np.zeros(N, np.float64)
    try:
        for _ in range(3):
            deltas = [rng.normal(size=N).astype(np.float32) for _ in range(3)]
            dense = np.zeros(N, np.float32)
            for d in deltas:
                dense += codec.dequantize(codec.decode(_sparse_frame(d)))
                with m.spool() as sp:
                    sp.write(_sparse_frame(d))
                    m.validate(sp)
                    m.add_pending(sp, 1.0)
            exact += -0.8 * dense / 3
            update = m.outer_step()
            q = codec.decode(update.frame, expected_n=N)
            counts = np.frombuffer(q.payload, "<u2", count=q.scales.size)
            assert counts.max() == 2 and counts.sum() <= 2 * q.scales.size  # the union held up to 18 per chunk
            residual = np.fromfile(m.state_files()["residual"], "<f4")
            np.testing.assert_allclose(m.theta - theta, exact - residual, rtol=0, atol=1e-5)
        assert np.count_nonzero(residual) > 10 * counts.sum()  # most of the union waits in the residual
    finally:
        m.close()


def test_a_sparse_push_above_the_density_is_refused_and_changes_nothing():
    rng = np.random.default_rng(31)
    m = Merger(np.zeros(N, np.float32), sparse_opts())
    with m.spool() as sp:
        with pytest.raises(codec.CodecError, match="at most 6 entries per chunk|above the 6 per chunk"):
            sp.write(_sparse_frame(rng.normal(size=N).astype(np.float32), density=0.1))
            m.validate(sp)
    assert m.pending_count == 0
    with pytest.raises(RuntimeError, match="no pending push"):
        m.outer_step()
    assert np.array_equal(m.theta, np.zeros(N, np.float32)) and m.version == 0


def test_the_spool_measures_a_sparse_push_norm():
    rng = np.random.default_rng(32)
    m = Merger(np.zeros(N, np.float32), sparse_opts())
    vec = rng.normal(size=N).astype(np.float32)
    with m.spool() as sp:
        sp.write(_sparse_frame(vec))
        m.validate(sp)
        want = np.linalg.norm(codec.dequantize(codec.decode(_sparse_frame(vec))).astype(np.float64))
        assert sp.norm == pytest.approx(want, rel=1e-6)
    m.close()
