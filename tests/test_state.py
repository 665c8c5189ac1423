"""coordinator.state: decisions and reasons, with an injected clock (no network, no JAX, no sleeps)."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from conftest import TINY
from coordinator.records import Admission, PushInfo, StateError, StateOptions
from coordinator.state import CoordinatorState
from dtrain.config import load_config

T0 = 1000.0
BASE = ["coordinator.lease_s=15", "train.steps=20000"]  # 15 s leases; 1000 rounds: a run ends only where a test says


def options(*overrides: str, **constants: Any) -> StateOptions:
    """The options for configs/tiny.toml (4 islands, sync, 30 s grace, alpha 0.5) with BASE and ``--set``
    overrides; ``constants``: the state's own (max_push_ids, linger_s)."""
    return StateOptions.from_config(load_config(TINY, [*BASE, *overrides]), **constants)


def make(*overrides: str, now: float = T0, **constants: Any) -> CoordinatorState:
    return CoordinatorState(options(*overrides, **constants), "run-1", now)


def join_all(st: CoordinatorState, names=("a", "b", "c", "d"), now: float = T0) -> list[str]:
    return [st.join(n, "cpu", 1, now)[0].island_id for n in names]


_n = [0]


def info(st: CoordinatorState, island_id: str, base: int = 0, tokens: int = 1000, push_id: str | None = None,
         start: int | None = None, end: int | None = None, shard: int | None = None,
         length: int = 40) -> PushInfo:
    """A push over [start, end) of ``shard`` (by default the island's): by default from where that shard's cursor
    is in ``st`` (0 for an unknown island), ``length`` sequences long (40: 40 x seq_len 32 = 1280 tokens; at most
    tiny's inner_steps 20 x batch_size 8 = 160 sequences, a whole round)."""
    if push_id is None:
        _n[0] += 1
        push_id = f"p{_n[0]}"
    record = st.islands.get(island_id)
    if shard is None:
        shard = 0 if record is None else record.shard_index
    if start is None:
        start = 0 if record is None else st.shard_cursor(shard)
    return PushInfo(push_id=push_id, island_id=island_id, base_version=base, tokens=tokens, inner_steps=5,
                    cursor_start=start, cursor_end=start + length if end is None else end, shard_index=shard)


def push(st: CoordinatorState, i: PushInfo, now: float = T0) -> Admission:
    """Previews, then commits: with nothing in between, commit_push records the decision admit_push showed."""
    preview = st.admit_push(i, now)
    adm = st.commit_push(i, now)
    assert adm == preview
    return adm


def merge_rounds(st: CoordinatorState, island_id: str, rounds: int) -> None:
    """``rounds`` versions, each merged from one fresh push of ``island_id`` (async mode: one push closes it)."""
    for _ in range(rounds):
        push(st, info(st, island_id, base=st.version))
        st.close_round(T0)


def unchanged(st: CoordinatorState, fn, code: str, *words: str) -> StateError:
    """fn() raises StateError(code) whose reason contains every word, and the state is untouched."""
    before = copy.deepcopy(st.to_json())
    with pytest.raises(StateError) as e:
        fn()
    assert e.value.code == code, str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert st.to_json() == before
    return e.value


# -- join -------------------------------------------------------------------------------------------


def test_join_assigns_distinct_shards():
    st = make()
    recs = [st.join(n, "gpu", 2, T0) for n in "abcd"]
    assert [r.shard_index for r, _ in recs] == [0, 1, 2, 3]
    assert len({r.island_id for r, _ in recs}) == 4
    rec, reason = recs[2]
    assert rec.state == "live" and rec.lease_expiry == T0 + 15.0 and rec.hardware == "gpu" and rec.devices == 2
    assert "joined as c-2" in reason and "assigned free shard 2 at cursor 0" in reason
    assert st.shard_cursor(2) == 0


def test_rejoin_keeps_shard_and_id():
    st = make()
    join_all(st)
    st.expire(T0 + 15.0)
    rec, reason = st.join("b", "tpu", 8, T0 + 20)
    assert rec.island_id == "b-1" and rec.shard_index == 1 and rec.state == "live"
    assert rec.lease_expiry == T0 + 35.0 and rec.hardware == "tpu" and rec.devices == 8
    assert "rejoined as b-1 (was lost): kept shard 1" in reason
    assert len(st.islands) == 4
    # a live island restarting also gets its record back
    rec2, reason2 = st.join("b", "tpu", 8, T0 + 21)
    assert rec2 is rec and "rejoined as b-1 (was live)" in reason2


@pytest.mark.parametrize("args, field", [
    (("bad name", "cpu", 1), "name"), (("", "cpu", 1), "name"), (("x" * 65, "cpu", 1), "name"),
    (("a", "fpga", 1), "hardware"), (("a", "cpu", 0), "devices"), (("a", "cpu", -3), "devices"),
])
def test_join_rejects_bad_fields_without_change(args, field):
    st = make()
    st.join("z", "cpu", 1, T0)
    err = unchanged(st, lambda: st.join(*args, T0), "INVALID_ARGUMENT", field)
    assert str(err).startswith(("island name", "hardware", "devices"))


def test_fifth_island_refused_when_all_shards_live():
    st = make()
    join_all(st)
    unchanged(st, lambda: st.join("e", "cpu", 1, T0 + 1), "FAILED_PRECONDITION",
              "all 4 shards are held by live islands", "a-0 (shard 0)", "d-3 (shard 3)")


def test_lost_island_shard_taken_over_with_cursor():
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")
    push(st, info(st, a, start=0, end=100))
    push(st, info(st, b, start=0, end=70))
    st.close_round(T0)
    assert st.shard_cursor(0) == 100 and st.shard_cursor(1) == 70
    assert st.islands[b].cursor_merged == 70
    st.heartbeat(a, 1, 0, 0, 0.0, "", (), T0 + 10)  # a stays live, b goes quiet
    lost = st.expire(T0 + 15)
    assert [i for i, _ in lost] == [b] and "shard 1 is free" in lost[0][1]
    rec, reason = st.join("c", "gpu", 1, T0 + 16)
    assert rec.shard_index == 1 and rec.island_id == "c-1"
    assert "took over shard 1 of lost island b-1 at cursor 70" in reason
    assert st.shard_cursor(rec.shard_index) == 70
    # b comes back: its shard is now held by live c and no shard is free
    unchanged(st, lambda: st.join("b", "cpu", 1, T0 + 17), "FAILED_PRECONDITION",
              "b-1 cannot rejoin", "taken over by c-1")


def test_takeover_cursor_counts_the_lost_islands_pending_push():
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")
    push(st, info(st, b, start=0, end=50))
    st.heartbeat(a, 0, 0, 0, 0.0, "", (), T0 + 10)
    st.expire(T0 + 15)
    rec, reason = st.join("c", "cpu", 1, T0 + 16)
    assert rec.shard_index == 1 and "at cursor 50" in reason  # b's pending push will merge: don't retrain it
    push(st, info(st, a, start=0, end=40), T0 + 16)
    ready, why = st.round_ready(T0 + 16)
    assert not ready and "missing: c-1" in why  # the newcomer is live and has not pushed


def test_rejoin_moves_to_free_shard_when_taken_over():
    st = make("outer.islands=3")
    join_all(st, "ab")
    st.heartbeat("b-1", 0, 0, 0, 0.0, "", (), T0 + 10)
    st.expire(T0 + 15)  # a lost
    c, _ = st.join("c", "cpu", 1, T0 + 16)
    assert c.shard_index == 0
    rec, reason = st.join("a", "cpu", 1, T0 + 17)
    assert rec.island_id == "a-0" and rec.shard_index == 2
    assert "its shard 0 was taken over by c-0; took over shard 2, which no live island holds and has data left" \
        in reason


# -- heartbeat / expire -----------------------------------------------------------------------------


def test_heartbeat_renews_lease_and_records_report():
    st = make()
    a, *_ = join_all(st)
    action, reason = st.heartbeat(a, 0, 12, 3000, 4.5, "abc", ("gpu:3",), T0 + 10)
    assert action == "continue" and "holding the latest version 0" in reason and "t=1025.0" in reason
    r = st.islands[a]
    assert (r.lease_expiry, r.steps, r.tokens_reported, r.steps_per_s, r.params_digest, r.bad_devices) == \
        (T0 + 25, 12, 3000, 4.5, "abc", ("gpu:3",))
    assert a not in dict(st.expire(T0 + 24.9))
    assert st.islands[a].state == "live"
    assert dict(st.expire(T0 + 25))[a].startswith("no heartbeat for 15s")


def test_heartbeat_pull_stop_rejoin_and_errors():
    st = make("outer.islands=1", "train.steps=40")
    a, = join_all(st, "a")
    push(st, info(st, a, length=160))
    st.close_round(T0)
    assert st.heartbeat(a, 0, 1, 1, 1.0, "", (), T0 + 1) == ("pull", ("holding version 0, the global version is "
                                                                      "1: pull"))
    unchanged(st, lambda: st.heartbeat(a, 2, 1, 1, 1.0, "", (), T0 + 1), "INVALID_ARGUMENT",
              "version=2 is ahead of the coordinator's version 1")
    unchanged(st, lambda: st.heartbeat("nobody", 0, 1, 1, 1.0, "", (), T0 + 1), "NOT_FOUND", "'nobody'",
              "call Join first")
    unchanged(st, lambda: st.heartbeat(a, 1, 1, 1, float("nan"), "", (), T0 + 1), "INVALID_ARGUMENT",
              "steps_per_s")
    push(st, info(st, a, base=1, length=160))
    st.close_round(T0 + 2)
    assert st.stopped()
    over = "the run is over: all 1 shards' data (320 sequences each) merged, in 2 versions"
    # Told to stop, but without the last θ it stays live: finished() waits (up to linger_s) for its pull.
    assert st.heartbeat(a, 1, 1, 1, 1.0, "", (), T0 + 3) == ("stop", f"{over}: pull version 2, the last")
    assert st.islands[a].state == "live" and not st.finished(T0 + 3)[0]
    assert st.heartbeat(a, 2, 1, 1, 1.0, "", (), T0 + 3) == ("stop", over)
    assert st.islands[a].state == "stopped" and st.finished(T0 + 3)[0]
    assert st.expire(T0 + 1000) == []  # stopped islands are not "lost"
    # lost -> rejoin, lease not renewed
    st2 = make()
    b, *_ = join_all(st2)
    st2.expire(T0 + 15)
    before = st2.to_json()
    action, reason = st2.heartbeat(b, 0, 1, 1, 1.0, "", (), T0 + 16)
    assert action == "rejoin" and "lease expired at t=1015.0" in reason and "call Join again" in reason
    assert st2.to_json() == before


def _ev(device: int, index: int | None = None, probe: str = "known_answer", step: int = 50, **more: Any
        ) -> dict[str, Any]:
    """A heartbeat's evidence for one device, as the server passes it (absent numbers left out)."""
    return {"device": device, "index": device if index is None else index, "probe": probe, "step": step,
            "detail": f"{probe} failed", **more}


def test_heartbeat_records_quarantined_devices_once_and_for_good():
    st = make()
    a = st.join("a", "gpu", 8, T0)[0].island_id
    stats = _ev(5, probe="stats", step=120, value=9.5, z=14.0, median=1.0)
    st.heartbeat(a, 0, 60, 100, 1.0, "", ("3",), T0 + 1,
                 quarantined=[_ev(3, value=7.0, expected=8.0, mismatches=2)], devices=7)
    r = st.islands[a]
    assert (r.devices, r.mesh_devices, r.bad_devices) == (7, 8, ("3",))
    assert [(e.device, e.index, e.probe, e.step, e.value, e.expected, e.z, e.mismatches) for e in r.quarantined] == \
        [(3, 3, "known_answer", 50, 7.0, 8.0, None, 2)]
    # The next report names device 3 again (its first evidence stays) and device 5; bad_devices may be left out.
    st.heartbeat(a, 0, 130, 200, 1.0, "", (), T0 + 2,
                 quarantined=[_ev(3, step=99, value=1.0), stats], devices=6)
    assert [(e.device, e.step, e.value) for e in r.quarantined] == [(3, 50, 7.0), (5, 120, 9.5)]
    assert (r.devices, r.bad_devices) == (6, ("3", "5"))
    # A report without them (a final heartbeat, a restarted process) takes nothing out; devices=0 changes nothing.
    st.heartbeat(a, 0, 140, 210, 1.0, "", (), T0 + 3)
    assert [e.device for e in r.quarantined] == [3, 5] and (r.devices, r.bad_devices) == (6, ("3", "5"))
    # Status: each device with the numbers its probe measured (non-finite ones as strings: strict JSON).
    st.heartbeat(a, 0, 150, 220, 1.0, "", (), T0 + 4, quarantined=[_ev(1, probe="finite", value=float("nan"))])
    s = st.status(T0 + 4)
    json.dumps(s, allow_nan=False)
    (isl,) = s["islands"]
    assert isl["devices"] == 6 and isl["bad_devices"] == ["1", "3", "5"]
    assert isl["quarantined"] == [
        {"device": 3, "index": 3, "probe": "known_answer", "step": 50, "value": 7.0, "expected": 8.0,
         "mismatches": 2, "detail": "known_answer failed"},
        {"device": 5, "index": 5, "probe": "stats", "step": 120, "value": 9.5, "z": 14.0, "median": 1.0,
         "detail": "stats failed"},
        {"device": 1, "index": 1, "probe": "finite", "step": 50, "value": "nan", "detail": "finite failed"}]
    # The checkpoint keeps them (NaN included) and a restored state checks them.
    same = CoordinatorState.from_json(options(), json.loads(json.dumps(st.to_json())), T0 + 5)
    assert same.status(T0 + 4)["islands"][0]["quarantined"] == isl["quarantined"]
    # A rejoin after a remesh declares only the healthy devices: the mesh stays 8 and index 7 is still inside it.
    st.expire(T0 + 100)
    rec, _ = st.join("a", "gpu", 5, T0 + 101)
    assert (rec.devices, rec.mesh_devices) == (5, 8)
    st.heartbeat(a, 0, 150, 220, 1.0, "", (), T0 + 102, quarantined=[_ev(7)], devices=4)
    assert [e.device for e in rec.quarantined] == [3, 5, 1, 7] and rec.devices == 4


@pytest.mark.parametrize("kwargs, words", [
    ({"quarantined": [_ev(d) for d in range(9)]}, ("quarantined: 9 devices reported", "mesh holds 8")),
    ({"quarantined": [_ev(3), _ev(3, index=4)]}, ("quarantined[1]: device 3 is named twice",)),
    ({"quarantined": [_ev(3), _ev(4, index=3)]}, ("quarantined[1]: mesh index 3 is named twice",)),
    ({"quarantined": [_ev(3, index=8)]}, ("quarantined[0].index=8: outside a-0's mesh of 8 devices",)),
    ({"quarantined": [_ev(3, probe="astrology")]}, ("quarantined[0].probe: 'astrology' is not one of",)),
    ({"quarantined": [{**_ev(3), "detail": "x" * 513}]}, ("quarantined[0].detail: 513 characters, at most 512",)),
    ({"quarantined": [_ev(3, step=-1)]}, ("quarantined[0].step: expected an int >= 0",)),
    ({"quarantined": [_ev(3, value="7")]}, ("quarantined[0].value: expected a number",)),
    ({"quarantined": [{**_ev(3), "colour": "red"}]}, ("quarantined[0].colour: unknown key",)),
    ({"quarantined": [{"device": 3}]}, ("quarantined[0].index: missing",)),
    ({"devices": 9}, ("devices=9: must be an integer from 0",)),
    ({"devices": -1}, ("devices=-1",)),
    ({"devices": 8, "quarantined": [_ev(3)]}, ("devices=8 healthy and 1 quarantined: more than the 8 devices",)),
    ({"bad_devices": ("4",), "quarantined": [_ev(3)]}, ("bad_devices ['4'] do not name the quarantined devices",)),
])
def test_a_bad_chip_health_report_is_refused_and_changes_nothing(kwargs, words):
    st = make()
    a = st.join("a", "gpu", 8, T0)[0].island_id
    st.heartbeat(a, 0, 1, 1, 1.0, "", (), T0 + 1, quarantined=[_ev(6, index=6)], devices=7)
    bad = kwargs.pop("bad_devices", ())
    unchanged(st, lambda: st.heartbeat(a, 0, 2, 2, 1.0, "", bad, T0 + 2, **kwargs), "INVALID_ARGUMENT", *words)


def test_the_quarantined_devices_of_an_island_never_outnumber_its_mesh():
    st = make()
    a = st.join("a", "gpu", 4, T0)[0].island_id
    st.heartbeat(a, 0, 1, 1, 1.0, "", (), T0 + 1, quarantined=[_ev(0), _ev(1), _ev(2)])
    # Each report fits the mesh of 4, but the record would then hold 5 devices.
    unchanged(st, lambda: st.heartbeat(a, 0, 2, 2, 1.0, "", (), T0 + 2, quarantined=[_ev(10, index=0),
                                                                                      _ev(11, index=1)]),
              "INVALID_ARGUMENT", "a-0 would have 5 devices quarantined, its mesh holds 4")


def test_expire_exactly_at_lease_end_not_before():
    st = make("coordinator.lease_s=15")
    a, b, *_ = join_all(st)
    st.heartbeat(b, 0, 0, 0, 0.0, "", (), T0 + 5)
    assert st.next_deadline(T0) == T0 + 15.0
    assert st.expire(T0 + 14.999) == []
    assert st.islands[a].state == "live"
    lost = st.expire(T0 + 15.0)
    assert sorted(i for i, _ in lost) == ["a-0", "c-2", "d-3"]
    reason = dict(lost)["a-0"]
    assert "no heartbeat for 15s: lease expired at t=1015.0, shard 0 is free" == reason
    assert st.islands[a].state == "lost" and st.islands[b].state == "live"
    assert st.expire(T0 + 15.0) == []  # only newly lost ones are reported
    assert st.next_deadline(T0 + 15.0) == T0 + 20.0


def test_default_leases_find_a_dead_island_within_5s_and_the_sync_round_does_not_wait_longer():
    """With the default config (1 s heartbeats, 4 s leases), an island that dies at any moment between two
    heartbeats is lost within 4 s of its death (<= 5 s, the issue's target), and a sync round with the default
    min_quorum (every live island) closes then, not after its 30 s grace."""
    cfg = load_config(TINY, ["outer.islands=2", "train.steps=20000"])  # the defaults for lease and heartbeat
    assert (cfg.coordinator.lease_s, cfg.worker.heartbeat_s, cfg.coordinator.min_quorum) == (4.0, 1.0, 0)
    lease, beat = cfg.coordinator.lease_s, cfg.worker.heartbeat_s
    for died_after in (0.0, 0.5, 0.999):  # seconds after the dead island's last heartbeat
        st = CoordinatorState(StateOptions.from_config(cfg), "run-1", T0)
        a, b = join_all(st, "ab")
        last = T0 + 10 * beat
        for k in range(1, 11):  # both beat every second until t=10; then b dies, a beats on and pushes
            for i in (a, b):
                st.heartbeat(i, 0, 0, 0, 0.0, "", (), T0 + k * beat)
        death = last + died_after
        push(st, info(st, a), death)
        t = last
        while not st.expire(t):  # the server's ticker wakes at next_deadline; a beats on schedule
            st.heartbeat(a, 0, 0, 0, 0.0, "", (), t)
            t = min(st.next_deadline(t), t + beat)
        assert st.islands[b].state == "lost" and st.islands[a].state == "live"
        assert t == last + lease and t - death <= lease <= 5.0  # found within one lease (<= 4 heartbeats)
        assert st.round_ready(t) == (True, "all 1 live islands pushed")  # the round goes on at once


def test_paused_leases_forgive_the_time_the_coordinator_could_not_listen():
    st = make("outer.islands=2")
    a, b = join_all(st, "ab")  # leases end at T0 + 15
    st.expire(T0 + 20)  # (both lost: not paused in time) ...
    a2, b2 = join_all(st, "ab", now=T0 + 20)  # ... they rejoin: leases end at T0 + 35
    st.pause_leases(6.0)  # a merge held the lock 6 s past the deadline: heartbeats waited unheard
    assert st.next_deadline(T0 + 20) == T0 + 41 and st.expire(T0 + 40.9) == []
    assert sorted(i for i, _ in st.expire(T0 + 41)) == [a2, b2]
    st.pause_leases(3.0)  # only live islands' leases move
    assert st.islands[a].lease_expiry == T0 + 41
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        st.pause_leases(-1.0)


# -- sync rounds ------------------------------------------------------------------------------------


def test_sync_round_closes_when_all_live_pushed():
    st = make()
    ids = join_all(st)
    assert st.round_ready(T0) == (False, "waiting for the first push for version 1 (4 live islands)")
    for i in ids[:3]:
        adm = push(st, info(st, i, start=0, end=40))
        assert adm.status == "accept" and adm.target_version == 1 and adm.staleness == 0 and adm.weight == 1000.0
        assert adm.reason == "accepted for version 1: weight 1000 = 1000 tokens"
    ready, why = st.round_ready(T0 + 1)
    assert not ready and why == "waiting for 1 of 4 islands (missing: d-3); a quorum close needs 4 pushes, have 3"
    unchanged(st, lambda: st.close_round(T0 + 1), "FAILED_PRECONDITION", "cannot close", "missing: d-3")
    push(st, info(st, ids[3], tokens=500, start=0, end=20))
    assert st.round_ready(T0 + 2) == (True, "all 4 live islands pushed")
    assert [i.island_id for i, _ in st.pending()] == ids
    version, merged, reason = st.close_round(T0 + 2)
    assert version == 1 == st.version and [m.island_id for m in merged] == ids
    assert "merged 4 deltas (a-0, b-1, c-2, d-3; 3500 tokens) into version 1 (all 4 live islands pushed)" == reason
    assert st.pending() == [] and st.deltas_merged == 4 and st.tokens_merged == 3500
    assert st.islands["d-3"].tokens_merged == 500 and st.islands["d-3"].pushes_merged == 1
    assert st.islands["d-3"].cursor_merged == 20 and st.shard_cursor(3) == 20


def test_quorum_and_grace():
    st = make("coordinator.min_quorum=3", "coordinator.grace_s=30")
    a, b, c, d = join_all(st)
    push(st, info(st, a), T0)
    push(st, info(st, c), T0 + 5)
    assert st.round_ready(T0 + 40) == (False, ("waiting for 2 of 4 islands (missing: b-1, d-3); "
                                              "a quorum close needs 3 pushes, have 2"))
    push(st, info(st, d), T0 + 10)
    ready, why = st.round_ready(T0 + 18)
    assert not ready and why == "waiting for 1 of 4 islands (missing: b-1); quorum close possible in 12.0s"
    assert st.next_deadline(T0 + 18) == T0 + 15  # earliest lease first
    st.heartbeat(a, 0, 0, 0, 0, "", (), T0 + 14), st.heartbeat(b, 0, 0, 0, 0, "", (), T0 + 14)
    st.heartbeat(c, 0, 0, 0, 0, "", (), T0 + 14), st.heartbeat(d, 0, 0, 0, 0, "", (), T0 + 14)
    assert st.next_deadline(T0 + 18) == T0 + 29
    assert st.next_deadline(T0 + 29.5) == T0 + 29  # an overdue lease: expire() is due now
    for i in (a, b, c, d):
        st.heartbeat(i, 0, 0, 0, 0, "", (), T0 + 29.5)
    assert st.next_deadline(T0 + 29.5) == T0 + 30  # the grace end
    assert st.round_ready(T0 + 29.999)[0] is False
    assert st.round_ready(T0 + 30.0) == (True, "quorum 3 of 4 after 30s grace (missing: b-1)")
    version, merged, reason = st.close_round(T0 + 30)
    assert version == 1 and len(merged) == 3 and "quorum 3 of 4 after 30s grace (missing: b-1)" in reason


def test_lost_island_no_longer_blocks_round_and_its_push_stays():
    st = make()
    a, b, c, d = join_all(st)
    push(st, info(st, b), T0 + 1)
    for i in (a, c):
        st.heartbeat(i, 0, 0, 0, 0.0, "", (), T0 + 10)
        push(st, info(st, i), T0 + 10)
    assert st.round_ready(T0 + 11)[1].startswith("waiting for 1 of 4 islands (missing: d-3)")
    lost = dict(st.expire(T0 + 15))  # b (pending push) and d are lost
    assert set(lost) == {b, d}
    assert "its pending push" in lost[b] and "stays in the open round" in lost[b]
    assert st.round_ready(T0 + 15) == (True, "all 2 live islands pushed (+1 from islands no longer live)")
    _version, merged, _ = st.close_round(T0 + 15)
    assert {m.island_id for m in merged} == {a, b, c}
    assert st.islands[b].pushes_merged == 1


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


def test_a_lost_islands_shard_is_finished_by_an_island_whose_own_is_done():
    """Rerouting: a's shard is done, b is lost with its shard untrained; a's heartbeat says rejoin, its Join moves
    it to b's shard at b's cursor, and the run ends only when that data is merged too (a second version)."""
    st = make("outer.islands=2", "train.steps=20")  # one round of 160 sequences per shard
    a, b = join_all(st, "ab")
    st.heartbeat(a, 0, 0, 0, 0.0, "", (), T0 + 10)
    st.expire(T0 + 15)  # b lost
    push(st, info(st, a, length=160), T0 + 16)
    assert st.close_round(T0 + 16)[0] == 1 and not st.stopped()
    assert not st.data_left(0) and st.data_left(1)
    action, reason = st.heartbeat(a, 1, 20, 0, 0.0, "", (), T0 + 17)
    assert action == "rejoin" and "shard 0 is done and shard 1 has data no live island trains (from cursor 0)" \
        in reason
    rec, why = st.join("a", "cpu", 1, T0 + 17)
    assert rec.island_id == a and rec.shard_index == 1 and "its shard 0 is done; took over shard 1" in why
    assert st.round_ready(T0 + 17)[1].startswith("waiting for the first push")
    push(st, info(st, a, base=1, length=160), T0 + 18)  # shard 1, from its cursor 0
    assert st.close_round(T0 + 18)[0] == 2 and st.stopped()
    assert st.ledger.shard_cursors == [160, 160] and st.tokens_merged == 2000
    unchanged(st, lambda: st.join("b", "cpu", 1, T0 + 19), "FAILED_PRECONDITION",
              "the run is over: all 2 shards' data (160 sequences each) merged, in 2 versions: nothing left to train")
    unchanged(st, lambda: st.join("newcomer", "cpu", 1, T0 + 19), "FAILED_PRECONDITION", "the run is over")
    assert st.heartbeat(b, 0, 0, 0, 0.0, "", (), T0 + 19)[0] == "stop"
    assert st.islands[b].state == "lost"  # told to stop, not brought back


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


def test_finished_when_live_islands_hold_the_last_version_or_the_linger_ends():
    st = make("outer.islands=3", "train.steps=20", linger_s=10.0)  # a run of one version
    a, b, c = join_all(st, "abc")
    assert st.finished(T0) == (False, "the run goes on: 0 of 1 versions merged")
    for i in (a, b, c):
        push(st, info(st, i, length=160))
    st.close_round(T0 + 1)
    assert st.finished(T0 + 2) == (False, ("the run is over (1 versions); waiting up to 9.0s for islands without "
                                           "version 1: a-0, b-1, c-2"))
    assert st.next_deadline(T0 + 2) == T0 + 11  # the linger ends before the leases (T0 + 15)
    assert st.heartbeat(a, 1, 0, 0, 0.0, "", (), T0 + 3)[0] == "stop"  # a holds version 1 and stops
    assert st.finished(T0 + 3)[1].endswith("waiting up to 8.0s for islands without version 1: b-1, c-2")
    assert st.finished(T0 + 11) == (True, ("the run is over (1 versions); gave up after 10s on islands without "
                                           "version 1: b-1, c-2"))
    assert st.next_deadline(T0 + 11) == T0 + 15  # past the linger: leases only
    # A resumed run that was already over lingers from the restart.
    again = CoordinatorState.from_json(st.opts, st.to_json(), T0 + 50)
    assert again.finished(T0 + 50)[1].endswith("waiting up to 10.0s for islands without version 1: b-1, c-2")
    # Islands that hold the last version (b) or are lost (c) end it at once.
    st.heartbeat(b, 1, 0, 0, 0.0, "", (), T0 + 4)
    st.expire(T0 + 15)
    assert st.finished(T0 + 15) == (True, "the run is over (1 versions) and every live island holds version 1")


def test_options_come_from_the_config():
    cfg = load_config(TINY)
    opts = StateOptions.from_config(cfg)
    assert opts.coordinator is cfg.coordinator  # lease_s, grace_s, ...: the config's values, no second default
    assert (opts.islands, opts.staleness_alpha, opts.total_versions) == (4, 0.5, cfg.rounds) == (4, 0.5, 3)
    assert StateOptions.from_config(load_config(TINY, ["coordinator.mode=async"])).total_versions == 3 * 4
    with pytest.raises(ValueError, match="max_push_ids=0"):
        StateOptions.from_config(cfg, max_push_ids=0)


def test_check_pull_refuses_unknown_islands_and_future_versions():
    st = make()
    a, *_ = join_all(st)
    st.check_pull(a, 0)
    unchanged(st, lambda: st.check_pull("ghost-9", 0), "NOT_FOUND", "unknown island_id 'ghost-9'")
    unchanged(st, lambda: st.check_pull(a, 1), "INVALID_ARGUMENT", "have_version=1 is ahead of the coordinator's")


# -- checkpoint -------------------------------------------------------------------------------------


def busy_state() -> CoordinatorState:
    st = make("coordinator.min_quorum=2")
    a, b, c, d = join_all(st)
    st.heartbeat(a, 0, 10, 100, 2.5, "dig", ("gpu:1",), T0 + 1)
    push(st, info(st, a, push_id="m1", start=0, end=35), T0 + 1)
    push(st, info(st, b, push_id="m2"), T0 + 1)
    push(st, info(st, c, push_id="m3"), T0 + 1)
    push(st, info(st, d, push_id="m4"), T0 + 1)
    st.close_round(T0 + 1)
    st.commit_push(info(st, a, push_id="m1"), T0 + 2)
    push(st, info(st, b, base=1, push_id="open-1"), T0 + 3)
    return st


def _no_leases(blob: dict) -> dict:
    blob = copy.deepcopy(blob)
    for r in blob["islands"]:
        r.pop("lease_expiry")
    return blob


def test_json_round_trip():
    st = busy_state()
    blob = st.to_json()
    text = json.dumps(blob)
    same = CoordinatorState.from_json(options("coordinator.min_quorum=2"), json.loads(text), T0 + 500)
    assert _no_leases(same.to_json()) == _no_leases(blob)  # only the leases move: renewed to now + lease_s
    assert all(r.lease_expiry == T0 + 515 for r in same.islands.values())
    assert same.admit_push(info(same, "a-0", push_id="m1"), T0).status == "duplicate"
    assert [i.push_id for i, _ in same.pending()] == ["open-1"]
    assert same.round_ready(T0 + 500) == st.round_ready(T0 + 500)
    assert (same.version, same.tokens_merged, same.duplicates, same.shard_cursor(0)) == (1, 4000, 1, 35)
    # leases that all end at now + lease_s: the round trip is exact
    st2 = make("outer.islands=2")
    join_all(st2, "ab")
    blob2 = json.loads(json.dumps(st2.to_json()))
    assert CoordinatorState.from_json(options("outer.islands=2"), blob2, T0).to_json() == st2.to_json()


def _mut(path, value):
    def f(blob):
        target = blob
        for k in path[:-1]:
            target = target[k]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return f


@pytest.mark.parametrize("mutate, words", [
    (lambda b: "not a dict", ("state: expected an object",)),
    (_mut(["format"], 99), ("state.format",)),
    (_mut(["format"], True), ("state.format",)),
    (_mut(["islands", 0, "colour"], "red"), ("state.islands[0].colour: unknown key",)),
    (_mut(["islands", 0, "steps"], KeyError), ("state.islands[0].steps: missing",)),
    (_mut(["pending", 0, "admission", "status"], "drop"), ("state.pending[0].admission.status",)),
    (_mut(["shards"], 8), ("state.shards", "8 shards")),
    (_mut(["version"], -1), ("state.version",)),
    (_mut(["version"], "3"), ("state.version",)),
    (_mut(["counters"], KeyError), ("state.counters",)),
    (_mut(["counters", "tokens_merged"], 1.5), ("state.counters.tokens_merged",)),
    (_mut(["islands"], {}), ("state.islands: expected a list",)),
    (_mut(["islands", 0, "shard_index"], 4), ("state.islands[0].shard_index",)),
    (_mut(["islands", 0, "hardware"], "fpga"), ("state.islands[0].hardware",)),
    (_mut(["islands", 1, "state"], "zombie"), ("state.islands[1].state",)),
    (_mut(["islands", 1, "name"], "a"), ("duplicate name",)),
    (_mut(["islands", 1, "shard_index"], 0), ("held by two live islands",)),
    (_mut(["islands", 2, "steps_per_s"], float("nan")), ("state.islands[2].steps_per_s",)),
    (_mut(["islands", 2, "bad_devices"], [3]), ("bad_devices",)),
    (_mut(["islands", 3, "version"], 9), ("state.islands[3].version",)),
    (_mut(["islands", 0, "devices"], 2), ("state.islands[0].devices", "more than its mesh_devices 1")),
    (_mut(["islands", 0, "quarantined"], [{"device": 0, "index": 1, "probe": "stats", "step": 0, "value": None,
                                           "expected": None, "z": None, "median": None, "mismatches": None,
                                           "detail": ""}]), ("state.islands[0].quarantined[0].index",)),
    (_mut(["islands", 0, "quarantined"], [{"device": 0, "index": 0, "probe": "magic", "step": 0, "value": None,
                                           "expected": None, "z": None, "median": None, "mismatches": None,
                                           "detail": ""}]), ("state.islands[0].quarantined[0].probe",)),
    (_mut(["shard_cursors"], [0, 0]), ("state.shard_cursors", "expected 4 entries")),
    (_mut(["push_ids", 0], ["x", "a-0", "merged"]), ("state.push_ids[0]",)),
    (_mut(["push_ids", 0, 2], "eaten"), ("state.push_ids[0].status",)),
    (_mut(["pending", 0, "info", "island_id"], "ghost"), ("unknown island 'ghost'",)),
    (_mut(["pending", 0, "admission", "target_version"], 7), ("target_version",)),
    (_mut(["pending", 0, "info", "push_id"], "m2"), ("'m2' is repeated",)),
    (_mut(["first_pending"], None), ("state.first_pending",)),
])
def test_from_json_rejects_malformed(mutate, words):
    blob = busy_state().to_json()
    if callable(mutate):
        out = mutate(blob)
        blob = out if out is not None else blob
    with pytest.raises(StateError) as e:
        CoordinatorState.from_json(options("coordinator.min_quorum=2"), blob, T0)
    assert e.value.code == "INVALID_ARGUMENT"
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_status_contents():
    st = busy_state()
    s = st.status(T0 + 10)
    json.dumps(s)
    assert (s["run_id"], s["version"], s["mode"], s["live"], s["stopped"]) == ("run-1", 1, "sync", 4, False)
    assert (s["deltas_merged"], s["deltas_dropped"], s["duplicates"], s["tokens_merged"]) == (4, 0, 1, 4000)
    isl = {i["island_id"]: i for i in s["islands"]}
    assert isl["a-0"]["lease_left_s"] == 6.0 and isl["b-1"]["lease_left_s"] == 5.0
    assert isl["a-0"]["bad_devices"] == ["gpu:1"] and isl["a-0"]["steps_per_s"] == 2.5
    assert isl["a-0"]["tokens_merged"] == 1000 and isl["a-0"]["cursor_merged"] == 35
    assert s["shard_cursors"] == [35, 80, 40, 40]  # shard 1: its pending push open-1 ends at 80
    rnd = s["round"]
    assert rnd["target_version"] == 2 and rnd["ready"] is False and [p["push_id"] for p in rnd["pending"]] == \
        ["open-1"]
    assert rnd["reason"] == "waiting for 3 of 4 islands (missing: a-0, c-2, d-3); a quorum close needs 2 " \
                            "pushes, have 1"
    st.expire(T0 + 16)
    assert all(i["lease_left_s"] == 0.0 and i["state"] == "lost" for i in st.status(T0 + 16)["islands"])


# -- deltas cannot poison θ: the weight bound, the norm screen, rejections ------------------------------------


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
