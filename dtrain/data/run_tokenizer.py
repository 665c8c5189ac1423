"""A finished run's tokenizer, found again from its ``[data]`` section: what ``dtrain export`` copies next to the
weights and what ``dtrain.load`` decodes with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from dtrain.config.sections import DataConfig
from dtrain.data.corpus import existing_store, names_store
from dtrain.data.token_store import DataError


class RunTokenizer(NamedTuple):
    """What :func:`run_tokenizer` finds: the store's tokenizer.json (None: none to copy), its end-of-document id, a
    note saying which (or why none), and whether the run's ids are bytes (the byte tokenizer)."""

    file: Path | None
    eos_id: int | None
    note: str
    bytes: bool = False


def run_tokenizer(data: DataConfig, run_dir: Path) -> RunTokenizer:
    """(the store's tokenizer.json or None, its end-of-document id, a note saying which or why none) for a run's
    source (``dtrain export``, ``dtrain.load``): a store it names, or the one a builtin or text source was made
    into under data.cache (default: the run folder's OUT_DIR/data-cache). DataError for an unreadable manifest."""
    if not names_store(data.source) and data.tokenizer == "bytes":
        return RunTokenizer(None, None, "no tokenizer files: the run's data was byte-tokenized (ids are bytes), and no "
                            "Hugging Face tokenizer exists for the byte tokenizer", bytes=True)
    cache = Path(data.cache).expanduser() if data.cache else run_dir.parent / "data-cache"
    source = existing_store(data, cache)
    if source is None:
        return RunTokenizer(None, None, f"no tokenizer files: the token store the run's source {data.source!r} was "
                            f"made into is not under {cache} (or its files changed since)")
    manifest = Path(source) / "manifest.json"
    if "://" in source:
        return RunTokenizer(None, None, f"tokenizer not copied: the run's store {source} is remote (copy its "
                            "tokenizer.json by hand)")
    try:
        info = json.loads(manifest.read_text())
        name, eos_id = info["tokenizer"], info.get("eos_id")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{manifest}: unreadable: {type(e).__name__}: {e}") from None
    if name == "bytes":
        return RunTokenizer(None, eos_id, "no tokenizer files: the run's store is byte-tokenized, and no Hugging Face "
                            "tokenizer exists for the byte tokenizer", bytes=True)
    vocab = Path(source) / name
    if not vocab.is_file():
        return RunTokenizer(None, eos_id, f"no tokenizer files: the store names {name!r} but {vocab} is not there")
    return RunTokenizer(vocab, eos_id, f"tokenizer: {vocab}")

