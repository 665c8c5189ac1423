"""The one outer update (dtrain.steps.outer) and the pytree outer step (dtrain.train.diloco): hand-derived golden
numbers, optax.sgd as an external oracle, and an independent numpy implementation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY
from dtrain.config.load import load_config
from dtrain.config.sections import ConfigError
from dtrain.data.corpus import SequenceStream, open_corpus
from dtrain.models import model
from dtrain.steps import outer
from dtrain.steps.inner import make_mesh
from dtrain.steps.outer import OuterHParams
from dtrain.train.diloco import (
    Island,
    advance,
    diloco_round,
    init_outer,
    merge_deltas,
    outer_step,
    pseudo_gradient,
    record_loss,
    round_lengths,
)
from dtrain.train.loop import InnerLoop


def _tree(a, c):
    return {"a": jnp.asarray(a, jnp.float32), "b": {"c": jnp.asarray(c, jnp.float32)}}


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_pseudo_gradient_sign_and_dtype():
    g = _tree([1.0, 2.0, -1.0], [[0.0, 1.0], [2.0, 3.0]])
    loc = _tree([0.5, 3.0, -1.0], [[1.0, 1.0], [0.0, 3.5]])
    d = pseudo_gradient(g, loc)
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
    assert outer.staleness_weight(1000, 0, 0.5) == 1000.0
    assert outer.staleness_weight(1, 3, 0.5) == pytest.approx(0.5)
    assert outer.staleness_weight(10, 1, 1.0) == pytest.approx(5.0)
    assert outer.staleness_weight(7, 7, 0.0) == 7.0
    # w = tokens * (1+s)^-alpha = [1 * 1, 3 * 0.5] = [1, 1.5] -> [0.4, 0.6]
    np.testing.assert_allclose(outer.merge_weights([1, 3], staleness=[0, 3], alpha=0.5), [0.4, 0.6], rtol=1e-6)
    s, a = np.array([0, 1, 2, 5]), 0.7
    tok = np.array([10.0, 20.0, 5.0, 40.0])
    w = tok * (1.0 + s) ** -a
    np.testing.assert_allclose(outer.merge_weights(tok, staleness=s, alpha=a), w / w.sum(), rtol=1e-6)
    assert outer.merge_weights([1, 3]).dtype == np.float32
    with pytest.raises(ValueError, match="one staleness per token count"):
        outer.merge_weights([1, 3], staleness=[0])


def test_merge_deltas_weighted_mean():
    d1 = _tree([1.0, 0.0, 4.0], [[1.0, 2.0], [3.0, 4.0]])
    d2 = _tree([5.0, 8.0, 0.0], [[-1.0, 2.0], [0.0, 0.0]])
    m = merge_deltas([d1, d2], tokens=[1, 3])
    np.testing.assert_allclose(m["a"], [4.0, 6.0, 1.0], rtol=1e-6)  # 0.25 d1 + 0.75 d2
    np.testing.assert_allclose(m["b"]["c"], [[-0.5, 2.0], [0.75, 1.0]], rtol=1e-6)
    ms = merge_deltas([d1, d2], tokens=[1, 3], staleness=[0, 3], alpha=0.5)  # weights [0.4, 0.6]
    np.testing.assert_allclose(ms["a"], 0.4 * np.array([1.0, 0.0, 4.0]) + 0.6 * np.array([5.0, 8.0, 0.0]),
                               rtol=1e-6)
    # equal deltas merge to themselves whatever the weights
    same = merge_deltas([d1, d1, d1], tokens=[1, 50, 7])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), same, d1)


@pytest.mark.parametrize("deltas,tokens", [(2, [1]), (1, [1, 2]), (0, []), (2, [0, 0]), (1, [0])])
def test_merge_deltas_rejects(deltas: int, tokens: list):
    d = _tree([1.0], [[1.0]])
    with pytest.raises(ValueError):
        merge_deltas([d] * deltas, tokens)


def test_hparams_from_config():
    cfg = load_config(TINY, ["outer.lr=0.8", "outer.momentum=0.5", "outer.nesterov=false", "outer.islands=4"])
    assert OuterHParams.from_config(cfg) == OuterHParams(lr=0.8, momentum=0.5, nesterov=False)
    # async mode merges every push on its own: N merges per round of N pushes, each with lr / N
    acfg = load_config(TINY, ["outer.lr=0.8", "outer.islands=4", "coordinator.mode=async"])
    assert OuterHParams.from_config(acfg).lr == pytest.approx(0.2)
    assert OuterHParams.from_config(acfg, mode="sync").lr == 0.8  # the in-process rounds are synchronous
    with pytest.raises(ValueError, match="merge mode must be 'sync' or 'async'"):
        OuterHParams.from_config(cfg, mode="lockstep")


def test_sparseloco_rule_is_sgd_on_the_mean_without_momentum():
    """outer.rule = sparseloco: u = −sparseloco_lr·Δ and the momentum is left as it is (whatever outer.momentum
    says), numpy and jax alike; async divides the lr as for nesterov; the islands' error feedback decays by β."""
    cfg = load_config(TINY, ["outer.rule=sparseloco", "outer.sparseloco_lr=0.9", "outer.sparseloco_beta=0.8",
                             "outer.momentum=0.5", "outer.islands=3"])
    hp = OuterHParams.from_config(cfg)
    assert hp == OuterHParams(lr=0.9, momentum=0.0, nesterov=False, rule="sparseloco")
    assert OuterHParams.from_config(cfg, mode="async").lr == pytest.approx(0.3)
    assert outer.feedback_decay(cfg) == 0.8 and outer.feedback_decay(load_config(TINY)) == 1.0
    delta, m = np.array([1.0, -2.0], np.float32), np.array([5.0, 6.0], np.float32)
    forced = OuterHParams(lr=0.9, momentum=0.9, nesterov=True, rule="sparseloco")  # momentum ignored
    for h in (hp, forced):
        u, m2 = outer.outer_update(delta, m, h)
        np.testing.assert_allclose(u, [-0.9, 1.8])
        assert m2 is m
        ju, jm = outer.outer_update(jnp.asarray(delta), jnp.asarray(m), h)
        np.testing.assert_allclose(np.asarray(ju), u)
        np.testing.assert_array_equal(np.asarray(jm), m)


def test_the_mask_codec_takes_its_own_lr_and_beta():
    """With codec.up = mask the sparseloco rule reads outer.mask_lr and outer.mask_beta (defaults 2.5 and 0.5, the
    fitted pair), not SparseLoCo's two; a bad value of either is refused by name."""
    cfg = load_config(TINY, ["codec.up=mask", "codec.down=mask", "outer.rule=sparseloco",
                             "outer.sparseloco_lr=0.9", "outer.sparseloco_beta=0.8"])
    assert OuterHParams.from_config(cfg).lr == 2.5 and outer.feedback_decay(cfg) == 0.5
    tuned = load_config(TINY, ["codec.up=mask", "codec.down=mask", "outer.rule=sparseloco", "outer.mask_lr=1.5",
                               "outer.mask_beta=0.3"])
    assert OuterHParams.from_config(tuned).lr == 1.5 and outer.feedback_decay(tuned) == 0.3
    assert "outer.mask_beta" in cfg.fingerprint_fields()
    assert "outer.mask_beta" not in load_config(TINY).fingerprint_fields()
    with pytest.raises(ConfigError, match=r"\[outer\] mask_lr: must be > 0"):
        load_config(TINY, ["outer.mask_lr=0"])
    with pytest.raises(ConfigError, match=r"\[outer\] mask_beta: must be in \(0, 1\]"):
        load_config(TINY, ["outer.mask_beta=1.5"])


HP = OuterHParams(lr=0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_outer_update_hand_derived(xp):
    """Δ1 = 0.5, Δ2 = -0.2, lr 0.7, μ 0.9.

    Nesterov   step 1: m = 0.5;  u = -0.7*(0.5 + 0.9*0.5) = -0.665
               step 2: m = -0.2 + 0.45 = 0.25;  u = -0.7*(-0.2 + 0.9*0.25) = -0.0175
    heavy ball step 1: u = -0.7*0.5 = -0.35;  step 2: u = -0.7*0.25 = -0.175
    μ = 0      u = -0.7*Δ; m is left as it is
    """
    d1, d2, zero = (xp.asarray([v, v], xp.float32) for v in (0.5, -0.2, 0.0))
    u, m = outer.outer_update(d1, zero, HP)
    np.testing.assert_allclose(np.asarray(u), -0.665, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m), 0.5, atol=1e-7)
    u, m = outer.outer_update(d2, m, HP)
    np.testing.assert_allclose(np.asarray(u), -0.0175, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m), 0.25, atol=1e-7)
    assert u.dtype == m.dtype == xp.float32 and isinstance(u, type(d1))
    heavy = OuterHParams(lr=0.7, momentum=0.9, nesterov=False)
    u, m = outer.outer_update(d1, zero, heavy)
    np.testing.assert_allclose(np.asarray(u), -0.35, atol=1e-7)
    u, m = outer.outer_update(d2, m, heavy)
    np.testing.assert_allclose(np.asarray(u), -0.175, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m), 0.25, atol=1e-7)
    sgd = OuterHParams(lr=0.7, momentum=0.0, nesterov=True)
    m0 = xp.asarray([3.0, 3.0], xp.float32)
    u, m = outer.outer_update(d2, m0, sgd)
    np.testing.assert_allclose(np.asarray(u), 0.14, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(m), [3.0, 3.0])


def test_outer_update_leaves_its_inputs_alone():
    d, m = np.full(4, 0.5, np.float32), np.full(4, 0.25, np.float32)
    for hp in (HP, OuterHParams(0.7, 0.9, False), OuterHParams(0.7, 0.0, True)):
        outer.outer_update(d, m, hp)
        assert (d == 0.5).all() and (m == 0.25).all()


@pytest.mark.parametrize("mu,nesterov", [(0.9, True), (0.9, False), (0.0, True), (0.5, True)])
def test_outer_update_matches_the_optax_oracle(mu: float, nesterov: bool):
    """optax.sgd(lr, momentum, nesterov) is the external reference: the same updates for numpy slabs (the
    merger's) and for jax arrays."""
    rng = np.random.default_rng(7)
    hp = OuterHParams(lr=0.7, momentum=mu, nesterov=nesterov)
    tx = optax.sgd(0.7, momentum=mu or None, nesterov=nesterov)
    x0 = rng.normal(size=300).astype(np.float32)
    opt_state = tx.init(jnp.asarray(x0))
    m_np, m_jax = np.zeros_like(x0), jnp.zeros(x0.shape, jnp.float32)
    for _ in range(5):
        d = rng.normal(size=x0.shape).astype(np.float32)
        want, opt_state = tx.update(jnp.asarray(d), opt_state)
        u_np, m_np = outer.outer_update(d, m_np, hp)
        u_jax, m_jax = outer.outer_update(jnp.asarray(d), m_jax, hp)
        np.testing.assert_allclose(u_np, np.asarray(want), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(u_jax), np.asarray(want), rtol=1e-6, atol=1e-7)


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
def test_outer_step_matches_numpy_and_optax(mu: float, nesterov: bool):
    rng = np.random.default_rng(0)
    theta0 = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    deltas = [{k: rng.normal(size=v.shape) for k, v in theta0.items()} for _ in range(5)]
    expected = numpy_outer(theta0, deltas, 0.7, mu, nesterov)
    hp = OuterHParams(lr=0.7, momentum=mu, nesterov=nesterov)
    tx = optax.sgd(0.7, momentum=mu or None, nesterov=nesterov)  # the external oracle
    as_f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)  # noqa: E731
    state = init_outer(as_f32(theta0))
    oracle, opt_state = as_f32(theta0), tx.init(as_f32(theta0))
    for v, (d, want) in enumerate(zip(deltas, expected, strict=True), start=1):
        state = outer_step(state, as_f32(d), hp)
        updates, opt_state = tx.update(as_f32(d), opt_state)
        oracle = optax.apply_updates(oracle, updates)
        assert int(state.version) == v
        for k in theta0:
            np.testing.assert_allclose(np.asarray(state.params[k]), want[k], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(oracle[k]), rtol=1e-6, atol=1e-6)


def test_outer_nesterov_hand_derived():
    """θ0 = 1, Δ1 = 0.5, Δ2 = -0.2, lr 0.7, μ 0.9.

    step 1: m = 0.5;                u = 0.5 + 0.9*0.5 = 0.95;     θ = 1 - 0.7*0.95 = 0.335
    step 2: m = -0.2 + 0.45 = 0.25; u = -0.2 + 0.9*0.25 = 0.025;  θ = 0.335 - 0.7*0.025 = 0.3175
    """
    state = init_outer({"x": jnp.array([1.0])})
    state = outer_step(state, {"x": jnp.array([0.5])}, HP)
    assert float(state.params["x"][0]) == pytest.approx(0.335, abs=1e-6)
    assert float(state.momentum["x"][0]) == pytest.approx(0.5, abs=1e-7)
    state = outer_step(state, {"x": jnp.array([-0.2])}, HP)
    assert float(state.params["x"][0]) == pytest.approx(0.3175, abs=1e-6)
    assert float(state.momentum["x"][0]) == pytest.approx(0.25, abs=1e-7)
    assert int(state.version) == 2


def test_outer_heavy_ball_hand_derived():
    """The same inputs without Nesterov: θ1 = 1 - 0.7*0.5 = 0.65; θ2 = 0.65 - 0.7*0.25 = 0.475."""
    hp = OuterHParams(lr=0.7, momentum=0.9, nesterov=False)
    state = init_outer({"x": jnp.array([1.0])})
    state = outer_step(state, {"x": jnp.array([0.5])}, hp)
    assert float(state.params["x"][0]) == pytest.approx(0.65, abs=1e-6)
    state = outer_step(state, {"x": jnp.array([-0.2])}, hp)
    assert float(state.params["x"][0]) == pytest.approx(0.475, abs=1e-6)


def test_momentum_zero_is_plain_sgd():
    hp = OuterHParams(lr=0.7, momentum=0.0, nesterov=True)
    state = init_outer({"x": jnp.array([1.0, -2.0])})
    state = outer_step(state, {"x": jnp.array([0.5, 1.0])}, hp)
    np.testing.assert_allclose(state.params["x"], [1.0 - 0.35, -2.0 - 0.7], rtol=1e-6)
    state = outer_step(state, {"x": jnp.array([-0.2, 0.0])}, hp)
    np.testing.assert_allclose(state.params["x"], [0.65 + 0.14, -2.7], rtol=1e-6)
    np.testing.assert_array_equal(state.momentum["x"], [0.0, 0.0])  # no momentum is kept


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
    corpus = open_corpus(cfg.data, cfg.model.vocab_size, tmp_path / "cache")
    B = cfg.train.batch_size
    params0 = loop.model.init(cfg.run.seed)

    plain = Island(index=0, state=loop.init_state(params0), stream=SequenceStream(corpus, cfg.model.seq_len, 0))
    advance(loop, plain, cfg.train.steps, B, record_loss)

    hp = OuterHParams.from_config(cfg, mode="sync")
    global_state = init_outer(loop.place_params(params0))
    isl = Island(index=0, state=loop.init_state(params0), stream=SequenceStream(corpus, cfg.model.seq_len, 0))
    for steps in round_lengths(cfg.train.steps, cfg.outer.inner_steps):
        global_state, res = diloco_round(loop, global_state, [isl], steps, B, hp, record_loss)
        assert res.weights == [1.0] and res.steps == steps
    assert int(global_state.version) == 3
    assert isl.cursor == plain.cursor == 30 * B and isl.tokens == plain.tokens
    assert int(isl.state.step) == int(plain.state.step) == 30

    np.testing.assert_allclose(isl.losses, plain.losses, rtol=1e-5, atol=1e-6)
    assert plain.losses[-1] < plain.losses[0] - 0.5  # it trained: the comparison is not between two no-ops
    want = _np(plain.state.params)
    for got in (_np(global_state.params), _np(isl.state.params)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


# -- robust merge rules and norm screening (the coordinator's, per slab) --------------------------------------


@pytest.mark.parametrize("pushes", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("trim", [0, 1, 2])
def test_trimmed_mean_matches_sorting_and_dropping(pushes: int, trim: int) -> None:
    rng = np.random.default_rng(pushes * 10 + trim)
    values = rng.normal(size=(pushes, 257)).astype(np.float32)
    values[0, :5] = [1e30, -1e30, 3e38, -3e38, 7.0]  # outliers in one push
    k = outer.effective_trim(trim, pushes)
    assert k == min(trim, (pushes - 1) // 2)
    ordered = np.sort(values.astype(np.float64), axis=0)
    want = ordered[k:pushes - k].mean(axis=0)
    got = outer.trimmed_mean(values, trim)
    assert got.dtype == np.float32 and got.shape == (257,)
    if k:  # one push's outliers are trimmed away: the result is ordinary
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.abs(got).max() < 10
    else:
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pushes", [1, 2, 3, 4, 7, 64])
def test_coordinate_median_is_numpys_median(pushes: int) -> None:
    """Bit for bit, with even and odd counts (the even one: one selection and the maximum below it) and with ties
    (values on a coarse grid, as quantized pushes are)."""
    values = np.random.default_rng(pushes).normal(size=(pushes, 300)).astype(np.float32)
    values[-1] *= 1e6  # one poisoned push moves the median by at most one rank
    for v in (values, np.round(values * 4) / 4):
        got = outer.coordinate_median(v)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.median(v, axis=0).astype(np.float32))


def test_robust_rules_refuse_no_pushes() -> None:
    with pytest.raises(ValueError, match="no pushes"):
        outer.trimmed_mean(np.zeros((0, 4), np.float32), 1)
    with pytest.raises(ValueError, match="no pushes"):
        outer.coordinate_median(np.zeros((0, 4), np.float32))


def test_robust_z_is_one_sided_median_mad_with_a_floor() -> None:
    window = [1.0, 1.1, 0.9, 1.2, 0.8]  # median 1, MAD 0.1: sigma = max(0.14826, 0.25) = 0.25
    assert outer.robust_z(1.0, window) == 0.0
    assert outer.robust_z(2.0, window) == pytest.approx(4.0)
    assert outer.robust_z(0.01, window) < 0  # small deltas are never outliers
    spread = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3, MAD 1: sigma = 1.4826 (above the floor 0.75)
    assert outer.robust_z(3.0 + 1.4826 * 6, spread) == pytest.approx(6.0)
    assert outer.robust_z(1e30, window) > 1e29 and outer.robust_z(math.inf, window) == math.inf
    assert outer.robust_z(1.0, [0.0, 0.0]) == math.inf and outer.robust_z(0.0, [0.0]) == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        outer.robust_z(1.0, [])


def test_clip_factor() -> None:
    assert outer.clip_factor(5.0, 0.0) == 1.0  # off
    assert outer.clip_factor(0.5, 1.0) == 1.0
    assert outer.clip_factor(4.0, 1.0) == 0.25
