"""``dtrain simulate`` in a pipe, as a script or CI log sees it (a real run: a coordinator and worker processes):
its lines' clock only goes forward, no status line is printed twice unchanged, start-up says what it waits for,
and the last line on stdout is a sentence (the numbers stay in summary.json)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"\[\s*(\d+\.\d)s\] (.*)")


@pytest.mark.slow  # a 2-island run of real processes: ~25 s
def test_simulate_in_a_pipe_prints_a_forward_clock_no_repeats_and_a_closing_sentence(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "dtrain_cli", "simulate", "--config", "tiny", "--islands", "2", "--no-pin",
         "--set", f"run.out_dir={tmp_path}", "--set", "train.steps=40", "--set", "outer.inner_steps=10"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert proc.stdout == (f"{run}: eval loss {summary['final_eval_loss']:.4f} after {summary['rounds']} versions, "
                           f"{summary['tokens']:,} tokens merged in {summary['wall_s']:.1f}s; the summary is in "
                           f"{run / 'summary.json'}\n")
    lines = [LINE.fullmatch(line) for line in proc.stderr.splitlines()]
    assert lines and all(lines), proc.stderr  # every line is [ elapsed s] text: no raw JSON, no traceback
    elapsed = [float(m.group(1)) for m in lines if m]
    assert elapsed == sorted(elapsed), proc.stderr  # the clock never goes back
    status = [m.group(2) for m in lines if m and m.group(2).startswith("simulate: ")]
    assert status[0] == "simulate: compiling: waiting for 2 islands to join; 2/2 worker processes running"
    assert all(a != b for a, b in itertools.pairwise(status)), status  # an unchanged line is not printed again
    last = lines[-1]
    assert last is not None and last.group(2).startswith(f"done: {summary['rounds']} versions")
