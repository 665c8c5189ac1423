"""coordinator.state: decisions and reasons, with an injected clock (no network, no JAX, no sleeps).

The options, pulls, the checkpoint and Status; the helpers the state tests share are in state_helpers.py."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import TINY
from coordinator.records import StateError, StateOptions
from coordinator.state import CoordinatorState
from dtrain.config.load import load_config
from state_helpers import T0, info, join_all, make, options, push, unchanged

# -- the state as a whole -------------------------------------------------------------------------------


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


def test_lost_and_quarantined_islands_get_no_pulls():
    """A lost island's pull is refused until it rejoins (busy: its worker retries while its heartbeat rejoins); a
    quarantined one's for good (stopped)."""
    st = make()
    a, b, *_ = join_all(st)
    st.expire(T0 + 100)  # every lease over: all lost
    e = unchanged(st, lambda: st.check_pull(a, 0), "FAILED_PRECONDITION", f"{st.islands[a].name} is lost",
                  "rejoin (call Join again)")
    assert e.busy and not e.stopped
    st.join("a", "cpu", 1, T0 + 101)  # rejoined: served again
    st.check_pull(a, 0)
    st.islands[b].state, st.islands[b].stop_reason = "quarantined", "quarantined: 3 pushes in a row rejected"
    e = unchanged(st, lambda: st.check_pull(b, 0), "FAILED_PRECONDITION", f"{st.islands[b].name} is quarantined",
                  "3 pushes in a row")
    assert e.stopped and not e.busy


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
    (_mut(["segments", 1, "start"], 5), ("state.segments[1].start", "contiguous from 0")),
    (_mut(["segments", 0, "end"], 10**6), ("state.segments[0].end", "at most the shard's end")),
    (_mut(["segments", 2, "merged"], 10**6), ("state.segments[2].merged", "must lie in the segment")),
    (_mut(["segments"], []), ("state.segments", "shard 0's segments end at 0")),
    (_mut(["islands", 0, "segment_start"], 7), ("state.islands[0].segment_start", "no segment starting there")),
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
    assert rnd["reason"] == "waiting for 3 of 4 islands (missing: a, c, d); a quorum close needs 2 " \
                            "pushes, have 1"
    st.expire(T0 + 16)
    assert all(i["lease_left_s"] == 0.0 and i["state"] == "lost" for i in st.status(T0 + 16)["islands"])


# A checkpoint's state with a push pending, as the coordinator wrote it before the open round's pushes were kept in
# one set (coordinator/pending.py; snapshot format 2): two islands, version 1 merged, island b's push for version 2
# pending.
PENDING_FORMAT_2 = (
    '{"format": 2, "run_id": "run-1", "created": 1000.0, "shards": 2, "version": 1, "counters": '
    '{"deltas_merged": 2, "deltas_dropped": 0, "duplicates": 0, "tokens_merged": 2000, "deltas_rejected":'
    ' 0}, "islands": [{"island_id": "a-0", "name": "a", "hardware": "cpu", "devices": 1, "mesh_devices": '
    '1, "shard_index": 0, "state": "live", "lease_expiry": 1015.0, "segment_start": 0, "version": 0, '
    '"steps": 0, "tokens_reported": 0, "steps_per_s": 0.0, "tokens_per_s": 0.0, "tokens_merged": 1000, '
    '"pushes_merged": 1, "cursor_merged": 40, "params_digest": "", "bad_devices": [], "quarantined": [], '
    '"rejections": 0, "throttled_until": 0.0, "stop_reason": ""}, {"island_id": "b-1", "name": "b", '
    '"hardware": "cpu", "devices": 1, "mesh_devices": 1, "shard_index": 1, "state": "live", '
    '"lease_expiry": 1015.0, "segment_start": 0, "version": 0, "steps": 0, "tokens_reported": 0, '
    '"steps_per_s": 0.0, "tokens_per_s": 0.0, "tokens_merged": 1000, "pushes_merged": 1, "cursor_merged":'
    ' 40, "params_digest": "", "bad_devices": [], "quarantined": [], "rejections": 0, "throttled_until": '
    '0.0, "stop_reason": ""}], "segments": [{"shard": 0, "start": 0, "end": 160000, "merged": 40}, '
    '{"shard": 1, "start": 0, "end": 160000, "merged": 40}], "pending": [{"info": {"push_id": "open-1", '
    '"island_id": "b-1", "base_version": 1, "tokens": 1000, "inner_steps": 5, "cursor_start": 40, '
    '"cursor_end": 80, "shard_index": 1}, "admission": {"status": "accept", "weight": 1000.0, '
    '"staleness": 0, "target_version": 2, "reason": "accepted for version 2: weight 1000 = 1000 tokens", '
    '"norm": 0.0, "scale": 1.0}, "received": 1003.0}], "first_pending": 1003.0, "push_ids": [["m1", '
    '"a-0", "merged", 1, 0], ["m2", "b-1", "merged", 1, 0]], "norms": [], "bindings": []}'
)


def test_a_checkpoint_written_before_the_one_pending_set_restores_into_it():
    st = CoordinatorState.from_json(options("outer.islands=2"), json.loads("".join(PENDING_FORMAT_2)), T0 + 10)
    assert st.version == 1 and list(st.ledger.pending) == ["open-1"]
    assert [i.push_id for i, _ in st.pending()] == ["open-1"] and st.ledger.first_pending == T0 + 3
    assert st.ledger.pending.spooled() == []  # no payload in a checkpoint: whoever restores holds the sum
    assert st.shard_cursor(1) == 80 and st.shard_cursor(0) == 40  # the pending push counts in its shard's cursor
    assert st.admit_push(info(st, "b-1", base=1, push_id="open-1"), T0 + 10).status == "duplicate"
    written = json.loads("".join(PENDING_FORMAT_2))
    assert _no_leases(st.to_json()) == _no_leases(written)  # written back the same way
    push(st, info(st, "a-0", base=1, push_id="a-2"), T0 + 11)
    version, merged, _ = st.close_round(T0 + 11)
    assert version == 2 and [i.push_id for i in merged] == ["open-1", "a-2"] and not st.ledger.pending
    assert st.shard_cursor(1) == 80 and st.deltas_merged == 4
