"""A killed and restarted island's counts with real processes: its ``train`` events' tokens go on from what it
trained before the kill, and the run's summary and closing line say the tokens the audit counts merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.config.load import load_config
from dtrain.runlog import read_events
from dtrain_cli.fault_spec import parse_fault
from dtrain_cli.plot import read_run, run_series
from dtrain_cli.simulate import run_simulation
from simulate_helpers import NO_FAKE_DEVICES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # two worker processes and a restart: ~20 s
def test_a_restarted_islands_tokens_go_on_and_the_summary_says_the_tokens_merged(tmp_path: Path,
                                                                                  compile_cache: str) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=80", "outer.inner_steps=10",
        "worker.heartbeat_s=0.5", "coordinator.grace_s=60", "run.log_every=5", compile_cache])
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("kill:island-1@v2+0s", 2)])
    out = Path(s["run_dir"])
    (restart,) = s["restarts"]
    assert restart["island"] == "island-1" and restart["first_step_t"] is not None
    # the run's tokens are the audit's merged ones: every sequence of both shards once
    shard_tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len
    assert s["audit"]["lost_tokens"] == s["audit"]["doubled_tokens"] == 0
    assert s["tokens"] == s["audit"]["merged_tokens"] == 2 * shard_tokens
    assert json.loads((out / "summary.json").read_text())["tokens"] == s["tokens"]
    stopped = next(e for e in read_events(out) if e["event"] == "coordinator_stopped")
    assert stopped["tokens_merged"] == s["tokens"]
    driver = read_events(out / "driver")
    (finished,) = [e for e in driver if e["event"] == "run_finished"]
    assert finished["tokens"] == s["tokens"]
    # each island's count only grows, across the restart too, and ends at least at its shard's tokens (a range
    # the killed process trained after its last merged push is trained again, and counted again)
    for name in ("island-0", "island-1"):
        events = read_events(out / "islands" / name, skip_torn=True)
        tokens = [e["tokens"] for e in events if e["event"] in ("train", "trained")]
        assert tokens == sorted(tokens) and tokens[-1] >= shard_tokens, (name, tokens)
        summary = json.loads((out / "islands" / name / "summary.json").read_text())
        assert summary["tokens"] == tokens[-1]
    starts = [e for e in read_events(out / "islands" / "island-1", skip_torn=True) if e["event"] == "island_started"]
    assert len(starts) == 2 and starts[0]["tokens"] == 0 and starts[1]["tokens"] > 0
    assert s["tokens_trained"] == sum(i["tokens"] for i in s["islands"]) >= s["tokens"]
    # dtrain plot's loss.png: each island's train losses in the order trained (no zig-zag back to the start), and
    # the final eval at the tokens merged
    series = run_series(*read_run(out))
    for name in ("island-0", "island-1"):
        in_order = [(e["tokens"], e["loss"]) for e in read_events(out / "islands" / name, skip_torn=True)
                    if e["event"] == "train"]
        assert series.train_loss[name] == in_order
    assert {x for x, _ in series.final_eval.values()} == {s["tokens"]}
