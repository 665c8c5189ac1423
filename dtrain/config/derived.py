"""What is read off a loaded config rather than stored in it: the merge rule a coordinator applies, its merge
threads and the cores they count on, and a ``security.bindings`` entry parsed."""

from __future__ import annotations

import os

from dtrain.config.sections import IDENTITY_KINDS, ISLAND_NAME_RE, Config


def merge_rule(cfg: Config) -> str:
    """``coordinator.merge_rule`` as the coordinator merges: ``auto`` is the screened mean, or with a sparse
    ``codec.up`` the clipped mean (the pushes' entries rarely coincide, so a per-coordinate median or trim, or a
    screen against the coordinate median, would drop most of them)."""
    rule = cfg.coordinator.merge_rule
    if rule == "auto":  # a sharded coordinator has no direction screen (the median is per range): clipped
        return "clipped_mean" if cfg.codec.up == "sparse" or cfg.coordinator.shards > 1 else "screened_mean"
    return rule


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one; else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def merge_threads(cfg: Config) -> int:
    """``coordinator.merge_threads`` as the coordinator runs it: 0 is half the usable cores, at least 1."""
    return cfg.coordinator.merge_threads or max(1, usable_cores() // 2)


def parse_binding(text: str) -> tuple[str, str]:
    """A ``security.bindings`` entry ``NAME=KIND:VALUE`` as (name, identity); ValueError says what is wrong."""
    name, sep, identity = text.partition("=")
    kind, colon, value = identity.partition(":")
    if not sep or not ISLAND_NAME_RE.fullmatch(name.strip()):
        raise ValueError(f"{text!r}: expected NAME=IDENTITY with an island name ([A-Za-z0-9._-]{{1,64}}), e.g. "
                         f"B=token:B or B=uri:spiffe://dtrain/island/B")
    if kind.strip() not in IDENTITY_KINDS or not colon or not value.strip():
        raise ValueError(f"{text!r}: the identity must be {', '.join(k + ':VALUE' for k in IDENTITY_KINDS)}")
    return name.strip(), f"{kind.strip()}:{value.strip()}"

