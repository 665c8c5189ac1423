"""benchmarks/scale.py: its figures (slope, growth ratio, targets, lines) from synthetic measurements, its
coordinator config, a bad argument, and a --quick run against a real coordinator process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import load_benchmark
from coordinator.handlers import server_threads, wait_threads, work_threads

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"scale: islands=(\d+) round-s=(\S+) rss/model=(\S+) params/core-s=(\S+) "
                       r"round-s-per-island-slope=(\S+)")
MODEL = 100 << 20  # bytes: a synthetic model's fp32 size


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    return load_benchmark("scale")


def _row(islands: int, round_s: float, peak_rss: float) -> dict[str, float]:
    return {"islands": islands, "round_s": round_s, "peak_rss": peak_rss}


def test_slope_is_least_squares(scale: ModuleType) -> None:
    assert scale.slope([8, 16, 32, 64], [1.0, 2.0, 4.0, 8.0]) == pytest.approx(0.125)
    assert scale.slope([8, 16, 32, 64], [3.0, 3.0, 3.0, 3.0]) == 0.0
    # Not the end points' slope: (9 - 1) / 3 = 2.667, least squares 2.6 for these points.
    assert scale.slope([0, 1, 2, 3], [1.0, 3.0, 5.0, 9.0]) == pytest.approx(2.6)
    assert math.isnan(scale.slope([8, 8], [1.0, 2.0]))
    with pytest.raises(ValueError):
        scale.slope([1, 2], [1.0])


def test_linear_growth_rule_and_memory_target(scale: ModuleType) -> None:
    linear = [_row(8, 1.0, 1.5 * MODEL), _row(16, 2.0, 1.8 * MODEL), _row(32, 4.0, 2.2 * MODEL),
              _row(64, 8.0, 2.9 * MODEL)]
    f = scale.figures(linear, MODEL, baseline=MODEL // 2)
    assert f["islands"] == 64 and f["round_s"] == 8.0
    assert f["growth"]["ratio"] == pytest.approx(8.0) and f["growth"]["limit"] == pytest.approx(10.0)
    assert f["linear_ok"] is True and f["memory_ok"] is True
    assert f["rss_over_model"] == pytest.approx(2.9) and f["net_rss_over_model"] == pytest.approx(2.4)
    assert f["slope"] == pytest.approx(0.125)

    # Quadratic growth (x64 for x8 islands) and 3.5 model sizes: both targets missed.
    worse = [_row(8, 0.5, MODEL), _row(64, 32.0, 3.5 * MODEL)]
    g = scale.figures(list(reversed(worse)), MODEL, baseline=None)  # rows in any order
    assert g["growth"]["ratio"] == pytest.approx(64.0)
    assert g["linear_ok"] is False and g["memory_ok"] is False and g["net_rss_over_model"] is None
    line = scale.targets_line(g)
    assert "round time x64.00 for x8 islands (target <= 1.25 x 8 = 10) NOT met" in line
    assert "peak RSS / model 3.50 at 64 islands (target <= 3) NOT met" in line

    # Just inside the tolerance: x10 for x8 islands is met, x10.1 is not.
    assert scale.figures([_row(8, 1.0, MODEL), _row(64, 10.0, MODEL)], MODEL, None)["linear_ok"] is True
    assert scale.figures([_row(8, 1.0, MODEL), _row(64, 10.1, MODEL)], MODEL, None)["linear_ok"] is False


def test_one_size_has_no_growth_target(scale: ModuleType) -> None:
    f = scale.figures([_row(64, 3.0, 2 * MODEL)], MODEL, None)
    assert f["growth"] is None and f["linear_ok"] is None and math.isnan(f["slope"])
    assert "round time: one island count only not measured" in scale.targets_line(f)


def test_final_line_format(scale: ModuleType) -> None:
    f = scale.figures([_row(8, 1.25, MODEL), {**_row(64, 9.5, 2.5 * MODEL), "coordinator_cpu_s": 12.5}], MODEL, None)
    line = scale.final_line(f)
    m = LAST_LINE.fullmatch(line)
    assert m, line
    # params/core-s: 64 pushes of the model's MODEL / 4 parameters over 12.5 coordinator CPU seconds
    assert m.groups() == ("64", "9.500", "2.50", f"{64 * (MODEL // 4) / 12.5:.3g}", f"{(9.5 - 1.25) / 56:.4f}")
    assert "params/core-s=n/a " in scale.final_line(scale.figures([_row(64, 9.5, MODEL)], MODEL, None))


def test_table_has_one_row_per_size(scale: ModuleType) -> None:
    row = {**_row(8, 1.0, 2 * MODEL), "rounds_s": [1.0, 1.1, 0.9], "bytes_in": 8e6, "bytes_out": 8e6,
           "coordinator_cpu_s": 1.0, "client_cpu_s": 0.5, "heartbeat_p50_s": 0.002, "heartbeat_max_s": 0.01,
           "heartbeat_failed": 0}
    lines = scale.table([row, {**row, "islands": 16}], MODEL, baseline=MODEL)
    assert len(lines) == 3 and lines[1].split()[0] == "8" and lines[2].split()[0] == "16"
    assert " 2.00 " in lines[1] and " 1.00 " in lines[1]  # raw and net RSS / model


def test_config_every_island_closes_a_round_and_each_long_poll_has_a_thread(scale: ModuleType,
                                                                             tmp_path: Path) -> None:
    fields = {"d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 16}
    cfg = scale.scale_config(fields, tmp_path, 64, 3)
    c = cfg.coordinator
    assert c.mode == "sync" and c.min_quorum == 64 and cfg.outer.islands == 64 and not c.checkpoint
    # the coordinator's own sizing, no override: a work thread per core, 3 wait threads per island + 8 (at least 16)
    assert c.workers == 0 and work_threads(cfg) == max(2, len(os.sched_getaffinity(0)))
    assert wait_threads(cfg) == 3 * 64 + 8 and server_threads(cfg) == work_threads(cfg) + wait_threads(cfg)
    assert cfg.worker.heartbeat_s == 1 and c.lease_s == scale.LEASE_S
    assert wait_threads(scale.scale_config(fields, tmp_path, 2, 3)) == 16  # never fewer than 16
    assert scale.scale_config(fields, tmp_path, 2, 3, ["coordinator.stream_window_bytes=65536"]
                              ).coordinator.stream_window_bytes == 65536


def test_bad_argument_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--rounds", "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--rounds must be >= 1, got 0" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--quick", "--set",
                           "coordinator.min_quorum=-1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("benchmarks/scale.py: config error: ") and "min_quorum" in lines[0]


@pytest.mark.slow
def test_quick_run_against_a_real_coordinator(tmp_path: Path) -> None:
    out_json = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--quick", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LAST_LINE.fullmatch(lines[-1])
    assert m, lines[-1]
    assert lines[-2].startswith("targets: round time x")
    islands, round_s, rss, per_core_s, _ = m.groups()
    assert islands == "4" and float(round_s) > 0 and float(rss) > 0 and float(per_core_s) > 0
    data = json.loads(out_json.read_text())
    rows = {r["islands"]: r for r in data["rows"]}
    assert sorted(rows) == [2, 4]
    for n, r in rows.items():
        assert len(r["rounds_s"]) == 2 and r["heartbeat_failed"] == 0 and r["heartbeats"] > 0
        # every island pushed one frame (about 0.1 MB at 100k int8 parameters) and pulled one update per round
        assert all(n * 50_000 < x["bytes_in"] < n * 200_000 and x["bytes_out"] > 0 for x in r["rounds"])


def test_the_stream_budget_is_shared_by_the_islands_within_the_per_stream_bounds(tmp_path: Path) -> None:
    """coordinator.stream_budget_bytes, each way: an incoming stream's receive window is its island's share, an
    outgoing pull's chunks half of it (at most codec.chunk_bytes)."""
    from conftest import TINY
    from coordinator.handlers import server_options
    from coordinator.memory import pull_piece, stream_window
    from dtrain.config.load import load_config

    def window(*overrides: str) -> int:
        return stream_window(load_config(TINY, list(overrides)))

    def piece(*overrides: str) -> int:
        return pull_piece(load_config(TINY, ["codec.chunk_bytes=1048576", *overrides]))

    assert window("outer.islands=8") == 4 << 20  # 64 MiB / 8 = 8 MiB: the per-stream cap, 4 MiB
    assert window("outer.islands=64") == 1 << 20  # 64 MiB / 64
    assert window("outer.islands=64", "coordinator.stream_budget_bytes=1048576") == 64 << 10  # at least 64 KiB
    assert window("outer.islands=64", "coordinator.stream_budget_bytes=0") == 4 << 20  # no budget: the cap
    assert window("outer.islands=64", "coordinator.stream_window_bytes=0") == 0  # gRPC's auto-tuning
    assert piece("outer.islands=8") == 1 << 20  # half of 4 MiB is over codec.chunk_bytes
    assert piece("outer.islands=64") == 512 << 10  # half of 1 MiB
    assert piece("outer.islands=64", "coordinator.stream_budget_bytes=1048576") == 32 << 10
    assert piece("outer.islands=64", "coordinator.stream_budget_bytes=0") == 1 << 20  # no budget: chunk_bytes
    assert piece("outer.islands=64", "coordinator.stream_window_bytes=0") == 512 << 10  # the budget still holds
    opts = dict(server_options(load_config(TINY, ["outer.islands=64"])))
    assert opts["grpc.http2.lookahead_bytes"] == 1 << 20 and opts["grpc.http2.bdp_probe"] == 0
    assert "grpc.http2.lookahead_bytes" not in dict(server_options(load_config(TINY, [
        "coordinator.stream_window_bytes=0"])))


def test_the_floor_and_the_per_core_target_on_the_targets_line(scale: ModuleType) -> None:
    # 16 islands of 2e8 parameters: a bare server at 4 CPU s a round (8e8 per core-s), zstd at 0.25 s a frame
    # (8e8): in series a ceiling of 4e8; a coordinator at 2e8 reaches half of it and misses 5e8.
    ff = scale.floor_figures({"islands": 16, "server_cpu_s": 4.0, "decode_cpu_s": 0.25}, 200_000_000)
    assert ff["wire"] == pytest.approx(8e8) and ff["decode"] == pytest.approx(8e8)
    assert ff["ceiling"] == pytest.approx(4e8)
    # stored frames (int8's default push level): nothing to decode, the ceiling is the wire's
    stored = scale.floor_figures({"islands": 16, "server_cpu_s": 4.0, "decode_cpu_s": None, "stored": True},
                                 200_000_000)
    assert stored == {"wire": pytest.approx(8e8), "decode": None, "ceiling": pytest.approx(8e8)}
    # a tiny model's CPU times round to 0 clock ticks: no figure, no division by zero
    assert scale.floor_figures({"islands": 4, "server_cpu_s": 0.0, "decode_cpu_s": 0.0}, 100_000) == {
        "wire": None, "decode": None, "ceiling": None}
    f = scale.figures([{**_row(16, 9.0, MODEL), "coordinator_cpu_s": 16 * (MODEL // 4) / 2e8}], MODEL, None)
    f["floor"] = ff
    line = scale.targets_line(f)
    assert "params/core-s 2e+08 at 16 islands (target >= 3e+08, issue 36; gRPC (+ zstd) alone here: " \
           "4e+08, 50% of it reached) NOT met; the earlier target >= 5e+08 (c4a8f2c) NOT met;" in line
    # Issue 36's 3e8 met, the earlier 5e8 not: each said as it is.
    mid = scale.figures([{**_row(16, 9.0, MODEL), "coordinator_cpu_s": 16 * (MODEL // 4) / 4e8}], MODEL, None)
    assert ("params/core-s 4e+08 at 16 islands (target >= 3e+08, issue 36) met; the earlier target >= 5e+08 "
            "(c4a8f2c) NOT met;") in scale.targets_line(mid)
    fast = scale.figures([{**_row(16, 9.0, MODEL), "coordinator_cpu_s": 16 * (MODEL // 4) / 6e8}], MODEL, None)
    assert ("params/core-s 6e+08 at 16 islands (target >= 3e+08, issue 36) met; the earlier target >= 5e+08 "
            "(c4a8f2c) met;") in scale.targets_line(fast)
    assert ("params/core-s n/a at 16 islands (target >= 3e+08, issue 36) not measured; the earlier target >= 5e+08 "
            "(c4a8f2c) not measured;") in scale.targets_line(scale.figures([_row(16, 9.0, MODEL)], MODEL, None))


def test_the_heartbeat_target_is_half_the_default_lease(scale: ModuleType) -> None:
    assert scale.default_lease_s() == 4.0  # the config's default, not the benchmark's LEASE_S
    quick = scale.figures([{**_row(64, 9.0, MODEL), "heartbeat_max_s": 1.5, "heartbeat_failed": 0}], MODEL, None)
    assert scale.targets_line(quick).endswith(
        "largest heartbeat round trip 1.50 s at 64 islands, 0 failed (target <= 2 s, half the default lease, and "
        "none failed) met")
    slow = scale.figures([{**_row(64, 9.0, MODEL), "heartbeat_max_s": 4.8, "heartbeat_failed": 0}], MODEL, None)
    assert scale.targets_line(slow).endswith("none failed) NOT met")
    failed = scale.figures([{**_row(64, 9.0, MODEL), "heartbeat_max_s": 0.1, "heartbeat_failed": 1}], MODEL, None)
    assert scale.targets_line(failed).endswith("1 failed (target <= 2 s, half the default lease, and none failed) "
                                               "NOT met")
