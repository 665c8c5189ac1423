"""Segments: a lost island's data left split across the islands whose own data is done (coordinator.ledger,
coordinator.membership, coordinator.admission), checkpointed (coordinator.snapshot), and the island's planner
stopping at its segment's end (workers.rounds). An injected clock; helpers from state_helpers.py. The same with
real processes: tests/test_faults_runs.py::test_a_lost_islands_shard_is_split_and_a_lost_piece_taken_over."""

from __future__ import annotations

import copy
import json

from coordinator.records import Segment
from coordinator.state import CoordinatorState
from state_helpers import T0, info, join_all, make, push, unchanged
from workers.recovery import in_segment
from workers.rounds import Kind, RoundProgress, Schedule, next_action

ROUND = 160  # tiny: inner_steps 20 x batch_size 8 sequences


def _rounds(st: CoordinatorState, ids: list[str], now: float) -> None:
    """One round: each island of ``ids`` pushes one round from its segment's cursor; the round closes."""
    for i in ids:
        push(st, info(st, i, base=st.version, length=ROUND), now)
    st.close_round(now)


def _lose(st: CoordinatorState, lost: str, now: float) -> float:
    """Every island but ``lost`` heartbeats; ``lost``'s lease runs out. Returns the time after."""
    for r in st.live():
        if r.island_id != lost:
            st.heartbeat(r.island_id, st.version, 0, 0, 0.0, "", (), now + 10)
    assert [i for i, _ in st.expire(now + 15)] == [lost]
    return now + 16


def _take(st: CoordinatorState, island: str, now: float) -> tuple[tuple[int, int], str]:
    """``island``'s data is done: its heartbeat says rejoin and its Join moves it; its (shard, start) and why."""
    action, reason = st.heartbeat(island, st.version, 0, 0, 0.0, "", (), now)
    assert action == "rejoin", reason
    record, why = st.join(st.islands[island].name, "cpu", 1, now)
    return (record.shard_index, record.segment_start), why


def _segments(st: CoordinatorState, shard: int) -> list[tuple[int, int, int]]:
    return [(s.start, s.end, st.segment_cursor(s)) for s in st.ledger.of_shard(shard)]


def _lost_after_one_round(steps: int) -> tuple[CoordinatorState, list[str], float]:
    """4 islands, shards of ``steps`` inner steps; d lost after round 1; a, b, c train their own shards to the end."""
    st = make(f"train.steps={steps}")
    a, b, c, d = join_all(st)
    _rounds(st, [a, b, c, d], T0)
    now = _lose(st, d, T0)
    while st.data_left(0):
        _rounds(st, [a, b, c], now)
    assert not st.stopped() and _segments(st, 3) == [(0, steps * 8, ROUND)]
    return st, [a, b, c, d], now


def test_a_lost_islands_data_left_is_split_in_whole_rounds_one_piece_per_live_island():
    """d's shard has 4 rounds left: a (the first out of data) splits it in 3 pieces (2, 1, 1 rounds) and keeps
    the first, which goes on from d's cursor; b and c take the others whole; the run ends 2 rounds later, with
    every segment's data merged once."""
    st, (a, b, c, d), now = _lost_after_one_round(100)  # 800 sequences a shard
    action, reason = st.heartbeat(a, st.version, 0, 0, 0.0, "", (), now)
    assert action == "rejoin" and "shard 0 is done and shard 3 has data no live island trains (from cursor 160)" \
        in reason
    key, why = _take(st, a, now)
    assert key == (3, 0) and "took over shard 3 of lost island d" in why
    assert "split for 3 live islands into shard 3 [0, 480) (this island's) and [480, 640), [640, 800)" in why
    assert why.endswith("cursor 160")
    assert _segments(st, 3) == [(0, 480, 160), (480, 640, 480), (640, 800, 640)]
    push(st, info(st, a, base=st.version, length=ROUND), now)
    ready, why = st.round_ready(now)  # b and c are out of data, but a piece waits for each: the round waits too
    assert not ready and "missing: b, c" in why, why
    assert _take(st, b, now) == ((3, 480), "rejoined as b-1 (was live): its shard 1 is done; took over shard 3 "
                                           "[480, 640), which no live island holds and has data left, cursor 480")
    key, why = _take(st, c, now)
    assert key == (3, 640) and "split" not in why  # a piece is taken whole
    _rounds(st, [b, c], now)
    assert not st.stopped() and _segments(st, 3) == [(0, 480, 320), (480, 640, 640), (640, 800, 800)]
    ready, _ = st.round_ready(now)
    assert not ready  # a has data left: b and c, whose pieces are done, are not waited for
    assert st.heartbeat(b, st.version, 0, 0, 0.0, "", (), now)[0] == "continue"  # nothing left to take
    _rounds(st, [a], now)
    assert st.stopped() and st.version == 7 and "all 4 shards' data" in st.run_over()  # 5 rounds + 2 for d's
    assert st.tokens_merged == 20 * 1000  # 20 pushes of 1000 tokens: 4 shards x 5 rounds, each merged once
    assert [st.shard_cursor(s) for s in range(4)] == [800] * 4


def test_a_push_past_its_segments_end_is_refused_and_one_in_another_segment_dropped():
    """Hostile input: b holds [480, 640); a range from inside it running past 640 is refused (INVALID_ARGUMENT,
    naming the segment) and changes nothing; a's push into c's segment is dropped with the reason, and c's
    cursor does not move."""
    st, (a, b, c, _), now = _lost_after_one_round(100)
    for island in (a, b, c):
        _take(st, island, now)
    unchanged(st, lambda: st.admit_push(info(st, b, base=st.version, start=560, end=700), now), "INVALID_ARGUMENT",
              "[560, 700) runs past the end of the segment it starts in, shard 3 [480, 640)")
    unchanged(st, lambda: st.commit_push(info(st, b, base=st.version, start=600, end=660), now),
              "INVALID_ARGUMENT", "shard 3 [480, 640)")
    adm = push(st, info(st, a, base=st.version, start=640, end=700), now)
    assert adm.status == "drop" and "covers shard 3 [640, 800), but a now holds shard 3 [0, 480)" in adm.reason
    assert _segments(st, 3)[2] == (640, 800, 640) and not st.pending()
    adm = push(st, info(st, c, base=st.version, start=680, end=720), now)  # a gap in its own segment
    assert adm.status == "drop" and "shard 3 [640, 800)'s cursor 640" in adm.reason


def test_a_lost_piece_is_taken_over_and_split_again():
    """d's 6 rounds left go in 3 pieces of 2; b is lost holding its piece [480, 800) after one round of it: c,
    once its own piece is done, takes b's data left over from b's cursor and splits it with a (one round each)."""
    st, (a, b, c, d), now = _lost_after_one_round(140)  # 1120 sequences a shard
    for island in (a, b, c):
        _take(st, island, now)
    assert _segments(st, 3) == [(0, 480, 160), (480, 800, 480), (800, 1120, 800)]
    _rounds(st, [a, b, c], now)
    now = _lose(st, b, now)  # mid-segment: [640, 800) of its piece untrained
    assert _segments(st, 3)[1] == (480, 800, 640)
    _rounds(st, [a, c], now)  # a: [320, 480), c: [960, 1120): both pieces done
    key, why = _take(st, c, now)
    assert key == (3, 480) and "of lost island b" in why and why.endswith("cursor 640")
    # 1 round left in b's piece: nothing to split; a takes nothing
    assert "split" not in why and st.heartbeat(a, st.version, 0, 0, 0.0, "", (), now)[0] == "continue"
    _rounds(st, [c], now)
    assert st.stopped() and [st.shard_cursor(s) for s in range(4)] == [1120] * 4


def test_a_lost_piece_with_rounds_left_is_split_again():
    """b is lost before training its piece (2 rounds): c takes it and splits it with a, one round each."""
    st, (a, b, c, d), now = _lost_after_one_round(140)
    for island in (a, b, c):
        _take(st, island, now)
    now = _lose(st, b, now)
    _rounds(st, [a, c], now)
    _rounds(st, [a, c], now)  # a's and c's pieces done
    key, why = _take(st, c, now)
    assert key == (3, 480) and "split for 2 live islands into shard 3 [480, 640) (this island's) and [640, 800)" \
        in why
    assert _take(st, a, now)[0] == (3, 640)
    _rounds(st, [a, c], now)
    assert st.stopped() and [st.shard_cursor(s) for s in range(4)] == [1120] * 4


def test_a_new_island_takes_a_lost_islands_segment_whole():
    """A newcomer (or the lost island back) takes a free segment whole: only an island whose own data is done
    splits a lost island's."""
    st = make("train.steps=100")
    a, b, c, d = join_all(st)
    now = _lose(st, d, T0)
    record, why = st.join("e", "cpu", 1, now)
    assert (record.shard_index, record.segment_start) == (3, 0) and "split" not in why
    assert _segments(st, 3) == [(0, 800, 0)]


def test_segments_round_trip_through_the_checkpoint_and_format_1_still_loads():
    st, (a, b, c, _), now = _lost_after_one_round(100)
    for island in (a, b, c):
        _take(st, island, now)
    push(st, info(st, b, base=st.version, length=ROUND), now)  # pending in [480, 640)
    blob = json.loads(json.dumps(st.to_json()))
    assert blob["format"] == 2 and blob["segments"][3:] == [
        {"shard": 3, "start": 0, "end": 480, "merged": 160}, {"shard": 3, "start": 480, "end": 640, "merged": 480},
        {"shard": 3, "start": 640, "end": 800, "merged": 640}]
    same = CoordinatorState.from_json(st.opts, blob, now)
    assert same.to_json()["segments"] == blob["segments"] and _segments(same, 3) == _segments(st, 3)
    assert (same.islands[b].shard_index, same.islands[b].segment_start) == (3, 480)
    # a checkpoint of format 1 (one cursor per shard, islands without segment_start) loads as one segment a shard
    old = make("train.steps=100")
    ids = join_all(old)
    _rounds(old, ids, T0)
    v1 = old.to_json()
    v1["format"] = 1
    v1["shard_cursors"] = [s["merged"] for s in v1.pop("segments")]
    for r in v1["islands"]:
        del r["segment_start"]
    loaded = CoordinatorState.from_json(old.opts, v1, T0)
    assert loaded.to_json()["segments"] == old.to_json()["segments"]
    assert [loaded.shard_cursor(s) for s in range(4)] == [ROUND] * 4


def test_a_checkpoint_with_bad_segments_is_refused_naming_the_problem():
    st, (a, b, c, _), now = _lost_after_one_round(100)
    for island in (a, b, c):
        _take(st, island, now)
    push(st, info(st, b, base=st.version, length=ROUND), now)
    good = st.to_json()

    def refused(blob: dict, *words: str) -> None:
        try:
            CoordinatorState.from_json(st.opts, blob, now)
        except Exception as e:  # noqa: BLE001 - the StateError's text is what is checked
            assert getattr(e, "code", None) == "INVALID_ARGUMENT", e
            for w in words:
                assert w in str(e), (w, str(e))
        else:
            raise AssertionError(f"accepted: {words}")

    blob = copy.deepcopy(good)
    blob["segments"][4]["end"] = 600  # [0, 480) [480, 600) [640, 800): a hole
    refused(blob, "state.segments[5].start", "contiguous")
    blob = copy.deepcopy(good)
    blob["segments"][3], blob["segments"][4] = blob["segments"][4], blob["segments"][3]
    refused(blob, "state.segments", "sorted by shard, then start")
    blob = copy.deepcopy(good)
    blob["islands"][2]["segment_start"] = 480  # c and b both live on [480, 640)
    refused(blob, "held by two live islands")
    blob = copy.deepcopy(good)
    blob["pending"][0]["info"]["cursor_end"] = 700  # b's pending push across its segment's end
    refused(blob, "state.pending[0].info", "lies in no one segment")
    v1 = copy.deepcopy(good)
    v1["format"] = 1
    v1["shard_cursors"] = [0, 0]
    del v1["segments"]
    refused(v1, "state.shard_cursors", "format 1: expected 4 entries")
    blob = copy.deepcopy(good)
    blob["format"] = 3
    refused(blob, "state.format", "reads checkpoint formats 1 and 2")


def test_split_cuts_whole_rounds_from_the_cursor_and_a_short_last_round_stays_last():
    st = make("train.steps=90")  # 720 sequences: 4 rounds and a half
    seg = st.ledger.segment(0, 0)
    seg.merged = 160
    assert st.ledger.rounds_left(seg) == 4  # [160, 720): 3 whole rounds and 80 sequences
    pieces = st.ledger.split(seg, 3)
    assert (seg.start, seg.end) == (0, 480) and [(p.start, p.end, p.merged) for p in pieces] == [
        (480, 640, 480), (640, 720, 640)]
    assert st.ledger.split(st.ledger.segment(0, 640), 5) == []  # one round left: nothing to cut
    assert st.ledger.segment_at(0, 639) == Segment(0, 480, 640, 480) and st.ledger.segment_at(0, 720) is None


def test_the_planner_stops_at_the_segments_end():
    """An island on segment [480, 640) of a 800-sequence shard (tiny: batch 8, H 20) trains one round from
    step 60 and ends there, not at the shard's end; with no end given it goes on to the shard's."""
    s = Schedule(inner_steps=20, steps_per_call=10, total_steps=100, overlap=False, overlap_steps=0,
                 round_seconds=0.0)
    assert next_action(s, RoundProgress(round_steps=0, island_steps=60, end_steps=80)).steps == 10
    assert next_action(s, RoundProgress(round_steps=20, island_steps=80, end_steps=80)).kind is Kind.END_ROUND
    assert next_action(s, RoundProgress(round_steps=0, island_steps=80, end_steps=80)).kind is Kind.END_RUN
    assert next_action(s, RoundProgress(round_steps=0, island_steps=80)).kind is Kind.TRAIN


def test_a_push_replys_rewind_applies_only_inside_the_islands_segment():
    from types import SimpleNamespace
    island = SimpleNamespace(index=3, segment=(480, 640))
    assert in_segment(island, 3, 480) and in_segment(island, 3, 639)  # type: ignore[arg-type]
    assert not in_segment(island, 3, 160) and not in_segment(island, 3, 640)  # type: ignore[arg-type]
    assert not in_segment(island, 2, 500)  # type: ignore[arg-type]
    assert in_segment(SimpleNamespace(index=0, segment=(0, 0)), 0, 10**9)  # type: ignore[arg-type]


def test_wall_time_rounds_keep_one_endless_segment_a_shard_and_never_split():
    """With wall-time rounds a shard has no end (a segment [0, 0)): no island runs out of data, a lost island's
    shard is taken whole by a newcomer, and the checkpoint holds one endless segment a shard."""
    st = make("worker.round_seconds=5", "coordinator.max_push_steps=20")
    a, b, c, d = join_all(st)
    _rounds(st, [a, b, c, d], T0)
    now = _lose(st, d, T0)
    assert st.heartbeat(a, st.version, 0, 0, 0.0, "", (), now)[0] == "continue"  # never out of data
    record, why = st.join("e", "cpu", 1, now)
    assert (record.shard_index, record.segment_start) == (3, 0) and "split" not in why and why.endswith("cursor 160")
    blob = json.loads(json.dumps(st.to_json()))
    assert blob["segments"][3] == {"shard": 3, "start": 0, "end": 0, "merged": 160}
    assert CoordinatorState.from_json(st.opts, blob, now).to_json()["segments"] == blob["segments"]
    blob["segments"][3]["end"] = 800
    try:
        CoordinatorState.from_json(st.opts, blob, now)
    except Exception as e:  # noqa: BLE001 - the StateError's text is what is checked
        assert "wall-time rounds: shard 3 is one segment [0, 0) (no end)" in str(e), e
    else:
        raise AssertionError("an end in a wall-time run was accepted")
