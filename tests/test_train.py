"""The inner loop: sharding equivalence, training progress, model accounting, chunking, donation."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY, make_text
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config
from dtrain.data.corpus import SequenceStream, open_corpus
from dtrain.models import model
from dtrain.steps.inner import loss_fn, lr_schedule, make_mesh, make_optimizer, param_spec, scaled
from dtrain.train.loop import InnerLoop, chunks

EQUIV_OVERRIDES = ["model.dtype=float32", "train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2"]


def test_eight_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


def _cfg(*extra: str) -> Config:
    return load_config(TINY, [*EQUIV_OVERRIDES, *extra])


def _stream_for(cfg: Config, text_corpus) -> SequenceStream:
    data_cfg = replace(cfg, data={"source": str(text_corpus), "max_bytes": 0}).data
    corpus = open_corpus(data_cfg, cfg.model.vocab_size, Path(text_corpus).parent / "cache")
    return SequenceStream(corpus, cfg.model.seq_len, seed=0)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _run_layout(cfg: Config, devices, params0, batches: np.ndarray):
    """Two calls of 3 fused steps (one compile): the second call continues from the carried optimizer state."""
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg, devices=devices))
    state = loop.init_state(params0)
    state, m1 = loop.run(state, batches[:3])
    state, m2 = loop.run(state, batches[3:])
    losses = np.concatenate([np.asarray(m1["loss"]), np.asarray(m2["loss"])])
    return loop, state, losses


@pytest.fixture(scope="module")
def equiv_inputs(tmp_path_factory):
    base = _cfg()
    path = tmp_path_factory.mktemp("equiv") / "corpus.txt"
    path.write_bytes(make_text(60_000))
    params0 = model.build(base.model).init(0)
    batches = _stream_for(base, path).batches(0, 6, 16)
    return params0, batches


@pytest.fixture(scope="module")
def single_device_reference(equiv_inputs):
    params0, batches = equiv_inputs
    _, state, losses = _run_layout(_cfg(), jax.devices()[:1], params0, batches)
    return int(state.step), _host(state.params), losses


def test_single_device_reference_trains(equiv_inputs, single_device_reference):
    params0, _ = equiv_inputs
    step, params, losses = single_device_reference
    assert step == 6
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    moved = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(params),
                                                                          jax.tree.leaves(params0), strict=True))
    assert moved > 1e-3  # the steps really changed the parameters, so equality below means something


@pytest.mark.parametrize("layout", ["data8", "fsdp4xdata2"])
def test_sharded_inner_steps_equal_single_device(equiv_inputs, single_device_reference, layout: str):
    params0, batches = equiv_inputs
    _, ref_params, ref_losses = single_device_reference
    cfg, shape = {"data8": (_cfg("mesh.data=8"), {"data": 8, "fsdp": 1}),
                  "fsdp4xdata2": (_cfg("mesh.data=2", "mesh.fsdp=4"), {"data": 2, "fsdp": 4})}[layout]
    loop, state, losses = _run_layout(cfg, jax.devices(), params0, batches)
    assert dict(loop.mesh.shape) == shape
    assert loop.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    got = _host(state.params)
    assert jax.tree.structure(got) == jax.tree.structure(ref_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref_params)
    # the batch really is split: each device holds B / 8 sequences
    placed = jax.device_put(batches, loop.batch_sharding)
    assert placed.addressable_shards[0].data.shape == (6, 16 // 8, batches.shape[-1])
    specs = [tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(state.params)]
    if shape["fsdp"] == 1:
        assert not any("fsdp" in s for s in specs)  # pure data parallel: replicated parameters
    else:
        assert any("fsdp" in s for s in specs), specs
        # optimizer moments are sharded like the parameters
        assert any("fsdp" in tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim >= 2)
        # each device holds only a quarter of a sharded matrix
        qkv = state.params["blocks"][0]["attn"]["qkv"]["kernel"]
        assert "fsdp" in tuple(qkv.sharding.spec)
        assert qkv.addressable_shards[0].data.size == qkv.size // 4


def test_param_spec_rule():
    assert param_spec((32, 96), 1) == jax.sharding.PartitionSpec()
    assert param_spec((32, 96), 4) == jax.sharding.PartitionSpec(None, "fsdp")
    assert param_spec((256, 32), 4) == jax.sharding.PartitionSpec("fsdp", None)
    assert param_spec((6, 3), 4) == jax.sharding.PartitionSpec()  # nothing divisible: replicated
    assert param_spec((), 4) == jax.sharding.PartitionSpec()


def _train_losses(cfg: Config, text_corpus, steps: int) -> np.ndarray:
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg, devices=jax.devices()[:1]))
    state = loop.init_state(loop.model.init(cfg.run.seed))
    stream = _stream_for(cfg, text_corpus)
    losses = []
    for c in range(0, steps, 10):
        state, m = loop.run(state, stream.batches(c * cfg.train.batch_size, 10, cfg.train.batch_size))
        losses.extend(np.asarray(m["loss"]).tolist())
    return np.array(losses)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_loss_decreases(text_corpus, kind: str):
    # the bigram MLP learns more slowly per step at the tiny config's lr
    cfg = load_config(TINY, [f"model.kind={kind}"] + (["train.lr=1e-2"] if kind == "mlp" else []))
    losses = _train_losses(cfg, text_corpus, 30)
    assert abs(losses[0] - math.log(256)) < 0.3  # starts at chance
    assert losses[-3:].mean() < losses[:3].mean() - 1.0, losses
    assert np.all(np.isfinite(losses))


def _independent_param_count(cfg) -> tuple[int, int]:
    """(total params, embedding-table params) counted from the architecture, not from the code."""
    V, L, D, n, r = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.mlp_ratio
    if cfg.kind == "gpt":
        block = 2 * D + 3 * D * D + D * D + 2 * D + D * r * D + r * D * D  # ln1, qkv, proj, ln2, up, down
        return V * D + L * D + n * block + 2 * D + D * V, V * D + L * D
    return V * D + n * D * D + D * V, V * D


@pytest.mark.parametrize("overrides", [[], ["model.kind=mlp"], ["model.n_layers=3", "model.mlp_ratio=2"],
                                       ["model.vocab_size=1000", "model.seq_len=48"]])
def test_param_count_and_flops(overrides):
    cfg = load_config(TINY, overrides).model
    built = model.build(cfg)
    params = built.init(0)
    total, embed = _independent_param_count(cfg)
    assert model.param_count(params) == total
    assert model.param_count(built.abstract_params) == total
    expected = 6.0 * (total - embed)
    if cfg.kind == "gpt":
        expected += 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    assert model.embedding_param_count(cfg) == embed
    assert model.flops_per_token(cfg) == expected
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_init_is_seeded():
    built = model.build(load_config(TINY).model)
    a, b, c = built.init(0), built.init(0), built.init(1)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a["head"]["kernel"], c["head"]["kernel"])


def test_bf16_compute_keeps_fp32_params():
    cfg = load_config(TINY, ["model.dtype=bfloat16"])
    built = model.build(cfg.model)
    params = built.init(0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    logits = jax.jit(built.apply)(params, jnp.zeros((2, cfg.model.seq_len), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (2, cfg.model.seq_len, cfg.model.vocab_size)


def test_eval_loss_is_mean_of_batch_losses(text_corpus):
    cfg = load_config(TINY)
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg))
    params = loop.init_params(3)
    evals = _stream_for(cfg, text_corpus).batches(0, 4, cfg.train.batch_size)
    got = loop.evaluate(params, evals)
    host_params = _host(params)
    per_batch = [float(loss_fn(loop.model.apply, host_params, jnp.asarray(b))) for b in evals]
    assert len(set(per_batch)) == 4  # distinct batches, so the mean is a real check
    np.testing.assert_allclose(got, np.mean(per_batch), rtol=1e-5)


def test_loss_fn_is_next_token_cross_entropy():
    cfg = load_config(TINY, ["model.kind=mlp"])
    built = model.build(cfg.model)
    params = built.init(0)
    batch = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)
    logits = np.asarray(built.apply(params, jnp.asarray(batch[:, :-1])), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, batch[:, 1:, None], -1).mean()
    np.testing.assert_allclose(float(loss_fn(built.apply, params, jnp.asarray(batch))), expected, rtol=1e-5)


@pytest.mark.parametrize("total,per_call,boundaries,expected", [
    (0, 10, (), []),
    (25, 10, (), [10, 10, 5]),
    (100, 30, (45, 50, 0, 100, 150), [30, 15, 5, 30, 20]),
    (60, 7, (10, 20, 30, 40, 50), [7, 3] * 6),
    (5, 10, (2, 2, 4), [2, 2, 1]),
])
def test_chunks_examples(total, per_call, boundaries, expected):
    assert chunks(total, per_call, boundaries) == expected


def test_chunks_never_cross_boundaries():
    rng = np.random.default_rng(0)
    for _ in range(300):
        total = int(rng.integers(0, 200))
        per_call = int(rng.integers(1, 40))
        boundaries = tuple(int(b) for b in rng.integers(-5, 220, size=int(rng.integers(0, 8))))
        out = chunks(total, per_call, boundaries)
        assert sum(out) == total
        assert all(1 <= n <= per_call for n in out)
        ends = set(np.cumsum(out).tolist())
        assert {b for b in boundaries if 0 < b < total} <= ends, (total, per_call, boundaries, out)


def test_run_donates_state_and_place_params_copies(text_corpus):
    cfg = load_config(TINY)
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg))
    params = loop.init_params(0)
    state = loop.init_state(params)
    old_leaves = jax.tree.leaves(state)
    batches = _stream_for(cfg, text_corpus).batches(0, 2, cfg.train.batch_size)
    new_state, _ = loop.run(state, batches)
    assert all(x.is_deleted() for x in old_leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_state))
    # init_state copied the params: the caller's params survive the donation
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    assert int(new_state.step) == 2
    # with_params swaps parameters but keeps the AdamW moments and the step
    swapped = loop.with_params(new_state, params)
    assert int(swapped.step) == 2
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 swapped.opt_state, new_state.opt_state)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), swapped.params, params)
    # θ from the host (a pull's arrays, views of one buffer): copied too, never aliased, on a CPU backend as well
    # (a donated alias would let the step write into the host's buffer)
    host = jax.tree.map(np.array, params)
    kept = jax.tree.map(np.copy, host)
    placed = loop.place_params(host)
    jax.tree.map(lambda h: h.__iadd__(1.0), host)  # the host's buffers change after the placement
    jax.tree.map(lambda a, k: np.testing.assert_array_equal(np.asarray(a), k), placed, kept)
    jax.tree.map(np.copyto, host, kept)
    after, _ = loop.run(loop.with_params(new_state, host), batches)  # donates the placed copy, steps it
    assert int(after.step) == 4
    jax.tree.map(lambda h, k: np.testing.assert_array_equal(h, k), host, kept)


def test_lr_schedule():
    cfg = load_config(TINY)  # lr 3e-3, warmup 5, steps 60, min_lr_ratio 0.1
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg, devices=jax.devices()[:1]))
    t = cfg.train
    assert loop.lr_at(0) == 0.0
    assert loop.lr_at(t.warmup_steps) == pytest.approx(t.lr)
    assert loop.lr_at(t.warmup_steps // 2) == pytest.approx(t.lr * (t.warmup_steps // 2) / t.warmup_steps)
    assert loop.lr_at(t.steps) == pytest.approx(t.lr * t.min_lr_ratio)
    mid = (t.warmup_steps + t.steps) / 2
    assert loop.lr_at(int(mid)) == pytest.approx(t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5), rel=0.05)


def test_lr_schedule_is_optax_warmup_cosine():
    """The schedule the step computes from its numbers is optax's warm-up + cosine decay, step for step."""
    t = load_config(TINY, ["train.warmup_steps=7", "train.steps=50"]).train
    ref = optax.warmup_cosine_decay_schedule(0.0, t.lr, 7, 50, t.lr * t.min_lr_ratio)
    ours = lr_schedule(t)
    for step in (0, 1, 3, 6, 7, 8, 20, 49, 50, 60):
        assert float(ours(step)) == pytest.approx(float(ref(step)), rel=1e-5, abs=1e-9), step


def test_retime_changes_the_schedule_without_compiling():
    """An island's stretched schedule (wall-time rounds) is an input of the compiled step: after ``retime`` the same
    program trains exactly as a loop built with the stretched config, and nothing was compiled again."""
    cfg = load_config(TINY)
    stretched = replace(cfg, train={"steps": cfg.train.steps * 3, "warmup_steps": cfg.train.warmup_steps * 3})
    built = model.build(cfg.model)
    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    batches = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (3, cfg.train.batch_size,
                                                                          cfg.model.seq_len + 1), dtype=np.int32)
    params = built.init(0)
    loop = InnerLoop(cfg, built, mesh)
    state, _ = loop.run(loop.init_state(params), batches)  # steps 0-2 on the config's schedule
    compiled = loop._scan._cache_size()
    loop.retime(stretched)
    assert loop.lr_at(4) == pytest.approx(InnerLoop(stretched, built, mesh).lr_at(4))
    assert loop.lr_at(4) < InnerLoop(cfg, built, mesh).lr_at(4)  # in warm-up: the stretched one climbs slower
    after, _ = loop.run(state, batches)
    assert loop._scan._cache_size() == compiled
    ref = InnerLoop(cfg, built, mesh)
    ref_state, _ = ref.run(ref.init_state(params), batches)
    ref2 = InnerLoop(stretched, built, mesh)
    expect, _ = ref2.run(ref_state, batches)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
                 after.params, expect.params)


def test_weight_decay_only_on_matrices():
    cfg = load_config(TINY, ["train.warmup_steps=0", "train.grad_clip=0.0", "train.weight_decay=0.5"]).train
    tx = make_optimizer(cfg)
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    updates = scaled(updates, lr_schedule(cfg)(0))  # the step applies the scheduled rate (warm-up 0: the peak)
    np.testing.assert_allclose(np.asarray(updates["w"]), -cfg.lr * 0.5 * np.ones((3, 4)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(updates["b"]), np.zeros(4))


def test_grad_clip_is_applied():
    cfg = load_config(TINY, ["train.warmup_steps=0", "train.weight_decay=0.0", "train.grad_clip=1.0"]).train
    clipped = make_optimizer(cfg)
    unclipped = make_optimizer(replace(load_config(TINY), train={"warmup_steps": 0, "weight_decay": 0.0,
                                                                  "grad_clip": 0.0}).train)
    params = {"w": jnp.zeros((2,))}
    g = {"w": jnp.array([30.0, 40.0])}  # norm 50
    # Adam's first step is sign-like either way; the clip shows in the first-moment state.
    _, s1 = clipped.update(g, clipped.init(params), params)
    _, s2 = unclipped.update(g, unclipped.init(params), params)
    mu_clipped = [x for x in jax.tree.leaves(s1) if x.shape == (2,)][0]  # leaves: count, mu, nu
    mu_raw = [x for x in jax.tree.leaves(s2) if x.shape == (2,)][0]
    np.testing.assert_allclose(np.asarray(mu_clipped), 0.1 * np.array([0.6, 0.8]), rtol=1e-6)  # (1-b1) g/|g|
    np.testing.assert_allclose(np.asarray(mu_raw), 0.1 * np.array([30.0, 40.0]), rtol=1e-6)
    assert isinstance(clipped, optax.GradientTransformation)
