"""Fragments (Streaming DiLoCo): θ cut into contiguous ranges of whole tensors, each exchanged on its own schedule.

A *range* is a contiguous run of whole tensors of the parameter tree in the flat order the codec and the wire
use (``dtrain.codec.flatten``): values ``[start, end)`` of θ. It has its own slice of θ, of the outer momentum
and of the down residual, its own pushes and merges, and its own line of versions. :func:`plan` cuts a tree
into ``parts`` ranges of about equal size; the islands and the coordinator both call it on the same spec and
count, so they agree on the ranges without sending them (``outer.fragments`` is a fingerprint field, checked at
Join). The same plan is what a coordinator sharded by ranges would use.

The schedule (``outer.fragments = F``): an island pushes every H / F inner steps, each push one fragment's
pseudo-gradient, round robin, so fragment f is exchanged every H steps at offset f·H / F. Version v + 1 is the
merge of fragment :func:`fragment_of_round` (v + 1) = v mod F: the coordinator's version counts merges of all
fragments, and fragment f's own line is every F-th version (f + 1, f + 1 + F, ...). A push based on version b
carries fragment b mod F (:func:`fragment_of_base`); it can join only a round that merges that fragment.

Pure: no JAX, no I/O (the coordinator imports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtrain.codec import Spec, hasher_digest, params_digest, params_hasher
from dtrain.config.sections import MAX_FRAGMENTS, ConfigError


@dataclass(frozen=True)
class Range:
    """Values ``[start, end)`` of the flat θ: the whole tensors ``[first_leaf, end_leaf)`` of the spec."""

    index: int
    start: int
    end: int
    first_leaf: int
    end_leaf: int

    @property
    def size(self) -> int:
        return self.end - self.start


def leaf_sizes(spec: Spec) -> list[int]:
    """The values of each tensor of ``spec``, in the flat order."""
    return [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in spec]


def plan(sizes: Sequence[int], parts: int) -> tuple[Range, ...]:
    """``parts`` contiguous ranges of whole tensors (``sizes``: each tensor's values, in flat order) of about
    equal size: boundary k is the tensor boundary closest to k/parts of the total, each range at least one
    tensor. ``parts = 1``: one range, the whole tree. ValueError if ``parts`` is out of [1, tensors]."""
    n_leaves = len(sizes)
    if parts < 1 or parts > MAX_FRAGMENTS:
        raise ValueError(f"fragments must be in 1..{MAX_FRAGMENTS}, got {parts}")
    if parts > n_leaves:
        raise ValueError(f"{parts} fragments need at least {parts} tensors, the tree has {n_leaves}")
    if any(s < 0 for s in sizes):
        raise ValueError("tensor sizes must be >= 0")
    cum = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))])
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, parts):
        lo, hi = cuts[-1] + 1, n_leaves - (parts - k)  # leave one tensor for each range after this one
        target = total * k / parts
        j = lo + int(np.argmin(np.abs(cum[lo:hi + 1] - target)))
        cuts.append(j)
    cuts.append(n_leaves)
    pairs = zip(cuts[:-1], cuts[1:], strict=True)
    return tuple(Range(i, int(cum[a]), int(cum[b]), a, b) for i, (a, b) in enumerate(pairs))


def plan_spec(spec: Spec, parts: int, field: str = "[outer] fragments") -> tuple[Range, ...]:
    """:func:`plan` over the tensors of a tree's spec; ConfigError naming ``field`` (the config field that asked
    for the parts: ``outer.fragments``, or ``coordinator.shards``) if it cannot be cut so (more parts than
    tensors)."""
    try:
        return plan(leaf_sizes(spec), parts)
    except ValueError as e:
        raise ConfigError(f"{field}: {e}") from None


def fragment_of_round(target_version: int, parts: int) -> int:
    """The fragment the merge that makes ``target_version`` (>= 1) updates: (target_version − 1) mod parts."""
    return (target_version - 1) % parts


def fragment_of_base(base_version: int, parts: int) -> int:
    """The fragment an island pushes from global θ ``base_version``: the one the next round merges."""
    return base_version % parts


def check_push(fragment: int, base_version: int, parts: int) -> str:
    """Why a push header naming ``fragment``, based on ``base_version``, does not fit a plan of ``parts``
    fragments, or "" if it does. (That its frame holds exactly that fragment's values is checked as the frame
    is decoded, against the plan's size.)"""
    if not 0 <= fragment < parts:
        return f"fragment={fragment}: must be below outer.fragments={parts}"
    want = fragment_of_base(base_version, parts)
    if fragment != want:
        return (f"fragment={fragment} with base_version={base_version}: a push from version {base_version} "
                f"carries fragment {want} (base_version mod outer.fragments {parts})")
    return ""


def whole(n: int) -> tuple[Range, ...]:
    """The plan without fragments: one range, all ``n`` values."""
    return (Range(0, 0, n, 0, 0),)


def update_range(version: int, ranges: Sequence[Range]) -> Range:
    """The range the update frame that makes ``version`` (>= 1) holds: the fragment that version merged."""
    return ranges[fragment_of_round(version, len(ranges))]


def apply_update(vec: np.ndarray, values: np.ndarray, version: int, ranges: Sequence[Range]) -> np.ndarray:
    """θ_version from θ_(version − 1) = ``vec`` and the dequantized update frame ``values``: a new array, ``vec``
    plus ``values`` on the fragment ``version`` merged (the whole θ without fragments), in float32 as the
    coordinator adds them, so both hold bit-identical θ. ValueError if ``values`` is not that fragment's size."""
    part = update_range(version, ranges)
    if values.size != part.size:
        raise ValueError(f"the update to v{version} holds {values.size} values, fragment {part.index} holds "
                         f"{part.size}")
    if part.size == vec.size:
        return vec + values
    out = vec.copy()
    out[part.start:part.end] += values
    return out


def at_push(anchor: np.ndarray, local: np.ndarray, part: Range) -> np.ndarray:
    """The θ_at_push that makes the fold-in of a push of ``part`` touch that fragment only: ``local`` on it,
    ``anchor`` (the global θ the push was based on) elsewhere. Folding in θ' (``dtrain.train.diloco.fold_in``:
    θ_local ← θ' + (θ_local − θ_at_push)) then keeps every other fragment's progress since its own last push, and
    takes whatever the global θ of the other fragments gained meanwhile."""
    if part.size == anchor.size:
        return local
    out = anchor.copy()
    out[part.start:part.end] = local[part.start:part.end]
    return out


def unsent(anchor: np.ndarray, local: np.ndarray, part: Range) -> np.ndarray:
    """At a push of ``part``: the island's progress that no push has carried yet, θ_local − θ_anchor on every
    other fragment (0 on ``part``, whose progress the push carries). A rewind to the end of this push's range
    puts it back on the newest global θ (θ_newest + unsent: what the fold-ins would have made of it), so it
    discards only what was trained after that point."""
    out = local - anchor
    out[part.start:part.end] = 0.0
    return out


def joined_digest(digests: Sequence[str]) -> str:
    """θ's digest over the ranges of a sharded coordinator (``coordinator.shards``): the one digest of an unsharded
    θ, else the digest of the ranges' digests in order (each one ``codec.params_digest`` of its range's values),
    which the islands compute the same way (:func:`range_digests`)."""
    if len(digests) == 1:
        return digests[0]
    h = params_hasher()
    h.update("|".join(digests).encode())
    return hasher_digest(h)


def range_digests(vec: np.ndarray, ranges: Sequence[Range]) -> list[str]:
    """Each range's digest of the whole θ ``vec``."""
    return [params_digest(vec[r.start:r.end]) for r in ranges]
