"""The outer step (DiLoCo): pseudo-gradients, weighted merge, Nesterov outer optimizer.

All pure functions over parameter pytrees:

- island i starts a round from the global θ_v and ends at θ_i; its
  pseudo-gradient is Δ_i = θ_v − θ_i (:func:`pseudo_gradient`);
- Δ = Σ w_i Δ_i / Σ w_i with w_i = tokens_i · (1 + staleness_i)^−α
  (:func:`merge_deltas`);
- θ_{v+1} = θ_v − OuterOpt(Δ), OuterOpt = SGD with Nesterov momentum
  (:func:`outer_step`; ``optax.sgd(lr, momentum, nesterov=True)``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dtrain.config import OuterConfig
from dtrain.model import Params


class OuterState(struct.PyTreeNode):
    version: jax.Array  # int32 scalar: outer steps applied so far (θ_version)
    params: Params  # the global parameters θ_version, float32
    opt_state: optax.OptState  # outer momentum buffer


def make_outer_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0)


def init_outer(params: Params, tx: optax.GradientTransformation) -> OuterState:
    return OuterState(version=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def pseudo_gradient(global_params: Params, local_params: Params) -> Params:
    """Δ = θ_global − θ_local: the direction the island moved, with the sign of a gradient."""
    return jax.tree.map(lambda g, l: (g - l).astype(jnp.float32), global_params, local_params)


def staleness_factor(staleness: int | jax.Array, alpha: float) -> jax.Array:
    """Weight multiplier for a delta based on a version ``staleness`` versions old: (1 + s)^−α."""
    return (1.0 + jnp.asarray(staleness, jnp.float32)) ** (-alpha)


def merge_weights(tokens: Sequence[float], staleness: Sequence[int] | None = None,
                  alpha: float = 0.0) -> jax.Array:
    """Normalized merge weights w_i / Σ w; w_i = tokens_i · (1 + s_i)^−α."""
    w = jnp.asarray(tokens, jnp.float32)
    if staleness is not None:
        w = w * staleness_factor(jnp.asarray(staleness), alpha)
    total = w.sum()
    if not bool(total > 0):  # note: host sync; weights are a handful of scalars
        raise ValueError(f"merge weights must have a positive sum, got tokens={list(tokens)}")
    return w / total


def merge_deltas(deltas: Sequence[Params], tokens: Sequence[float], staleness: Sequence[int] | None = None,
                 alpha: float = 0.0) -> Params:
    """Token- and staleness-weighted mean of pseudo-gradients."""
    if len(deltas) != len(tokens) or not deltas:
        raise ValueError(f"need one token count per delta, got {len(deltas)} deltas and {len(tokens)} counts")
    w = merge_weights(tokens, staleness, alpha)
    return jax.tree.map(lambda *ds: sum(w[i] * d for i, d in enumerate(ds)), *deltas)


@jax.jit
def _apply(params: Params, updates: Params) -> Params:
    return optax.apply_updates(params, updates)


def outer_step(state: OuterState, delta: Params, tx: optax.GradientTransformation) -> OuterState:
    """θ_{v+1} = θ_v + OuterOpt.update(Δ): a descent step along the merged pseudo-gradient."""
    updates, opt_state = tx.update(delta, state.opt_state, state.params)
    return OuterState(version=state.version + 1, params=_apply(state.params, updates), opt_state=opt_state)
