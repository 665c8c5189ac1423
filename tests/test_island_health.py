"""Chip health inside a real island: a ``dtrain worker`` process on 8 fake CPU devices against a real coordinator on
127.0.0.1:0, with a device fault injected into its per-device inner step. The island finds the device, quarantines
it, rebuilds its mesh on the healthy devices with the same global batch, goes back to its last good state and
trains on; the NaN/Inf guard rolls a non-finite round back instead of pushing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import TINY, initial_parameters
from coordinator.app import serve
from dtrain.config.load import load_config, to_toml
from dtrain.config.sections import Config
from dtrain.health.faults import DeviceFault
from dtrain.runlog import read_events
from simulate_helpers import NO_FAKE_DEVICES


def _cfg(tmp_path: Path, *extra: str) -> Config:
    # coordinator.checkpoint=false: the coordinator runs in this process, and orbax's async checkpointing does not
    # bear two checkpoint managers at work in one process (the workers are processes of their own)
    return load_config(TINY, [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.checkpoint=false", "outer.islands=1",
        "train.steps=60", "outer.inner_steps=20", "worker.heartbeat_s=0.5", "worker.retry_total_s=20",
        "worker.start_wait_s=0", *extra])


def _spec(f: DeviceFault) -> str:
    """``dtrain worker --device-fault`` for ``f``."""
    opts = {"scale": f",factor={f.factor}", "bitflip": f",bit={f.bit}", "dead": ""}[f.kind]
    return f"{f.kind}:{f.device}@{f.start}{opts}" + (f",until={f.until}" if f.until else "")


def _run(cfg: Config, tmp_path: Path, faults: dict[str, DeviceFault | None]) -> dict[str, Any]:
    """A coordinator in this process and one ``dtrain worker`` process per island on 8 fake devices (``faults``:
    island name -> its device fault); returns each island's summary and events and the coordinator's θ."""
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coordinator", theta, spec, port=0, quiet=True)
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
    procs = {}
    out: dict[str, Any] = {}
    try:
        for name, fault in faults.items():
            cmd = [sys.executable, "-m", "dtrain_cli", "worker", "--config", str(tmp_path / "config.toml"),
                   "--host-devices", "8", "--coordinator", f"127.0.0.1:{port}", "--island", name,
                   "--run-dir", str(tmp_path / name), "--quiet", *(["--device-fault", _spec(fault)] if fault else [])]
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, proc in procs.items():
            printed, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"worker {name} exited {proc.returncode}: {printed[-3000:]}"
            out[name] = json.loads((tmp_path / name / "summary.json").read_text())
        out["digest"] = service.merger.digest
        out["version"] = service.state.version
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        server.stop(grace=None).wait()
        service.close()
    out["events"] = {name: read_events(tmp_path / name) for name in faults}
    out["coordinator_events"] = read_events(tmp_path / "coordinator")
    return out


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, compile_cache: str) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("clean")
    return _run(_cfg(tmp, compile_cache, "health.enabled=true"), tmp, {"a": None})


def test_clean_island_quarantines_nothing(clean: dict[str, Any]) -> None:
    a = clean["a"]
    assert a["quarantined"] == [] and a["devices"] == 8 and a["nan_rollbacks"] == 0
    assert _of(clean["events"]["a"], "device_quarantined") == [] and _of(clean["events"]["a"], "remeshed") == []
    assert a["params_digest"] == clean["digest"] and a["version"] == clean["version"] == 3
    assert np.isfinite(a["final_eval_loss"])


@pytest.mark.slow
def test_scaled_device_is_quarantined_and_the_island_trains_on_seven(clean: dict[str, Any], tmp_path: Path,
                                                                     compile_cache: str) -> None:
    # the session's compilation cache: the 8-device programs are the clean run's (loaded, not compiled again)
    fault = DeviceFault("scale", 3, factor=10.0, start=25)
    run = _run(_cfg(tmp_path, compile_cache, "health.enabled=true"), tmp_path, {"a": fault})
    a, events = run["a"], run["events"]["a"]
    [q] = _of(events, "device_quarantined")
    assert q["device"] == 3 and q["probe"] == "stats" and 25 <= q["step"] <= 27 and q["healthy"] == 7
    [remesh] = _of(events, "remeshed")
    assert remesh["devices"] == 7 and 3 not in remesh["device_ids"] and sum(remesh["rows_per_device"]) == 8
    rewound = [e for e in _of(events, "rewound") if e["restored"]]
    assert len(rewound) == 1 and rewound[0]["to_cursor"] == 20 * 8  # back to the last push (round 1's end)
    # it trained on: the same data, every version, and ends on the coordinator's θ
    assert a["devices"] == 7 and [e["device"] for e in a["quarantined"]] == [3]
    assert a["cursor"] == clean["a"]["cursor"] and a["version"] == run["version"] == 3
    assert a["params_digest"] == run["digest"]
    assert a["final_eval_loss"] / clean["a"]["final_eval_loss"] < 1.02
    # the coordinator heard of it
    [cq] = _of(run["coordinator_events"], "device_quarantined")
    assert cq["device"] == 3 and cq["probe"] == "stats"


@pytest.mark.slow  # a worker run of its own; Muon's fault detection and exact restore are in tests/test_muon.py
def test_a_muon_island_quarantines_a_scaled_device_and_restores_its_muon_state(tmp_path: Path,
                                                                               compile_cache: str) -> None:
    fault = DeviceFault("scale", 3, factor=10.0, start=25)
    run = _run(_cfg(tmp_path, compile_cache, "health.enabled=true", "train.optimizer=muon"), tmp_path,
               {"a": fault})
    a, events = run["a"], run["events"]["a"]
    [q] = _of(events, "device_quarantined")
    assert q["device"] == 3 and q["healthy"] == 7
    # back to its last push with the optimizer state of that push's checkpoint: Muon's momentum, restored
    rewound = [e for e in _of(events, "rewound") if e["restored"]]
    assert len(rewound) == 1 and rewound[0]["to_cursor"] == 20 * 8
    assert _of(events, "island_restored")
    assert a["devices"] == 7 and a["version"] == run["version"] == 3 and a["params_digest"] == run["digest"]
    assert np.isfinite(a["final_eval_loss"])


@pytest.mark.slow  # ~17 s; the guard's detection is in test_chip_step.py, the rollback path in the test above
def test_nan_guard_rolls_back_and_every_pushed_delta_is_finite(tmp_path: Path) -> None:
    """Health probes off; one device's gradients get their exponent bit flipped on one step (a transient fault):
    the round is never pushed, the island goes back to its start and trains it again, cleanly."""
    fault = DeviceFault("bitflip", 2, bit=30, start=5, until=6)
    run = _run(_cfg(tmp_path), tmp_path, {"a": fault})
    a, events = run["a"], run["events"]["a"]
    [guard] = _of(events, "nan_guard")
    assert guard["rollbacks"] == 1
    [rewound] = _of(events, "rewound")
    assert rewound["restored"] and rewound["to_cursor"] == 0 and rewound["discarded_steps"] == 20
    assert a["nan_rollbacks"] == 1 and a["quarantined"] == [] and a["devices"] == 8
    sent = _of(events, "push_sent")
    assert all(e["status"] in ("PUSH_STATUS_MERGED", "PUSH_STATUS_PENDING") for e in sent)
    assert len(sent) == 3 and [(e["start"], e["end"]) for e in sent] == [(0, 160), (160, 320), (320, 480)]
    refused = [e for e in run["coordinator_events"] if e.get("event") in ("push_refused", "push_quarantined")]
    assert refused == []
    assert a["params_digest"] == run["digest"] and np.isfinite(a["final_eval_loss"])


@pytest.mark.slow
def test_dead_device_is_found_by_the_known_answer_and_quarantined(clean: dict[str, Any], tmp_path: Path) -> None:
    fault = DeviceFault("dead", 5, start=30)
    run = _run(_cfg(tmp_path, "health.enabled=true"), tmp_path, {"a": fault})
    a, events = run["a"], run["events"]["a"]
    [failed] = _of(events, "chunk_failed")
    assert "device 5 is dead" in failed["error"]
    [q] = _of(events, "device_quarantined")
    assert q["device"] == 5 and q["probe"] == "known_answer" and "raised" in q["detail"]
    [remesh] = _of(events, "remeshed")
    assert remesh["devices"] == 7 and 5 not in remesh["device_ids"]
    assert a["params_digest"] == run["digest"] and a["version"] == 3
    assert a["final_eval_loss"] / clean["a"]["final_eval_loss"] < 1.02


@pytest.mark.slow
def test_island_with_too_few_devices_drains_and_its_shard_is_rerouted(tmp_path: Path) -> None:
    """min_devices=8: one quarantined device drains island a; b finishes its own shard, then a's."""
    cfg = _cfg(tmp_path, "health.enabled=true", "health.min_devices=8", "outer.islands=2",
               "coordinator.lease_s=2", "coordinator.grace_s=2", "worker.start_wait_s=120")
    run = _run(cfg, tmp_path, {"a": DeviceFault("scale", 3, factor=10.0, start=25), "b": None})
    a, b = run["a"], run["b"]
    [drained] = _of(run["events"]["a"], "drained")
    assert "min_devices=8" in drained["reason"] and drained["devices"] == 7
    assert a["drained"] and a["steps"] < 60
    [took] = [e for e in _of(run["events"]["b"], "rewound") if e["to_shard"] != e["from_shard"]]
    assert took["to_shard"] == a["shard"] and took["to_cursor"] == 20 * 8  # a's merged cursor: its first round
    assert b["params_digest"] == run["digest"]
    merged = sorted((p["shard"], p["start"], p["end"]) for e in _of(run["coordinator_events"], "round_merged")
                    for p in e["pushes"])
    assert merged == [(0, 0, 160), (0, 160, 320), (0, 320, 480), (1, 0, 160), (1, 160, 320), (1, 320, 480)]


def _merged(run: dict[str, Any]) -> list[dict[str, Any]]:
    return _of(run["coordinator_events"], "round_merged")


@pytest.mark.slow  # two worker runs; the kept progress is the rewind's (Rewinder.apply, one line for both), whose
# default proof is tests/test_fragments.py's rewind with kept_unsent
def test_a_recovery_with_fragments_keeps_the_other_fragments_unsent_progress(tmp_path: Path) -> None:
    """outer.fragments = 2, H = 20: a push every 10 steps, fragments 0 and 1 in turn. Device 3 goes bad at step 25
    and is quarantined; the island goes back to its last push (step 20, fragment 1's) on 7 devices. That push
    left fragment 0's progress of steps 10-20 unsent (fragment 0 was last exchanged at step 10): the recovery
    keeps it on the newest θ, as a network rewind does, so fragment 0's next push (step 30) again carries its 20
    steps, as in the same run without a fault, not only the 10 trained after the recovery. The audit stays
    exact (every range merged once) and the island ends on the coordinator's θ. A constant learning rate after
    the warm-up: a recovery keeps the step counter going (the schedule is ahead by the steps it discarded), which
    would change the pushes' norms too."""
    fragments = ("health.enabled=true", "outer.fragments=2", "train.min_lr_ratio=1.0")
    clean_dir, fault_dir = tmp_path / "clean", tmp_path / "fault"
    clean = _run(_cfg(clean_dir, *fragments), clean_dir, {"a": None})
    run = _run(_cfg(fault_dir, *fragments), fault_dir, {"a": DeviceFault("scale", 3, factor=10.0, start=25)})
    a, events = run["a"], run["events"]["a"]
    [q] = _of(events, "device_quarantined")
    assert q["device"] == 3 and 25 <= q["step"] <= 27
    [rewound] = _of(events, "rewound")
    assert rewound["restored"] and rewound["to_cursor"] == 20 * 8 and rewound.get("kept_unsent")
    # every range merged exactly once, one fragment per version, and the island holds the coordinator's θ
    merged = _merged(run)
    assert [e["fragment"] for e in merged] == [0, 1] * 3
    assert [(p["start"], p["end"]) for e in merged for p in e["pushes"]] == [(80 * i, 80 * (i + 1)) for i in range(6)]
    assert a["params_digest"] == run["digest"] and a["version"] == run["version"] == 6
    assert a["cursor"] == clean["a"]["cursor"]
    # fragment 0's push at step 30 (version 3) carries steps 10-30, as without the fault: its norm is the clean
    # run's (the remeshed island sums its gradients in another order); steps 20-30 alone would be far smaller
    norm = {v: [p["norm"] for p in e["pushes"]][0] for v, e in enumerate(_merged(run), 1)}
    clean_norm = {v: [p["norm"] for p in e["pushes"]][0] for v, e in enumerate(_merged(clean), 1)}
    assert norm[1] == pytest.approx(clean_norm[1], rel=1e-4)  # before the fault: the same pushes
    assert norm[3] == pytest.approx(clean_norm[3], rel=0.05), (norm, clean_norm)
    assert norm[4] == pytest.approx(clean_norm[4], rel=0.05), (norm, clean_norm)  # fragment 1's: steps 20-40
    assert np.isfinite(a["final_eval_loss"]) and a["final_eval_loss"] / clean["a"]["final_eval_loss"] < 1.02
