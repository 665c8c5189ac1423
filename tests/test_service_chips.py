"""Chip health over the wire: quarantined devices in heartbeats, Status and `dtrain status`, and bad reports
refused."""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest

from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.runlog import read_events
from service_helpers import assert_unchanged, snapshot
from workers.client import CoordinatorClient

# -- chip health: quarantined devices in heartbeats, Status and `dtrain status` ---------------------------------

# As workers/chip_health.py writes them (non-finite numbers by name; an event's extra keys, such as healthy, ignored).
_KNOWN_ANSWER = {"device": 3, "index": 3, "probe": "known_answer", "step": 50, "value": 7.0, "expected": 8.0,
                 "mismatches": 2, "detail": "known answer 7.0 != 8.0 (2 entries wrong)"}
_NON_FINITE = {"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
               "detail": "micro-batch loss or gradient not finite", "healthy": 6}


def test_the_client_converts_chips_evidence_dicts():
    from dtrain.net.wire import MAX_EVIDENCE_DETAIL
    from workers.client import evidence_message

    m = evidence_message(_NON_FINITE)
    assert (m.device, m.index, m.probe, m.step, m.detail) == (0, 0, "finite", 61, _NON_FINITE["detail"])
    assert m.HasField("value") and np.isnan(m.value)
    assert not any(m.HasField(f) for f in ("expected", "z", "median", "mismatches"))  # not measured: unset
    r = evidence_message({"device": 9, "index": 1, "probe": "replay", "step": 7, "value": "inf", "expected": 0.0,
                          "z": "-inf", "mismatches": None, "detail": "x" * 5000})
    assert (r.value, r.expected, r.z) == (np.inf, 0.0, -np.inf) and r.HasField("expected")
    assert not r.HasField("mismatches") and len(r.detail) == MAX_EVIDENCE_DETAIL and r.detail.endswith("...")
    k = evidence_message(_KNOWN_ANSWER)
    assert (k.value, k.expected, k.mismatches) == (7.0, 8.0, 2) and not k.HasField("z")
    with pytest.raises(ValueError, match="no 'step'"):
        evidence_message({"device": 1, "index": 1, "probe": "stats"})


def test_quarantined_devices_reach_status_once_with_their_evidence(coordinator, net_cfg, tmp_path):
    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    for steps in (60, 70, 80):  # every heartbeat repeats the whole report
        client.heartbeat(island_id=join.island_id, version=0, steps=steps, bad_devices=["0", "3"],
                         quarantined=[_KNOWN_ANSWER, _NON_FINITE], devices=6)
    (isl,) = client.status().islands
    assert isl.devices == 6 and [e.device for e in isl.quarantined] == [3, 0]
    ka, nf = isl.quarantined
    assert (ka.index, ka.probe, ka.step, ka.value, ka.expected, ka.mismatches, ka.detail) == (
        3, "known_answer", 50, 7.0, 8.0, 2, _KNOWN_ANSWER["detail"])
    assert not ka.HasField("z") and not ka.HasField("median")
    assert (nf.index, nf.probe, nf.step) == (0, "finite", 61) and np.isnan(nf.value) and not nf.HasField("expected")
    with coordinator.service.lock:
        state = coordinator.service.state.status(coordinator.service.clock())
    (rec,) = state["islands"]
    assert rec["bad_devices"] == ["0", "3"] and rec["devices"] == 6
    assert rec["quarantined"][1] == {"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
                                     "detail": _NON_FINITE["detail"]}
    events = [e for e in read_events(tmp_path / "coord") if e["event"] == "device_quarantined"]
    assert [(e["island"], e["island_id"], e["device"], e["probe"], e["healthy"]) for e in events] == [
        ("a", join.island_id, 3, "known_answer", 6), ("a", join.island_id, 0, "finite", 6)]
    assert events[1]["value"] == "nan" and events[0]["mismatches"] == 2
    client.close()


@pytest.mark.parametrize("case, match", [
    ("more_than_joined", "quarantined: 9 devices reported, a's mesh holds 8"),
    ("duplicate_device", "quarantined[1]: device 3 is named twice"),
    ("unknown_probe", "quarantined[0].probe: 'vibes' is not one of"),
    ("long_detail", "quarantined[0].detail: 600 characters, at most 512"),
    ("too_many_devices", "devices=9: must be an integer from 0"),
])
def test_a_bad_chip_health_report_is_refused_and_changes_nothing(coordinator, net_cfg, case, match):
    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    client.heartbeat(island_id=join.island_id, version=0, quarantined=[_KNOWN_ANSWER], devices=7)
    evidence = [pb.DeviceEvidence(device=3, index=3, probe="known_answer", step=5)]
    devices = 6
    if case == "more_than_joined":
        evidence = [pb.DeviceEvidence(device=d, index=d, probe="stats", step=5) for d in range(9)]
    elif case == "duplicate_device":
        evidence.append(pb.DeviceEvidence(device=3, index=4, probe="replay", step=5))
    elif case == "unknown_probe":
        evidence[0].probe = "vibes"
    elif case == "long_detail":  # the client shortens a long detail: sent raw here
        evidence[0].detail = "x" * 600
    elif case == "too_many_devices":
        devices = 9
    before = snapshot(coordinator.service)
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(pb.HeartbeatRequest(island_id=join.island_id, version=0, steps=9, quarantined=evidence,
                                           devices=devices), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details(), e.value.details()
    assert_unchanged(before, coordinator.service)
    (isl,) = client.status().islands
    assert [q.device for q in isl.quarantined] == [3] and isl.devices == 7
    client.close()


def test_dtrain_status_names_the_quarantined_device(coordinator, net_cfg, capsys):
    from dtrain_cli.main import main

    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    client.heartbeat(island_id=join.island_id, version=0, quarantined=[_NON_FINITE], devices=7)
    client.close()
    capsys.readouterr()
    rc = main(["status", "--coordinator", coordinator.address, "--json"])
    out = json.loads(capsys.readouterr().out)
    (isl,) = out["islands"]
    assert rc == 0 and isl["devices"] == 7
    # Device 0 at mesh index 0: printed although 0 is the proto default; unset measures are null.
    assert isl["quarantined"] == [{"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
                                   "expected": None, "z": None, "median": None, "mismatches": None,
                                   "detail": _NON_FINITE["detail"]}]
    rc = main(["status", "--coordinator", coordinator.address])  # the table: its island row counts the device
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("island "))
    row = next(line for line in lines if line.startswith(isl["name"] + " "))
    cells = dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", row.strip()), strict=True))
    assert rc == 0 and cells["devices"].split()[0] == "7" and cells["quar."] == "1", cells
