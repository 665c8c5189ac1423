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
    Segment,
    StateError,
    StateOptions,
)
from dtrain import schema

Format = Literal[2]  # to_json layout version: 2 has segments (1, one cursor per shard, is converted on load)
FORMAT: Format = 2


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
    segments: list[Segment]  # every shard's segments, by shard then start (coordinator.ledger)
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
    if isinstance(blob, dict) and type(blob.get("format")) is int and blob["format"] == 1:
        blob = _from_format_1(opts, blob)
    if isinstance(blob, dict) and not (type(blob.get("format")) is int and blob["format"] == FORMAT):
        _fail(("format",), f"{blob.get('format')!r}: this coordinator reads checkpoint formats 1 and {FORMAT} "
              f"(written by another version of dtrain?)")
    try:
        snap = schema.load(Snapshot, blob)  # every field's type and range
    except schema.SchemaError as e:
        _fail(e.path, e.why)
    if snap.shards != opts.islands:
        _fail(("shards",), f"checkpoint has {snap.shards} shards, the config has {opts.islands} islands")
    _check_segments(opts, snap)
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


def _from_format_1(opts: StateOptions, blob: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint (one cursor per shard: each shard one segment) in format 2's layout; its values are
    checked by :func:`load` as any other."""
    cursors = blob.get("shard_cursors")
    if not isinstance(cursors, list):
        _fail(("shard_cursors",), "format 1: must be a list of one cursor per shard")
    if len(cursors) != opts.islands:
        _fail(("shard_cursors",), f"format 1: expected {opts.islands} entries, got {len(cursors)}")
    out = {k: v for k, v in blob.items() if k != "shard_cursors"}
    out["format"] = FORMAT
    if isinstance(out.get("islands"), list):  # each holds its shard's one segment
        out["islands"] = [{"segment_start": 0, **r} if isinstance(r, dict) else r for r in out["islands"]]
    out["segments"] = [{"shard": s, "start": 0, "end": opts.shard_end, "merged": c} for s, c in enumerate(cursors)]
    return out


def _check_segments(opts: StateOptions, snap: Snapshot) -> None:
    """Each shard's segments, by start, cover it without gap or overlap from 0 to its end (step rounds), each
    with its merged cursor inside it; with wall-time rounds each shard is one segment with no end."""
    keys = [(seg.shard, seg.start) for seg in snap.segments]
    if keys != sorted(set(keys)):
        _fail(("segments",), "must be sorted by shard, then start, each (shard, start) once")
    shard_end = opts.shard_end
    at = {s: 0 for s in range(opts.islands)}  # where each shard's next segment must start
    for i, seg in enumerate(snap.segments):
        if seg.shard >= opts.islands:
            _fail(("segments", i, "shard"), f"{seg.shard}: must be below {opts.islands} shards")
        if seg.start != at[seg.shard]:
            _fail(("segments", i, "start"), f"{seg.start}: shard {seg.shard}'s segments must be contiguous from 0 "
                  f"(this one should start at {at[seg.shard]})")
        if not shard_end:
            if seg.start or seg.end:
                _fail(("segments", i), f"wall-time rounds: shard {seg.shard} is one segment [0, 0) (no end), got "
                      f"[{seg.start}, {seg.end})")
        elif not seg.start < seg.end <= shard_end:
            _fail(("segments", i, "end"), f"{seg.end}: must be after its start {seg.start} and at most the shard's "
                  f"end, {shard_end} sequences")
        if seg.merged < seg.start or (shard_end and seg.merged > seg.end):
            _fail(("segments", i, "merged"), f"{seg.merged}: must lie in the segment [{seg.start}, {seg.end}]")
        at[seg.shard] = seg.end if shard_end else 1
    short = [s for s, end in at.items() if end != (shard_end or 1)]
    if short:
        _fail(("segments",), f"shard {short[0]}'s segments end at {at[short[0]]}, not at the shard's end "
              f"{shard_end}")


def _check_islands(opts: StateOptions, snap: Snapshot) -> None:
    ids: set[str] = set()
    names: set[str] = set()
    held: set[tuple[int, int]] = set()  # segments of live islands
    starts = {(seg.shard, seg.start) for seg in snap.segments}
    for i, rec in enumerate(snap.islands):
        if rec.shard_index >= opts.islands:
            _fail(("islands", i, "shard_index"), f"{rec.shard_index}: must be below {opts.islands} shards")
        if (rec.shard_index, rec.segment_start) not in starts:
            _fail(("islands", i, "segment_start"), f"{rec.segment_start}: shard {rec.shard_index} has no segment "
                  f"starting there")
        if rec.version > snap.version:
            _fail(("islands", i, "version"), f"{rec.version} is ahead of the state's version {snap.version}")
        if not NAME_RE.fullmatch(rec.name):
            _fail(("islands", i, "name"), f"{rec.name!r} is not a valid island name")
        if rec.island_id in ids:
            _fail(("islands", i, "island_id"), f"duplicate island_id {rec.island_id!r}")
        if rec.name in names:
            _fail(("islands", i, "name"), f"duplicate name {rec.name!r}")
        if rec.state == "live" and (rec.shard_index, rec.segment_start) in held:
            _fail(("islands", i, "segment_start"), f"shard {rec.shard_index}'s segment at {rec.segment_start} is "
                  f"held by two live islands")
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
            held.add((rec.shard_index, rec.segment_start))


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
        seg = next((g for g in snap.segments if g.shard == p.info.shard_index and g.start <= p.info.cursor_start
                    and (not g.end or p.info.cursor_end <= g.end)), None)
        if seg is None:
            _fail(("pending", i, "info"), f"range [{p.info.cursor_start}, {p.info.cursor_end}) of shard "
                  f"{p.info.shard_index} lies in no one segment")
        ids.add(p.info.push_id)
