"""``dtrain plot``: the series read from a run's events (a finished and a live run), the PNGs drawn from them, and
the one-line errors for a folder that is missing or holds no events."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from conftest import TINY
from dtrain.config.load import load_config
from dtrain.runlog import RunLog
from dtrain_cli.main import main
from dtrain_cli.plot import COORDINATOR, Mark, plot_run, read_run, run_series

PNGS = ["loss.png", "bytes.png", "utilization.png", "timeline.png"]


def _write(folder: Path, events: list[tuple[str, dict]]) -> None:
    log = RunLog(folder, quiet=True)
    for kind, fields in events:
        log.event(kind, **fields)
    log.close()


def _finished_run(root: Path) -> Path:
    """A two-island run as the coordinator, the islands and the simulate driver write it (fields as on main: the
    coordinator's events name an island by its name, its id in island_id)."""
    _write(root, [
        ("coordinator_started", {"address": "127.0.0.1:1"}),
        ("island_joined", {"island": "a", "island_id": "a-0", "name": "a", "shard": 0}),
        ("island_joined", {"island": "b", "island_id": "b-1", "name": "b", "shard": 1}),
        ("pull_served", {"island": "a", "have_version": 0, "frames": [["PULL_KIND_FULL", 0, 0, 1000]]}),
        ("eval", {"version": 0, "loss": 5.5, "tokens": 0, "island": "a", "name": "a"}),
        ("push_received", {"island": "a", "push_id": "p1", "status": "accept", "bytes": 300}),
        ("push_received", {"island": "b", "push_id": "p2", "status": "accept", "bytes": 200}),
        ("round_merged", {"version": 1, "pushes": [{"island": "a", "tokens": 640, "shard": 0, "end": 20},
                                                   {"island": "b", "tokens": 640, "shard": 1, "end": 20}]}),
        ("pull_served", {"island": "b", "have_version": 0, "frames": [["PULL_KIND_UPDATE", 0, 1, 150]]}),
        ("eval", {"version": 1, "loss": 4.0, "tokens": 1280, "island": "b", "name": "b"}),
        ("island_lost", {"island": "b", "reason": "lease expired"}),
        ("push_received", {"island": "a", "push_id": "p3", "status": "drop", "bytes": 100, "reason": "stale"}),
        ("island_joined", {"island": "b", "island_id": "b-2", "name": "b", "shard": 1}),
        ("round_merged", {"version": 2, "pushes": [{"island": "a", "tokens": 640, "shard": 0, "end": 40}]}),
        ("eval", {"version": 2, "loss": 3.0, "island": "a", "name": "a"}),  # tokens from the merges
    ])
    _write(root / "islands" / "a", [
        ("train", {"step": 10, "loss": 5.0, "tokens": 320, "utilization": 1.0}),
        ("train", {"step": 20, "loss": 4.5, "tokens": 640, "utilization": 0.8}),
        ("nan_guard", {"step": 20, "cursor": 20}),
        ("island_finished", {"version": 2, "final_eval_loss": 3.0, "utilization": 0.75}),
    ])
    _write(root / "islands" / "b", [
        ("train", {"step": 10, "loss": 5.2, "tokens": 320, "utilization": 0.9}),
        ("device_quarantined", {"device": 3, "probe": "replay", "detail": "mismatch"}),
    ])
    _write(root / "driver", [
        ("fault_injected", {"fault": "kill:b@v1+2s", "target": "b", "version": 1}),
        ("fault_recovered", {"fault": "kill:b@v1+2s", "action": "restarted"}),
    ])
    return root


def test_the_series_of_a_finished_run(tmp_path):
    s = run_series(*read_run(_finished_run(tmp_path / "run")))
    assert s.train_loss == {"a": [(320.0, 5.0), (640.0, 4.5)], "b": [(320.0, 5.2)]}
    assert s.eval_loss == [(0.0, 5.5), (1280.0, 4.0), (1920.0, 3.0)]
    assert s.final_eval == {"a": (1920.0, 3.0)}
    assert s.bytes_up["all"][-1][1] == 600 and s.bytes_up["a"][-1][1] == 400 and s.bytes_up["b"][-1][1] == 200
    assert s.bytes_down["all"][-1][1] == 1150 and s.bytes_down["b"][-1][1] == 150
    assert [u for _, u in s.utilization["a"]] == [1.0, 0.8, 0.75] and [u for _, u in s.utilization["b"]] == [0.9]
    kinds = [(m.lane, m.kind) for m in s.marks]
    for expected in [("a", "island_joined"), ("b", "island_joined"), ("b", "island_lost"), ("b", "rejoined"),
                     ("a", "push_dropped"), ("a", "nan_guard"), ("b", "device_quarantined"),
                     ("b", "fault_injected"), ("b", "fault_recovered"), (COORDINATOR, "round_merged")]:
        assert expected in kinds, expected
    assert s.lanes == [COORDINATOR, "a", "b"]
    assert all(isinstance(m, Mark) and m.t >= 0 for m in s.marks)


def _check_png(path: Path, min_bytes: int = 8000) -> None:
    assert path.is_file() and path.stat().st_size > min_bytes, path
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] >= 200 and pixels.shape[1] >= 400, pixels.shape
    assert float(np.var(pixels[..., :3])) > 1e-3  # not a blank canvas


def test_plot_of_a_finished_run_writes_non_trivial_pngs_and_prints_their_paths(tmp_path, capsys):
    root = _finished_run(tmp_path / "run")
    assert main(["plot", str(root), "--out", str(tmp_path / "png")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "png" / name) for name in PNGS]
    for name in PNGS:
        _check_png(tmp_path / "png" / name)


def test_plot_of_a_live_run_reads_up_to_a_half_written_line(tmp_path):
    root = tmp_path / "live"
    _write(root / "islands" / "a", [("train", {"step": 10, "loss": 5.0, "tokens": 320, "utilization": 1.0})])
    with open(root / "islands" / "a" / "events.jsonl", "a") as f:
        f.write('{"t": 1, "event": "train", "step": 20, "lo')  # still being written
    s = run_series(*read_run(root))
    assert s.train_loss == {"a": [(320.0, 5.0)]} and s.eval_loss == [] and s.lanes == ["a"]
    written = plot_run(root)
    assert [p.name for p in written] == ["loss.png", "utilization.png"]  # nothing else yet
    _check_png(root / "plots" / "loss.png", min_bytes=5000)


def test_plot_errors_are_one_line_naming_the_folder(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err == f"dtrain plot: error: {tmp_path / 'nope'}: no such run folder (give RUN_DIR, e.g. runs/tiny)\n"
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dtrain plot: error: {tmp_path / 'empty'}: no events.jsonl") and err.count("\n") == 1
    _write(tmp_path / "starting", [("coordinator_started", {"address": "x"})])  # events, nothing to plot yet
    assert main(["plot", str(tmp_path / "starting")]) == 1
    assert "no losses, bytes or marks" in capsys.readouterr().err


def test_plot_of_a_train_run(tmp_path):
    cfg = load_config(TINY, [])
    _write(tmp_path, [
        ("run_started", {"mode": "train", "islands": 1, "config": cfg.to_dict()}),
        ("train", {"step": 10, "loss": 4.0, "tokens": 2560}),
        ("eval", {"step": 10, "eval_loss": 4.5}),
    ])
    s = run_series(*read_run(tmp_path))
    assert s.train_loss == {"train": [(2560.0, 4.0)]}
    assert s.eval_loss == [(10.0 * cfg.train.batch_size * cfg.model.seq_len, 4.5)]


@pytest.mark.slow  # a real 2-island simulate: ~20 s alone
def test_plot_of_a_real_simulation_shows_the_coordinators_evals(tmp_path, monkeypatch):
    from dtrain_cli.simulate import run_simulation

    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "train.steps=40", "outer.islands=2",
                             "coordinator.eval_every=1", "coordinator.port=0"])
    summary = run_simulation(cfg, 2, quiet=True, pin=False)
    root = Path(summary["run_dir"])
    s = run_series(*read_run(root))
    evals = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [(e["tokens"], e["loss"]) for e in evals] == s.eval_loss and len(s.eval_loss) == summary["rounds"] + 1
    assert set(s.train_loss) == {"island-0", "island-1"} and s.bytes_up["all"][-1][1] == summary["bytes_up"]
    for path in plot_run(root):
        _check_png(path)
