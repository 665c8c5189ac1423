"""benchmarks/mfu.py and the knobs it turns: the model FLOPs formula against a hand count, the peak table, a short
CPU run's last line, one-line errors; the [model] attention and remat switches (same loss, kept out of the
fingerprint)."""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest

from conftest import load_benchmark
from dtrain.config.load import load_config, replace
from dtrain.config.sections import ConfigError
from dtrain.models import model
from dtrain.steps.inner import loss_fn

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.toml"
LAST_LINE = re.compile(r"mfu: config=(\S+) device=(.+) tokens/s=(\d+) mfu=(n/a|\d+\.\d%)")


def _bench() -> ModuleType:
    return load_benchmark("mfu")


def test_model_flops_per_token_of_the_tiny_config_by_hand() -> None:
    """configs/tiny.toml: V=256, seq 32, d 32, 1 layer, MLP 4d. Non-embedding parameters: the block's LayerNorms
    2 x 2d = 128, qkv 3d^2 = 3072, proj d^2 = 1024, MLP up and down 2 x 4d^2 = 8192; the final LayerNorm 2d = 64;
    the head d x V = 8192: N = 20,672. 6N = 124,032, attention 12 x 1 x 32 x 32 = 12,288: 136,320."""
    cfg = load_config(TINY).model
    assert model.embedding_param_count(cfg) == 256 * 32 + 32 * 32  # the token and position tables
    assert model.flops_per_token(cfg) == 136_320
    # the knobs change how, not what: the same model FLOPs
    assert model.flops_per_token(load_config(TINY, ["model.remat=true", "model.attention=einsum"]).model) == 136_320


def test_the_peak_table_by_device_kind() -> None:
    bench = _bench()
    expected = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H200": 989,
                "NVIDIA A100-SXM4-80GB": 312, "NVIDIA L4": 121, "TPU v4": 275, "TPU v5 lite": 197, "TPU v5": 459,
                "TPU v6 lite": 918}
    for kind, tflops in expected.items():
        peak = bench.peak_tflops(kind)
        assert peak is not None and peak[0] == tflops, kind
    for kind, (tflops, source) in bench.PEAK_TFLOPS.items():
        assert tflops > 0 and ("datasheet" in source or "documentation" in source), kind
    assert bench.peak_tflops("cpu") is None and bench.peak_tflops("NVIDIA GeForce RTX 9999") is None


def test_mfu_is_model_flops_per_second_over_the_devices_peak() -> None:
    bench = _bench()
    assert bench.model_flops_utilization(1e6, 3e8, 1, 989.0) == pytest.approx(3e14 / 989e12)
    assert bench.model_flops_utilization(1e6, 3e8, 4, 989.0) == pytest.approx(3e14 / (4 * 989e12))
    assert bench.model_flops_utilization(1e6, 3e8, 1, None) is None


def test_a_short_cpu_run_prints_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (8 fake CPU devices), the tiny config, one step a call (one compile): positive tokens/s in
    the last line, MFU n/a (a CPU has no peak in the table); XLA's FLOPs a step near the model's. The same result
    against a stated peak: a percentage."""
    bench = _bench()
    out = bench.main(["--config", "tiny", "--steps", "4", "--steps-per-call", "1", "--repeats", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = LAST_LINE.fullmatch(last)
    assert m is not None, last
    assert m.group(1) == "tiny" and m.group(2) == jax.devices()[0].device_kind and m.group(4) == "n/a"
    r = out["results"][0]
    assert float(m.group(3)) == pytest.approx(r["tokens_per_s"], abs=1) and r["tokens_per_s"] > 0
    assert r["timed_steps"] == 4 and len(r["repeat_s"]) == 2 and all(t > 0 for t in r["repeat_s"])
    assert r["tokens_per_s"] == pytest.approx(4 * 8 * 32 / float(np.median(r["repeat_s"])))
    assert r["model_flops_per_step"] == 136_320 * 8 * 32 and r["mfu"] is None
    assert 0.9 < r["xla_flops_per_step"] / r["model_flops_per_step"] < 1.5

    mfu = bench.model_flops_utilization(r["tokens_per_s"], r["model_flops_per_token"], r["devices"], 0.5)
    stated = bench.Result(**{**r, "peak_tflops": 0.5, "peak_source": "given by --peak-tflops", "mfu": mfu})
    m = LAST_LINE.fullmatch(bench.report(stated)[-1])
    assert m is not None and float(m.group(4).rstrip("%")) == pytest.approx(100 * mfu, abs=0.05) and mfu > 0


@pytest.mark.slow
def test_document_masking_is_timed_side_by_side_with_documents_of_random_lengths(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--document-masking: the llama-tiny step timed again with data.document_masking on, its line before the last
    (the mfu: line, unchanged); its batches are ids and positions restarting at random document starts."""
    bench = _bench()
    out = bench.main(["--config", "llama-tiny", "--steps", "2", "--steps-per-call", "1", "--repeats", "1",
                      "--document-masking"])
    lines = capsys.readouterr().out.strip().splitlines()
    r = out["results"][0]
    assert LAST_LINE.fullmatch(lines[-1]) and r["tokens_per_s_documents"] > 0
    assert lines[-2].startswith("  documents kept apart (data.document_masking): tokens/s ")
    batches = bench.with_documents(np.zeros((3, 8, 33), np.int32), np.random.default_rng(0))
    positions = batches[:, :, 1]
    assert batches.shape == (3, 8, 2, 33) and (positions[..., 0] == 0).all()
    step = np.diff(positions, axis=-1)
    assert ((step == 1) | (positions[..., 1:] == 0)).all() and (positions[..., 1:] == 0).any()


def test_optimizers_side_by_side_end_with_their_step_times(capsys: pytest.CaptureFixture[str]) -> None:
    """--optimizers adamw,muon: the tiny config timed under each (named tiny+adamw, tiny+muon), then one line of
    their step times and Muon's over AdamW's."""
    bench = _bench()
    out = bench.main(["--config", "tiny", "--steps", "2", "--steps-per-call", "1", "--repeats", "1",
                      "--optimizers", "adamw,muon"])
    assert [r["config"] for r in out["results"]] == ["tiny+adamw", "tiny+muon"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"optimizers: config=tiny device=(.+) adamw=([0-9.]+)ms/step muon=([0-9.]+)ms/step "
                     r"muon/adamw=([0-9.]+)", last)
    assert m is not None, last
    adamw, muon = (statistics.median(r["repeat_s"]) / r["timed_steps"] * 1e3 for r in out["results"])
    assert float(m.group(2)) == pytest.approx(adamw, abs=1e-3) and float(m.group(3)) == pytest.approx(muon, abs=1e-3)
    assert float(m.group(4)) == pytest.approx(muon / adamw, rel=1e-2)


def test_the_knob_flags_become_config_overrides_after_set() -> None:
    bench = _bench()
    args = bench.parse_args(["--set", "train.batch_size=4", "--batch-size", "16", "--seq-len", "64",
                             "--steps-per-call", "5", "--remat", "--attention", "einsum"])
    assert bench.knob_overrides(args) == ["train.batch_size=4", "train.batch_size=16", "model.seq_len=64",
                                          "train.steps_per_call=5", "model.remat=full", "model.attention=einsum"]
    assert bench.knob_overrides(bench.parse_args(["--remat", "dots", "--loss-chunk", "8"])) == \
        ["model.remat=dots", "model.loss_chunk=8"]
    assert bench.knob_overrides(bench.parse_args(["--no-remat"])) == ["model.remat=none"]
    assert bench.knob_overrides(bench.parse_args([])) == []  # no flag: the config as it is
    assert bench.parse_args([]).donate and not bench.parse_args(["--no-donate"]).donate


COMPILE_LINE = re.compile(r"mfu-compile: config=(\S+) batch=(\d+) argument-gib=(\d+\.\d\d) "
                          r"output-gib=(\d+\.\d\d) temp-gib=(\d+\.\d\d)")


@pytest.mark.slow
def test_compile_only_prints_the_memory_estimate_without_running_a_step() -> None:
    bench = _bench()
    cfg = load_config(TINY, ["train.batch_size=8", "model.seq_len=32"])
    plain = bench.compile_only("tiny", cfg)
    m = COMPILE_LINE.fullmatch(bench.compile_report(plain)[-1])
    assert m is not None and m.group(1, 2) == ("tiny", "8")
    assert plain.memory["argument"] > 4 * plain.n_params  # the state: float32 params and AdamW's moments
    assert plain.memory["temp"] > 0
    # a config that could not run on a CPU compiles from abstract shapes: nothing allocated, nothing run
    big = load_config(TINY, ["model.vocab_size=65536", "train.batch_size=8", "model.seq_len=128"])
    whole, chunked = (bench.compile_only("tiny", replace(big, model={"loss_chunk": c})) for c in (0, 16))
    # the [B, L, V] float32 logits (32 MiB) are not held whole with chunks of 16 positions
    assert chunked.memory["temp"] < whole.memory["temp"] - 16 * 2**20
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mfu.py"), "--compile-only", "--config",
                           "tiny", "--remat", "names"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert COMPILE_LINE.fullmatch(proc.stdout.strip().splitlines()[-1]) and "remat names" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--config", "no-such-config"], "config error: no-such-config: config file not found"),
    (["--config", "tiny", "--set", "model.attention=flash"], "attention: must be one of"),
    (["--config", "gpt-125m"], "needs an accelerator"),
    (["--config", "tiny", "--set", "model.dtype=bfloat16", "--attention", "cudnn"], "needs an NVIDIA GPU"),
    (["--config", "tiny", "--repeats", "0"], "--repeats must be >= 1"),
])
def test_a_bad_flag_or_config_is_one_line_and_a_nonzero_exit(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mfu.py"), *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("benchmarks/mfu.py: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------------ [model] attention and remat


def _loss_and_grads(overrides: list[str], tokens_BxL1: jax.Array) -> tuple[float, dict]:
    """The tiny model's loss and gradients with the knobs in ``overrides``, from the same parameters (the knobs
    do not change them)."""
    params = model.build(load_config(TINY).model).init(0)
    built = model.build(load_config(TINY, overrides).model)
    loss, grads = jax.jit(jax.value_and_grad(partial(loss_fn, built.apply)))(params, tokens_BxL1)
    return float(loss), grads


def test_the_attention_implementations_and_remat_give_the_same_loss_and_gradients() -> None:
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
    ref_loss, ref_grads = _loss_and_grads([], tokens)  # the default: xla, no remat
    assert math.isfinite(ref_loss)
    for knobs in (["model.attention=einsum"], ["model.remat=true"]):
        loss, grads = _loss_and_grads(knobs, tokens)
        assert loss == pytest.approx(ref_loss, rel=1e-5), knobs
        jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), grads, ref_grads)
    for remat in (False, True):  # remat is really there: a remat primitive in the gradient's program
        built = model.build(load_config(TINY, [f"model.remat={str(remat).lower()}"]).model)
        jaxpr = jax.make_jaxpr(jax.grad(partial(loss_fn, built.apply)))(built.abstract_params, tokens)
        assert ("remat" in str(jaxpr)) == remat


def test_cudnn_attention_calls_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN needs an NVIDIA GPU: here, in bfloat16 as cuDNN requires, the call is checked (and served by XLA);
    the loss is the same."""
    calls: list[str | None] = []
    real = jax.nn.dot_product_attention

    def recording(*args: Any, implementation: str | None = None, **kwargs: Any) -> Any:
        calls.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
    ref_loss, _ = _loss_and_grads(["model.dtype=bfloat16"], tokens)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    loss, _ = _loss_and_grads(["model.dtype=bfloat16", "model.attention=cudnn"], tokens)
    assert calls and set(calls) == {"cudnn"} and loss == ref_loss


def test_the_knobs_are_validated_defaulted_and_kept_out_of_the_fingerprint() -> None:
    base = load_config(TINY)
    assert (base.model.attention, base.model.remat, base.model.loss_chunk) == ("auto", "none", 0)
    # model.remat as the bool it was: true is the full policy, false none
    assert [load_config(TINY, [f"model.remat={v}"]).model.remat for v in ("true", "false", "dots")] == \
        ["full", "none", "dots"]
    with pytest.raises(ConfigError, match=r"\[model\] remat: must be one of"):
        load_config(TINY, ["model.remat=some"])
    with pytest.raises(ConfigError, match=r"\[model\] loss_chunk: must be >= 0"):
        load_config(TINY, ["model.loss_chunk=-1"])
    with pytest.raises(ConfigError, match=r"\[model\] attention: cudnn .* needs model.dtype"):
        load_config(TINY, ["model.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"\[model\] attention: cudnn needs a head size .* multiple of 8, got 12"):
        load_config(TINY, ["model.dtype=bfloat16", "model.attention=cudnn", "model.d_model=48", "model.n_heads=4"])
    with pytest.raises(ConfigError, match=r"\[model\] attention: must be one of"):
        load_config(TINY, ["model.attention=flash"])
    other = load_config(TINY, ["model.dtype=bfloat16", "model.attention=cudnn", "model.remat=true"])
    bf16 = load_config(TINY, ["model.dtype=bfloat16"])
    assert other.fingerprint() == bf16.fingerprint() != base.fingerprint()  # dtype counts; the knobs do not
    assert not any(k in base.fingerprint_fields() for k in ("model.attention", "model.remat", "model.loss_chunk"))
    assert load_config(TINY, ["model.loss_chunk=8", "model.remat=names"]).fingerprint() == base.fingerprint()
