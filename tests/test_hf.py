"""Hugging Face folders (dtrain/models/hf.py, dtrain export, model.init_from): the same model in transformers, the same
θ back, and every bad input one line."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dtrain import codec
from dtrain.config.load import load_config
from dtrain.config.sections import ModelConfig
from dtrain.models import hf, model
from dtrain.models.stored import write_layout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


# The nudged init per (model, seed), built once per module: most tests start from the same llama-tiny θ.
_INITS: dict[tuple[ModelConfig, int], tuple[codec.Spec, np.ndarray]] = {}


def _theta(config: str, *overrides: str, seed: int = 0):
    """(config, spec, θ): the model's init, every value nudged so norms and zero-initialized leaves are not trivial.
    Every caller gets its own copy of the spec and of θ."""
    cfg = load_config(config, list(overrides))
    key = (cfg.model, seed)
    if key not in _INITS:
        spec, vec = codec.flatten(jax.device_get(model.build(cfg.model).init(seed)))
        _INITS[key] = spec, vec + np.random.default_rng(seed).normal(0, 0.05, vec.shape).astype(np.float32)
    spec, vec = _INITS[key]
    return cfg, copy.deepcopy(spec), vec.copy()


def _their_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _same_model(tmp_path: Path, config: str, *overrides: str, arch: str) -> None:
    cfg, spec, vec = _theta(config, *overrides)
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len)).astype(np.int32)
    ours = np.asarray(model.build(cfg.model).apply(codec.unflatten(spec, vec), tokens))
    hf.export_folder(cfg.model, spec, vec, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [arch]
    assert np.abs(ours - _their_logits(tmp_path / "hf", tokens)).max() <= 1e-4
    back = np.zeros_like(vec)
    hf.read_vector(cfg.model, spec, tmp_path / "hf", back)
    assert back.tobytes() == vec.tobytes()  # bit-identical θ


@pytest.mark.parametrize("overrides", [(), ("model.n_kv_heads=0",), ("model.tie_embeddings=true",)],
                         ids=["gqa", "mha", "tied"])
def test_llama_is_transformers_llama(tmp_path, overrides):
    _same_model(tmp_path, "llama-tiny", *overrides, arch="LlamaForCausalLM")


def test_gpt_is_transformers_gpt2(tmp_path):
    _same_model(tmp_path, "tiny", arch="GPT2LMHeadModel")


def test_sharded_folder_reads_back_and_loads(tmp_path):
    cfg, spec, vec = _theta("llama-tiny")
    files = hf.export_folder(cfg.model, spec, vec, tmp_path, shard_bytes=20_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / hf.INDEX).read_text())
    assert index["metadata"]["total_size"] == 4 * vec.size and set(index["weight_map"].values()) == set(shards)
    back = np.zeros_like(vec)
    hf.read_vector(cfg.model, spec, tmp_path, back)
    assert back.tobytes() == vec.tobytes()
    tokens = np.arange(8, dtype=np.int32)[None]
    ours = np.asarray(model.build(cfg.model).apply(codec.unflatten(spec, vec), tokens))
    assert np.abs(ours - _their_logits(tmp_path, tokens)).max() <= 1e-4


def test_bfloat16_and_buffers_are_read(tmp_path):
    from safetensors.numpy import save_file

    cfg, spec, vec = _theta("llama-tiny")
    hf.export_folder(cfg.model, spec, vec, tmp_path)
    tensors = dict(hf.hf_tensors(cfg.model, spec, vec))
    bf16 = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}  # truncated to bfloat16
    raw = {k: v.view(np.uint8) for k, v in bf16.items()}
    (tmp_path / "model.safetensors").unlink()
    buffer = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    save_file(tensors | buffer, str(tmp_path / "model.safetensors"))
    back = np.zeros_like(vec)
    hf.read_vector(cfg.model, spec, tmp_path, back)  # a buffer some folders carry is ignored
    assert back.tobytes() == vec.tobytes()
    header = {k: {"dtype": "BF16", "shape": list(tensors[k].shape)} for k in raw}
    offset = 0
    for k in raw:
        header[k]["data_offsets"] = [offset, offset + raw[k].size]
        offset += raw[k].size
    blob = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob
                                                  + b"".join(raw[k].tobytes() for k in raw))
    hf.read_vector(cfg.model, spec, tmp_path, back)
    expected = (vec.view(np.uint32) >> 16 << 16).view(np.float32)
    assert back.tobytes() == expected.tobytes()


def test_a_folder_that_does_not_fit_is_one_line_naming_every_tensor(tmp_path):
    cfg, spec, vec = _theta("llama-tiny")
    hf.export_folder(cfg.model, spec, vec, tmp_path)
    other, other_spec, _ = _theta("llama-tiny", "model.n_layers=3", "model.d_model=48", "model.n_heads=4")
    with pytest.raises(hf.HFError) as e:
        hf.read_vector(other.model, other_spec, tmp_path, np.zeros(codec.spec_size(other_spec), np.float32))
    msg = str(e.value)
    assert "\n" not in msg
    assert "missing model.layers.2.input_layernorm.weight [48]" in msg
    assert "model.embed_tokens.weight is [256, 32], the config wants [256, 48]" in msg
    assert msg.count(";") == len([t for t in hf.mapping(other.model, other_spec)]) - 1  # every tensor differs
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf.HFError, match="no model.safetensors or model.safetensors.index.json"):
        hf.weight_files(tmp_path / "empty")


def test_gpt2_biases_must_be_zero_and_mlp_has_no_counterpart(tmp_path):
    from safetensors.numpy import save_file

    cfg, spec, vec = _theta("tiny")
    tensors = dict(hf.hf_tensors(cfg.model, spec, vec))
    tensors["transformer.h.0.mlp.c_fc.bias"] = np.ones_like(tensors["transformer.h.0.mlp.c_fc.bias"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.HFError, match=r"transformer.h.0.mlp.c_fc.bias is not all zero"):
        hf.read_vector(cfg.model, spec, tmp_path, np.zeros_like(vec))
    mlp, mlp_spec, _ = _theta("tiny", "model.kind=mlp")
    with pytest.raises(hf.HFError, match="'mlp' has no Hugging Face counterpart"):
        hf.mapping(mlp.model, mlp_spec)


# -- dtrain export on a coordinator's run folder -------------------------------------------------------------


def _run_folder(tmp_path: Path, config: str, *overrides: str, versions: tuple[int, ...] = (3,)):
    """A run folder as a coordinator leaves it: model.json, θ of the current version in spool/state."""
    cfg, spec, vec = _theta(config, *overrides)
    run = tmp_path / "run"
    (run / "spool" / "state").mkdir(parents=True)
    write_layout(cfg, run, spec)
    for v in versions:
        vec.astype("<f4").tofile(run / "spool" / "state" / f"theta-{v:08d}.f32")
    return cfg, spec, vec, run


def _dtrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain_cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=120)


def test_export_cli_writes_the_folder_without_jax(tmp_path):
    cfg, spec, vec, run = _run_folder(tmp_path, "llama-tiny")
    code = ("import sys, runpy; sys.argv = ['dtrain'] + sys.argv[1:]; from dtrain_cli.main import main; rc = main(); "
            "assert 'jax' not in sys.modules, 'JAX imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "export", str(run), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "version 3" in done.stdout and "no Hugging Face tokenizer exists for the byte tokenizer" in done.stdout
    back = np.zeros_like(vec)
    hf.read_vector(cfg.model, spec, tmp_path / "out", back)
    assert back.tobytes() == vec.tobytes()


def test_export_copies_the_stores_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    store = tmp_path / "store"
    store.mkdir()
    vocab = {"</s>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(store / "tokenizer.json"))
    (store / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer.json", "eos_id": 0}))
    _, _, _, run = _run_folder(tmp_path, "llama-tiny", f"data.source={store}")
    done = _dtrain("export", str(run), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 0
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.eos_token == "</s>" and loaded("hello world")["input_ids"] == [2, 3]


@pytest.mark.parametrize("case", ["version", "kind", "out", "no-run"])
def test_export_cli_bad_input_is_one_line(tmp_path, case):
    config, overrides, args = "llama-tiny", (), ["--out", str(tmp_path / "out")]
    if case == "kind":
        config, overrides = "tiny", ("model.kind=mlp",)
    if case == "version":
        args += ["--version", "1"]
    if case == "out":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x").write_text("x")
    _, _, _, run = _run_folder(tmp_path, config, *overrides)
    done = _dtrain("export", str(tmp_path / "nowhere" if case == "no-run" else run), *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("dtrain export: error: "), done.stderr
    assert {"version": "version 1 is not kept in", "kind": "'mlp' has no Hugging Face counterpart",
            "out": "exists and is not an empty folder", "no-run": "no model.json"}[case] in lines[0]


# -- model.init_from ---------------------------------------------------------------------------------------


def test_init_from_is_the_coordinators_theta0(tmp_path):
    from coordinator.lifecycle import initial_parameters_file

    cfg, spec, vec = _theta("llama-tiny", seed=5)
    hf.export_folder(cfg.model, spec, vec, tmp_path / "hf")
    started = load_config("llama-tiny", [f"model.init_from={tmp_path / 'hf'}"])
    assert started.fingerprint() == cfg.fingerprint()  # islands need not name the folder
    path, got_spec = initial_parameters_file(started, tmp_path / "init")
    assert path is not None and got_spec == spec
    assert codec.params_digest(np.fromfile(path, "<f4")) == codec.params_digest(vec)


@pytest.mark.parametrize("case", ["no-safetensors", "wrong-shape", "config-json"])
def test_init_from_bad_folder_is_one_line(tmp_path, case):
    folder = tmp_path / "hf"
    if case == "no-safetensors":
        folder.mkdir()
        (folder / "pytorch_model.bin").write_bytes(b"")
    else:
        cfg, spec, vec = _theta("llama-tiny", "model.mlp_hidden=64")
        hf.export_folder(cfg.model, spec, vec, folder)
    if case == "wrong-shape":  # a config.json that agrees with the config, tensors that do not
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    done = _dtrain("coordinator", "--config", "llama-tiny", "--set", f"model.init_from={folder}", "--port", "0",
                   "--run-dir", str(tmp_path / "run"), "--quiet")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("dtrain coordinator: config error: ")
    assert {"no-safetensors": "model.init_from: ", "wrong-shape": "model.init_from: ",
            "config-json": f"[model] init_from {folder}: "}[case] in lines[0]
    assert {"no-safetensors": "(found pytorch_model.bin: convert them to safetensors)",
            "wrong-shape": "model.layers.0.mlp.gate_proj.weight is [64, 32], the config wants [96, 32]",
            "config-json": "model.mlp_hidden: the config has 96, " + str(folder) + "/config.json has 64"}[case] \
        in lines[0]


# Slow (a real simulate run, then transformers generates): each part is a default test above. The coordinator's run
# folder (write_layout, spool/state/theta-V.f32, pinned in test_merger.py) read by dtrain export:
# test_export_cli_writes_the_folder_without_jax; a store's tokenizer exported and loaded by transformers:
# test_export_copies_the_stores_tokenizer; the exported llama's logits in transformers:
# test_llama_is_transformers_llama; a trained BPE stored with the tokens: test_tokenize.py.
@pytest.mark.slow
def test_export_of_a_finished_run_loads_and_generates(tmp_path):
    """A real (one-island, four-step) `dtrain simulate` run on the built-in corpus with a BPE trained on it,
    exported: transformers loads the model and the tokenizer from the folder and generates text."""
    run = _dtrain("simulate", "--config", "llama-tiny", "--islands", "1", "--quiet", "--set",
                  f"run.out_dir={tmp_path}", "--set", "train.steps=4", "--set", "train.warmup_steps=1", "--set",
                  "outer.inner_steps=2", "--set", "train.steps_per_call=2", "--set", "worker.heartbeat_s=0.5",
                  "--set", "data.max_bytes=50000", "--set", "data.tokenizer=bpe:300", "--set", "model.vocab_size=300")
    assert run.returncode == 0, run.stderr
    done = _dtrain("export", str(tmp_path / "llama-tiny"), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0 and "version 2 of" in done.stdout, done.stderr
    assert (tmp_path / "hf" / "tokenizer.json").exists()  # the run's store carried its tokenizer
    m = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok("def main(", return_tensors="pt").input_ids
    out = m.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape == (1, prompt.shape[1] + 5) and tok.decode(out[0]).startswith("def main(")


def test_the_final_theta_of_a_train_or_inprocess_run_exports(tmp_path):
    """What dtrain train and simulate --inprocess leave at their end (dtrain.models.layout.write_theta) is what
    dtrain export reads: bfloat16 weights rounded to nearest even, the card's figures from the run's events."""
    from dtrain.models.layout import write_theta
    from dtrain_cli import export

    cfg, spec, vec = _theta("llama-tiny")
    run = tmp_path / "run"
    write_theta(cfg, run, 7, codec.unflatten(spec, vec))
    (run / "events.jsonl").write_text(json.dumps({"event": "round_merged", "version": 7, "eval_loss": 3.25,
                                                  "tokens": 1234}) + "\n")
    assert export.main(str(run), None, str(tmp_path / "out"), 10**9, "bfloat16") == 0
    back = np.zeros_like(vec)
    hf.read_vector(cfg.model, spec, tmp_path / "out", back)
    assert back.tobytes() == (hf.to_bfloat16(vec).astype(np.uint32) << 16).view(np.float32).tobytes()
    assert np.abs(back - vec).max() <= np.abs(vec).max() * 2.0 ** -8  # rounded, not truncated: half an ulp
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| version | 7 |" in card and "| eval loss | 3.2500" in card and "| tokens trained on | 1,234 |" in card
    assert "| weights | bfloat16 |" in card and "[train]\nbatch_size = 8" in card


@pytest.mark.slow
def test_a_train_run_exports_in_bfloat16_with_a_model_card(tmp_path):
    """dtrain train leaves its final θ for dtrain export (which used to refuse: "not the folder of a coordinator's
    run"); --dtype bfloat16 halves the weights, transformers loads them, and the card tells where they came from."""
    from dtrain.train.runs import run_train

    cfg = load_config("llama-tiny", [f"run.out_dir={tmp_path}", "train.steps=2", "train.warmup_steps=1",
                                     "train.steps_per_call=2", "outer.inner_steps=2", "data.max_bytes=40000",
                                     "data.eval_batches=1",
                                     "run.log_every=2"])
    summary = run_train(cfg, quiet=True)
    done = _dtrain("export", summary["run_dir"], "--dtype", "bfloat16", "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and "version 2 of" in done.stdout, done.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == cfg.model.seq_len
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| eval loss | {summary['final_eval_loss']:.4f}" in card and f"| tokens trained on | " \
        f"{summary['tokens']:,} |" in card and "[model]\nkind = \"llama\"" in card
    spec, vec = codec.flatten(jax.device_get(
        hf.load_params(dataclasses.replace(cfg.model, init_from=str(tmp_path / "out")),
                       model.build(cfg.model).abstract_params)))
    assert (tmp_path / "out" / "model.safetensors").stat().st_size < 2.2 * vec.size
    final = np.fromfile(Path(summary["run_dir"]) / "theta" / "theta-00000002.f32", "<f4")
    assert vec.tobytes() == hf.to_bfloat16(final).astype(np.uint32).__lshift__(16).view(np.float32).tobytes()
    tokens = np.arange(16, dtype=np.int32)[None]
    ours = np.asarray(model.build(cfg.model).apply(codec.unflatten(spec, vec), tokens))
    assert np.abs(ours - _their_logits(tmp_path / "out", tokens)).max() <= 1e-4
