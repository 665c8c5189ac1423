"""Orbax checkpoint helpers: a pytree of arrays plus a small JSON record per step.

Orbax writes each step into a temporary folder and renames it into place when
complete, so a crash mid-save never leaves a checkpoint that looks whole; a
restore only ever sees finished steps. Nothing is pickled: arrays go to
tensorstore, metadata to JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dtrain.errors import CheckpointError  # re-exported: callers import it from here

__all__ = ["CheckpointError", "Checkpointer", "FileArraysHandler", "FileArraysRestore", "FileArraysSave"]

_MANIFEST = "manifest.json"


class FileArraysHandler(ocp.CheckpointHandler):
    """An orbax handler for flat float32 arrays that already live in files (the coordinator's state).

    Saving hard-links each file into orbax's temporary step folder (a copy by the kernel where links are
    not possible): O(1) time and no memory, however large the model. That is only correct because the
    coordinator never modifies a version's file while it is current or anything else links it (it writes
    over a dead version's file only when its link count is 1). A manifest records each array's
    length; :meth:`restore` checks every file against it and returns their paths inside the checkpoint
    (read-only to the caller, who verifies the contents: the coordinator checks θ against the digest in
    its metadata). Orbax's CheckpointManager does the rest: the temporary folder, the atomic rename,
    max_to_keep.
    """

    def save(self, directory: Any, args: FileArraysSave) -> None:
        directory = Path(directory)
        manifest = {}
        for name, path in args.files.items():
            dest = directory / f"{name}.bin"
            try:
                os.link(path, dest)
            except OSError:
                shutil.copyfile(path, dest)
            manifest[name] = {"file": dest.name, "dtype": "<f4", "length": Path(path).stat().st_size // 4}
        (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1))

    def restore(self, directory: Any, args: FileArraysRestore | None = None) -> dict[str, Path]:
        directory = Path(directory)
        try:
            manifest = json.loads((directory / _MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{directory}: unreadable {_MANIFEST}: {e}") from None
        out: dict[str, Path] = {}
        for name, entry in manifest.items():
            path = directory / entry["file"]
            if not path.is_file() or path.stat().st_size != 4 * entry["length"]:
                raise CheckpointError(f"{path}: missing or not {entry['length']} float32 values")
            out[name] = path
        return out


@ocp.args.register_with_handler(FileArraysHandler, for_save=True)
@dataclasses.dataclass
class FileArraysSave(ocp.args.CheckpointArgs):
    files: dict[str, Path]  # name -> file of raw little-endian float32


@ocp.args.register_with_handler(FileArraysHandler, for_restore=True)
@dataclasses.dataclass
class FileArraysRestore(ocp.args.CheckpointArgs):
    pass


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

    def save_files(self, step: int, files: dict[str, Path], meta: dict[str, Any]) -> None:
        """A checkpoint of file-backed arrays (see FileArraysHandler): no copy of them passes through memory."""
        self._mngr.save(step, args=ocp.args.Composite(state=FileArraysSave(files),
                                                      meta=ocp.args.JsonSave(meta)))

    def restore_files(self, step: int | None = None) -> tuple[int, dict[str, Path], dict[str, Any]]:
        """(step, {name: path inside the checkpoint}, meta) of a :meth:`save_files` checkpoint."""
        step = self._mngr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(state=FileArraysRestore(),
                                                                   meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"checkpoint {self.directory}/{step} cannot be restored: {e}") from None
        return step, dict(out.state), dict(out.meta)

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
