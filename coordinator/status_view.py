"""The Status document: the run as the Status RPC answers it and the dashboard shows it.

Owns the service's own counters (:class:`Counters`: bytes, merge time, refused pushes) and the building of the
``StatusResponse`` message from them, the state machine's record and the run's history
(:func:`status_response`). Pure: the caller holds the service's lock.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from coordinator.history import RunHistory
from coordinator.records import DeviceEvidence, IslandRecord, StateOptions
from coordinator.state import CoordinatorState
from dtrain.data.mixture import schedule_of
from dtrain.net.proto import dtrain_pb2 as pb

# The quarantined devices' evidence Status carries per island (the first ones, in the order reported): an island may
# report up to min(its mesh, MAX_EVIDENCE) devices of up to 512-character details, which would make Status megabytes
# whatever the edge allows each field; the full record is the island's device_quarantined events.
MAX_STATUS_EVIDENCE = 64

@dataclasses.dataclass
class Counters:
    """What the service counts beside the state machine's record, reported by Status and the run's summary."""

    bytes_in: int = 0  # frame bytes received in pushes
    bytes_out: int = 0  # frame bytes sent in pulls
    merge_s: float = 0.0  # seconds spent in outer steps and their checkpoints
    # Pushes refused: by the state machine (bad header, a weight over its bound, ...) or for a bad payload.
    pushes_refused: int = 0
    # Refused calls by kind, counted in full however few are logged (coordinator/refusals.py): "METHOD: CODE", "auth".
    refusals: Counter[str] = dataclasses.field(default_factory=Counter)
    islands_forgotten: int = 0  # lost islands' records dropped (coordinator.forget_after_s), since this start


def source_tokens(state: CoordinatorState, opts: StateOptions) -> dict[str, int]:
    """A mixture's tokens merged per source, by name: every segment's merged cursor range, as each source's
    sequences (``dtrain.data.mixture.Schedule.ranges``), times ``model.seq_len``. Empty for one store."""
    if not opts.sources:
        return {}
    schedule = schedule_of(opts.source_weights)
    sequences = [0] * len(opts.sources)
    for seg in state.ledger.segments.values():
        for k, (a, b) in enumerate(schedule.ranges(seg.start, seg.merged)):
            sequences[k] += b - a
    return {name: n * opts.seq_len for name, n in zip(opts.sources, sequences, strict=True)}


def evidence_to_message(e: DeviceEvidence) -> pb.DeviceEvidence:
    """A recorded device's evidence for Status: numbers the probe did not measure stay unset."""
    return pb.DeviceEvidence(**{k: v for k, v in dataclasses.asdict(e).items() if v is not None})


def island_status(state: CoordinatorState, history: RunHistory, islands: int, r: IslandRecord,
                  now: float) -> pb.IslandStatus:
    """One island's row: the state's record of it and what the history saw of it (``islands``: shards)."""
    view = history.island(r.island_id)
    return pb.IslandStatus(
        island_id=r.island_id, name=r.name, state=r.state, version=r.version,
        tokens_merged=r.tokens_merged, pushes_merged=r.pushes_merged,
        lease_left_s=max(0.0, r.lease_expiry - now) if r.state == "live" else 0.0,
        steps_per_s=r.steps_per_s, tokens_per_s=r.tokens_per_s, shard_index=r.shard_index, devices=r.devices,
        quarantined=[evidence_to_message(e) for e in r.quarantined[:MAX_STATUS_EVIDENCE]], hardware=r.hardware,
        device_kind=view.device_kind, steps=r.steps, tokens=r.tokens_reported,
        train_loss=view.train_loss, utilization=view.utilization, params_digest=r.params_digest,
        cursor=state.segment_cursor(state.segment(r)) if r.shard_index < islands else 0,
        segment_start=r.segment_start, segment_end=state.segment(r).end if r.shard_index < islands else 0,
        bytes_in=view.bytes_in, bytes_out=view.bytes_out,
        last_seen_s=max(0.0, now - view.last_seen) if view.last_seen else 0.0)


def status_response(state: CoordinatorState, history: RunHistory, opts: StateOptions, counters: Counters, *,
                    run_id: str, params_digest: str, started_at: float, now: float) -> pb.StatusResponse:
    """The run's status at ``now``: what the Status RPC answers and the dashboard shows (as JSON:
    :func:`dtrain.status_doc.message_dict`). ``params_digest``: the merger's θ's; ``started_at``: the service's
    start."""
    st = state.status(now)
    h = history
    islands = [island_status(state, h, opts.islands, r, now)
               for r in sorted(state.islands.values(), key=lambda r: (r.shard_index, r.island_id))]
    rnd = st["round"]
    deadline = st["next_deadline"]
    return pb.StatusResponse(
        run_id=run_id, version=state.version, mode=opts.coordinator.mode, islands=islands,
        tokens_merged=state.tokens_merged, bytes_in=counters.bytes_in, bytes_out=counters.bytes_out,
        deltas_dropped=state.deltas_dropped, total_versions=opts.end_version,
        tokens_total=opts.tokens_total,
        stopped=st["stopped"], run_over=st["run_over"], deltas_merged=state.deltas_merged,
        deltas_rejected=state.deltas_rejected, duplicates=state.duplicates,
        pushes_refused=counters.pushes_refused, refusals=dict(counters.refusals),
        islands_forgotten=counters.islands_forgotten, round_seconds=state.round_seconds,
        shard_cursors=st["shard_cursors"],
        round=pb.OpenRound(target_version=rnd["target_version"], ready=rnd["ready"], reason=rnd["reason"],
                           pending=len(rnd["pending"]),
                           deadline_s=None if deadline is None else max(0.0, deadline - now)),
        merge_s=counters.merge_s, params_digest=params_digest, started_at=started_at, now=now,
        eval_loss=h.evals[-1].loss if h.evals else None, eval_confirmed=bool(h.evals) and h.evals[-1].confirmed,
        rounds=h.rounds, evals=h.evals, faults=h.faults, source_tokens=source_tokens(state, opts))
