"""Chip-health probes on the 8 fake CPU devices: each finds its injected device fault on the right device, and
none flags a healthy device over many clean repetitions."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtrain.health.faults import DeadDeviceError, DeviceFault, check_alive, inject
from dtrain.health.probes import (
    KNOWN_ANSWER_N,
    STAT_Z_MAX,
    all_finite,
    digest,
    known_answer_expected,
    majority,
    micro_batch,
    outliers,
    robust_z,
)
from dtrain.steps.inner import loss_fn
from fake_island import Island


def test_known_answer_closed_form_is_the_exact_sum() -> None:
    for n in (1, 2, 7, 64, KNOWN_ANSWER_N):
        idx = np.arange(n, dtype=np.int64)
        a = idx[:, None] + idx[None, :]
        wrapped = int((a @ a).sum()) % 2**32  # the int32 sum, wrapping
        assert known_answer_expected(n) == (wrapped - 2**32 if wrapped >= 2**31 else wrapped)
        assert (a @ a).max() < 2**24  # every entry exact in float32


def test_known_answer_healthy_devices(island: Island) -> None:
    for step in range(5):
        results = island.probes().known_answer(step)
        assert [r.device_id for r in results] == island.ids
        assert all(r.ok and r.value == r.expected == known_answer_expected() and r.mismatches == 0 for r in results)


@pytest.mark.parametrize("fault", [DeviceFault("scale", 3, factor=1.5), DeviceFault("bitflip", 5, bit=0, rate=0.01),
                                   DeviceFault("bitflip", 1, bit=30), DeviceFault("dead", 6)],
                         ids=["scale", "bitflip-low", "bitflip-exponent", "dead"])
def test_known_answer_finds_the_faulty_device(island: Island, fault: DeviceFault) -> None:
    results = island.probes(fault).known_answer(step=0)
    assert [r.device_id for r in results if not r.ok] == [fault.device]
    bad = next(r for r in results if not r.ok)
    if fault.kind == "dead":
        assert bad.value is None and bad.error is not None and "DeadDeviceError" in bad.error
    else:
        assert bad.mismatches and bad.mismatches > 0 and bad.error is None


def test_known_answer_one_program_matches_each_device_alone(island: Island) -> None:
    # known_answer runs one SPMD program over the mesh; a dead device makes it fall back to one program per device.
    # Both give every device the same result, its error aside.
    fault = DeviceFault("scale", 2, factor=3.0, start=1)
    probes = island.probes(fault)
    for step in (0, 1):
        assert probes.known_answer(step) == probes._known_answer_each(step)
    assert [r.ok for r in probes.known_answer(1)] == [d != 2 for d in island.ids]
    dead = island.probes(DeviceFault("dead", 4, start=1))
    assert dead.known_answer(0) == dead._known_answer_each(0) and all(r.ok for r in dead.known_answer(0))


def test_intermittent_fault_fires_on_some_steps_only(island: Island) -> None:
    fault = DeviceFault("scale", 2, factor=2.0, prob=0.3, seed=7)
    flagged = [any(not r.ok for r in island.probes(fault).known_answer(step)) for step in range(40)]
    assert 4 <= sum(flagged) <= 24  # ~12 expected
    for step, was in enumerate(flagged):  # a dead device with the same draw is dead on exactly those steps
        dead = DeviceFault("dead", 2, prob=0.3, seed=7)
        if was:
            with pytest.raises(DeadDeviceError, match="device 2 is dead"):
                check_alive(dead, island.ids, step)
        else:
            check_alive(dead, island.ids, step)
    check_alive(DeviceFault("dead", 2), [0, 1, 3], 0)  # a dead device outside the computation's devices


def test_fault_starts_at_its_onset_step(island: Island) -> None:
    fault = DeviceFault("scale", 5, factor=3.0, start=7)
    bad = [[r.device_id for r in island.probes(fault).known_answer(step) if not r.ok] for step in range(5, 10)]
    assert bad == [[], [], [5], [5], [5]]
    transient = DeviceFault("scale", 5, factor=3.0, start=7, until=8)
    assert [[r.device_id for r in island.probes(transient).known_answer(step) if not r.ok]
            for step in range(6, 9)] == [[], [5], []]
    check_alive(DeviceFault("dead", 5, start=7), island.ids, 6)
    with pytest.raises(DeadDeviceError, match="step 7"):
        check_alive(DeviceFault("dead", 5, start=7), island.ids, 7)


def test_grad_stats_are_each_devices_own_micro_batch(island: Island) -> None:
    batch = island.batch(np.random.default_rng(0))
    stats = island.probes().grad_stats(island.params, batch)
    assert stats.device_ids == island.ids and stats.finite.all()
    grad = jax.jit(jax.value_and_grad(partial(loss_fn, island.model.apply)))
    for i in range(8):
        loss, g = grad(island.params, micro_batch(batch, island.mesh, i))
        norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
        assert stats.loss[i] == pytest.approx(float(loss), rel=1e-5)
        assert stats.grad_norm[i] == pytest.approx(norm, rel=1e-4)
    assert len(set(stats.grad_norm.tolist())) > 1  # not one reduced gradient seen eight times


@pytest.mark.parametrize("fault", [DeviceFault("scale", 4, factor=10.0),
                                   pytest.param(DeviceFault("bitflip", 7, bit=30), marks=pytest.mark.slow),
                                   DeviceFault("scale", 0, factor=-8.0)], ids=["scale", "bitflip-exponent", "neg"])
# bitflip-exponent: a program of its own (~7 s); the default run keeps scale and neg, and the exponent flip is found
# by test_known_answer_finds_the_faulty_device[bitflip-exponent]
def test_grad_stats_flag_the_faulty_device(island: Island, fault: DeviceFault) -> None:
    rng = np.random.default_rng(1)
    for step in range(5):
        stats = island.probes(fault).grad_stats(island.params, island.batch(rng), step)
        flagged = outliers(stats.grad_norm)
        assert [stats.device_ids[o.index] for o in flagged] == [fault.device]
        assert flagged[0].z > STAT_Z_MAX


def test_robust_z_rule() -> None:
    assert robust_z([3.0] * 8).tolist() == [0.0] * 8  # identical healthy values never flag
    assert robust_z([0.0] * 8).tolist() == [0.0] * 8
    assert outliers([1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 5.0])[0].index == 7
    z = robust_z([1.0, 1.0, float("nan"), 1.0])
    assert z[2] == np.inf and z[0] == 0.0
    assert [o.index for o in outliers([1.0, float("inf"), 1.0])] == [1]
    with pytest.raises(ValueError, match="at least 3"):
        outliers([1.0, 2.0])


@pytest.mark.slow  # 200 statistics calls and 40 replays: ~15 s on 2 cores
def test_clean_control_flags_nothing(island: Island) -> None:
    """200 random clean micro-batch sets (100 at θ_0, 100 after 30 inner steps): no device flagged by the
    statistics; 40 clean replays on all 8 devices agree bit for bit; the known answer holds."""
    rng = np.random.default_rng(2)
    probes = island.probes()
    state = island.loop().init_state(island.params)
    worst = 0.0
    for phase in range(2):
        for step in range(100):
            stats = probes.grad_stats(state.params, island.batch(rng), step)
            assert stats.finite.all() and outliers(stats.grad_norm) == [] and outliers(stats.loss) == []
            worst = max(worst, float(robust_z(stats.grad_norm).max()))
        if phase == 0:
            state, _ = island.loop().run(state, island.batch(rng, steps=30))
    assert worst < STAT_Z_MAX / 2  # a margin, not just under the threshold
    for step in range(40):  # one row of a random device's micro-batch, on every device: all the same bits
        row = micro_batch(island.batch(rng), island.mesh, int(rng.integers(8)))[:1]
        replay = probes.replay(state.params, row, step)
        assert replay.suspects == [] and replay.conclusive and replay.error == {}
        assert replay.digests == [replay.majority] * 8
    assert all(r.ok for r in probes.known_answer(step=99))


@pytest.mark.slow  # the default run finds a bit-22 flip by replay in test_chip_health.py (tiny-chunks)
@pytest.mark.parametrize("fault", [DeviceFault("bitflip", 4, bit=22),
                                   DeviceFault("bitflip", 6, bit=0, rate=0.01, seed=3)],
                         ids=["bit22", "bit0-sparse"])
def test_replay_finds_a_silent_bit_flip_on_the_right_device(island: Island, fault: DeviceFault) -> None:
    """A mantissa flip on one device (its highest bit of every gradient entry, or the lowest of 1%): invisible to
    the statistics, found by one replay on all devices and pinned on that device and no other."""
    probes = island.probes(fault)
    rng = np.random.default_rng(3)
    for step in range(3):
        batch = island.batch(rng)
        assert outliers(probes.grad_stats(island.params, batch, step).grad_norm) == []
        replay = probes.replay(island.params, micro_batch(batch, island.mesh, step)[:1], step)
        assert replay.device_ids == island.ids and replay.conclusive and replay.error == {}
        assert replay.suspects == [fault.device]
        bad = island.ids.index(fault.device)
        assert replay.digests[bad] != replay.majority
        assert replay.digests[:bad] + replay.digests[bad + 1:] == [replay.majority] * 7
    # on a subset without the faulty device, the others agree; with it, it is still the one
    assert probes.replay(island.params, micro_batch(batch, island.mesh, 0)[:1], 0, [0, 1, 2]).suspects == []
    pos = island.ids.index(fault.device)
    assert probes.replay(island.params, micro_batch(batch, island.mesh, 0)[:1], 0, [1, pos, 2]).suspects == [
        fault.device]


def test_dead_device_in_replay_and_stats(island: Island) -> None:
    fault = DeviceFault("dead", island.ids[5])
    probes = island.probes(fault)
    row = micro_batch(island.batch(np.random.default_rng(5)), island.mesh, 5)[:1]
    replay = probes.replay(island.params, row, 0, [5, 0, 1, 2])
    assert replay.suspects == [island.ids[5]] and replay.conclusive and replay.digests[0] is None
    assert "DeadDeviceError" in replay.error[island.ids[5]] and list(replay.error) == [island.ids[5]]
    assert replay.digests[1:] == [replay.majority] * 3
    with pytest.raises(DeadDeviceError):  # the whole mesh's computation fails; the known answer names the device
        probes.grad_stats(island.params, island.batch(np.random.default_rng(5)))
    with pytest.raises(ValueError, match="distinct devices"):
        probes.replay(island.params, row, 0, [5, 5])


def test_majority_vote() -> None:
    assert majority([7, 7, 7, 3]) == 7
    assert majority([7, 3, 7]) == 7
    assert majority([7, 3]) is None  # two that differ: no strict majority
    assert majority([7, 7, 3, 3]) is None
    assert majority([1, 2, 3, 4, 5, 6, 7, 8]) is None  # nondeterministic ops: every device differs
    assert majority([None, None, 5]) == 5  # devices that raised do not vote
    assert majority([None, None]) is None and majority([]) is None


def test_digest_changes_for_any_flipped_bit() -> None:
    """Flip one bit of one element of one leaf (float32, int32 and bfloat16 leaves; 600 random trials, every bit
    position): the digest always changes. Permuted elements and structured changes (every element × 2) change it
    too, and it is the same for the same bits wherever it is computed."""
    rng = np.random.default_rng(11)
    tree = {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": [np.float32(rng.standard_normal()),
            rng.integers(-2**31, 2**31, (64,)).astype(np.int32)],
            "c": rng.standard_normal((5, 3)).astype(jnp.bfloat16), "d": rng.standard_normal(128).astype(np.float32)}
    leaves, treedef = jax.tree.flatten(tree)
    jdigest = jax.jit(digest)
    base = int(jdigest(tree))
    assert base == int(digest(tree)) == int(jdigest(jax.device_put(tree, jax.devices()[3])))
    for trial in range(600):
        li = int(rng.integers(len(leaves)))
        leaf = np.array(leaves[li]).reshape(-1)
        uint = {2: np.uint16, 4: np.uint32}[leaf.dtype.itemsize]
        bit = trial % (8 * leaf.dtype.itemsize)
        words = leaf.view(uint).copy()
        words[int(rng.integers(words.size))] ^= uint(1 << bit)
        changed = list(leaves)
        changed[li] = words.view(leaf.dtype).reshape(np.shape(leaves[li]))
        assert int(jdigest(jax.tree.unflatten(treedef, changed))) != base, (trial, li, bit)
    # every element × 2 adds 2**23 to each word: Σ (2k + 1) · 2**23 = n² · 2**23 ≡ 0 (mod 2**32) for n = 1024, so a
    # weighted sum of the raw words would miss it; of the mixed words it does not
    x = rng.standard_normal(1024).astype(np.float32)
    assert int(jdigest(x)) != int(jdigest(2 * x))
    assert int(jdigest(dict(tree, d=tree["d"][::-1].copy()))) != base  # the same values in another order


def test_nan_inf_guard() -> None:
    guard = jax.jit(all_finite)
    clean: dict[str, Any] = {"a": jnp.ones((3, 2)), "b": [jnp.zeros(4), jnp.float32(2.0)]}
    assert bool(guard(jnp.float32(1.5), clean))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        assert not bool(guard(jnp.float32(bad), clean))  # the loss
        tree = jax.tree.map(lambda x: x, clean)
        tree["b"][0] = tree["b"][0].at[2].set(bad)
        assert not bool(guard(jnp.float32(1.5), tree))  # a gradient entry
    assert bool(all_finite())
    flipped = jax.jit(partial(inject, fault=DeviceFault("bitflip", 1, bit=30)))(jnp.ones(4), 1, 0)
    assert not bool(guard(flipped))  # 1.0 with its exponent's top bit flipped is inf
    assert bool(guard(jax.jit(partial(inject, fault=DeviceFault("bitflip", 1, bit=30)))(jnp.ones(4), 2, 0)))


def test_fault_spec_validation() -> None:
    for kwargs, match in [({"kind": "melt", "device": 0}, "kind"), ({"kind": "scale", "device": -1}, "device"),
                          ({"kind": "scale", "device": 0, "prob": 0.0}, "prob"),
                          ({"kind": "bitflip", "device": 0, "bit": 32}, "bit"),
                          ({"kind": "bitflip", "device": 0, "rate": 2.0}, "rate"),
                          ({"kind": "scale", "device": 0, "factor": float("inf")}, "factor"),
                          ({"kind": "dead", "device": 0, "start": -1}, "start"),
                          ({"kind": "dead", "device": 0, "start": 4, "until": 4}, "until")]:
        with pytest.raises(ValueError, match=f"DeviceFault.{match}"):
            DeviceFault(**kwargs)
