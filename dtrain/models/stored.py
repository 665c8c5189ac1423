"""What a coordinator leaves in its run folder for tools to read without it running (``dtrain export``,
``dtrain.load``, ``dtrain generate`` and ``dtrain eval``); the coordinator writes it (:func:`write_layout`).

- ``RUN_DIR/model.json``: the run's ``[model]`` and ``[data]`` sections and the spec of θ's flat vector
  (``dtrain.codec.spec``), written by every coordinator start (:func:`write_layout`), before anything is served.
- θ of each version still on disk (:func:`stored_versions`): the checkpoints in ``RUN_DIR/coordinator/VERSION``
  (``dtrain.checkpoint``: the last two, each ``state/theta.bin`` with a manifest, complete once orbax's commit
  marker is there) and the merger's current version, ``RUN_DIR/spool/state/theta-VERSION.f32``
  (``coordinator.merger``: a version's file is never written while it is current).

Plain files and numpy only: no JAX, no orbax.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from dtrain import codec
from dtrain.config.sections import Config, DataConfig, ModelConfig
from dtrain.errors import DtrainError

LAYOUT = "model.json"
_COMMIT_MARKER = "commit_success.txt"  # dtrain.checkpoint.COMMIT_MARKER (that module imports orbax and JAX)
_MERGER_THETA = re.compile(r"theta-(\d{8})\.f32")


def write_layout(cfg: Config, run_dir: str | Path, spec: codec.Spec) -> Path:
    """RUN_DIR/model.json (atomically): the [model] and [data] sections and θ's spec."""
    path = Path(run_dir) / LAYOUT
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data),
                               "spec": spec}))
    tmp.replace(path)
    return path


def read_layout(run_dir: str | Path) -> tuple[ModelConfig, DataConfig, codec.Spec]:
    """The run's [model], [data] and θ's spec from RUN_DIR/model.json; DtrainError if there is none."""
    path = Path(run_dir) / LAYOUT
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return ModelConfig(**raw["model"]), DataConfig(**raw["data"]), raw["spec"]
    except FileNotFoundError:
        raise DtrainError(f"{run_dir}: no {LAYOUT}: not the folder of a coordinator's run (one started by this "
                          "version of dtrain coordinator or dtrain simulate without --inprocess)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DtrainError(f"{path}: unreadable: {type(e).__name__}: {e}") from None


def stored_versions(run_dir: str | Path) -> dict[int, Path]:
    """Each version whose θ is on disk → its file of raw little-endian float32: the complete checkpoints, and
    the merger's current version."""
    root = Path(run_dir)
    out: dict[int, Path] = {}
    ckpts = root / "coordinator"
    if ckpts.is_dir():
        for step in ckpts.iterdir():
            theta = step / "state" / "theta.bin"
            if step.name.isdigit() and (step / _COMMIT_MARKER).is_file() and theta.is_file():
                out[int(step.name)] = theta
    state = root / "spool" / "state"
    if state.is_dir():
        for f in state.iterdir():
            m = _MERGER_THETA.fullmatch(f.name)
            if m:
                out.setdefault(int(m.group(1)), f)
    return dict(sorted(out.items()))


def theta_file(run_dir: str | Path, spec: codec.Spec, version: int | None = None) -> tuple[int, Path]:
    """(version, θ's file) for ``version`` (None: the newest on disk), its size checked against the spec;
    DtrainError naming the versions that are kept if it is not one of them."""
    kept = stored_versions(run_dir)
    if not kept:
        raise DtrainError(f"{run_dir}: no coordinator state on disk (no checkpoint in {Path(run_dir) / 'coordinator'}"
                          f", no θ in {Path(run_dir) / 'spool' / 'state'})")
    if version is None:
        version = max(kept)
    if version not in kept:
        raise DtrainError(f"version {version} is not kept in {run_dir}: the versions on disk are "
                          f"{', '.join(map(str, kept))} (the coordinator keeps its last checkpoints and its current θ)")
    path = kept[version]
    n = codec.spec_size(spec)
    if path.stat().st_size != 4 * n:
        raise DtrainError(f"{path}: {path.stat().st_size} bytes, but θ of this run's model has {n} float32 values")
    return version, path
