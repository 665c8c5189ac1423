"""The CLI and the train / simulate runs: outputs, accounting, exact resume, run folders."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import TINY, make_text
from dtrain.config.load import load_config, replace
from dtrain.models import model
from dtrain.runlog import read_events
from dtrain.train.runs import RunError, run_dir, run_train
from dtrain_cli import main as cli

ISLANDS = 4


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _n_params(cfg) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.build(cfg.model).abstract_params))


# --- simulate ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulate_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sim") / "runs"
    rc, stdout, stderr = _main(["simulate", "--config", str(TINY), "--islands", str(ISLANDS), "--inprocess",
                                "--set", f"run.out_dir={out_dir}", "--quiet"])
    assert rc == 0, stderr
    cfg = load_config(TINY, [f"run.out_dir={out_dir}"])
    return cfg, out_dir / "tiny", stdout, stderr


def test_simulate_summary(simulate_run):
    cfg, rdir, stdout, stderr = simulate_run
    assert stderr == ""  # --quiet
    summary = json.loads((rdir / "summary.json").read_text())
    for key in ("final_eval_loss", "rounds", "tokens", "bytes_up", "bytes_down", "wall_s", "islands"):
        assert key in summary, key
    t = cfg.train
    rounds = summary["rounds"]
    assert rounds == cfg.rounds == math.ceil(t.steps / cfg.outer.inner_steps) == 3
    n_params = _n_params(cfg)
    assert summary["params"] == n_params
    assert summary["tokens"] == ISLANDS * t.steps * t.batch_size * cfg.model.seq_len
    assert summary["bytes_up"] == ISLANDS * rounds * n_params * 4
    assert summary["bytes_down"] == ISLANDS * (rounds - 1) * n_params * 4  # round 0 starts from the seed
    assert summary["version"] == rounds
    assert summary["wall_s"] > 0
    assert summary["final_eval_loss"] < 5.0
    islands = summary["islands"]
    assert [i["index"] for i in islands] == list(range(ISLANDS))
    for i in islands:
        assert i["tokens"] == t.steps * t.batch_size * cfg.model.seq_len
        assert i["steps"] == t.steps
        assert i["cursor"] == t.steps * t.batch_size
        assert i["bytes_up"] == rounds * n_params * 4
        assert i["bytes_down"] == (rounds - 1) * n_params * 4
        assert np.isfinite(i["final_train_loss"])
    shards = [i["shard_tokens"] for i in islands]
    assert shards[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(shards))  # disjoint, contiguous
    # the one line on stdout is the summary's headline, for a person (the numbers are in summary.json)
    assert stdout == (f"{rdir}: eval loss {summary['final_eval_loss']:.4f} after {rounds} versions, "
                      f"{summary['tokens']:,} tokens merged in {summary['wall_s']:.1f}s; the summary is in "
                      f"{rdir / 'summary.json'}\n")


def test_simulate_events(simulate_run):
    cfg, rdir, _, _ = simulate_run
    events = read_events(rdir)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert kinds == ["run_started"] + ["island_joined"] * ISLANDS + ["round_merged"] * cfg.rounds + ["run_finished"]
    started = events[0]
    assert started["mode"] == "simulate-inprocess" and started["islands"] == ISLANDS
    assert started["config"]["train"]["steps"] == cfg.train.steps
    assert started["fingerprint"] == cfg.fingerprint()
    assert [e["island"] for e in events if e["event"] == "island_joined"] == list(range(ISLANDS))
    rounds = [e for e in events if e["event"] == "round_merged"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and [r["version"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["weights"] == pytest.approx([1 / ISLANDS] * ISLANDS)  # equal tokens, equal weights
        assert len(r["delta_norms"]) == ISLANDS and all(d > 0 for d in r["delta_norms"])
    assert [r["tokens"] for r in rounds] == [ISLANDS * 20 * 8 * 32 * k for k in (1, 2, 3)]
    summary = json.loads((rdir / "summary.json").read_text())
    assert rounds[-1]["bytes_up"] == summary["bytes_up"] and rounds[-1]["bytes_down"] == summary["bytes_down"]
    assert rounds[-1]["eval_loss"] == events[-1]["final_eval_loss"] == summary["final_eval_loss"]
    # the global model learns: every round far below uniform guessing (ln 256), a later round below the first (on
    # tiny, outer momentum can overshoot in round 3, so not necessarily the last)
    evals = [r["eval_loss"] for r in rounds]
    assert max(evals) < math.log(256) - 1.5 and min(evals[1:]) < evals[0]


def test_simulate_loss_well_below_chance(simulate_run):
    _, rdir, _, _ = simulate_run
    loss = json.loads((rdir / "summary.json").read_text())["final_eval_loss"]
    assert loss < math.log(256) - 1.0  # chance for bytes is ln 256 = 5.545


def test_process_simulate_with_a_missing_data_source_fails_cleanly(tmp_path: Path):
    rc, _, err = _main(["simulate", "--config", str(TINY), "--islands", "2",
                        "--set", f"run.out_dir={tmp_path / 'runs'}",
                        "--set", f"data.source={tmp_path / 'nope.txt'}", "--quiet"])
    assert rc == 1
    assert "nope.txt" in err and "no such file" in err
    assert not (tmp_path / "runs").exists()  # refused before any process started


def test_simulate_zero_islands(tmp_path: Path):
    rc, _, err = _main(["simulate", "--config", str(TINY), "--islands", "0", "--inprocess",
                        "--set", f"run.out_dir={tmp_path / 'runs'}"])
    assert rc == 2 and "--islands" in err


# --- CLI errors ----------------------------------------------------------------------------------------


def test_resume_without_checkpoint(tmp_path: Path):
    rc, _, err = _main(["train", "--config", str(TINY), "--resume", "--quiet",
                        "--set", f"run.out_dir={tmp_path / 'runs'}"])
    assert rc == 1
    assert "no checkpoint" in err and str(tmp_path / "runs" / "tiny") in err


@pytest.mark.parametrize("override,field", [("train.lr=fast", "[train] lr"), ("train.bogus=1", "[train] bogus"),
                                            ("train.steps=1.5", "[train] steps"), ("foo", "--set 'foo'")])
def test_bad_set_exit_code(tmp_path: Path, override: str, field: str):
    rc, _, err = _main(["train", "--config", str(TINY), "--set", f"run.out_dir={tmp_path / 'runs'}",
                        "--set", override])
    assert rc == 2
    assert "config error" in err and field in err, err
    assert not (tmp_path / "runs").exists()


def test_missing_config_exit_code(tmp_path: Path):
    rc, _, err = _main(["train", "--config", str(tmp_path / "nope.toml")])
    assert rc == 2 and "nope.toml" in err


def test_config_command_prints_resolved_toml():
    rc, out, _ = _main(["config", "--config", str(TINY), "--set", "train.lr=1e-3"])
    assert rc == 0
    parsed = tomllib.loads(out)
    cfg = load_config(TINY, ["train.lr=1e-3"])
    assert parsed == cfg.to_dict()


# --- train, checkpoints, exact resume -----------------------------------------------------------------

TRAIN_SETS = ["log_every=10", "checkpoint_every=30", "eval_every=20"]


def _train_cfg(out_dir: Path, corpus: Path, name: str, *extra: str):
    # steps_per_call=7 does not divide the 10-step log interval: chunks are [7, 3] * 6, so a resume must
    # re-plan the same fused steps to reproduce the losses exactly.
    return load_config(TINY, [f"run.out_dir={out_dir}", f"run.name={name}", f"data.source={corpus}",
                              "data.max_bytes=0", "train.steps_per_call=7", *(f"run.{s}" for s in TRAIN_SETS),
                              *extra])


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    corpus = base / "corpus.txt"
    corpus.write_bytes(make_text(120_000))
    cfg = _train_cfg(base / "runs", corpus, "A")
    summary = run_train(cfg, quiet=True)
    return cfg, corpus, summary


def _by_step(events, kind):
    return {e["step"]: e for e in events if e["event"] == kind}


def test_train_outputs(train_run):
    cfg, _, summary = train_run
    rdir = run_dir(cfg)
    assert summary["run_dir"] == str(rdir) and summary["steps"] == cfg.train.steps == 60
    assert summary["tokens"] == 60 * cfg.train.batch_size * cfg.model.seq_len
    assert summary["rounds"] == 0 and summary["bytes_up"] == 0
    assert json.loads((rdir / "summary.json").read_text())["final_eval_loss"] == summary["final_eval_loss"]
    events = read_events(rdir)
    assert events[0]["event"] == "run_started" and events[-1]["event"] == "run_finished"
    train = _by_step(events, "train")
    assert sorted(train) == [10, 20, 30, 40, 50, 60]
    assert train[60]["loss"] < train[10]["loss"] - 1.0
    assert sorted(_by_step(events, "checkpoint_saved")) == [30, 60]
    assert sorted(_by_step(events, "eval")) == [20, 40, 60]
    assert summary["final_eval_loss"] < 4.0
    ckpts = sorted(int(p.name) for p in (rdir / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [30, 60]


def test_exact_resume_from_copied_checkpoint(train_run):
    cfg_a, _, summary_a = train_run
    cfg_b = replace(cfg_a, run={"name": "B"})
    src, dst = run_dir(cfg_a) / "checkpoints", run_dir(cfg_b) / "checkpoints"
    dst.mkdir(parents=True)
    shutil.copytree(src / "30", dst / "30")  # as if B had been killed between its step-30 and step-60 saves
    summary_b = run_train(cfg_b, resume=True, quiet=True)

    ev_a, ev_b = read_events(run_dir(cfg_a)), read_events(run_dir(cfg_b))
    resumed = [e for e in ev_b if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 30 and resumed[0]["cursor"] == 30 * cfg_a.train.batch_size
    train_a, train_b = _by_step(ev_a, "train"), _by_step(ev_b, "train")
    assert sorted(train_b) == [40, 50, 60]
    # Same process, same compiled programs, same data: the resumed run is bit-identical, not just close.
    for step in (40, 50, 60):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert train_b[step][key] == train_a[step][key], (step, key)
    assert _by_step(ev_b, "eval")[40]["eval_loss"] == _by_step(ev_a, "eval")[40]["eval_loss"]
    assert summary_b["final_eval_loss"] == summary_a["final_eval_loss"]
    assert summary_b["tokens"] == summary_a["tokens"] and summary_b["steps"] == 60
    assert summary_b["islands"][0]["cursor"] == summary_a["islands"][0]["cursor"]
    assert sorted(_by_step(ev_b, "checkpoint_saved")) == [60]


def test_resume_with_other_model_is_refused(train_run):
    cfg_a, corpus, _ = train_run
    cfg_c = replace(cfg_a, run={"name": "C"})
    (run_dir(cfg_c) / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir(cfg_a) / "checkpoints" / "30", run_dir(cfg_c) / "checkpoints" / "30")
    # n_heads changes the model (its fingerprint) without changing any parameter shape
    argv = ["train", "--config", str(TINY), "--resume", "--quiet", "--set", f"run.out_dir={cfg_a.run.out_dir}",
            "--set", "run.name=C", "--set", f"data.source={corpus}", "--set", "model.n_heads=4"]
    rc, _, err = _main(argv)
    assert rc == 1
    assert "fingerprint" in err
    assert not (run_dir(cfg_c) / "summary.json").exists()


def test_second_run_same_name_gets_suffix(train_run):
    cfg_a, _, _ = train_run
    first = run_dir(cfg_a)
    before = {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    quick = replace(cfg_a, train={"steps": 10, "warmup_steps": 2, "steps_per_call": 10},
                    outer={"inner_steps": 10}, run={"checkpoint_every": 0, "eval_every": 0})
    s2 = run_train(quick, quiet=True)
    assert s2["run_dir"] == str(first.parent / "A-2")
    assert (first.parent / "A-2" / "summary.json").exists()
    assert (first.parent / "A-2" / "checkpoints" / "10").is_dir()  # the final checkpoint
    after = {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    assert after == before  # the first run is untouched
    assert read_events(first.parent / "A-2")[0]["config"]["run"]["name"] == "A-2"


def test_run_error_when_resuming_nothing(tmp_path: Path, tiny_cfg):
    with pytest.raises(RunError, match="no checkpoint"):
        run_train(tiny_cfg, resume=True, quiet=True)
    (run_dir(tiny_cfg) / "checkpoints").mkdir(parents=True)  # an empty checkpoints folder is not a checkpoint
    with pytest.raises(RunError, match="no checkpoint"):
        run_train(tiny_cfg, resume=True, quiet=True)


# --- a real crash: SIGKILL a train subprocess, resume it --------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain_cli", *args]


@pytest.mark.slow
def test_sigkill_and_resume_subprocess(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(make_text(120_000))
    out_dir = tmp_path / "runs"
    common = ["--config", str(TINY), "--quiet", "--set", f"run.out_dir={out_dir}", "--set", f"data.source={corpus}",
              "--set", "data.max_bytes=0", "--set", "train.steps=400", "--set", "train.warmup_steps=20",
              "--set", "run.checkpoint_every=50", "--set", "run.log_every=10", "--set", "train.steps_per_call=10"]
    env = dict(os.environ)  # carries XLA_FLAGS (8 CPU devices) and JAX_PLATFORMS from conftest

    ref = subprocess.run(_cli("train", *common, "--set", "run.name=ref"), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr

    ckpts = out_dir / "crash" / "checkpoints"
    proc = subprocess.Popen(_cli("train", *common, "--set", "run.name=crash"), cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    steps_on_disk = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert steps_on_disk and steps_on_disk[-1] < 400
    assert not (out_dir / "crash" / "summary.json").exists()

    res = subprocess.run(_cli("train", *common, "--set", "run.name=crash", "--resume"), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr

    ev_ref, ev_crash = read_events(out_dir / "ref"), read_events(out_dir / "crash")
    i = max(k for k, e in enumerate(ev_crash) if e["event"] == "resumed")
    resumed_at = ev_crash[i]["step"]
    assert resumed_at in steps_on_disk
    after = _by_step(ev_crash[i:], "train")
    ref_train = _by_step(ev_ref, "train")
    assert sorted(after) == [s for s in sorted(ref_train) if s > resumed_at]
    for step, e in after.items():
        assert e["loss"] == pytest.approx(ref_train[step]["loss"], rel=1e-6, abs=1e-6), step
        assert e["tokens"] == ref_train[step]["tokens"]
    s_ref = json.loads((out_dir / "ref" / "summary.json").read_text())
    s_crash = json.loads((out_dir / "crash" / "summary.json").read_text())
    assert s_crash["final_eval_loss"] == pytest.approx(s_ref["final_eval_loss"], rel=1e-6, abs=1e-6)
    assert s_crash["tokens"] == s_ref["tokens"] and s_crash["steps"] == 400


def test_read_events_can_skip_a_line_torn_by_a_killed_writer(tmp_path: Path):
    """A process killed mid-write leaves a partial line; the next process appends after it. Strict reading
    refuses the file; skip_torn leaves out only that line."""
    (tmp_path / "events.jsonl").write_text('{"event": "a"}\n{"event": "tr' + '{"event": "b"}\n{"event": "c"}\n')
    with pytest.raises(ValueError):
        read_events(tmp_path)
    assert [e["event"] for e in read_events(tmp_path, skip_torn=True)] == ["a", "c"]
