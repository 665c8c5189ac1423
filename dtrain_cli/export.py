"""``dtrain export RUN_DIR [--version V] --out DIR``: the coordinator's θ at a version as a Hugging Face folder.

Reads what the coordinator left in RUN_DIR (``dtrain.models.stored``: ``model.json``, θ's files of the versions
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
from dtrain.data.corpus import run_tokenizer
from dtrain.errors import DtrainError


def main(run_dir: str, version: int | None, out: str, shard_bytes: int) -> int:
    from dtrain.models import hf
    from dtrain.models.stored import read_layout, theta_file

    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DtrainError(f"--out {out}: exists and is not an empty folder (the export writes a new one)")
    model, data, spec = read_layout(run_dir)
    try:
        hf.mapping(model, spec)  # a kind without a counterpart: refused before anything is read
        version, path = theta_file(run_dir, spec, version)
        vocab, eos_id, note, _ = run_tokenizer(data, Path(run_dir))
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


def _tokenizer_config(vocab: Path, eos_id: int | None, seq_len: int) -> dict[str, object]:
    """A minimal tokenizer_config.json: transformers' fast tokenizer over tokenizer.json, with its eos token."""
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    if eos_id is not None:
        from tokenizers import Tokenizer

        token = Tokenizer.from_file(str(vocab)).id_to_token(eos_id)
        if token is not None:
            config.update(eos_token=token, bos_token=token)
    return config
