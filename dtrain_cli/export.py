"""``dtrain export RUN_DIR [--version V] [--dtype D] --out DIR``: a run's θ at a version as a Hugging Face folder.

Reads what the run left in RUN_DIR (``dtrain.models.stored``: ``model.json``, θ's files of the versions still on
disk: a coordinator's checkpoints and current θ, a ``dtrain train`` or ``simulate --inprocess`` run's final θ),
maps it with ``dtrain.models.hf`` (llama: its family's ``*ForCausalLM``; gpt: ``GPT2LMHeadModel``) and writes
``config.json`` (what was imported kept: rope scaling, positions, epsilon, biases), ``generation_config.json``,
float32 or bfloat16 safetensors, a ``README.md`` model card (the run, version, tokens, eval loss as the run's
events recorded them, dtrain's version, the training config) and, when the run's data source is a local token
store with a Hugging Face tokenizer, ``tokenizer.json`` and a ``tokenizer_config.json``. No JAX is imported: θ
is memory-mapped from the run's file and written tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from dtrain import __version__, codec
from dtrain.config.hf_fields import ARCHITECTURES
from dtrain.config.sections import ModelConfig
from dtrain.data.run_tokenizer import run_tokenizer
from dtrain.errors import DtrainError


def main(run_dir: str, version: int | None, out: str, shard_bytes: int, dtype: str = "float32") -> int:
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
        files = hf.export_folder(model, spec, theta, target, shard_bytes=shard_bytes, eos_id=eos_id, dtype=dtype)
    except hf.HFError as e:
        raise DtrainError(str(e)) from None
    if vocab is not None:
        shutil.copyfile(vocab, target / "tokenizer.json")
        (target / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(vocab, eos_id, model.seq_len),
                                                                 indent=2))
        files += ["tokenizer.json", "tokenizer_config.json"]
    arch = ARCHITECTURES[model.family] if model.kind == "llama" else "GPT2LMHeadModel"
    (target / "README.md").write_text(model_card(Path(run_dir), version, model, arch, codec.spec_size(spec), dtype))
    files.append("README.md")
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


def provenance(run_dir: Path, version: int) -> tuple[int | None, float | None]:
    """(tokens, eval loss) of ``version`` as the run's events recorded them (None: not recorded): a coordinator's
    ``eval`` events, an in-process run's ``round_merged``, a train run's ``train`` and ``eval`` events (by step)."""
    from dtrain.runlog import read_events

    tokens: int | None = None
    loss: float | None = None
    for r in read_events(run_dir, skip_torn=True, missing_ok=True):
        if r.get("version", r.get("step")) != version:
            continue
        figure = r.get("eval_loss", r.get("loss"))
        if r.get("event") in ("eval", "round_merged") and isinstance(figure, (int, float)):
            loss = float(figure)
        if r.get("event") in ("eval", "round_merged", "train") and isinstance(r.get("tokens"), int):
            tokens = r["tokens"]
    return tokens, loss


def model_card(run_dir: Path, version: int, model: ModelConfig, arch: str, params: int, dtype: str) -> str:
    """README.md: what the folder is and where it came from, with the run's training config."""
    from dtrain.models.layout import read_run_config

    tokens, loss = provenance(run_dir, version)
    config = read_run_config(run_dir)
    start = f"`{model.init_from}` (model.init_from)" if model.init_from else "a random initialization"
    rows = [("run", f"`{run_dir.resolve().name}` ({run_dir})"), ("version", str(version)),
            ("tokens trained on", f"{tokens:,}" if tokens is not None else "not recorded"),
            ("eval loss", f"{loss:.4f} (the run's held-out split)" if loss is not None else "not recorded"),
            ("started from", start), ("weights", dtype), ("exported by", f"dtrain {__version__}")]
    lines = ["---", "library_name: transformers", "tags:", "- dtrain", "---", "",
             f"# {run_dir.resolve().name}", "",
             f"A {arch} of {params:,} parameters trained with dtrain (DiLoCo across islands) and exported with "
             "`dtrain export`.", "", "| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows], ""]
    if config is not None:
        lines += ["## Training config", "", "```toml", _toml(config), "```", ""]
    return "\n".join(lines)


def _toml(config: dict[str, Any]) -> str:
    """The recorded config as TOML, a section per table."""
    out = []
    for section, values in config.items():
        out.append(f"[{section}]")
        out += [f"{k} = {str(v).lower() if isinstance(v, bool) else json.dumps(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out).rstrip()
