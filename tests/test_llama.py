"""model.kind = "llama": the parameter tree (a contract with the Hugging Face mapping), causality, rotary
embeddings against a numpy reference of Hugging Face's formulas, grouped-query attention, tied embeddings, the
FLOPs count by hand, training (fused, FSDP, per-device), codecs and checkpoints."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CONFIG_DIR, make_text
from dtrain.checkpoint import Checkpointer
from dtrain.codec import flatten, unflatten
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config
from dtrain.data.corpus import SequenceStream, open_corpus
from dtrain.models import model
from dtrain.steps.inner import loss_fn, make_mesh
from dtrain.train.loop import InnerLoop

LLAMA_TINY = CONFIG_DIR / "llama-tiny.toml"


def _cfg(*overrides: str) -> Config:
    return load_config(LLAMA_TINY, list(overrides))


def _paths(tree) -> dict[str, tuple[int, ...]]:
    return {"/".join(str(k.key) for k in path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _tokens(seed: int, shape: tuple[int, int], vocab: int = 256) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


# ----------------------------------------------------------------------------------- the parameter tree


@pytest.mark.parametrize("tied", [False, True])
def test_the_parameter_tree_is_the_contract(tied: bool) -> None:
    cfg = _cfg(f"model.tie_embeddings={str(tied).lower()}").model
    V, D, F, H = 256, 32, 96, 8  # llama-tiny: 4 heads of 8, 2 kv heads
    expected = {"tok_embed/embedding": (V, D), "norm_f/scale": (D,)}
    for i in range(2):
        expected |= {f"blocks/{i}/attn_norm/scale": (D,), f"blocks/{i}/attn/q/kernel": (D, 4 * H),
                     f"blocks/{i}/attn/k/kernel": (D, 2 * H), f"blocks/{i}/attn/v/kernel": (D, 2 * H),
                     f"blocks/{i}/attn/o/kernel": (4 * H, D), f"blocks/{i}/mlp_norm/scale": (D,),
                     f"blocks/{i}/mlp/gate/kernel": (D, F), f"blocks/{i}/mlp/up/kernel": (D, F),
                     f"blocks/{i}/mlp/down/kernel": (F, D)}
    if not tied:
        expected["head/kernel"] = (D, V)
    built = model.build(cfg)
    params = built.init(0)
    assert _paths(params) == expected
    assert _paths(built.abstract_params) == expected
    assert set(params["blocks"]) == {0, 1}  # nnx.List children: integer keys, as the GPT's
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(params["norm_f"]["scale"], np.ones(D))
    np.testing.assert_array_equal(params["blocks"][1]["mlp_norm"]["scale"], np.ones(D))
    assert float(np.std(params["tok_embed"]["embedding"])) == pytest.approx(0.02, rel=0.1)
    assert float(np.std(params["blocks"][0]["mlp"]["gate"]["kernel"])) == pytest.approx(0.02, rel=0.15)
    assert float(np.std(params["blocks"][0]["mlp"]["down"]["kernel"])) == pytest.approx(0.01, rel=0.15)  # /sqrt(2n)


def test_the_published_shapes() -> None:
    """llama-8b is Meta-Llama-3-8B's 8,030,261,248 parameters, llama-1b Llama 3.2 1B's 1,235,814,400."""
    c8 = load_config(CONFIG_DIR / "llama-8b.toml").model
    assert (c8.d_model, c8.n_layers, c8.n_heads, c8.n_kv_heads, model.llama_mlp_hidden(c8), c8.vocab_size,
            c8.rope_theta, c8.tie_embeddings) == (4096, 32, 32, 8, 14336, 128256, 500000.0, False)
    assert model.param_count(model.build(c8).abstract_params) == 8_030_261_248
    c1 = load_config(CONFIG_DIR / "llama-1b.toml").model
    assert model.param_count(model.build(c1).abstract_params) == 1_235_814_400
    # mlp_hidden = 0: Llama's rule, int(8 d / 3) rounded up to a multiple of 256
    assert model.llama_mlp_hidden(_cfg("model.mlp_hidden=0", "model.d_model=96").model) == 256
    assert model.llama_mlp_hidden(_cfg("model.mlp_hidden=0", "model.d_model=4096").model) == 11008  # Llama 2 7B


# --------------------------------------------------------------------------------------------- semantics


def test_causal_a_later_token_leaves_earlier_logits_alone() -> None:
    built = model.build(_cfg().model)
    params = built.init(0)
    tokens = _tokens(0, (2, 32))
    changed = tokens.at[:, 20:].set((tokens[:, 20:] + 7) % 256)
    a, b = jax.jit(built.apply)(params, tokens), jax.jit(built.apply)(params, changed)
    assert a.shape == (2, 32, 256) and a.dtype == jnp.float32
    np.testing.assert_allclose(a[:, :20], b[:, :20], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(a[:, 20:] - b[:, 20:]).max()) > 1e-3


def _rope_numpy(x_LxH: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face's LlamaRotaryEmbedding + apply_rotary_pos_emb, transcribed to numpy (float64)."""
    L, H = x_LxH.shape
    inv_freq = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.int64).astype(np.float64) / H)
    freqs = np.outer(np.arange(L), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    rotate_half = np.concatenate([-x_LxH[:, H // 2:], x_LxH[:, :H // 2]], axis=-1)
    return x_LxH * np.cos(emb) + rotate_half * np.sin(emb)


def test_rope_is_hugging_faces_rotate_half() -> None:
    L, H, theta = 16, 8, 500000.0
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, L, 3, H)))
    rope = jax.jit(model.apply_rope)
    cos, sin = model.rope_cos_sin(L, H, theta)
    out = np.asarray(rope(jnp.asarray(x), cos, sin))
    for n in range(3):
        np.testing.assert_allclose(out[0, :, n], _rope_numpy(x[0, :, n].astype(np.float64), theta), atol=1e-5)
    # relative positions: q at i and k at j give the same dot product as at i + s and j + s
    cos, sin = model.rope_cos_sin(32, H, 10000.0)
    q, k = np.asarray(jax.random.normal(jax.random.key(1), (2, H)))
    rq = np.asarray(rope(jnp.broadcast_to(jnp.asarray(q), (1, 32, 1, H)), cos, sin))[0, :, 0]
    rk = np.asarray(rope(jnp.broadcast_to(jnp.asarray(k), (1, 32, 1, H)), cos, sin))[0, :, 0]
    for shift in (1, 9, 20):
        assert rq[10] @ rk[3] == pytest.approx(rq[10 + shift] @ rk[3 + shift], rel=1e-4)
    assert abs(rq[10] @ rk[3] - rq[10] @ rk[4]) > 1e-4  # and it does depend on the offset


def test_gqa_kernels_agree_and_follow_repeat_kv() -> None:
    """xla (jax.nn.dot_product_attention with 2 K/V heads for 4 query heads) against einsum (heads repeated), and
    both against plain multi-head attention with each kv head repeated for its query heads (HF's repeat_kv)."""
    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    k, v = (jax.random.normal(jax.random.key(i), (2, 16, 2, 8)) for i in (1, 2))
    attend = jax.jit(model.causal_attention, static_argnums=3)
    xla = attend(q, k, v, "xla")
    ein = attend(q, k, v, "einsum")
    np.testing.assert_allclose(xla, ein, rtol=1e-5, atol=1e-6)
    repeat = [0, 0, 1, 1]  # query head h uses kv head h // (4 // 2)
    mha = attend(q, k[:, :, repeat], v[:, :, repeat], "xla")
    np.testing.assert_allclose(xla, mha, rtol=1e-5, atol=1e-6)


def _loss_and_grads(overrides: list[str], tokens: jax.Array) -> tuple[float, dict]:
    params = model.build(_cfg().model).init(0)
    built = model.build(_cfg(*overrides).model)
    loss, grads = jax.jit(jax.value_and_grad(partial(loss_fn, built.apply)))(params, tokens)
    return float(loss), grads


def test_the_attention_kernels_and_remat_give_the_same_loss_and_gradients() -> None:
    tokens = _tokens(3, (4, 33))
    ref_loss, ref_grads = _loss_and_grads([], tokens)
    assert abs(ref_loss - math.log(256)) < 0.3
    for knobs in (["model.attention=einsum"], ["model.remat=true"]):
        loss, grads = _loss_and_grads(knobs, tokens)
        assert loss == pytest.approx(ref_loss, rel=1e-5), knobs
        jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), grads, ref_grads)
    built = model.build(_cfg("model.remat=true").model)
    assert "remat" in str(jax.make_jaxpr(jax.grad(partial(loss_fn, built.apply)))(built.abstract_params, tokens))
    bf16 = model.build(_cfg("model.dtype=bfloat16").model)
    logits = jax.jit(bf16.apply)(bf16.init(0), tokens[:, :-1])
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_tied_embeddings_share_the_table() -> None:
    built = model.build(_cfg("model.tie_embeddings=true").model)
    params = built.init(0)
    assert "head" not in params
    tokens = _tokens(4, (2, 17))
    apply = jax.jit(built.apply)
    logits = apply(params, tokens[:, :-1])
    table = params["tok_embed"]["embedding"]
    # the logits are the final hidden state times the table: moving one row of the table moves that logit
    bumped = jax.tree.map(lambda x: x, params)
    bumped["tok_embed"]["embedding"] = table.at[200].add(1.0)
    delta = apply(bumped, tokens[:, :-1]) - logits
    assert float(jnp.abs(delta[..., 200]).max()) > 1e-3
    grads = jax.jit(jax.grad(partial(loss_fn, built.apply)))(params, tokens)
    assert float(jnp.abs(grads["tok_embed"]["embedding"][200]).max()) > 0  # 200 never appears as an input
    assert 200 not in np.asarray(tokens[:, :-1])


# ------------------------------------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_by_hand(tied: bool) -> None:
    """llama-tiny: V=256, seq 32, d 32, 2 layers, 4 heads of 8, 2 kv heads, SwiGLU 96. A block: two RMSNorm scales
    2 x 32 = 64, q 32 x 32 = 1024, k and v 2 x 32 x 16 = 1024, o 32 x 32 = 1024, gate, up and down 3 x 32 x 96 =
    9216: 12,352; two blocks 24,704, the final norm 32. The head is a 32 x 256 = 8192 matmul, tied or not (tied:
    by the table, no head parameter). Matmul parameters 24,736 + 8192 = 32,928: 6N = 197,568; attention
    12 x 2 x 32 x 32 = 24,576: 222,144 either way."""
    cfg = _cfg(f"model.tie_embeddings={str(tied).lower()}").model
    assert model.embedding_param_count(cfg) == 256 * 32  # the token table, a lookup
    assert model.param_count(model.build(cfg).abstract_params) == 24_736 + 8192 + (0 if tied else 8192)
    assert model.flops_per_token(cfg) == 222_144
    assert model.flops_per_token(_cfg("model.remat=true", "model.attention=einsum").model) == 222_144


def test_flops_near_xla_cost_analysis() -> None:
    """XLA's count of one training step's FLOPs (forward + backward) near the model count: GQA, tied head (whose
    matmul has no parameter of its own)."""
    cfg = _cfg("model.tie_embeddings=true")
    built = model.build(cfg.model)
    step = jax.jit(jax.value_and_grad(partial(loss_fn, built.apply)))
    cost = step.lower(built.abstract_params, _tokens(5, (8, 33))).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ratio = cost["flops"] / (model.flops_per_token(cfg.model) * 8 * 32)
    assert 0.9 < ratio < 1.5, ratio


# ------------------------------------------------------------------------------------ training, sharding


def _flat(tree) -> dict:
    return {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _batches(cfg: Config, tmp_path: Path, steps: int) -> np.ndarray:
    path = tmp_path / "corpus.txt"
    path.write_bytes(make_text(60_000))
    data_cfg = replace(cfg, data={"source": str(path), "max_bytes": 0}).data
    corpus = open_corpus(data_cfg, cfg.model.vocab_size, tmp_path / "cache")
    return SequenceStream(corpus, cfg.model.seq_len, seed=0).batches(0, steps, cfg.train.batch_size)


def _train(cfg: Config, devices, params0, batches: np.ndarray, per_device: bool = False):
    loop = InnerLoop(cfg, model.build(cfg.model), make_mesh(cfg, devices=devices), per_device=per_device)
    state, m = loop.run(loop.init_state(params0), batches)
    return jax.tree.map(np.asarray, jax.device_get(state.params)), np.asarray(m["loss"]), loop


def test_the_fsdp_mesh_shards_the_llamas_matrices() -> None:
    """The sharding the training test below checks (slow: three compiles), without training: on a data 2 x fsdp 4
    mesh the attention's and the MLP's matrices are sharded over fsdp."""
    fsdp = _cfg("train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2", "mesh.data=2", "mesh.fsdp=4")
    loop = InnerLoop(fsdp, model.build(fsdp.model), make_mesh(fsdp, devices=jax.devices()))
    specs = {k: tuple(s.spec) for k, s in _flat(loop.params_sharding).items()}
    assert "fsdp" in specs["blocks/0/attn/k/kernel"] and "fsdp" in specs["blocks/0/mlp/gate/kernel"], specs


@pytest.mark.slow  # ~27 s: three trainings; the sharding is checked above, GPT's fsdp and per-device equivalence
# by test_train.py::test_sharded_inner_steps_equal_single_device and test_chip_step.py
def test_training_fsdp_and_per_device_steps(tmp_path: Path) -> None:
    """Six steps of llama-tiny: the loss falls; the same losses and parameters on one device, on a data 2 x fsdp 4
    mesh (parameters sharded) and with the per-device (chip-health) step on 8 devices."""
    cfg = _cfg("train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2")
    params0 = model.build(cfg.model).init(0)
    batches = _batches(cfg, tmp_path, 6)
    ref_params, ref_losses, _ = _train(cfg, jax.devices()[:1], params0, batches)
    assert np.all(np.isfinite(ref_losses)) and ref_losses[-1] < ref_losses[0] - 0.3, ref_losses

    fsdp = _cfg("train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2", "mesh.data=2", "mesh.fsdp=4")
    params, losses, loop = _train(fsdp, jax.devices(), params0, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=2e-4, atol=2e-6), params, ref_params)
    specs = {k: tuple(s.spec) for k, s in _flat(loop.params_sharding).items()}
    assert "fsdp" in specs["blocks/0/attn/k/kernel"] and "fsdp" in specs["blocks/0/mlp/gate/kernel"], specs

    per_dev = _cfg("train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2", "mesh.data=8")
    _, losses, _ = _train(per_dev, jax.devices(), params0, batches, per_device=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)


def test_codec_and_checkpoint_round_trip(tmp_path: Path) -> None:
    params = jax.tree.map(np.asarray, model.build(_cfg("model.tie_embeddings=true").model).init(1))
    spec, vec = flatten(params)
    assert [p for p, _, _ in spec][:2] == ["blocks/0/attn/k/kernel", "blocks/0/attn/o/kernel"]
    back = unflatten(spec, vec)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(3, params, {"note": "llama"})
    ckpt.wait()
    step, restored, meta = ckpt.restore(model.build(_cfg("model.tie_embeddings=true").model).abstract_params)
    ckpt.close()
    assert step == 3 and meta["note"] == "llama"
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), params)


def test_the_llama_fields_are_in_the_fingerprint_and_only_the_llamas() -> None:
    base = _cfg()
    fields = base.fingerprint_fields()
    assert {"model.n_kv_heads", "model.mlp_hidden", "model.rope_theta", "model.norm_eps",
            "model.tie_embeddings"} <= set(fields)
    for change in ("model.n_kv_heads=4", "model.mlp_hidden=64", "model.rope_theta=500000.0", "model.norm_eps=1e-6",
                   "model.tie_embeddings=true"):
        assert _cfg(change).fingerprint() != base.fingerprint(), change
    assert _cfg("model.attention=einsum", "model.remat=true").fingerprint() == base.fingerprint()
    gpt = load_config(CONFIG_DIR / "tiny.toml")  # another kind: the fields are held at their defaults, left out
    assert not any(k in gpt.fingerprint_fields() for k in ("model.n_kv_heads", "model.rope_theta"))
