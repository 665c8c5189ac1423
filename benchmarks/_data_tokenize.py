"""benchmarks/data.py's tokenizing figures: K (``dtrain tokenize`` with one worker and every core), E (against
the ``tokenizers`` library's own ``encode_batch``) and Y (on a local Ray cluster of 1, then 2 nodes)."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from _common import log

from dtrain.data.corpus import builtin_files
from dtrain.errors import DtrainError

BPE_VOCAB, BPE_TRAIN_BYTES = 4096, 4_000_000
RAY_BYTES = 8_000_000  # Y: this much of the corpus (whole files) tokenized on 1 and on 2 Ray nodes
RAY_TASK_BYTES = 1 << 20  # Y: source bytes per Ray task (many tasks, so two nodes share the work)


def tokenize_throughput(work: Path) -> dict[str, Any]:
    """K: ``dtrain tokenize`` of the built-in corpus with a small BPE, 1 worker and every core; {"built": False}
    where dtrain.data.tokenize is not there."""
    try:
        tk = importlib.import_module("dtrain.data.tokenize")
        tkz = importlib.import_module("dtrain.data.tokenizer")
        docs = importlib.import_module("dtrain.data.documents")
    except ImportError as e:
        log(f"tokenize: not measured ({e})")
        return {"built": False}
    files = [str(p) for p in builtin_files()]
    total = sum(Path(f).stat().st_size for f in files)
    t0 = time.perf_counter()
    bpe = tkz.train_bpe(docs.enumerate_sources(files, True), BPE_VOCAB, max_bytes=BPE_TRAIN_BYTES, skip_bad=True)
    train_s = time.perf_counter() - t0
    log(f"tokenize: a BPE of {BPE_VOCAB} ids trained on {BPE_TRAIN_BYTES / 1e6:g} MB in {train_s:.1f}s; "
        f"the corpus: {len(files):,} files, {total / 1e6:.1f} MB")
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {"built": True, "bpe_vocab": BPE_VOCAB, "bpe_train_s": train_s, "cores": cores,
                           "files": len(files)}
    for label, workers in (("1", 1), ("all", cores)):
        dest = work / f"tokenized-{label}"
        shutil.rmtree(dest, ignore_errors=True)
        manifest, stats = tk.tokenize(files, dest, bpe, workers=workers, plain_text=True, overwrite=True,
                                      skip_bad=True)  # a few test files are not UTF-8 on purpose
        mb_s = stats.bytes / 1e6 / stats.seconds
        out[f"mb_per_s_{label}"] = mb_s
        out[f"seconds_{label}"] = stats.seconds
        out["bytes"], out["tokens"], out["skipped_files"] = stats.bytes, manifest.tokens, len(stats.skipped)
        log(f"tokenize: {stats.bytes / 1e6:.1f} MB into {manifest.tokens:,} ids with {workers} worker(s) in "
            f"{stats.seconds:.1f}s: {mb_s:.2f} MB/s")
        shutil.rmtree(dest, ignore_errors=True)
    out.update(encode_batch(files, bpe, out["seconds_all"]))
    return out


def encode_batch(files: list[str], bpe: Any, dtrain_s: float) -> dict[str, Any]:
    """E: the ``tokenizers`` library's own ``encode_batch`` on the texts dtrain tokenized (the UTF-8 files; the
    others dtrain skipped), every core (its threads), against ``dtrain_s``."""
    texts = []
    for f in files:
        try:
            texts.append(Path(f).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    t0 = time.perf_counter()
    encodings = bpe.tokenizer.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - t0
    ids = sum(len(e.ids) for e in encodings)
    log(f"tokenize: encode_batch of the same {len(texts):,} texts: {ids:,} ids in {seconds:.1f}s; dtrain took "
        f"{dtrain_s / seconds:.2f}x as long")
    return {"encode_batch_s": seconds, "encode_batch_ids": ids, "encode_overhead": dtrain_s / seconds}


def ray_scaling(work: Path) -> dict[str, Any]:
    """Y: ``dtrain tokenize`` on a local Ray cluster of 1, then 2 nodes (one CPU each), the first RAY_BYTES of the
    corpus; {"ray": False} without Ray."""
    try:
        importlib.import_module("ray")
    except ImportError as e:
        log(f"ray: not measured ({e}; pip install 'dtrain[ray]')")
        return {"ray": False}
    from dtrain.data.documents import enumerate_sources
    from dtrain.data.tokenize import tokenize
    from dtrain.data.tokenize_ray import LocalRayCluster, RayExecutor
    from dtrain.data.tokenizer import train_bpe

    files, size = [], 0
    for p in builtin_files():
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(str(p))
        size += p.stat().st_size
        if size >= RAY_BYTES:
            break
    bpe = train_bpe(enumerate_sources(files, True), BPE_VOCAB, max_bytes=BPE_TRAIN_BYTES)  # K's, on these files
    out: dict[str, Any] = {"ray": True, "bytes": size, "files": len(files)}
    digests = []
    with LocalRayCluster() as cluster:
        for nodes in (1, 2):
            if nodes == 2:
                cluster.add_node()
            dest = work / f"ray-{nodes}"
            executor = RayExecutor(cluster.address, task_bytes=RAY_TASK_BYTES)
            executor.connect()  # joined before the clock starts
            manifest, stats = tokenize(files, dest, bpe, executor=executor, plain_text=True, overwrite=True)
            out[f"seconds_{nodes}"], out[f"mb_per_s_{nodes}"] = stats.seconds, stats.bytes / 1e6 / stats.seconds
            digests.append(manifest.digest)
            log(f"ray: {stats.bytes / 1e6:.1f} MB with {nodes} node(s) in {stats.seconds:.1f}s: "
                f"{out[f'mb_per_s_{nodes}']:.2f} MB/s")
            shutil.rmtree(dest, ignore_errors=True)
    if digests[0] != digests[1]:
        raise DtrainError(f"ray: the stores of 1 and 2 nodes differ ({digests[0]} vs {digests[1]})")
    out["ratio"] = out["mb_per_s_2"] / out["mb_per_s_1"]
    return out
