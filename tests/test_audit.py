"""The token-range audit and goodput (dtrain/audit.py) on synthetic event lists."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.audit import AuditError, AuditParams, Span, audit, executed_steps
from dtrain.config.load import load_config

SEQ = 64  # tokens per sequence
STEP_ROUNDS = AuditParams(seq_len=SEQ, shards=2, shard_end=40)  # 2 shards of 40 sequences
WALL_ROUNDS = AuditParams(seq_len=SEQ, shards=2, shard_end=None)


def push(shard: int, start: int, end: int, steps: int | None = None, island: str = "") -> dict[str, Any]:
    return {"island": island or f"island-{shard}", "push_id": f"{shard}-{start}", "shard": shard, "start": start,
            "end": end, "steps": (end - start) // 4 if steps is None else steps, "tokens": (end - start) * SEQ}


def merged(version: int, *pushes: dict[str, Any]) -> dict[str, Any]:
    return {"event": "round_merged", "version": version, "pushes": list(pushes)}


def clean_run() -> list[dict[str, Any]]:
    """2 shards of 40 sequences in 2 rounds of 20 (batch 4: 5 steps a push)."""
    return [merged(1, push(0, 0, 20), push(1, 0, 20)), merged(2, push(0, 20, 40), push(1, 20, 40))]


def trained(*executed: int, started: bool = True) -> list[dict[str, Any]]:
    return ([{"event": "island_started"}] if started else []) + [{"event": "trained", "executed": x} for x in executed]


def test_a_clean_run_has_no_gap_no_overlap_and_full_goodput() -> None:
    a = audit(clean_run(), {"island-0": trained(5, 10), "island-1": trained(5, 10)}, STEP_ROUNDS)
    assert (a.gaps, a.overlaps, a.lost_tokens, a.doubled_tokens) == ((), (), 0, 0)
    assert a.merged_ranges == 4 and a.superseded == 0 and a.missing_versions == ()
    assert a.merged_tokens == 2 * 40 * SEQ and a.to_dict()["merged_tokens"] == a.merged_tokens
    assert a.merged[0] == (Span(0, 0, 20), Span(0, 20, 40))
    assert (a.steps_merged, a.steps_executed, a.goodput) == (20, 20, 1.0)
    d = a.to_dict()
    assert d["coverage"] == {"0": [[0, 40]], "1": [[0, 40]]} and d["shard_end"] == 40
    assert {"lost_tokens", "doubled_tokens", "merged_ranges", "gaps", "overlaps", "shard_end"} <= d.keys()


def test_a_dropped_range_is_a_gap_and_its_compute_is_lost() -> None:
    events = [merged(1, push(0, 0, 20), push(1, 0, 20)),
              merged(2, push(0, 20, 40), push(1, 28, 40))]  # shard 1's [20, 28) was never merged
    a = audit(events, {"island-0": trained(5, 10), "island-1": trained(5, 10)}, STEP_ROUNDS)
    assert a.gaps == (Span(1, 20, 28),) and a.lost_tokens == 8 * SEQ
    assert a.overlaps == () and a.doubled_tokens == 0
    assert a.to_dict()["gaps"] == [{"shard": 1, "start": 20, "end": 28}]
    assert a.goodput == pytest.approx(18 / 20)


def test_a_shard_nothing_was_merged_from_is_lost_whole_with_step_rounds() -> None:
    events = [merged(1, push(0, 0, 40))]
    a = audit(events, {}, STEP_ROUNDS)
    assert a.gaps == (Span(1, 0, 40),) and a.lost_tokens == 40 * SEQ
    assert a.goodput is None  # no trained events: nothing executed


def test_a_range_merged_twice_is_an_overlap() -> None:
    events = clean_run() + [merged(3, push(0, 10, 30))]  # [10, 30) of shard 0 again
    a = audit(events, {}, STEP_ROUNDS)
    assert a.overlaps == (Span(0, 10, 30, times=2),) and a.doubled_tokens == 20 * SEQ
    assert a.merged_tokens == (2 * 40 + 20) * SEQ  # every copy merged
    assert a.gaps == () and a.lost_tokens == 0
    # three copies of [10, 20): counted twice
    a3 = audit(events + [merged(4, push(0, 10, 20))], {}, STEP_ROUNDS)
    assert a3.doubled_tokens == (20 + 10) * SEQ
    assert a3.overlaps == (Span(0, 10, 30, times=3),)


def test_merges_a_coordinator_resume_rolled_back_do_not_count() -> None:
    # The coordinator merged v2 and v3, was killed before checkpointing them, resumed at v1; the islands pushed
    # their ranges again and v2, v3 were merged a second time. Counted naively, [20, 40) is doubled.
    events = [merged(1, push(0, 0, 20), push(1, 0, 20)),
              merged(2, push(0, 20, 30), push(1, 20, 30)),
              merged(3, push(0, 30, 40)),
              {"event": "coordinator_resumed", "version": 1},
              merged(2, push(0, 20, 40), push(1, 20, 40))]
    a = audit(events, {}, STEP_ROUNDS)
    assert a.superseded == 2 and a.merged_ranges == 4
    assert (a.lost_tokens, a.doubled_tokens, a.missing_versions) == (0, 0, ())
    # Without the resume event the same merges are doubles: the rule is what removes them.
    naive = audit([e for e in events if e["event"] != "coordinator_resumed"], {}, STEP_ROUNDS)
    assert naive.doubled_tokens == 30 * SEQ


def test_a_resume_past_the_last_logged_version_is_reported_as_missing() -> None:
    events = [merged(1, push(0, 0, 20), push(1, 0, 20)), {"event": "coordinator_resumed", "version": 2},
              merged(3, push(0, 30, 40))]
    a = audit(events, {}, STEP_ROUNDS)
    assert a.missing_versions == (2,)


def test_goodput_sums_the_last_executed_of_every_incarnation() -> None:
    # island-1: a process ran 30 steps and was killed; the restart ran 10 more (executed restarts from 0).
    island_1 = trained(10, 20, 30) + trained(5, 10)
    assert executed_steps(island_1) == 40
    # A restart whose island_started line is missing is still split where `executed` stops growing.
    assert executed_steps(trained(10, 20, 30) + trained(10, 20, started=False)) == 50
    assert executed_steps([]) == 0
    a = audit(clean_run(), {"island-0": trained(10, 20), "island-1": island_1}, STEP_ROUNDS)
    assert (a.steps_merged, a.steps_executed) == (20, 60)
    assert a.goodput == pytest.approx(20 / 60)


def test_wall_time_rounds_check_each_shard_below_its_highest_merged_end() -> None:
    events = [merged(1, push(0, 0, 17), push(1, 0, 9)), merged(2, push(0, 17, 33), push(1, 12, 20))]
    a = audit(events, {}, WALL_ROUNDS)
    assert a.shard_end is None
    assert a.gaps == (Span(1, 9, 12),) and a.lost_tokens == 3 * SEQ  # nothing past 33 / 20 counts
    assert audit(events[:1], {}, WALL_ROUNDS).gaps == ()


def test_params_from_config_and_unauditable_events() -> None:
    cfg = load_config("tiny", ["outer.islands=3"])
    p = AuditParams.from_config(cfg)
    assert p == AuditParams(seq_len=cfg.model.seq_len, shards=3, shard_end=cfg.train.steps * cfg.train.batch_size)
    assert AuditParams.from_config(load_config("tiny", ["worker.round_seconds=2"])).shard_end is None
    with pytest.raises(AuditError, match="lists no pushes"):
        audit([{"event": "round_merged", "version": 1}], {}, STEP_ROUNDS)
    with pytest.raises(AuditError, match="has no start, end"):
        audit([merged(1, {"push_id": "x", "shard": 0, "steps": 1})], {}, STEP_ROUNDS)
