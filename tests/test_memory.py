"""The model's memory knobs: the loss over chunks of positions (model.loss_chunk) and the remat policies
(model.remat: none, full, dots, names) give the loss and gradients of the plain step (float32 tightly, bfloat16
loosely), are really in the program they claim to change, and the default attention resolves by platform."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtrain.config.load import load_config
from dtrain.models import model
from dtrain.steps.inner import loss_fn

# knobs on top of each base config; the chunk sizes divide the sequence (8) and do not (5, 48 > L)
_CHUNKED = (["model.loss_chunk=8"], ["model.loss_chunk=5"], ["model.loss_chunk=48"])
_REMAT = (["model.remat=full"], ["model.remat=dots"], ["model.remat=names"],
          ["model.remat=dots", "model.loss_chunk=5"])


def _loss_and_grads(base: list[str], knobs: list[str], tokens_BxL1: jax.Array) -> tuple[float, dict]:
    params = model.build(load_config("tiny", base).model).init(0)  # the knobs do not change the parameters
    built = model.build(load_config("tiny", base + knobs).model)
    loss, grads = jax.jit(jax.value_and_grad(partial(loss_fn, built.apply)))(params, tokens_BxL1)
    return float(loss), grads


@pytest.mark.parametrize("kind", ["gpt", pytest.param("llama", marks=pytest.mark.slow), "mlp"])
def test_chunked_loss_and_each_remat_policy_give_the_plain_loss_and_gradients_in_float32(kind: str) -> None:
    base = [f"model.kind={kind}"] + (["model.n_kv_heads=2", "model.tie_embeddings=true"] if kind == "llama" else [])
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
    ref_loss, ref_grads = _loss_and_grads(base, [], tokens)
    assert np.isfinite(ref_loss) and ref_loss > 0
    for knobs in _CHUNKED + (_REMAT if kind != "mlp" else ()):
        loss, grads = _loss_and_grads(base, knobs, tokens)
        assert loss == pytest.approx(ref_loss, rel=1e-6), knobs
        jax.tree.map(partial(np.testing.assert_allclose, rtol=2e-5, atol=1e-7, err_msg=str(knobs)), grads, ref_grads)


@pytest.mark.parametrize("kind", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_documents_kept_apart_give_the_same_loss_and_gradients_chunked_and_under_remat(kind: str) -> None:
    """A batch with positions (data.document_masking: two documents a row) through the chunked loss and a remat
    policy gives the plain masked step's loss and gradients, and differs from the unmasked step's."""
    base = [f"model.kind={kind}"] + (["model.n_kv_heads=2"] if kind == "llama" else [])
    tokens_BxL1 = jax.random.randint(jax.random.key(2), (4, 33), 0, 256)
    positions_BxL1 = jnp.concatenate([jnp.arange(13), jnp.arange(20)])[None].repeat(4, axis=0)
    batch = jnp.stack([tokens_BxL1, positions_BxL1], axis=1)  # [B, 2, L + 1]
    ref_loss, ref_grads = _loss_and_grads(base, [], batch)
    plain_loss, _ = _loss_and_grads(base, [], tokens_BxL1)
    assert abs(ref_loss - plain_loss) > 1e-4  # the mask and the restarted positions change the loss
    for knobs in (["model.loss_chunk=5"], ["model.remat=dots", "model.loss_chunk=8"], ["model.remat=names"]):
        loss, grads = _loss_and_grads(base, knobs, batch)
        assert loss == pytest.approx(ref_loss, rel=1e-6), knobs
        jax.tree.map(partial(np.testing.assert_allclose, rtol=2e-5, atol=1e-7, err_msg=str(knobs)), grads, ref_grads)


@pytest.mark.slow
def test_chunked_loss_and_remat_in_bfloat16_stay_close_to_the_plain_ones() -> None:
    base = ["model.kind=llama", "model.dtype=bfloat16"]
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
    ref_loss, ref_grads = _loss_and_grads(base, [], tokens)
    for knobs in (*_CHUNKED, *_REMAT):
        loss, grads = _loss_and_grads(base, knobs, tokens)
        assert loss == pytest.approx(ref_loss, rel=1e-2), knobs
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            scale = float(jnp.max(jnp.abs(r))) or 1.0
            assert float(jnp.max(jnp.abs(g - r))) <= 0.05 * scale, knobs


def _jaxpr(overrides: list[str], grad: bool = False) -> str:
    built = model.build(load_config("tiny", overrides).model)
    tokens = jax.ShapeDtypeStruct((2, 33), jnp.int32)
    loss = partial(loss_fn, built.apply)
    return str(jax.make_jaxpr(jax.grad(loss) if grad else loss)(built.abstract_params, tokens))


def test_each_knob_is_in_the_program_it_claims_to_change() -> None:
    plain = _jaxpr([], grad=True)
    assert "remat" not in plain and "checkpoint" not in plain and " scan" not in plain
    policies = {}
    for policy in ("full", "dots", "names"):
        jaxpr = _jaxpr([f"model.remat={policy}"])
        found = set(re.findall(r"policy=(\w+)", jaxpr))
        assert len(found) == 1, (policy, found)  # every block under the one policy
        policies[policy] = found.pop()
    assert policies["full"] == "None" and len(set(policies.values())) == 3  # three different policies
    assert "attn_out" in _jaxpr(["model.remat=names"]).split("policy=")[1][:200]  # the names it saves
    chunked = _jaxpr(["model.loss_chunk=8"], grad=True)
    assert "scan" in chunked and ("remat" in chunked or "checkpoint" in chunked)
    # the whole [B, L, V] float32 logits appear only without chunks: with chunks, [B, C, V] at most
    assert "f32[2,32,256]" in plain and "f32[2,32,256]" not in chunked and "f32[2,8,256]" in chunked


def test_auto_attention_is_xla_on_a_cpu_and_cudnn_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    assert model.attention_kernel("auto", jnp.bfloat16, 64) == "xla"  # this process's backend: a CPU
    assert model.attention_kernel("einsum", jnp.bfloat16, 64) == "einsum"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert model.attention_kernel("auto", jnp.bfloat16, 64) == "cudnn"
    assert model.attention_kernel("auto", jnp.float32, 64) == "xla"  # cuDNN's kernel: bfloat16 only
    assert model.attention_kernel("auto", jnp.bfloat16, 12) == "xla"  # and a head size a multiple of 8
