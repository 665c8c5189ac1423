"""The per-device inner step (dtrain/health/device_step.py, ``InnerLoop(per_device=True)``) on the 8 fake CPU devices:
the same training as the fused step, the statistics probe's numbers as its metrics, and an injected device fault
found by them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dtrain.config.sections import ConfigError
from dtrain.health.faults import DeadDeviceError, DeviceFault
from dtrain.health.probes import Probes, outliers
from dtrain.steps.inner import TrainState, make_mesh, pad_rows, rows_per_device
from dtrain.train.loop import InnerLoop
from fake_island import Island, K

# Loss trajectories agree to this relative tolerance, not bit for bit: the per-device step averages 8 micro-batch
# means (and their gradients) where the fused step takes one mean over the batch, so float32 sums run in another
# order (measured: at most 1 ulp, ~1e-7 relative, over the 8 steps; the tolerance leaves a 10x margin).
LOSS_RTOL = 1e-6
TRAINED_CHUNKS = 2  # of the island's fixed batches, trained by train()


def train(island: Island, loop: InnerLoop) -> tuple[list[TrainState], dict[str, np.ndarray]]:
    """The island's first TRAINED_CHUNKS chunks of K steps from the same start with ``loop``; the state before
    each chunk (a copy, the run donates it) and the metrics of all TRAINED_CHUNKS·K steps."""
    state = loop.init_state(island.params)
    before, metrics = [], []
    for batches in island.batches[:TRAINED_CHUNKS]:
        before.append(jax.tree.map(lambda x: np.asarray(x).copy(), state))
        state, m = loop.run(state, batches)
        metrics.append(jax.device_get(m))
    return before, {k: np.concatenate([m[k] for m in metrics]) for k in metrics[0]}


def test_default_is_the_fused_step(island: Island) -> None:
    assert not island.loop(False).per_device
    with pytest.raises(ValueError, match="per_device=True"):
        InnerLoop(island.cfg, island.model, island.mesh, fault=DeviceFault("scale", 0))


def test_same_loss_trajectory_as_the_fused_step(island: Island) -> None:
    _, fused = train(island, island.loop(False))
    _, per_device = train(island, island.loop(True))
    assert fused["loss"].shape == per_device["loss"].shape == (TRAINED_CHUNKS * K,)
    np.testing.assert_allclose(per_device["loss"], fused["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(per_device["grad_norm"], fused["grad_norm"], rtol=LOSS_RTOL)
    assert per_device["loss"][-1] < per_device["loss"][0]  # it trains
    assert per_device["device_grad_norm"].shape == (TRAINED_CHUNKS * K, 8)
    assert per_device["finite"].all() and per_device["device_finite"].all()
    # the average of the devices' micro-batch losses is the step's loss
    np.testing.assert_allclose(per_device["device_loss"].mean(axis=1), per_device["loss"], rtol=1e-6)
    assert outliers(per_device["device_grad_norm"][-1]) == []


def test_per_device_norms_are_the_statistics_probe(island: Island) -> None:
    before, metrics = train(island, island.loop(True))
    probes = Probes(island.model.apply, island.mesh)
    for chunk, state in enumerate(before):
        stats = probes.grad_stats(state.params, island.batches[chunk][0], step=int(state.step))
        assert stats.device_ids == island.ids
        np.testing.assert_allclose(metrics["device_grad_norm"][chunk * K], stats.grad_norm, rtol=1e-5)
        np.testing.assert_allclose(metrics["device_loss"][chunk * K], stats.loss, rtol=1e-6)


@pytest.mark.parametrize("index", [3, pytest.param(6, marks=pytest.mark.slow)])  # the default run keeps one
def test_scaled_device_is_the_one_outlier(island: Island, index: int) -> None:
    fault = DeviceFault("scale", island.ids[index], factor=10.0)
    _, metrics = train(island, island.loop(True, fault))
    for norms_D in metrics["device_grad_norm"]:
        assert [o.index for o in outliers(norms_D)] == [index]


def test_nan_guard_sees_the_corrupt_device(island: Island) -> None:
    fault = DeviceFault("bitflip", island.ids[5], bit=30)  # exponent bit: values blow up to inf/NaN or ~2^127
    _, metrics = train(island, island.loop(True, fault))
    first = metrics["device_finite"][0]
    assert [i for i in range(8) if not first[i]] == [5]
    assert not metrics["finite"][0]
    assert not metrics["finite"].any()


def test_dead_device_raises_before_dispatch(island: Island) -> None:
    loop = island.loop(True, DeviceFault("dead", island.ids[2]))
    with pytest.raises(DeadDeviceError, match=f"device {island.ids[2]} is dead"):
        loop.run(loop.init_state(island.params), island.batches[0])


def test_rows_per_device_and_padding() -> None:
    assert rows_per_device(8, 8) == (1,) * 8
    assert rows_per_device(8, 7) == (2, 1, 1, 1, 1, 1, 1)
    assert rows_per_device(32, 6) == (6, 6, 5, 5, 5, 5)
    with pytest.raises(ConfigError, match="cannot give each of 9 devices"):
        rows_per_device(8, 9)
    batches = np.arange(2 * 5 * 3).reshape(2, 5, 3)  # [K=2, B=5, L+1=3]
    assert pad_rows(batches, (1,) * 5) is batches
    padded = pad_rows(batches, (2, 2, 1))  # device 0: rows 0-1; device 1: rows 2-3; device 2: row 4 + padding
    assert padded.shape == (2, 6, 3)
    np.testing.assert_array_equal(padded[:, :5], batches)
    np.testing.assert_array_equal(padded[:, 5], batches[:, 0])


def test_remeshed_on_seven_devices_same_global_batch(island: Island) -> None:
    """A quarantined device's island, rebuilt on the 7 others with the same global batch (its row rerouted to the
    first device: 2, 1, ..., 1 rows), trains the same loss trajectory as the 8 devices, up to float32 rounding."""
    healthy = [d for d in island.mesh.devices.flat if d.id != island.ids[3]]
    mesh7 = make_mesh(island.cfg, healthy, remesh=True)
    assert mesh7.devices.size == 7 and island.ids[3] not in [d.id for d in mesh7.devices.flat]
    with pytest.raises(ConfigError, match="not divisible"):
        make_mesh(island.cfg, healthy)  # the fused step's mesh still needs an even split
    loop7 = InnerLoop(island.cfg, island.model, mesh7, per_device=True)
    assert loop7.rows == (2, 1, 1, 1, 1, 1, 1) and loop7.padded_batch == 14
    _, eight = train(island, island.loop(True))
    _, seven = train(island, loop7)
    assert seven["device_grad_norm"].shape == (TRAINED_CHUNKS * K, 7) and seven["finite"].all()
    np.testing.assert_allclose(seven["loss"], eight["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(seven["grad_norm"], eight["grad_norm"], rtol=1e-5)
    # the first device's micro-batch is rows 0-1 (their mean loss), each other device's one row: the row the
    # 8-device mesh gave the device one further on (device 3's row went to its neighbours)
    np.testing.assert_allclose(seven["device_loss"][0, 0], eight["device_loss"][0, :2].mean(), rtol=1e-5)
    np.testing.assert_allclose(seven["device_loss"][0, 1:], eight["device_loss"][0, 2:], rtol=1e-5)
    params = jax.device_get(loop7.init_params(0))
    assert np.isfinite(loop7.evaluate(params, island.batches[0][:2])), "eval on an uneven mesh (replicated)"
