"""Fault injection for `dtrain simulate`: the --fault grammar, the link proxy, and a chaos run with real
processes and real signals."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtrain import codec
from dtrain.config.load import load_config
from dtrain.config.sections import Config, ConfigError
from dtrain.health.faults import FAULT_KINDS, DeviceFault
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from dtrain.steps.outer import OuterHParams, merge_weights, outer_update
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
from dtrain_cli.simulate import run_simulation
from service_helpers import Running, push_header
from workers.client import CoordinatorClient, CoordinatorError
from workers.push_faults import (
    PUSH_FAULTS,
    Injection,
    check_device_fault,
    corrupt_push,
    parse_device_fault,
    take_injection,
)

ROOT = Path(__file__).resolve().parent.parent
NO_FAKE_DEVICES = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


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


@pytest.mark.slow
def test_chaos_run_with_real_processes(tmp_path: Path) -> None:
    """An island SIGKILLed and restarted, one hung (SIGSTOP) past its lease, the coordinator SIGKILLed and
    resumed, a link cut: every fault is an event with its recovery, the run finishes, survivors agree."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=80", "outer.inner_steps=10",
        "worker.heartbeat_s=0.5", "coordinator.lease_s=3", "coordinator.grace_s=60"])
    faults = [parse_fault(t, 2) for t in ("kill:island-1@v1+1s", "hang:island-0@v2+5s",
                                          "kill-coordinator@v6+1s", "cut:island-1@v7+1s")]
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=600, faults=faults)
    assert s["bit_identical_final_params"]
    _assert_every_sequence_once(s)
    assert s["rounds"] >= cfg.rounds and not s["unfinished_islands"]
    by_fault = {f["fault"]: f for f in s["faults"]}
    assert set(by_fault) == {f.text for f in faults}
    for f in s["faults"]:
        assert f["recovered_t"] is not None and f["recovered_t"] >= f["injected_t"], f
    assert by_fault["hang:island-0@v2+5s"]["detected_by"] == "island_lost"  # hung past its 3 s lease
    assert by_fault["kill-coordinator@v6+1s"]["detected_by"] in ("retry", "heartbeat_failed")
    driver = [e["event"] for e in read_events(Path(s["run_dir"]) / "driver")]
    assert driver.count("fault_injected") == driver.count("fault_recovered") == len(faults)
    coordinator = [e["event"] for e in read_events(s["run_dir"])]
    assert "coordinator_resumed" in coordinator


def _assert_every_sequence_once(summary: dict) -> None:
    """The run's token-range audit (dtrain.audit, in summary.json): every sequence of every shard went into
    exactly one merged version."""
    a = summary["audit"]
    assert a["lost_tokens"] == 0 and a["doubled_tokens"] == 0, a
    assert not a["gaps"] and not a["overlaps"] and not a["missing_versions"], a


@pytest.mark.slow  # ~35 s of worker processes; rerouting's state-machine rules are in test_membership.py
def test_a_killed_islands_shard_is_finished_by_a_survivor(tmp_path: Path) -> None:
    """island-1 is SIGKILLed after version 1 and never comes back: once a survivor's own shard is done it takes
    over island-1's shard from its merged cursor and splits its data left with the other survivor, so the run
    trains every sequence of every shard exactly once (a version more than without the fault per round of that
    shard left, halved) and the survivors end on the same θ."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", "outer.islands=3"])
    s = run_simulation(cfg, 3, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("kill:island-1@v1", 3), parse_fault("nan:island-1@v50", 3)])
    assert s["bit_identical_final_params"]
    # island-1 never pushed again: its NaN push never fired, and the summary says so (it is not in "faults").
    assert s["faults_not_injected"] == [{"fault": "nan:island-1@v50",
                                         "reason": "island-1 made no push based on version 50 or later"}]
    assert [f["fault"] for f in s["faults"]] == ["kill:island-1@v1"]
    _assert_every_sequence_once(s)
    joins = [e for e in read_events(s["run_dir"]) if e["event"] == "island_joined"]
    (shard,) = [e["shard"] for e in joins if e["name"] == "island-1"]  # joined once, then killed for good
    taken = [e for e in joins if e["shard"] == shard and e["name"] != "island-1"]
    assert taken and f"took over shard {shard} of lost island" in taken[0]["reason"], joins
    left = (cfg.train.steps * cfg.train.batch_size - taken[0]["cursor"]) // (cfg.outer.inner_steps * 8)
    assert len(taken) == min(left, 2)  # a piece of the shard's rounds left per survivor
    assert left >= 1 and s["rounds"] == cfg.rounds + math.ceil(left / 2)
    end = max(e["t"] for e in read_events(s["run_dir"]) if e["event"] == "round_merged")  # the last version
    for name in ("island-0", "island-2"):  # the survivors never lost contact while the run went on
        events = read_events(Path(s["run_dir"]) / "islands" / name)
        assert not [e for e in events if e["event"] in ("heartbeat_failed", "rejoin_failed") and e["t"] < end], name


@pytest.mark.slow  # ~27 s of worker processes; the split and take-over rules are in test_segments.py
def test_a_lost_islands_shard_is_split_and_a_lost_piece_taken_over(tmp_path: Path) -> None:
    """Segments with real processes: island-1 is SIGKILLed after version 1 for good; once island-0's and island-2's
    own shards are done the first of them splits island-1's data left in two pieces (one per live island) and
    both train one; island-0 is SIGKILLed after version 13 (its piece's first round), in the middle of its piece,
    and island-2 takes over that piece's data left from its cursor once its own piece is done. The audit is exact:
    every sequence of every shard went into exactly one merged version. Pieces of 4 rounds or more: on an idle
    machine a round takes 0.2 s, and the kill (the driver watches the versions) may come a round or two late."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=3", "train.steps=120", "outer.inner_steps=10"])  # 12 rounds a shard
    s = run_simulation(cfg, 3, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("kill:island-1@v1", 3), parse_fault("kill:island-0@v13", 3)])
    _assert_every_sequence_once(s)
    assert not s["unfinished_islands"] or set(s["unfinished_islands"]) <= {"island-0", "island-1"}
    joins = [e for e in read_events(s["run_dir"]) if e["event"] == "island_joined"]
    (lost,) = [e["shard"] for e in joins if e["name"] == "island-1"]
    split = [e for e in joins if "split for 2 live islands" in e["reason"]]
    assert len(split) == 1 and split[0]["shard"] == lost, joins
    pieces = {tuple(e["segment"]) for e in joins if e["shard"] == lost and e["name"] != "island-1"}
    assert len(pieces) >= 2 and all(end > start for start, end in pieces), joins
    # island-0 held a piece of island-1's shard when it was killed: island-2 took over its data left mid-segment
    mine = [e for e in joins if e["name"] == "island-0" and e["shard"] == lost]
    assert mine, joins
    taken = [e for e in joins if e["name"] == "island-2" and "of lost island island-0" in e["reason"]
             and e["segment"] == mine[-1]["segment"]]
    assert taken and taken[0]["cursor"] > taken[0]["segment"][0], joins
    assert s["audit"]["segments"][str(lost)] == sorted({e["segment"][0] for e in joins if e["shard"] == lost})


def _push_fault_cfg(tmp_path: Path) -> Config:
    """Two islands, four rounds, the default quorum (every live island: a round waits for a refused island's
    range, trained again); frames of ~28 KB go in 4 KiB chunks (7: a truncated upload breaks off mid-frame)."""
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40", "outer.inner_steps=10",
        "codec.chunk_bytes=4096"])


def _check_push_faults(s: dict[str, Any], texts: list[str]) -> dict[str, dict[str, Any]]:
    """What must hold after push faults: the run finished with a finite θ, each fault fired once and was detected
    by the coordinator, no bad push (every one but a truncated upload's, sent again whole) was merged, its
    island trained its range again, and every sequence went into exactly one merged version."""
    out = Path(s["run_dir"])
    assert math.isfinite(s["final_eval_loss"]) and s["bit_identical_final_params"]
    _assert_every_sequence_once(s)
    for f in s["faults"]:
        if f["kind"] != "truncate":
            assert f["recovery"].startswith("the island rewound to cursor"), f
    last = max((p for p in (out / "coordinator").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    theta = np.fromfile(last / "state" / "theta.bin", "<f4")
    assert theta.size > 0 and np.isfinite(theta).all()
    by_fault = {f["fault"]: f for f in s["faults"]}
    assert set(by_fault) == set(texts)
    merged_ids = {p["push_id"] for e in read_events(out) if e["event"] == "round_merged" for p in e["pushes"]}
    for f in s["faults"]:
        assert f["detected_by"] is not None and f["detection_s"] >= 0, f  # how fast: benchmarks/faults.py
        assert f["merged"] == (f["push_id"] in merged_ids) == (f["kind"] == "truncate"), f
        island = read_events(out / "islands" / f["target"])
        fired = [e for e in island if e["event"] == "fault_injected" and e["fault_kind"] == f["kind"]]
        assert [e["push_id"] for e in fired] == [f["push_id"]] and fired[0]["base_version"] >= int(f["fault"][-1])
    return by_fault


_EXPECTED = {"nan": ("push_refused", "refused: bad frame"), "poison": ("push_quarantined", "quarantined"),
             "inflate": ("push_refused", "refused: tokens beyond its assigned range"),
             "truncate": ("push_aborted", "upload retried")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(_EXPECTED))  # scale and ramp, Byzantine islands: benchmarks/adversary.py
def test_a_push_fault_is_stopped_and_the_run_finishes(tmp_path: Path, kind: str) -> None:
    """One push fault in a real two-island run: the coordinator stops it (or, for a broken upload, discards the
    partial frame and takes the island's whole retry), θ stays finite, the run finishes."""
    text = f"{kind}:island-1@v1"
    s = run_simulation(_push_fault_cfg(tmp_path), 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault(text, 2)])
    f = _check_push_faults(s, [text])[text]
    assert (f["detected_by"], f["action"]) == _EXPECTED[kind]


@pytest.mark.slow
def test_every_push_fault_in_one_run(tmp_path: Path) -> None:
    """The four push faults in one real two-island run, on rounds where the other island's push is honest."""
    texts = ["nan:island-0@v1", "truncate:island-1@v1", "poison:island-1@v2", "inflate:island-0@v3"]
    s = run_simulation(_push_fault_cfg(tmp_path), 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault(t, 2) for t in texts])
    by_fault = _check_push_faults(s, texts)
    for f in by_fault.values():
        assert (f["detected_by"], f["action"]) == _EXPECTED[f["kind"]], f
    truncated = by_fault["truncate:island-1@v1"]
    assert truncated["recovered_t"] is not None  # the whole push, sent again, was received
    coordinator = read_events(s["run_dir"])
    aborted = [e for e in coordinator if e["event"] == "push_aborted"]
    assert [e["push_id"] for e in aborted] == [truncated["push_id"]]
    assert 0 < aborted[0]["chunks_received"] < aborted[0]["chunks"]  # broken off mid-frame, not before it
    driver = [e["event"] for e in read_events(Path(s["run_dir"]) / "driver")]
    assert driver.count("fault_armed") == len(texts) and "fault_not_injected" not in driver


def test_the_bounds_matter_a_plain_mean_takes_the_bad_deltas_the_coordinator_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's poisoned and inflated frames (workers.push_faults.corrupt_push) against a real coordinator: it
    quarantines / refuses them, and θ moves by the honest push alone. The same frames through a plain
    token-weighted mean and the outer update (no bounds, no norm screen) put them into θ: the inflated one makes
    θ non-finite, the poisoned one moves it ~1000x farther than the honest delta would."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.grace_s=60", "outer.islands=2",
        "train.steps=40", "outer.inner_steps=10", "codec.chunk_bytes=4096", "worker.retry_total_s=1"])
    running = Running(cfg, tmp_path / "coord")
    service, address, theta0 = running.service, running.address, running.theta
    try:
        c0, c1 = (CoordinatorClient(address, cfg) for _ in range(2))
        j0, j1 = c0.join("bad", "cpu", 1), c1.join("good", "cpu", 1)
        n, k = j0.tree_size, cfg.codec
        rng = np.random.default_rng(0)
        real_delta = (rng.normal(size=n) * 1e-3).astype(np.float32)  # what the bad island trained
        honest = codec.encode(codec.quantize((rng.normal(size=n) * 1e-3).astype(np.float32), 8, k.block))
        frames = {}
        for kind in ("nan", "inflate", "poison"):
            header = push_header(j0, kind)
            frame, _ = corrupt_push(kind, real_delta, header, 8, k.block, k.zstd_level)
            frames[kind] = (header, frame)
        assert frames["inflate"][0].tokens == 10 ** 9 and frames["poison"][0].tokens == 640
        for kind, words in (("nan", "bad frame: invalid scale"), ("inflate", "tokens=1000000000 exceed")):
            with pytest.raises(CoordinatorError) as e:
                c0.push(*frames[kind])
            assert e.value.code.name == "INVALID_ARGUMENT" and words in e.value.message
        r = c0.push(*frames["poison"])  # a valid frame, honest tokens: quarantined, the round goes on
        assert r.status == pb.PUSH_STATUS_REJECTED and r.reason.startswith("quarantined: push poison has L2 norm")
        assert c1.push(push_header(j1, "honest"), honest).status == pb.PUSH_STATUS_MERGED
        theta = service.merger.theta
        hp = OuterHParams.from_config(cfg)
        honest_delta = codec.dequantize(codec.decode(honest, expected_n=n))
        u, _ = outer_update(honest_delta, np.zeros(n, np.float32), hp)
        assert np.isfinite(theta).all()
        np.testing.assert_allclose(theta, theta0 + u, rtol=0, atol=1e-6)  # the honest push alone moved θ
        # The same pushes through a plain token-weighted mean: the bad deltas reach θ.
        for kind in ("inflate", "poison"):
            header, frame = frames[kind]
            bad_delta = codec.dequantize(codec.decode(frame, expected_n=n))
            w = merge_weights([header.tokens, 640])
            with np.errstate(over="ignore", invalid="ignore"):
                mean = (w[0] * bad_delta.astype(np.float64) + w[1] * honest_delta).astype(np.float32)
                plain, _ = outer_update(mean, np.zeros(n, np.float32), hp)
                plain_theta = theta0 + plain
            if kind == "inflate":  # non-finite (or astronomically far): ~0.7-1.9 x 3.4e38 per value
                assert not (np.abs(plain_theta - theta0) < 1e30).all()
            else:
                assert np.abs(plain_theta - theta0).max() > 100 * np.abs(theta - theta0).max()
        for c in (c0, c1):
            c.close()
    finally:
        running.stop()


def test_a_truncated_upload_changes_nothing_and_its_retry_is_merged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CoordinatorClient.push_broken against a real coordinator: the stream is cancelled after 3 of its 7 chunks;
    the coordinator logs push_aborted and admits nothing (no pending push, no state change); the whole push,
    sent again under the same push_id, is received and merged."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "outer.islands=1", "train.steps=40",
        "outer.inner_steps=10", "codec.chunk_bytes=4096", "worker.retry_total_s=1"])
    running = Running(cfg, tmp_path / "coord")
    service, address, theta0 = running.service, running.address, running.theta
    try:
        client = CoordinatorClient(address, cfg)
        join = client.join("a", "cpu", 1)
        n = join.tree_size
        delta = (np.random.default_rng(1).normal(size=n) * 1e-3).astype(np.float32)
        frame = codec.encode(codec.quantize(delta, 8, cfg.codec.block))
        header = push_header(join, "cut")
        before = service.state.to_json()
        told: list[tuple[int, int]] = []
        assert client.push_broken(header, frame, lambda sent, total: told.append((sent, total)))
        assert told == [(3, 7)]
        deadline = time.monotonic() + 10
        while not [e for e in read_events(tmp_path / "coord") if e["event"] == "push_aborted"]:
            assert time.monotonic() < deadline, "the coordinator logged no push_aborted"
            time.sleep(0.05)
        (aborted,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "push_aborted"]
        assert (aborted["push_id"], aborted["chunks_received"], aborted["chunks"]) == ("cut", 3, 7)
        with service.lock:
            assert service.state.to_json() == before and service.merger.pending_count == 0
        assert service.state.version == 0 and np.array_equal(service.merger.theta, theta0)
        r = client.push(header, frame)  # the retry: the same push id, whole
        assert r.status == pb.PUSH_STATUS_MERGED and r.version == 1
        events = read_events(tmp_path / "coord")
        assert [p["push_id"] for e in events if e["event"] == "round_merged" for p in e["pushes"]] == ["cut"]
        client.close()
    finally:
        running.stop()


@pytest.mark.slow
def test_a_partitioned_minority_cannot_commit(tmp_path: Path) -> None:
    """island-2's link is cut for 8 s (past its 4 s lease): the coordinator is the one commit point, so while
    the minority is cut off nothing of it is merged; the majority goes on without waiting for it (and, tiny
    rounds being short, finishes the minority's shard too); every sequence is merged once, and the islands
    that finished end on one θ."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", "outer.islands=3"])
    s = run_simulation(cfg, 3, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("cut:island-2@v1+8s", 3)])
    assert s["bit_identical_final_params"]
    _assert_every_sequence_once(s)
    (cut,) = s["faults"]
    assert cut["detected_by"] == "island_lost" and cut["detection_s"] <= 5.0, cut
    events = read_events(s["run_dir"])
    during = [e for e in events if e["event"] == "round_merged" and cut["injected_t"] <= e["t"] < cut["recovered_t"]]
    assert during, "the majority merged versions while the minority was cut off"
    assert all(p["island"] != "island-2" for e in during for p in e["pushes"]), during
    shard = next(e["shard"] for e in events if e["event"] == "island_joined" and e["name"] == "island-2")
    assert any(e["event"] == "island_joined" and e["shard"] == shard and "took over" in e["reason"]
               for e in events), "the majority finished the minority's shard"


@pytest.mark.slow
def test_a_hung_islands_dropped_late_delta_is_trained_again(tmp_path: Path) -> None:
    """late_policy = "drop": island-0, hung (SIGSTOP) for 6 s past its 3 s lease, wakes with a delta based on
    a version the other island has long moved past; it is dropped (counted), island-0 rewinds to its shard's
    cursor and trains that range again, so every sequence is still merged exactly once."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        # 100 rounds per shard: island-1 is still training its own when island-0 wakes (tiny rounds take ~0.1 s)
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=2000", "coordinator.late_policy=drop",
        "worker.heartbeat_s=0.5", "coordinator.lease_s=3"])
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("hang:island-0@v1+6s", 2)])
    assert s["bit_identical_final_params"]
    _assert_every_sequence_once(s)
    (hang,) = s["faults"]
    assert hang["detected_by"] == "island_lost", hang
    dropped = [e for e in read_events(s["run_dir"])
               if e["event"] == "push_received" and e["status"] == "drop" and e["island"] == "island-0"]
    assert dropped, "the hung island's late delta was dropped"
    rewound = [e for e in read_events(Path(s["run_dir"]) / "islands" / "island-0") if e["event"] == "rewound"]
    assert any(e["retrained_steps"] > 0 for e in rewound), rewound


@pytest.mark.slow
def test_a_corrupted_device_is_quarantined_and_the_islands_end_bit_identical(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dtrain simulate, two islands of 8 fake devices with chip health on, device 3 of island-1 scaled x10 from
    inner step 20: island-1 quarantines device 3 (and no other device), remeshes on the 7 others, and both
    islands end on the same parameters; the summary's fault entry says detected."""
    text = "device-scale:island-1@step20,device=3,factor=10"
    rc = main(["simulate", "--config", "tiny", "--islands", "2", "--quiet", "--set", f"run.out_dir={tmp_path}",
               "--set", "health.enabled=true", "--fault", text])
    assert rc == 0, capsys.readouterr().err
    run_dir = tmp_path / "tiny"  # the one run of this folder
    assert capsys.readouterr().out.startswith(f"{run_dir}: eval loss ")
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["bit_identical_final_params"] and len({i["params_digest"] for i in s["islands"]}) == 1
    assert math.isfinite(s["final_eval_loss"])
    _assert_every_sequence_once(s)
    events = read_events(run_dir / "islands" / "island-1")
    quarantined = [e for e in events if e["event"] == "device_quarantined"]
    assert [e["device"] for e in quarantined] == [3], quarantined
    remeshed = [e for e in events if e["event"] == "remeshed"]
    assert remeshed and remeshed[0]["devices"] == 7 and 3 not in remeshed[0]["device_ids"], remeshed
    assert not [e for e in read_events(run_dir / "islands" / "island-0") if e["event"] == "device_quarantined"]
    (f,) = s["faults"]
    assert (f["fault"], f["detected_by"], f["device"], f["false_positives"]) == \
        (text, "device_quarantined", 3, []), f
    assert 0 <= f["detection_steps"] <= 50 and f["action"].endswith("remeshed on 7 devices"), f
    assert f["detection_s"] is not None and f["detection_s"] >= 0, f  # in steps above; seconds: benchmarks/health.py
    assert [(q["island"], q["device"], q["fault"]) for q in s["device_quarantines"]] == [("island-1", 3, text)]
    driver = [e for e in read_events(run_dir / "driver") if e["event"] == "fault_armed"]
    assert [e["fault"] for e in driver] == [text]
