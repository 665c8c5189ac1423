"""Fault injection for `dtrain simulate`, run: a chaos run with real processes and real signals, a lost island's
shard, push faults (and a plain mean that would take them), a truncated upload, a partitioned minority, a hung
island's late delta, a corrupted device."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtrain import codec
from dtrain.config.load import load_config
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from dtrain.steps.outer import OuterHParams, merge_weights, outer_update
from dtrain_cli.fault_spec import parse_fault
from dtrain_cli.main import main
from dtrain_cli.simulate import run_simulation
from service_helpers import Running, push_header
from simulate_helpers import NO_FAKE_DEVICES
from workers.client import CoordinatorClient, CoordinatorError
from workers.push_faults import (
    corrupt_push,
)

ROOT = Path(__file__).resolve().parent.parent


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
