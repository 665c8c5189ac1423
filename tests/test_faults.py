"""Fault injection for `dtrain simulate`: the --fault grammar, the faults' scoring, the link proxy. The runs with
real processes and real signals are in test_faults_runs.py."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtrain import codec
from dtrain.config.sections import ConfigError
from dtrain.health.faults import FAULT_KINDS, DeviceFault
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain_cli.fault_score import (
    device_fault_entry,
    device_fault_reached,
    device_quarantines,
    driver_fault_detection,
    push_detection,
    push_fault_event,
    score_faults,
)
from dtrain_cli.fault_spec import DEVICE_KINDS, PUSH_KINDS, check_devices, host_device_count, parse_fault
from dtrain_cli.link_proxy import LinkError, LinkProxy, LinkShape, parse_link
from dtrain_cli.main import main
from workers.push_faults import (
    PUSH_FAULTS,
    Injection,
    check_device_fault,
    corrupt_push,
    parse_device_fault,
    take_injection,
)


def test_parse_fault_specs() -> None:
    f = parse_fault("kill:island-1@v3+10s", 4)
    assert (f.kind, f.target, f.at_version, f.at_s, f.duration_s) == ("kill", "island-1", 3, None, 10.0)
    f = parse_fault("hang:island-0@20s+30s", 2)
    assert (f.kind, f.at_version, f.at_s, f.duration_s) == ("hang", None, 20.0, 30.0)
    f = parse_fault("kill-coordinator@v5+3s", 2)
    assert (f.kind, f.target) == ("kill-coordinator", "coordinator")
    f = parse_fault("slow:island-1@1.5s+2s,delay=250", 2)
    assert (f.kind, f.delay_ms, f.at_s) == ("slow", 250.0, 1.5)
    assert parse_fault("kill:island-1@v2", 2).duration_s is None  # killed for good
    f = parse_fault("kill:island-1@v2+0s", 2)  # restarted at once, not killed for good
    assert f.duration_s == 0.0 and f.describe() == "kill island-1 after version 2, restarted at once"
    f = parse_fault("truncate:island-1@v2", 2)
    assert (f.kind, f.target, f.at_version, f.duration_s) == ("truncate", "island-1", 2, None)
    assert PUSH_KINDS == PUSH_FAULTS  # the driver's grammar and the worker's --inject know the same push faults
    assert [(i.kind, i.at_version) for i in map(Injection.parse, ("nan@v0", "inflate@v12"))] == \
        [("nan", 0), ("inflate", 12)]


@pytest.mark.parametrize("text, why", [
    ("explode:island-0@v1", "unknown kind 'explode'"),
    ("kill:island-7@v1", "'island-7' is not an island of this run"),
    ("hang:island-0@v1", "hang needs a duration"),
    ("kill-coordinator:island-0@v1", "takes no target"),
    ("kill:island-0@v1,delay=5", "unknown option(s) delay"),
    ("kill:island-0", "expected KIND[:ISLAND]@"),
    ("nan:island-0@5s", "nan fires at a version only"),
    ("poison:island-1@v2+3s", "poison takes no duration"),
    ("truncate@v1", "truncate needs an island, e.g. truncate:island-1@v2"),
])
def test_parse_fault_rejects_bad_specs(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(text, 2)
    assert why in str(e.value)


@pytest.mark.parametrize("text, why", [("nan@5s", "push faults fire at a version only"),
                                       ("explode@v1", "unknown kind 'explode'")])
def test_worker_inject_rejects_bad_specs(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        Injection.parse(text)
    assert why in str(e.value)


def test_an_injection_fires_once_on_the_first_push_at_or_after_its_version() -> None:
    injections = [Injection("nan", 2), Injection("poison", 2)]
    assert take_injection(injections, 1) is None
    assert take_injection(injections, 3) is injections[0]  # the first push based on version >= 2 ...
    assert take_injection(injections, 3) is injections[1]  # ... takes one; the next push the other
    assert take_injection(injections, 4) is None  # each fires once


def test_a_byzantine_island_scales_every_push_from_its_version_on() -> None:
    """scale and ramp (a Byzantine island) change every push based on version >= N, not one: scale by F, ramp by
    G^k; --fault's factor reaches the worker's --inject as given."""
    f = parse_fault("scale:island-1@v0,factor=-20", 4)
    assert (f.kind, f.target, f.at_version, f.factor, f.inject_arg()) == ("scale", "island-1", 0, -20.0,
                                                                          "scale@v0,factor=-20.0")
    assert parse_fault("ramp:island-2@v1", 4).inject_arg() == "ramp@v1"
    scale, ramp = Injection.parse("scale@v0,factor=-20.0"), Injection.parse("ramp@v1")
    assert (scale.factor, ramp.factor) == (-20.0, 1.2) and Injection.parse("scale@v0").factor == -1.0
    assert take_injection([ramp], 0) is None
    assert all(take_injection([scale], v) is scale for v in range(3))  # every push, not once
    delta = np.linspace(-1, 1, 256, dtype=np.float32)
    header = pb.PushHeader(tokens=640)
    frame, detail = corrupt_push("scale", delta, header, 32, 64, 1, factor=-3.0)
    np.testing.assert_array_equal(codec.dequantize(codec.decode(frame, expected_n=256)), -3.0 * delta)
    assert detail["norm"] == pytest.approx(3 * detail["honest_norm"]) and header.tokens == 640
    for text, why in [("scale:island-1@v0,factor=0", "must be a finite number other than 0"),
                      ("nan:island-1@v0,factor=2", "unknown option(s) factor")]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            parse_fault(text, 4)
    with pytest.raises(ConfigError, match="factor=F is for scale and ramp only"):
        Injection.parse("poison@v1,factor=2")


def test_cli_refuses_a_bad_fault_before_starting(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["simulate", "--config", "tiny", "--set", f"run.out_dir={tmp_path}", "--fault", "kill:island-5@v1"])
    assert rc == 2
    assert "island-5" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_parse_device_fault_specs_and_what_the_worker_is_given() -> None:
    """A device fault of --fault becomes the DeviceFault the island's worker injects: the driver passes it as
    --device-fault (FaultSpec.worker_arg), which the worker's parser reads back as the same DeviceFault."""
    assert DEVICE_KINDS == tuple(f"device-{k}" for k in FAULT_KINDS)  # the driver's kinds are the worker's
    cases = {
        "device-bitflip:island-1@step120,device=3,bit=30":
            (DeviceFault("bitflip", 3, bit=30, start=120), "bitflip:3@120,bit=30"),
        "device-scale:island-0@step200,device=5,factor=8":
            (DeviceFault("scale", 5, factor=8.0, start=200), "scale:5@200,factor=8.0"),
        "device-dead:island-1@step150,device=6": (DeviceFault("dead", 6, start=150), "dead:6@150"),
        "device-scale:island-1@step0,device=0,prob=0.25,seed=7,factor=-2":
            (DeviceFault("scale", 0, prob=0.25, seed=7, factor=-2.0), "scale:0@0,prob=0.25,seed=7,factor=-2.0"),
        "device-dead:island-0@step40,device=2,until=41":
            (DeviceFault("dead", 2, start=40, until=41), "dead:2@40,until=41"),
        "device-bitflip:island-0@step5,device=7,rate=0.001,bit=31,prob=0.5":
            (DeviceFault("bitflip", 7, prob=0.5, bit=31, rate=0.001, start=5),
             "bitflip:7@5,prob=0.5,bit=31,rate=0.001"),
    }
    for text, (fault, arg) in cases.items():
        f = parse_fault(text, 2, devices=8)
        assert (f.kind, f.target, f.device_fault, f.at_version, f.at_s, f.duration_s) == \
            (f"device-{fault.kind}", text.split(":")[1].split("@")[0], fault, None, None, None), text
        assert f.worker_arg() == arg
        assert parse_device_fault(arg) == fault
    assert parse_fault("device-dead:island-1@step1,device=40", 2).device_fault == DeviceFault("dead", 40, start=1)
    with pytest.raises(ValueError, match="is not a device fault"):
        parse_fault("kill:island-1@v1", 2).worker_arg()


@pytest.mark.parametrize("text, why", [
    ("device-scale:island-1@v2,device=3", "device-scale starts at an inner step of the island only"),
    ("device-scale:island-1@20s,device=3", "device-scale starts at an inner step of the island only"),
    ("device-dead:island-1@step2+3s,device=3", "device-dead takes no duration"),
    ("device-scale:island-1@step2", "device-scale needs the device, e.g. device-scale:island-1@step2,device=3"),
    ("device-scale@step2,device=1", "device-scale needs an island, e.g. device-scale:island-1@step20,device=3"),
    ("device-scale:island-2@step2,device=1", "'island-2' is not an island of this run"),
    ("device-scale:island-1@step2,device=8", "device 8 is not a device of island-1 (it has 8: ids 0..7)"),
    ("device-scale:island-1@step2,device=1.5", "option device=1.5 is not an integer"),
    ("device-scale:island-1@step2,device=1,bit=3", "option bit is for device-bitflip, not device-scale"),
    ("device-dead:island-1@step2,device=1,factor=3", "option factor is for device-scale, not device-dead"),
    ("device-bitflip:island-1@step2,device=1,delay=3", "unknown option 'delay'"),
    ("device-bitflip:island-1@step2,device=1,bit=32", "DeviceFault.bit: 32 is not a bit of a 32-bit float"),
    ("device-bitflip:island-1@step2,device=1,rate=0", "DeviceFault.rate: 0.0 is not in (0, 1]"),
    ("device-scale:island-1@step2,device=1,prob=1.5", "DeviceFault.prob: 1.5 is not in (0, 1]"),
    ("device-scale:island-1@step2,device=1,until=2", "DeviceFault.until: 2 must be after start (2)"),
    ("device-scale:island-1@step2,device=1,device=2", "an option is given twice"),
    ("kill:island-1@step3", "stepN (an island's inner step) is for device faults only"),
    ("hang:island-1@step3+2s", "stepN (an island's inner step) is for device faults only"),
    ("nan:island-1@step3", "nan fires at a version only"),
    ("slow:island-0@v1+2s,delay=1e", "option delay=1e is not a number"),
])
def test_parse_fault_rejects_bad_device_specs(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(text, 2, devices=8)
    assert why in str(e.value)


@pytest.mark.parametrize("text, why", [
    ("bitflip:3", "expected KIND:DEVICE@STEP[,OPTION=VALUE...]"),
    ("bitflip:x@3", "expected KIND:DEVICE@STEP[,OPTION=VALUE...]"),
    ("melt:3@10", "unknown kind 'melt' (one of scale, bitflip, dead)"),
    ("scale:3@10,bit=4", "option bit is for bitflip faults, not scale"),
    ("dead:3@10,rate=0.5", "option rate is for bitflip faults, not dead"),
    ("scale:3@10,speed=2", "unknown option 'speed'"),
    ("scale:3@10,factor=big", "option factor='big' is not a number"),
    ("bitflip:3@10,bit=2.5", "option bit='2.5' is not an integer"),
    ("scale:3@10,prob", "option prob='' is not a number"),
    ("scale:3@10,seed=1,seed=2", "option seed given twice"),
    ("scale:3@10,factor=nan", "DeviceFault.factor: nan is not finite"),
    ("dead:3@10,prob=0", "DeviceFault.prob: 0.0 is not in (0, 1]"),
])
def test_worker_device_fault_rejects_bad_specs(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_device_fault(text)
    assert str(e.value).startswith(f"--device-fault {text!r}: ") and why in str(e.value)


def test_a_device_fault_needs_a_device_the_island_has() -> None:
    check_device_fault(DeviceFault("dead", 7), range(8))
    with pytest.raises(ConfigError, match=r"device 8 is not a device of this worker \(JAX device ids 0, 1, 2\)"):
        check_device_fault(DeviceFault("dead", 8), [2, 0, 1])
    assert host_device_count({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == 4
    assert host_device_count({"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                                           "--xla_force_host_platform_device_count=2"}) == 2  # the last one wins
    assert host_device_count({"XLA_FLAGS": ""}) is None and host_device_count({}) is None
    faults = [parse_fault("kill:island-0@v1", 2), parse_fault("device-dead:island-1@step3,device=5", 2)]
    check_devices(faults, 6)
    check_devices(faults, None)  # unknown: the worker checks
    with pytest.raises(ConfigError, match="device 5 is not a device of island-1 .it has 4: ids 0..3."):
        check_devices(faults, 4)


def test_cli_refuses_a_bad_device_fault(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """simulate (8 fake devices per worker, from XLA_FLAGS) and worker refuse a bad device fault with one line and
    exit status 2, before anything starts."""
    rc = main(["simulate", "--config", "tiny", "--set", f"run.out_dir={tmp_path}", "--fault",
               "device-scale:island-1@step20,device=8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "device 8 is not a device of island-1 (it has 8" in err, err
    assert not any(tmp_path.iterdir())
    for spec, why in (("scale:3@20,bit=1", "option bit is for bitflip faults, not scale"),
                      ("dead:8@20", "device 8 is not a device of this worker (JAX device ids 0, 1, 2, 3, 4, 5, 6, 7)")):
        rc = main(["worker", "--config", "tiny", "--set", f"run.out_dir={tmp_path}", "--coordinator",
                   "127.0.0.1:1", "--island", "island-0", "--device-fault", spec])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and err.startswith("dtrain worker: config error: --device-fault")
        assert why in err, err
    assert not any(tmp_path.iterdir())


def _island_events(*events: tuple[float, str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": t, "event": name, **fields} for t, name, fields in events]


def _chunks(until: int, chunk: int = 10, t0: float = 1.0, dt: float = 0.5) -> list[tuple[float, str, dict[str, Any]]]:
    """The ``trained`` events of one worker process that ran chunks of ``chunk`` steps up to ``until``."""
    return [(t0 + dt * (i + 1), "trained", {"steps": chunk, "executed": chunk * (i + 1), "shard": 1,
                                           "cursor": 8 * chunk * (i + 1)}) for i in range(until // chunk)]


def test_device_fault_summary_detected_with_its_delay_probe_and_action() -> None:
    fault = parse_fault("device-scale:island-1@step20,device=3,factor=10", 2)
    events = _island_events((0.5, "island_started", {}), *_chunks(60), (
        3.1, "device_quarantined", {"device": 3, "index": 3, "probe": "stats", "step": 22, "z": 40.0,
                                    "detail": "gradient norm an outlier on two consecutive steps", "healthy": 7}),
        (3.3, "remeshed", {"devices": 7, "device_ids": [0, 1, 2, 4, 5, 6, 7], "rows_per_device": 1,
                           "from_devices": 8, "cursor": 160, "version": 2, "restored": True}))
    e = device_fault_entry(fault, events, [fault])
    assert (e["detected_by"], e["probe"], e["device"], e["start_step"], e["detection_steps"]) == \
        ("device_quarantined", "stats", 3, 20, 2)
    assert e["injected_t"] == 2.0  # the island's chunk that ended at step 20 ended at t = 2.0: step 20 began then
    assert e["detected_t"] == 3.1 and e["detection_s"] == pytest.approx(1.1)
    assert e["action"] == "quarantined device 3 (stats); remeshed on 7 devices"
    assert e["recovered_t"] == 3.3 and "remeshed on devices [0, 1, 2, 4, 5, 6, 7] from 8" in e["recovery"]
    assert e["false_positives"] == [] and e["evidence"]["z"] == 40.0
    (q,) = device_quarantines({"island-0": [], "island-1": events}, [fault])
    assert (q["island"], q["device"], q["probe"], q["fault"]) == ("island-1", 3, "stats", fault.text)


def test_device_fault_summary_undetected_and_drained() -> None:
    fault = parse_fault("device-bitflip:island-0@step15,device=6,bit=3", 2)
    e = device_fault_entry(fault, _island_events((0.5, "island_started", {}), *_chunks(40)), [fault])
    assert (e["detected_t"], e["detection_s"], e["detection_steps"], e["detected_by"], e["probe"]) == \
        (None, None, None, None, None)
    assert e["action"] == "none: not detected" and e["injected_t"] == 1.5 and e["false_positives"] == []
    short = _island_events((0.5, "island_started", {}), *_chunks(10))
    assert device_fault_entry(fault, short, [fault])["injected_t"] is None  # the island never ran step 15 ...
    assert not device_fault_reached(fault, short)  # ... so the fault was not injected (faults_not_injected)
    assert device_fault_reached(fault, _island_events(*_chunks(20)))
    restarted = _island_events(*_chunks(10), *_chunks(10, t0=5.0), (6.0, "device_quarantined", {
        "device": 6, "probe": "stats", "step": 16, "detail": "z"}))  # a restarted process's state went on
    assert device_fault_reached(fault, restarted)
    # A dead device: the chunk holding its start step raised (no trained event for it), the known answer found it.
    dead = parse_fault("device-dead:island-0@step30,device=1", 2)
    events = _island_events((0.5, "island_started", {}), *_chunks(20), (2.5, "trained", {"executed": 25}),
                            (2.7, "chunk_failed", {"step": 25, "steps": 10}), (
        2.7, "device_quarantined", {"device": 1, "probe": "known_answer", "step": 34, "detail": "raised"}),
        (2.8, "drained", {"reason": "1 healthy device left, fewer than health.min_devices = 2", "devices": 1}),
        (3.0, "trained", {"executed": 30}), (3.5, "trained", {"executed": 40}))
    e = device_fault_entry(dead, events, [dead])
    assert (e["detection_steps"], e["injected_t"], e["detection_s"]) == (4, 2.5, 0.2)
    assert device_fault_entry(parse_fault("device-dead:island-0@step0,device=1", 2), events, [dead])[
        "injected_t"] == 0.5  # the first chunk began when the island started
    assert e["action"] == "quarantined device 1 (known_answer); drained (1 healthy device left, fewer than " \
        "health.min_devices = 2)" and e["recovered_t"] is None


def test_a_wrong_device_quarantined_is_a_false_positive() -> None:
    """A quarantine of a device with no fault, or of the faulty device before its fault could fire, is a false
    positive: in the fault's entry (its island) and in the run's device_quarantines (every island)."""
    fault = parse_fault("device-scale:island-1@step30,device=3", 2)
    other = parse_fault("device-dead:island-1@step50,device=5", 2)
    events = _island_events(*_chunks(80), (
        2.0, "device_quarantined", {"device": 3, "probe": "known_answer", "step": 10, "detail": "too early"}),
        (2.5, "device_quarantined", {"device": 2, "probe": "replay", "step": 40, "detail": "outvoted"}),
        (2.8, "device_quarantined", {"device": 5, "probe": "known_answer", "step": 50, "detail": "raised"}),
        (3.0, "remeshed", {"devices": 5, "device_ids": [0, 1, 4, 6, 7], "from_devices": 8}))
    e = device_fault_entry(fault, events, [fault, other])
    assert e["detected_t"] is None and e["action"] == "none: not detected"
    assert [(fp["device"], fp["probe"], fp["step"]) for fp in e["false_positives"]] == \
        [(3, "known_answer", 10), (2, "replay", 40)]
    e = device_fault_entry(other, events, [fault, other])  # the other fault on the island was found
    assert e["detection_steps"] == 0 and e["action"] == "quarantined device 5 (known_answer); remeshed on 5 devices"
    clean = _island_events((4.0, "device_quarantined", {"device": 0, "probe": "stats", "step": 9, "detail": "z"}))
    found = device_quarantines({"island-0": clean, "island-1": events}, [fault, other])
    assert [(q["island"], q["device"], q["fault"]) for q in found] == [
        ("island-1", 3, None), ("island-1", 2, None), ("island-1", 5, other.text), ("island-0", 0, None)]


def test_the_drivers_faults_are_scored_by_the_event_that_noticed_them() -> None:
    """kill, hang and cut: the coordinator's island_lost of the island (or its rejoin under the same name, not a
    live island taking over a shard); kill-coordinator: the islands' first retry; slow: the island's link_slow."""
    def fired(kind: str, target: str) -> dict[str, Any]:
        return {"fault": f"{kind}:{target}", "kind": kind, "target": target, "injected_t": 2.0, "version": 1,
                "recovered_t": None}

    coord = _island_events((1.0, "island_lost", {"island": "island-1"}),
                           (2.5, "island_joined", {"name": "island-1", "reason": "island-0 is done; took over"}),
                           (3.0, "island_lost", {"island": "island-1"}), (3.5, "island_joined", {"name": "island-0"}))
    islands = {"island-0": _island_events((2.4, "heartbeat_failed", {}), (4.0, "link_slow", {})),
               "island-1": _island_events((2.2, "retry", {}))}
    kill = driver_fault_detection(fired("kill", "island-1"), coord, islands)
    assert (kill["detected_t"], kill["detection_s"], kill["detected_by"]) == (3.0, 1.0, "island_lost")
    assert kill["action"].startswith("lease expired") and kill["fault"] == "kill:island-1"
    hang = driver_fault_detection(fired("hang", "island-0"), coord, islands)
    assert (hang["detected_by"], hang["action"]) == ("island_joined", "rejoined before its lease expired: kept its "
                                                                       "shard, from the coordinator's cursor")
    cut = driver_fault_detection(fired("cut", "island-0"), coord[:3], islands)
    assert (cut["detected_t"], cut["detection_s"], cut["action"]) == (None, None, "none: lease not expired")
    coordinator = driver_fault_detection(fired("kill-coordinator", "coordinator"), coord, islands)
    assert (coordinator["detected_t"], coordinator["detected_by"]) == (2.2, "retry")
    slow = driver_fault_detection(fired("slow", "island-0"), coord, islands)
    assert (slow["detected_by"], slow["detection_s"]) == ("link_slow", 2.0)


def test_a_push_fault_is_scored_by_the_coordinators_answer_to_its_push() -> None:
    """The coordinator's first event about the bad push (by its push id) is its detection; the island's rewind
    (or an aborted upload's resend) its recovery; an undetected one says whether it was merged."""
    nan = parse_fault("nan:island-1@v2", 2)
    injected = {"t": 5.0, "event": "fault_injected", "fault_kind": "nan", "at_version": 2, "push_id": "p7",
                "base_version": 3}
    island = _island_events((4.0, "fault_injected", {"fault_kind": "nan", "at_version": 1, "push_id": "p1"}),
                            (6.0, "rewound", {"reason": "push p7 quarantined", "to_cursor": 80, "retrained_steps": 10}))
    island.insert(1, injected)
    assert push_fault_event(nan, island) == injected
    assert push_fault_event(parse_fault("nan:island-1@v3", 2), island) is None
    coord = _island_events((5.5, "push_received", {"push_id": "p7"}), (5.6, "push_quarantined", {"push_id": "p7"}))
    e = push_detection(nan, injected, coord, island)
    assert (e["detected_by"], e["detection_s"], e["action"], e["merged"], e["version"]) == \
        ("push_quarantined", 0.6, "quarantined", False, 3)
    assert e["recovered_t"] == 6.0 and e["recovery"] == "the island rewound to cursor 80 and trained the range " \
        "again (10 steps)"
    refused = _island_events((5.2, "push_refused", {"push_id": "p7", "reason": "tokens exceed its cursor range"}))
    assert push_detection(nan, injected, refused, [])["action"] == "refused: tokens beyond its assigned range"
    aborted = _island_events((5.2, "push_aborted", {"push_id": "p7"}), (5.9, "push_received", {"push_id": "p7"}))
    e = push_detection(nan, injected, aborted, island)  # an aborted upload recovers by its resend, not a rewind
    assert (e["action"], e["recovered_t"], e["recovery"]) == ("upload retried", 5.9, "upload sent again")
    merged = _island_events((5.8, "round_merged", {"pushes": [{"push_id": "p7"}]}))
    e = push_detection(nan, injected, merged, island)
    assert (e["detected_t"], e["action"], e["merged"], e["recovered_t"]) == (None, "merged: not detected", True, None)
    # score_faults: the driver's faults first, then the push faults that fired, then the device faults reached
    kill = {"fault": "kill:island-0@v1", "kind": "kill", "target": "island-0", "injected_t": 1.0, "version": 1,
            "recovered_t": None}
    never = parse_fault("poison:island-0@v9", 2)
    scored = score_faults([kill], [nan, never], coord, {"island-0": [], "island-1": island})
    assert [f["fault"] for f in scored] == ["kill:island-0@v1", nan.text]


class _Echo:
    """A loopback echo server for the proxy tests."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)


def _roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_link_proxy_passes_cuts_slows_and_restores() -> None:
    echo = _Echo()
    proxy = LinkProxy(echo.port)
    try:
        assert _roundtrip(proxy.port) == b"ping"
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as open_conn:
            open_conn.sendall(b"a")
            assert open_conn.recv(16) == b"a"
            proxy.cut()  # an open connection is dropped ...
            open_conn.settimeout(5)
            assert open_conn.recv(16) == b""
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:  # ... and new ones refused
            s.settimeout(5)
            try:
                s.sendall(b"x")
                got = s.recv(16)
            except OSError:
                got = b""
            assert got == b""
        proxy.slow(0.3)
        t0 = time.perf_counter()
        assert _roundtrip(proxy.port) == b"ping"
        assert time.perf_counter() - t0 >= 0.6  # held 0.3 s each way
        proxy.restore()
        assert _roundtrip(proxy.port) == b"ping"
    finally:
        proxy.close()
        echo.server.close()


def test_a_shaped_link_keeps_its_bandwidth_and_round_trip() -> None:
    """``--link RATE/RTT``: data arrives whole and in order, never sooner than its round trip, and a transfer never
    faster than the rate (lower bounds: a loaded machine makes them slower, never faster); bad values are one
    clear error."""
    assert parse_link("100mbit/100ms") == LinkShape(100e6, 0.1) and str(LinkShape(20e6, 0.2)) == "20mbit/200ms"
    assert parse_link(" 1Gbit / 0.5s ") == LinkShape(1e9, 0.5)
    for bad in ("100mbit", "fast/100ms", "0mbit/10ms", "10mbit/11s", "10mb/10ms"):
        with pytest.raises(LinkError, match="link"):
            parse_link(bad)
    echo = _Echo()
    proxy = LinkProxy(echo.port, shape=LinkShape(8e6, 0.2))  # 1 MB/s each way, 200 ms round trip
    try:
        t0 = time.perf_counter()
        assert _roundtrip(proxy.port) == b"ping"
        assert time.perf_counter() - t0 >= 0.2
        payload = bytes(range(256)) * 2048  # 512 KiB: at least 0.5 s each way at 1 MB/s
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            t0 = time.perf_counter()
            threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload):
                chunk = s.recv(1 << 16)
                assert chunk
                got += chunk
            elapsed = time.perf_counter() - t0
        assert bytes(got) == payload
        assert elapsed >= len(payload) * 8 / 8e6 + 0.2  # serialized once per direction, pipelined: >= one pass
        assert proxy.bytes["up"] >= len(payload) and proxy.bytes["down"] >= len(payload)
    finally:
        proxy.close()
        echo.server.close()
