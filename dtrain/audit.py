"""The token-range audit and goodput of a run, reconstructed from its events (pure Python: no JAX, no I/O).

Inputs: the coordinator's events (``RUN_DIR/events.jsonl``) and each island's (``RUN_DIR/islands/NAME/
events.jsonl``, appended by every process that ran as that island). Units: data cursors count *sequences*
of ``model.seq_len`` tokens; a push covers sequences ``[start, end)`` of shard ``shard``.

Definitions:

- **Merged pushes.** Every push listed in a ``round_merged`` event (``pushes``: shard, start, end, steps,
  ...), in log order, except the superseded ones: a ``coordinator_resumed`` event with ``version`` V means
  the coordinator restarted from its checkpoint of version V, so θ was rolled back to V and every
  ``round_merged`` record logged before it with a version > V never reached the θ the run went on from (a
  coordinator killed after logging a merge but before checkpointing it). Those records do not count.
- **Shard end.** With step rounds (``worker.round_seconds == 0``) each shard has a fixed length,
  ``train.steps × train.batch_size`` sequences, and every shard ``0 .. outer.islands - 1`` must be covered
  over ``[0, shard_end)``. With wall-time rounds there is no fixed end: a shard is checked only over
  ``[0, its highest merged end)`` (a shard nothing was merged from is not checked).
- **Gaps** (lost data): the ranges of the checked span of a shard covered by no merged push.
  ``lost_tokens`` = sequences in gaps × ``model.seq_len``.
- **Overlaps** (doubled data): the ranges covered by two or more merged pushes, each with how many times
  (``times``, the most over the range). ``doubled_tokens`` counts every extra copy: Σ over sequences of
  (times merged − 1) × ``model.seq_len`` (a range merged three times counts twice).
- **Segments.** A shard may be trained as several segments at once (a lost island's data left split across
  islands: docs/faults.md); each merged push lies in one segment, and the checks above are per shard whatever
  the segments. ``segments``: per shard, the starts of the segments the coordinator handed out (its
  ``island_joined`` events' ``segment``), 0 alone for a shard that stayed one segment.
- **merged_ranges**: the number of merged pushes (one range each); ``merged_tokens``: their sequences ×
  ``model.seq_len``, every copy (a run's tokens merged: what its summary and closing line say).
  ``missing_versions``: versions up to the
  last one counted that no counted record describes (a coordinator killed between committing a version and
  logging it): their pushes are unknown to the audit, so its lost/doubled counts are not to be trusted then.
- **Sources** (a mixture, ``data.sources``): a shard's sequence ``c`` is a sequence of one source, given by the
  mixture's schedule (``dtrain.data.mixture``), so each merged range of a shard is one range of each source's part
  of that shard (``AuditParams.source_ranges``). Each source is audited as the shards are: its gaps and overlaps
  per shard over ``[0, its part of shard_end)``, with ``merged_tokens``, ``lost_tokens`` and ``doubled_tokens``
  per source (``sources`` in the summary; absent for a single store).
- **Goodput** = inner steps in merged pushes / inner steps executed by all island processes. A worker's
  ``trained`` events carry ``executed``, the steps this process has run so far; it restarts from 0 with a
  new process, so each island's event list is split into incarnations (at every ``island_started``, which
  each process logs before it trains, and wherever ``executed`` does not grow) and the last ``executed`` of
  each incarnation is what that process ran, including the steps of a push that was lost with it. Goodput
  is ``None`` when no step was executed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.config.sections import Config

Event = Mapping[str, Any]


class AuditError(ValueError):
    """The events cannot be audited (a merged push without its shard and cursor range, say)."""


@dataclass(frozen=True)
class AuditParams:
    seq_len: int  # tokens per sequence (model.seq_len)
    shards: int  # shards of the run (outer.islands)
    shard_end: int | None  # sequences per shard with step rounds; None with wall-time rounds
    sources: tuple[str, ...] = ()  # a mixture's sources, by name (data.sources); () for one store
    # a mixture: a shard's sequences [start, end) as each source's sequences [a, b) (dtrain.data.mixture.Schedule)
    source_ranges: Callable[[int, int], list[tuple[int, int]]] | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, cfg: Config) -> AuditParams:
        step_rounds = cfg.worker.round_seconds == 0
        return cls(seq_len=cfg.model.seq_len, shards=cfg.outer.islands,
                   shard_end=cfg.train.shard_sequences if step_rounds else None)


@dataclass(frozen=True)
class Span:
    """Sequences ``[start, end)`` of shard ``shard``; ``times``: how often they were merged (overlaps)."""

    shard: int
    start: int
    end: int
    times: int = 1

    @property
    def sequences(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, int]:
        d = {"shard": self.shard, "start": self.start, "end": self.end}
        return d if self.times == 1 else {**d, "times": self.times}


@dataclass(frozen=True)
class SourceAudit:
    """One source of a mixture, over every shard: its tokens merged, lost (gaps) and doubled (extra copies)."""

    merged_tokens: int
    lost_tokens: int
    doubled_tokens: int
    gaps: tuple[Span, ...]  # in the source's own sequences, per shard
    overlaps: tuple[Span, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"merged_tokens": self.merged_tokens, "lost_tokens": self.lost_tokens,
                "doubled_tokens": self.doubled_tokens, "gaps": [g.to_dict() for g in self.gaps],
                "overlaps": [o.to_dict() for o in self.overlaps]}


@dataclass(frozen=True)
class Audit:
    merged: dict[int, tuple[Span, ...]]  # per shard, every merged push's range, sorted by start
    gaps: tuple[Span, ...]
    overlaps: tuple[Span, ...]
    lost_tokens: int
    doubled_tokens: int
    merged_ranges: int
    merged_tokens: int  # every merged push's sequences x seq_len (doubled ones as often as merged)
    superseded: int  # round_merged records rolled back by a coordinator resume
    missing_versions: tuple[int, ...]  # versions below the last one counted that have no round_merged record
    shard_end: int | None
    steps_merged: int
    steps_executed: int
    goodput: float | None
    segments: dict[int, tuple[int, ...]]  # per shard, the starts of the segments handed out (0 alone: never split)
    sources: dict[str, SourceAudit] = field(default_factory=dict)  # a mixture: per source, by name

    def coverage(self) -> dict[int, list[tuple[int, int]]]:
        """Per shard, the merged ranges joined where they touch or overlap."""
        out: dict[int, list[tuple[int, int]]] = {}
        for shard, spans in sorted(self.merged.items()):
            joined: list[tuple[int, int]] = []
            for s in spans:
                if joined and s.start <= joined[-1][1]:
                    joined[-1] = (joined[-1][0], max(joined[-1][1], s.end))
                else:
                    joined.append((s.start, s.end))
            out[shard] = joined
        return out

    def to_dict(self) -> dict[str, Any]:
        """For ``summary.json``: the counts, the gaps and overlaps, and each shard's joined coverage."""
        return {"lost_tokens": self.lost_tokens, "doubled_tokens": self.doubled_tokens,
                "merged_ranges": self.merged_ranges, "merged_tokens": self.merged_tokens,
                "gaps": [g.to_dict() for g in self.gaps],
                "overlaps": [o.to_dict() for o in self.overlaps], "shard_end": self.shard_end,
                "superseded_merges": self.superseded, "missing_versions": list(self.missing_versions),
                "steps_merged": self.steps_merged,
                "steps_executed": self.steps_executed,
                "segments": {str(k): list(v) for k, v in sorted(self.segments.items())},
                "coverage": {str(k): [list(r) for r in v] for k, v in self.coverage().items()},
                **({"sources": {k: v.to_dict() for k, v in self.sources.items()}} if self.sources else {})}


def merged_pushes(coordinator_events: Iterable[Event]) -> tuple[list[Event], int, tuple[int, ...]]:
    """The pushes of every ``round_merged`` record that still counts, in log order; how many records a
    coordinator resume superseded; and the versions up to the last counted one that no record covers."""
    records: list[Event] = []
    superseded = 0
    for e in coordinator_events:
        if e.get("event") == "round_merged":
            records.append(e)
        elif e.get("event") == "coordinator_resumed":
            restored = int(e["version"])
            kept = [r for r in records if int(r["version"]) <= restored]
            superseded += len(records) - len(kept)
            records = kept
    pushes: list[Event] = []
    for r in records:
        if "pushes" not in r:
            raise AuditError(f"round_merged for version {r.get('version')} lists no pushes: these events "
                             "cannot be audited (in-process simulations have no per-push ranges)")
        for p in r["pushes"]:
            absent = [k for k in ("shard", "start", "end", "steps") if k not in p]
            if absent:
                raise AuditError(f"version {r['version']}: push {p.get('push_id')} has no {', '.join(absent)}")
            pushes.append(p)
    versions = {int(r["version"]) for r in records}
    missing = tuple(v for v in range(1, max(versions, default=0) + 1) if v not in versions)
    return pushes, superseded, missing


def executed_steps(island_events: Iterable[Event]) -> int:
    """Inner steps run by every process of one island: the sum over its incarnations of the last
    ``executed`` each reported."""
    total = last = 0
    for e in island_events:
        kind = e.get("event")
        if kind == "island_started":
            total, last = total + last, 0
        elif kind == "trained":
            executed = int(e["executed"])
            if executed <= last:  # a new process whose island_started line is missing
                total += last
            last = executed
    return total + last


def _sweep(shard: int, spans: Sequence[Span], limit: int | None) -> tuple[list[Span], list[Span], int]:
    """One shard's gaps over ``[0, limit)``, its overlaps (anywhere) and its extra copies: Σ over sequences of
    (times merged − 1) where merged twice or more."""
    delta: dict[int, int] = {}
    for s in spans:
        delta[s.start] = delta.get(s.start, 0) + 1
        delta[s.end] = delta.get(s.end, 0) - 1
    points = sorted({0, *delta, *([limit] if limit is not None else [])})
    gaps: list[Span] = []
    overlaps: list[Span] = []
    extra = depth = 0
    for a, b in itertools.pairwise(points):
        depth += delta.get(a, 0)
        if depth == 0 and limit is not None and a < limit:
            if gaps and gaps[-1].end == a:
                gaps[-1] = Span(shard, gaps[-1].start, b)
            else:
                gaps.append(Span(shard, a, b))
        elif depth >= 2:
            extra += (depth - 1) * (b - a)
            if overlaps and overlaps[-1].end == a:
                overlaps[-1] = Span(shard, overlaps[-1].start, b, max(overlaps[-1].times, depth))
            else:
                overlaps.append(Span(shard, a, b, depth))
    return gaps, overlaps, extra


def audit(coordinator_events: Iterable[Event], island_events: Mapping[str, Iterable[Event]],
          params: AuditParams) -> Audit:
    """The token-range audit and goodput of one run (definitions: the module docstring)."""
    coordinator_events = list(coordinator_events)
    pushes, superseded, missing = merged_pushes(coordinator_events)
    segments: dict[int, set[int]] = {}
    for e in coordinator_events:
        if e.get("event") == "island_joined" and "segment" in e:
            segments.setdefault(int(e["shard"]), {0}).add(int(e["segment"][0]))
    by_shard: dict[int, list[Span]] = {}
    for p in pushes:
        start, end = int(p["start"]), int(p["end"])
        if end < start:
            raise AuditError(f"push {p.get('push_id')}: cursor range [{start}, {end}) ends before it starts")
        if end > start:
            by_shard.setdefault(int(p["shard"]), []).append(Span(int(p["shard"]), start, end))
    shards = set(by_shard) | (set(range(params.shards)) if params.shard_end is not None else set())
    gaps: list[Span] = []
    overlaps: list[Span] = []
    doubled = 0
    for shard in sorted(shards):
        spans = sorted(by_shard.get(shard, []), key=lambda s: (s.start, s.end))
        # Step rounds: every shard over its fixed length. Wall-time rounds: a shard up to its highest merged end.
        limit = params.shard_end if params.shard_end is not None else max(s.end for s in spans)
        g, o, extra = _sweep(shard, spans, limit)
        gaps += g
        overlaps += o
        doubled += extra
    sources = _source_audits(by_shard, shards, params)
    steps_merged = sum(int(p["steps"]) for p in pushes)
    steps_executed = sum(executed_steps(events) for events in island_events.values())
    return Audit(merged={k: tuple(sorted(v, key=lambda s: (s.start, s.end))) for k, v in sorted(by_shard.items())},
                 gaps=tuple(gaps), overlaps=tuple(overlaps),
                 lost_tokens=sum(g.sequences for g in gaps) * params.seq_len,
                 doubled_tokens=doubled * params.seq_len, merged_ranges=len(pushes),
                 merged_tokens=sum(s.sequences for spans in by_shard.values() for s in spans) * params.seq_len,
                 superseded=superseded,
                 missing_versions=missing, shard_end=params.shard_end, steps_merged=steps_merged,
                 steps_executed=steps_executed,
                 goodput=steps_merged / steps_executed if steps_executed else None,
                 segments={k: tuple(sorted(v)) for k, v in sorted(segments.items())}, sources=sources)


def _source_audits(by_shard: Mapping[int, Sequence[Span]], shards: Iterable[int], params: AuditParams
                   ) -> dict[str, SourceAudit]:
    """A mixture's audit per source: each shard's merged ranges as each source's ranges, swept as a shard's are
    (over the source's part of ``shard_end``, or up to its highest merged end with wall-time rounds)."""
    to_source = params.source_ranges
    if not params.sources or to_source is None:
        return {}
    merged = [0] * len(params.sources)
    gaps: list[list[Span]] = [[] for _ in params.sources]
    overlaps: list[list[Span]] = [[] for _ in params.sources]
    extra = [0] * len(params.sources)
    for shard in sorted(shards):
        mapped = [to_source(s.start, s.end) for s in by_shard.get(shard, [])]
        ends = to_source(0, params.shard_end) if params.shard_end is not None else None
        for k in range(len(params.sources)):
            spans = sorted((Span(shard, m[k][0], m[k][1]) for m in mapped if m[k][1] > m[k][0]),
                           key=lambda s: (s.start, s.end))
            merged[k] += sum(s.sequences for s in spans)
            limit = ends[k][1] if ends is not None else max((s.end for s in spans), default=0)
            g, o, x = _sweep(shard, spans, limit)
            gaps[k] += g
            overlaps[k] += o
            extra[k] += x
    n = params.seq_len
    return {name: SourceAudit(merged[k] * n, sum(g.sequences for g in gaps[k]) * n, extra[k] * n,
                              tuple(gaps[k]), tuple(overlaps[k])) for k, name in enumerate(params.sources)}
