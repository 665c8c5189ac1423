"""coordinator.admission and the ledger through CoordinatorState: the decision on a push (duplicates,
staleness, contiguity, the weight bound, the norm screen) and what is recorded (an injected clock; helpers from
state_helpers.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from coordinator import admission
from coordinator.records import Admission, PushInfo, StateError
from coordinator.state import CoordinatorState
from state_helpers import T0, info, join_all, make, merge_rounds, options, push, unchanged


def test_second_push_in_open_round_refused():
    st = make()
    a, *_ = join_all(st)
    push(st, info(st, a))
    unchanged(st, lambda: st.admit_push(info(st, a), T0), "FAILED_PRECONDITION",
              "a already pushed for version 1", "wait for the round to close")


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
    assert "lease expired at t=1015.0 and e took over shard 0" in adm.reason
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
                          ({"start": 0, "end": 40, "shard": 1}, "covers shard 1, but a now holds shard 0")]:
        adm = push(st, info(st, a, base=1, **kwargs))
        assert adm.status == "drop" and words in adm.reason, adm.reason
        assert "not merged: its range is trained again from shard" in adm.reason
    assert st.deltas_dropped == 3 and [st.shard_cursor(s) for s in (0, 1)] == [40, 0] and not st.pending()
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
    st = make("coordinator.mode=async", "coordinator.norm_window=5", "coordinator.norm_window_min=4",
              "coordinator.round_norm_ratio=0")  # the robust-z window alone
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


def test_a_push_with_no_merged_norms_to_check_it_is_clipped_to_the_honest_ceiling():
    """Before any merged norm can check it (the first rounds), a push is clipped to what an honest island's
    AdamW steps can move θ (dtrain.steps.outer.honest_delta_bound x CODEC_SLACK); an honest norm under it, and
    any push once the window holds a reference, is merged as it is."""
    st = make("coordinator.mode=async", "coordinator.reject_backoff_s=0", params=29888)
    a, b, c = join_all(st, ("a", "b", "c"))
    lone = info(st, a)  # 40 sequences, inner_steps 5 (state_helpers)
    assert not admission.has_reference(st.opts.coordinator, st.ledger.norms, st.opts.islands)
    ceiling = admission.honest_ceiling(st.opts, lone, 10.0)
    # by hand: 5 steps of at most lr 3e-3 x (1.165 x sqrt(29888) + 0.1 x (10 + D)) each, x 2
    assert ceiling == pytest.approx(2 * 5 * 3e-3 * (1.16496 * 29888 ** 0.5 + 0.1 * 10), rel=1e-3)
    forged = st.commit_push(lone, T0, norm=95.0, theta_norm=10.0)  # 9.5 x ||θ||: under norm_max_ratio's 10 x
    assert forged.status == "accept" and forged.scale == pytest.approx(ceiling / 95.0)
    st.close_round(T0)
    assert f"norm 95 clipped to the honest ceiling {ceiling:.4g}" in forged.reason and "unchecked" in forged.reason
    honest = st.commit_push(info(st, b, base=st.version), T0, norm=0.5 * ceiling, theta_norm=10.0)
    assert honest.status == "accept" and honest.scale == 1.0 and "clipped" not in honest.reason
    st.close_round(T0)
    # claiming more inner steps than sequences buys nothing: at most one step per sequence of its range
    greedy = dataclasses.replace(info(st, c, base=st.version, length=4), inner_steps=10 ** 6)
    assert admission.honest_ceiling(st.opts, greedy, 10.0) == pytest.approx(
        admission.honest_ceiling(st.opts, dataclasses.replace(greedy, inner_steps=4), 10.0))
    st.commit_push(info(st, c, base=st.version), T0, norm=1.0, theta_norm=10.0)
    st.close_round(T0)  # 3 merged norms: a reference
    assert admission.has_reference(st.opts.coordinator, st.ledger.norms, st.opts.islands)
    assert list(st.ledger.norms) == [95.0, 0.5 * ceiling, 1.0]  # from now on screen_history judges a lone push
    # without the model's size (tools, the state tests) there is no ceiling
    assert admission.honest_ceiling(options(), lone, 10.0) == 0.0


def test_norm_max_ratio_and_clip_norm():
    st = make("coordinator.mode=async", "coordinator.clip_norm=2", "coordinator.reject_backoff_s=0")
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



def _norms(st: CoordinatorState, ids: list[str], norms: list[float], now: float = T0,
           theta_norm: float = 100.0) -> list[tuple[PushInfo, Admission]]:
    """One push per island of ``ids`` for the open round, with these L2 norms (θ's norm: ``theta_norm``)."""
    pushes = [info(st, i, base=st.version) for i in ids]
    return [(p, st.commit_push(p, now, norm=n, theta_norm=theta_norm)) for p, n in zip(pushes, norms, strict=True)]


def _close(st: CoordinatorState, now: float = T0) -> list[str]:
    """The round screen, then the merge (what RoundsLoop.begin_merge does); the ids of the pushes it rejected."""
    screened = st.screen_round()
    for push_id, why in screened:
        st.reject_pending([push_id], why, now)
    st.close_round(now)
    return [p for p, _ in screened]


def test_a_minus_20x_push_is_refused_in_round_one():
    """Round 1 has no norm history (the window is empty) and −20 x the honest delta is under 10 x ‖θ‖: the
    round screen, relative to the other pushes of the same round, rejects it."""
    st = make()
    a, b, c, d = join_all(st)
    pushes = _norms(st, [a, b, c, d], [1.0, 1.1, 0.9, 20.0])
    assert [adm.status for _, adm in pushes] == ["accept"] * 4  # each alone passes the arrival screen
    assert _close(st) == [pushes[3][0].push_id]
    assert st.version == 1 and st.deltas_merged == 3 and st.deltas_rejected == 1
    assert st.islands[d].rejections == 1 and st.islands[d].pushes_merged == 0
    assert st.shard_cursor(3) == 0 and st.shard_cursor(0) == 40  # d's range is not merged: trained again
    assert "more than round_norm_ratio 4 x the median 1.05 of the 4 pushes" in st.ledger.notice(d)


def test_the_round_screen_needs_three_pushes_and_can_be_off():
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")
    _norms(st, [a, b], [1.0, 50.0])
    assert st.screen_round() == []  # two pushes: no majority to compare with
    off = make("coordinator.round_norm_ratio=0")
    ids = join_all(off)
    _norms(off, ids, [1.0, 1.0, 1.0, 50.0])
    assert off.screen_round() == []


def test_the_round_screen_rejects_a_push_pointing_away_from_the_round():
    """With cosines (screened_mean: each push's cosine with the round's coordinate median), a push below
    coordinator.min_cosine is rejected, counted against its island as any rejection; a norm outlier keeps its norm
    reason; in a round of fewer than 3 pushes only an island on probation is screened (against the momentum), and
    with no reference (before any merge) nothing is."""
    st = make()
    a, b, c, d = join_all(st)
    pushes = _norms(st, [a, b, c, d], [1.0, 1.1, 0.9, 1.0])
    ids = [p.push_id for p, _ in pushes]
    median = "the coordinate median of the 4 pushes of its round"
    screened = st.screen_round({ids[0]: 0.9, ids[1]: 0.8, ids[2]: 0.05, ids[3]: -0.7}, median)
    assert [p for p, _ in screened] == [ids[3]]
    assert (f"quarantined: push {ids[3]} points away from the others: cosine -0.7 with the coordinate median of "
            f"the 4 pushes of its round, below min_cosine 0") == screened[0][1]
    strict = make("coordinator.min_cosine=0.1")
    pushes = _norms(strict, join_all(strict), [1.0, 1.1, 0.9, 20.0])
    ids = [p.push_id for p, _ in pushes]
    screened = strict.screen_round({ids[0]: 0.9, ids[1]: 0.8, ids[2]: 0.05, ids[3]: -0.7}, median)
    assert [p for p, _ in screened] == [ids[2], ids[3]] and "round_norm_ratio" in screened[1][1]
    assert strict.screen_round() == [(ids[3], screened[1][1])]  # no cosines: the norm screen alone
    # one push (the last rounds of a shard taken over), in a run of fewer than 3 islands: against the outer
    # momentum, if its island is on probation (its last push rejected); no reference: nothing
    one = make("outer.islands=2")
    a = join_all(one, ("a", "b"))[0]
    momentum = "the outer momentum (the direction of the recent merged updates)"
    (p, _), = _norms(one, [a], [1.0])
    assert one.screen_round({p.push_id: -0.5}, "", screened=True) == []
    assert one.screen_round({p.push_id: -0.5}, momentum, screened=True) == []  # an island in good standing
    one.islands[a].rejections = 1
    (rejected,) = one.screen_round({p.push_id: -0.5}, momentum, screened=True)
    assert rejected[0] == p.push_id and "cosine -0.5 with the outer momentum" in rejected[1]
    assert "below probation_min_cosine -0.15" in rejected[1]
    # an honest push late in a run, all but orthogonal to the momentum: not rejected, even on probation
    assert one.screen_round({p.push_id: -0.025}, momentum, screened=True) == []


def test_an_island_on_probation_is_not_merged_alone():
    """In a run of 4 islands, a push of an island whose last push was rejected, in a round of fewer than 3 pushes
    (the others' shards done), cannot be checked (the momentum is no test: a reversed push had cosines of -0.02
    to +0.16 with it in tiny): rejected whatever its cosine, its island quarantined at max_rejections in a row,
    its shard handed to the others. An island in good standing alone, and any island with screened_mean off, is
    merged as before; in a round of 3 or more the median decides."""
    momentum = "the outer momentum (the direction of the recent merged updates)"
    st = make("coordinator.reject_backoff_s=0")
    a, b, c, d = join_all(st)
    (p, _), = _norms(st, [a], [1.0])
    assert st.screen_round({p.push_id: 0.3}, momentum, screened=True) == []  # good standing
    st.islands[a].rejections = 1
    assert st.screen_round({p.push_id: 0.3}, momentum) == []  # the mean: no direction screen
    (rejected,) = st.screen_round({p.push_id: 0.3}, momentum, screened=True)
    assert rejected == (p.push_id, f"quarantined: push {p.push_id} cannot be checked: {a}'s last push was "
                                   f"rejected and its round has 1 push, too few for a coordinate median to compare "
                                   f"it with (an island on probation is merged only in a round of 3 pushes or "
                                   f"more)")
    _norms(st, [b], [1.0])
    assert [r[0] for r in st.screen_round({p.push_id: 0.9}, momentum, screened=True)] == [p.push_id]
    _norms(st, [c], [1.0])  # 3 pushes: the median decides
    median = "the coordinate median of the 3 pushes of its round"
    assert st.screen_round({p.push_id: 0.8}, median, screened=True) == []
    # alone, rejected max_rejections (3) times in a row: quarantined, its shard for the others
    st2 = make("coordinator.reject_backoff_s=0")
    a, *_ = join_all(st2)
    st2.islands[a].rejections = 1
    for _k in range(2):
        (p, _), = _norms(st2, [a], [1.0])
        for push_id, why in st2.screen_round({p.push_id: 0.5}, momentum, screened=True):
            st2.reject_pending([push_id], why, T0)
    assert st2.islands[a].state == "quarantined" and "cannot be checked" in st2.islands[a].stop_reason


def test_repeated_rejections_quarantine_the_island_and_the_run_ends():
    """d pushes −20 x every round: rejected three times in a row (coordinator.max_rejections 3) it is quarantined
    (told to stop, with why; its pushes and its Join refused), its shard goes to an island whose own is done, and
    the run ends with every shard's data merged."""
    st = make("train.steps=15", "outer.inner_steps=5")  # a shard: 120 sequences, three pushes of 40
    a, b, c, d = join_all(st)
    now = T0
    for k in range(3):
        _norms(st, [a, b, c, d], [1.0, 1.1, 0.9, 20.0], now)  # rejected by the round screen (or, once the
        _close(st, now)  # window holds enough norms, as it arrives)
        assert st.islands[d].rejections == k + 1 and st.islands[d].pushes_merged == 0
        now += 10  # past the backoff
        assert st.islands[d].state == ("quarantined" if k == 2 else "live")
    why = st.islands[d].stop_reason
    assert "3 pushes in a row rejected (coordinator.max_rejections 3)" in why and "shard 3" in why
    assert st.take_quarantined() == [(d, why)] and st.take_quarantined() == []
    assert st.heartbeat(d, st.version, 0, 0, 0.0, "", (), now) == ("stop", why)
    unchanged(st, lambda: st.admit_push(info(st, d, base=st.version), now), "FAILED_PRECONDITION",
              f"{st.islands[d].name} is quarantined")
    unchanged(st, lambda: st.join("d", "cpu", 1, now), "FAILED_PRECONDITION", "may not join again")
    assert not st.stopped()
    # a, b, c finished their shards: a is told to take over d's shard and splits its three rounds left in three
    # segments, one per live island; b and c take the other two: one more round ends the run
    action, reason = st.heartbeat(a, st.version, 0, 0, 0.0, "", (), now)
    assert action == "rejoin" and "shard 3" in reason
    record, why = st.join("a", "cpu", 1, now)
    assert (record.shard_index, record.segment_start) == (3, 0) and "split for 3 live islands" in why
    for island, start in ((b, 40), (c, 80)):
        assert st.heartbeat(island, st.version, 0, 0, 0.0, "", (), now)[0] == "rejoin"
        joined, _ = st.join(st.islands[island].name, "cpu", 1, now)
        assert (joined.shard_index, joined.segment_start) == (3, start)
    _norms(st, [a, b, c], [1.0, 1.0, 1.0], now)
    st.close_round(now)
    assert st.stopped() and "all 4 shards' data" in st.run_over()


def test_a_rejected_island_is_throttled_and_not_waited_for():
    st = make("coordinator.reject_backoff_s=2")
    a, b, c, d = join_all(st)
    _norms(st, [a, b, c, d], [1.0, 1.1, 0.9, 20.0])
    _close(st)
    assert st.islands[d].throttled_until == T0 + 2
    unchanged(st, lambda: st.admit_push(info(st, d, base=1), T0 + 1), "FAILED_PRECONDITION",
              "throttled for 1.0s more after 1 rejected push in a row")
    with pytest.raises(StateError) as refused:  # the refusal says how long, for the island to wait (not a message)
        st.admit_push(info(st, d, base=1), T0 + 1.25)
    assert refused.value.retry_after_s == 0.75
    _norms(st, [a, b, c], [1.0, 1.0, 1.0], T0 + 1)
    assert st.round_ready(T0 + 1) == (True, "all 4 live islands pushed")  # d, throttled, is not awaited
    assert st.next_deadline(T0 + 1) == T0 + 2
    _close(st, T0 + 1)
    _norms(st, [a, b, c, d], [1.0, 1.0, 1.0, 20.0], T0 + 3)  # the backoff doubles with a second rejection in a row
    _close(st, T0 + 3)
    assert st.islands[d].rejections == 2 and st.islands[d].throttled_until == T0 + 3 + 4


def test_an_island_ramping_its_pushes_is_rejected_and_quarantined():
    """An island growing its push 1.2 x a round while the honest norms shrink (0.9 x a round): its pushes are
    rejected once they pass round_norm_ratio x the round's median (or the recent norms' outlier bound), and it
    is quarantined; no merged push of it was ever above round_norm_ratio x the honest norm."""
    st = make("coordinator.reject_backoff_s=0")
    a, b, c, d = join_all(st)
    honest, worst = 1.0, 0.0
    for k in range(1, 30):
        if st.islands[d].state == "quarantined":
            break
        before = st.islands[d].pushes_merged
        _norms(st, [a, b, c, d], [honest, honest * 1.05, honest * 0.95, honest * 1.2 ** k])
        _close(st)
        if st.islands[d].pushes_merged > before:
            worst = max(worst, 1.2 ** k)
        honest *= 0.9
    assert st.islands[d].state == "quarantined" and k < 15, k
    assert 1.2 < worst <= 4.0  # merged while it was within the bounds, never past them


def test_the_norm_reference_follows_the_honest_norms_as_they_shrink():
    """The honest norms shrink 4 -> 2.4 -> 0.5 over three rounds; then one island pushes alone (the others' shards
    are done) 13 x the last honest norm. The 8-norm robust-z window still holds the early, large norms (its
    spread is large) and would let it through; the reference of the last round's norms refuses it."""
    st = make()
    ids = join_all(st)
    for norms in ([4.1, 4.2, 4.1, 4.2], [2.4, 2.3, 2.4, 2.4], [0.5, 0.55, 0.5, 0.45]):
        _norms(st, ids, norms)
        _close(st)
    (lone, adm), = _norms(st, ids[:1], [6.5])
    assert adm.status == "accept"  # sync: judged as its round closes, a round of one push
    assert [p for p, _ in st.screen_round()] == [lone.push_id]
    assert "more than round_norm_ratio 4 x the median 0.5 of the last 4 merged pushes" in st.screen_round()[0][1]
    old = make("coordinator.round_norm_ratio=0")  # the robust-z window alone: accepted
    ids = join_all(old)
    for norms in ([4.1, 4.2, 4.1, 4.2], [2.4, 2.3, 2.4, 2.4], [0.5, 0.55, 0.5, 0.45]):
        _norms(old, ids, norms)
        _close(old)
    _norms(old, ids[:1], [6.5])
    assert old.screen_round() == []


# Measured (benchmarks/wan.py's small, codec sparse, outer.fragments = 2, 100mbit/100ms, from scratch): each
# fragment's honest pushes, round by round. Fragment 0's first push covers H/F = 25 steps of the learning-rate
# warm-up and is a top-k of that delta alone; its next ones cover H = 50 steps and carry the error-feedback
# accumulator: 3.6 x the first. The old screen judged them on arrival against fragment 0's window of four
# 0.77s alone (robust z 9.8-11.2 > norm_z_max 8), rejected every one, so nothing was merged and the window never
# moved: the retries (4.3-4.6, then 5.3-5.5) were rejected too, and all four islands quarantined at version 2.
# Versions 4-6: the same run with the screen judging at the round's close (all merged).
SPARSE_F2 = ([0.778, 0.765, 0.767, 0.779], [2.089, 2.122, 2.032, 2.116], [2.874, 2.815, 2.934, 2.668],
             [4.694, 4.651, 4.742, 4.77], [4.426, 4.267, 4.365, 4.485], [6.82, 6.698, 6.645, 6.517])


def test_honest_sparse_norms_growing_with_fragments_are_merged():
    """A shift the whole round shares (a sparse island's accumulator filling, a fragment's short first exchange)
    is judged beside the round's own pushes, as the round closes: every honest push is merged, no island is
    rejected; the old screen (on arrival, against the merged norms alone) rejects the whole of fragment 0's
    second round."""
    st = make("outer.fragments=2", "outer.inner_steps=20")
    ids = join_all(st)
    for norms in SPARSE_F2:
        assert [adm.status for _, adm in _norms(st, ids, norms)] == ["accept"] * 4
        assert _close(st) == []
    assert st.version == 6 and st.deltas_merged == 24 and st.deltas_rejected == 0
    assert all(st.islands[i].rejections == 0 and st.islands[i].state != "quarantined" for i in ids)
    assert list(st.ledger.norm_window(7)) == [*SPARSE_F2[2], *SPARSE_F2[4]]  # fragment 0's last 8
    # the same norms against fragment 0's window alone (what the arrival screen did): every push of the round out
    c = st.opts.coordinator
    assert all(admission.screen_history(c, "p", n, SPARSE_F2[0], 4) for n in SPARSE_F2[2])
    assert not any(admission.screen_history(c, "p", n, SPARSE_F2[0], 4, SPARSE_F2[2]) for n in SPARSE_F2[2])


def test_hostile_pushes_are_still_rejected_while_the_honest_norms_grow():
    """In the same growing rounds: a push scaled up 20 x (the round screen), one scaled 3.5 x in a round of honest
    norms that grew too (the drift-aware robust z: it cannot move the median), a NaN (on arrival) and a lone push
    13 x the window in a round of one (the recent merged norms) are each rejected; the honest ones beside them
    are merged."""
    st = make("outer.fragments=2", "outer.inner_steps=20", "coordinator.reject_backoff_s=0")
    ids = join_all(st)
    a, b, c, d = ids
    for norms in SPARSE_F2[:2]:
        _norms(st, ids, norms)
        assert _close(st) == []
    scaled = _norms(st, ids, [2.874, 2.815, 2.934, 20 * 2.8])  # fragment 0, second round: honest 3.6 x, d 20 x
    assert _close(st) == [scaled[3][0].push_id] and st.deltas_merged == 11
    assert "more than round_norm_ratio 4 x the median 2.904 of the 4 pushes of its round" in st.ledger.notice(d)
    drift = _norms(st, ids, [2.09, 2.12, 2.03, 3.5 * 2.1])  # fragment 1: its window [2.1 x 4], d 3.5 x
    assert _close(st) == [drift[3][0].push_id]
    assert "robust deviations above the median" in st.ledger.notice(d) and \
        "of the last 4 merged pushes and the 4 of its round (norm_z_max 8)" in st.ledger.notice(d)
    nan = _norms(st, ids, [3.9, 4.1, 3.8, math.nan])
    assert nan[3][1].status == "reject" and "non-finite norm nan" in nan[3][1].reason
    assert _close(st) == [] and st.islands[d].state == "quarantined"  # its third rejection in a row
    assert st.version == 5 and st.deltas_merged == 17 and st.deltas_rejected == 3
    (lone, _), = _norms(st, [a], [13 * 2.1])  # fragment 1, a round of one (the others' shards done, say)
    (push_id, why), = st.screen_round()
    assert push_id == lone.push_id and "more than round_norm_ratio 4 x the median 2.103 of the last 4 merged" in why
