"""The outer update (DiLoCo) and the merge weights, in plain Python: no JAX.

- island i starts a round from the global θ_v and ends at θ_i; its
  pseudo-gradient is Δ_i = θ_v − θ_i;
- Δ = Σ w_i Δ_i / Σ w_i with w_i = tokens_i · (1 + staleness_i)^−α
  (:func:`staleness_weight`, :func:`merge_weights`);
- θ_{v+1} = θ_v + u, with (u, m) from :func:`outer_update`: SGD with
  (Nesterov) momentum, the outer optimizer of DiLoCo.

:func:`outer_update` uses arithmetic operators only, so the one implementation
serves the coordinator's merger (numpy slabs of flat vectors, see
``coordinator.merger``) and the in-process simulation (jax arrays, mapped over
the parameter pytree by ``dtrain.diloco.outer_step``). The coordinator never
imports JAX, so nothing here may.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from dtrain.config import Config

if TYPE_CHECKING:  # for the annotations only: importing JAX here would load it into the coordinator
    import jax

Array = TypeVar("Array", np.ndarray, "jax.Array")  # numpy slabs (the merger) or jax arrays (dtrain.diloco)


@dataclass(frozen=True)
class OuterHParams:
    """The outer optimizer's hyper-parameters, as one merge applies them (hashable: a static jit argument)."""

    lr: float  # outer learning rate of one merge
    momentum: float  # μ in [0, 1); 0: plain SGD, the momentum buffer is left as it is
    nesterov: bool  # Nesterov momentum (u = −lr·(Δ + μ·m)) rather than heavy ball (u = −lr·m)

    @classmethod
    def from_config(cls, cfg: Config, mode: str | None = None) -> OuterHParams:
        """The outer section's lr, momentum and Nesterov flag for merges in ``mode`` (default:
        ``coordinator.mode``). In async mode every push is merged on its own, N merges where a synchronous round
        makes one, so each takes lr / outer.islands. The in-process rounds are synchronous: ``mode="sync"``."""
        o = cfg.outer
        mode = cfg.coordinator.mode if mode is None else mode
        if mode not in ("sync", "async"):
            raise ValueError(f"merge mode must be 'sync' or 'async', got {mode!r}")
        lr = o.lr if mode == "sync" else o.lr / o.islands
        return cls(lr=lr, momentum=o.momentum, nesterov=o.nesterov)


def outer_update(delta: Array, momentum: Array, hp: OuterHParams) -> tuple[Array, Array]:
    """(u, m') for the merged pseudo-gradient Δ and the momentum m: m' = μ·m + Δ; u = −lr·(Δ + μ·m') with
    Nesterov, u = −lr·m' without; with μ = 0, u = −lr·Δ and m' = m. Apply as θ' = θ + u.

    ``optax.sgd(lr, momentum, nesterov)`` on the same inputs (the golden oracle in tests/test_outer.py).
    Elementwise and pure: any shape, numpy or jax; the results are new arrays (the inputs are not modified),
    in the inputs' dtype (the hyper-parameters are Python floats)."""
    if not hp.momentum:
        return delta * -hp.lr, momentum
    new_momentum = momentum * hp.momentum + delta
    step = delta + new_momentum * hp.momentum if hp.nesterov else new_momentum
    return step * -hp.lr, new_momentum


def staleness_weight(tokens: float, staleness: int, alpha: float) -> float:
    """The merge weight of a delta over ``tokens`` tokens from a base ``staleness`` versions old:
    tokens · (1 + s)^−α (float64)."""
    return float(tokens) * (1.0 + staleness) ** (-alpha)


def merge_weights(tokens: Sequence[float], staleness: Sequence[int] | None = None,
                  alpha: float = 0.0) -> np.ndarray:
    """Normalized merge weights w_i / Σ w (float32), w_i = :func:`staleness_weight` (tokens_i, s_i, α)."""
    stale = [0] * len(tokens) if staleness is None else list(staleness)
    if len(stale) != len(tokens):
        raise ValueError(f"need one staleness per token count, got {len(stale)} and {len(tokens)}")
    w = np.array([staleness_weight(t, s, alpha) for t, s in zip(tokens, stale, strict=True)], np.float64)
    total = w.sum()
    if not total > 0:
        raise ValueError(f"merge weights must have a positive sum, got tokens={list(tokens)}")
    return (w / total).astype(np.float32)
