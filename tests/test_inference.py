"""Looking at what a run learned (dtrain/inference, dtrain generate, dtrain eval) and documents kept apart
(data.document_masking): the KV cache decodes what the plain forward does, a document inside a batch is computed as
if alone, dtrain eval's loss is the run's own eval figure, and every bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtrain import codec
from dtrain.config.load import load_config
from dtrain.config.sections import DataConfig
from dtrain.data.corpus import SequenceStream, eval_batches, open_corpus, split
from dtrain.data.token_store import StoreWriter
from dtrain.inference.generate import generate
from dtrain.inference.load import Loaded, LoadError, load
from dtrain.models import hf, model
from dtrain.models.stored import write_layout
from dtrain.steps.inner import loss_fn

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _dtrain(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain_cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=180)


def _loaded(config: str, *overrides: str) -> Loaded:
    cfg = load_config(config, ["model.vocab_size=256", *overrides]).model
    return Loaded(cfg, model.build(cfg).init(0), None, "no tokenizer", f"{config} at init")


@pytest.mark.parametrize("config", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.8, "seed": 5}])
def test_the_kv_cache_decodes_what_the_plain_forward_does(config, sampling):
    m = _loaded(config, "model.attention=einsum")
    prompt = np.random.default_rng(0).integers(0, 256, (2, 7))
    cached = generate(m, prompt, 12, **sampling)
    plain = generate(m, prompt, 12, cache=False, **sampling)
    assert cached.shape == (2, 12)
    np.testing.assert_array_equal(cached, plain)
    if not sampling:  # greedy: each token is the argmax of the full forward's logits at the position before it
        seq = np.concatenate([prompt, cached], axis=1)
        np.testing.assert_array_equal(m.logits(seq)[:, 6:-1].argmax(-1), cached)


@pytest.mark.parametrize("config", ["tiny", "llama-tiny"])
def test_a_second_document_in_a_batch_is_computed_as_if_alone(config):
    """Masking and the position restart: the second document's logits equal that document's alone (and the first
    document's are the plain causal ones)."""
    m = _loaded(config)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 24)).astype(np.int32)
    positions = np.concatenate([np.arange(9), np.arange(15)])[None].repeat(2, 0)
    both = np.asarray(m.built.apply(m.params, jnp.asarray(tokens), jnp.asarray(positions)))
    np.testing.assert_allclose(both[:, 9:], m.logits(tokens[:, 9:]), atol=2e-6)
    np.testing.assert_allclose(both[:, :9], m.logits(tokens[:, :9]), atol=2e-6)
    assert np.abs(both[:, 9:] - m.logits(tokens)[:, 9:]).max() > 1e-3  # without them it does differ


def test_document_masking_batches_carry_positions_from_the_stores_document_ends(tmp_path):
    w = StoreWriter(tmp_path / "store", vocab_size=256)
    lengths = [5, 40, 3, 70, 11, 90]
    for i, n in enumerate(lengths):
        w.add_document(np.full(n, i, np.uint8))
    w.close()
    plain = open_corpus(DataConfig(source=str(tmp_path / "store"), max_bytes=0), 256, tmp_path)
    kept = open_corpus(DataConfig(source=str(tmp_path / "store"), max_bytes=0, document_masking=True), 256, tmp_path)
    a, b = SequenceStream(plain, 16, seed=0).batches(0, 4, 3), SequenceStream(kept, 16, seed=0).batches(0, 4, 3)
    assert a.shape == (4, 3, 17) and b.shape == (4, 3, 2, 17)  # 12 of the store's 13 windows
    np.testing.assert_array_equal(b[:, :, 0], a)
    tokens, positions = b[:, :, 0].reshape(-1, 17), b[:, :, 1].reshape(-1, 17)
    for row_t, row_p in zip(tokens, positions, strict=True):  # each document is one id here: restarts where it changes
        assert row_p[0] == 0
        for j in range(1, 17):
            assert row_p[j] == (0 if row_t[j] != row_t[j - 1] else row_p[j - 1] + 1)
    ev = eval_batches(kept, split(kept, 0.3, 16).eval, 16, 2, 2)
    assert ev.shape == (2, 2, 2, 17)
    cfg = load_config("llama-tiny", ["model.seq_len=16"]).model
    built = model.build(cfg)
    rows, plain_rows = b.reshape(12, 2, 17), a.reshape(12, 17)
    assert (rows[:, 1, 1:] == 0).any()  # a document starts inside some window
    params = built.init(0)
    kept_loss = float(loss_fn(built.apply, params, jnp.asarray(rows)))
    assert np.isfinite(kept_loss) and kept_loss != float(loss_fn(built.apply, params, jnp.asarray(plain_rows)))


def test_bad_folders_and_ids_are_one_line(tmp_path):
    with pytest.raises(LoadError, match="no such folder"):
        load(tmp_path / "nowhere")
    with pytest.raises(LoadError, match="neither a run folder"):
        load(tmp_path)
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "run_started", "mode": "simulate-inprocess"}) + "\n")
    with pytest.raises(LoadError, match="left no θ on disk"):
        load(tmp_path)
    m = _loaded("tiny")
    for ids, what in [(np.zeros((2, 3), np.float32), "integer array"), (np.zeros(3, int), r"shape \[batch, length\]"),
                      (np.full((1, 3), 256), r"\[0, 256\)"), (np.zeros((1, 33), int), "learned positions for 32")]:
        with pytest.raises(LoadError, match=what) as e:
            m.logits(ids)
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_generate_on_a_coordinators_run_and_its_export_prints_text(tmp_path):
    """A coordinator's run folder (model.json, θ of version 3; a store with a tokenizer.json) and its `dtrain export`
    folder: both generate text from a prompt, the same greedy continuation; dtrain.load reads both."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    store = tmp_path / "store"
    store.mkdir()
    words = ["</s>", "[UNK]", "hello", "world", "again", "and"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(store / "tokenizer.json"))
    (store / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer.json", "eos_id": 0}))
    cfg = load_config("llama-tiny", [f"data.source={store}", "model.vocab_size=6"])
    spec, vec = codec.flatten(jax.device_get(model.build(cfg.model).init(4)))  # greedy: "again hello again ..."
    run = tmp_path / "run"
    (run / "spool" / "state").mkdir(parents=True)
    write_layout(cfg, run, spec)
    vec.astype("<f4").tofile(run / "spool" / "state" / "theta-00000003.f32")
    assert _dtrain("export", str(run), "--out", str(tmp_path / "hf")).returncode == 0
    outs = []
    for folder in (run, tmp_path / "hf"):
        m = load(folder)
        assert m.tokenizer is not None and m.tokenizer.decode([2, 3]) == "hello world"
        done = _dtrain("generate", str(folder), "--prompt", "hello world", "--max-new-tokens", "6")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("hello world") and len(done.stdout.split()) > 2, done.stdout
        outs.append(done.stdout)
    assert outs[0] == outs[1]
    np.testing.assert_array_equal(load(run).logits([[2, 3, 4]]), load(tmp_path / "hf").logits([[2, 3, 4]]))
    (tmp_path / "hf" / "tokenizer.json").unlink()
    no_tok = _dtrain("generate", str(tmp_path / "hf"), "--prompt", "x")
    assert no_tok.returncode == 1
    assert no_tok.stderr.strip().count("\n") == 0 and "pass --ids instead" in no_tok.stderr
    ids = _dtrain("generate", str(tmp_path / "hf"), "--ids", "2,3", "--max-new-tokens", "3")
    assert ids.returncode == 0 and ids.stdout.strip().startswith("2,3,") and len(ids.stdout.split(",")) == 5


@pytest.fixture(scope="module")
def train_run(tmp_path_factory) -> Path:
    """A real 20-step `dtrain train` run of the tiny config (its checkpoint at step 20, its eval events)."""
    out = tmp_path_factory.mktemp("runs")
    done = _dtrain("train", "--config", "tiny", "--quiet", "--set", "train.steps=20", "--set", "run.eval_every=10",
                   "--set", f"run.out_dir={out}")
    assert done.returncode == 0, done.stderr
    return out / "tiny"


def test_eval_prints_the_runs_own_eval_figure(train_run):
    events = [json.loads(line) for line in (train_run / "events.jsonl").read_text().splitlines()]
    recorded = [e["eval_loss"] for e in events if e["event"] == "eval" and e["step"] == 20]
    done = _dtrain("eval", str(train_run), "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert recorded and got["loss"] == pytest.approx(recorded[0], rel=1e-6, abs=0)
    assert got["perplexity"] == pytest.approx(np.exp(recorded[0])) and got["batches"] == 4
    store = got["store"]
    again = _dtrain("eval", str(train_run), "--data", store)
    assert again.returncode == 0 and f"loss {recorded[0]:.6f}" in again.stdout, again.stdout


def test_generate_on_a_train_run_prints_text(train_run):
    done = _dtrain("generate", str(train_run), "--prompt", "def ", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def ") and len(done.stdout.rstrip("\n")) > len("def "), repr(done.stdout)
    bad = _dtrain("generate", str(train_run), "--ids", "1,2,300")
    assert bad.returncode == 1 and bad.stderr.strip() == \
        "dtrain generate: error: ids must lie in [0, 256) (the model's vocabulary), got 300"


def test_hf_folder_config_is_the_exported_model(tmp_path):
    cfg = load_config("llama-tiny").model
    spec, vec = codec.flatten(jax.device_get(model.build(cfg).init(0)))
    hf.export_folder(cfg, spec, vec, tmp_path)
    back = hf.folder_config(tmp_path)
    assert (back.kind, back.d_model, back.n_layers, back.n_heads, back.n_kv_heads, back.mlp_hidden, back.vocab_size) \
        == (cfg.kind, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_hidden, cfg.vocab_size)
