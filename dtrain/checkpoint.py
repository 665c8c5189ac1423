"""Orbax checkpoint helpers: a pytree of arrays plus a small JSON record per step.

Orbax writes each step into a temporary folder and renames it into place when
complete, so a crash mid-save never leaves a checkpoint that looks whole; a
restore only ever sees finished steps (a step folder without orbax's commit
marker, as a save to a store without renames would leave it, is refused).
Nothing is pickled: arrays go to tensorstore, metadata to JSON. File-backed
arrays (:class:`FileArraysHandler`) carry a CRC-32 each, checked on restore.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dtrain.codec.frame import crc32
from dtrain.errors import CheckpointError  # re-exported: callers import it from here

__all__ = ["CheckpointError", "Checkpointer", "FileArraysHandler", "FileArraysRestore", "FileArraysSave"]

_MANIFEST = "manifest.json"
COMMIT_MARKER = "commit_success.txt"  # orbax writes it into a step folder last, once the step is complete
_CRC_PIECE = 1 << 20


def file_crc32(path: str | Path) -> int:
    """CRC-32 of a file's bytes, read in 1 MiB pieces (the CRC releases the GIL while it sums a piece)."""
    crc = 0
    piece = bytearray(_CRC_PIECE)
    view = memoryview(piece)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(piece):
            crc = crc32(view[:n], crc)
    return crc


def _crc32s(paths: dict[str, Path]) -> dict[str, int]:
    """:func:`file_crc32` of each file, one thread per file: a model's state files are summed side by side."""
    with ThreadPoolExecutor(max_workers=max(1, len(paths)), thread_name_prefix="crc32") as pool:
        sums = {name: pool.submit(file_crc32, path) for name, path in paths.items()}
        return {name: future.result() for name, future in sums.items()}


class FileArraysHandler(ocp.CheckpointHandler):
    """An orbax handler for flat float32 arrays that already live in files (the coordinator's state).

    Saving hard-links each file into orbax's temporary step folder (a copy by the kernel where links are
    not possible): O(1) time and no memory, however large the model. That is only correct because the
    coordinator never modifies a version's file while it is current or anything else links it (it writes
    over a dead version's file only when its link count is 1). A manifest records each array's length
    and the CRC-32 of its bytes, summed at save time by reading the files back (one thread per file: the
    files were just written, so they are read from the page cache; 25M parameters: ~100 ms for θ, momentum
    and residual one after the other, next to a ~575 ms outer step). :meth:`restore` checks every file's
    size and CRC-32 against it and returns their paths inside the checkpoint (read-only to the caller; the
    coordinator also checks θ against the digest in its metadata). Orbax's CheckpointManager does the rest:
    the temporary folder, the atomic rename, max_to_keep.
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
        for name, crc in _crc32s({name: directory / entry["file"] for name, entry in manifest.items()}).items():
            manifest[name]["crc32"] = crc
        (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1))

    def restore(self, directory: Any, args: FileArraysRestore | None = None) -> dict[str, Path]:
        directory = Path(directory)
        try:
            manifest = json.loads((directory / _MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{directory}: unreadable {_MANIFEST}: {e}") from None
        out: dict[str, Path] = {}
        try:
            for name, entry in manifest.items():
                path = directory / entry["file"]
                if not path.is_file() or path.stat().st_size != 4 * entry["length"]:
                    raise CheckpointError(f"{path}: missing or not {entry['length']} float32 values")
                if not isinstance(entry.get("crc32"), int):
                    raise CheckpointError(f"{path}: no CRC-32 recorded in {_MANIFEST}: cannot be verified")
                out[name] = path
        except (TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{directory}: malformed {_MANIFEST}: {type(e).__name__}: {e}") from None
        for name, crc in _crc32s(out).items():
            if crc != manifest[name]["crc32"]:
                raise CheckpointError(f"{out[name]}: CRC-32 {crc:08x} differs from the recorded "
                                      f"{manifest[name]['crc32']:08x}: the file is corrupt")
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
        """(step, {name: path inside the checkpoint}, meta) of a :meth:`save_files` checkpoint, every file's
        size and CRC-32 verified. A step folder without orbax's commit marker (a save that did not finish),
        or whose metadata is unreadable or not a JSON object, raises CheckpointError saying so."""
        step = self._mngr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        if not (self.directory / str(step) / COMMIT_MARKER).is_file():
            raise CheckpointError(f"checkpoint {step} is incomplete (no {COMMIT_MARKER}: its save did not finish)")
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(state=FileArraysRestore(),
                                                                   meta=ocp.args.JsonRestore()))
            meta = out.meta
        except (ValueError, KeyError, TypeError, OSError) as e:  # orbax's and json's errors for a damaged step
            raise CheckpointError(f"checkpoint {self.directory}/{step} cannot be restored: "
                                  f"{type(e).__name__}: {e}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {self.directory}/{step}: its metadata is not a JSON object")
        return step, dict(out.state), dict(meta)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def steps(self) -> list[int]:
        """Every step in the folder, newest first, complete or not (:meth:`restore_files` tells)."""
        return sorted(self._mngr.all_steps(), reverse=True)

    def set_aside(self, step: int) -> Path:
        """Moves a step that cannot be restored out of the folder, to ``<folder>.skipped/<step>-<unix time>``
        (kept for inspection; the step number is then free for the next save); returns where it went."""
        dest = self.directory.with_name(self.directory.name + ".skipped") / f"{step}-{int(time.time())}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        (self.directory / str(step)).rename(dest)
        self._mngr.reload()
        return dest

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
