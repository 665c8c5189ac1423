"""coordinator.quorum through CoordinatorState: when a round closes (all pushed, quorum after grace, async),
when the run ends and when the coordinator may stop (an injected clock; helpers from state_helpers.py)."""

from __future__ import annotations

import json

import pytest

from coordinator.state import CoordinatorState
from state_helpers import T0, info, join_all, make, options, push, unchanged


def test_sync_round_closes_when_all_live_pushed():
    st = make()
    ids = join_all(st)
    assert st.round_ready(T0) == (False, "waiting for the first push for version 1 (4 live islands)")
    for i in ids[:3]:
        adm = push(st, info(st, i, start=0, end=40))
        assert adm.status == "accept" and adm.target_version == 1 and adm.staleness == 0 and adm.weight == 1000.0
        assert adm.reason == "accepted for version 1: weight 1000 = 1000 tokens"
    ready, why = st.round_ready(T0 + 1)
    assert not ready and why == "waiting for 1 of 4 islands (missing: d); a quorum close needs 4 pushes, have 3"
    unchanged(st, lambda: st.close_round(T0 + 1), "FAILED_PRECONDITION", "cannot close", "missing: d")
    push(st, info(st, ids[3], tokens=500, start=0, end=20))
    assert st.round_ready(T0 + 2) == (True, "all 4 live islands pushed")
    assert [i.island_id for i, _ in st.pending()] == ids
    version, merged, reason = st.close_round(T0 + 2)
    assert version == 1 == st.version and [m.island_id for m in merged] == ids
    assert "merged 4 deltas (a, b, c, d; 3500 tokens) into version 1 (all 4 live islands pushed)" == reason
    assert st.pending() == [] and st.deltas_merged == 4 and st.tokens_merged == 3500
    assert st.islands["d-3"].tokens_merged == 500 and st.islands["d-3"].pushes_merged == 1
    assert st.islands["d-3"].cursor_merged == 20 and st.shard_cursor(3) == 20


def test_quorum_and_grace():
    st = make("coordinator.min_quorum=3", "coordinator.grace_s=30")
    a, b, c, d = join_all(st)
    push(st, info(st, a), T0)
    push(st, info(st, c), T0 + 5)
    assert st.round_ready(T0 + 40) == (False, ("waiting for 2 of 4 islands (missing: b, d); "
                                              "a quorum close needs 3 pushes, have 2"))
    push(st, info(st, d), T0 + 10)
    ready, why = st.round_ready(T0 + 18)
    assert not ready and why == "waiting for 1 of 4 islands (missing: b); quorum close possible in 12.0s"
    assert st.next_deadline(T0 + 18) == T0 + 15  # earliest lease first
    st.heartbeat(a, 0, 0, 0, 0, "", (), T0 + 14), st.heartbeat(b, 0, 0, 0, 0, "", (), T0 + 14)
    st.heartbeat(c, 0, 0, 0, 0, "", (), T0 + 14), st.heartbeat(d, 0, 0, 0, 0, "", (), T0 + 14)
    assert st.next_deadline(T0 + 18) == T0 + 29
    assert st.next_deadline(T0 + 29.5) == T0 + 29  # an overdue lease: expire() is due now
    for i in (a, b, c, d):
        st.heartbeat(i, 0, 0, 0, 0, "", (), T0 + 29.5)
    assert st.next_deadline(T0 + 29.5) == T0 + 30  # the grace end
    assert st.round_ready(T0 + 29.999)[0] is False
    assert st.round_ready(T0 + 30.0) == (True, "quorum 3 of 4 after 30s grace (missing: b)")
    version, merged, reason = st.close_round(T0 + 30)
    assert version == 1 and len(merged) == 3 and "quorum 3 of 4 after 30s grace (missing: b)" in reason


def test_lost_island_no_longer_blocks_round_and_its_push_stays():
    st = make()
    a, b, c, d = join_all(st)
    push(st, info(st, b), T0 + 1)
    for i in (a, c):
        st.heartbeat(i, 0, 0, 0, 0.0, "", (), T0 + 10)
        push(st, info(st, i), T0 + 10)
    assert st.round_ready(T0 + 11)[1].startswith("waiting for 1 of 4 islands (missing: d)")
    lost = dict(st.expire(T0 + 15))  # b (pending push) and d are lost
    assert set(lost) == {b, d}
    assert "its pending push" in lost[b] and "stays in the open round" in lost[b]
    assert st.round_ready(T0 + 15) == (True, "all 2 live islands pushed (+1 from islands no longer live)")
    _version, merged, _ = st.close_round(T0 + 15)
    assert {m.island_id for m in merged} == {a, b, c}
    assert st.islands[b].pushes_merged == 1


def test_async_ready_after_each_push():
    st = make("coordinator.mode=async")
    a, b, *_ = join_all(st)
    assert st.round_ready(T0) == (False, "no pushes pending")
    push(st, info(st, a))
    assert st.round_ready(T0) == (True, "1 push pending (async: merge on arrival)")
    assert st.close_round(T0)[0] == 1
    push(st, info(st, b, base=0))
    push(st, info(st, a, base=1))  # async: an island may push again before its last merges
    ready, why = st.round_ready(T0)
    assert ready and why == "2 pushes pending (async: merge on arrival)"
    assert st.next_deadline(T0) == T0 + 15  # leases only: no grace in async


def test_the_run_ends_when_every_shards_data_is_merged():
    st = make("outer.islands=1", "train.steps=20")
    a, = join_all(st, "a")
    assert st.opts.end_version == 0  # step rounds: the data decides, islands are told
    push(st, info(st, a, length=160))
    version, _, reason = st.close_round(T0)
    assert version == 1 and st.stopped() and reason.endswith("; the run is over (1 versions)")
    over = "the run is over: all 1 shards' data (160 sequences each) merged, in 1 versions"
    assert st.round_ready(T0) == (False, over)
    adm = push(st, info(st, a, base=1, tokens=10 ** 9, end=10 ** 9))  # whatever it claims: weight 0
    assert adm.status == "drop" and over in adm.reason and st.deltas_dropped == 1 and adm.weight == 0
    assert st.heartbeat(a, 1, 0, 0, 0.0, "", (), T0)[0] == "stop"


def test_total_versions_stops_a_wall_time_run():
    st = make("outer.islands=1", "train.steps=20", "worker.round_seconds=1")
    a, = join_all(st, "a")
    assert st.opts.end_version == st.opts.total_versions == 1
    push(st, info(st, a, length=40))
    assert st.close_round(T0)[0] == 1 and st.stopped()
    assert st.round_ready(T0) == (False, "the run is over: 1 of 1 versions merged")


def test_a_sync_round_does_not_wait_for_an_island_without_data():
    """An island whose shard is done (its data merged or pending) is not waited for; one with data left is."""
    st = make("outer.islands=2", "train.steps=40")  # two rounds of 160 sequences per shard
    a, b = join_all(st, "ab")
    push(st, info(st, a, length=160))
    push(st, info(st, b, length=160))
    st.close_round(T0)
    push(st, info(st, a, base=1, length=160))
    assert st.round_ready(T0)[0] is False  # b has data left
    push(st, info(st, b, base=1, length=120))
    st.close_round(T0)
    assert st.data_left(1) and not st.data_left(0) and not st.stopped()
    push(st, info(st, b, base=2, length=40))  # b's last 40 sequences; a has nothing to push
    assert st.round_ready(T0) == (True, "all 2 live islands pushed")
    assert st.close_round(T0)[0] == 3 and st.stopped()


def test_finished_when_live_islands_hold_the_last_version_or_the_linger_ends():
    st = make("outer.islands=3", "train.steps=20", linger_s=10.0)  # a run of one version
    a, b, c = join_all(st, "abc")
    assert st.finished(T0) == (False, "the run goes on: 0 of 1 versions merged")
    for i in (a, b, c):
        push(st, info(st, i, length=160))
    st.close_round(T0 + 1)
    assert st.finished(T0 + 2) == (False, ("the run is over (1 versions); waiting up to 9.0s for islands without "
                                           "version 1: a, b, c"))
    assert st.next_deadline(T0 + 2) == T0 + 11  # the linger ends before the leases (T0 + 15)
    assert st.heartbeat(a, 1, 0, 0, 0.0, "", (), T0 + 3)[0] == "stop"  # a holds version 1 and stops
    assert st.finished(T0 + 3)[1].endswith("waiting up to 8.0s for islands without version 1: b, c")
    assert st.finished(T0 + 11) == (True, ("the run is over (1 versions); gave up after 10s on islands without "
                                           "version 1: b, c"))
    assert st.next_deadline(T0 + 11) == T0 + 15  # past the linger: leases only
    # A resumed run that was already over lingers from the restart.
    again = CoordinatorState.from_json(st.opts, st.to_json(), T0 + 50)
    assert again.finished(T0 + 50)[1].endswith("waiting up to 10.0s for islands without version 1: b, c")
    # Islands that hold the last version (b) or are lost (c) end it at once.
    st.heartbeat(b, 1, 0, 0, 0.0, "", (), T0 + 4)
    st.expire(T0 + 15)
    assert st.finished(T0 + 15) == (True, "the run is over (1 versions) and every live island holds version 1")


def test_rejected_pending_push_does_not_hold_up_its_round():
    """reject_pending (a merge it made non-finite): out of the round, counted, its island told, and the round
    closes with the others (the rejected island counts as having pushed)."""
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")
    pa, pb = info(st, a, tokens=700), info(st, b, tokens=300)
    push(st, pa)
    push(st, pb)
    unchanged(st, lambda: st.reject_pending(["nope"], "x"), "NOT_FOUND", "nope not pending")
    assert st.reject_pending([pa.push_id], "the outer step makes theta[3] non-finite") == [pa]
    assert [i.push_id for i, _ in st.pending()] == [pb.push_id] and st.deltas_rejected == 1
    assert st.round_ready(T0) == (True, "all 2 live islands pushed, 1 of them rejected")
    assert "was rejected: the outer step makes theta[3] non-finite" in st.heartbeat(a, 0, 0, 0, 0.0, "", (),
                                                                                     T0)[1]
    # The state round-trips through a checkpoint with its rejection and norms.
    same = CoordinatorState.from_json(options("outer.islands=2"), json.loads(json.dumps(st.to_json())), T0)
    assert same.round_ready(T0) == st.round_ready(T0) and same.deltas_rejected == 1
    version, merged, reason = st.close_round(T0)
    assert version == 1 and merged == [pb] and st.tokens_merged == 300 and st.shard_cursor(0) == 0
    assert st.admit_push(pa, T0).status == "duplicate"
    assert st.round_ready(T0)[0] is False  # the next round waits for both again
    # All pushes rejected: nothing to merge, the round stays open.
    push(st, info(st, a, base=1))
    (only,) = st.pending()
    st.reject_pending([only[0].push_id], "bad")
    assert st.round_ready(T0) == (False, "waiting for the first push for version 2 (2 live islands)")


def test_quorum_and_grace_with_islands_whose_rounds_differ_10x_in_tokens():
    """Wall-time rounds of islands that differ (issue 26): a fast island's round carries 10x the slow one's
    tokens. Each push weighs its tokens; the slow island holds a round up only for the grace, and its late push
    counts once, discounted by its staleness, in the next version."""
    st = make("outer.islands=2", "train.steps=200", "worker.round_seconds=1", "coordinator.min_quorum=1",
              "coordinator.grace_s=5")
    fast, slow = join_all(st, ("fast", "slow"))
    assert push(st, info(st, fast, tokens=3200, length=100), T0 + 1).weight == 3200.0
    assert st.round_ready(T0 + 1.5) == (False, "waiting for 1 of 2 islands (missing: slow); "
                                               "quorum close possible in 4.5s")
    assert push(st, info(st, slow, tokens=320, length=10), T0 + 2).weight == 320.0
    assert st.round_ready(T0 + 2) == (True, "all 2 live islands pushed")
    version, merged, _ = st.close_round(T0 + 2)
    assert version == 1 and [m.tokens for m in merged] == [3200, 320] and st.tokens_merged == 3520
    # round 2: the slow island is late; the fast one's push alone closes it after the grace, not before
    push(st, info(st, fast, base=1, tokens=3200, length=100), T0 + 3)
    assert st.round_ready(T0 + 7.9)[0] is False
    assert st.round_ready(T0 + 8) == (True, "quorum 1 of 2 after 5s grace (missing: slow)")
    version, merged, _ = st.close_round(T0 + 8)
    assert version == 2 and [m.island_id for m in merged] == [fast]
    late = push(st, info(st, slow, base=1, tokens=320, length=10), T0 + 9)
    assert (late.status, late.target_version, late.staleness) == ("accept", 3, 1)
    assert late.weight == pytest.approx(320 * 2 ** -0.5)  # its tokens, discounted by (1 + staleness)^-alpha
    assert st.round_ready(T0 + 9) == (False, "waiting for 1 of 2 islands (missing: fast); "
                                             "quorum close possible in 5.0s")
    push(st, info(st, fast, base=2, tokens=3200, length=100), T0 + 10)
    version, merged, _ = st.close_round(T0 + 10)
    assert version == 3 and st.tokens_merged == 3520 + 3200 + 320 + 3200
    assert st.shard_cursor(0) == 300 and st.shard_cursor(1) == 20  # nothing lost or doubled on either shard
