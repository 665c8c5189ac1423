"""The coordinator's streaming merger: the outer step against hand computation, bit-identical broadcast θ, no
partial state."""

import dataclasses
import os
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest

from coordinator import direction, merge_types
from coordinator import merger as merger_mod
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from coordinator.spool import Spool
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config, ConfigError
from dtrain.steps.outer import OuterHParams

N, BLOCK = 3000, 64


def opts(up: str = "int8", down: str = "int8", error_feedback: bool = True, keep_updates: int = 16,
         mode: str = "sync", rule: str = "mean", **outer: object) -> MergeOptions:
    """The merger options of a default config with these codec, coordinator and outer fields (block: BLOCK); the
    merge rule is the mean unless ``rule`` says otherwise (the hand computations here are of the mean)."""
    cfg = replace(Config(), codec={"up": up, "down": down, "block": BLOCK, "error_feedback": error_feedback},
                  coordinator={"keep_updates": keep_updates, "mode": mode, "merge_rule": rule}, outer=outer)
    return MergeOptions.from_config(cfg)


@pytest.fixture(params=["one-slab", "many-slabs"], autouse=True)
def slabs(request, monkeypatch):
    """Every test runs with one slab and with many (slab = 256 values: 11 full slabs and a partial one)."""
    if request.param == "many-slabs":
        monkeypatch.setattr(merge_types, "SLAB_TARGET", 256)  # the outer step's slabs (merge_types.slab_len)
        monkeypatch.setattr(direction, "SLAB_TARGET", 256)  # the round screen's pieces


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the mergers' state folders go under tmp_path


def _push(m: Merger, vec: np.ndarray, weight: float) -> None:
    with m.spool() as sp:
        sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, BLOCK)))
        m.validate(sp)
        m.add_pending(sp, weight)


def test_options_come_from_the_config():
    o = opts(up="int4", down="e3m0", error_feedback=False, keep_updates=3, lr=0.5, momentum=0.8, nesterov=False)
    assert o.outer == OuterHParams(lr=0.5, momentum=0.8, nesterov=False)
    assert (o.up_bits, o.down_bits, o.block, o.error_feedback, o.keep_updates) == (4, "e3m0", BLOCK, False, 3)
    assert o.zstd_level == Config().codec.zstd_level
    assert opts(up="fp32", down="int8").up_bits == 32
    cfg = replace(Config(), coordinator={"merge_threads": 3})
    assert MergeOptions.from_config(cfg).threads == 3 and MergeOptions.from_config(Config()).threads == 2
    with pytest.raises(ConfigError, match="merge_threads"):
        replace(Config(), coordinator={"merge_threads": 0})
    # async: every push is merged on its own, with lr / islands
    assert opts(mode="async", lr=0.8, islands=4).outer == OuterHParams(lr=0.2, momentum=0.9, nesterov=True)


def test_the_merger_and_state_machine_keep_jax_out():
    """The coordinator's resident size is a few model sizes: the JAX runtime (~190 MiB) stays out of it."""
    code = ("import sys, coordinator.merger, coordinator.state, dtrain.steps.outer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'optax', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def hand_outer_steps(theta0: np.ndarray, rounds: list[tuple[list[np.ndarray], list[float]]], lr: float,
                     mu: float, nesterov: bool) -> list[np.ndarray]:
    """θ after each round, in float64: Δ = Σ w·Δ_i / Σ w; m = μ·m + Δ; θ -= lr·(Δ + μ·m) (Nesterov) or lr·m."""
    theta, m, out = theta0.astype(np.float64), np.zeros(theta0.size), []
    for deltas, weights in rounds:
        delta = sum(w * d.astype(np.float64) for d, w in zip(deltas, weights, strict=True)) / sum(weights)
        m = mu * m + delta
        theta = theta - lr * (delta + mu * m if nesterov else m)
        out.append(theta)
    return out


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_lossless_merge_matches_hand_computation(momentum, nesterov):
    rng = np.random.default_rng(0)
    theta = rng.normal(size=N).astype(np.float32)
    m = Merger(theta.copy(), opts(up="fp32", down="fp32", lr=0.7, momentum=momentum, nesterov=nesterov))
    tokens = [100.0, 200.0, 300.0]
    rounds = [([rng.normal(size=N).astype(np.float32) * 0.01 for _ in range(3)], tokens) for _ in range(4)]
    want = hand_outer_steps(theta, rounds, 0.7, momentum, nesterov)
    for v, ((deltas, _), theta_v) in enumerate(zip(rounds, want, strict=True), start=1):
        for d, t in zip(deltas, tokens, strict=True):
            _push(m, d, t)
        update = m.outer_step()
        np.testing.assert_allclose(m.theta, theta_v, rtol=0, atol=1e-6)
        assert update.version == v == m.version


@pytest.mark.parametrize("nesterov,theta1,theta2", [(True, 0.335, 0.3175), (False, 0.65, 0.475)])
def test_outer_step_hand_derived(nesterov: bool, theta1: float, theta2: float):
    """θ0 = 1, Δ1 = 0.5, Δ2 = -0.2 (each the weighted mean of two pushes), lr 0.7, μ 0.9, lossless both ways.

    Nesterov: m1 = 0.5, θ1 = 1 - 0.7*(0.5 + 0.45) = 0.335; m2 = 0.25, θ2 = 0.335 - 0.7*(-0.2 + 0.225) = 0.3175.
    Heavy ball: θ1 = 1 - 0.7*0.5 = 0.65; θ2 = 0.65 - 0.7*0.25 = 0.475.
    """
    m = Merger(np.ones(N, np.float32), opts(up="fp32", down="fp32", lr=0.7, momentum=0.9, nesterov=nesterov))
    _push(m, np.full(N, 0.2, np.float32), 1.0)  # (1·0.2 + 3·0.6) / 4 = 0.5
    _push(m, np.full(N, 0.6, np.float32), 3.0)
    m.outer_step()
    np.testing.assert_allclose(m.theta, theta1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(m.momentum, 0.5, rtol=0, atol=1e-7)
    _push(m, np.full(N, -0.2, np.float32), 2.0)
    m.outer_step()
    np.testing.assert_allclose(m.theta, theta2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(m.momentum, 0.25, rtol=0, atol=1e-7)


@pytest.mark.parametrize("down", ["int8", "int4", "e3m0"])
def test_islands_applying_update_frames_hold_bit_identical_theta(down):
    rng = np.random.default_rng(1)
    theta = rng.normal(size=N).astype(np.float32)
    m = Merger(theta.copy(), opts(up="int8", down=down))
    island = theta.copy()
    for _ in range(3):
        _push(m, rng.normal(size=N).astype(np.float32), 1.0)
        update = m.outer_step()
        island = island + codec.dequantize(codec.decode(update.frame, expected_n=N))
        assert np.array_equal(island, m.theta)
        assert update.params_digest == m.digest
    assert m.updates_since(0) is not None and len(m.updates_since(0)) == 3
    assert m.updates_since(3) == []


def test_down_error_feedback_keeps_theta_close_to_the_exact_outer_trajectory():
    rng = np.random.default_rng(2)
    theta = rng.normal(size=N).astype(np.float32)
    exact = Merger(theta.copy(), opts(up="fp32", down="fp32"))
    with_ef = Merger(theta.copy(), opts(up="fp32", down="int4", error_feedback=True))
    no_ef = Merger(theta.copy(), opts(up="fp32", down="int4", error_feedback=False))
    for _ in range(20):
        d = rng.normal(size=N).astype(np.float32) * 0.01 + 0.005  # a consistent drift quantization would bias
        for m in (exact, with_ef, no_ef):
            _push(m, d, 1.0)
            m.outer_step()
    err_ef = np.abs(with_ef.theta - exact.theta).max()
    err_no = np.abs(no_ef.theta - exact.theta).max()
    assert err_ef < err_no


def test_a_bad_frame_changes_nothing():
    rng = np.random.default_rng(3)
    m = Merger(np.zeros(N, np.float32), opts(up="int8"))
    frame = bytearray(codec.encode(codec.quantize(rng.normal(size=N).astype(np.float32), 8, BLOCK)))
    frame[-5] ^= 0xFF
    with m.spool() as sp:
        sp.write(bytes(frame))
        with pytest.raises(codec.CodecError):
            m.validate(sp)
    assert m.pending == [] and m.total_weight == 0 and m.pending_count == 0
    assert len(list(m.spool_dir.glob("push-*"))) == 1  # the rejected spool's file, kept for the next push
    with pytest.raises(RuntimeError, match="no pending push"):
        m.outer_step()
    good = rng.normal(size=N).astype(np.float32)  # written over the rejected push's spool file
    _push(m, good, 2.0)
    np.testing.assert_allclose(m.pending_sum(), 2 * codec.dequantize(codec.quantize(good, 8, BLOCK)), rtol=1e-6)


def test_lagging_island_gets_none_when_updates_were_dropped():
    m = Merger(np.zeros(N, np.float32), opts(up="fp32", down="int8", keep_updates=2))
    for _ in range(3):
        _push(m, np.ones(N, np.float32), 1.0)
        m.outer_step()
    assert m.updates_since(0) is None  # version 1's update is gone: a full pull is needed
    update = m.full_update()
    full = codec.dequantize(codec.decode(update.frame, expected_n=N))
    assert np.array_equal(full, m.theta) and update.version == 3 and update.params_digest == m.digest
    assert m.full_update() is update  # written once per version
    assert update.size == len(update.frame) and update.crc32 == zlib.crc32(update.frame)
    with update.open() as f:  # a pull under way keeps reading after the next version replaces the frame
        _push(m, np.ones(N, np.float32), 1.0)
        m.outer_step()
        newer = m.full_update()
        assert not update.path.exists() and newer.version == 4
        assert f.read() == codec.encode(codec.QuantizedVec(32, BLOCK, N, np.zeros(0, np.float32),
                                                           full.view(np.uint8)), 1)


def test_state_lives_in_per_version_files_that_are_never_modified(tmp_path):
    rng = np.random.default_rng(4)
    theta = rng.normal(size=N).astype(np.float32)
    (tmp_path / "a" / "state").mkdir(parents=True)
    stale = [tmp_path / "a" / "update-00000099.frame", tmp_path / "a" / "state" / "theta-00000099.f32"]
    for p in stale:  # what a coordinator that died here left behind
        p.write_bytes(b"old")
    m = Merger(theta, opts(up="int8", down="int8"), spool_dir=tmp_path / "a")
    assert not any(p.exists() for p in stale)
    _push(m, rng.normal(size=N).astype(np.float32), 2.0)
    m.outer_step()
    files = m.state_files()
    kept = {k: tmp_path / f"kept-{k}" for k in files}
    for k, p in files.items():
        os.link(p, kept[k])  # what a checkpoint does
    before = {k: p.read_bytes() for k, p in kept.items()}
    second = rng.normal(size=N).astype(np.float32)
    _push(m, second, 1.0)
    update2 = m.outer_step()
    update2_frame, digest2 = update2.frame, m.digest
    assert {k: p.read_bytes() for k, p in kept.items()} == before  # version 1's files are untouched
    assert sorted(p.name for p in (tmp_path / "a" / "state").glob("*.f32")) == [
        "momentum-00000002.f32", "residual-00000002.f32", "theta-00000002.f32"]
    # Version 0's files, linked by nothing else, were written over for version 2; version 1's were kept whole.
    assert not list((tmp_path / "a" / "state").glob("*.spare"))
    _push(m, second, 1.0)
    m.outer_step()
    _push(m, second, 1.0)
    m.outer_step()  # written over version 2's files; the linked version-1 files stay as they were
    assert {k: p.read_bytes() for k, p in kept.items()} == before
    # A merger restored from version 1's files continues exactly like the original did.
    r = Merger(kept["theta"], opts(up="int8", down="int8"), version=1,
               momentum=kept["momentum"], residual=kept["residual"], spool_dir=tmp_path / "b")
    assert r.version == 1 and np.array_equal(r.theta, np.frombuffer(before["theta"], np.float32))
    _push(r, second, 1.0)
    assert r.outer_step().frame == update2_frame and r.digest == digest2  # bit for bit
    with pytest.raises(ValueError, match="momentum file .* holds 4 bytes"):
        (tmp_path / "short").write_bytes(b"\0" * 4)
        Merger(kept["theta"], opts(), momentum=tmp_path / "short", spool_dir=tmp_path / "c")


def test_pending_sum_matches_dequantize_for_every_codec():
    rng = np.random.default_rng(5)
    for name, bits in (("int8", 8), ("int4", 4), ("e3m0", "e3m0"), ("fp32", 32)):
        m = Merger(np.zeros(N, np.float32), opts(up=name))
        assert m.opts.up_bits == bits
        vecs = [rng.normal(size=N).astype(np.float32) for _ in range(2)]
        weights = (0.25, 3.0)
        for v, w in zip(vecs, weights, strict=True):
            _push(m, v, w)
        want = sum(np.float32(w) * codec.dequantize(codec.quantize(v, bits, BLOCK))
                   for v, w in zip(vecs, weights, strict=True))
        np.testing.assert_allclose(m.pending_sum(), want, rtol=1e-6, atol=1e-6)
        assert m.total_weight == 3.25 and m.pending_count == 2


def test_pending_pushes_stay_spooled_until_the_outer_step_sums_them():
    rng = np.random.default_rng(11)
    m = Merger(np.zeros(N, np.float32), opts(up="int8", down="fp32", lr=1.0, momentum=0.0, nesterov=False))
    vecs = [rng.normal(size=N).astype(np.float32) for _ in range(3)]
    for v, w in zip(vecs, (1.0, 2.0, 5.0), strict=True):
        _push(m, v, w)
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3 and m.pending_count == 3  # kept after their `with`
    m.outer_step()
    theta1 = m.theta
    assert m.pending == [] and m.total_weight == 0
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3  # kept, to be written over by the next pushes
    _push(m, vecs[0], 1.0)
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3 and m.pending_count == 1
    m.close()
    assert list(m.spool_dir.glob("push-*.body")) == []
    deq = [codec.dequantize(codec.quantize(v, 8, BLOCK)) for v in vecs]
    want = -(deq[0] * np.float32(1 / 8) + deq[1] * np.float32(2 / 8) + deq[2] * np.float32(5 / 8))
    np.testing.assert_allclose(theta1, want, rtol=1e-5, atol=1e-6)  # θ1 = θ0 − lr·Σ w·Δ / Σ w, lossless down


# -- deltas cannot poison θ: norms, robust rules, the finite check --------------------------------------------


def _push_keyed(m: Merger, vec: np.ndarray, weight: float, key: str, scale: float = 1.0) -> float:
    with m.spool() as sp:
        sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, BLOCK)))
        m.validate(sp)
        m.add_pending(sp, weight, scale=scale, key=key)
        return sp.norm


@pytest.mark.parametrize("up", ["int8", "int4", "e3m0", "fp32"])
def test_the_spool_measures_the_push_norm_as_it_validates(up):
    rng = np.random.default_rng(21)
    m = Merger(np.zeros(N, np.float32), opts(up=up))
    for n_values, scale in ((N, 1.0), (N, 3e37)):
        vec = (rng.normal(size=n_values) * scale).astype(np.float32)
        want = np.linalg.norm(codec.dequantize(codec.quantize(vec, m.opts.up_bits, BLOCK)).astype(np.float64))
        assert _push_keyed(m, vec, 1.0, "k") == pytest.approx(want, rel=1e-6)
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
        _push_keyed(m, v, float(1 + i), f"p{i}", scale=c)  # weights do not count in these rules
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
    _push_keyed(m, a, 1.0, "a", scale=0.25)
    _push_keyed(m, b, 3.0, "b")
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
    _push_keyed(m, honest, 640.0, "honest")
    _push_keyed(m, poison, 1e9, "poison")
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
        _push_keyed(m, v, 1.0, f"p{i}")
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
        _push_keyed(m, v, 1.0, f"p{i}", scale=c)
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
        _push_keyed(m, v, 1.0, f"p{i}")
    rows = np.stack([codec.dequantize(codec.quantize(v, 8, BLOCK)) for v in vecs]).astype(np.float64)
    med = np.median(rows, axis=0)
    exact = [float(r @ med / (np.linalg.norm(r) * np.linalg.norm(med))) for r in rows]
    read: list[tuple[int, int]] = []
    stack = Merger.stack_pending
    monkeypatch.setattr(Merger, "stack_pending", lambda self, s, c: read.append((s, c)) or stack(self, s, c))
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
        _push_keyed(m, v, 1.0, f"p{i}")
    rows = np.stack([codec.dequantize(codec.quantize(v, 8, BLOCK)) for v in vecs]).astype(np.float64)
    med = np.median(rows, axis=0)
    exact = [float(r @ med / (np.linalg.norm(r) * np.linalg.norm(med))) for r in rows]
    read: list[tuple[int, int]] = []
    stack = Merger.stack_pending
    monkeypatch.setattr(Merger, "stack_pending", lambda self, s, c: read.append((s, c)) or stack(self, s, c))
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
    _push_keyed(m, honest, 1.0, "first")
    m.outer_step()  # m = Δ = honest
    later = honest + 1.5 * rng.normal(size=n).astype(np.float32)
    _push_keyed(m, later, 1.0, "honest")
    _push_keyed(m, -later, 1.0, "reversed")
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
    _push_keyed(m, honest, 1.0, "first")
    assert m.direction_cosines() == ([1.0], "")  # momentum 0: no reference yet
    m.outer_step()  # m = Δ = honest
    later = honest + rng.normal(size=N).astype(np.float32)
    _push_keyed(m, later, 1.0, "honest")
    _push_keyed(m, -later, 1.0, "reversed")
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
    norms = [_push_keyed(m, v, 1000.0, f"p{i}") for i, v in enumerate(pushes)]
    assert m.opts.rule == "screened_mean"
    infos = [PushInfo(f"p{i}", f"island-{i}", 0, 1000, 10, 0, 80, i) for i in range(4)]
    screened = screen_round(cfg.coordinator, infos, norms, *m.direction_cosines())
    assert [p for p, _ in screened] == ["p3"] and "points away from the others: cosine -" in screened[0][1]
    m.drop_pending(["p3"])
    m.outer_step()
    merged = -m.theta
    assert np.linalg.norm(merged - honest) < 0.5 * np.linalg.norm(honest), m.opts.rule
    assert float(np.dot(merged, honest)) > 0.5 * float(np.dot(honest, honest))
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


def test_a_merger_without_a_folder_removes_the_one_it_made(tmp_path) -> None:
    import gc

    rng = np.random.default_rng(5)
    m = Merger(np.zeros(N, np.float32), opts(up="int8"))
    own = m.spool_dir
    _push(m, rng.normal(size=N).astype(np.float32) * 1e-2, 1.0)
    m.outer_step()
    assert own.is_dir() and any(own.iterdir())
    m.close()
    assert not own.exists()  # state files, update frames and spare spools with it

    lost = Merger(np.zeros(N, np.float32), opts(up="int8")).spool_dir  # never closed: collected
    gc.collect()
    assert not lost.exists()

    given = Merger(np.zeros(N, np.float32), opts(up="int8"), spool_dir=tmp_path / "run")
    given.close()
    assert (tmp_path / "run" / "state").is_dir()  # a folder it was given is its owner's


def test_every_push_of_a_round_writes_over_a_spool_file_of_the_last_round() -> None:
    islands = 12  # more than the 8 spares a merger keeps at least
    o = MergeOptions.from_config(replace(Config(), outer={"islands": islands}, codec={"block": BLOCK}))
    assert o.spare_spools == islands and MergeOptions.from_config(Config()).spare_spools == 8
    m = Merger(np.zeros(N, np.float32), o)
    rng = np.random.default_rng(9)
    files = []
    for _ in range(3):
        spools = [m.spool() for _ in range(islands)]
        files.append({os.fstat(sp.fd).st_ino for sp in spools})
        for sp in spools:
            sp.write(codec.encode(codec.quantize(rng.normal(size=N).astype(np.float32) * 1e-2, o.up_bits, BLOCK)))
            m.validate(sp)
            m.add_pending(sp, 1.0)
        m.outer_step()
    assert files[1] == files[0] and files[2] == files[0]  # no new file after the first round
    m.close()


def test_a_merger_reading_an_open_rounds_pushes_sums_those_and_keeps_no_list_of_its_own():
    """A coordinator's merger sums what its open round holds (``read_pending_from``: coordinator/pending.py's
    PendingSet): the same sum and step as pushes given to it, its own add/drop/unpend refused, and a commit that
    releases the spools but leaves the round's list to its owner."""
    rng = np.random.default_rng(12)
    vecs = [rng.normal(size=N).astype(np.float32) for _ in range(2)]
    own = Merger(np.zeros(N, np.float32), opts(up="int8", down="fp32"))
    for v, w in zip(vecs, (1.0, 3.0), strict=True):
        _push(own, v, w)
    m = Merger(np.zeros(N, np.float32), opts(up="int8", down="fp32"))
    held = []  # the open round's spools, as its owner keeps them
    m.read_pending_from(lambda: list(held))
    for i, (v, w) in enumerate(zip(vecs, (1.0, 3.0), strict=True)):
        with m.spool() as sp:
            sp.write(codec.encode(codec.quantize(v, 8, BLOCK)))
            m.validate(sp)
            held.append(m.spooled(sp, w, key=f"p{i}"))
    assert [p.key for p in m.pending] == ["p0", "p1"] and m.total_weight == 4.0 and m.pending_count == 2
    np.testing.assert_array_equal(m.pending_sum(), own.pending_sum())
    for refused in (lambda: m.add_pending(held[0].spool, 1.0), lambda: m.drop_pending(["p0"]), m.unpend):
        with pytest.raises(RuntimeError, match="read_pending_from"):
            refused()
    m.outer_step()
    own.outer_step()
    np.testing.assert_array_equal(m.theta, own.theta)
    assert [p.key for p in m.pending] == ["p0", "p1"] and all(p.spool.fd == -1 for p in held)  # released, still listed
    held.clear()
    assert m.pending == [] and m.total_weight == 0
    m.close()
    own.close()
