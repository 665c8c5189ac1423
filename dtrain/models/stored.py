"""What a run leaves in its folder for tools to read without it running (``dtrain export``, ``dtrain.load``,
``dtrain generate`` and ``dtrain eval``).

- ``RUN_DIR/model.json``: the run's ``[model]`` and ``[data]`` sections and the spec of θ's flat vector
  (``dtrain.codec.spec``), written by every coordinator start (:func:`write_layout`, from
  ``dtrain.models.layout``), before anything is served.
- θ of each version still on disk (:func:`stored_versions`): the checkpoints in ``RUN_DIR/coordinator/VERSION``
  (``dtrain.checkpoint``: the last two, each ``state/theta.bin`` with a manifest, complete once orbax's commit
  marker is there) and the merger's current version, ``RUN_DIR/spool/state/theta-VERSION.f32``
  (``coordinator.merger``: a version's file is never written while it is current); for a ``dtrain train`` or
  ``simulate --inprocess`` run, its final θ, ``RUN_DIR/theta/theta-VERSION.f32`` (``dtrain.models.layout``).

Plain files and numpy only: no JAX, no orbax.
"""

from __future__ import annotations

import re
from pathlib import Path

from dtrain import codec
from dtrain.errors import DtrainError
from dtrain.models.layout import LAYOUT, THETA_DIR, read_layout, write_layout

__all__ = ["LAYOUT", "read_layout", "stored_versions", "theta_file", "write_layout"]

_COMMIT_MARKER = "commit_success.txt"  # dtrain.checkpoint.COMMIT_MARKER (that module imports orbax and JAX)
_MERGER_THETA = re.compile(r"theta-(\d{8})\.f32")


def stored_versions(run_dir: str | Path) -> dict[int, Path]:
    """Each version whose θ is on disk → its file of raw little-endian float32: the complete checkpoints, the
    merger's current version, and a train or in-process run's final θ."""
    root = Path(run_dir)
    out: dict[int, Path] = {}
    ckpts = root / "coordinator"
    if ckpts.is_dir():
        for step in ckpts.iterdir():
            theta = step / "state" / "theta.bin"
            if step.name.isdigit() and (step / _COMMIT_MARKER).is_file() and theta.is_file():
                out[int(step.name)] = theta
    for state in (root / "spool" / "state", root / THETA_DIR):
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
        raise DtrainError(f"{run_dir}: no θ on disk (no checkpoint in {Path(run_dir) / 'coordinator'}, no θ in "
                          f"{Path(run_dir) / 'spool' / 'state'} or {Path(run_dir) / THETA_DIR}: a dtrain train or "
                          f"simulate --inprocess run writes its θ there when it finishes)")
    if version is None:
        version = max(kept)
    if version not in kept:
        raise DtrainError(f"version {version} is not kept in {run_dir}: the versions on disk are "
                          f"{', '.join(map(str, kept))} (a coordinator keeps its last checkpoints and its current θ; "
                          "a train or in-process run its final θ)")
    path = kept[version]
    n = codec.spec_size(spec)
    if path.stat().st_size != 4 * n:
        raise DtrainError(f"{path}: {path.stat().st_size} bytes, but θ of this run's model has {n} float32 values")
    return version, path
