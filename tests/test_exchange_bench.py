"""benchmarks/exchange.py end to end on a tiny model: a real coordinator process, raw gRPC, the summary line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"exchange: int8 ratio=(\S+) 4bit ratio=(\S+) merge/raw-grpc throughput=(\S+) "
                       r"coordinator peak-rss/model=(\S+)")


@pytest.mark.slow
def test_exchange_benchmark_runs_and_ends_with_the_summary_line(tmp_path):
    out_json = tmp_path / "exchange.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "exchange.py"), "--params", "20k", "--islands", "2",
         "--codecs", "int8", "--repeats", "1", "--delta", "gaussian", "--no-baseline", "--no-checkpoint-run",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = LAST_LINE.fullmatch(last)
    assert m, last
    x, y, z, mem = (float(g) for g in m.groups())
    assert x > 3.5 and y > 7 and z > 0 and mem > 0  # gaussian ratios; real (not nan) throughput and memory
    data = json.loads(out_json.read_text())
    run = data["dtrain"][0]
    assert run["codec"] == "int8" and run["islands"] == 2 and run["wall_s"] > 0
    assert [r["streams"] for r in data["raw_grpc"]] == [2]
    assert data["summary"]["merge_over_raw"] == pytest.approx(z, rel=1e-2)
    # section 6: the 2 pushes merged in process, once per coordinator.merge_threads (default 1,2)
    assert [(r["codec"], r["threads"], r["pushes"]) for r in data["merge_rate"]] == [("int8", 1, 2), ("int8", 2, 2)]
    assert all(r["params_per_core_s"] > 0 and r["step_cpu_s"] > 0 for r in data["merge_rate"])


def test_the_trained_delta_is_a_real_pseudo_gradient_of_the_benchmark_model() -> None:
    """The default ``--delta trained``: a short AdamW run from θ0 of the chosen model (here 2 steps of a 20k-parameter
    one), θ0 − θ_steps: finite, not zero, one value per parameter. The benchmark's default run failed its config
    (outer.inner_steps over the short run's train.steps) before this test existed."""
    bench = load_benchmark("exchange")
    fields, n_params = bench.choose_model(params=20_000)
    delta, how = bench.trained_delta(fields, steps=2, batch=2)
    assert delta.shape == (n_params,) and delta.dtype == np.float32
    assert np.all(np.isfinite(delta)) and np.count_nonzero(delta) > n_params // 2
    assert how.startswith("θ0−θ2: 2 AdamW steps")


def test_a_bad_set_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "exchange.py"), "--params", "20k",
                           "--set", "coordinator.merge_rule=bogus"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("benchmarks/exchange.py: config error: ") and "merge_rule" in lines[0]
