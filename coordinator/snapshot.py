"""The coordinator state's checkpoint layout (:class:`Snapshot`, read and written through ``dtrain.schema``) and
the checks that span its records: ``CoordinatorState.to_json`` writes one, :func:`load` reads and checks one for
``CoordinatorState.from_json``. Malformed input raises ``StateError`` INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from coordinator.bindings import MAX_IDENTITY_LEN, Binding
from coordinator.records import (
    MAX_PUSH_ID_LEN,
    NAME_RE,
    Count,
    Finite,
    IslandRecord,
    PendingPush,
    SeenPush,
    StateError,
    StateOptions,
)
from dtrain import schema

Format = Literal[1]  # to_json layout version
FORMAT: Format = 1


@dataclass(frozen=True)
class Counters:
    """The state's counts of pushes and tokens, as checkpointed."""

    deltas_merged: Count
    deltas_dropped: Count
    duplicates: Count
    tokens_merged: Count
    deltas_rejected: Count  # quarantined norm outliers and pushes that made a merge non-finite


@dataclass(frozen=True)
class Snapshot:
    """The checkpoint layout (``CoordinatorState.to_json``); checks that span records are in :func:`load`."""

    format: Format
    run_id: str
    created: Finite
    shards: Count
    version: Count
    counters: Counters
    islands: list[IslandRecord]
    shard_cursors: list[Count]
    pending: list[PendingPush]
    first_pending: Finite | None
    push_ids: list[SeenPush]
    norms: list[Finite]  # the L2 norms of the last coordinator.norm_window merged pushes, oldest first
    bindings: list[Binding]  # names bound at their first Join (coordinator.bindings); [] before identities


def _fail(path: schema.FieldPath, why: str) -> typing.NoReturn:
    raise StateError("INVALID_ARGUMENT", f"bad coordinator state: {schema.format_path(path, 'state')}: {why}")


def load(opts: StateOptions, blob: Any) -> Snapshot:
    """A checkpointed state (``CoordinatorState.to_json``) read and checked against ``opts``: every field's type
    and range, and what spans records (shards, unique ids and names, one live island per shard, pending pushes
    for the open round)."""
    if isinstance(blob, dict) and "bindings" not in blob:  # a checkpoint from before identities: none bound
        blob = {**blob, "bindings": []}
    try:
        snap = schema.load(Snapshot, blob)  # every field's type and range
    except schema.SchemaError as e:
        _fail(e.path, e.why)
    if snap.shards != opts.islands:
        _fail(("shards",), f"checkpoint has {snap.shards} shards, the config has {opts.islands} islands")
    if len(snap.shard_cursors) != opts.islands:
        _fail(("shard_cursors",), f"expected {opts.islands} entries, got {len(snap.shard_cursors)}")
    _check_islands(opts, snap)
    ids: set[str] = set()
    for i, seen in enumerate(snap.push_ids):
        if not 0 < len(seen.push_id) <= MAX_PUSH_ID_LEN or seen.push_id in ids:
            _fail(("push_ids", i, "push_id"), f"{seen.push_id!r}: empty, too long or repeated")
        ids.add(seen.push_id)
    remembered = {s.push_id for s in snap.push_ids[-opts.max_push_ids:]}  # the oldest beyond it are forgotten
    _check_pending(opts, snap, remembered)
    if (snap.first_pending is None) == bool(snap.pending):
        _fail(("first_pending",), "must be a number when pushes are pending, else null")
    names: set[str] = set()
    for i, b in enumerate(snap.bindings):
        if not NAME_RE.fullmatch(b.name) or b.name in names:
            _fail(("bindings", i, "name"), f"{b.name!r}: not a valid island name, or bound twice")
        if not 0 < len(b.identity) <= MAX_IDENTITY_LEN:
            _fail(("bindings", i, "identity"), f"must be 1 to {MAX_IDENTITY_LEN} characters")
        names.add(b.name)
    return snap


def _check_islands(opts: StateOptions, snap: Snapshot) -> None:
    ids: set[str] = set()
    names: set[str] = set()
    held: set[int] = set()  # shards of live islands
    for i, rec in enumerate(snap.islands):
        if rec.shard_index >= opts.islands:
            _fail(("islands", i, "shard_index"), f"{rec.shard_index}: must be below {opts.islands} shards")
        if rec.version > snap.version:
            _fail(("islands", i, "version"), f"{rec.version} is ahead of the state's version {snap.version}")
        if not NAME_RE.fullmatch(rec.name):
            _fail(("islands", i, "name"), f"{rec.name!r} is not a valid island name")
        if rec.island_id in ids:
            _fail(("islands", i, "island_id"), f"duplicate island_id {rec.island_id!r}")
        if rec.name in names:
            _fail(("islands", i, "name"), f"duplicate name {rec.name!r}")
        if rec.state == "live" and rec.shard_index in held:
            _fail(("islands", i, "shard_index"), f"shard {rec.shard_index} is held by two live islands")
        if rec.devices > rec.mesh_devices:
            _fail(("islands", i, "devices"), f"{rec.devices}: more than its mesh_devices {rec.mesh_devices}")
        if len(rec.quarantined) > rec.mesh_devices:
            _fail(("islands", i, "quarantined"), f"{len(rec.quarantined)} devices, more than its mesh_devices "
                  f"{rec.mesh_devices}")
        for j, ev in enumerate(rec.quarantined):
            if ev.index >= rec.mesh_devices:
                _fail(("islands", i, "quarantined", j, "index"), f"{ev.index}: outside its mesh of "
                      f"{rec.mesh_devices} devices")
            if any(e.device == ev.device for e in rec.quarantined[:j]):
                _fail(("islands", i, "quarantined", j, "device"), f"device {ev.device} is named twice")
        ids.add(rec.island_id)
        names.add(rec.name)
        if rec.state == "live":
            held.add(rec.shard_index)


def _check_pending(opts: StateOptions, snap: Snapshot, remembered: set[str]) -> None:
    islands = {rec.island_id for rec in snap.islands}
    ids = set(remembered)
    for i, p in enumerate(snap.pending):
        if p.admission.status != "accept":
            _fail(("pending", i, "admission", "status"), f"a pending push is 'accept', got {p.admission.status!r}")
        if p.admission.target_version != snap.version + 1:
            _fail(("pending", i, "admission", "target_version"), f"a pending push is for version "
                  f"{snap.version + 1}, got {p.admission.target_version}")
        if p.info.island_id not in islands:
            _fail(("pending", i, "info", "island_id"), f"unknown island {p.info.island_id!r}")
        if p.info.push_id in ids:
            _fail(("pending", i, "info", "push_id"), f"{p.info.push_id!r} is repeated")
        if p.info.shard_index >= opts.islands:
            _fail(("pending", i, "info", "shard_index"), f"{p.info.shard_index}: must be below {opts.islands} "
                  f"shards")
        ids.add(p.info.push_id)
