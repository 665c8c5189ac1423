"""Generating from a :class:`~dtrain.inference.load.Loaded` model: greedy or top-p sampling, with a KV cache.

With the cache (the default) the prompt is run once (the prefill, one jitted program per prompt length), then each
new token is one jitted decode step over the cache (:attr:`dtrain.models.model.BuiltModel.decode`; one program
for every step). Without it, every step runs the model over the whole sequence so far, padded to its final length
(causal: the padding after a position changes nothing before it), one program for every step too: the reference
the cache is tested against. Both pick each token with :func:`pick` from the same per-step key, so they agree
token for token, sampled or greedy.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dtrain.inference.load import Loaded, LoadError

__all__ = ["generate", "pick"]


@partial(jax.jit, static_argnames=("temperature", "top_p"))
def pick(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """The next id of each row: the argmax with ``temperature`` 0 (greedy), else a sample of
    ``softmax(logits / temperature)`` restricted to the smallest set of ids whose probability reaches ``top_p``
    (nucleus sampling; 1.0: all of them)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    scaled_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # probability of the ids ranked above each
        kept = jnp.sum(before_BxV < top_p, axis=-1)  # at least 1: the top id has nothing before it
        cutoff_B = jnp.take_along_axis(sorted_BxV, (kept - 1)[:, None], axis=-1)
        scaled_BxV = jnp.where(scaled_BxV >= cutoff_B, scaled_BxV, -jnp.inf)
    return jax.random.categorical(key, scaled_BxV, axis=-1).astype(jnp.int32)


def generate(model: Loaded, prompt_ids: np.ndarray, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, cache: bool = True, stop_id: int | None = None) -> np.ndarray:
    """``[batch, new]`` ids following each row of ``prompt_ids`` (``[batch, length]``): ``max_new_tokens`` of them,
    fewer when every row has produced ``stop_id`` (the rows that stopped first are padded with it). ``cache``:
    with the KV cache (else the whole sequence is run again each step). LoadError for ids the model cannot take or
    a bad setting."""
    if max_new_tokens < 1:
        raise LoadError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise LoadError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    prompt = model.check_ids(prompt_ids, extra=max_new_tokens)
    B, P = prompt.shape
    total = P + max_new_tokens
    key = jax.random.PRNGKey(seed)
    choose = partial(pick, temperature=float(temperature), top_p=float(top_p))
    out = np.zeros((B, max_new_tokens), np.int32)
    done = np.zeros(B, bool)
    if cache:
        prefill = jax.jit(model.built.decode)
        step = jax.jit(model.built.decode, donate_argnums=(2,))  # the old cache's buffers become the new one's
        logits, kv = prefill(model.params, jnp.asarray(prompt), model.built.new_cache(B, total))
    else:
        forward = jax.jit(model.built.apply)
        seq = np.zeros((B, total), np.int32)
        seq[:, :P] = prompt
        logits = forward(model.params, jnp.asarray(seq))[:, :P]
    for i in range(max_new_tokens):
        next_B = np.asarray(choose(logits[:, -1], jax.random.fold_in(key, i)))  # note: a host sync per token
        if stop_id is not None:
            next_B = np.where(done, stop_id, next_B)
            done |= next_B == stop_id
        out[:, i] = next_B
        if i == max_new_tokens - 1 or done.all():
            return out[:, :i + 1]
        if cache:
            logits, kv = step(model.params, jnp.asarray(next_B[:, None]), kv)
        else:
            seq[:, P + i] = next_B
            logits = forward(model.params, jnp.asarray(seq))[:, :P + i + 1]
    return out
