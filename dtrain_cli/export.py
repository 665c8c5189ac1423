"""``dtrain export RUN_DIR [--version V] --out DIR``: the coordinator's θ at a version as a Hugging Face folder.

Reads what the coordinator left in RUN_DIR (``coordinator.stored``: ``model.json``, θ's files of the versions
still on disk), maps it with ``dtrain.models.hf`` (llama: ``LlamaForCausalLM``; gpt: ``GPT2LMHeadModel``) and writes
``config.json``, ``generation_config.json``, float32 safetensors and, when the run's data source is a local token
store with a Hugging Face tokenizer, ``tokenizer.json`` and a ``tokenizer_config.json``. No JAX is imported: θ
is memory-mapped from the coordinator's file and written tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from dtrain import codec
from dtrain.config.sections import DataConfig
from dtrain.errors import DtrainError


def main(run_dir: str, version: int | None, out: str, shard_bytes: int) -> int:
    from coordinator.stored import read_layout, theta_file
    from dtrain.models import hf

    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DtrainError(f"--out {out}: exists and is not an empty folder (the export writes a new one)")
    model, data, spec = read_layout(run_dir)
    try:
        hf.mapping(model, spec)  # a kind without a counterpart: refused before anything is read
        version, path = theta_file(run_dir, spec, version)
        vocab, eos_id, note = _tokenizer(data, Path(run_dir))
        theta = np.memmap(path, "<f4", mode="r")
        files = hf.export_folder(model, spec, theta, target, shard_bytes=shard_bytes, eos_id=eos_id)
    except hf.HFError as e:
        raise DtrainError(str(e)) from None
    if vocab is not None:
        shutil.copyfile(vocab, target / "tokenizer.json")
        (target / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(vocab, eos_id, model.seq_len),
                                                                 indent=2))
        files += ["tokenizer.json", "tokenizer_config.json"]
    arch = "LlamaForCausalLM" if model.kind == "llama" else "GPT2LMHeadModel"
    size = sum((target / f).stat().st_size for f in files)
    print(f"dtrain export: version {version} of {run_dir} -> {target} ({arch}, {codec.spec_size(spec):,} params, "
          f"{size / 1e6:,.1f} MB: {', '.join(files)}); {note}")
    return 0


def _tokenizer(data: DataConfig, run_dir: Path) -> tuple[Path | None, int | None, str]:
    """(the store's tokenizer.json or None, its end-of-document id, a note for the summary) for the run's source:
    a store it names, or the one a builtin or text source was made into under data.cache (default: the run
    folder's OUT_DIR/data-cache)."""
    from dtrain.data.corpus import existing_store, names_store

    if not names_store(data.source) and data.tokenizer == "bytes":
        return None, None, ("no tokenizer files: the run's data was byte-tokenized (ids are bytes), and no Hugging "
                            "Face tokenizer exists for the byte tokenizer")
    cache = Path(data.cache).expanduser() if data.cache else run_dir.parent / "data-cache"
    source = existing_store(data, cache)
    if source is None:
        return None, None, (f"no tokenizer files: the token store the run's source {data.source!r} was made into "
                            f"is not under {cache} (or its files changed since)")
    manifest = Path(source) / "manifest.json"
    if "://" in source:
        return None, None, f"tokenizer not copied: the run's store {source} is remote (copy its tokenizer.json by hand)"
    try:
        info = json.loads(manifest.read_text())
        name, eos_id = info["tokenizer"], info.get("eos_id")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DtrainError(f"{manifest}: unreadable: {type(e).__name__}: {e}") from None
    if name == "bytes":
        return None, eos_id, "no tokenizer files: the run's store is byte-tokenized, and no Hugging Face tokenizer " \
            "exists for the byte tokenizer"
    vocab = Path(source) / name
    if not vocab.is_file():
        return None, eos_id, f"no tokenizer files: the store names {name!r} but {vocab} is not there"
    return vocab, eos_id, f"tokenizer: {vocab}"


def _tokenizer_config(vocab: Path, eos_id: int | None, seq_len: int) -> dict[str, object]:
    """A minimal tokenizer_config.json: transformers' fast tokenizer over tokenizer.json, with its eos token."""
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    if eos_id is not None:
        from tokenizers import Tokenizer

        token = Tokenizer.from_file(str(vocab)).id_to_token(eos_id)
        if token is not None:
            config.update(eos_token=token, bos_token=token)
    return config
