"""What a run leaves in its folder for ``dtrain export`` (and other tools) to read without it running.

- ``RUN_DIR/model.json``: the run's ``[model]`` and ``[data]`` sections, the spec of θ's flat vector
  (``dtrain.codec.spec``) and the whole resolved config (the model card's training config), written by every
  coordinator start before anything is served (:func:`write_layout`), and by ``dtrain train`` and
  ``dtrain simulate --inprocess`` with their final θ.
- ``RUN_DIR/theta/theta-VERSION.f32``: θ as raw little-endian float32 in the spec's layout, written by
  ``dtrain train`` (VERSION: its steps) and ``dtrain simulate --inprocess`` (VERSION: the outer version) at
  their end (:func:`write_theta`). A coordinator's θ lives in its checkpoints and spool
  (``dtrain.models.stored``).

Plain files and numpy only: no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dtrain import codec
from dtrain.config.sections import Config, DataConfig, ModelConfig
from dtrain.errors import DtrainError

LAYOUT = "model.json"
THETA_DIR = "theta"  # RUN_DIR/theta/theta-VERSION.f32: a train or in-process run's final θ


def write_layout(cfg: Config, run_dir: str | Path, spec: codec.Spec) -> Path:
    """RUN_DIR/model.json (atomically): the [model] and [data] sections, θ's spec and the whole config."""
    path = Path(run_dir) / LAYOUT
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data),
                               "spec": spec, "config": cfg.to_dict()}))
    tmp.replace(path)
    return path


def read_layout(run_dir: str | Path) -> tuple[ModelConfig, DataConfig, codec.Spec]:
    """The run's [model], [data] and θ's spec from RUN_DIR/model.json; DtrainError if there is none."""
    raw = _layout(run_dir)
    try:
        return ModelConfig(**raw["model"]), DataConfig(**raw["data"]), raw["spec"]
    except (KeyError, TypeError) as e:
        raise DtrainError(f"{Path(run_dir) / LAYOUT}: unreadable: {type(e).__name__}: {e}") from None


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The whole resolved config a run recorded in RUN_DIR/model.json (None: written before it was recorded)."""
    config = _layout(run_dir).get("config")
    return config if isinstance(config, dict) else None


def _layout(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / LAYOUT
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DtrainError(f"{run_dir}: no {LAYOUT}: not the folder of a dtrain run (one of this version's "
                          "dtrain coordinator, simulate, or a finished dtrain train or simulate --inprocess)") from None
    except (OSError, ValueError) as e:
        raise DtrainError(f"{path}: unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise DtrainError(f"{path}: not a JSON object")
    return raw


def theta_path(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / THETA_DIR / f"theta-{version:08d}.f32"


def write_theta(cfg: Config, run_dir: str | Path, version: int, params: Any) -> Path:
    """A run's θ (a host pytree of the model's parameters) as RUN_DIR/theta/theta-VERSION.f32, atomically, and
    RUN_DIR/model.json with its spec: what ``dtrain export`` reads from a ``dtrain train`` or ``simulate
    --inprocess`` run."""
    spec, vec = codec.flatten(params)
    path = theta_path(run_dir, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    np.ascontiguousarray(vec, dtype="<f4").tofile(tmp)
    os.replace(tmp, path)
    write_layout(cfg, run_dir, spec)
    return path
