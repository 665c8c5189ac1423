"""What the merger works with: its options, a pending push, a prepared and a broadcast update, and the rules.

Guards against a poisoned delta:

- Each spool (``coordinator.spool``) measures its push's L2 norm as the frame
  is validated, from the checked scales and codes (``codec.block_sum_squares``:
  no dequantization, no second pass over the body); the coordinator screens it
  (``coordinator.admission``) and may give the push a clip factor c ≤ 1
  (:meth:`Merger.add_pending`). With
  ``merge_rule = "mean"`` the merged Δ is Σ w_i·c_i·Δ_i / Σ w_i (the divisor keeps
  the unclipped weights, so clipping shrinks the push's contribution).
- ``coordinator.merge_rule`` ``trimmed_mean`` / ``median``: per slab, each push's
  c_i·Δ_i is dequantized into a row of a (pushes × slab) array and the rule
  (``dtrain.steps.outer.trimmed_mean`` / ``coordinate_median``, unweighted) reduces it:
  memory stays pushes × slab.
- ``clipped_mean``: the mean, with each push's clip factor further capped so that
  its norm is at most ``coordinator.clip_ratio`` × the median norm of the pushes
  being merged (:func:`round_clip_factors`; the norms are the spools', known before
  the step, so it stays one streaming pass).
- ``screened_mean``: the mean, of the pushes that pass a direction screen when the round
  closes (``coordinator.admission.screen_round``): :meth:`Merger.direction_cosines` gives
  each pending push's cosine with the coordinate median of the pending pushes (with fewer
  than 3, the outer momentum), estimated on a random sample of about 2^20 values per push
  (``SCREEN_VALUES``; with more than 4 pushes, a share of 4 × that: :func:`screen_budget`; all in a smaller
  fragment), in one streaming pass over the spools
  before the step (memory pushes × slab / 8), and a push below ``coordinator.min_cosine``
  is rejected and dropped (:meth:`Merger.drop_pending`).
- Before it commits, the step checks every slab of the update, the momentum, the
  residual and θ for non-finite values. If any is found, it deletes its temp
  files, leaves the version as it was and raises :class:`NonFiniteResult`
  naming the push to blame: a validated payload's values are always finite
  (the codec caps the scales), so the blame goes to the pending push with the
  largest contribution (c·‖Δ‖, times its weight under the mean). The caller
  drops it (:meth:`Merger.drop_pending`) and may step again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from coordinator.spool import Spool
from dtrain import codec
from dtrain.config.derived import merge_rule, merge_threads
from dtrain.config.sections import Config
from dtrain.steps.outer import OuterHParams
from dtrain.train.fragments import Range, plan_spec

# Values per slab: 256 KiB of float32, which stays in a core's L2 cache while every push is added to it (a 1 MiB
# slab spilled: ~15% more CPU for the sum); a merge thread's buffers (merge_io.SUM_GROUP pushes at once) stay under
# the coordinator's 4 MiB mmap threshold, so they are reused.
SLAB_TARGET = 1 << 16


SCREEN_VALUES = 1 << 20  # values per push the direction screen samples (Merger.direction_cosines): ~1e-3 on a cosine
# With more than SCREEN_SHARE_PUSHES pushes the round's sample is shared: each push gets screen_values x
# SCREEN_SHARE_PUSHES / pushes values, at least SCREEN_MIN_VALUES (~3e-3 on a cosine): the median's cost stays
# that of 4 pushes' however many islands push, and min_cosine's margin (0 against a reversed push's -1) is kept.
SCREEN_SHARE_PUSHES = 4
SCREEN_MIN_VALUES = 1 << 17


MEAN_RULES = ("mean", "clipped_mean", "screened_mean")  # the merge rules that take the weighted mean of the pushes


def slab_values(block: int) -> int:
    """The slab length: a whole number of quantization blocks, about SLAB_TARGET values."""
    return max(1, SLAB_TARGET // block) * block


@dataclass(frozen=True)
class MergeOptions:
    """What the merger does: everything but the last two fields comes from the config (:meth:`from_config`)."""

    outer: OuterHParams  # the outer update of one merge (lr already divided in async mode)
    up_bits: codec.Bits  # codec.up: the pushed deltas' codec
    down_bits: codec.Bits  # codec.down: the broadcast update's codec (32: lossless)
    block: int  # codec.block: values per quantization block
    zstd_level: int  # codec.zstd_level of the update frames
    error_feedback: bool  # codec.error_feedback: the down path keeps its quantization residual
    keep_updates: int  # coordinator.keep_updates: past update frames kept for lagging islands
    rule: str = "mean"  # coordinator.merge_rule: "mean", "trimmed_mean", "median", "clipped_mean", "screened_mean"
    trim: int = 1  # coordinator.trim: trimmed_mean drops this many values at each end per coordinate
    clip_ratio: float = 1.0  # coordinator.clip_ratio: clipped_mean caps each norm at this x the median norm
    spare_spools: int = 8  # spool files kept for reuse between rounds (disk: this many frame bodies at most)
    threads: int = 2  # coordinator.merge_threads: the outer step's threads
    up_block: int = 0  # the pushes' block (a sparse codec's chunk: codec.sparse_chunk); 0: block
    down_block: int = 0  # the update's block, likewise; 0: block
    max_count: int | None = None  # sparse pushes: the most entries a chunk may hold (codec.density's k)
    down_count: int = 0  # a sparse update: entries kept per chunk (codec.down_density's k); 0: the pushes' union
    mask_code: int = 0  # a mask update: its density code (codec.mask_density, ``codec.density_code``)
    up_mask_code: int = 0  # mask pushes: the density code they must carry (0: any)
    ranges: tuple[Range, ...] = ()  # outer.fragments > 1: the fragments' plan; (): one, the whole θ
    screen_values: int = SCREEN_VALUES  # the direction screen samples about this many values per push (all if fewer)
    screen_min_values: int = SCREEN_MIN_VALUES  # ... and, with more than SCREEN_SHARE_PUSHES pushes, at least these

    @property
    def slab(self) -> int:
        """Values per slab of the outer step: whole blocks of both the pushes' and the update's codec."""
        return slab_values(math.lcm(self.up_block or self.block, self.down_block or self.block))

    @classmethod
    def from_config(cls, cfg: Config, spec: codec.Spec | None = None) -> MergeOptions:
        """The merger of ``cfg``'s coordinator (merge mode: ``coordinator.mode``), with the default internal knobs
        (``dataclasses.replace`` them if needed). ``spec``: the parameter tree, which ``outer.fragments`` > 1
        needs (its fragments' plan, ``dtrain.train.fragments.plan_spec``)."""
        k = cfg.codec
        ranges: tuple[Range, ...] = ()
        if cfg.outer.fragments > 1:
            if spec is None:
                raise ValueError("outer.fragments > 1 needs the parameter tree's spec to plan the fragments")
            ranges = plan_spec(spec, cfg.outer.fragments)
        (up_bits, up_block), (down_bits, down_block) = k.scheme(k.up), k.scheme(k.down)
        return cls(outer=OuterHParams.from_config(cfg), up_bits=up_bits, down_bits=down_bits,
                   block=k.block, zstd_level=k.zstd_level, error_feedback=k.error_feedback,
                   keep_updates=cfg.coordinator.keep_updates, rule=merge_rule(cfg),
                   trim=cfg.coordinator.trim, clip_ratio=cfg.coordinator.clip_ratio,
                   threads=merge_threads(cfg), up_block=up_block, down_block=down_block,
                   # one spare per island: a round's pushes all write over the last round's files (filling new
                   # ones costs the kernel 3x), and the disk they hold is what every round's spools take anyway
                   spare_spools=max(cls.spare_spools, cfg.outer.islands),
                   max_count=k.max_count if codec.is_sparse(up_bits) else None, ranges=ranges,
                   down_count=codec.kept_per_chunk(k.down_density, down_block)
                   if codec.is_sparse(down_bits) and k.down_density > 0 else 0,
                   mask_code=codec.density_code(k.mask_density) if down_bits == codec.MASK_BITS else 0,
                   up_mask_code=codec.density_code(k.mask_density) if up_bits == codec.MASK_BITS else 0)


class NonFiniteResult(ValueError):
    """The outer step would have made the state non-finite; nothing was committed. ``blame``: the key of the
    pending push held responsible (see the module docstring); ``what``: which array, at which value index."""

    def __init__(self, what: str, blame: str, reason: str):
        super().__init__(reason)
        self.what = what
        self.blame = blame


@dataclass
class SpooledPush:
    """A push the next outer step merges: its validated, spooled body and how it counts."""

    spool: Spool
    weight: float  # merge weight (tokens x staleness factor)
    scale: float = 1.0  # clip factor on its values (1: not clipped)
    key: str = ""  # the caller's name for it (the push id)
    cap: float = 1.0  # clipped_mean: the further factor this step gives it (round_clip_factors)
    whole_norm: float | None = None  # a sharded coordinator: the whole push's L2 norm (all ranges), not this spool's

    @property
    def norm(self) -> float:
        """The L2 norm of its values, as spooled (before the clip factor); the whole push's, when given."""
        return self.spool.norm if self.whole_norm is None else self.whole_norm


@dataclass(frozen=True)
class Update:
    """One frame on disk: an outer update (θ_version = θ_base + dequantize(frame)) or a lossless θ."""

    version: int
    base_version: int
    path: Path  # written once; pulls stream it from here
    size: int
    crc32: int
    params_digest: str  # digest of θ_version

    @property
    def frame(self) -> bytes:
        """The whole frame in memory (tests and tools; the service streams it with :meth:`open`)."""
        return self.path.read_bytes()

    def open(self) -> BinaryIO:
        """An open handle: the frame stays readable even if it is deleted before the pull finishes."""
        return open(self.path, "rb")


@dataclass(frozen=True)
class Prepared:
    """An outer step written but not committed (:meth:`Merger.prepare`): the new version's temp state files and its
    update frame, θ's digest and L2 norm."""

    version: int
    tmp: dict[str, Path]
    digest: str
    theta_norm: float
    update: Update


def screen_budget(opts: MergeOptions, pushes: int) -> int:
    """Values per push the direction screen samples in a round of ``pushes``: ``opts.screen_values``, or with more
    than SCREEN_SHARE_PUSHES pushes their share of SCREEN_SHARE_PUSHES x that, at least ``opts.screen_min_values``
    (never more than ``opts.screen_values``)."""
    if pushes <= SCREEN_SHARE_PUSHES:
        return opts.screen_values
    return max(min(opts.screen_values, opts.screen_min_values), opts.screen_values * SCREEN_SHARE_PUSHES // pushes)


def round_clip_factors(norms: list[float], scales: list[float], ratio: float) -> list[float]:
    """``clipped_mean``: the factor (<= 1) on each push, on top of its clip factor (``scales``), that makes its norm
    at most ``ratio`` × the median of the pushes' clipped norms (``norms``: as spooled). A zero norm gets 1."""
    clipped = [n * c for n, c in zip(norms, scales, strict=True)]
    bound = ratio * float(np.median(clipped)) if clipped else 0.0
    return [min(1.0, bound / m) if m > 0 else 1.0 for m in clipped]

