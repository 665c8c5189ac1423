"""benchmarks/health.py: its fault plan, its records, figures and lines from synthetic island events, user errors,
and (slow) a short run end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_benchmark
from dtrain.health.faults import DeviceFault

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"health: injected=(\d+) detected=(\d+) false-positives=(\d+) detect-steps-p50=(\S+) "
                       r"detect-steps-max=(\S+) probe-overhead=(-?\d+\.\d)% per-device-ratio=(\d+\.\d{3}) "
                       r"loss-ratio=(\S+)")
TIMING_LINE = re.compile(r"health-timing: probe-overhead=(-?\d+\.\d)% per-device-ratio=(\d+\.\d{3}) repeats=(\d+)")


def _bench() -> ModuleType:
    return load_benchmark("health")


def _quarantined(device: int, step: int, probe: str = "stats") -> dict[str, Any]:
    return {"event": "device_quarantined", "device": device, "index": device, "probe": probe, "step": step,
            "detail": "x", "z": 9.5, "healthy": 7}


def _summary(loss: float, steps: int = 1000, devices: int = 8) -> dict[str, Any]:
    return {"final_eval_loss": loss, "steps": steps, "devices": devices, "nan_rollbacks": 0, "wall_s": 60.0}


def _timing(probes: float = 0.018, per_device: float = 0.04) -> dict[str, Any]:
    return {"probe_overhead": probes, "per_device_overhead": per_device,
            "probe_overhead_range": [probes - 0.01, probes + 0.02],
            "per_device_overhead_range": [per_device - 0.02, per_device + 0.01]}


def test_the_plan_is_seeded_and_has_every_fault_the_issue_asks_for() -> None:
    bench = _bench()
    names = [f.name for f in bench.FAULTS]
    plan = bench.plan_faults(names, 1000, 3, list(range(8)))
    assert plan == bench.plan_faults(names, 1000, 3, list(range(8)))  # the same seed, the same plan
    assert plan != bench.plan_faults(names, 1000, 4, list(range(8)))
    assert [n for n, _ in plan] == names
    for _, f in plan:
        assert 200 <= f.start <= 800 and f.device in range(8) and f.until == 0
    faults = dict(plan)
    assert faults["scale"].kind == "scale" and faults["scale"].prob == 1.0
    assert (faults["bitflip-exp"].kind, faults["bitflip-exp"].bit) == ("bitflip", 30)
    assert (faults["bitflip-mantissa"].kind, faults["bitflip-mantissa"].bit) == ("bitflip", 22)
    assert faults["intermittent"].prob == 0.3
    assert faults["dead"].kind == "dead"
    assert {f.device for _, f in bench.plan_faults(names, 1000, 0, [5])} == {5}


def test_records_count_detection_only_for_the_faulty_device_after_its_onset() -> None:
    bench = _bench()
    fault = DeviceFault("scale", 3, start=400)
    events = [{"event": "trained", "steps": 10}, _quarantined(3, 412), {"event": "remeshed", "devices": 7}]
    r = bench.run_record("scale", fault, events, _summary(2.5, devices=7))
    assert (r["detected"], r["detected_step"], r["detect_steps"], r["probe"]) == (True, 412, 12, "stats")
    assert (r["false_positives"], r["remeshes"], r["devices_left"], r["onset"]) == (0, 1, 7, 400)
    assert r["quarantined"] == [{"device": 3, "probe": "stats", "step": 412, "detail": "x", "z": 9.5}]
    # another device, and the faulty one before its fault began, are false positives, not a detection
    r = bench.run_record("scale", fault, [_quarantined(5, 300), _quarantined(3, 390)], _summary(2.5, devices=6))
    assert (r["detected"], r["detect_steps"], r["false_positives"]) == (False, None, 2)
    clean = bench.run_record("none (clean)", None, [_quarantined(1, 50, "replay")], _summary(2.5))
    assert (clean["detected"], clean["false_positives"], clean["device"]) == (False, 1, None)


def test_figures_and_lines_from_the_records() -> None:
    bench = _bench()
    clean = bench.run_record("none (clean)", None, [], _summary(2.0))
    runs = [bench.run_record("scale", DeviceFault("scale", 1, start=300), [_quarantined(1, 301)], _summary(2.01)),
            bench.run_record("dead", DeviceFault("dead", 4, start=500), [_quarantined(4, 509, "known_answer")],
                             _summary(2.002)),
            bench.run_record("bitflip-exp", DeviceFault("bitflip", 6, bit=30, start=250),
                             [_quarantined(6, 270, "finite")], _summary(1.99))]
    f = bench.figures(clean, runs, _timing())
    assert (f["injected"], f["detected"], f["false_positives"], f["undetected"]) == (3, 3, 0, [])
    assert (f["detect_steps_p50"], f["detect_steps_max"]) == (9, 20)
    assert f["loss_ratio"] == pytest.approx(1.005)
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups() == ("3", "3", "0", "9", "20", "1.8", "1.040", "1.0050")
    targets = bench.targets_line(f)
    assert "NOT met" not in targets and targets.count(" met") == 7
    # the overheads' medians with the range of the repeats' ratios
    assert "probe-overhead 1.8% (range +0.8%..+3.8%) (target <= 3%) met" in targets
    assert "per-device-ratio 1.040 (range 1.020..1.050) (target <= 1.05) met" in targets
    table = bench.table(clean, runs)
    assert len(table) == 5 and "1@301(stats)" in table[2] and table[2].rstrip().endswith("1.0050")


def test_missed_targets_are_reported() -> None:
    bench = _bench()
    clean = bench.run_record("none (clean)", None, [_quarantined(2, 600)], _summary(2.0, steps=200))
    runs = [bench.run_record("bitflip-mantissa", DeviceFault("bitflip", 1, start=300), [], _summary(2.1)),
            bench.run_record("scale", DeviceFault("scale", 3, start=300), [_quarantined(3, 380)], _summary(2.0))]
    f = bench.figures(clean, runs, _timing(probes=0.075, per_device=0.144))
    assert (f["injected"], f["detected"], f["false_positives"]) == (2, 1, 1)
    assert f["undetected"] == ["bitflip-mantissa"]
    assert f["loss_ratio"] == pytest.approx(1.05)
    targets = bench.targets_line(f)
    for what in ("detected 1/2", "false-positives 1", "detect-steps-max 80", "probe-overhead 7.5% (range",
                 "per-device-ratio 1.144 (range", "loss-ratio 1.0500", "clean run 200 inner steps"):
        assert what in targets and targets.split(what)[1].split(";")[0].endswith("NOT met"), targets
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups() == ("2", "1", "1", "80", "80", "7.5", "1.144", "1.0500")
    # a run without a final eval (nan) makes L nan: NOT met; nothing detected: the delays are n/a
    runs = [bench.run_record("dead", DeviceFault("dead", 3, start=300), [], _summary(math.nan))]
    f = bench.figures(bench.run_record("none (clean)", None, [], _summary(2.0)), runs, _timing())
    assert math.isnan(f["loss_ratio"])
    assert "detect-steps-p50=n/a detect-steps-max=n/a" in bench.final_line(f)
    assert "loss-ratio nan (target <= 1.01) NOT met" in bench.targets_line(f)
    assert "detect-steps-max n/a (target <= 50) NOT met" in bench.targets_line(f)


def test_timing_only_lines() -> None:
    bench = _bench()
    t = {**_timing(probes=0.021, per_device=0.062), "repeats": 5}
    m = TIMING_LINE.fullmatch(bench.timing_line(t))
    assert m and m.groups() == ("2.1", "1.062", "5")
    [(probe, ok_p), (device, ok_d)] = bench.timing_checks(t)
    assert (ok_p, ok_d) == (True, False)
    assert probe == "probe-overhead 2.1% (range +1.1%..+4.1%) (target <= 3%)"
    assert device == "per-device-ratio 1.062 (range 1.042..1.072) (target <= 1.05)"


USAGE = " (benchmarks/health.py --help shows the usage)"


@pytest.mark.parametrize(("args", "message"), [
    (["--faults", "scale,melted"], "benchmarks/health.py: error: --faults 'scale,melted': give distinct names from "
                                   "scale,bitflip-exp,bitflip-mantissa,intermittent,dead" + USAGE),
    (["--repeats", "0"], "benchmarks/health.py: error: --repeats must be >= 1, got 0" + USAGE),
    (["--seed", "x"], "benchmarks/health.py: error: argument --seed: invalid int value: 'x'" + USAGE),
    (["--set", "outer.islands=2"], "benchmarks/health.py: config error: [outer] islands: this benchmark runs one "
                                   "island, got 2"),
])
def test_a_bad_option_is_one_line_and_exit_status_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "health.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message]


@pytest.mark.slow
def test_health_benchmark_runs_and_ends_with_the_summary_line(tmp_path: Path) -> None:
    out_json = tmp_path / "health.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "health.py"), "--quick", "--faults", "scale", "--repeats", "1",
         "--json", str(out_json)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LAST_LINE.fullmatch(lines[-1])
    assert m, lines[-1]
    assert lines[-2].startswith("targets: detected ")
    assert "clean: 200 inner steps on 8 devices" in proc.stderr  # progress lines
    # a device's outputs x10 from a step on: the statistics probe finds it within two steps, nothing else flagged
    assert m.groups()[:3] == ("1", "1", "0") and int(m[5]) <= 2
    data = json.loads(out_json.read_text())
    [run] = data["runs"]
    assert run["detected"] and run["probe"] == "stats" and run["devices_left"] == 7
    assert data["clean"]["quarantined"] == [] and data["clean"]["devices_left"] == 8
    assert data["figures"]["loss_ratio"] == pytest.approx(float(m[8]), rel=1e-3)
    assert data["figures"]["probe_overhead"] == pytest.approx(float(m[6]) / 100, abs=1e-3)
    lo, hi = data["figures"]["probe_overhead_range"]
    assert lo <= data["figures"]["probe_overhead"] <= hi


@pytest.mark.slow
def test_timing_only_runs_no_island_and_ends_with_its_line(tmp_path: Path) -> None:
    out_json = tmp_path / "timing.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "health.py"), "--timing-only", "--quick", "--repeats", "2",
         "--json", str(out_json)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = TIMING_LINE.fullmatch(lines[-1])
    assert m and m[3] == "2", lines[-1]
    assert lines[-2].startswith("targets: probe-overhead ") and "per-device-ratio" in lines[-2]
    assert "inner steps on" not in proc.stderr  # no island ran
    t = json.loads(out_json.read_text())["timing"]
    assert len(t["samples_s"]["probes"]) == 2 and t["probe_calls"]["replay"] > 0
    # the same checks read at once (not overlapped), timed in the same rounds, printed beside P
    assert len(t["samples_s"]["at_once"]) == 2
    lo, hi = t["probe_overhead_at_once_range"]
    assert lo <= t["probe_overhead_at_once"] <= hi and "the same checks not overlapped" in proc.stdout
    lo, hi = t["per_device_overhead_range"]
    assert lo <= t["per_device_overhead"] <= hi
    assert float(m[2]) == pytest.approx(1 + t["per_device_overhead"], abs=1e-3)
