"""Muon as the inner optimizer (``train.optimizer = "muon"``, dtrain/steps/inner.py): its update against a reference
written out in NumPy, the parameters it leaves to AdamW, stacked layers, the fused and the per-device step on a
sharded mesh with a device fault, and its state through an orbax checkpoint and back, bit for bit."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from conftest import TINY, make_text
from dtrain.checkpoint import Checkpointer
from dtrain.config.load import load_config
from dtrain.config.sections import ConfigError, TrainConfig
from dtrain.health.faults import DeviceFault
from dtrain.health.probes import outliers
from dtrain.models.model import build
from dtrain.steps.inner import make_mesh, make_optimizer, muon_labels
from dtrain.train.loop import InnerLoop

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic Newton-Schulz coefficients


def ns_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Newton-Schulz orthogonalization in float64 NumPy, as Muon's authors write it: a tall matrix transposed, the
    Frobenius norm scaled to 1, then ``steps`` times X <- aX + (b A + c A A) X with A = X X^T."""
    a, b, c = NS_COEFFS
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_reference(grads: list[np.ndarray], beta: float) -> list[np.ndarray]:
    """Muon's update direction for each step's gradient of one matrix ``[m, n]``: Nesterov momentum with Adam-style
    bias correction (optax's), Newton-Schulz, then ``sqrt(max(1, n / m))``."""
    mu, out = np.zeros_like(grads[0], np.float64), []
    for t, g in enumerate(grads, start=1):
        mu = beta * mu + (1 - beta) * g
        nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
        m, n = g.shape
        out.append(ns_reference(nesterov) * max(1.0, n / m) ** 0.5)
    return out


def _cfg(**fields) -> TrainConfig:
    return TrainConfig(**{"optimizer": "muon", "lr": 1e-3, "muon_lr": 0.02, "grad_clip": 0.0, **fields})


def test_muon_update_matches_the_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    cfg = _cfg(muon_weight_decay=0.1)
    params = {"blocks": {0: {"w": rng.normal(size=(6, 10)).astype(np.float32),
                             "tall": rng.normal(size=(12, 5)).astype(np.float32),
                             "bias": np.zeros(10, np.float32)}},
              "tok_embed": {"embedding": rng.normal(size=(16, 6)).astype(np.float32)},
              "head": {"kernel": rng.normal(size=(6, 16)).astype(np.float32)}}
    assert muon_labels(params) == {"blocks": {0: {"w": "muon", "tall": "muon", "bias": "adamw"}},
                                   "tok_embed": {"embedding": "adamw"}, "head": {"kernel": "adamw"}}
    tx, adamw = make_optimizer(cfg), make_optimizer(TrainConfig(lr=1e-3, grad_clip=0.0))
    state, adamw_state = tx.init(params), adamw.init(params)
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(3)]
    want = {name: muon_reference([g["blocks"][0][name] for g in grads], cfg.muon_beta) for name in ("w", "tall")}
    update, adamw_update = jax.jit(tx.update), jax.jit(adamw.update)  # one compile each, not one per operation
    for t, g in enumerate(grads):
        updates, state = update(g, state, params)
        ref, adamw_state = adamw_update(g, adamw_state, params)
        for name in ("w", "tall"):
            p = params["blocks"][0][name]
            expected = -(want[name][t] + cfg.muon_weight_decay * p) * cfg.muon_lr / cfg.lr  # descent
            np.testing.assert_allclose(updates["blocks"][0][name], expected, rtol=2e-4, atol=2e-5)
        # embeddings, the head and the bias: exactly train.optimizer = "adamw"'s update
        for path in (("tok_embed", "embedding"), ("head", "kernel"), ("blocks", 0, "bias")):
            got, exp = updates, ref
            for key in path:
                got, exp = got[key], exp[key]
            np.testing.assert_array_equal(got, exp)
    # Newton-Schulz's output is nearly orthogonal: its singular values lie around 1 (Keller Jordan: ~[0.5, 1.5])
    s = np.linalg.svd(ns_reference(rng.normal(size=(6, 10))), compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5


def test_stacked_layers_are_orthogonalized_one_by_one() -> None:
    rng = np.random.default_rng(1)
    stacked = rng.normal(size=(3, 8, 4)).astype(np.float32)  # [L, m, n]: three layers' matrices
    tx = make_optimizer(_cfg())
    g = {"layers": {"w": stacked}}
    updates, _ = tx.update(g, tx.init(g), g)
    for layer in range(3):
        expected = -muon_reference([stacked[layer]], 0.95)[0] * 0.02 / 1e-3
        np.testing.assert_allclose(updates["layers"]["w"][layer], expected, rtol=2e-4, atol=2e-5)


def test_muon_config_is_validated() -> None:
    assert load_config(TINY, ["train.optimizer=muon"]).train.optimizer == "muon"
    for override, field in (("train.optimizer=lion", "optimizer"), ("train.muon_lr=0", "muon_lr"),
                            ("train.muon_beta=1", "muon_beta"), ("train.muon_weight_decay=-1", "muon_weight_decay")):
        with pytest.raises(ConfigError, match=f"train.*{field}"):
            load_config(TINY, [override])


@pytest.fixture(scope="module")
def muon_island():
    """configs/tiny.toml with Muon on the 8 fake devices, parameters sharded over fsdp=4 x data=2."""
    cfg = load_config(TINY, ["train.optimizer=muon", "mesh.fsdp=4"])
    model = build(cfg.model)
    mesh = make_mesh(cfg)
    text = np.frombuffer(make_text(60_000), np.uint8).astype(np.int32)
    L1 = cfg.model.seq_len + 1
    starts = np.random.default_rng(0).integers(0, len(text) - L1, (3, 4, cfg.train.batch_size))
    return cfg, model, mesh, text[starts[..., None] + np.arange(L1)]


def _train(loop: InnerLoop, state, batches) -> tuple:
    losses = []
    for chunk in batches:
        state, m = loop.run(state, chunk)
        losses.append(np.asarray(m["loss"]))
    return state, np.concatenate(losses)


def test_muon_trains_sharded_and_a_chip_fault_is_found_under_it(muon_island) -> None:
    cfg, model, mesh, batches = muon_island
    fused = InnerLoop(cfg, model, mesh)
    params = fused.init_params(0)
    state = fused.init_state(params)
    # the Muon momentum of a matrix is sharded over fsdp like the matrix
    assert any("fsdp" in tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim >= 2)
    _, loss_fused = _train(fused, state, batches)
    assert loss_fused[-1] < loss_fused[0] - 0.1  # it trains
    # a chip fault in the per-device step under Muon: the statistics probe's outlier is the faulty device
    faulty = InnerLoop(cfg, model, mesh, per_device=True, fault=DeviceFault("scale", 3, factor=10.0))
    _, m = faulty.run(faulty.init_state(params), batches[0])
    norms = np.asarray(m["device_grad_norm"])[-1]
    assert [o.index for o in outliers(norms)] == [[int(d.id) for d in mesh.devices.flat].index(3)]


@pytest.mark.slow  # two more compiles; the fused step's sharded Muon is checked by the test above
def test_muon_per_device_step_trains_as_the_fused_one(muon_island) -> None:
    cfg, model, mesh, batches = muon_island
    fused, per_device = InnerLoop(cfg, model, mesh), InnerLoop(cfg, model, mesh, per_device=True)
    params = fused.init_params(0)
    _, loss_fused = _train(fused, fused.init_state(params), batches)
    _, loss_dev = _train(per_device, per_device.init_state(params), batches)
    np.testing.assert_allclose(loss_dev, loss_fused, rtol=1e-5)


def test_muon_state_restores_exactly_and_trains_on_identically(muon_island, tmp_path: Path) -> None:
    cfg, model, mesh, batches = muon_island
    loop = InnerLoop(cfg, model, mesh)
    state, _ = _train(loop, loop.init_state(loop.init_params(0)), batches[:1])
    saved = jax.tree.map(lambda x: np.asarray(x).copy(), state)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(4, state, {"steps": 4})
    ckpt.wait()
    # a restart restores into the loop's shardings (a restarted worker builds the same loop, the same program)
    _, restored, meta = ckpt.restore(loop.abstract_state())
    assert meta == {"steps": 4}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), saved)
    mu = [leaf for leaf in jax.tree.leaves(restored.opt_state) if leaf.ndim >= 2]
    assert mu and all(np.abs(np.asarray(x)).max() > 0 for x in mu)  # the moments came back, not fresh zeros
    after_original, loss_a = _train(loop, state, batches[1:])
    after_restored, loss_b = _train(loop, restored, batches[1:])
    np.testing.assert_array_equal(loss_a, loss_b)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after_original.params),
                 jax.tree.map(np.asarray, after_restored.params))
    # a remeshed island (a chip quarantined: 7 healthy devices, the per-device step) restores the same state
    healthy = [d for d in mesh.devices.flat if d.id != 3]
    remeshed = InnerLoop(cfg, model, make_mesh(cfg, healthy, remesh=True), per_device=True)
    _, onto_seven, _ = ckpt.restore(remeshed.abstract_state())
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, onto_seven), saved)
    _, loss_7 = _train(remeshed, onto_seven, batches[1:])
    np.testing.assert_allclose(loss_7, loss_a, rtol=1e-5)
    ckpt.close()


def test_adamw_is_still_the_default() -> None:
    tx = make_optimizer(TrainConfig(grad_clip=0.0))
    params = {"w": np.ones((4, 4), np.float32)}
    assert isinstance(tx.init(params)[0], optax.ScaleByAdamState)
