"""Flax NNX models: a decoder-only byte GPT and a tiny MLP language model.

Both map ``tokens_BxL`` (int32) to ``logits_BxLxV`` (float32). Parameters are
kept in float32; ``dtype`` sets the compute dtype (bfloat16 on accelerators).
Two knobs change how the GPT computes, not what: ``attention`` picks the
attention kernel (:func:`causal_attention`) and ``remat`` recomputes each
block's activations in the backward pass instead of keeping them.

The rest of dtrain never touches NNX objects in the hot path: :func:`build`
returns a pure ``apply(params, tokens) -> logits`` over a plain nested dict of
arrays, which is what the optimizers, the codecs and the checkpoints see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from dtrain.config import ModelConfig

Params = dict[str, Any]  # nested dict of float32 arrays
ApplyFn = Callable[[Params, jax.Array], jax.Array]

_INIT_STD = 0.02


def _dense(d_in: int, d_out: int, dtype: Any, rngs: nnx.Rngs, std: float = _INIT_STD) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


def causal_attention(q_BxLxNxH: jax.Array, k_BxLxNxH: jax.Array, v_BxLxNxH: jax.Array,
                     implementation: str) -> jax.Array:
    """Causal softmax attention, by ``model.attention``: ``xla`` and ``cudnn`` are
    ``jax.nn.dot_product_attention`` with that implementation (``cudnn``: the fused flash-attention kernel, NVIDIA
    GPUs and bfloat16 only); ``einsum`` is the textbook formulation written out (scores and softmax in float32),
    a reference the others are tested against."""
    if implementation in ("xla", "cudnn"):
        kernel: Literal["xla", "cudnn"] = "cudnn" if implementation == "cudnn" else "xla"
        return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, is_causal=True, implementation=kernel)
    if implementation != "einsum":
        raise ValueError(f"model.attention: unknown implementation {implementation!r}")
    L, H = q_BxLxNxH.shape[1], q_BxLxNxH.shape[3]
    scores_BxNxLxL = jnp.einsum("blnh,bmnh->bnlm", q_BxLxNxH, k_BxLxNxH,
                                preferred_element_type=jnp.float32) * H ** -0.5
    causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
    scores_BxNxLxL = jnp.where(causal_LxL, scores_BxNxLxL, jnp.finfo(jnp.float32).min)
    probs_BxNxLxL = jax.nn.softmax(scores_BxNxLxL, axis=-1).astype(v_BxLxNxH.dtype)
    return jnp.einsum("bnlm,bmnh->blnh", probs_BxNxLxL, v_BxLxNxH)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.attention = cfg.attention
        self.qkv = _dense(cfg.d_model, 3 * cfg.d_model, dtype, rngs)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers) at init.
        self.proj = _dense(cfg.d_model, cfg.d_model, dtype, rngs, _INIT_STD / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        qkv_BxLx3xNxH = self.qkv(x_BxLxD).reshape(B, L, 3, self.n_heads, D // self.n_heads)
        q, k, v = (qkv_BxLx3xNxH[:, :, i] for i in range(3))
        out_BxLxNxH = causal_attention(q, k, v, self.attention)
        return self.proj(out_BxLxNxH.reshape(B, L, D))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.d_model
        self.up = _dense(cfg.d_model, hidden, dtype, rngs)
        self.down = _dense(hidden, cfg.d_model, dtype, rngs, _INIT_STD / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, dtype, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    """Decoder-only transformer with learned positions and an untied head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.dtype = dtype
        self.tok_embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                                   embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
        self.pos_embed = nnx.Param(nnx.initializers.normal(_INIT_STD)(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.head = _dense(cfg.d_model, cfg.vocab_size, dtype, rngs)
        self.remat = cfg.remat

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        L = tokens_BxL.shape[1]
        x_BxLxD = self.tok_embed(tokens_BxL) + self.pos_embed[...][:L].astype(self.dtype)
        # remat: each block keeps only its input for the backward pass and recomputes the rest (less memory, one
        # more forward pass of the blocks' FLOPs)
        run_block = nnx.remat(Block.__call__) if self.remat else Block.__call__
        for block in self.blocks:
            x_BxLxD = run_block(block, x_BxLxD)
        return self.head(self.ln_f(x_BxLxD)).astype(jnp.float32)


class ByteMLP(nnx.Module):
    """Per-position MLP over the current token's embedding (a bigram model): the fastest test model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
        self.hidden = nnx.List([_dense(cfg.d_model, cfg.d_model, dtype, rngs, cfg.d_model ** -0.5)
                                for _ in range(cfg.n_layers)])
        self.head = _dense(cfg.d_model, cfg.vocab_size, dtype, rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxL)
        for layer in self.hidden:
            x = x + jax.nn.gelu(layer(x))
        return self.head(x).astype(jnp.float32)


def _module(cfg: ModelConfig, seed: int) -> nnx.Module:
    rngs = nnx.Rngs(seed)
    return GPT(cfg, rngs) if cfg.kind == "gpt" else ByteMLP(cfg, rngs)


@dataclass(frozen=True)
class BuiltModel:
    """A model as pure functions: ``init(seed) -> params`` and ``apply(params, tokens) -> logits``."""

    cfg: ModelConfig
    apply: ApplyFn
    init: Callable[[int], Params]
    abstract_params: Params  # ShapeDtypeStructs, no memory


def build(cfg: ModelConfig) -> BuiltModel:
    abstract_module = nnx.eval_shape(lambda: _module(cfg, 0))
    graphdef, abstract_state = nnx.split(abstract_module)

    def init(seed: int) -> Params:
        return nnx.split(_module(cfg, seed))[1].to_pure_dict()

    def apply(params: Params, tokens_BxL: jax.Array) -> jax.Array:
        state = jax.tree.map(lambda x: x, abstract_state)  # a fresh container each trace
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(tokens_BxL)

    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_state.to_pure_dict())
    return BuiltModel(cfg=cfg, apply=apply, init=init, abstract_params=abstract_params)


def param_count(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def embedding_param_count(cfg: ModelConfig) -> int:
    """Parameters in embedding tables (lookups, not matrix multiplies): the token table, and the GPT's positions."""
    return cfg.vocab_size * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.kind == "gpt" else 0)


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs of one training token (forward + backward), the numerator of MFU.

    ``6 * N`` for the matrix multiplies, where N is every parameter of the model (counted from the model as
    :func:`build` builds it) except the embedding tables (:func:`embedding_param_count`: lookups); the output
    head counts (it is a matmul), and so do the few LayerNorm scales and biases (a rounding error). For the GPT,
    plus attention's score and value products: ``12 * n_layers * d_model * seq_len`` (PaLM, appendix B; the full
    LxL products, as PaLM counts them, though a causal mask makes half of them moot). Model FLOPs, not hardware
    FLOPs: ``remat``'s recomputation and the optimizer's elementwise update are not counted.
    """
    n_params = param_count(build(cfg).abstract_params)
    flops = 6.0 * (n_params - embedding_param_count(cfg))
    if cfg.kind == "gpt":
        flops += 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
    return flops
