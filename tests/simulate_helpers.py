"""What the tests of `dtrain simulate` with real processes share (test_simulate_processes.py,
test_simulate_restarts.py): the environment of a worker process, and the tiny config of a two-island run."""

from __future__ import annotations

from pathlib import Path

from dtrain.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent
NO_FAKE_DEVICES = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # one CPU device per worker process: faster


def process_cfg(tmp_path, *extra: str):
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40", "outer.inner_steps=10",
        "worker.heartbeat_s=0.5", "coordinator.grace_s=60", *extra])
