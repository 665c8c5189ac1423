"""Orbax checkpoint helpers: a pytree of arrays plus a small JSON record per step.

Orbax writes each step into a temporary folder and renames it into place when
complete, so a crash mid-save never leaves a checkpoint that looks whole; a
restore only ever sees finished steps. Nothing is pickled: arrays go to
tensorstore, metadata to JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dtrain.errors import CheckpointError  # re-exported: callers import it from here

__all__ = ["CheckpointError", "Checkpointer"]


class Checkpointer:
    """``save(step, tree, meta)`` / ``restore(abstract_tree) -> (step, tree, meta)`` over one folder."""

    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        # Async: device arrays are copied out first, then written in the background;
        # the step only becomes visible once fully written (atomic rename).
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                      meta=ocp.args.JsonSave(meta)))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def restore(self, abstract_tree: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restores ``step`` (default: latest) into the shardings of ``abstract_tree``."""
        step = self._mngr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_tree)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                   meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"checkpoint {self.directory}/{step} does not match this run's model/optimizer: "
                                  f"{e}") from None
        return step, out.state, dict(out.meta)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
