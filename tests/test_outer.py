"""The DiLoCo outer step against an independent numpy implementation and hand-derived numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from dtrain import model, outer
from dtrain.config import OuterConfig, load_config
from dtrain.data import SequenceStream, load_corpus
from dtrain.diloco import Island, advance, diloco_round, record_loss, round_lengths
from dtrain.train import InnerLoop, make_mesh


def _tree(a, c):
    return {"a": jnp.asarray(a, jnp.float32), "b": {"c": jnp.asarray(c, jnp.float32)}}


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_pseudo_gradient_sign_and_dtype():
    g = _tree([1.0, 2.0, -1.0], [[0.0, 1.0], [2.0, 3.0]])
    loc = _tree([0.5, 3.0, -1.0], [[1.0, 1.0], [0.0, 3.5]])
    d = outer.pseudo_gradient(g, loc)
    np.testing.assert_allclose(d["a"], [0.5, -1.0, 0.0])  # global - local
    np.testing.assert_allclose(d["b"]["c"], [[-1.0, 0.0], [2.0, -0.5]])
    assert d["a"].dtype == jnp.float32
    assert jax.tree.structure(d) == jax.tree.structure(g)
    # a descent step of lr 1 along Δ goes from the global params to the local ones
    back = jax.tree.map(lambda x, y: x - y, g, d)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y), back, loc)


def test_merge_weights_tokens_and_staleness():
    np.testing.assert_allclose(outer.merge_weights([1, 3]), [0.25, 0.75])
    np.testing.assert_allclose(outer.merge_weights([2, 2, 4]), [0.25, 0.25, 0.5])
    assert float(outer.staleness_factor(0, 0.5)) == 1.0
    assert float(outer.staleness_factor(3, 0.5)) == pytest.approx(0.5)
    assert float(outer.staleness_factor(1, 1.0)) == pytest.approx(0.5)
    assert float(outer.staleness_factor(7, 0.0)) == 1.0
    # w = tokens * (1+s)^-alpha = [1 * 1, 3 * 0.5] = [1, 1.5] -> [0.4, 0.6]
    np.testing.assert_allclose(outer.merge_weights([1, 3], staleness=[0, 3], alpha=0.5), [0.4, 0.6], rtol=1e-6)
    s, a = np.array([0, 1, 2, 5]), 0.7
    tok = np.array([10.0, 20.0, 5.0, 40.0])
    w = tok * (1.0 + s) ** -a
    np.testing.assert_allclose(outer.merge_weights(tok, staleness=s, alpha=a), w / w.sum(), rtol=1e-6)


def test_merge_deltas_weighted_mean():
    d1 = _tree([1.0, 0.0, 4.0], [[1.0, 2.0], [3.0, 4.0]])
    d2 = _tree([5.0, 8.0, 0.0], [[-1.0, 2.0], [0.0, 0.0]])
    m = outer.merge_deltas([d1, d2], tokens=[1, 3])
    np.testing.assert_allclose(m["a"], [4.0, 6.0, 1.0], rtol=1e-6)  # 0.25 d1 + 0.75 d2
    np.testing.assert_allclose(m["b"]["c"], [[-0.5, 2.0], [0.75, 1.0]], rtol=1e-6)
    ms = outer.merge_deltas([d1, d2], tokens=[1, 3], staleness=[0, 3], alpha=0.5)  # weights [0.4, 0.6]
    np.testing.assert_allclose(ms["a"], 0.4 * np.array([1.0, 0.0, 4.0]) + 0.6 * np.array([5.0, 8.0, 0.0]),
                               rtol=1e-6)
    # equal deltas merge to themselves whatever the weights
    same = outer.merge_deltas([d1, d1, d1], tokens=[1, 50, 7])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), same, d1)


@pytest.mark.parametrize("deltas,tokens", [(2, [1]), (1, [1, 2]), (0, []), (2, [0, 0]), (1, [0])])
def test_merge_deltas_rejects(deltas: int, tokens: list):
    d = _tree([1.0], [[1.0]])
    with pytest.raises(ValueError):
        outer.merge_deltas([d] * deltas, tokens)


def numpy_outer(theta0, deltas, lr, mu, nesterov):
    """Reference SGD with (Nesterov) momentum: m = d + mu m; u = d + mu m (nesterov) or m; θ -= lr u."""
    theta = {k: np.asarray(v, np.float64).copy() for k, v in theta0.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    out = []
    for d in deltas:
        for k in theta:
            m[k] = d[k] + mu * m[k]
            u = d[k] + mu * m[k] if nesterov else m[k]
            theta[k] = theta[k] - lr * u
        out.append({k: v.copy() for k, v in theta.items()})
    return out


@pytest.mark.parametrize("mu,nesterov", [(0.9, True), (0.9, False), (0.0, True), (0.5, True)])
def test_outer_step_matches_numpy(mu: float, nesterov: bool):
    rng = np.random.default_rng(0)
    theta0 = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    deltas = [{k: rng.normal(size=v.shape) for k, v in theta0.items()} for _ in range(5)]
    expected = numpy_outer(theta0, deltas, 0.7, mu, nesterov)
    tx = outer.make_outer_optimizer(OuterConfig(lr=0.7, momentum=mu, nesterov=nesterov))
    state = outer.init_outer(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), theta0), tx)
    for v, (d, want) in enumerate(zip(deltas, expected), start=1):
        state = outer.outer_step(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), d), tx)
        assert int(state.version) == v
        for k in theta0:
            np.testing.assert_allclose(np.asarray(state.params[k]), want[k], rtol=1e-5, atol=1e-6)


def test_outer_nesterov_hand_derived():
    """θ0 = 1, Δ1 = 0.5, Δ2 = -0.2, lr 0.7, μ 0.9.

    step 1: m = 0.5;                u = 0.5 + 0.9*0.5 = 0.95;     θ = 1 - 0.7*0.95 = 0.335
    step 2: m = -0.2 + 0.45 = 0.25; u = -0.2 + 0.9*0.25 = 0.025;  θ = 0.335 - 0.7*0.025 = 0.3175
    """
    tx = outer.make_outer_optimizer(OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    state = outer.init_outer({"x": jnp.array([1.0])}, tx)
    state = outer.outer_step(state, {"x": jnp.array([0.5])}, tx)
    assert float(state.params["x"][0]) == pytest.approx(0.335, abs=1e-6)
    trace = [x for x in jax.tree.leaves(state.opt_state) if x.shape == (1,)]
    assert float(trace[0][0]) == pytest.approx(0.5, abs=1e-7)  # the momentum buffer
    state = outer.outer_step(state, {"x": jnp.array([-0.2])}, tx)
    assert float(state.params["x"][0]) == pytest.approx(0.3175, abs=1e-6)
    trace = [x for x in jax.tree.leaves(state.opt_state) if x.shape == (1,)]
    assert float(trace[0][0]) == pytest.approx(0.25, abs=1e-7)
    assert int(state.version) == 2


def test_outer_heavy_ball_hand_derived():
    """The same inputs without Nesterov: θ1 = 1 - 0.7*0.5 = 0.65; θ2 = 0.65 - 0.7*0.25 = 0.475."""
    tx = outer.make_outer_optimizer(OuterConfig(lr=0.7, momentum=0.9, nesterov=False))
    state = outer.init_outer({"x": jnp.array([1.0])}, tx)
    state = outer.outer_step(state, {"x": jnp.array([0.5])}, tx)
    assert float(state.params["x"][0]) == pytest.approx(0.65, abs=1e-6)
    state = outer.outer_step(state, {"x": jnp.array([-0.2])}, tx)
    assert float(state.params["x"][0]) == pytest.approx(0.475, abs=1e-6)


def test_momentum_zero_is_plain_sgd():
    tx = outer.make_outer_optimizer(OuterConfig(lr=0.7, momentum=0.0, nesterov=True))
    state = outer.init_outer({"x": jnp.array([1.0, -2.0])}, tx)
    assert [x for x in jax.tree.leaves(state.opt_state) if x.shape == (2,)] == []  # no momentum buffer
    state = outer.outer_step(state, {"x": jnp.array([0.5, 1.0])}, tx)
    np.testing.assert_allclose(state.params["x"], [1.0 - 0.35, -2.0 - 0.7], rtol=1e-6)
    state = outer.outer_step(state, {"x": jnp.array([-0.2, 0.0])}, tx)
    np.testing.assert_allclose(state.params["x"], [0.65 + 0.14, -2.7], rtol=1e-6)


def test_round_lengths():
    assert round_lengths(60, 20) == [20, 20, 20]
    assert round_lengths(50, 20) == [20, 20, 10]
    assert round_lengths(7, 7) == [7]
    assert round_lengths(5, 1) == [1] * 5


def test_one_island_lr1_no_momentum_is_plain_training(tmp_path, text_corpus):
    """DiLoCo with one island, outer lr 1 and no momentum: θ_{v+1} = θ_v - (θ_v - θ_local) = θ_local,
    and the island keeps its AdamW state across rounds, so it is exactly plain training."""
    cfg = load_config(TINY, ["model.dtype=float32", "train.steps=30", "outer.inner_steps=10", "outer.lr=1.0",
                             "outer.momentum=0.0", "train.steps_per_call=10", f"data.source={text_corpus}",
                             "data.max_bytes=0"])
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg, devices=jax.devices()[:1]))
    tokens = load_corpus(cfg.data).tokens
    B = cfg.train.batch_size
    params0 = loop.model.init(cfg.run.seed)

    plain = Island(index=0, state=loop.init_state(params0), stream=SequenceStream(tokens, cfg.model.seq_len, 0))
    advance(loop, plain, cfg.train.steps, B, record_loss)

    tx = outer.make_outer_optimizer(cfg.outer)
    global_state = outer.init_outer(loop.place_params(params0), tx)
    isl = Island(index=0, state=loop.init_state(params0), stream=SequenceStream(tokens, cfg.model.seq_len, 0))
    for steps in round_lengths(cfg.train.steps, cfg.outer.inner_steps):
        global_state, res = diloco_round(loop, global_state, [isl], steps, B, tx, record_loss)
        assert res.weights == [1.0] and res.steps == steps
    assert int(global_state.version) == 3
    assert isl.cursor == plain.cursor == 30 * B and isl.tokens == plain.tokens
    assert int(isl.state.step) == int(plain.state.step) == 30

    np.testing.assert_allclose(isl.losses, plain.losses, rtol=1e-5, atol=1e-6)
    assert plain.losses[-1] < plain.losses[0] - 0.5  # it trained: the comparison is not between two no-ops
    want = _np(plain.state.params)
    for got in (_np(global_state.params), _np(isl.state.params)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
