"""What is read off a loaded config rather than stored in it: the merge rule a coordinator applies, and a
``security.bindings`` entry parsed."""

from __future__ import annotations

from dtrain.config.sections import IDENTITY_KINDS, ISLAND_NAME_RE, Config


def merge_rule(cfg: Config) -> str:
    """``coordinator.merge_rule`` as the coordinator merges: ``auto`` is the screened mean, or with a sparse
    ``codec.up`` the clipped mean (the pushes' entries rarely coincide, so a per-coordinate median or trim, or a
    screen against the coordinate median, would drop most of them)."""
    rule = cfg.coordinator.merge_rule
    if rule == "auto":  # a sharded coordinator has no direction screen (the median is per range): clipped
        return "clipped_mean" if cfg.codec.up == "sparse" or cfg.coordinator.shards > 1 else "screened_mean"
    return rule


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

