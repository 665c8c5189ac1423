"""The llama's Hugging Face families (dtrain/models/model.py's LlamaSwitches, dtrain/models/rope.py,
dtrain/config/hf_fields.py): a tiny model made by transformers from each family's config class imports through
model.init_from with its config.json honoured, and computes transformers' logits; rope scalings; a config that
contradicts the folder is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from dtrain.config.load import load_config
from dtrain.config.sections import ConfigError
from dtrain.models import hf, model
from dtrain.steps.inner import loss_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
VOCAB = 256  # the byte tokenizer's, so that the slow round trip trains on the built-in corpus

# Each family's switches, turned on in its tiny model: Llama 3's rope scaling (a small original context so that
# every band of llama3's rule is used), Qwen 2.5's q/k/v biases, Qwen 3's q/k norms with its own head size,
# Mistral's sliding window (shorter than the sequences).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16},
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 256},
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "mistral": {"sliding_window": 8, "rms_norm_eps": 1e-5},
}
_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def hf_folder(path: Path, family: str, nudge: float = 0.05, **overrides: Any) -> Path:
    """A tiny random ``<Family>ForCausalLM`` made by transformers, saved to ``path``: every parameter nudged by
    normal noise of std ``nudge``, so that biases and norm weights are not their zeros and ones."""
    config_cls = getattr(transformers, f"{_CLASSES[family]}Config")
    model_cls = getattr(transformers, f"{_CLASSES[family]}ForCausalLM")
    fields = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              **FAMILIES[family], **overrides}
    torch.manual_seed(0)
    m = model_cls(config_cls(**fields))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * nudge)
    m.save_pretrained(path)
    return path


def their_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def imported(folder: Path, *overrides: str):
    """(config, params) of ``folder`` imported as θ_0 by a config that names only the folder and the sequence
    length: every [model] field comes from its config.json."""
    cfg = load_config(None, [f"model.init_from={folder}", "model.seq_len=32", *overrides])
    built = model.build(cfg.model)
    return cfg, built, hf.load_params(cfg.model, built.abstract_params)


def _tokens(n: int = 2, length: int = 32) -> np.ndarray:
    return np.random.default_rng(3).integers(0, VOCAB, (n, length)).astype(np.int32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_model_of_each_family_imports_with_its_logits(tmp_path, family):
    folder = hf_folder(tmp_path / "hf", family)
    cfg, built, params = imported(folder)
    assert (cfg.model.kind, cfg.model.family) == ("llama", family)
    tokens = _tokens()
    ours = np.asarray(built.apply(params, tokens))
    assert np.abs(ours - their_logits(folder, tokens)).max() <= 1e-4


def test_the_families_switches_are_taken_from_config_json(tmp_path):
    m = imported(hf_folder(tmp_path / "llama", "llama"))[0].model
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max, m.rope_theta, m.norm_eps, m.tie_embeddings,
            m.max_positions) == ("llama3", 32.0, 16, 500000.0, 1e-6, True, 256)
    m = imported(hf_folder(tmp_path / "qwen3", "qwen3"))[0].model
    assert (m.head_size, m.d_model // m.n_heads, m.kv_heads) == (16, 8, 2)
    assert imported(hf_folder(tmp_path / "mistral", "mistral"))[0].model.sliding_window == 8


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}],
                         ids=["linear", "dynamic", "yarn"])
def test_rope_scalings_compute_transformers_logits(tmp_path, rope):
    # max_position_embeddings 16 < the 32 positions: dynamic NTK scales its base, as transformers does past it
    folder = hf_folder(tmp_path / "hf", "llama", rope_parameters={**rope, "rope_theta": 10000.0},
                       max_position_embeddings=16)
    cfg, built, params = imported(folder)
    assert cfg.model.rope_scaling == rope["rope_type"]
    tokens = _tokens()
    assert np.abs(np.asarray(built.apply(params, tokens)) - their_logits(folder, tokens)).max() <= 1e-4


def test_llama3_rope_scaling_theta0_loss_is_transformers(tmp_path):
    """The issue's measurement: a Llama 3-style folder (rope_theta 500000, llama3 rope scaling, rms_norm_eps 1e-6)
    gives the loss transformers gives on the same batches, where dtrain's own values used to give another."""
    folder = hf_folder(tmp_path / "hf", "llama", nudge=0.3)  # attention that matters to the loss
    cfg, built, params = imported(folder)
    batch = np.random.default_rng(4).integers(0, VOCAB, (4, 33)).astype(np.int32)
    ours = float(jax.jit(lambda p, b: loss_fn(built.apply, p, b))(params, batch))
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor(batch, dtype=torch.long)
        theirs = float(torch.nn.functional.cross_entropy(m(ids[:, :-1]).logits.reshape(-1, VOCAB),
                                                         ids[:, 1:].reshape(-1)))
    assert abs(ours - theirs) <= 1e-4
    plain = model.build(load_config(None, ["model.kind=llama", "model.seq_len=32", "model.vocab_size=256",
                                           "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
                                           "model.mlp_hidden=64", "model.tie_embeddings=true"]).model)
    unscaled = float(loss_fn(plain.apply, params, batch))  # the same θ without the folder's rope and epsilon
    assert abs(unscaled - theirs) > 1e-2  # the folder's config.json matters


@pytest.mark.parametrize("setting", ["model.rope_theta=10000.0", "model.n_kv_heads=4", "model.rope_scaling=none"])
def test_a_set_that_contradicts_the_folder_is_one_line(tmp_path, setting):
    folder = hf_folder(tmp_path / "hf", "llama")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.init_from={folder}", setting])
    msg = str(e.value)
    name, value = setting.split("=")
    theirs = {"model.rope_theta": "500000.0", "model.n_kv_heads": "2", "model.rope_scaling": "'llama3'"}[name]
    assert "\n" not in msg and f"{name}: the config has " in msg and f"config.json has {theirs}" in msg, msg
    done = subprocess.run([sys.executable, "-m", "dtrain_cli", "train", "--config", "llama-tiny", "--set",
                           f"model.init_from={folder}", "--set", "run.out_dir=" + str(tmp_path)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "model.mlp_hidden: the config has 96" in lines[0] and "config.json has 64" in lines[0], lines[0]


def test_what_dtrain_does_not_compute_is_refused_by_name(tmp_path):
    folder = hf_folder(tmp_path / "hf", "qwen2")
    raw = json.loads((folder / "config.json").read_text())
    for key, value, named in [("hidden_act", "gelu", "hidden_act"),
                              ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_type"),
                              ("use_sliding_window", True, "use_sliding_window")]:
        (folder / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ConfigError, match=f"config.json has [a-z_.]*{named}"):
            load_config(None, [f"model.init_from={folder}"])
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = load_config(None, [f"model.init_from={folder}"])
    (folder / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1e-5}))  # changed after the load
    with pytest.raises(hf.HFError, match=r"model.norm_eps is 1e-06, config.json has 1e-05"):
        hf.load_params(cfg.model, model.build(cfg.model).abstract_params)


def _short_run(tmp_path: Path) -> list[str]:
    """A few steps on a small slice of the built-in corpus (bytes: the tiny models' 256 ids)."""
    return [f"run.out_dir={tmp_path / 'runs'}", "run.name=fam", "train.steps=4", "train.warmup_steps=1",
            "train.batch_size=8", "train.steps_per_call=2", "outer.inner_steps=2", "data.max_bytes=60000",
            "data.eval_batches=1", "run.log_every=2"]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_round_trips_through_a_two_island_run(tmp_path, family):
    """import (config.json honoured) → two islands train in-process → dtrain export → transformers computes the
    trained θ's logits, and the exported config.json still carries what was imported."""
    from dtrain.train.runs import run_simulate_inprocess
    from dtrain_cli import export

    folder = hf_folder(tmp_path / "hf", family)
    before = json.loads((folder / "config.json").read_text())
    cfg = load_config(None, [f"model.init_from={folder}", "model.seq_len=32", *_short_run(tmp_path)])
    summary = run_simulate_inprocess(cfg, islands=2, quiet=True)
    run = Path(summary["run_dir"])
    assert export.main(str(run), None, str(tmp_path / "out"), 10**9) == 0
    theta = hf.load_params(dataclasses.replace(cfg.model, init_from=str(tmp_path / "out")),
                           model.build(cfg.model).abstract_params)
    imported_theta = hf.load_params(cfg.model, model.build(cfg.model).abstract_params)
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(jax.tree.leaves(theta), jax.tree.leaves(imported_theta),
                                                          strict=True))  # it trained
    tokens = _tokens()
    ours = np.asarray(model.build(cfg.model).apply(theta, tokens))
    assert np.abs(ours - their_logits(tmp_path / "out", tokens)).max() <= 1e-4
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("model_type", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "head_dim",
                "sliding_window", "num_key_value_heads"):
        if key in before:
            assert after[key] == before[key], key
    rope = before["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        assert after["rope_scaling"]["rope_type"] == rope["rope_type"]
        assert after["rope_scaling"]["factor"] == rope["factor"]
    assert f"| version | {summary['version']} |" in (tmp_path / "out" / "README.md").read_text()


def test_the_family_configs_have_the_published_sizes():
    """The configs for the real sizes: parameters as the published checkpoints count them (tied tables once)."""
    sizes = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen3-0.6b": 596_049_920,
             "qwen3-1.7b": 1_720_574_976, "mistral-7b": 7_248_023_552, "llama-1b": 1_235_814_400}
    for name, size in sizes.items():
        cfg = load_config(name).model
        assert model.param_count(model.build(cfg).abstract_params) == size, name
    m = load_config("llama-1b").model  # Llama 3.2 1B's rope, as its config.json has it
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max, m.max_positions) == ("llama3", 32.0, 8192, 131072)
    assert (load_config("qwen3-0.6b").model.head_size, load_config("qwen2.5-0.5b").model.family) == (128, "qwen2")
