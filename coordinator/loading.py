"""The coordinator's state and merger at its start: a new run's from θ_0, or a resumed run's from the newest
good checkpoint.

Owns the choice of checkpoint (:func:`resume_state`: newest first, a bad one skipped and set aside) and the
checks a restored checkpoint passes before anything is served (its files, its metadata, its size and θ's digest
against this config's model); :func:`has_checkpoint` answers ``dtrain coordinator --resume=auto``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from coordinator.records import StateError, StateOptions
from coordinator.shard import shard_ranges
from coordinator.state import CoordinatorState
from dtrain import codec
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import CheckpointError
from dtrain.runlog import RunLog

if TYPE_CHECKING:
    from dtrain.checkpoint import Checkpointer


class Loaded(NamedTuple):
    """What a coordinator starts from: its run's id, the state machine and the merger (θ, momentum, residual)."""

    run_id: str
    state: CoordinatorState
    merger: Merger
    meta: dict[str, Any] = {}  # a restored checkpoint's metadata (a sharded lead's: every shard's digest)


def has_checkpoint(cfg: Config, run_dir: str | Path) -> bool:
    """Whether RUN_DIR holds a coordinator checkpoint to resume from (good or not: resuming tries each); what
    ``dtrain coordinator --resume=auto`` asks at every start of a restarted Deployment."""
    ckpt_dir = Path(run_dir) / "coordinator"
    return cfg.coordinator.checkpoint and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


def open_merger(cfg: Config, run_dir: Path, theta: np.ndarray | Path, version: int, momentum: Path | None,
                residual: Path | None, spec: codec.Spec | None = None) -> Merger:
    """The merger over ``theta`` (and a restored run's momentum and residual), spooling under RUN_DIR/spool;
    CheckpointError if they do not fit this config's model. ``spec``: the parameter tree (``outer.fragments`` > 1
    plans its fragments from it)."""
    try:
        return Merger(theta, MergeOptions.from_config(cfg, spec), version=version, momentum=momentum,
                      residual=residual, spool_dir=run_dir / "spool")
    except ConfigError:  # outer.fragments that this model's tree cannot be cut into
        raise
    except ValueError as e:  # a θ/momentum/residual of the wrong size
        raise CheckpointError(f"coordinator state does not match this config's model: {e}") from None


def new_run(cfg: Config, opts: StateOptions, run_dir: Path, theta: np.ndarray | Path | None, now: float,
            spec: codec.Spec | None = None) -> Loaded:
    """A new run from θ_0 (``theta``, required), under a fresh run id; ``spec``: the parameter tree."""
    if theta is None:
        raise ValueError("a new coordinator run needs θ_0")
    run_id = uuid.uuid4().hex[:12]
    return Loaded(run_id, CoordinatorState(opts, run_id, now), open_merger(cfg, run_dir, theta, 0, None, None, spec))


def resume_state(cfg: Config, opts: StateOptions, run_dir: Path, spec: codec.Spec, ckpt: Checkpointer,
                 log: RunLog, now: float) -> Loaded:
    """Everything from the newest good checkpoint in ``ckpt``, its leases running from ``now``.

    Checkpoints are tried newest first; one that cannot be restored (a corrupt or missing state file or
    metadata, a save that did not finish, a state that does not fit this config) is skipped, and once a good
    one is found each skipped one is set aside (``Checkpointer.set_aside``) with a ``checkpoint_skipped`` event
    and a progress line. If none is good, CheckpointError names each and why."""
    skipped: list[tuple[int, str]] = []
    for step in ckpt.steps():
        try:
            loaded = restore(cfg, opts, run_dir, spec, ckpt, step, now)
            break
        except (CheckpointError, StateError) as e:
            skipped.append((step, " ".join(str(e).split())))  # one line, whatever the underlying error
    else:
        reasons = "; ".join(f"checkpoint {step}: {why}" for step, why in skipped)
        raise CheckpointError(f"--resume: no good coordinator checkpoint in {ckpt.directory}: {reasons}")
    for step, why in skipped:
        moved = ckpt.set_aside(step)
        log.event("checkpoint_skipped", step=step, reason=why, moved_to=str(moved))
        log.progress(f"skipped checkpoint {step}: {why} (moved to {moved})")
    log.event("coordinator_resumed", version=loaded.state.version, skipped=[step for step, _ in skipped])
    log.progress(f"resumed from version {loaded.state.version} (its checkpoint)")
    return loaded


def restore(cfg: Config, opts: StateOptions, run_dir: Path, spec: codec.Spec, ckpt: Checkpointer, step: int,
            now: float) -> Loaded:
    """The state and merger from checkpoint ``step``, or CheckpointError / StateError saying what is wrong."""
    version, files, meta = ckpt.restore_files(step)
    missing = {"theta", "momentum"} - set(files)
    if missing:
        raise CheckpointError(f"checkpoint {version} lacks {sorted(missing)}: not a coordinator checkpoint")
    if meta.get("version", version) != version or "state" not in meta:
        raise CheckpointError(f"checkpoint {version}: its metadata records version {meta.get('version')} "
                              f"and {'a' if 'state' in meta else 'no'} coordinator state")
    state = CoordinatorState.from_json(opts, meta["state"], now)
    # Files inside the checkpoint: linked into the merger's state folder, not read into memory.
    merger = open_merger(cfg, run_dir, files["theta"], version, files["momentum"], files.get("residual"), spec)
    # a sharded coordinator's lead holds range 0 (coordinator/shard.py)
    tree_size = shard_ranges(spec, cfg.coordinator.shards)[0].size if cfg.coordinator.shards > 1 \
        else codec.spec_size(spec)
    problem = ""
    if merger.n != tree_size:
        problem = f"checkpoint {version} holds {merger.n} parameters, this config's model has {tree_size}"
    elif merger.digest != meta.get("params_digest"):
        problem = (f"checkpoint {version}: θ digest {merger.digest} differs from the recorded "
                   f"{meta.get('params_digest')}")
    elif cfg.coordinator.shards > 1 and len(meta.get("shard_digests", ())) != cfg.coordinator.shards:
        problem = (f"checkpoint {version} records {len(meta.get('shard_digests', ()))} shards' digests, "
                   f"coordinator.shards is {cfg.coordinator.shards}")
    if problem:
        merger.close()
        raise CheckpointError(problem)
    return Loaded(state.run_id, state, merger, meta)
