"""benchmarks/faults.py: its figures and lines from synthetic summaries, its default fault list, user errors,
and (slow) a short run end to end on a tiny model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_benchmark
from dtrain_cli.fault_spec import parse_fault

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"faults: injected=(\d+) detected=(\d+) goodput=(\S+) loss-ratio=(\S+) lost-tokens=(\d+) "
                       r"doubled-tokens=(\d+) detect-p50=(\S+)s detect-max=(\S+)s restart-p50=(\S+?)s? "
                       r"kill-wall-ratio=(\S+)")


def _bench() -> ModuleType:
    return load_benchmark("faults")


def _fault(text: str, kind: str, detection_s: float | None) -> dict[str, Any]:
    return {"fault": text, "kind": kind, "detected_t": None if detection_s is None else 100.0 + detection_s,
            "detection_s": detection_s, "detected_by": "island_lost" if detection_s is not None else None,
            "action": "x"}


def _restart(seconds: float | None) -> dict[str, Any]:
    """A restart of the simulation summary's ``restarts`` (None: the island took no step after it)."""
    return {"fault": "kill:island-1@v1+2s", "island": "island-1", "killed_t": 100.0, "restarted_t": 102.0,
            "first_step_t": None if seconds is None else 100.0 + seconds, "restart_s": seconds,
            "phases": None if seconds is None else {"imports": 1.0, "compile": 0.5},
            "cache_hits": None if seconds is None else 12, "cache_misses": None if seconds is None else 0}


def _summaries(faults: list[dict[str, Any]], goodput: float | None = 0.95, lost: int = 0,
               doubled: int = 0, restarts: tuple[float | None, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    clean = {"final_eval_loss": 2.0, "goodput": 1.0, "audit": {"lost_tokens": 0, "doubled_tokens": 0}, "faults": []}
    chaos = {"final_eval_loss": 2.02, "goodput": goodput, "faults": faults,
             "audit": {"lost_tokens": lost, "doubled_tokens": doubled}, "restarts": [_restart(s) for s in restarts]}
    return clean, chaos


def test_figures_and_lines_from_the_summaries() -> None:
    bench = _bench()
    faults = [_fault("kill:island-1@v1+2s", "kill", 3.0), _fault("hang:island-2@v3+8s", "hang", 4.0),
              _fault("kill-coordinator@v5+2s", "kill-coordinator", 1.0)]
    f = bench.figures(*_summaries(faults, restarts=(7.5, 5.0, 30.0)))
    assert (f["injected"], f["detected"], f["undetected"]) == (3, 3, [])
    assert f["loss_ratio"] == pytest.approx(1.01)
    assert (f["detect_p50_s"], f["detect_max_s"], f["dead_island_detect_s"]) == (3.0, 4.0, 3.0)
    assert (f["restart_p50_s"], f["restarts"]) == (7.5, 3)
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups() == ("3", "3", "0.950", "1.0100", "0", "0", "3.00", "4.00", "7.50", "n/a")
    targets = bench.targets_line(f)
    assert "NOT met" not in targets and targets.count(" met") == 7
    assert "restart-p50 7.50s over 3 restarts (target <= 8s) met" in targets


def _kill_pair(clean_s: float, kill_s: float, versions: int, lost: int = 0) -> tuple[dict, dict]:
    clean = {"wall_s": clean_s, "rounds": 12, "utilization": 0.98, "audit": {"lost_tokens": 0, "doubled_tokens": 0}}
    killed = {"wall_s": kill_s, "rounds": versions, "utilization": 0.9,
              "audit": {"lost_tokens": lost, "doubled_tokens": 0, "segments": {"1": [0, 800, 1600]}}}
    return clean, killed


def test_kill_wall_ratio_is_the_median_of_the_pairs_next_to_the_bound_with_all_data_kept() -> None:
    """A kill at v3 of 12 on 4 islands: the dead island's 9 rounds shared by 3 others, (3 + 12) / 12 = 1.25."""
    bench = _bench()
    k = bench.kill_figures([_kill_pair(100.0, 130.0, 15), _kill_pair(100.0, 120.0, 15),
                            _kill_pair(90.0, 135.0, 16)], 4, 3)
    assert k["kill_wall_ratio"] == pytest.approx(1.3) and k["kill_runs"][0]["bound"] == pytest.approx(1.25)
    f = {**bench.figures(*_summaries([_fault("kill:island-1@v1+2s", "kill", 3.0)], restarts=(5.0,))), **k}
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m[10] == "1.300"
    assert ("kill-wall-ratio 1.300 over 3 pairs, 0 lost / 0 doubled tokens (target <= 1.05 (the bound with all "
            "data kept: 1.250), 0 / 0) NOT met") in bench.targets_line(f)
    k = bench.kill_figures([_kill_pair(100.0, 101.0, 12, lost=64)], 4, 3)
    assert "64 lost" in bench.targets_line({**f, **k}) and bench.targets_line({**f, **k}).endswith("NOT met")
    assert bench.kill_figures([], 4, 3)["kill_wall_ratio"] is None
    assert bench.parse_fault(bench.KILL_WALL_FAULT, 4).duration_s is None  # not restarted


def test_a_device_fault_found_before_its_onset_time_counts_as_detected_without_a_latency() -> None:
    device = {"fault": "device-scale:island-1@step5,device=2", "kind": "device-scale", "detected_t": 130.0,
              "detection_s": None, "detected_by": "stats", "action": "quarantined"}
    f = _bench().figures(*_summaries([_fault("kill:island-1@v1+2s", "kill", 3.0), device]))
    assert (f["injected"], f["detected"], f["undetected"]) == (2, 2, [])
    assert (f["detect_p50_s"], f["detect_max_s"]) == (3.0, 3.0)


def test_missed_targets_are_reported() -> None:
    bench = _bench()
    faults = [_fault("kill:island-1@v1+2s", "kill", 6.5), _fault("slow:island-3@v2+15s,delay=50", "slow", None),
              _fault("kill:island-1@v8+2s", "kill", None)]
    # a restart that took no step counts as the slowest: the median of (6, 9, never) is 9
    f = bench.figures(*_summaries(faults, goodput=0.8, lost=640, doubled=64, restarts=(6.0, None, 9.0)))
    assert (f["injected"], f["detected"]) == (3, 1)
    assert f["undetected"] == ["slow:island-3@v2+15s,delay=50", "kill:island-1@v8+2s"]
    assert f["dead_island_detect_s"] is None  # one kill never noticed: a miss, not the other one's 6.5 s
    targets = bench.targets_line(f)
    assert f["restart_p50_s"] == 9.0
    for what in ("detected 1/3", "goodput 0.800", "lost-tokens 640", "doubled-tokens 64",
                 "dead island detected in n/a", "restart-p50 9.00s over 3 restarts"):
        assert f"{what} (target" in targets and targets.split(what)[1].split(";")[0].endswith("NOT met"), targets
    f = bench.figures(*_summaries([], goodput=None, restarts=(None, None, 4.0)))
    assert "detect-p50=n/a detect-max=n/a" in bench.final_line(f) and "goodput=n/a" in bench.final_line(f)
    assert bench.final_line(f).endswith(" restart-p50=n/a kill-wall-ratio=n/a")  # most restarts took no step
    assert "restart-p50 n/a over 3 restarts (target <= 8s) NOT met" in bench.targets_line(f)


def test_the_closing_writes_the_json_drops_or_keeps_the_runs_and_ends_with_the_two_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/_common.finish, the closing faults.py and health.py share (through the script's own import)."""
    finish = _bench().finish
    for keep in (False, True):
        work, out_json = tmp_path / f"work-{keep}", tmp_path / f"out-{keep}.json"
        (work / "run").mkdir(parents=True)
        finish({"figures": {"x": 1.5}}, str(out_json), work, keep, "targets: x met", "faults: x=1.5")
        assert json.loads(out_json.read_text()) == {"figures": {"x": 1.5}} and out_json.read_text().endswith("}\n")
        assert work.exists() == keep
        out, err = capsys.readouterr()
        assert out == "targets: x met\nfaults: x=1.5\n"
        assert (f"run folders kept under {work}" in err) == keep
    finish({}, None, tmp_path / "none", False, "t", "l")  # no --json: no file; a missing folder is no error
    assert capsys.readouterr().out == "t\nl\n"


def test_the_default_chaos_run_has_every_fault_the_issue_asks_for() -> None:
    faults = _bench().FAULTS
    parsed = [parse_fault(t, 4) for t in faults]
    assert {"nan", "poison"} <= {f.kind for f in parsed}  # a NaN delta and a poisoned one
    kills = [f for f in parsed if f.kind == "kill"]
    assert len(kills) == 2 and kills[0].target == kills[1].target and all(f.duration_s is not None for f in kills)
    hang = next(f for f in parsed if f.kind == "hang")
    assert hang.duration_s is not None and hang.duration_s > 4.0  # past the default 4 s lease
    assert any(f.kind == "kill-coordinator" and f.duration_s for f in parsed)
    assert any(f.kind == "slow" for f in parsed)


def test_a_bad_fault_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--fault", "kill:island-7@v1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "benchmarks/faults.py: config error: --fault 'kill:island-7@v1': target 'island-7' is not an island of this "
        "run (island-0 .. island-3)"]


@pytest.mark.slow
def test_faults_benchmark_runs_and_ends_with_the_summary_line(tmp_path: Path) -> None:
    out_json = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--config", "tiny", "--islands", "2",
         "--set", "train.steps=60", "--set", "outer.inner_steps=10", "--set", "coordinator.lease_s=30",
         "--fault", "kill:island-1@v2+1s",
         "--fault", "slow:island-0@v1+2s,delay=20", "--kill-pairs", "0", "--json", str(out_json)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LAST_LINE.fullmatch(lines[-1])
    assert m, lines[-1]
    assert lines[-2].startswith("targets: detected ")
    # Both faults injected; with a 30 s lease the killed island rejoins before it is lost (its restart is how
    # the kill is detected), keeps its shard and cursor, and every token is merged once.
    assert int(m[1]) == 2 and m[5] == m[6] == "0"
    data = json.loads(out_json.read_text())
    # the restart: timed from the kill to its first step, phase by phase, its programs loaded from the run's cache
    restart, = data["chaos"]["restarts"]
    assert m[9] != "n/a", "the restarted island took no step before the run ended"
    assert restart["island"] == "island-1" and restart["restart_s"] == pytest.approx(float(m[9]), abs=0.01)
    assert restart["first_step_t"] > restart["restarted_t"] > restart["killed_t"]
    assert {"devices", "data", "compile", "join", "pull", "first_step"} <= set(restart["phases"])
    assert restart["cache_hits"] > 0 and restart["cache_misses"] == 0
    assert data["faults"] == ["kill:island-1@v2+1s", "slow:island-0@v1+2s,delay=20"]
    assert data["figures"]["loss_ratio"] == pytest.approx(float(m[4]), rel=1e-3)
    assert 0 < data["figures"]["goodput"] <= 1 and data["fault_free"]["goodput"] == pytest.approx(1.0)

