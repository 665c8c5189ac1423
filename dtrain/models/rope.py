"""Rotary position embedding frequencies, with the rope scalings ``transformers`` ships for the llama's families.

:func:`frequencies` gives the inverse frequencies ``[H / 2]`` (float32) and the factor cos and sin are scaled by,
as ``transformers``' ``ROPE_INIT_FUNCTIONS`` compute them (``modeling_rope_utils.py``), step for step in float32:

- ``none`` (``default``): ``1 / theta ** (arange(0, H, 2) / H)``.
- ``linear``: those divided by ``rope_factor`` (positions interpolated).
- ``dynamic`` (NTK): for a sequence of ``L`` positions past ``max_positions``, theta becomes
  ``theta * (factor * L / max_positions - (factor - 1)) ** (H / (H - 2))``; unchanged up to ``max_positions``.
- ``yarn``: interpolated and extrapolated frequencies blended by a linear ramp between the correction dimensions
  of ``beta_fast = 32`` and ``beta_slow = 1`` rotations over ``rope_original_max`` (floored and ceiled, as
  ``truncate`` does by default), and cos and sin scaled by ``0.1 * ln(factor) + 1``.
- ``llama3`` (Llama 3.1 and later): wavelengths past ``original / low_freq_factor`` divided by ``factor``,
  those under ``original / high_freq_factor`` kept, the ones between smoothly interpolated.

numpy only: the tables are constants of the traced program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dtrain.config.sections import ModelConfig

YARN_BETA_FAST = 32.0  # yarn's default beta_fast and beta_slow, the only ones dtrain takes (hf_fields refuses others)
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class RopeScaling:
    """The llama's rope: base, scaling type and its numbers (``model.rope_*``; ``positions``: max_positions)."""

    theta: float
    kind: str = "none"
    factor: float = 1.0
    positions: int = 0
    original: int = 0  # original_max_position_embeddings (0: positions)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> RopeScaling:
        return cls(theta=cfg.rope_theta, kind=cfg.rope_scaling, factor=cfg.rope_factor, positions=cfg.positions,
                   original=cfg.rope_original_max or cfg.positions, low_freq_factor=cfg.rope_low_freq_factor,
                   high_freq_factor=cfg.rope_high_freq_factor)


def _default(head_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32)


def frequencies(head_dim: int, rope: RopeScaling, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies ``[head_dim / 2]`` float32, cos/sin scale) for positions ``0 .. seq_len - 1``."""
    f = rope.factor
    if rope.kind == "none":
        return _default(head_dim, rope.theta), 1.0
    if rope.kind == "linear":
        return (_default(head_dim, rope.theta) / np.float32(f)).astype(np.float32), 1.0
    if rope.kind == "dynamic":
        theta = rope.theta
        if seq_len > rope.positions:
            theta = theta * ((f * seq_len / rope.positions) - (f - 1)) ** (head_dim / (head_dim - 2))
        return _default(head_dim, theta), 1.0
    if rope.kind == "yarn":
        return _yarn(head_dim, rope)
    if rope.kind == "llama3":
        return _llama3(head_dim, rope), 1.0
    raise ValueError(f"model.rope_scaling: unknown type {rope.kind!r}")


def _yarn(head_dim: int, rope: RopeScaling) -> tuple[np.ndarray, float]:
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
    high: float = min(math.ceil(correction_dim(YARN_BETA_SLOW)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)  # the share of the extrapolated (unscaled) frequency
    inv_freq = interpolation * (np.float32(1.0) - keep) + extrapolation * keep
    scale = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return inv_freq.astype(np.float32), scale


def _llama3(head_dim: int, rope: RopeScaling) -> np.ndarray:
    inv_freq = _default(head_dim, rope.theta)
    f = np.float32(rope.factor)
    low_wavelen = rope.original / rope.low_freq_factor
    high_wavelen = rope.original / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f, inv_freq).astype(np.float32)
    smooth = ((np.float32(rope.original) / wavelen - np.float32(rope.low_freq_factor))
              / np.float32(rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
    smoothed = (np.float32(1.0) - smooth) * scaled / f + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
