"""coordinator.admission and the ledger through CoordinatorState: the decision on a push (duplicates,
staleness, contiguity, the weight bound, the norm screen) and what is recorded (an injected clock; helpers from
state_helpers.py)."""

from __future__ import annotations

import math

import pytest

from coordinator.records import Admission, PushInfo
from coordinator.state import CoordinatorState
from state_helpers import T0, info, join_all, make, merge_rounds, options, push, unchanged


def test_second_push_in_open_round_refused():
    st = make()
    a, *_ = join_all(st)
    push(st, info(st, a))
    unchanged(st, lambda: st.admit_push(info(st, a), T0), "FAILED_PRECONDITION",
              "a-0 already pushed for version 1", "wait for the round to close")


def test_duplicate_push_id_pending_and_merged_no_double_count():
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")
    first = info(st, a, push_id="retry-me", tokens=700)
    push(st, first)
    dup = st.admit_push(first, T0 + 1)
    assert dup == Admission("duplicate", 0.0, 0, 1, "push retry-me is pending in the open round for version 1: "
                                                      "a retry, not applied again")
    assert st.commit_push(first, T0 + 1) == dup
    assert st.duplicates == 1 and len(st.pending()) == 1
    push(st, info(st, b))
    st.close_round(T0 + 2)
    assert st.tokens_merged == 1700 and st.islands[a].tokens_merged == 700
    dup2 = st.admit_push(first, T0 + 3)
    assert dup2.status == "duplicate" and dup2.target_version == 1 and dup2.weight == 0.0
    assert dup2.reason == "push retry-me was merged into version 1: a retry, not applied again"
    assert st.commit_push(first, T0 + 3) == dup2
    assert st.tokens_merged == 1700 and st.deltas_merged == 2 and st.duplicates == 2
    assert st.push_known("retry-me") and not st.push_known("never")
    # the same id from another island is a client bug, not a retry
    unchanged(st, lambda: st.admit_push(info(st, b, push_id="retry-me"), T0 + 3), "INVALID_ARGUMENT",
              "already used by island a-0")


def test_push_id_memory_is_bounded():
    st = make("outer.islands=1", max_push_ids=3)
    a, = join_all(st, "a")
    for v in range(5):
        push(st, info(st, a, base=v, push_id=f"id{v}"))
        st.close_round(T0)
    assert [st.push_known(f"id{v}") for v in range(5)] == [False, False, True, True, True]


def test_late_delta_discount_weight_exact():
    st = make("outer.islands=2", "coordinator.mode=async", "outer.staleness_alpha=0.5")
    a, b = join_all(st, "ab")
    merge_rounds(st, a, 3)
    adm = st.admit_push(info(st, b, base=1, tokens=1000), T0)
    assert adm.status == "accept" and adm.staleness == 2 and adm.target_version == 4
    assert adm.weight == 1000 * (1 + 2) ** -0.5
    assert adm.reason == "accepted for version 4: 2 versions late: weight 577.35 = 1000 tokens x (1+2)^-0.5"


def test_drop_policy_drops_and_counts():
    st = make("outer.islands=2", "coordinator.mode=async", "coordinator.late_policy=drop")
    a, b = join_all(st, "ab")
    push(st, info(st, a))
    st.close_round(T0)
    late = info(st, b, base=0)
    adm = push(st, late)
    assert adm.status == "drop" and adm.weight == 0.0 and adm.staleness == 1
    assert adm.reason == "delta from version 0 is 1 versions stale and late_policy is 'drop': dropped"
    assert st.deltas_dropped == 1 and st.pending() == [] and st.round_ready(T0) == (False, "no pushes pending")
    retry = st.admit_push(late, T0)
    assert retry.status == "duplicate" and "was dropped" in retry.reason
    assert push(st, info(st, b, base=1)).status == "accept"  # fresh deltas are fine


def test_max_staleness_drops_under_discount():
    st = make("outer.islands=2", "coordinator.mode=async", "coordinator.max_staleness=2")
    a, b = join_all(st, "ab")
    merge_rounds(st, a, 3)
    assert push(st, info(st, b, base=1)).status == "accept"  # staleness 2: discounted
    st.close_round(T0)
    adm = push(st, info(st, b, base=1))
    assert adm.status == "drop" and adm.staleness == 3
    assert adm.reason == "delta from version 1 is 3 versions stale (max_staleness 2): dropped"
    assert st.deltas_dropped == 1


@pytest.mark.parametrize("change, code, words", [
    ({"base_version": 1}, "INVALID_ARGUMENT", ("base_version=1 is ahead of the coordinator's version 0",)),
    ({"tokens": 0}, "INVALID_ARGUMENT", ("tokens=0",)),
    ({"inner_steps": 0}, "INVALID_ARGUMENT", ("inner_steps=0",)),
    ({"cursor_start": 5, "cursor_end": 4}, "INVALID_ARGUMENT", ("cursor_end=4 is before cursor_start=5",)),
    ({"push_id": ""}, "INVALID_ARGUMENT", ("push_id",)),
    ({"push_id": "x" * 129}, "INVALID_ARGUMENT", ("push_id", "1 to 128 characters")),
    ({"island_id": "ghost-9"}, "NOT_FOUND", ("unknown island_id 'ghost-9'",)),
])
def test_bad_pushes_refused_without_change(change, code, words):
    st = make()
    a, *_ = join_all(st)
    good = info(st, a)
    bad = PushInfo(**{**good.__dict__, **change})
    unchanged(st, lambda: st.admit_push(bad, T0), code, *words)
    unchanged(st, lambda: st.commit_push(bad, T0), code, *words)


def test_a_lost_islands_late_push_is_judged_like_any_other_until_its_shard_is_taken():
    """A lost island's push (a hung island back) is a late delta under late_policy while its shard is free;
    once another island holds the shard, it is dropped and counted, naming the cursor to train it from."""
    st = make("coordinator.mode=async")
    a, *_ = join_all(st)
    st.expire(T0 + 15)  # all four lost
    adm = push(st, info(st, a), T0 + 16)
    assert adm.status == "accept" and st.shard_cursor(0) == 40
    st.close_round(T0 + 16)
    st.join("e", "cpu", 1, T0 + 17)  # takes shard 0, the lowest free one with data left
    adm = push(st, info(st, a, base=1), T0 + 18)
    assert adm.status == "drop" and st.deltas_dropped == 1 and st.shard_cursor(0) == 40
    assert "lease expired at t=1015.0 and e-0 took over shard 0" in adm.reason
    assert "rejoin (call Join again)" in adm.reason and "trained again from shard 0's cursor 40" in adm.reason


def test_a_push_must_start_at_its_shards_cursor():
    """A push that overlaps merged or pending data, leaves a gap, or covers a shard its island no longer holds is
    dropped and counted, naming the cursor its island rewinds to; the shard's data stays one prefix."""
    st = make("coordinator.mode=async")
    a, b = join_all(st, "ab")
    push(st, info(st, a, start=0, end=40))
    st.close_round(T0)
    for kwargs, words in [({"start": 39, "end": 79}, "[39, 79) overlaps data merged or pending"),
                          ({"start": 41, "end": 81}, "[41, 81) leaves a gap after data merged or pending"),
                          ({"start": 0, "end": 40, "shard": 1}, "covers shard 1, but a-0 now holds shard 0")]:
        adm = push(st, info(st, a, base=1, **kwargs))
        assert adm.status == "drop" and words in adm.reason, adm.reason
        assert "not merged: its range is trained again from shard" in adm.reason
    assert st.deltas_dropped == 3 and st.ledger.shard_cursors[:2] == [40, 0] and not st.pending()
    assert push(st, info(st, a, base=1, start=40, end=80)).status == "accept"


def test_commit_decides_again_when_the_round_closed_meanwhile():
    st = make("outer.islands=2", "coordinator.min_quorum=1", "coordinator.grace_s=5")
    a, b = join_all(st, "ab")
    late = info(st, b)
    preview = st.admit_push(late, T0)  # b's payload starts streaming in...
    assert (preview.status, preview.target_version, preview.weight) == ("accept", 1, 1000.0)
    push(st, info(st, a), T0)
    assert st.close_round(T0 + 5)[0] == 1  # ...and the round closes on quorum without it
    adm = st.commit_push(late, T0 + 6)
    assert (adm.status, adm.target_version, adm.staleness, adm.weight) == ("accept", 2, 1, 1000 * 2 ** -0.5)
    assert st.pending() == [(late, adm)]  # recorded as decided now, not as previewed


@pytest.mark.parametrize("fields, words", [
    ({"tokens": 10 ** 9, "start": 0, "end": 80},
     ("tokens=1000000000 exceed its cursor range [0, 80) = 80 sequences x seq_len 32 = 2560 tokens",)),
    ({"tokens": 1281, "start": 0, "end": 40}, ("tokens=1281", "= 1280 tokens")),
    ({"tokens": 1000, "start": 0, "end": 161},
     ("[0, 161) is 161 sequences, more than one push may cover: max_push_steps 20 x batch_size 8 = 160",)),
    ({"tokens": 10 ** 9, "start": 0, "end": 10 ** 9}, ("more than one push may cover",)),
    ({"tokens": 1000, "start": 159_990, "end": 160_030},
     ("cursor_end=160030 is past the end of shard 0: train.steps 20000 x batch_size 8 = 160000 sequences",)),
])
def test_a_push_weight_is_bounded_by_its_assigned_cursor_range(fields, words):
    """tokens <= range x seq_len; range <= max_push_steps (H = 20) x batch 8; no earlier than the shard's cursor;
    within the shard's train.steps x batch: refused, naming the numbers, with the state unchanged."""
    st = make("coordinator.mode=async")
    a, _ = join_all(st, "ab")
    push(st, info(st, a, start=0, end=40))  # shard 0's cursor: 40 (pending counts)
    st.close_round(T0)
    bad = info(st, a, base=1, **fields)
    for decide in (st.admit_push, st.commit_push):
        unchanged(st, lambda decide=decide: decide(bad, T0), "INVALID_ARGUMENT", f"push {bad.push_id} from a-0", *words)
    # At the bounds: accepted.
    assert push(st, info(st, a, base=1, tokens=160 * 32, start=40, end=200)).status == "accept"


def test_the_push_bound_follows_the_config():
    assert options().max_push_steps == 20 and options().shard_steps == 20000
    assert options("coordinator.max_push_steps=7").max_push_steps == 7
    wall = options("worker.round_seconds=2")  # wall-time rounds: no cap per push unless set, no shard end
    assert wall.max_push_steps == 0 and wall.shard_steps == 0
    st = CoordinatorState(wall, "run-1", T0)
    (a,) = join_all(st, "a")
    assert push(st, info(st, a, tokens=6400 * 32, start=0, end=6400)).status == "accept"
    capped = CoordinatorState(options("worker.round_seconds=2", "coordinator.max_push_steps=50"), "run-1", T0)
    (a,) = join_all(capped, "a")
    unchanged(capped, lambda: capped.admit_push(info(capped, a, start=0, end=401), T0), "INVALID_ARGUMENT",
              "[0, 401) is 401 sequences, more than one push may cover: max_push_steps 50 x batch_size 8 = 400")


def _merged_norms(st: CoordinatorState, island_id: str, norms: list[float]) -> None:
    for norm in norms:  # async: each push is merged on its own
        assert st.commit_push(info(st, island_id, base=st.version), T0, norm=norm).status == "accept"
        st.close_round(T0)


def test_a_norm_outlier_is_quarantined_once_the_window_fills():
    st = make("coordinator.mode=async", "coordinator.norm_window=5", "coordinator.norm_window_min=4")
    a, b = join_all(st, "ab")
    _merged_norms(st, a, [1.0, 1.1, 0.9])
    assert list(st.ledger.norms) == [1.0, 1.1, 0.9]
    # Three norms: the check does not apply yet (the push is accepted; it joins the window once merged).
    assert st.commit_push(info(st, b, base=st.version), T0, norm=3.0).status == "accept"
    st.close_round(T0)
    _merged_norms(st, a, [1.0, 1.05])
    assert list(st.ledger.norms) == [1.1, 0.9, 3.0, 1.0, 1.05]  # the last norm_window=5
    ok = st.commit_push(info(st, b, base=st.version), T0, norm=2.5)  # median 1.05: z = 1.45/0.2625 = 5.5 <= 8
    assert ok.status == "accept" and ok.norm == 2.5 and ok.scale == 1.0
    st.close_round(T0)
    poison = info(st, b, base=st.version)
    adm = st.commit_push(poison, T0, norm=1e6)
    assert adm.status == "reject" and adm.weight == 0.0 and st.pending() == [] and st.deltas_rejected == 1
    assert adm.reason.startswith(f"quarantined: push {poison.push_id} has L2 norm 1e+06") and \
        "robust deviations above the median 1.05 of the last 5 merged pushes (norm_z_max 8)" in adm.reason
    assert 1e6 not in st.ledger.norms
    # Its island is told in every heartbeat reply until a push of its own is accepted; a retry is a duplicate.
    action, why = st.heartbeat(b, st.version, 0, 0, 0.0, "", (), T0 + 1)
    assert action == "continue" and f"your push {poison.push_id} was rejected: quarantined" in why
    assert st.rejected(poison.push_id) is not None and st.rejected("p-unknown") is None
    retry = st.commit_push(poison, T0 + 1, norm=1e6)
    assert retry.status == "duplicate" and "was rejected" in retry.reason
    assert st.commit_push(info(st, b, base=st.version), T0 + 2, norm=1.2).status == "accept"
    assert "rejected" not in st.heartbeat(b, st.version, 0, 0, 0.0, "", (), T0 + 3)[1]
    st.close_round(T0 + 3)
    # off: norm_z_max = 0
    off = make("coordinator.mode=async", "coordinator.norm_z_max=0", "coordinator.norm_window_min=1")
    (c,) = join_all(off, "c")
    _merged_norms(off, c, [1.0, 1e6])


def test_norm_max_ratio_and_clip_norm():
    st = make("coordinator.mode=async", "coordinator.clip_norm=2")
    (a,) = join_all(st, "a")
    big = info(st, a)
    adm = st.commit_push(big, T0, norm=10.5, theta_norm=1.0)  # first round: no window yet, the ratio applies
    assert adm.status == "reject" and "more than norm_max_ratio 10 x the L2 norm of θ (1)" in adm.reason
    assert st.commit_push(info(st, a), T0, norm=10.5, theta_norm=0.0).status == "accept"  # θ = 0: skipped
    st.close_round(T0)
    clipped = st.commit_push(info(st, a, base=1), T0, norm=8.0, theta_norm=1.0)
    assert clipped.status == "accept" and clipped.scale == 0.25 and clipped.weight == 1000.0
    assert clipped.reason.endswith("; norm 8 clipped to 2")
    nan = st.commit_push(info(st, a, base=1), T0, norm=math.nan)
    assert nan.status == "reject" and "non-finite norm nan" in nan.reason
