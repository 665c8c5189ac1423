"""The outer update (DiLoCo) and the merge weights, in plain Python: no JAX.

- island i starts a round from the global θ_v and ends at θ_i; its
  pseudo-gradient is Δ_i = θ_v − θ_i;
- Δ = Σ w_i Δ_i / Σ w_i with w_i = tokens_i · (1 + staleness_i)^−α
  (:func:`staleness_weight`, :func:`merge_weights`);
- θ_{v+1} = θ_v + u, with (u, m) from :func:`outer_update`: SGD with
  (Nesterov) momentum, the outer optimizer of DiLoCo, or (``outer.rule =
  "sparseloco"``) plain SGD on the mean of the islands' sparse updates, whose
  decaying error-feedback accumulators replace the momentum (SparseLoCo).

The coordinator can combine a round's pushes by a robust rule instead of the
mean (``coordinator.merge_rule``): :func:`trimmed_mean` and
:func:`coordinate_median`, per coordinate over one slab of every push, and it
screens each push's norm first (:func:`robust_z`, :func:`clip_factor`).

:func:`outer_update` uses arithmetic operators only, so the one implementation
serves the coordinator's merger (numpy slabs of flat vectors, see
``coordinator.merger``) and the in-process simulation (jax arrays, mapped over
the parameter pytree by ``dtrain.train.diloco.outer_step``). The coordinator never
imports JAX, so nothing here may.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from dtrain.config.sections import Config

if TYPE_CHECKING:  # for the annotations only: importing JAX here would load it into the coordinator
    import jax

Array = TypeVar("Array", np.ndarray, "jax.Array")  # numpy slabs (the merger) or jax arrays (dtrain.train.diloco)


@dataclass(frozen=True)
class OuterHParams:
    """The outer optimizer's hyper-parameters, as one merge applies them (hashable: a static jit argument)."""

    lr: float  # outer learning rate of one merge
    momentum: float  # μ in [0, 1); 0: plain SGD, the momentum buffer is left as it is
    nesterov: bool  # Nesterov momentum (u = −lr·(Δ + μ·m)) rather than heavy ball (u = −lr·m)
    rule: str = "nesterov"  # outer.rule: "nesterov" (DiLoCo) or "sparseloco" (u = −lr·Δ, no momentum)

    @classmethod
    def from_config(cls, cfg: Config, mode: str | None = None) -> OuterHParams:
        """The outer section's rule and its hyper-parameters for merges in ``mode`` (default:
        ``coordinator.mode``): ``nesterov``: outer.lr, outer.momentum, outer.nesterov; ``sparseloco``:
        outer.sparseloco_lr (outer.mask_lr with the mask codec) and no momentum. In async mode every push is
        merged on its own, N merges where a synchronous round makes one, so each takes lr / outer.islands. The
        in-process rounds are synchronous: ``mode="sync"``."""
        o = cfg.outer
        mode = cfg.coordinator.mode if mode is None else mode
        if mode not in ("sync", "async"):
            raise ValueError(f"merge mode must be 'sync' or 'async', got {mode!r}")
        if o.rule not in ("nesterov", "sparseloco"):
            raise ValueError(f"outer.rule must be 'nesterov' or 'sparseloco', got {o.rule!r}")
        sparse = o.rule == "sparseloco"
        lr = (o.mask_lr if cfg.codec.up == "mask" else o.sparseloco_lr) if sparse else o.lr
        lr = lr if mode == "sync" else lr / o.islands
        return cls(lr=lr, momentum=0.0 if sparse else o.momentum, nesterov=o.nesterov and not sparse, rule=o.rule)


def outer_update(delta: Array, momentum: Array, hp: OuterHParams) -> tuple[Array, Array]:
    """(u, m') for the merged pseudo-gradient Δ and the momentum m: m' = μ·m + Δ; u = −lr·(Δ + μ·m') with
    Nesterov, u = −lr·m' without; with μ = 0, u = −lr·Δ and m' = m. Apply as θ' = θ + u.

    ``hp.rule == "sparseloco"`` (SparseLoCo): u = −lr·Δ and m' = m whatever μ: the islands' decaying
    error-feedback accumulators stand in for the outer momentum, and Δ is already the mean of their sparse,
    quantized updates.

    ``optax.sgd(lr, momentum, nesterov)`` on the same inputs (the golden oracle in tests/test_outer.py).
    Elementwise and pure: any shape, numpy or jax; the results are new arrays (the inputs are not modified),
    in the inputs' dtype (the hyper-parameters are Python floats)."""
    if hp.rule == "sparseloco" or not hp.momentum:
        return delta * -hp.lr, momentum
    new_momentum = momentum * hp.momentum + delta
    step = delta + new_momentum * hp.momentum if hp.nesterov else new_momentum
    return step * -hp.lr, new_momentum


def suited_rule(codec_up: str) -> str:
    """The outer rule that suits pushes in the codec ``codec_up`` (``codec.up``'s value): ``sparseloco`` for the
    sparse and mask codecs (SparseLoCo: an island's decaying error-feedback accumulator already carries the
    momentum of what it has not sent; a Nesterov momentum over the mean of sparse pushes amplifies their selection
    noise, and over masked pushes it diverged: its mass waits for each value's turn), and
    ``nesterov`` for every dense codec, int2 included (DiLoCo; MuLoCo's 2-bit pushes: error feedback on each
    island keeps the quantization error out of the outer momentum, which smooths what remains)."""
    return "sparseloco" if codec_up in ("sparse", "mask") else "nesterov"


def feedback_decay(cfg: Config) -> float:
    """β of the islands' error feedback: ``outer.sparseloco_beta`` under the sparseloco rule (its accumulator,
    e ← β·e + Δ, stands in for the outer momentum; ``outer.mask_beta`` with the mask codec), 1 (plain error
    feedback) otherwise."""
    if cfg.outer.rule != "sparseloco":
        return 1.0
    return cfg.outer.mask_beta if cfg.codec.up == "mask" else cfg.outer.sparseloco_beta


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


MERGE_RULES = ("mean", "trimmed_mean", "median")


def effective_trim(trim: int, pushes: int) -> int:
    """The values :func:`trimmed_mean` drops at each end: ``trim``, but at most (pushes − 1) // 2 so one is left."""
    return max(0, min(trim, (pushes - 1) // 2))


def trimmed_mean(values_NxS: np.ndarray, trim: int) -> np.ndarray:
    """Per coordinate (column), the mean of the N values left after dropping the ``trim`` largest and the ``trim``
    smallest (``trim`` capped by :func:`effective_trim`). Unweighted: every push is one vote. float32 result."""
    n = values_NxS.shape[0]
    if n == 0:
        raise ValueError("trimmed_mean of no pushes")
    k = effective_trim(trim, n)
    if k == 0:
        return values_NxS.mean(axis=0, dtype=np.float32)
    ordered = np.sort(values_NxS, axis=0)  # a slab-sized copy per push: the slab is small
    return ordered[k:n - k].mean(axis=0, dtype=np.float32)


def coordinate_median(values_NxS: np.ndarray) -> np.ndarray:
    """Per coordinate (column), the median of the N values (the mean of the middle two when N is even), as
    ``np.median`` computes it. Unweighted. float32 result. The columns are copied to rows first, so that the
    partial sort runs over contiguous memory (about twice as fast as ``np.median(axis=0)`` with 64 pushes).

    One selection per row, for N even too: after partitioning at ``mid`` the values before it are the row's
    ``mid`` smallest, so the lower middle value is their maximum. ``np.partition`` with the two middle ranks
    (what ``np.median`` does) selects twice and took about 3 times the CPU with 64 pushes; the result is the same
    bit for bit ((a + b) / 2 in float32 either way)."""
    n = values_NxS.shape[0]
    if n == 0:
        raise ValueError("median of no pushes")
    cols = np.array(values_NxS.T, np.float32, order="C")  # the one copy (np.median makes one too), sorted in place
    mid = n // 2
    cols.partition(mid, axis=1)
    if n % 2:
        return cols[:, mid].copy()
    lower = cols[:, :mid].max(axis=1)
    lower += cols[:, mid]
    lower /= np.float32(2)
    return lower


NORM_SPREAD_FLOOR = 0.25  # the deviation used by robust_z is at least this fraction of the median


def robust_scores(values: Sequence[float] | np.ndarray, window: Sequence[float] | np.ndarray, spread_floor: float,
                  abs_floor: float = 0.0) -> np.ndarray:
    """The one robust z-score: how far each of ``values`` lies from the median of ``window``, signed, in robust
    deviations: (v − median) / σ with σ = max(1.4826 · MAD, ``spread_floor`` · |median|, ``abs_floor``) over the
    window (1.4826 · MAD estimates a normal distribution's σ; the floors keep a window of near-equal values from
    making every small change an outlier). A non-finite value gives ``inf``; with σ = 0, a value above the
    median gives ``inf`` and any other 0. The window must be finite and non-empty.

    Used by the coordinator's norm screen (:func:`robust_z`: one norm against the recent ones) and by the chip
    probes (``dtrain.health.probes.robust_z``: each device against all of them)."""
    w = np.asarray(window, np.float64)
    if w.size == 0:
        raise ValueError("robust_scores needs a non-empty window")
    v = np.asarray(values, np.float64)
    # Over the last axis: a 2-D window is one window per row (rows of ``values`` against their own row), e.g. a
    # chunk's per-device gradient norms, step by step, in one call.
    median = np.median(w, axis=-1, keepdims=True)
    sigma = np.maximum(np.maximum(1.4826 * np.median(np.abs(w - median), axis=-1, keepdims=True),
                                  spread_floor * np.abs(median)), abs_floor)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(sigma > 0, (v - median) / np.where(sigma > 0, sigma, 1.0), np.where(v > median, np.inf, 0.0))
    z = np.where(np.isfinite(v), z, np.inf)
    return z if w.ndim > 1 else z.reshape(v.shape)


def robust_z(norm: float, window: Sequence[float]) -> float:
    """How far ``norm`` lies above the median of ``window`` (:func:`robust_scores` with the spread floor
    ``NORM_SPREAD_FLOOR``): one-sided in use, a norm below the median gives z ≤ 0 (a small delta cannot swamp a
    merge). ``inf`` for a non-finite norm, or a positive norm over a window of zeros."""
    if len(window) == 0:
        raise ValueError("robust_z needs a non-empty window")
    return float(robust_scores([norm], window, NORM_SPREAD_FLOOR)[0])


def clip_factor(norm: float, clip_norm: float) -> float:
    """The factor that scales a push of L2 norm ``norm`` down to at most ``clip_norm`` (1 when it is within it,
    or ``clip_norm`` is 0: off)."""
    if clip_norm <= 0 or norm <= clip_norm:
        return 1.0
    return clip_norm / norm


def adam_ratio_bound(b1: float, b2: float, steps: int) -> float:
    """The largest ``|m̂_t / (√v̂_t + ε)|`` AdamW can reach at any step ``t <= steps``, whatever the gradients: by
    Cauchy-Schwarz, ``|m_t| <= (1-b1)/√(1-b2) · √(Σ_{k<t} (b1²/b2)^k) · √v_t``, with Adam's bias corrections
    ``1/(1-b1^t)`` and ``1/(1-b2^t)``; ε only shrinks it. 1 at t = 1; 1.17 at most for (0.9, 0.95)."""
    t = np.arange(1, max(steps, 1) + 1, dtype=np.float64)
    r = b1 * b1 / b2
    geometric = t if r == 1 else (1 - r ** t) / (1 - r)
    ratio = (1 - b1) / (1 - b1 ** t) * np.sqrt((1 - b2 ** t) / (1 - b2) * geometric)
    return float(ratio.max())


def honest_delta_bound(lr: float, ratio: float, weight_decay: float, params: int, steps: int,
                       theta_norm: float) -> float:
    """A hard ceiling on ‖Δ‖ = ‖θ_v − θ_i‖ after ``steps`` AdamW steps of peak rate ``lr`` from θ_v (L2 norm
    ``theta_norm``) over ``params`` values: each step moves each value by at most ``lr · ratio``
    (:func:`adam_ratio_bound`) plus the decoupled decay ``lr · weight_decay · θ``, so with ``D_t`` the distance
    after t steps, ``D_{t+1} <= D_t + lr·(ratio·√params + weight_decay·(theta_norm + D_t))``, which sums to the
    value returned. The learning-rate schedule and the gradient clip only make the real step smaller."""
    a = lr * weight_decay
    b = lr * (ratio * params ** 0.5 + weight_decay * theta_norm)
    return b * steps if a == 0 else b * ((1 + a) ** steps - 1) / a
