"""MFU: tokens per second and model FLOPs utilization of the island's inner step.

What is timed is the step an island runs: ``dtrain.train.loop.InnerLoop`` for the config's model, optimizer and mesh
(all of this process's devices, ``[mesh]`` as configured), its jitted ``lax.scan`` of ``train.steps_per_call``
fused inner steps, called through ``InnerLoop.run`` (which also puts each chunk's batches on the devices), the
state donated from call to call as an island does. The batches are random tokens: the step's cost does not depend
on the data.

Timing: the scan is compiled and run once before any clock starts (the warm-up). Then ``--repeats`` timed repeats,
each ``--steps`` inner steps (rounded up to whole calls): the calls are dispatched back to back and the host waits
for the devices once, at the end of the repeat (one sync per repeat, none inside it). The figure is the median
repeat.

  tokens/s   the island's, all its devices together: steps x train.batch_size x model.seq_len / seconds
  model FLOPs per token   :func:`dtrain.models.model.flops_per_token`: 6 x N, N the parameters less the embedding
             tables, plus the GPT's attention, 12 x n_layers x d_model x seq_len (PaLM, appendix B)
  MFU        tokens/s x model FLOPs per token / (devices x the device's peak), the peak from :data:`PEAK_TFLOPS`
             (dense bf16, no sparsity, by ``jax.Device.device_kind``); ``n/a`` for a device kind not in it (a CPU
             has no meaningful peak) unless ``--peak-tflops`` states one, which the output then names
  XLA FLOPs  XLA's own count of one step, ``cost_analysis()["flops"]`` of the scan compiled for one step (XLA counts
             a loop's body once, whatever its trip count, so one step is what it can count), times the devices (the
             count is the partitioned, per-device program's). Printed next to the model FLOPs with their ratio;
             they need not agree: XLA also counts the elementwise work (softmax, GELU, LayerNorm, the loss, the
             AdamW update, which every device repeats on replicated parameters) and, with ``--remat``, the
             recomputed forward pass; the model count is the standard one MFU is defined by

The configs: ``gpt-125m`` and ``gpt-350m`` (bf16) on an accelerator; on a CPU ``tiny`` (so the benchmark stays
tested), and the accelerator configs only with ``--allow-cpu`` (a step of gpt-125m is ~1e14 FLOPs: minutes on a
CPU). The knobs a tuning session turns: ``--batch-size``, ``--seq-len``, ``--steps-per-call``, ``--remat``,
``--attention`` (``cudnn``: ``jax.nn.dot_product_attention``'s fused flash-attention kernel, NVIDIA GPUs with
bf16), ``--no-donate``, and any ``--set SECTION.FIELD=VALUE``. Target: MFU >= 45% for gpt-350m on an H100.

Per config, a few lines, then ``mfu: config=NAME device=KIND tokens/s=T mfu=M`` (M a percentage or ``n/a``);
the last line is the last config's. ``--optimizers adamw,muon`` times each config under each inner optimizer
(named ``CONFIG+OPTIMIZER``) and ends with one line per config, ``optimizers: config=NAME device=KIND
adamw=Xms/step muon=Yms/step muon/adamw=R``: Muon's extra time a step is its Newton-Schulz iterations. A bad
flag or config is one line on stderr and a non-zero exit.

``--compile-only``: no step runs and no parameter is allocated; the scan is lowered from abstract shapes and
compiled, and XLA's memory estimate of one device's program is printed, the last line
``mfu-compile: config=NAME batch=B argument-gib=A output-gib=O temp-gib=T`` (per device; on a CPU, the estimate
of the CPU program, which any config may be compiled for: no --allow-cpu needed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dtrain.config.load import load_config
from dtrain.config.sections import ATTENTION_KINDS, REMAT_POLICIES, Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.runlog import fmt_bytes
from dtrain_cli.entry import Parser, run_main

ACCELERATOR_CONFIGS = ("gpt-125m", "gpt-350m")
CPU_CONFIGS = ("tiny",)
# Above this many model FLOPs a step, a config needs an accelerator (a 2-core CPU does ~1e11 FLOP/s): --allow-cpu
CPU_MAX_STEP_FLOPS = 1e12
DOCS_PER_ROW = 4  # --document-masking: documents a row holds on average

_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)"
_TPU_DOCS = "Google Cloud TPU documentation, system architecture"
# Peak dense bf16 (no sparsity) TFLOP/s of one JAX device, keyed by ``jax.Device.device_kind``, with its source.
# NVIDIA datasheets quote bf16 with 2:4 sparsity; the dense figure is half of it. A TPU v4 and v5p chip (two
# TensorCores, one megacore JAX device) and a v5e/v6e chip (one TensorCore) are each one JAX device.
PEAK_TFLOPS: dict[str, tuple[float, str]] = {
    "NVIDIA H100 80GB HBM3": (989.0, f"{_NVIDIA_H100}, H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity"),
    "NVIDIA H100 PCIe": (756.0, f"{_NVIDIA_H100}, H100 PCIe: BF16 Tensor Core 1,513 TFLOPS with sparsity"),
    "NVIDIA H200": (989.0, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 Tensor Core 1,979 TFLOPS with "
                           "sparsity"),
    "NVIDIA A100-SXM4-80GB": (312.0, _NVIDIA_A100),
    "NVIDIA A100-SXM4-40GB": (312.0, _NVIDIA_A100),
    "NVIDIA A100 80GB PCIe": (312.0, _NVIDIA_A100),
    "NVIDIA A100-PCIE-40GB": (312.0, _NVIDIA_A100),
    "NVIDIA L4": (121.0, "NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity"),
    "TPU v4": (275.0, f"{_TPU_DOCS}, TPU v4: 275 peak bf16 TFLOPs per chip"),
    "TPU v5 lite": (197.0, f"{_TPU_DOCS}, TPU v5e: 197 peak bf16 TFLOPs per chip"),
    "TPU v5e": (197.0, f"{_TPU_DOCS}, TPU v5e: 197 peak bf16 TFLOPs per chip"),
    "TPU v5": (459.0, f"{_TPU_DOCS}, TPU v5p: 459 peak bf16 TFLOPs per chip"),
    "TPU v5p": (459.0, f"{_TPU_DOCS}, TPU v5p: 459 peak bf16 TFLOPs per chip"),
    "TPU v6 lite": (918.0, f"{_TPU_DOCS}, TPU v6e (Trillium): 918 peak bf16 TFLOPs per chip"),
    "TPU v6e": (918.0, f"{_TPU_DOCS}, TPU v6e (Trillium): 918 peak bf16 TFLOPs per chip"),
}


def peak_tflops(device_kind: str) -> tuple[float, str] | None:
    """(peak dense bf16 TFLOP/s of one device, its source) for a ``jax.Device.device_kind``, None when unknown."""
    return PEAK_TFLOPS.get(device_kind)


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, devices: int,
                            peak_tflops: float | None) -> float | None:
    """MFU, a fraction: the model FLOPs done per second over the devices' peak; None without a peak."""
    return tokens_per_s * flops_per_token / (devices * peak_tflops * 1e12) if peak_tflops else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/mfu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", dest="configs", action="append", default=None, metavar="NAME",
                   help=f"config file or name, repeatable (default: {', '.join(ACCELERATOR_CONFIGS)} on an "
                        f"accelerator, {', '.join(CPU_CONFIGS)} on a CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field, for every config (repeatable; the flags below go after it)")
    p.add_argument("--batch-size", type=int, default=None, help="train.batch_size: rows a step, the island's")
    p.add_argument("--seq-len", type=int, default=None, help="model.seq_len: tokens a row")
    p.add_argument("--steps-per-call", type=int, default=None, help="train.steps_per_call: steps fused in one scan")
    p.add_argument("--remat", nargs="?", const="full", default=None, choices=REMAT_POLICIES,
                   help="model.remat: what each block keeps for the backward pass (alone: full)")
    p.add_argument("--no-remat", dest="remat", action="store_const", const="none", help="model.remat=none")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default=None,
                   help="model.attention: the attention kernel (cudnn: fused flash attention, NVIDIA GPUs, bf16; "
                        "auto: cudnn where it applies)")
    p.add_argument("--loss-chunk", type=int, default=None, metavar="C",
                   help="model.loss_chunk: the loss over chunks of C positions (0: the whole logits)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile only, from abstract shapes, and print XLA's memory estimate (no step runs)")
    p.add_argument("--no-donate", dest="donate", action="store_false",
                   help="do not donate the state's buffers from call to call (an island always does)")
    p.add_argument("--steps", type=int, default=20, help="inner steps a timed repeat, rounded up to whole calls "
                   "(default 20)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median counts (default 5)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOPS",
                   help="the peak of one device to measure MFU against, for a device kind not in the table (or to "
                        "override it); the output names it as given")
    p.add_argument("--allow-cpu", action="store_true",
                   help=f"run configs over {CPU_MAX_STEP_FLOPS:.0e} model FLOPs a step on a CPU (slow)")
    p.add_argument("--document-masking", action="store_true",
                   help="also time the step with data.document_masking on (documents of random lengths, mean "
                   f"seq_len / {DOCS_PER_ROW}), side by side: tokens/s with and without, and their ratio")
    p.add_argument("--optimizers", default="", metavar="NAMES", help="comma-separated train.optimizer values (adamw, "
                   "muon) timed side by side on each config, ending with an 'optimizers:' line of their step times "
                   "(muon's extra time is its Newton-Schulz iterations); '': the config's optimizer")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.loss_chunk is not None and args.loss_chunk < 0:
        p.error(f"--loss-chunk must be >= 0, got {args.loss_chunk}")
    for name in ("batch_size", "seq_len", "steps_per_call", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops must be a number > 0, got {args.peak_tflops}")
    return args


def knob_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, then the knob flags as overrides (so they win)."""
    out = list(args.overrides)
    for flag, key in (("batch_size", "train.batch_size"), ("seq_len", "model.seq_len"),
                      ("steps_per_call", "train.steps_per_call")):
        if getattr(args, flag) is not None:
            out.append(f"{key}={getattr(args, flag)}")
    if args.remat is not None:
        out.append(f"model.remat={args.remat}")
    if args.loss_chunk is not None:
        out.append(f"model.loss_chunk={args.loss_chunk}")
    if args.attention is not None:
        out.append(f"model.attention={args.attention}")
    return out


@dataclass
class Result:
    config: str
    device_kind: str
    devices: int
    platform: str
    batch_size: int
    seq_len: int
    steps_per_call: int
    dtype: str
    attention: str
    remat: str
    loss_chunk: int
    donate: bool
    n_params: int
    model_flops_per_token: float
    model_flops_per_step: float
    xla_flops_per_step: float | None
    compile_s: float
    timed_steps: int
    repeat_s: list[float]
    tokens_per_s: float
    peak_tflops: float | None  # one device's
    peak_source: str
    mfu: float | None  # a fraction
    memory: dict[str, int]
    tokens_per_s_documents: float | None = None  # --document-masking: the same step with documents kept apart


def _xla_flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    flops = cost.get("flops") if cost else None
    return float(flops) if flops is not None and flops > 0 else None


def _memory(compiled: Any) -> dict[str, int]:
    """XLA's memory estimate of one device's program (bytes), where the backend gives one."""
    try:
        m = compiled.memory_analysis()
    except (NotImplementedError, AttributeError, RuntimeError):
        return {}
    if m is None:
        return {}
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return {n.removesuffix("_size_in_bytes"): int(getattr(m, n)) for n in names if hasattr(m, n)}


def measure(name: str, cfg: Config, args: argparse.Namespace) -> Result:
    """Builds the island's inner loop for ``cfg``, warms it up, and times ``args.repeats`` repeats."""
    import jax
    import numpy as np

    from dtrain.models import model
    from dtrain.steps.inner import make_mesh
    from dtrain.train.loop import InnerLoop

    devices = jax.devices()
    platform, kind = devices[0].platform, devices[0].device_kind
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"{name}: model.attention=cudnn needs an NVIDIA GPU; this process's JAX devices are "
                          f"{platform} ({kind})")
    flops_per_token = model.flops_per_token(cfg.model)
    B, L, K = cfg.train.batch_size, cfg.model.seq_len, cfg.train.steps_per_call
    step_flops = flops_per_token * B * L
    if platform == "cpu" and step_flops > CPU_MAX_STEP_FLOPS and not args.allow_cpu:
        raise ConfigError(f"{name}: {step_flops:.1e} model FLOPs a step needs an accelerator (GPU or TPU); on this "
                          f"CPU pass --allow-cpu to run it anyway (slow), or --config tiny")
    built = model.build(cfg.model)
    loop = InnerLoop(cfg, built, make_mesh(cfg), donate=args.donate)
    n_devices = loop.mesh.devices.size
    rng = np.random.default_rng(cfg.run.seed)
    batches_KxBxL1 = rng.integers(0, cfg.model.vocab_size, size=(K, B, L + 1), dtype=np.int32)
    calls = -(-args.steps // K)
    try:
        t0 = time.perf_counter()
        compiled = loop.compile_scan(K)
        compile_s = time.perf_counter() - t0
        # one step, compiled apart: XLA counts a loop's body once, so a 1-step scan is what it counts right
        xla_step = _xla_flops(compiled if K == 1 else loop.compile_scan(1))
        times = _timed(loop, built.init(cfg.run.seed), batches_KxBxL1, calls, args.repeats)
        documents_s = None
        if args.document_masking:  # the same step, documents kept apart: batches of ids and positions
            from dtrain.config.load import replace

            kept = InnerLoop(replace(cfg, data={"document_masking": True}), built, loop.mesh, donate=args.donate)
            documents_s = _timed(kept, built.init(cfg.run.seed), with_documents(batches_KxBxL1, rng), calls,
                                 args.repeats)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DtrainError(f"{name}: batch {B} x seq {L} does not fit in device memory ({kind}); try a smaller "
                          f"--batch-size, --remat or --attention cudnn") from None
    tokens_per_s = calls * K * B * L / statistics.median(times)
    peak, source = (args.peak_tflops, "given by --peak-tflops") if args.peak_tflops else (
        peak_tflops(kind) or (None, f"no peak known for device kind {kind!r}"))
    return Result(
        config=name, device_kind=kind, devices=n_devices, platform=platform, batch_size=B, seq_len=L,
        steps_per_call=K, dtype=cfg.model.dtype, attention=cfg.model.attention, remat=cfg.model.remat,
        loss_chunk=cfg.model.loss_chunk,
        donate=args.donate, n_params=model.param_count(built.abstract_params), model_flops_per_token=flops_per_token,
        model_flops_per_step=step_flops, xla_flops_per_step=None if xla_step is None else xla_step * n_devices,
        compile_s=compile_s, timed_steps=calls * K, repeat_s=times, tokens_per_s=tokens_per_s, peak_tflops=peak,
        peak_source=source, mfu=model_flops_utilization(tokens_per_s, flops_per_token, n_devices, peak),
        memory=_memory(compiled),
        tokens_per_s_documents=None if documents_s is None else calls * K * B * L / statistics.median(documents_s))


def with_documents(batches_KxBxL1: Any, rng: Any) -> Any:
    """``[K, B, 2, L + 1]``: the ids and the positions of documents of random lengths (a document starts at each
    id with probability ``1 / (seq_len / DOCS_PER_ROW)``, and at each row's start), as ``data.document_masking``
    batches hold them."""
    import numpy as np

    L1 = batches_KxBxL1.shape[-1]
    starts = rng.random(batches_KxBxL1.shape) < DOCS_PER_ROW / (L1 - 1)
    starts[..., 0] = True
    index = np.arange(L1)
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)  # each id's document's first id
    return np.stack([batches_KxBxL1, (index - first).astype(np.int32)], axis=2)


def _timed(loop: Any, params: Any, batches: Any, calls: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` repeats of ``calls`` calls of ``loop.run`` on ``batches``, after one untimed
    call (the warm-up)."""
    import jax

    state = loop.init_state(params)
    state, _ = loop.run(state, batches)  # the warm-up: not timed
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            state, _ = loop.run(state, batches)  # dispatched back to back: no host sync in here
        jax.block_until_ready(state)  # note: the one host-device sync of a repeat
        times.append(time.perf_counter() - t0)
    return times


def report(r: Result) -> list[str]:
    """The lines printed for one config; the last is the ``mfu:`` line."""
    mfu = "n/a" if r.mfu is None else f"{r.mfu:.1%}"
    xla = ("XLA FLOPs a step: n/a (the backend gives no cost analysis)" if r.xla_flops_per_step is None else
           f"XLA FLOPs a step {r.xla_flops_per_step:.4g} (x{r.xla_flops_per_step / r.model_flops_per_step:.3f} "
           f"the model FLOPs: XLA also counts elementwise work, the optimizer update on every device"
           f"{' and the remat recomputation' if r.remat != 'none' else ''})")
    mem = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.memory.items()) or "n/a"
    peak = "n/a" if r.peak_tflops is None else f"{r.peak_tflops:g} TFLOP/s"
    achieved = r.tokens_per_s * r.model_flops_per_token / r.devices / 1e12
    return [
        f"{r.config}: {r.n_params:,} params, {r.dtype}, batch {r.batch_size} x seq {r.seq_len}, {r.steps_per_call} "
        f"steps a call, attention {r.attention}, remat {r.remat}, loss chunk {r.loss_chunk or 'off'}, donation "
        f"{'on' if r.donate else 'off'}; {r.devices} x {r.device_kind} ({r.platform}); compile {r.compile_s:.1f}s",
        f"  model FLOPs a token {r.model_flops_per_token:.4g} (6N + 12 L d seq), a step {r.model_flops_per_step:.4g}; "
        + xla,
        f"  timed: {len(r.repeat_s)} repeats of {r.timed_steps} steps, median {statistics.median(r.repeat_s):.3f}s "
        f"(min {min(r.repeat_s):.3f}s, max {max(r.repeat_s):.3f}s); {achieved:.3g} model TFLOP/s a device",
        f"  peak a device: {peak} ({r.peak_source}); XLA memory estimate a device: {mem}",
        *([] if r.tokens_per_s_documents is None else [
            f"  documents kept apart (data.document_masking): tokens/s {r.tokens_per_s_documents:.0f} with, "
            f"{r.tokens_per_s:.0f} without (x{r.tokens_per_s_documents / r.tokens_per_s:.3f})"]),
        f"mfu: config={r.config} device={r.device_kind} tokens/s={r.tokens_per_s:.0f} mfu={mfu}",
    ]


@dataclass
class CompileResult:
    config: str
    device_kind: str
    platform: str
    devices: int
    batch_size: int
    seq_len: int
    dtype: str
    attention: str
    remat: str
    loss_chunk: int
    n_params: int
    compile_s: float
    memory: dict[str, int]  # one device's program, bytes


def compile_only(name: str, cfg: Config) -> CompileResult:
    """Lowers the island's scan for ``cfg`` from abstract shapes (no parameter allocated, no step run), compiles
    it, and returns XLA's memory estimate of one device's program."""
    import jax

    from dtrain.models import model
    from dtrain.steps.inner import make_mesh
    from dtrain.train.loop import InnerLoop

    device = jax.devices()[0]
    built = model.build(cfg.model)
    loop = InnerLoop(cfg, built, make_mesh(cfg))
    t0 = time.perf_counter()
    compiled = loop.compile_scan(cfg.train.steps_per_call)
    return CompileResult(config=name, device_kind=device.device_kind, platform=device.platform,
                         devices=loop.mesh.devices.size, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len,
                         dtype=cfg.model.dtype, attention=cfg.model.attention, remat=cfg.model.remat,
                         loss_chunk=cfg.model.loss_chunk, n_params=model.param_count(built.abstract_params),
                         compile_s=time.perf_counter() - t0, memory=_memory(compiled))


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def compile_report(r: CompileResult) -> list[str]:
    """The lines printed for one config compiled only; the last is the ``mfu-compile:`` line."""
    m = r.memory
    return [
        f"{r.config}: {r.n_params:,} params, {r.dtype}, batch {r.batch_size} x seq {r.seq_len}, attention "
        f"{r.attention}, remat {r.remat}, loss chunk {r.loss_chunk or 'off'}; {r.devices} x {r.device_kind} "
        f"({r.platform}); compile {r.compile_s:.1f}s; XLA memory estimate a device (the {r.platform} program's): "
        + (", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.items()) or "n/a"),
        f"mfu-compile: config={r.config} batch={r.batch_size} argument-gib={_gib(m.get('argument'))} "
        f"output-gib={_gib(m.get('output'))} temp-gib={_gib(m.get('temp'))}",
    ]


def optimizer_line(results: list[Result], optimizers: list[str]) -> str:
    """One config's optimizers side by side: each one's median step time, and each one's over the first's (Muon's
    over AdamW's: the cost of its Newton-Schulz iterations, five quintic steps on every hidden matrix)."""
    step_ms = [statistics.median(r.repeat_s) / r.timed_steps * 1e3 for r in results]
    config = results[0].config.rsplit("+", 1)[0]
    return (f"optimizers: config={config} device={results[0].device_kind} "
            + " ".join(f"{o}={ms:.3f}ms/step" for o, ms in zip(optimizers, step_ms, strict=True)) + " "
            + " ".join(f"{o}/{optimizers[0]}={ms / step_ms[0]:.3f}" for o, ms in zip(optimizers[1:], step_ms[1:],
                                                                                     strict=True)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax

    on_cpu = jax.devices()[0].platform == "cpu"
    names = args.configs or list(CPU_CONFIGS if on_cpu else ACCELERATOR_CONFIGS)
    overrides = knob_overrides(args)
    optimizers = [o for o in args.optimizers.split(",") if o]
    # every config (with each optimizer) checked before any runs
    configs = [(name, load_config(name, overrides)) for name in names] if not optimizers else [
        (f"{name}+{opt}", load_config(name, [*overrides, f"train.optimizer={opt}"]))
        for name in names for opt in optimizers]
    results: list[Any] = []
    for name, cfg in configs:
        if args.compile_only:
            c = compile_only(name, cfg)
            results.append(c)
            print("\n".join(compile_report(c)), flush=True)
            continue
        r = measure(name, cfg, args)
        results.append(r)
        print("\n".join(report(r)), flush=True)
    out = {"overrides": overrides, "results": [asdict(r) for r in results]}
    if len(optimizers) > 1:
        lines = [optimizer_line(results[i:i + len(optimizers)], optimizers)
                 for i in range(0, len(results), len(optimizers))]
        print("\n".join(lines), flush=True)
        out["optimizers"] = lines
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/mfu.py", main))
