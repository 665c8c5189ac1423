"""The coordinator's streaming merger: the outer step against hand computation, bit-identical broadcast θ, no
partial state. Poisoned and robust merges are in test_merger_poison.py, sparse pushes in test_merger_sparse.py."""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config, ConfigError
from dtrain.steps.outer import OuterHParams
from merger_helpers import BLOCK, N, in_tmp, opts, push, slabs  # noqa: F401  (in_tmp, slabs: autouse fixtures)


def test_options_come_from_the_config():
    o = opts(up="int4", down="e3m0", error_feedback=False, keep_updates=3, lr=0.5, momentum=0.8, nesterov=False)
    assert o.outer == OuterHParams(lr=0.5, momentum=0.8, nesterov=False)
    assert (o.up_bits, o.down_bits, o.block, o.error_feedback, o.keep_updates) == (4, "e3m0", BLOCK, False, 3)
    assert o.zstd_level == Config().codec.zstd_level
    assert opts(up="fp32", down="int8").up_bits == 32
    cfg = replace(Config(), coordinator={"merge_threads": 3})
    assert MergeOptions.from_config(cfg).threads == 3  # 0, the default: half the usable cores, at least 1
    assert MergeOptions.from_config(Config()).threads == max(1, len(os.sched_getaffinity(0)) // 2)
    with pytest.raises(ConfigError, match="merge_threads"):
        replace(Config(), coordinator={"merge_threads": -1})
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
            push(m, d, t)
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
    push(m, np.full(N, 0.2, np.float32), 1.0)  # (1·0.2 + 3·0.6) / 4 = 0.5
    push(m, np.full(N, 0.6, np.float32), 3.0)
    m.outer_step()
    np.testing.assert_allclose(m.theta, theta1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(m.momentum, 0.5, rtol=0, atol=1e-7)
    push(m, np.full(N, -0.2, np.float32), 2.0)
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
        push(m, rng.normal(size=N).astype(np.float32), 1.0)
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
            push(m, d, 1.0)
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
    push(m, good, 2.0)
    np.testing.assert_allclose(m.pending_sum(), 2 * codec.dequantize(codec.quantize(good, 8, BLOCK)), rtol=1e-6)


def test_lagging_island_gets_none_when_updates_were_dropped():
    m = Merger(np.zeros(N, np.float32), opts(up="fp32", down="int8", keep_updates=2))
    for _ in range(3):
        push(m, np.ones(N, np.float32), 1.0)
        m.outer_step()
    assert m.updates_since(0) is None  # version 1's update is gone: a full pull is needed
    update = m.full_update()
    full = codec.dequantize(codec.decode(update.frame, expected_n=N))
    assert np.array_equal(full, m.theta) and update.version == 3 and update.params_digest == m.digest
    assert m.full_update() is update  # written once per version
    assert update.size == len(update.frame) and update.crc32 == zlib.crc32(update.frame)
    with update.open() as f:  # a pull under way keeps reading after the next version replaces the frame
        push(m, np.ones(N, np.float32), 1.0)
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
    push(m, rng.normal(size=N).astype(np.float32), 2.0)
    m.outer_step()
    files = m.state_files()
    kept = {k: tmp_path / f"kept-{k}" for k in files}
    for k, p in files.items():
        os.link(p, kept[k])  # what a checkpoint does
    before = {k: p.read_bytes() for k, p in kept.items()}
    second = rng.normal(size=N).astype(np.float32)
    push(m, second, 1.0)
    update2 = m.outer_step()
    update2_frame, digest2 = update2.frame, m.digest
    assert {k: p.read_bytes() for k, p in kept.items()} == before  # version 1's files are untouched
    assert sorted(p.name for p in (tmp_path / "a" / "state").glob("*.f32")) == [
        "momentum-00000002.f32", "residual-00000002.f32", "theta-00000002.f32"]
    # Version 0's files, linked by nothing else, were written over for version 2; version 1's were kept whole.
    assert not list((tmp_path / "a" / "state").glob("*.spare"))
    push(m, second, 1.0)
    m.outer_step()
    push(m, second, 1.0)
    m.outer_step()  # written over version 2's files; the linked version-1 files stay as they were
    assert {k: p.read_bytes() for k, p in kept.items()} == before
    # A merger restored from version 1's files continues exactly like the original did.
    r = Merger(kept["theta"], opts(up="int8", down="int8"), version=1,
               momentum=kept["momentum"], residual=kept["residual"], spool_dir=tmp_path / "b")
    assert r.version == 1 and np.array_equal(r.theta, np.frombuffer(before["theta"], np.float32))
    push(r, second, 1.0)
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
            push(m, v, w)
        want = sum(np.float32(w) * codec.dequantize(codec.quantize(v, bits, BLOCK))
                   for v, w in zip(vecs, weights, strict=True))
        np.testing.assert_allclose(m.pending_sum(), want, rtol=1e-6, atol=1e-6)
        assert m.total_weight == 3.25 and m.pending_count == 2


def test_pending_pushes_stay_spooled_until_the_outer_step_sums_them():
    rng = np.random.default_rng(11)
    m = Merger(np.zeros(N, np.float32), opts(up="int8", down="fp32", lr=1.0, momentum=0.0, nesterov=False))
    vecs = [rng.normal(size=N).astype(np.float32) for _ in range(3)]
    for v, w in zip(vecs, (1.0, 2.0, 5.0), strict=True):
        push(m, v, w)
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3 and m.pending_count == 3  # kept after their `with`
    m.outer_step()
    theta1 = m.theta
    assert m.pending == [] and m.total_weight == 0
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3  # kept, to be written over by the next pushes
    push(m, vecs[0], 1.0)
    assert len(list(m.spool_dir.glob("push-*.body"))) == 3 and m.pending_count == 1
    m.close()
    assert list(m.spool_dir.glob("push-*.body")) == []
    deq = [codec.dequantize(codec.quantize(v, 8, BLOCK)) for v in vecs]
    want = -(deq[0] * np.float32(1 / 8) + deq[1] * np.float32(2 / 8) + deq[2] * np.float32(5 / 8))
    np.testing.assert_allclose(theta1, want, rtol=1e-5, atol=1e-6)  # θ1 = θ0 − lr·Σ w·Δ / Σ w, lossless down


def test_a_merger_without_a_folder_removes_the_one_it_made(tmp_path) -> None:
    import gc

    rng = np.random.default_rng(5)
    m = Merger(np.zeros(N, np.float32), opts(up="int8"))
    own = m.spool_dir
    push(m, rng.normal(size=N).astype(np.float32) * 1e-2, 1.0)
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
        push(own, v, w)
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
