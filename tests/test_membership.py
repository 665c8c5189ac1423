"""coordinator.membership through CoordinatorState: joins, shards and rerouting, heartbeats and their
chip-health reports, leases (an injected clock; helpers from state_helpers.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import TINY
from coordinator.records import StateOptions
from coordinator.state import CoordinatorState
from dtrain.config.load import load_config
from state_helpers import T0, info, join_all, make, options, push, unchanged


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
              "all 4 shards are held by live islands", "a (shard 0)", "d (shard 3)")


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
    assert "took over shard 1 of lost island b at cursor 70" in reason
    assert st.shard_cursor(rec.shard_index) == 70
    # b comes back: its shard is now held by live c and no shard is free
    unchanged(st, lambda: st.join("b", "cpu", 1, T0 + 17), "FAILED_PRECONDITION",
              "b cannot rejoin", "taken over by c and")


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
    assert not ready and "missing: c" in why  # the newcomer is live and has not pushed


def test_rejoin_moves_to_free_shard_when_taken_over():
    st = make("outer.islands=3")
    join_all(st, "ab")
    st.heartbeat("b-1", 0, 0, 0, 0.0, "", (), T0 + 10)
    st.expire(T0 + 15)  # a lost
    c, _ = st.join("c", "cpu", 1, T0 + 16)
    assert c.shard_index == 0
    rec, reason = st.join("a", "cpu", 1, T0 + 17)
    assert rec.island_id == "a-0" and rec.shard_index == 2
    assert "its shard 0 was taken over by c; took over shard 2, which no live island holds and has data left" \
        in reason


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
    ({"quarantined": [_ev(3, index=8)]}, ("quarantined[0].index=8: outside a's mesh of 8 devices",)),
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
              "INVALID_ARGUMENT", "a would have 5 devices quarantined, its mesh holds 4")


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
    assert [st.shard_cursor(s) for s in (0, 1)] == [160, 160] and st.tokens_merged == 2000
    unchanged(st, lambda: st.join("b", "cpu", 1, T0 + 19), "FAILED_PRECONDITION",
              "the run is over: all 2 shards' data (160 sequences each) merged, in 2 versions: nothing left to train")
    unchanged(st, lambda: st.join("newcomer", "cpu", 1, T0 + 19), "FAILED_PRECONDITION", "the run is over")
    assert st.heartbeat(b, 0, 0, 0, 0.0, "", (), T0 + 19)[0] == "stop"
    assert st.islands[b].state == "lost"  # told to stop, not brought back
