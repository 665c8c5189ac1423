"""The typed Status the coordinator answers (and the dashboard shows): islands' reports, rounds with their bytes,
the global evals the coordinator asks islands for, faults; and the JSON form (dtrain.status_doc.message_dict)."""

import dataclasses
import json

import grpc
import numpy as np
import pytest

from coordinator.history import EVAL_REASSIGN_S, RunHistory, check_eval_reports
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import MAX_EVAL_REPORTS
from dtrain.runlog import read_events
from dtrain.status_doc import message_dict
from service_helpers import Running, delta_frame, join_island, push_header
from workers.client import CoordinatorClient


@pytest.fixture
def coord(net_cfg, tmp_path):
    running = Running(net_cfg, tmp_path / "coord")
    yield running
    running.stop()


def _merge_one_round(coord, net_cfg):
    clients = [CoordinatorClient(coord.address, net_cfg) for _ in range(2)]
    joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
    n = joins[0].tree_size
    frames = [delta_frame(n, i)[1] for i in range(2)]
    for c, j, f, name in zip(clients, joins, frames, ("p0", "p1"), strict=True):
        c.push(push_header(j, name), f)
    return clients, joins, frames


def test_status_shows_rounds_with_their_bytes_and_each_islands_reports(coord, net_cfg):
    clients, joins, frames = _merge_one_round(coord, net_cfg)
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
    stub.Heartbeat(pb.HeartbeatRequest(island_id=joins[0].island_id, version=0, steps=10, tokens=640,
                                       train_loss=2.5, utilization=0.75), timeout=10)
    st = clients[0].status()
    assert st.version == 1 and st.total_versions == 0  # step rounds: the data decides
    assert st.tokens_total == 2 * 40 * 8 * net_cfg.model.seq_len  # islands x train.steps x batch x seq_len
    (rnd,) = st.rounds
    assert (rnd.version, rnd.pushes, rnd.tokens) == (1, 2, 1280)
    assert rnd.bytes_in == sum(len(f) for f in frames) == st.bytes_in
    a, b = st.islands  # by shard
    assert (a.shard_index, b.shard_index) == (0, 1) and a.hardware == "cpu" and a.devices == 1
    assert a.train_loss == 2.5 and a.utilization == 0.75 and a.steps == 10 and a.tokens == 640
    assert not b.HasField("train_loss")  # never reported: absent, not 0
    assert a.bytes_in == len(frames[int(a.island_id != joins[0].island_id)]) and a.cursor == 80
    assert st.round.target_version == 2 and st.round.pending == 0
    doc = message_dict(st)
    assert json.loads(json.dumps(doc)) == doc  # strict JSON
    assert doc["version"] == 1 and isinstance(doc["bytes_in"], int) and doc["islands"][0]["shard_index"] == 0
    assert doc["islands"][1]["train_loss"] is None and doc["rounds"][0]["bytes_in"] == rnd.bytes_in
    for c in clients:
        c.close()


def _report(stub, island_id: str, version: int, loss: float) -> None:
    stub.Heartbeat(pb.HeartbeatRequest(island_id=island_id, version=version,
                                       evals=[pb.EvalReport(version=version, loss=loss)]), timeout=10)


def test_two_islands_evaluate_each_version_and_agreeing_reports_are_a_confirmed_figure(coord, net_cfg, tmp_path):
    clients = [CoordinatorClient(coord.address, net_cfg) for _ in range(2)]
    a, b = (join_island(c, f"isl-{i}") for i, c in enumerate(clients))
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
    # Every island starts with a full pull of θ_0: both are asked to evaluate it (eval_every=5: v0, v5, ...).
    assert [f.header.evaluate for f in clients[0].pull(a.island_id, 0, full=True)] == [True]
    for _ in range(2):  # the island sends its report until a heartbeat is answered: a retry is recorded once
        _report(stub, a.island_id, 0, 3.25)
    assert list(clients[0].status().evals) == []  # held: b, live, can check it
    _report(stub, b.island_id, 0, 3.25)  # not asked of b yet: ignored
    assert list(clients[0].status().evals) == []
    assert [f.header.evaluate for f in clients[1].pull(b.island_id, 0, full=True)] == [True]
    _report(stub, b.island_id, 0, 3.2501)  # within EVAL_RTOL: the same θ and batches on another device
    st = clients[0].status()
    assert [(e.version, e.loss, e.tokens, e.island_id, e.confirmed, list(e.confirmed_by)) for e in st.evals] == \
        [(0, pytest.approx(3.25005), 0, "isl-0", True, ["isl-0", "isl-1"])]  # the islands' names
    assert st.eval_loss == pytest.approx(3.25005) and st.eval_confirmed
    evals = [e for e in read_events(tmp_path / "coord") if e["event"] == "eval"]
    assert [(e["version"], e["confirmed"], e["confirmed_by"]) for e in evals] == \
        [(0, True, ["isl-0", "isl-1"])]
    assert [f.header.evaluate for f in clients[1].pull(b.island_id, 0, full=True)] == [False]  # settled
    for c in clients:
        c.close()


def test_a_forged_eval_report_never_becomes_a_confirmed_figure(net_cfg, tmp_path):
    """The issue's attack: an island asked to evaluate v0 reports 0.0123 while the other reports the true loss. The
    two disagree: an eval_disagreement fault names both, no figure is recorded, and a third island is asked."""
    coord = Running(dataclasses.replace(net_cfg, outer=dataclasses.replace(net_cfg.outer, islands=3)),
                    tmp_path / "coord")
    try:
        _forged_eval(coord, net_cfg, tmp_path)
    finally:
        coord.stop()


def _forged_eval(coord, net_cfg, tmp_path) -> None:
    clients = [CoordinatorClient(coord.address, net_cfg) for _ in range(3)]
    joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
    for c, j in zip(clients[:2], joins[:2], strict=True):
        assert [f.header.evaluate for f in c.pull(j.island_id, 0, full=True)] == [True]
    _report(stub, joins[0].island_id, 0, 0.0123)  # forged
    _report(stub, joins[1].island_id, 0, 6.93)  # the true loss
    st = clients[0].status()
    assert list(st.evals) == [] and not st.HasField("eval_loss")
    (fault,) = [f for f in st.faults if f.kind == "eval_disagreement"]
    assert "isl-0 reported 0.0123" in fault.detail and "isl-1 reported 6.93" in fault.detail  # by name
    (ev,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "eval_disagreement"]
    assert ev["reports"] == {joins[0].island_id: 0.0123, joins[1].island_id: 6.93}
    # a third island breaks the tie: the honest pair is the figure, confirmed; the forger is not among them
    assert [f.header.evaluate for f in clients[2].pull(joins[2].island_id, 0, full=True)] == [True]
    _report(stub, joins[2].island_id, 0, 6.93)
    (point,) = clients[0].status().evals
    assert point.confirmed and point.loss == 6.93 and list(point.confirmed_by) == ["isl-1", "isl-2"]
    for c in clients:
        c.close()


def test_the_only_islands_eval_is_recorded_but_marked_unconfirmed(coord, net_cfg, tmp_path):
    client = CoordinatorClient(coord.address, net_cfg)
    join = join_island(client, "alone")
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
    assert [f.header.evaluate for f in client.pull(join.island_id, 0, full=True)] == [True]
    _report(stub, join.island_id, 0, 0.0123)  # no other live island to check it
    st = client.status()
    assert [(e.loss, e.confirmed, list(e.confirmed_by)) for e in st.evals] == [(0.0123, False, [])]
    assert st.eval_loss == 0.0123 and not st.eval_confirmed
    (ev,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "eval"]
    assert ev["confirmed"] is False and (ev["island"], ev["island_id"]) == ("alone", join.island_id)
    client.close()


def test_evals_are_spread_over_the_live_islands_not_all_asked_of_the_first_puller():
    h, live = RunHistory(), ["a", "b", "c"]
    # v0: nobody has evaluated yet, so the first puller is asked, and the next as the second opinion.
    assert h.assign_eval("a", 0, False, 5, 0.0, live)
    assert h.assign_eval("b", 0, False, 5, 0.5, live)
    assert not h.assign_eval("c", 0, False, 5, 0.6, live)  # two asked, still expected to answer
    # v5: a pulls first, but c (asked fewer) has not pulled it yet: a is passed over; c is asked, then a second.
    assert not h.assign_eval("a", 5, False, 5, 1.0, live)
    assert h.assign_eval("c", 5, False, 5, 2.0, live)
    assert h.assign_eval("b", 5, False, 5, 3.0, live)
    assert not h.assign_eval("a", 5, False, 5, 3.5, live)
    assert h.evals_asked == {"a": 1, "b": 2, "c": 1}
    # An asked island that has not answered for EVAL_REASSIGN_S is replaced.
    assert h.assign_eval("a", 5, False, 5, 3.0 + EVAL_REASSIGN_S, live)
    # The final version goes to its first pullers, and a version off the grid to nobody.
    assert h.assign_eval("a", 17, True, 5, 8.0, live)
    assert not h.assign_eval("b", 16, False, 5, 9.0, live)


def test_the_final_version_is_evaluated_with_the_tokens_merged_into_it(net_cfg, tmp_path):
    cfg = dataclasses.replace(net_cfg, train=dataclasses.replace(net_cfg.train, steps=10))  # one push per shard
    coord = Running(cfg, tmp_path / "coord")
    try:
        clients = [CoordinatorClient(coord.address, cfg) for _ in range(2)]
        joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
        for c, j, name in zip(clients, joins, ("p0", "p1"), strict=True):
            c.push(push_header(j, name), delta_frame(j.tree_size, len(name))[1])
        st = clients[0].status()
        assert st.version == 1 and st.stopped  # every shard's data merged: version 1 is the final one
        (first,) = clients[1].pull(joins[1].island_id, 0)
        (second,) = clients[0].pull(joins[0].island_id, 0)
        assert first.header.version == 1 and first.header.evaluate and second.header.evaluate  # two opinions
        clients[1].heartbeat(island_id=joins[1].island_id, version=1)
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
        for j in joins:
            _report(stub, j.island_id, 1, 2.0)
        st = clients[0].status()
        assert [(e.version, e.tokens, e.loss, e.confirmed) for e in st.evals] == [(1, 1280, 2.0, True)]
        assert st.eval_loss == 2.0 and st.eval_confirmed
        for c in clients:
            c.close()
    finally:
        coord.stop()


@pytest.mark.parametrize("request_fields, message", [
    ({"train_loss": float("nan")}, "train_loss=nan"),
    ({"train_loss": -1.0}, "train_loss=-1.0"),
    ({"utilization": 1.5}, "utilization=1.5"),
    ({"evals": [pb.EvalReport(version=7, loss=1.0)]}, "version 7 is newer"),
    ({"evals": [pb.EvalReport(version=0, loss=float("inf"))]}, "loss inf"),
    ({"evals": [pb.EvalReport(version=0, loss=1.0)] * (MAX_EVAL_REPORTS + 1)}, "at most 16"),
])
def test_a_heartbeat_with_an_impossible_report_is_refused_and_changes_nothing(coord, net_cfg, request_fields,
                                                                             message):
    client = CoordinatorClient(coord.address, net_cfg)
    join = join_island(client, "a")
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coord.address))
    with coord.service.lock:
        before = coord.service.state.to_json()
        expiry = coord.service.state.islands[join.island_id].lease_expiry
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(pb.HeartbeatRequest(island_id=join.island_id, version=0, steps=5, **request_fields), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    with coord.service.lock:
        assert coord.service.state.to_json() == before
        assert coord.service.state.islands[join.island_id].lease_expiry == expiry
    (isl,) = client.status().islands
    assert not isl.HasField("train_loss") and isl.utilization == 0.0 and isl.steps == 0
    client.close()


def test_history_is_a_fold_over_events_and_a_resume_rolls_back_unsaved_merges(tmp_path):
    h = RunHistory()
    push = {"tokens": 100, "bytes": 10, "staleness": 1}
    for v in (1, 2, 3):
        h.observe({"event": "round_merged", "t": float(v), "version": v, "pushes": [push, push], "merge_s": 0.5})
    h.observe({"event": "push_received", "t": 4.0, "island": "x", "status": "drop", "reason": "too stale"})
    h.observe({"event": "coordinator_resumed", "t": 5.0, "version": 2})  # v3 was merged, never checkpointed
    assert [r.version for r in h.rounds] == [1, 2] and h.tokens_merged_at(2) == 400 and h.tokens_merged_at(3) == 400
    h.observe({"event": "round_merged", "t": 6.0, "version": 3, "pushes": [push], "merge_s": 0.1})
    assert h.tokens_merged_at(3) == 500 and h.rounds[-1].bytes_in == 10 and h.rounds[-1].max_staleness == 1
    assert [(f.kind, f.island_id, f.detail) for f in h.faults] == [("delta_dropped", "x", "too stale"),
                                                                   ("coordinator_resumed", "", "resumed at version 2")]
    assert check_eval_reports([(3, 1.0)], 3) == "" and "newer" in check_eval_reports([(4, 1.0)], 3)
    assert "finite" in check_eval_reports([(1, float("nan"))], 3) and "finite" in check_eval_reports([(1, -0.5)], 3)
    assert np.isfinite(h.rounds[0].merge_s)
