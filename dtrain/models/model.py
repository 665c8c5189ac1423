"""Flax NNX models (``model.kind``): a decoder-only byte GPT, a Llama and a tiny MLP language model.

All map ``tokens_BxL`` (int32) to ``logits_BxLxV`` (float32). Parameters are
kept in float32; ``dtype`` sets the compute dtype (bfloat16 on accelerators).
Three knobs change how the models compute, not what: ``attention`` picks the
attention kernel (:func:`causal_attention`), ``remat`` what each block keeps
for the backward pass (:func:`remat_block`: nothing recomputed, everything, or
all but the matmuls or the attention's named activations), and ``loss_chunk``
lets the loss take the logits a chunk of positions at a time
(:class:`Apply`: the model's features and its head apart). The
Llama (:class:`Llama`) computes what Hugging Face's ``LlamaForCausalLM`` does,
its parameter tree mapping onto that one's by transposes only.

The rest of dtrain never touches NNX objects in the hot path: :func:`build`
returns a pure ``apply(params, tokens) -> logits`` over a plain nested dict of
arrays, which is what the optimizers, the codecs and the checkpoints see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dtrain.config.sections import ModelConfig
from dtrain.models.rope import RopeScaling, frequencies

Params = dict[str, Any]  # nested dict of float32 arrays


class ApplyFn(Protocol):
    """``apply(params, tokens_BxL) -> logits_BxLxV``; with ``positions_BxL`` (``data.document_masking``) each token's
    position in its document: positions restart at 0 and attention stops at each document's first token."""

    def __call__(self, params: Params, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None) -> jax.Array:
        ...


class KVCache(NamedTuple):
    """Keys and values of every attention layer for ``T`` slots of each row (``k[i]``, ``v[i]``: layer i's
    ``[B, T, K, H]``), filled for slots ``[0, filled)``: what :attr:`BuiltModel.decode` reads and extends."""

    k: list[jax.Array]
    v: list[jax.Array]
    filled: jax.Array  # int32 scalar: the slots filled, where the next tokens go

_INIT_STD = 0.02


def _dense(d_in: int, d_out: int, dtype: Any, rngs: nnx.Rngs, std: float = _INIT_STD,
           bias: bool = False) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


# What model.remat = "names" keeps: the attention's projected q, k, v and its output (before the o projection)
REMAT_NAMES = ("attn_qkv", "attn_out")


def remat_block(call: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """A block's ``__call__`` under ``model.remat``: ``none`` as it is; ``full``, ``dots`` and ``names`` wrapped in
    ``nnx.remat`` (``jax.checkpoint``), keeping nothing but the block's input, the matmul outputs without batch
    dimensions (``dots_with_no_batch_dims_saveable``), or :data:`REMAT_NAMES` (``save_only_these_names``)."""
    if policy == "none":
        return call
    policies = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                "names": jax.checkpoint_policies.save_only_these_names(*REMAT_NAMES)}
    if policy not in policies:
        raise ValueError(f"model.remat: unknown policy {policy!r}")
    return nnx.remat(call, policy=policies[policy])


def attention_kernel(implementation: str, dtype: Any, head_dim: int) -> str:
    """``model.attention`` resolved: ``auto`` is ``cudnn`` where the fused kernel applies (this process's JAX
    backend is an NVIDIA GPU, bfloat16, a head size that is a multiple of 8), else ``xla``; the others as they
    are."""
    if implementation != "auto":
        return implementation
    fused = jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 and head_dim % 8 == 0
    return "cudnn" if fused else "xla"


def causal_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                     implementation: str, mask_Bx1xLxT: jax.Array | None = None, window: int = 0) -> jax.Array:
    """Causal softmax attention, by ``model.attention`` (``auto``: :func:`attention_kernel`): ``xla`` and ``cudnn`` are
    ``jax.nn.dot_product_attention`` with that implementation (``cudnn``: the fused flash-attention kernel, NVIDIA
    GPUs and bfloat16 only); ``einsum`` is the textbook formulation written out (scores and softmax in float32),
    a reference the others are tested against. Scores are scaled by ``H ** -0.5``.

    Grouped-query attention when the keys and values have ``K`` heads, fewer than the queries' ``N`` (K divides N):
    query head ``n`` attends with key/value head ``n // (N // K)`` (Hugging Face's ``repeat_kv``; what
    ``jax.nn.dot_product_attention`` does with fewer K/V heads). A ``window`` > 0 (Mistral's sliding window) lets
    each position attend to the last ``window`` positions only, itself included (transformers' ``kv > q - window``).

    ``mask_Bx1xLxT`` (:func:`attention_mask`; documents kept apart, or a KV cache's ``T`` slots) replaces the causal
    mask: query ``l`` sees key ``t`` where it is true (and, with a window, within it)."""
    implementation = attention_kernel(implementation, q_BxLxNxH.dtype, q_BxLxNxH.shape[-1])
    if window and mask_Bx1xLxT is not None:  # each query's own slot is the last key its mask lets it see
        T = mask_Bx1xLxT.shape[-1]
        q_slot_Bx1xL = T - 1 - jnp.argmax(mask_Bx1xLxT[..., ::-1], axis=-1)
        mask_Bx1xLxT = mask_Bx1xLxT & (jnp.arange(T) > q_slot_Bx1xL[..., None] - window)
    if implementation in ("xla", "cudnn"):
        kernel: Literal["xla", "cudnn"] = "cudnn" if implementation == "cudnn" else "xla"
        if mask_Bx1xLxT is not None:
            return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask=mask_Bx1xLxT,
                                                implementation=kernel)
        return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True, implementation=kernel,
                                            local_window_size=(window - 1, 0) if window else None)
    if implementation != "einsum":
        raise ValueError(f"model.attention: unknown implementation {implementation!r}")
    L, N, H = q_BxLxNxH.shape[1], q_BxLxNxH.shape[2], q_BxLxNxH.shape[3]
    group = N // k_BxLxKxH.shape[2]  # each key/value head serves `group` consecutive query heads
    k_BxLxNxH = jnp.repeat(k_BxLxKxH, group, axis=2)
    v_BxLxNxH = jnp.repeat(v_BxLxKxH, group, axis=2)
    scores_BxNxLxL = jnp.einsum("blnh,bmnh->bnlm", q_BxLxNxH, k_BxLxNxH,
                                preferred_element_type=jnp.float32) * H ** -0.5
    if mask_Bx1xLxT is not None:
        causal_LxL = mask_Bx1xLxT
    else:
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        if window:
            causal_LxL &= ~jnp.tril(causal_LxL, -window)  # keys more than window - 1 positions back are out
    scores_BxNxLxL = jnp.where(causal_LxL, scores_BxNxLxL, jnp.finfo(jnp.float32).min)
    probs_BxNxLxL = jax.nn.softmax(scores_BxNxLxL, axis=-1).astype(v_BxLxNxH.dtype)
    return jnp.einsum("bnlm,bmnh->blnh", probs_BxNxLxL, v_BxLxNxH)


def attention_mask(positions_BxL: jax.Array, first_slot: jax.Array | int, slots: int) -> jax.Array:
    """Which keys each query sees, ``[B, 1, L, T]``: query ``l`` sits at slot ``first_slot + l`` and is token
    ``positions[b, l]`` of its document, so it sees the slots from its document's first to itself (causal, and
    nothing of an earlier document). One document from slot 0 (a KV cache's prompt) is ``positions = slot``."""
    q_slot_L = first_slot + jnp.arange(positions_BxL.shape[1])
    k_slot_T = jnp.arange(slots)
    first_BxL = q_slot_L[None, :] - positions_BxL
    mask_BxLxT = (k_slot_T[None, None, :] <= q_slot_L[None, :, None]) & \
        (k_slot_T[None, None, :] >= first_BxL[:, :, None])
    return mask_BxLxT[:, None]


def _cached(k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, layer: tuple[jax.Array, jax.Array, jax.Array] | None
            ) -> tuple[jax.Array, jax.Array]:
    """The keys and values attention reads: these, or with a layer's cache ``(k, v, index)`` the cache's with these
    written at slot ``index``."""
    if layer is None:
        return k_BxLxKxH, v_BxLxKxH
    k_cache, v_cache, index = layer
    at = (0, index, 0, 0)
    return (jax.lax.dynamic_update_slice(k_cache, k_BxLxKxH.astype(k_cache.dtype), at),
            jax.lax.dynamic_update_slice(v_cache, v_BxLxKxH.astype(v_cache.dtype), at))


_Layer = tuple[jax.Array, jax.Array, jax.Array] | None  # one layer's (k cache, v cache, index), or no cache


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.attention = cfg.attention
        self.qkv = _dense(cfg.d_model, 3 * cfg.d_model, dtype, rngs)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers) at init.
        self.proj = _dense(cfg.d_model, cfg.d_model, dtype, rngs, _INIT_STD / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x_BxLxD: jax.Array, mask: jax.Array | None = None, layer: _Layer = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        B, L, D = x_BxLxD.shape
        qkv_BxLx3xNxH = self.qkv(x_BxLxD).reshape(B, L, 3, self.n_heads, D // self.n_heads)
        qkv_BxLx3xNxH = checkpoint_name(qkv_BxLx3xNxH, "attn_qkv")
        q, k, v = (qkv_BxLx3xNxH[:, :, i] for i in range(3))
        k, v = _cached(k, v, layer)
        out_BxLxNxH = checkpoint_name(causal_attention(q, k, v, self.attention, mask), "attn_out")
        return self.proj(out_BxLxNxH.reshape(B, L, D)), (k, v)


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

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, layer: _Layer = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        y, kv = self.attn(self.ln1(x), mask, layer)
        x = x + y
        return x + self.mlp(self.ln2(x)), kv


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

    def features(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """The final LayerNorm's output ``[B, L, D]`` (what the head takes), and each layer's keys and values."""
        L = tokens_BxL.shape[1]
        mask, positions_BxL = _positions(tokens_BxL, positions_BxL, cache)
        pos_D = self.pos_embed[...][:L] if positions_BxL is None else self.pos_embed[...][positions_BxL]
        x_BxLxD = self.tok_embed(tokens_BxL) + pos_D.astype(self.dtype)
        # remat: each block keeps only what its policy saves for the backward pass and recomputes the rest (less
        # memory, up to one more forward pass of the blocks' FLOPs)
        run_block = remat_block(Block.__call__, self.remat)
        kvs = []
        for i, block in enumerate(self.blocks):
            x_BxLxD, kv = run_block(block, x_BxLxD, mask, _layer(cache, i))
            kvs.append(kv)
        return self.ln_f(x_BxLxD), kvs

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """The head: float32 logits ``[B, L, V]`` of :meth:`features`' output (or of a chunk of its positions)."""
        return self.head(x_BxLxD).astype(jnp.float32)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> Any:
        x_BxLxD, kvs = self.features(tokens_BxL, positions_BxL, cache)
        return _out(self.logits(x_BxLxD), cache, kvs, tokens_BxL.shape[1])


# ------------------------------------------------------------------------------------------------------- Llama


def llama_mlp_hidden(cfg: ModelConfig) -> int:
    """The Llama's SwiGLU hidden width F (:attr:`ModelConfig.swiglu_hidden`)."""
    return cfg.swiglu_hidden


def llama_kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads of the Llama's grouped-query attention (:attr:`ModelConfig.kv_heads`)."""
    return cfg.kv_heads


@dataclass(frozen=True)
class LlamaSwitches:
    """What the llama's Hugging Face families (``model.family``) change in the one implementation: Qwen 2.5's q,
    k, v biases, Qwen 3's q and k RMSNorm (over each head, before the rotation), Llama's optional biases on all
    four projections and on the MLP, Mistral's sliding window; the head size and the rope of every family."""

    head_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    window: int  # 0: none
    rope: RopeScaling

    @classmethod
    def of(cls, cfg: ModelConfig) -> LlamaSwitches:
        return cls(head_dim=cfg.head_size, qkv_bias=cfg.attention_bias or cfg.family == "qwen2",
                   o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, qk_norm=cfg.family == "qwen3",
                   window=cfg.sliding_window, rope=RopeScaling.of(cfg))


def rope_cos_sin(seq_len: int, head_dim: int, theta: float | RopeScaling) -> tuple[jax.Array, jax.Array]:
    """Rotary position embedding tables ``[L, H]`` (float32) in Hugging Face's convention: ``inv_freq = 1 /
    theta ** (arange(0, H, 2) / H)`` (or a rope scaling's, :func:`dtrain.models.rope.frequencies`), angles
    ``position * inv_freq``, concatenated twice (the two halves of the head dimension rotate together, not
    interleaved pairs), cos and sin times the scaling's factor (yarn's; 1 otherwise)."""
    rope = theta if isinstance(theta, RopeScaling) else RopeScaling(theta=theta)
    inv_freq, scale = frequencies(head_dim, rope, seq_len)
    angles_LxH2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles_LxH = jnp.concatenate([angles_LxH2, angles_LxH2], axis=-1)
    if scale == 1.0:
        return jnp.cos(angles_LxH), jnp.sin(angles_LxH)
    return jnp.cos(angles_LxH) * scale, jnp.sin(angles_LxH) * scale


def apply_rope(x_BxLxNxH: jax.Array, cos_LxH: jax.Array, sin_LxH: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x2, x1)`` (x1, x2: the halves of the head
    dimension), computed in float32 and returned in ``x``'s dtype. The tables are ``[L, H]``, or ``[B, L, H]`` for
    positions of each row's own."""
    x = x_BxLxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos_BxLxH, sin_BxLxH = (cos_LxH[None], sin_LxH[None]) if cos_LxH.ndim == 2 else (cos_LxH, sin_LxH)
    out = x * cos_BxLxH[:, :, None, :] + rotated * sin_BxLxH[:, :, None, :]
    return out.astype(x_BxLxNxH.dtype)


class RMSNorm(nnx.Module):
    """Hugging Face's ``LlamaRMSNorm``: ``x * rsqrt(mean(x^2) + eps)`` in float32, cast back to the compute dtype,
    times ``scale`` (initialized to ones)."""

    def __init__(self, dim: int, eps: float, dtype: Any):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class LlamaAttention(nnx.Module):
    """Grouped-query attention with rotary positions; biases, q/k norms and a window by :class:`LlamaSwitches`."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        sw = LlamaSwitches.of(cfg)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, sw.head_dim
        self.attention, self.window = cfg.attention, sw.window
        self.q = _dense(cfg.d_model, self.n_heads * self.head_dim, dtype, rngs, bias=sw.qkv_bias)
        self.k = _dense(cfg.d_model, self.n_kv_heads * self.head_dim, dtype, rngs, bias=sw.qkv_bias)
        self.v = _dense(cfg.d_model, self.n_kv_heads * self.head_dim, dtype, rngs, bias=sw.qkv_bias)
        # residual projections scaled by 1/sqrt(2 * n_layers) at init, as the GPT's
        self.o = _dense(self.n_heads * self.head_dim, cfg.d_model, dtype, rngs, _INIT_STD / (2 * cfg.n_layers) ** 0.5,
                        bias=sw.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype) if sw.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype) if sw.qk_norm else None

    def __call__(self, x_BxLxD: jax.Array, cos_LxH: jax.Array, sin_LxH: jax.Array, mask: jax.Array | None = None,
                 layer: _Layer = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        B, L, _ = x_BxLxD.shape
        q_BxLxNxH = self.q(x_BxLxD).reshape(B, L, self.n_heads, self.head_dim)
        k_BxLxKxH = self.k(x_BxLxD).reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen 3: each head normalized, then rotated
            q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
        q_BxLxNxH = apply_rope(q_BxLxNxH, cos_LxH, sin_LxH)
        k_BxLxKxH = apply_rope(k_BxLxKxH, cos_LxH, sin_LxH)
        v_BxLxKxH = self.v(x_BxLxD).reshape(B, L, self.n_kv_heads, self.head_dim)
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = checkpoint_name((q_BxLxNxH, k_BxLxKxH, v_BxLxKxH), "attn_qkv")
        k_BxTxKxH, v_BxTxKxH = _cached(k_BxLxKxH, v_BxLxKxH, layer)
        out_BxLxNxH = checkpoint_name(causal_attention(q_BxLxNxH, k_BxTxKxH, v_BxTxKxH, self.attention, mask,
                                                       self.window), "attn_out")
        return self.o(out_BxLxNxH.reshape(B, L, self.n_heads * self.head_dim)), (k_BxTxKxH, v_BxTxKxH)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        hidden, bias = cfg.swiglu_hidden, cfg.mlp_bias
        self.gate = _dense(cfg.d_model, hidden, dtype, rngs, bias=bias)
        self.up = _dense(cfg.d_model, hidden, dtype, rngs, bias=bias)
        self.down = _dense(hidden, cfg.d_model, dtype, rngs, _INIT_STD / (2 * cfg.n_layers) ** 0.5, bias=bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    """Pre-norm Llama block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.attn = LlamaAttention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.mlp = SwiGLU(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, cos_LxH: jax.Array, sin_LxH: jax.Array, mask: jax.Array | None = None,
                 layer: _Layer = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        y, kv = self.attn(self.attn_norm(x), cos_LxH, sin_LxH, mask, layer)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), kv


class Llama(nnx.Module):
    """Hugging Face's ``LlamaForCausalLM`` (and, by :class:`LlamaSwitches`, its Qwen 2.5, Qwen 3 and Mistral
    relatives): no position embeddings (rotary ones in attention, scaled by ``model.rope_scaling``), RMSNorm,
    SwiGLU, grouped-query attention; the head is ``head`` or, with ``model.tie_embeddings``, the token table."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.dtype = dtype
        self.head_dim, self.rope = cfg.head_size, RopeScaling.of(cfg)
        self.tok_embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                                   embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
        self.blocks = nnx.List([LlamaBlock(cfg, dtype, rngs) for _ in range(cfg.n_layers)])
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
        self.head = None if cfg.tie_embeddings else _dense(cfg.d_model, cfg.vocab_size, dtype, rngs)
        self.remat = cfg.remat

    def features(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """The final RMSNorm's output ``[B, L, D]`` (what the head takes), and each layer's keys and values."""
        L = tokens_BxL.shape[1]
        mask, positions_BxL = _positions(tokens_BxL, positions_BxL, cache)
        cos_LxH, sin_LxH = rope_cos_sin(L if cache is None else cache.k[0].shape[1], self.head_dim, self.rope)
        if positions_BxL is not None:  # each row's own positions: rows of the tables
            cos_LxH, sin_LxH = cos_LxH[positions_BxL], sin_LxH[positions_BxL]
        x_BxLxD = self.tok_embed(tokens_BxL)
        run_block = remat_block(LlamaBlock.__call__, self.remat)
        kvs = []
        for i, block in enumerate(self.blocks):
            x_BxLxD, kv = run_block(block, x_BxLxD, cos_LxH, sin_LxH, mask, _layer(cache, i))
            kvs.append(kv)
        return self.norm_f(x_BxLxD), kvs

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """The head: float32 logits ``[B, L, V]`` of :meth:`features`' output (or of a chunk of its positions)."""
        if self.head is None:  # tied: logits = x @ embedding.T
            return self.tok_embed.attend(x_BxLxD).astype(jnp.float32)
        return self.head(x_BxLxD).astype(jnp.float32)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> Any:
        x_BxLxD, kvs = self.features(tokens_BxL, positions_BxL, cache)
        return _out(self.logits(x_BxLxD), cache, kvs, tokens_BxL.shape[1])


class ByteMLP(nnx.Module):
    """Per-position MLP over the current token's embedding (a bigram model): the fastest test model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
        self.hidden = nnx.List([_dense(cfg.d_model, cfg.d_model, dtype, rngs, cfg.d_model ** -0.5)
                                for _ in range(cfg.n_layers)])
        self.head = _dense(cfg.d_model, cfg.vocab_size, dtype, rngs)

    def features(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """The last hidden layer's output ``[B, L, D]``, what the head takes (per position: positions, documents and
        a cache change nothing)."""
        x = self.embed(tokens_BxL)
        for layer in self.hidden:
            x = x + jax.nn.gelu(layer(x))
        return x, []

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """The head: float32 logits of :meth:`features`' output (or of a chunk of its positions)."""
        return self.head(x_BxLxD).astype(jnp.float32)

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None, cache: KVCache | None = None
                 ) -> Any:
        x, kvs = self.features(tokens_BxL, positions_BxL, cache)
        return _out(self.logits(x), cache, kvs, tokens_BxL.shape[1])


def _positions(tokens_BxL: jax.Array, positions_BxL: jax.Array | None, cache: KVCache | None
               ) -> tuple[jax.Array | None, jax.Array | None]:
    """(the attention mask, the positions) of a forward pass: (None, None) on the plain causal path; with a cache,
    the slots from its index (one document); with positions, documents kept apart (:func:`attention_mask`)."""
    if cache is None and positions_BxL is None:
        return None, None
    first = 0 if cache is None else cache.filled
    if positions_BxL is None:
        positions_BxL = jnp.broadcast_to(first + jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
    return attention_mask(positions_BxL, first, tokens_BxL.shape[1] if cache is None else cache.k[0].shape[1]), \
        positions_BxL


def _layer(cache: KVCache | None, i: int) -> _Layer:
    return None if cache is None else (cache.k[i], cache.v[i], cache.filled)


def _out(logits_BxLxV: jax.Array, cache: KVCache | None, kvs: list[tuple[jax.Array, jax.Array]], L: int) -> Any:
    """The logits, or with a cache (logits, the cache extended by these ``L`` slots)."""
    if cache is None:
        return logits_BxLxV
    return logits_BxLxV, KVCache([k for k, _ in kvs], [v for _, v in kvs], cache.filled + L)


def _module(cfg: ModelConfig, seed: int) -> nnx.Module:
    rngs = nnx.Rngs(seed)
    if cfg.kind == "gpt":
        return GPT(cfg, rngs)
    return Llama(cfg, rngs) if cfg.kind == "llama" else ByteMLP(cfg, rngs)


@dataclass(frozen=True)
class Apply:
    """``apply(params, tokens[, positions]) -> logits``, and its two halves: ``features(params, tokens[,
    positions]) -> x_BxLxD`` (all but the head) and ``head(params, x) -> logits`` (of any positions' features: a
    chunk of them), with the config's ``loss_chunk`` (0: off), by which :func:`dtrain.steps.inner.loss_fn` takes the
    logits a chunk at a time."""

    features: Callable[..., jax.Array]  # (params, tokens_BxL, positions_BxL=None) -> x_BxLxD
    head: Callable[[Params, jax.Array], jax.Array]
    loss_chunk: int = 0

    def __call__(self, params: Params, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None) -> jax.Array:
        return self.head(params, self.features(params, tokens_BxL, positions_BxL))


@dataclass(frozen=True)
class BuiltModel:
    """A model as pure functions: ``init(seed) -> params``, ``apply(params, tokens) -> logits`` and, for generating
    with a KV cache, ``decode(params, tokens, cache) -> (logits, cache)`` over a :meth:`new_cache`."""

    cfg: ModelConfig
    apply: Apply
    init: Callable[[int], Params]
    abstract_params: Params  # ShapeDtypeStructs, no memory
    decode: Callable[[Params, jax.Array, KVCache], tuple[jax.Array, KVCache]]

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """An empty cache of ``slots`` positions per row (the prompt and every token to generate)."""
        cfg = self.cfg
        layers = cfg.n_layers if cfg.kind in ("gpt", "llama") else 0
        kv_heads = llama_kv_heads(cfg) if cfg.kind == "llama" else cfg.n_heads
        shape = (batch, slots, kv_heads, cfg.d_model // cfg.n_heads)
        return KVCache([jnp.zeros(shape, cfg.dtype) for _ in range(layers)],
                       [jnp.zeros(shape, cfg.dtype) for _ in range(layers)], jnp.zeros((), jnp.int32))


def build(cfg: ModelConfig) -> BuiltModel:
    abstract_module = nnx.eval_shape(lambda: _module(cfg, 0))
    graphdef, abstract_state = nnx.split(abstract_module)

    def init(seed: int) -> Params:
        return nnx.to_pure_dict(nnx.split(_module(cfg, seed))[1])

    def module(params: Params) -> Any:
        state = jax.tree.map(lambda x: x, abstract_state)  # a fresh container each trace
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def features(params: Params, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None) -> jax.Array:
        if positions_BxL is None:  # the plain causal path
            return module(params).features(tokens_BxL)[0]
        return module(params).features(tokens_BxL, positions_BxL)[0]

    def head(params: Params, x_BxLxD: jax.Array) -> jax.Array:
        return module(params).logits(x_BxLxD)

    def decode(params: Params, tokens_BxL: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        return module(params)(tokens_BxL, cache=cache)

    apply = Apply(features, head, cfg.loss_chunk)

    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   nnx.to_pure_dict(abstract_state))
    return BuiltModel(cfg=cfg, apply=apply, init=init, abstract_params=abstract_params, decode=decode)


def param_count(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def embedding_param_count(cfg: ModelConfig) -> int:
    """Parameters in embedding tables (lookups, not matrix multiplies): the token table, and the GPT's positions.
    A Llama's tied table counts here too (it is one table); its use as the head is counted by
    :func:`flops_per_token`."""
    return cfg.vocab_size * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.kind == "gpt" else 0)


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs of one training token (forward + backward), the numerator of MFU.

    ``6 * N`` for the matrix multiplies, where N is every parameter of the model (counted from the model as
    :func:`build` builds it) except the embedding tables (:func:`embedding_param_count`: lookups); the output
    head counts (it is a matmul), and so do the few norm scales and biases (a rounding error). A Llama with
    ``tie_embeddings`` has no head parameter, but its head is still a ``[D, V]`` matmul (by the token table):
    ``6 * vocab_size * d_model`` more, so tied and untied Llamas of one shape count the same FLOPs. GQA's smaller
    k and v projections and SwiGLU's three matrices are counted as :func:`build` builds them. For the GPT and the
    Llama, plus attention's score and value products: ``12 * n_layers * d_model * seq_len`` (PaLM, appendix B; the
    full LxL products, as PaLM counts them, though a causal mask makes half of them moot; GQA shares keys and
    values between query heads but computes every query head's products: ``d_model`` is ``n_heads * head_dim``
    there, which a llama with its own ``model.head_dim`` counts instead; a sliding window is not discounted).
    Model FLOPs, not hardware FLOPs: ``remat``'s recomputation and the optimizer's elementwise update are not
    counted.
    """
    n_params = param_count(build(cfg).abstract_params)
    flops = 6.0 * (n_params - embedding_param_count(cfg))
    if cfg.kind == "llama" and cfg.tie_embeddings:
        flops += 6.0 * cfg.vocab_size * cfg.d_model
    if cfg.kind in ("gpt", "llama"):
        width = cfg.n_heads * cfg.head_size if cfg.kind == "llama" else cfg.d_model
        flops += 12.0 * cfg.n_layers * width * cfg.seq_len
    return flops
