"""Data: token stores of two sizes side by side: an island's start-up and memory, read throughput, the data wait
of a training run, and ``dtrain tokenize`` throughput, in one run.

The stores (``--sizes``, default 0.5 and 4 G tokens: 1 and 8 GB of uint16 ids) are random ids below
:data:`VOCAB` (a GPT-2-size vocabulary), generated with numpy in blocks of :data:`GEN_BLOCK` ids, cut into
documents of :data:`DOC_TOKENS` ids and written through ``dtrain.data.token_store.StoreWriter`` (never the whole
store in memory). They live under ``--work`` and a store already there whose manifest matches (ids, vocabulary,
the tokenizer name naming the seed) is reused, not written again (said on stderr).

Figures:

  S   start-up ratio: the median, over ``--repeats`` fresh child processes per store (alternating the stores), of
      the seconds from the child's imports done to its first batch, biggest store / smallest. Each child
      (this file with ``--child-startup``) does an island's data work before its first step, as
      ``dtrain.train.prepare.prepare`` does it, without the model: ``open_corpus`` (``configs/small.toml`` with
      ``data.source=STORE``, ``data.max_bytes=0``, ``model.vocab_size=50304``), ``split``, ``island_shards`` for 4
      islands, ``eval_batches``, then ``shards[0].stream.batches(0, steps_per_call, batch_size)``. The seconds
      from the child's spawn (interpreter start and imports included) are printed next to it, not compared:
      the imports (numpy, TensorStore) are the same for both stores and would hide the data work. The child
      says whether JAX was imported (it should not be: the data path does not need it). The data work reads a
      fixed window: the eval windows (over the held-out split's first 8 chunks) and, in island 0's shard, the
      first batch's group of blocks and the group read ahead. A store whose held-out split or shards are smaller
      than that (below :func:`window_tokens`, 168 M ids) reads less, and S and R would count that as growth in
      the bigger store (said on stderr when ``--sizes`` has one).
  R   RSS ratio: the median peak RSS (VmHWM of /proc/self/status) of those children, biggest store / smallest,
      read :data:`SETTLE_S` after the first batch, once the reads ahead it started have landed (an island holds
      them from then on; the peak at the first batch itself depends on how many had landed, and is in the --json
      report, ``rss_first``); the peak after the imports alone, and the RSS the data work added, are printed
      too. Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries it over across ``execve`` from the process
      that was replaced, here a fork of this (bigger) parent, so every child would report the parent's peak
      (it is in the --json report, ``ru_maxrss``).
  T   read throughput of one process: a ``SequenceStream`` over the biggest store's whole train split, read as
      batches of :data:`READ_BATCH` windows of :data:`READ_SEQ_LEN` + 1 ids (int32, as ``batches()`` gives
      them), until ``--read-tokens`` ids or ``--read-seconds`` seconds, whichever comes first; T counts
      ``READ_SEQ_LEN`` ids a window (the tokens trained on). Next to it, not compared: ``TokenStore.read`` of
      whole chunks in order, the raw read.
  W   data wait: a ``small`` training run (``dtrain.train.runs.run_train``, in this process, ``--train-steps``
      steps, ``model.vocab_size=50304``) reading the smallest store: the island's ``data_wait_s`` (the time its
      steps waited for a batch) / the run's wall time (compiling included). The step time (wall / steps) is
      printed too.
  K   ``dtrain tokenize`` throughput on the built-in corpus (``dtrain.data.corpus.builtin_files()``, about 31 MB of
      Python sources, as plain text) with a byte-level BPE of :data:`BPE_VOCAB` ids trained once beforehand on
      the first :data:`BPE_TRAIN_BYTES` bytes (its training time is printed, not in K; the few files that are
      not UTF-8, on purpose, in the test suite are skipped): MB of text per second
      with one worker and with every core, printed ``K1/KN@Ccores`` (e.g. ``3.1/5.6@2cores``), or
      ``n/a (dtrain tokenize not built)`` where ``dtrain.data.tokenize`` cannot be imported.
  E   encode overhead: the seconds of that every-core ``dtrain tokenize`` (reading the files, encoding, writing
      and digesting the store, the pool's start) / the seconds of the ``tokenizers`` library's own
      ``Tokenizer.encode_batch`` on the same texts (read into memory beforehand) with the same cores (its own
      threads), the same BPE, measured right after it. 1.0 is no overhead over the library.
  Y   Ray scaling: ``dtrain tokenize --ray`` (:class:`dtrain.data.tokenize_ray.RayExecutor`) of the first
      :data:`RAY_BYTES` of the corpus's UTF-8 files, with a BPE as K's (trained on them), on a local Ray
      cluster (:class:`~dtrain.data.tokenize_ray.LocalRayCluster`, one CPU a node): the throughput with 2 nodes
      / with 1 (the same store both times, checked). On a 2-core machine 2 nodes can at best double it; ``n/a``
      without Ray (``pip install 'dtrain[ray]'``) or ``--skip-ray``.

The reads are from the OS page cache as far as a store is in it (it was just written, or read by the previous
run; the cache cannot be dropped here), and then T and the children's times measure decoding and gathering, not
a disk. The 8 GB store of the defaults fits in a 24 GiB machine's cache, but a kernel that reclaims cold pages
(here kdamond: 6 GB cached of 9) sends part of the reads to the disk, and the figures with them.

Targets: S <= 1.2; R <= 1.1; T >= 20M tokens/s; W <= 1%; K reported; E <= 1.5; Y reported. A missed target is
reported (NOT met) but, as in the other benchmarks, does not change the exit status; a bad argument or a failing
child does (one line on stderr, exit 2 or 1). About 5 minutes at the default sizes on 2 cores (2 of them writing
the stores the first time); ``--quick`` (0.2 and 1.6 G tokens, 60 training steps) about 3. Last line:

  data: startup-ratio=S rss-ratio=R read-tokens/s=T data-wait=W tokenize-mb/s=K ray-2/1=Y encode-overhead=E
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_SPAWNED = time.time()  # before the imports below: a child's clock from its interpreter's first line of ours
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX (only the training run imports it)

import numpy as np
from _common import ROOT, child_env, finish, fmt_or_na, log, met
from _data_tokenize import BPE_VOCAB, ray_scaling, tokenize_throughput

from dtrain.config.load import load_config
from dtrain.config.sections import Config, DataConfig
from dtrain.data.corpus import (
    EVAL_SPAN_CHUNKS,
    READ_AHEAD_GROUPS,
    SHUFFLE_BLOCKS,
    SequenceStream,
    eval_batches,
    island_shards,
    open_corpus,
    split,
)
from dtrain.data.token_store import CHUNK_TOKENS, MANIFEST, StoreError, StoreWriter, TokenStore
from dtrain.errors import DtrainError
from dtrain_cli.entry import Parser, run_main

VOCAB = 50_304  # GPT-2's 50,257 rounded up to a multiple of 64
DOC_TOKENS = 4 << 20  # ids a document
GEN_BLOCK = 16 << 20  # ids generated at once (32 MB)
SEED = 0
TOKENIZER_NAME = f"random uint16 below {VOCAB} (benchmarks/data.py, seed {SEED})"
ISLANDS = 4  # the start-up child's island shards
SETTLE_S = 1.0  # a start-up child's wait after its first batch before its peak RSS is read
READ_SEQ_LEN, READ_BATCH = 2048, 8
SIZES, QUICK_SIZES = (0.5, 4.0), (0.2, 1.6)  # each store past window_tokens(); 8x apart
TRAIN_STEPS, QUICK_TRAIN_STEPS = 100, 60  # both past small's warm-up (50 steps) and first round (50)
STARTUP_RATIO_MAX, RSS_RATIO_MAX, READ_TOKENS_S_MIN, DATA_WAIT_MAX, ENCODE_OVERHEAD_MAX = 1.2, 1.1, 20e6, 0.01, 1.5
TARGETS = {"startup_ratio": f"<= {STARTUP_RATIO_MAX}", "rss_ratio": f"<= {RSS_RATIO_MAX}",
           "read_tokens_per_s": f">= {READ_TOKENS_S_MIN:.0e}", "data_wait": f"<= {DATA_WAIT_MAX:.0%}",
           "tokenize_mb_per_s": "reported", "encode_overhead": f"<= {ENCODE_OVERHEAD_MAX}", "ray_2_over_1": "reported"}
NOT_BUILT = "n/a (dtrain tokenize not built)"


def sizes_arg(text: str) -> list[float]:
    """argparse type: sizes in G tokens separated by commas, each positive, at least two."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if len(out) < 2 or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected two or more positive sizes in G tokens like 0.5,4, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=sizes_arg, default=None, metavar="G,G",
                   help="store sizes in G tokens (default 0.5,4; --quick: 0.2,1.6); S and R compare the biggest "
                        "with the smallest")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: sizes {','.join(map(str, QUICK_SIZES))}, {QUICK_TRAIN_STEPS} training steps, "
                        "5 s of reads")
    p.add_argument("--repeats", type=int, default=3, help="start-up children per store (default 3)")
    p.add_argument("--read-seconds", type=float, default=None, help="the read measurement's budget (default 20; "
                                                                    "--quick: 5)")
    p.add_argument("--read-tokens", type=float, default=200e6, help="... or this many ids, first (default 2e8)")
    p.add_argument("--train-steps", type=int, default=None,
                   help=f"steps of the data-wait run (default {TRAIN_STEPS}; --quick: {QUICK_TRAIN_STEPS})")
    p.add_argument("--skip-train", action="store_true", help="no training run (W is n/a)")
    p.add_argument("--skip-tokenize", action="store_true", help="no tokenize measurements (K, E and Y are n/a)")
    p.add_argument("--skip-ray", action="store_true", help="no Ray cluster (Y is n/a)")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="where the stores are written and reused (kept at the end); default: a temporary folder "
                        "under /tmp, deleted at the end unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the work folder (stores, the training run)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    p.add_argument("--child-startup", default=None, help=argparse.SUPPRESS)  # a start-up child: the store's path
    p.add_argument("--child-spawned-at", type=float, default=_SPAWNED, help=argparse.SUPPRESS)  # its parent's clock
    args = p.parse_args(argv)
    args.sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    if args.read_seconds is None:
        args.read_seconds = 5.0 if args.quick else 20.0
    if args.train_steps is None:
        args.train_steps = QUICK_TRAIN_STEPS if args.quick else TRAIN_STEPS
    for name in ("repeats", "train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.skip_train or args.child_startup):
        warmup, inner = small_schedule()
        if args.train_steps <= warmup or args.train_steps < inner:
            p.error(f"--train-steps must be >= {max(warmup + 1, inner)} (configs/small.toml warms up for "
                    f"{warmup} steps and merges every {inner}), got {args.train_steps}; or --skip-train")
    for name in ("read_seconds", "read_tokens"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def window_tokens() -> int:
    """The fewest ids a store needs for an island's start-up to read its whole window: a held-out split
    (``data.eval_fraction``) of at least ``EVAL_SPAN_CHUNKS`` stored chunks, which the eval windows span, and
    :data:`ISLANDS` shards of the rest, each holding the ``1 + READ_AHEAD_GROUPS`` groups of ``SHUFFLE_BLOCKS``
    blocks (a block: the windows of one stored chunk) that the first batch reads."""
    cfg = load_config(ROOT / "configs" / "small.toml")
    block = CHUNK_TOKENS // cfg.model.seq_len * cfg.model.seq_len
    fraction = cfg.data.eval_fraction
    shards = ISLANDS * (1 + READ_AHEAD_GROUPS) * SHUFFLE_BLOCKS * block / (1 - fraction)
    return math.ceil(max(EVAL_SPAN_CHUNKS * CHUNK_TOKENS / fraction, shards))


def small_schedule() -> tuple[int, int]:
    """configs/small.toml's ``train.warmup_steps`` and ``outer.inner_steps``: the data-wait run trains more steps
    than the first and at least the second (its config refuses fewer)."""
    cfg = load_config(ROOT / "configs" / "small.toml")
    return cfg.train.warmup_steps, cfg.outer.inner_steps


# ---------------------------------------------------------------------------------------------------- the stores


def store_tokens(size_g: float) -> int:
    """Ids in a store of ``size_g`` G tokens."""
    return max(1, round(size_g * 1e9))


def store_name(size_g: float) -> str:
    return f"store-{size_g:g}G"


def reusable(path: Path, tokens: int) -> bool:
    """Whether a complete store of ``tokens`` random ids of this benchmark (its manifest says so) is at ``path``."""
    if not (path / MANIFEST).exists():
        return False
    try:
        m = TokenStore.open(path).manifest
    except StoreError:
        return False
    return (m.tokens, m.vocab_size, m.tokenizer) == (tokens, VOCAB, TOKENIZER_NAME)


def write_store(path: Path, tokens: int, label: str, every_s: float = 5.0) -> dict[str, Any]:
    """A store of ``tokens`` random uint16 ids below VOCAB at ``path`` (seeded: the same ids every time), unless a
    matching one is there already; {"path", "tokens", "bytes", "reused", "seconds"}, progress logged."""
    if reusable(path, tokens):
        log(f"{label}: reusing the store at {path} ({tokens:,} ids, its manifest matches)")
        return {"path": str(path), "tokens": tokens, "bytes": _du(path), "reused": True, "seconds": 0.0}
    rng = np.random.default_rng(SEED)
    writer = StoreWriter(path, vocab_size=VOCAB, tokenizer=TOKENIZER_NAME, overwrite=True)
    t0 = last = time.perf_counter()
    done = 0
    while done < tokens:
        block = rng.integers(0, VOCAB, size=min(GEN_BLOCK, tokens - done), dtype=np.uint16)
        for s in range(0, block.size, DOC_TOKENS):
            writer.add_document(block[s:s + DOC_TOKENS])
        done += block.size
        now = time.perf_counter()
        if now - last >= every_s:
            log(f"{label}: {2 * done / 1e9:.2f}/{2 * tokens / 1e9:.2f} GB of ids written, "
                f"{2 * done / 1e6 / (now - t0):.0f} MB/s")
            last = now
    writer.close()
    seconds = time.perf_counter() - t0
    log(f"{label}: {tokens:,} ids ({2 * tokens / 1e9:.2f} GB) written in {seconds:.1f}s "
        f"({2 * tokens / 1e6 / seconds:.0f} MB/s) at {path}")
    return {"path": str(path), "tokens": tokens, "bytes": _du(path), "reused": False, "seconds": seconds}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------- start-up children


def island_config(store: str | Path, out_dir: Path, extra: tuple[str, ...] = ()) -> Config:
    """configs/small.toml reading ``store`` whole with a GPT-2-size vocabulary, runs under ``out_dir``."""
    return load_config(ROOT / "configs" / "small.toml",
                       [f"data.source={store}", "data.max_bytes=0", f"model.vocab_size={VOCAB}",
                        f"run.out_dir={out_dir}", *extra])


def child_startup(store: str, spawned_at: float) -> dict[str, Any]:
    """A start-up child's work and report: an island's data work before its first step (see the docstring)."""
    from dtrain.config.load import data_cache

    imported_s = time.time() - spawned_at
    mem_imports = proc_mem()
    t0 = time.perf_counter()
    cfg = island_config(store, Path(tempfile.gettempdir()))
    corpus = open_corpus(cfg.data, cfg.model.vocab_size, data_cache(cfg))
    parts = split(corpus, cfg.data.eval_fraction, cfg.model.seq_len)
    shards = island_shards(corpus, parts.train, ISLANDS, cfg.model.seq_len, cfg.run.seed)
    evals = eval_batches(corpus, parts.eval, cfg.model.seq_len, cfg.train.batch_size, cfg.data.eval_batches)
    batch = shards[0].stream.batches(0, cfg.train.steps_per_call, cfg.train.batch_size)
    data_s = time.perf_counter() - t0
    process_s = time.time() - spawned_at
    first = proc_mem()
    time.sleep(SETTLE_S)  # the read-ahead the first batch started lands: an island holds it from now on
    mem = proc_mem()
    return {"data_s": data_s, "process_s": process_s, "imports_s": imported_s, "rss_first": first["VmHWM"],
            "rss": mem["VmHWM"], "rss_imports": mem_imports["VmHWM"], "rss_now": mem["VmRSS"],
            "rss_now_imports": mem_imports["VmRSS"],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "tokens": len(corpus), "batch_shape": list(batch.shape), "eval_shape": list(evals.shape),
            "batch_sum": int(batch.sum()), "jax_imported": "jax" in sys.modules}


def proc_mem() -> dict[str, int]:
    """This process's VmHWM (peak RSS) and VmRSS, bytes. Not ``getrusage``'s ru_maxrss: Linux carries that over
    from the process image an ``execve`` replaced (here the parent's, forked), so a child's would be the parent's
    peak, not its own."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def run_child(store: str | Path) -> dict[str, Any]:
    """One start-up child for ``store`` (a fresh process); its report. DtrainError with its last line if it fails."""
    spawned = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-startup", str(store), "--child-spawned-at",
           repr(spawned)]
    proc = subprocess.run(cmd, capture_output=True,
                          text=True, cwd=ROOT, env=child_env(), timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DtrainError(f"the start-up child for {store} exited with status {proc.returncode}: {last}")
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise DtrainError(f"the start-up child for {store} printed no report: {proc.stdout[-300:]!r}") from None


def startup(stores: list[Path], repeats: int) -> list[dict[str, Any]]:
    """``repeats`` children per store, the stores alternating; per store its runs and their medians."""
    runs: list[list[dict[str, Any]]] = [[] for _ in stores]
    for r in range(repeats):
        for i, store in enumerate(stores):
            rep = run_child(store)
            runs[i].append(rep)
            log(f"start-up {r + 1}/{repeats} {store.name}: first batch {rep['data_s']:.3f}s after the imports "
                f"({rep['process_s']:.2f}s after the spawn), peak RSS {rep['rss'] / 2**20:.0f} MiB "
                f"({rep['rss_imports'] / 2**20:.0f} after the imports; the data work added "
                f"{(rep['rss_now'] - rep['rss_now_imports']) / 2**20:.0f})"
                f"{', JAX imported' if rep['jax_imported'] else ''}")
    keys = ("data_s", "process_s", "imports_s", "rss", "rss_first", "rss_imports", "rss_now", "rss_now_imports")
    return [{"store": str(s), "runs": rs, **{f"median_{k}": statistics.median(x[k] for x in rs) for k in keys},
             "jax_imported": any(x["jax_imported"] for x in rs)} for s, rs in zip(stores, runs, strict=True)]


# ---------------------------------------------------------------------------------------------------- the reads


def read_throughput(store: Path, seconds: float, max_tokens: float) -> dict[str, Any]:
    """T: batches of READ_BATCH windows from a SequenceStream over ``store``'s train split, then, for reference,
    raw TokenStore.read of whole chunks in order, each until ``max_tokens`` ids or ``seconds``."""
    corpus = open_corpus(DataConfig(source=str(store), max_bytes=0), VOCAB, Path(tempfile.gettempdir()))
    parts = split(corpus, 0.05, READ_SEQ_LEN)
    stream = SequenceStream(corpus, READ_SEQ_LEN, seed=SEED, span=parts.train, name="read benchmark")
    cursor, tokens, checksum = 0, 0, 0
    t0 = time.perf_counter()
    while tokens < max_tokens and time.perf_counter() - t0 < seconds:
        batch = stream.batches(cursor, 1, READ_BATCH)
        checksum ^= int(batch[0, 0, 0])
        cursor += READ_BATCH
        tokens += READ_BATCH * READ_SEQ_LEN
    stream_s = time.perf_counter() - t0
    chunk = corpus.store.chunk_tokens
    step = min(8 * chunk, len(corpus))
    raw, start = 0, 0
    t0 = time.perf_counter()
    while raw < max_tokens and time.perf_counter() - t0 < seconds:
        if start + step > len(corpus):
            start = 0  # around again: whole chunks from the start
        raw += corpus.store.read(start, start + step).size
        start += step
    raw_s = time.perf_counter() - t0
    out: dict[str, Any] = {
           "store": str(store), "stream_tokens": tokens, "stream_s": stream_s, "tokens_per_s": tokens / stream_s,
           "stream_wait_s": stream.wait_s, "peak_blocks": stream.peak_blocks, "windows": cursor,
           "raw_tokens": raw, "raw_s": raw_s, "raw_tokens_per_s": raw / raw_s, "checksum": checksum}
    log(f"reads: {tokens / 1e6:.0f}M ids in {stream_s:.1f}s through SequenceStream.batches ({READ_BATCH} x "
        f"{READ_SEQ_LEN + 1}): {out['tokens_per_s'] / 1e6:.0f}M ids/s, waited {stream.wait_s:.2f}s, at most "
        f"{stream.peak_blocks} blocks held; raw TokenStore.read of {step // chunk} chunks: "
        f"{out['raw_tokens_per_s'] / 1e6:.0f}M ids/s")
    return out


# ------------------------------------------------------------------------------------------------ the data wait


def data_wait(store: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    """W: a ``small`` training run (run_train, this process) of ``steps`` steps reading ``store``."""
    from dtrain.train.runs import run_train

    cfg = island_config(store, out_dir, (f"train.steps={steps}", "run.name=data-wait", f"run.log_every={steps}"))
    log(f"data wait: training small ({VOCAB:,}-id vocabulary) for {steps} steps from {store.name}")
    summary = run_train(cfg, quiet=True)
    wait = float(summary["islands"][0]["data_wait_s"])
    wall = float(summary["wall_s"])
    out = {"steps": int(summary["steps"]), "wall_s": wall, "step_s": wall / max(1, int(summary["steps"])),
           "data_wait_s": wait, "data_wait": wait / wall, "params": summary["params"],
           "final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"]}
    log(f"data wait: {out['steps']} steps in {wall:.1f}s ({1e3 * out['step_s']:.0f} ms a step, compiling "
        f"included), waited {wait:.3f}s for data: {100 * out['data_wait']:.2f}%")
    return out


# ------------------------------------------------------------------------------------------------ tokenize


# --------------------------------------------------------------------------------------------------- figures


def figures(stores: list[dict[str, Any]], start: list[dict[str, Any]], reads: dict[str, Any],
            wait: dict[str, Any] | None, tok: dict[str, Any] | None,
            ray: dict[str, Any] | None = None) -> dict[str, Any]:
    """The benchmark's figures: S and R (the last store's median over the first's), T, W, K."""
    small, big = start[0], start[-1]
    k = None
    if tok is not None and tok.get("built"):
        k = f"{tok['mb_per_s_1']:.2f}/{tok['mb_per_s_all']:.2f}@{tok['cores']}cores"
    return {
        "sizes_tokens": [s["tokens"] for s in stores],
        "startup_ratio": big["median_data_s"] / small["median_data_s"],
        "startup_process_ratio": big["median_process_s"] / small["median_process_s"],
        "rss_ratio": big["median_rss"] / small["median_rss"],
        "startup_s": [s["median_data_s"] for s in start], "startup_process_s": [s["median_process_s"] for s in start],
        "rss": [s["median_rss"] for s in start], "rss_imports": [s["median_rss_imports"] for s in start],
        "jax_imported": any(s["jax_imported"] for s in start),
        "read_tokens_per_s": reads["tokens_per_s"], "raw_read_tokens_per_s": reads["raw_tokens_per_s"],
        "data_wait": None if wait is None else wait["data_wait"],
        "step_s": None if wait is None else wait["step_s"],
        "tokenize": k if k is not None else (NOT_BUILT if tok is not None else None),
        "encode_overhead": tok.get("encode_overhead") if tok is not None else None,
        "ray_2_over_1": ray.get("ratio") if ray is not None else None,
    }


def targets_line(f: dict[str, Any]) -> str:
    w, k = f["data_wait"], f["tokenize"]
    checks = [
        (f"startup-ratio {f['startup_ratio']:.2f} (target <= {STARTUP_RATIO_MAX})",
         f["startup_ratio"] <= STARTUP_RATIO_MAX),
        (f"rss-ratio {f['rss_ratio']:.2f} (target <= {RSS_RATIO_MAX})", f["rss_ratio"] <= RSS_RATIO_MAX),
        (f"read-tokens/s {fmt_m(f['read_tokens_per_s'])} (target >= {fmt_m(READ_TOKENS_S_MIN)})",
         f["read_tokens_per_s"] >= READ_TOKENS_S_MIN),
        (f"data-wait {fmt_or_na(None if w is None else 100 * w, '.2f', '%')} (target <= {DATA_WAIT_MAX:.0%})",
         None if w is None else w <= DATA_WAIT_MAX),
        (f"tokenize-mb/s {k or 'n/a'} (target: reported)",
         None if k is None or k == NOT_BUILT else True),
        (f"encode-overhead {fmt_or_na(f['encode_overhead'], '.2f')} (target <= {ENCODE_OVERHEAD_MAX})",
         None if f["encode_overhead"] is None else f["encode_overhead"] <= ENCODE_OVERHEAD_MAX),
        (f"ray-2/1 {fmt_or_na(f['ray_2_over_1'], '.2f')} (target: reported)",
         None if f["ray_2_over_1"] is None else True),
    ]
    return "targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in checks)


def fmt_m(x: float) -> str:
    """Millions, no decimals: 412M."""
    return f"{x / 1e6:.0f}M"


def final_line(f: dict[str, Any]) -> str:
    w = f["data_wait"]
    return (f"data: startup-ratio={f['startup_ratio']:.2f} rss-ratio={f['rss_ratio']:.2f} "
            f"read-tokens/s={fmt_m(f['read_tokens_per_s'])} "
            f"data-wait={fmt_or_na(None if w is None else 100 * w, '.2f', '%')} tokenize-mb/s={f['tokenize'] or 'n/a'} "
            f"ray-2/1={fmt_or_na(f['ray_2_over_1'], '.2f')} encode-overhead={fmt_or_na(f['encode_overhead'], '.2f')}")


def table(stores: list[dict[str, Any]], start: list[dict[str, Any]]) -> list[str]:
    """One row a store: ids, size on disk, written or reused, start-up and RSS medians."""
    rows = [f"{'store':<12} {'ids':>15} {'on disk':>9} {'written':>9} {'first batch':>12} {'from spawn':>11} "
            f"{'peak RSS':>9} {'after imports':>14} {'data added':>11}"]
    for s, st in zip(stores, start, strict=True):
        written = "reused" if s["reused"] else f"{s['seconds']:.0f}s"
        rows.append(f"{Path(s['path']).name:<12} {s['tokens']:>15,} {s['bytes'] / 1e9:>7.2f}GB "
                    f"{written:>9} {st['median_data_s']:>11.3f}s "
                    f"{st['median_process_s']:>10.2f}s {st['median_rss'] / 2**20:>6.0f}MiB "
                    f"{st['median_rss_imports'] / 2**20:>11.0f}MiB "
                    f"{(st['median_rss_now'] - st['median_rss_now_imports']) / 2**20:>8.0f}MiB")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child_startup:
        print(json.dumps(child_startup(args.child_startup, args.child_spawned_at)))
        return {}
    work = Path(args.work).expanduser() if args.work else Path(tempfile.mkdtemp(prefix="dtrain-data-"))
    work.mkdir(parents=True, exist_ok=True)
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    sizes = sorted(args.sizes)
    log(f"stores of {', '.join(f'{s:g}G' for s in sizes)} tokens under {work}; {args.repeats} start-up children "
        f"each; reads for up to {args.read_seconds:g}s; {args.train_steps} training steps")
    if store_tokens(sizes[0]) < (window := window_tokens()):
        log(f"the smallest store ({store_tokens(sizes[0]):,} ids) is below {window:,}: its held-out split or its "
            "islands' shards are smaller than what an island reads at start-up, so it reads less, and S and R "
            f"count that as growth; sizes of {window / 1e9:.3f} G tokens or more compare like with like")
    stores = [write_store(work / store_name(s), store_tokens(s), store_name(s)) for s in sizes]
    paths = [Path(s["path"]) for s in stores]
    start = startup([paths[0], paths[-1]], args.repeats)
    reads = read_throughput(paths[-1], args.read_seconds, args.read_tokens)
    wait = None if args.skip_train else data_wait(paths[0], args.train_steps, scratch)
    tok = None if args.skip_tokenize else tokenize_throughput(scratch)
    ray = None if args.skip_tokenize or args.skip_ray else ray_scaling(scratch)
    f = figures([stores[0], stores[-1]], start, reads, wait, tok, ray)
    print("\n".join(table([stores[0], stores[-1]], start)))
    print(f"\nstart-up (imports done -> first batch) ratio {f['startup_ratio']:.2f}; from the spawn "
          f"{f['startup_process_ratio']:.2f}; JAX imported by the data path: {'yes' if f['jax_imported'] else 'no'}")
    print(f"reads: {fmt_m(reads['tokens_per_s'])} ids/s through SequenceStream.batches ({READ_BATCH} x "
          f"{READ_SEQ_LEN + 1} int32), {fmt_m(reads['raw_tokens_per_s'])} ids/s raw TokenStore.read (page cache)")
    if wait is not None:
        print(f"training: {wait['steps']} steps of small ({wait['params']:,} params) in {wait['wall_s']:.1f}s, "
              f"{1e3 * wait['step_s']:.0f} ms a step; data wait {wait['data_wait_s']:.3f}s")
    if tok is not None and tok.get("built"):
        print(f"tokenize: {tok['bytes'] / 1e6:.1f} MB: {tok['mb_per_s_1']:.2f} MB/s with 1 worker, "
              f"{tok['mb_per_s_all']:.2f} MB/s with {tok['cores']}; BPE ({BPE_VOCAB} ids) trained in "
              f"{tok['bpe_train_s']:.1f}s (not in K); tokenizers' encode_batch of the same texts "
              f"{tok['encode_batch_s']:.1f}s: dtrain {f['encode_overhead']:.2f}x")
    if ray is not None and ray.get("ray"):
        print(f"ray: {ray['bytes'] / 1e6:.1f} MB: {ray['mb_per_s_1']:.2f} MB/s on 1 node, {ray['mb_per_s_2']:.2f} "
              f"on 2 (one CPU each): {ray['ratio']:.2f}x")
    out = {"figures": f, "targets": TARGETS, "stores": stores, "startup": start, "reads": reads, "data_wait": wait,
           "tokenize": tok, "ray": ray}
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    keep = args.keep or args.work is not None
    if keep and not args.keep:
        log(f"stores kept under {work} (--work): a rerun with it reuses them")
    finish(out, args.json, work, keep, targets_line(f), final_line(f))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/data.py", main))
