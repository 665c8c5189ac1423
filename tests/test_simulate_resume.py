"""`dtrain simulate --resume RUN_DIR` with real processes: a run interrupted with Ctrl-C (SIGINT to the simulate
process) writes a partial summary and prints the command that resumes it; resumed, its versions continue from the
coordinator's checkpoint (its log says from which), it finishes, and the token-range audit is exact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.runlog import read_events
from simulate_helpers import NO_FAKE_DEVICES

ROOT = Path(__file__).resolve().parent.parent


def _simulate(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain_cli", "simulate", *args]


def _env() -> dict[str, str]:
    env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
    env.pop("DTRAIN_TOKEN", None)
    return env


def _merged(run_dir: Path) -> list[int]:
    try:
        return [e["version"] for e in read_events(run_dir, skip_torn=True) if e["event"] == "round_merged"]
    except (OSError, ValueError):
        return []


def test_resume_refuses_what_it_cannot_do(tmp_path):
    out = subprocess.run(_simulate("--resume", str(tmp_path / "nope")), capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().endswith(
        "no config.toml there: not a run folder dtrain simulate wrote"), out.stderr
    out = subprocess.run(_simulate("--resume", str(tmp_path), "--set", "train.steps=3"), capture_output=True,
                         text=True, env=_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "--set cannot be given with it" in out.stderr, out.stderr
    out = subprocess.run(_simulate("--islands", "2"), capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=60)
    assert out.returncode == 2 and "needs --config (or --resume RUN_DIR" in out.stderr, out.stderr


@pytest.mark.slow
def test_ctrl_c_then_resume_finishes_the_run_with_an_exact_audit(tmp_path, compile_cache):
    runs = tmp_path / "runs"
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _simulate("--config", str(ROOT / "configs" / "tiny.toml"), "--islands", "2", "--no-pin",
                      "--set", f"run.out_dir={runs}", "--set", "train.steps=160", "--set", "outer.inner_steps=10",
                      "--set", "worker.heartbeat_s=0.5", "--set", compile_cache),
            stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    run_dir = runs / "tiny"
    deadline = time.monotonic() + 240
    while len(_merged(run_dir)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the simulate process only, as a kill -INT would
    assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    text = log.read_text()
    said = re.search(r"dtrain simulate: interrupted at version (\d+) \(([\d,]+) tokens merged\); a partial summary "
                     r"is in (\S+); to go on from there: dtrain simulate --resume (\S+)\n", text)
    assert said, text[-3000:]
    stopped_at = int(said.group(1))
    assert stopped_at >= 3 and Path(said.group(3)) == run_dir / "summary.json" and Path(said.group(4)) == run_dir
    partial = json.loads((run_dir / "summary.json").read_text())
    assert partial["interrupted"] is True and partial["version"] == stopped_at
    assert partial["tokens_merged"] == int(said.group(2).replace(",", "")) > 0
    assert partial["resume"] == f"dtrain simulate --resume {run_dir}"
    assert not any(p.name.startswith("tiny-") for p in runs.iterdir())  # one run folder

    second = subprocess.run(_simulate("--resume", str(run_dir)), capture_output=True, text=True, env=_env(),
                            cwd=ROOT, timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    coordinator_log = (run_dir / "coordinator.log").read_text()
    resumed = re.findall(r"resumed from version (\d+) \(its checkpoint\)", coordinator_log)
    assert len(resumed) == 1 and stopped_at - 1 <= int(resumed[0]) <= stopped_at, coordinator_log[-2000:]
    final = json.loads((run_dir / "summary.json").read_text())
    # 160 steps / 10 = 16 rounds per island; a restarted island's first round after its checkpoint can take a
    # version more, as after any restart (docs/faults.md)
    assert "interrupted" not in final and final["rounds"] >= 16
    versions = _merged(run_dir)
    assert versions[-1] == final["rounds"] and set(range(1, versions[-1] + 1)) <= set(versions)  # none skipped
    a = final["audit"]
    assert a["lost_tokens"] == 0 and a["doubled_tokens"] == 0, a
    assert not a["gaps"] and not a["overlaps"] and not a["missing_versions"], a
    assert final["bit_identical_final_params"] is True
