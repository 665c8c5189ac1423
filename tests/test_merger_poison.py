"""Deltas cannot poison θ in the coordinator's merger: push norms measured as the spool validates, what a push
costs (no BLAS call, written once and read once), robust rules against numpy, the clip, the finite check, the
direction screen."""

import dataclasses
import os

import numpy as np
import pytest

from coordinator import merger as merger_mod
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from coordinator.spool import Spool
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config
from merger_helpers import BLOCK, N, in_tmp, opts, push, push_keyed, slabs  # noqa: F401  (in_tmp, slabs: autouse fixtures)

# -- deltas cannot poison θ: norms, robust rules, the finite check --------------------------------------------


@pytest.mark.parametrize("up", ["int8", "int4", "e3m0", "fp32"])
def test_the_spool_measures_the_push_norm_as_it_validates(up):
    rng = np.random.default_rng(21)
    m = Merger(np.zeros(N, np.float32), opts(up=up))
    for n_values, scale in ((N, 1.0), (N, 3e37)):
        vec = (rng.normal(size=n_values) * scale).astype(np.float32)
        want = np.linalg.norm(codec.dequantize(codec.quantize(vec, m.opts.up_bits, BLOCK)).astype(np.float64))
        assert push_keyed(m, vec, 1.0, "k") == pytest.approx(want, rel=1e-6)
    m.close()


BLAS_ENTRY_POINTS = ("dot", "vdot", "inner", "matmul", "tensordot", "outer")


@pytest.mark.parametrize("up", ["int8", "int4", "e3m0", "fp32"])
def test_the_push_and_merge_path_makes_no_blas_call(up, monkeypatch):
    """Receiving (decode, check, spool, norm) and merging pushes calls no BLAS routine: the BLAS library's threads
    spin while they wait, so pushes decoded at once on several threads took the cores from each other (the fp32
    norm was an np.dot: 8 fp32 islands cost 8x the coordinator CPU of 4). Counted, whatever the timing."""
    calls: list[str] = []
    for name in BLAS_ENTRY_POINTS:
        real = getattr(np, name)
        monkeypatch.setattr(np, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    monkeypatch.setattr(np.linalg, "norm", lambda *a, **k: calls.append("linalg.norm"))
    rng = np.random.default_rng(5)
    m = Merger(rng.normal(size=N).astype(np.float32), opts(up=up, rule="screened_mean"))
    frames = [codec.encode(codec.quantize(rng.normal(size=N).astype(np.float32), m.opts.up_bits, BLOCK))
              for _ in range(3)]
    for round_ in range(2):
        for i, frame in enumerate(frames):
            with m.spool() as sp:
                for piece in range(0, len(frame), 1000):  # the chunks of a stream
                    sp.write(frame[piece:piece + 1000])
                m.validate(sp)
                m.add_pending(sp, 1.0 + i, key=f"{round_}-{i}")
        m.direction_cosines()  # the round screen's pass (the default rule's)
        m.outer_step()
    m.close()
    assert calls == []


@pytest.mark.parametrize("up", ["int8", "int4", "e3m0", "fp32", "sparse"])
def test_a_push_is_written_once_and_read_once(up, monkeypatch):
    """Work per push, counted: spooling a push writes its decompressed body once (scales ‖ payload, no more), and
    the outer step reads each pending push's body once (dense codecs: exactly its payload, the scales being kept in
    memory since the push was accepted; sparse: its scales and records, at most its size) and nothing else of it,
    whatever the number of pushes and slabs. A second pass over the pushes (a norm re-read, a copy) would grow each
    round's work with the islands."""
    rng = np.random.default_rng(8)
    m = Merger(rng.normal(size=N).astype(np.float32), opts(up=up))
    bits, block = m.opts.up_bits, m.opts.up_block or m.opts.block
    written: dict[int, int] = {}
    read: dict[int, int] = {}
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        written[fd] = written.get(fd, 0) + n
        return n

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        read[fd] = read.get(fd, 0) + n
        return n

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    sizes = {}
    for i in range(4):
        q = codec.quantize(rng.normal(size=N).astype(np.float32), bits, block, Config().codec.density)
        written.clear()
        with m.spool() as sp:
            sp.write(codec.encode(q))
            m.validate(sp)
            m.add_pending(sp, 1.0 + i, key=str(i))
            body = 4 * q.scales.size + q.payload.size
            assert written == {sp.fd: body}  # the body, once; the spool writes nothing else
            sizes[sp.fd] = body if codec.is_sparse(bits) else q.payload.size
            if bits == 32:  # no scales: the body is the payload
                assert sp.scales is None
            elif not codec.is_sparse(bits):  # the scales stay in memory, exactly the frame's
                assert np.array_equal(sp.scales, q.scales)
    read.clear()
    m.outer_step()
    pushes = {fd: read.get(fd, 0) for fd in sizes}
    if codec.is_sparse(bits):  # the chunks' scales and records, never a byte twice
        assert all(0 < pushes[fd] <= sizes[fd] for fd in sizes), (pushes, sizes)
    else:
        assert pushes == sizes
    m.close()


@pytest.mark.parametrize("up", ["int8", "int4", "int2", "e3m0"])
def test_the_merge_takes_a_pending_push_s_scales_from_memory(up):
    """An accepted push's scales stay in memory (the spool's ``scales``, exactly the frame's) and the merge's sum
    uses them, not the spool file's copy: with the scales on disk overwritten, the pending sum is still the
    decoded values, weighted. A dequantized value is its code times its block's scale, so a sum that read the
    file would come out zero."""
    rng = np.random.default_rng(21)
    m = Merger(np.zeros(N, np.float32), opts(up=up))
    bits = m.opts.up_bits
    want = np.zeros(N, np.float32)
    for i, w in enumerate((1.0, 2.5)):
        q = codec.quantize(rng.normal(size=N).astype(np.float32), bits, BLOCK)
        with m.spool() as sp:
            sp.write(codec.encode(q))
            m.validate(sp)
            m.add_pending(sp, w, key=str(i))
            assert sp.scales is not None and np.array_equal(sp.scales, q.scales) and not sp.scales.flags.writeable
            os.pwrite(sp.fd, bytes(4 * q.scales.size), 0)  # the file's scales: zeros from here on
        codec.dequantize_add(bits, BLOCK, q.scales, q.payload, want, weight=w)
    got = m.pending_sum()
    assert np.abs(got).max() > 0 and np.array_equal(got, want)
    m.close()


@pytest.mark.parametrize("rule,trim", [("trimmed_mean", 1), ("trimmed_mean", 2), ("median", 0)])
@pytest.mark.parametrize("pushes", [3, 4, 5])
def test_robust_rules_match_numpy_on_the_full_vectors(rule, trim, pushes):
    """The merger's slab-by-slab rule vs numpy's on whole vectors: with lr 1, no momentum and a lossless down
    path, θ1 = θ0 − rule(c_i·Δ_i). One push is poisoned (x1e6), one clipped (c = 0.5)."""
    rng = np.random.default_rng(pushes)
    theta = rng.normal(size=N).astype(np.float32)
    o = dataclasses.replace(opts(up="int8", down="fp32", lr=1.0, momentum=0.0, nesterov=False), rule=rule,
                            trim=trim)
    m = Merger(theta.copy(), o)
    vecs = [rng.normal(size=N).astype(np.float32) * 0.01 for _ in range(pushes)]
    vecs[1] *= 1e6
    scales = [1.0, 1.0, 0.5] + [1.0] * (pushes - 3)
    for i, (v, c) in enumerate(zip(vecs, scales, strict=True)):
        push_keyed(m, v, float(1 + i), f"p{i}", scale=c)  # weights do not count in these rules
    rows = np.stack([np.float32(c) * codec.dequantize(codec.quantize(v, 8, BLOCK))
                     for v, c in zip(vecs, scales, strict=True)])
    if rule == "median":
        want = np.median(rows, axis=0)
    else:
        k = min(trim, (pushes - 1) // 2)
        want = np.sort(rows, axis=0)[k:pushes - k].mean(axis=0)
    m.outer_step()
    np.testing.assert_allclose(m.theta, theta - want, rtol=1e-5, atol=1e-5)
    assert np.abs(m.theta - theta).max() < 1.0  # the poisoned push did not get through


def test_the_clip_factor_scales_a_push_in_the_mean():
    rng = np.random.default_rng(8)
    m = Merger(np.zeros(N, np.float32), opts(up="fp32", down="fp32", lr=1.0, momentum=0.0, nesterov=False))
    a, b = (rng.normal(size=N).astype(np.float32) for _ in range(2))
    push_keyed(m, a, 1.0, "a", scale=0.25)
    push_keyed(m, b, 3.0, "b")
    m.outer_step()
    np.testing.assert_allclose(m.theta, -(0.25 * 1.0 * a + 3.0 * b) / 4.0, rtol=1e-5, atol=1e-6)


def _poisoned_merger(rule: str = "mean") -> tuple[Merger, np.ndarray, list[np.ndarray]]:
    """θ0 and two pending pushes: an honest one and an int8 frame of 3e38 values, weighted 1e9 (the island's
    word for its tokens, unchecked here)."""
    rng = np.random.default_rng(30)
    theta = rng.normal(size=N).astype(np.float32)
    m = Merger(theta.copy(), dataclasses.replace(opts(up="int8", down="int8"), rule=rule))
    honest = rng.normal(size=N).astype(np.float32) * 1e-3
    poison = np.full(N, 3e38, np.float32)
    push_keyed(m, honest, 640.0, "honest")
    push_keyed(m, poison, 1e9, "poison")
    return m, theta, [honest, poison]


def test_a_plain_mean_without_the_guards_poisons_theta(monkeypatch):
    """What the guards stop: the same merge with the finite check bypassed leaves θ non-finite."""
    monkeypatch.setattr(Merger, "_check_finite", lambda self, what, start, values: None)
    for down in (8, 32):
        m, theta, _ = _poisoned_merger()
        m.opts = dataclasses.replace(m.opts, down_bits=down)
        with np.errstate(over="ignore", invalid="ignore"):
            m.outer_step()
        assert m.version == 1 and np.abs(m.momentum).min() > 1e38  # m = μ·0 + Δ ≈ 3e38
        with np.errstate(over="ignore", invalid="ignore"):
            moved = np.abs(m.theta.astype(np.float64) - theta)
        assert not np.isfinite(moved).all() or moved.max() > 1e30  # θ: inf (lossless) or absurd (int8)


def test_a_non_finite_outer_step_commits_nothing_and_blames_the_largest_push():
    m, theta, (honest, _) = _poisoned_merger()
    before = {name: path.read_bytes() for name, path in m.state_files().items()}
    with pytest.raises(merger_mod.NonFiniteResult) as e:
        m.outer_step()
    assert e.value.blame == "poison" and e.value.what.startswith("update[0] = ")  # -0.7·(Δ + 0.9·m): -inf
    assert "the outer step for version 1 makes" in str(e.value) and "blamed: push poison" in str(e.value)
    assert m.version == 0 and m.pending_count == 2 and m.updates_since(0) == []
    assert {name: path.read_bytes() for name, path in m.state_files().items()} == before
    assert list(m.state_dir.glob("*.tmp")) == [] and not list(m.spool_dir.glob("update-*.frame"))
    m.drop_pending([e.value.blame])
    assert m.pending_count == 1 and m.total_weight == 640.0
    update = m.outer_step()  # the run goes on without it
    assert update.version == 1 == m.version and np.isfinite(m.theta).all()
    assert np.abs(m.theta - theta).max() < 0.1


@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_robust_rules_blame_by_norm_alone(rule):
    m, _, _ = _poisoned_merger(rule)
    assert m._blame().key == "poison"


def test_a_closed_spool_is_freed_without_the_cyclic_gc(tmp_path):
    """The validator refers back to its spool, and zstd's writer to its validator (its sink): unless close() and the
    validator's finish() break those cycles, every push's decompression context (megabytes of native memory) waits
    for Python's cyclic GC, and the coordinator's resident size grows with every round (benchmarks/scale.py: about
    3 MiB per push at 25M parameters)."""
    import gc
    import weakref

    n, block = 10_000, 1024
    frame = codec.encode(codec.quantize(np.random.default_rng(0).standard_normal(n, dtype=np.float32), 8, block), 3)
    for broken in (False, True):
        spool = Spool(tmp_path, n, 8, block)
        gc.disable()
        try:
            if broken:  # a corrupt body: the validator raises mid-stream
                with pytest.raises(codec.CodecError):
                    spool.write(frame[:-8] + bytes(8))
                    spool.finish()
            else:
                spool.write(frame)
                spool.finish()
            validator = weakref.ref(spool._validator)
            spool.close()
            ref = weakref.ref(spool)
            del spool
            assert ref() is None and validator() is None, "a reference cycle keeps the spool or its validator"
        finally:
            gc.enable()


def test_clipped_mean_caps_each_push_at_clip_ratio_times_the_rounds_median_norm():
    """clipped_mean: the weighted mean of the pushes, each clipped to clip_ratio x the median norm of the round's
    pushes; pushes within it are untouched (lossless codec, lr 1, no momentum: θ1 = θ0 − Δ)."""
    rng = np.random.default_rng(12)
    o = dataclasses.replace(opts(up="fp32", down="fp32", lr=1.0, momentum=0.0, nesterov=False),
                            rule="clipped_mean", clip_ratio=1.5)
    m = Merger(np.zeros(N, np.float32), o)
    vecs = [rng.normal(size=N).astype(np.float32) for _ in range(4)]
    vecs[3] *= -20.0  # a Byzantine push: 20 x the others' norm
    for i, v in enumerate(vecs):
        push_keyed(m, v, 1.0, f"p{i}")
    norms = [float(np.linalg.norm(v)) for v in vecs]
    caps = merger_mod.round_clip_factors(norms, [1.0] * 4, 1.5)
    bound = 1.5 * float(np.median(norms))
    assert caps[:3] == [1.0, 1.0, 1.0] and caps[3] == pytest.approx(bound / norms[3])
    m.outer_step()
    want = -(vecs[0] + vecs[1] + vecs[2] + np.float32(caps[3]) * vecs[3]) / 4.0
    np.testing.assert_allclose(m.theta, want, rtol=1e-4, atol=1e-5)


def test_direction_cosines_match_numpy_on_the_full_vectors():
    """screened_mean's screen: each pending push's cosine with the coordinate median of the pending pushes (each
    times its clip factor), slab by slab, equals numpy's on the whole dequantized vectors; a push of norm 0 has no
    direction (1)."""
    rng = np.random.default_rng(14)
    m = Merger(np.zeros(N, np.float32), dataclasses.replace(opts(up="int8"), rule="screened_mean"))
    honest = rng.normal(size=N).astype(np.float32)
    vecs = [honest + rng.normal(size=N).astype(np.float32) for _ in range(3)] + [-1.0 * honest]
    vecs.append(np.zeros(N, np.float32))
    scales = [1.0, 0.5, 1.0, 1.0, 1.0]
    for i, (v, c) in enumerate(zip(vecs, scales, strict=True)):
        push_keyed(m, v, 1.0, f"p{i}", scale=c)
    rows = np.stack([np.float32(c) * codec.dequantize(codec.quantize(v, 8, BLOCK))
                     for v, c in zip(vecs, scales, strict=True)]).astype(np.float64)
    med = np.median(rows, axis=0)
    want = [float(r @ med / (np.linalg.norm(r) * np.linalg.norm(med))) for r in rows[:4]] + [1.0]
    got, reference = m.direction_cosines()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert min(got[:3]) > 0.5 and got[3] < -0.5  # the honest agree with the median, the reversed one does not
    assert reference == "the coordinate median of the 5 pushes of its round"
    assert Merger(np.zeros(N, np.float32), opts()).direction_cosines() == ([], "")


def test_over_its_budget_the_direction_screen_samples_random_pieces_and_still_catches_a_reversed_push(monkeypatch):
    """A fragment larger than ``screen_values``: the screen reads about that many values per push (whole pieces,
    not every one), a different random set each call, and the sampled cosines stay within 0.02 of the exact
    ones on the whole vectors; the reversed push is still far below the honest ones."""
    n, budget = 200_000, 1 << 16
    rng = np.random.default_rng(16)
    m = Merger(np.zeros(n, np.float32), dataclasses.replace(opts(up="int8"), rule="screened_mean",
                                                            screen_values=budget))
    honest = rng.normal(size=n).astype(np.float32)
    vecs = [honest + rng.normal(size=n).astype(np.float32) * s for s in (0.5, 1.0, 2.0)] + [-1.0 * honest]
    for i, v in enumerate(vecs):
        push_keyed(m, v, 1.0, f"p{i}")
    exact = _median_cosines(vecs)
    read = _pieces_read(monkeypatch)
    samples = []
    for _ in range(4):
        read.clear()
        got, reference = m.direction_cosines()
        np.testing.assert_allclose(got, exact, atol=0.02)
        assert min(got[:3]) > 0.3 and got[3] < -0.5
        assert reference == "the coordinate median of the 4 pushes of its round"
        piece = max(c for _, c in read)  # the last piece may be shorter
        assert len(read) == -(-budget // piece) and sum(c for _, c in read) <= budget + piece - 1 < n
        samples.append(tuple(sorted(s for s, _ in read)))
    assert len(set(samples)) > 1  # a fresh random choice each round


def test_with_many_pushes_the_screen_shares_its_budget_and_still_catches_a_reversed_push(monkeypatch):
    """More than 4 pushes: each gets its share of 4 x ``screen_values`` (at least ``screen_min_values``), so the
    screen's cost stays that of 4 pushes; the sampled cosines stay within 0.03 of the exact ones and the reversed
    push is still far below the honest ones."""
    from coordinator.merge_types import screen_budget

    n, budget, k = 200_000, 1 << 16, 16
    rng = np.random.default_rng(18)
    o = dataclasses.replace(opts(up="int8"), rule="screened_mean", screen_values=budget, screen_min_values=1 << 13)
    assert screen_budget(o, 4) == budget and screen_budget(o, k) == budget * 4 // k
    assert screen_budget(dataclasses.replace(o, screen_min_values=1 << 15), 64) == 1 << 15  # the floor
    m = Merger(np.zeros(n, np.float32), o)
    honest = rng.normal(size=n).astype(np.float32)
    vecs = [honest + rng.normal(size=n).astype(np.float32) for _ in range(k - 1)] + [-1.0 * honest]
    for i, v in enumerate(vecs):
        push_keyed(m, v, 1.0, f"p{i}")
    exact = _median_cosines(vecs)
    read = _pieces_read(monkeypatch)
    got, _ = m.direction_cosines()
    np.testing.assert_allclose(got, exact, atol=0.03)
    assert min(got[:-1]) > 0.3 and got[-1] < -0.5
    piece = max(c for _, c in read)
    assert sum(c for _, c in read) <= budget * 4 // k + piece - 1  # a quarter of one push's full budget


def test_over_its_budget_the_momentum_reference_is_sampled_at_the_same_coordinates():
    """Fewer than 3 pushes over the budget: the momentum is read at the sampled pieces' offsets, so the sampled
    cosines stay within 0.02 of the exact ones on the whole vectors, and the reversed push is caught."""
    n = 200_000
    rng = np.random.default_rng(17)
    m = Merger(np.zeros(n, np.float32), dataclasses.replace(opts(up="fp32", down="fp32"), rule="screened_mean",
                                                            screen_values=1 << 16))
    honest = rng.normal(size=n).astype(np.float32)
    push_keyed(m, honest, 1.0, "first")
    m.outer_step()  # m = Δ = honest
    later = honest + 1.5 * rng.normal(size=n).astype(np.float32)
    push_keyed(m, later, 1.0, "honest")
    push_keyed(m, -later, 1.0, "reversed")
    momentum = m.momentum.astype(np.float64)
    exact = [float(v @ momentum / (np.linalg.norm(v) * np.linalg.norm(momentum))) for v in (later, -later)]
    got, _ = m.direction_cosines()
    np.testing.assert_allclose(got, exact, atol=0.02)
    assert got[0] > 0.3 and got[1] < -0.3


def test_with_fewer_than_three_pushes_the_direction_reference_is_the_outer_momentum():
    """A round of one or two pushes has no majority: each push is compared with the outer momentum (the recent
    merged updates' direction; none before the first merge: every cosine 1). Lossless, momentum 0.9."""
    rng = np.random.default_rng(15)
    m = Merger(np.zeros(N, np.float32), dataclasses.replace(opts(up="fp32", down="fp32"), rule="screened_mean"))
    honest = rng.normal(size=N).astype(np.float32)
    push_keyed(m, honest, 1.0, "first")
    assert m.direction_cosines() == ([1.0], "")  # momentum 0: no reference yet
    m.outer_step()  # m = Δ = honest
    later = honest + rng.normal(size=N).astype(np.float32)
    push_keyed(m, later, 1.0, "honest")
    push_keyed(m, -later, 1.0, "reversed")
    got, reference = m.direction_cosines()
    momentum = m.momentum.astype(np.float64)
    want = [float(v @ momentum / (np.linalg.norm(v) * np.linalg.norm(momentum))) for v in (later, -later)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[0] > 0.5 > -0.5 > got[1]
    assert reference == "the outer momentum (the direction of the recent merged updates)"


def test_a_minus_3x_island_does_not_move_the_merged_theta_far_by_default():
    """One island of four pushing −3 x its honest delta: the default merge rule (screened_mean: the round screen,
    as coordinator.rounds_loop runs it, rejects the push pointing away from the round's coordinate median, and the
    rest are averaged) keeps the merged Δ near the honest one (the mean would cancel it: (3·d − 3·d)/4 = 0).
    θ1 = θ0 − Δ (lr 1, no momentum, lossless down)."""
    from coordinator.admission import screen_round
    from coordinator.records import PushInfo

    rng = np.random.default_rng(13)
    cfg = replace(Config(), codec={"up": "int8", "down": "fp32", "block": BLOCK},
                  outer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
    m = Merger(np.zeros(N, np.float32), MergeOptions.from_config(cfg))
    honest = rng.normal(size=N).astype(np.float32) * 0.01
    pushes = [honest + rng.normal(size=N).astype(np.float32) * 0.002 for _ in range(3)]
    pushes.append(-3.0 * honest)
    norms = [push_keyed(m, v, 1000.0, f"p{i}") for i, v in enumerate(pushes)]
    assert m.opts.rule == "screened_mean"
    infos = [PushInfo(f"p{i}", f"island-{i}", 0, 1000, 10, 0, 80, i) for i in range(4)]
    screened = screen_round(cfg.coordinator, infos, norms, *m.direction_cosines())
    assert [p for p, _ in screened] == ["p3"] and "points away from the others: cosine -" in screened[0][1]
    m.drop_pending(["p3"])
    m.outer_step()
    merged = -m.theta
    assert np.linalg.norm(merged - honest) < 0.5 * np.linalg.norm(honest), m.opts.rule
    assert float(np.dot(merged, honest)) > 0.5 * float(np.dot(honest, honest))


def _median_cosines(vecs: list[np.ndarray]) -> list[float]:
    """Each int8-coded vector's exact cosine with their coordinate median, over every value (what the screen's
    sample estimates)."""
    rows = np.stack([codec.dequantize(codec.quantize(v, 8, BLOCK)) for v in vecs]).astype(np.float64)
    med = np.median(rows, axis=0)
    return [float(r @ med / (np.linalg.norm(r) * np.linalg.norm(med))) for r in rows]


def _pieces_read(monkeypatch) -> list[tuple[int, int]]:
    """The (start, count) of every piece the screen stacks from here on, in order."""
    read: list[tuple[int, int]] = []
    stack = Merger.stack_pending
    monkeypatch.setattr(Merger, "stack_pending", lambda self, s, c: read.append((s, c)) or stack(self, s, c))
    return read
