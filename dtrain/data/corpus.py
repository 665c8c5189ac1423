"""Corpora as token stores, per-island shards streamed in blocks, resumable cursors, a held-out split.

Every corpus is read through one reader: a token store (``dtrain.data.token_store``). ``data.source`` names a store
(a folder holding ``manifest.json``, or a ``file://``, ``gs://``, ``s3://`` or ``http(s)://`` URL), or a source
that becomes a store on first use (:func:`store_location`): ``builtin``, a text file or folder of text files
(each file one document), a ``.jsonl``/``.parquet`` file or folder (or a ``datasets`` folder, or compressed
``.gz``/``.zst`` files: read as :mod:`dtrain.data.documents` reads them, the document text in field ``text``),
or nanoGPT-style uint16 ``.bin`` shards; the store is cached under ``data.cache``
(default ``OUT_DIR/data-cache``), keyed by what it was made from (``data.tokenizer``: the byte tokenizer by
default, a BPE trained on the source, or a tokenizer.json).

The first ``data.max_bytes`` ids of the store are used (0: all). Their tail (``eval_fraction``) is held out for
eval; the rest is cut into one contiguous, disjoint shard per island. A shard is read as windows of
``seq_len + 1`` ids at stride ``seq_len``, in an order that is a pure function of (seed, epoch): an island's whole
position in its data is one integer, the cursor (sequences consumed), so checkpoints and token accounting carry
only that integer, and batch ``c`` always holds the same tokens.

The order is two-level so that a shard can be streamed: the shard's windows are cut into blocks of about one
stored chunk; each epoch permutes the blocks, takes them :data:`SHUFFLE_BLOCKS` at a time (a group), and permutes
the windows within each group. An island holds the blocks of the group it reads and of the next one, read ahead
on TensorStore's threads (:class:`SequenceStream`): memory stays at a few groups whatever the corpus's size, and
the step never waits for data once the first group is in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
import threading
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dtrain.config.sections import DataConfig
from dtrain.data.documents import enumerate_sources, kind_of
from dtrain.data.token_store import MANIFEST, DataError, StoreWriter, TokenStore, answered

__all__ = ["SHUFFLE_BLOCKS", "Corpus", "DataError", "IslandShard", "SequenceStream", "ShardStream",
           "Span", "Split", "builtin_files", "eval_batches", "existing_store", "island_shards", "names_store",
           "open_corpus", "split", "store_location", "with_positions"]

SHUFFLE_BLOCKS = 8  # blocks (of about one stored chunk each) whose windows are shuffled together
READ_AHEAD_GROUPS = 1  # groups read ahead of the one being consumed
EVAL_SPAN_CHUNKS = 8  # the eval windows are spread over at most this many stored chunks of the held-out split
CACHE_FORMAT = 1  # bump when the conversion of a source into a store changes
BPE_TRAIN_BYTES = 8 << 20  # data.tokenizer = "bpe:N": the BPE is trained on this much of the source's text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Span:
    """A range ``[start, stop)`` of a corpus's ids."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Corpus:
    """The ids an island trains and evaluates on: the first ``size`` ids of an opened token store."""

    store: TokenStore
    size: int
    description: str
    digest: str  # identifies the ids used (the store's digest, and the prefix when max_bytes cuts it)
    doc_ends: np.ndarray | None = None  # data.document_masking: the store's document ends (int64), read once

    def __len__(self) -> int:
        return self.size

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids ``[start, stop)`` (within the first ``size``)."""
        if not 0 <= start <= stop <= self.size:
            raise DataError(f"{self.store.location}: range [{start}, {stop}) is outside the {self.size} ids used")
        return self.store.read(start, stop)


def builtin_files() -> list[Path]:
    """The running interpreter's standard-library .py files in a fixed, well-mixed order.

    Sorted by a hash of the relative path (not alphabetically), so the eval
    tail and the island shards each see a mix of modules rather than one
    corner of the library.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    if not files:
        raise DataError(f"builtin corpus: no .py files under {root}")
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest())


# --- sources into stores ------------------------------------------------------------------------------------


def _is_url(source: str) -> bool:
    return urllib.parse.urlparse(source).scheme in ("file", "gs", "s3", "http", "https")


def names_store(source: str) -> bool:
    """Whether ``source`` is a store itself (a URL, or a folder with a manifest or a tokens array), not a source
    to make one from."""
    if _is_url(source):
        return True
    path = Path(source).expanduser()
    return source != "builtin" and ((path / MANIFEST).exists() or (path / "tokens").is_dir())


@dataclass(frozen=True)
class _Plan:
    """How a source that is not a store becomes one: its files, their kind, and the cache key."""

    kind: str  # "builtin", "text" (each file one document), "documents" (files of documents) or "bin"
    files: list[Path]
    description: str


def _plan(source: str) -> _Plan:
    if source == "builtin":
        return _Plan("builtin", builtin_files(),
                     f"builtin: Python {sysconfig.get_python_version()} standard library sources")
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source {source!r}: no such file or folder (a store path or URL, builtin, text "
                        "files or .bin shards)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        shards = [p for p in files if p.suffix == ".bin"]
        if shards:
            return _Plan("bin", shards, f"{len(shards)} token shards in {path}")
        if not files:
            raise DataError(f"data.source {source!r}: the folder holds no files")
        if any(kind_of(p) != "text" for p in files) or (path / "state.json").exists() \
                or (path / "dataset_dict.json").exists():
            files = [f.path for f in enumerate_sources([path])]  # a datasets folder: its data files
            return _Plan("documents", files, f"the documents of {len(files)} files in {path}")
        return _Plan("text", files, f"{len(files)} text files in {path}")
    if path.suffix == ".bin":
        return _Plan("bin", [path], f"token shard {path}")
    if kind_of(path) != "text":
        return _Plan("documents", [path], f"the documents of {path}")
    return _Plan("text", [path], f"text file {path}")


def _cache_key(plan: _Plan, limit: int, tokenizer: str) -> str:
    stats = []
    tokenizer_file = [] if tokenizer == "bytes" or tokenizer.startswith("bpe:") or plan.kind == "bin" \
        else [Path(tokenizer).expanduser()]
    for p in [*plan.files, *tokenizer_file]:
        try:
            st = p.stat()
        except OSError as e:
            raise DataError(f"{p}: cannot read: {e.strerror}") from None
        stats.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format": CACHE_FORMAT, "kind": plan.kind, "files": stats, "limit": limit,
                       "tokenizer": "" if plan.kind == "bin" else tokenizer}).encode()
    return f"{plan.kind}-{hashlib.sha256(blob).hexdigest()[:16]}"


def _utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True


def _source_tokenizer(spec: str, plan: _Plan, vocab_size: int | None) -> tuple[Any, int]:
    """``data.tokenizer`` for a text or documents source: the tokenizer, and the vocabulary size of a BPE trained
    here (0). Refuses one with more ids than ``vocab_size`` (model.vocab_size) before a BPE is trained or a
    document tokenized."""
    from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe

    tokenizer = ByteTokenizer() if spec == "bytes" else None if spec.startswith("bpe:") else HFTokenizer.from_file(spec)
    size = tokenizer.vocab_size if tokenizer is not None else int(spec[4:])
    if vocab_size is not None and size > vocab_size:
        raise DataError(f"data.tokenizer {spec!r} has {size:,} ids, more than model.vocab_size {vocab_size:,}: set "
                        f"model.vocab_size >= {size} (refused before tokenizing data.source)")
    if tokenizer is not None:
        return tokenizer, 0
    log.info("training a byte-level BPE of %d ids on the first %d MB of %s", size, BPE_TRAIN_BYTES >> 20,
             plan.description)
    files = enumerate_sources(plan.files, plain_text=plan.kind != "documents")
    return train_bpe(files, size, max_bytes=BPE_TRAIN_BYTES), size


def _write_text_store(plan: _Plan, out: Path, limit: int, tokenizer_spec: str, vocab_size: int | None) -> None:
    """The store of a text source's files (each file one document) or a documents source's documents, at most
    ``limit`` ids, with the tokenizer ``data.tokenizer`` names (no more ids than ``vocab_size``, checked first):
    ``dtrain tokenize`` with every file read as text or as its kind, in this process (no pool to
    start from inside an island), its progress a status line. The built-in corpus's few files that are not UTF-8
    on purpose (test data) are left out by a BPE, not by the byte tokenizer."""
    from dtrain.data.tokenize import ProgressLine, tokenize

    if plan.kind == "builtin" and tokenizer_spec != "bytes":  # its deliberately non-UTF-8 test files: left out
        plan = _Plan(plan.kind, [f for f in plan.files if _utf8(f)], plan.description)
    tokenizer, trained = _source_tokenizer(tokenizer_spec, plan, vocab_size)
    progress = ProgressLine(quiet=False)
    try:
        tokenize(plan.files, out, tokenizer, limit=limit, plain_text=plan.kind != "documents", progress=progress,
                 workers=1, trained_vocab_size=trained)
    finally:
        progress.end()


def _bin_ids(path: Path) -> np.ndarray:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    if size % 2:
        raise DataError(f"{path}: a uint16 token shard must have an even byte size, got {size}")
    if size == 0:
        return np.zeros(0, np.uint16)
    try:
        return np.memmap(path, dtype="<u2", mode="r")
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None


def _write_bin_store(files: list[Path], out: Path, limit: int, block: int = 1 << 24) -> None:
    """uint16 shards (one document each) into a store, at most ``limit`` ids. The first pass (the largest id)
    reads ``block`` ids at a time; the writer then holds one shard's ids at a time (a document is written
    whole). The store's vocabulary is the largest id + 1: the shards do not say which tokenizer made them."""
    arrays, top, total = [], -1, 0
    for path in files:  # first pass: sizes and the largest id, read through the page cache
        ids = _bin_ids(path)
        if limit:
            ids = ids[: max(0, limit - total)]
        for s in range(0, ids.size, block):
            top = max(top, int(ids[s:s + block].max()))
        arrays.append(ids)
        total += ids.size
        if limit and total >= limit:
            break
    writer = StoreWriter(out, vocab_size=max(top + 1, 1), tokenizer="pre-tokenized (.bin)")
    for ids in arrays:
        if ids.size:
            writer.add_document(np.asarray(ids))
    writer.close()


def existing_store(cfg: DataConfig, cache: Path) -> str | None:
    """The token store ``cfg.source`` names, or the one it was made into under ``cache`` (:func:`store_location`),
    without making one: None when there is none yet there for the source as its files are now."""
    source = cfg.source
    if names_store(source):
        return source
    try:
        dest = cache / _cache_key(_plan(source), cfg.max_bytes, cfg.tokenizer)
    except DataError:
        return None
    return str(dest) if (dest / MANIFEST).exists() else None


def store_location(cfg: DataConfig, cache: Path, vocab_size: int | None = None) -> str:
    """The token store ``cfg.source`` names or was made into (:func:`_made_store`)."""
    return _made_store(cfg, cache, vocab_size)[0]


def _made_store(cfg: DataConfig, cache: Path, vocab_size: int | None = None) -> tuple[str, str]:
    """The token store ``cfg.source`` names: itself when it is a store (a folder with ``manifest.json``, or a
    URL), else a store made from it on first use under ``cache`` (``builtin``, text, documents, ``.bin``),
    holding at most ``max_bytes`` ids; and what it holds, in words. ``vocab_size``: model.vocab_size, which a
    tokenizer must fit before it tokenizes anything. Raises DataError naming the source for what cannot be
    read."""
    source = cfg.source
    if names_store(source):
        return source, source
    plan = _plan(source)
    dest = cache / _cache_key(plan, cfg.max_bytes, cfg.tokenizer)
    if (dest / MANIFEST).exists():
        return str(dest), plan.description
    log.info("making the token store %s from %s (%s, first use)", dest, plan.description,
             "pre-tokenized" if plan.kind == "bin" else cfg.tokenizer)
    t0 = time.perf_counter()
    tmp = cache / f".{dest.name}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if plan.kind == "bin":
            _write_bin_store(plan.files, tmp, cfg.max_bytes)
        else:
            _write_text_store(plan, tmp, cfg.max_bytes, cfg.tokenizer, vocab_size)
        try:
            os.rename(tmp, dest)  # whole or absent: a process making the same store at once loses the race
        except OSError:
            if not (dest / MANIFEST).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("token store %s written in %.1f s", dest, time.perf_counter() - t0)
    return str(dest), plan.description


def known_digest(cfg: DataConfig, vocab_size: int, cache: Path) -> str:
    """The digest of the corpus ``cfg`` names (:attr:`Corpus.digest`) when its store exists already (one named
    as the source, or made from it under ``cache``), read from its manifest; '' when there is none yet or it
    cannot be opened (the coordinator then takes the first joining island's: ``Config.fingerprint_fields``)."""
    if existing_store(cfg, cache) is None:
        return ""
    try:
        return open_corpus(cfg, vocab_size, cache).digest
    except DataError:
        return ""


def open_corpus(cfg: DataConfig, vocab_size: int, cache: Path) -> Corpus:
    """Opens the configured source as a token store (:func:`store_location`): the manifest only, so start-up
    does not grow with the corpus. Raises DataError naming the source for a store that is missing, incomplete,
    empty, not answering, or whose vocabulary exceeds ``vocab_size``."""
    location, what = _made_store(cfg, cache, vocab_size)
    store = TokenStore.open(location, timeout_s=cfg.read_timeout_s)
    m = store.manifest
    if m.vocab_size > vocab_size:
        raise DataError(f"data.source {cfg.source!r}: the token store's vocabulary has {m.vocab_size} ids "
                        f"(0..{m.vocab_size - 1}, tokenizer {m.tokenizer}), more than model.vocab_size {vocab_size}: "
                        f"set model.vocab_size >= {m.vocab_size}")
    size = min(m.tokens, cfg.max_bytes) if cfg.max_bytes else m.tokens
    if size == 0:
        raise DataError(f"data.source {cfg.source!r}: empty (no tokens)")
    digest = m.digest.split(":")[-1][:16] + (f"@{size}" if size < m.tokens else "")
    ends = store.doc_ends().astype(np.int64) if cfg.document_masking else None  # 8 bytes a document, once
    return Corpus(store=store, size=size, description=f"{what} ({size:,} tokens, {m.tokenizer})", digest=digest,
                  doc_ends=ends)


def with_positions(corpus: Corpus, starts_N: np.ndarray, windows_NxL1: np.ndarray) -> np.ndarray:
    """The windows as they go to the step: unchanged (``[N, L + 1]``), or with ``data.document_masking`` each
    stacked with its tokens' positions in their documents (``[N, 2, L + 1]``: 0 at a document's first token and at
    the window's start, counting up), from the corpus's document ends. ``starts_N``: each window's first id."""
    if corpus.doc_ends is None:
        return windows_NxL1
    at_NxL1 = starts_N[:, None] + np.arange(windows_NxL1.shape[1])
    ends = corpus.doc_ends
    ended_NxL1 = np.searchsorted(ends, at_NxL1, side="right")  # documents that end at or before each id
    doc_start_NxL1 = np.where(ended_NxL1 > 0, ends[np.maximum(ended_NxL1 - 1, 0)], 0)
    positions_NxL1 = at_NxL1 - np.maximum(doc_start_NxL1, starts_N[:, None])
    return np.stack([windows_NxL1, positions_NxL1.astype(np.int32)], axis=1)


# --- split, shards, streams -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    train: Span
    eval: Span


def split(corpus: Corpus, eval_fraction: float, seq_len: int) -> Split:
    n = len(corpus)
    n_eval = max(int(n * eval_fraction), seq_len + 1)
    if n - n_eval < 2 * (seq_len + 1):
        raise DataError(f"corpus too small: {n} tokens leave no training data after holding out {n_eval} "
                        f"for eval with seq_len {seq_len}; use a larger source or data.max_bytes")
    return Split(train=Span(0, n - n_eval), eval=Span(n - n_eval, n))


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n_blocks: int, block_windows: int, n_windows: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's block order and the first position of each group (and the end): group ``g`` holds blocks
    ``order[g*G:(g+1)*G]`` and positions ``[starts[g], starts[g+1])`` of the epoch. Read-only, as it is shared."""
    order = np.random.default_rng([seed, epoch, 0]).permutation(n_blocks)
    sizes = np.minimum(block_windows, n_windows - order * block_windows)
    group_sizes = np.add.reduceat(sizes, np.arange(0, n_blocks, SHUFFLE_BLOCKS))
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    order.flags.writeable = False
    starts.flags.writeable = False
    return order, starts


@lru_cache(maxsize=16)
def _group_windows(seed: int, epoch: int, group: int, n_blocks: int, block_windows: int, n_windows: int
                   ) -> np.ndarray:
    """The window ids of one group, in the order the epoch reads them. Read-only, as it is shared."""
    order, _ = _epoch_order(seed, epoch, n_blocks, block_windows, n_windows)
    blocks = order[group * SHUFFLE_BLOCKS:(group + 1) * SHUFFLE_BLOCKS]
    ids = np.concatenate([np.arange(b * block_windows, min((b + 1) * block_windows, n_windows)) for b in blocks])
    out = ids[np.random.default_rng([seed, epoch, 1, group]).permutation(ids.size)]
    out.flags.writeable = False
    return out


class SequenceStream:
    """Deterministic, resumable batches of windows from one span of a corpus (all of it by default), streamed
    from its store.

    ``batches(cursor, steps, batch_size)`` returns ``[steps, batch_size, seq_len + 1]`` int32 (with
    ``data.document_masking`` ``[steps, batch_size, 2, seq_len + 1]``: :func:`with_positions`) for sequences
    ``cursor .. cursor + steps * batch_size``: a pure function of the cursor, so resuming is exact. The blocks a
    batch needs are read on demand and the next group's are read ahead; :attr:`wait_s` is the time callers spent
    waiting for reads, and :attr:`peak_blocks` the most blocks held at once.
    """

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, span: Span | None = None, name: str = "shard"):
        span = span or Span(0, len(corpus))
        self.corpus, self.span, self.seq_len, self.seed, self.name = corpus, span, seq_len, seed, name
        self.n_windows = (len(span) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{name}: {len(span)} tokens hold no window of seq_len+1={seq_len + 1}; "
                            "use a larger corpus (data.max_bytes) or fewer islands")
        self.block_windows = max(1, corpus.store.chunk_tokens // seq_len)
        self.n_blocks = -(-self.n_windows // self.block_windows)
        self.wait_s = 0.0
        self.peak_blocks = 0
        self._blocks: OrderedDict[int, Any] = OrderedDict()  # block -> its ids (np.ndarray) or a read future
        self._capacity = (2 + READ_AHEAD_GROUPS) * SHUFFLE_BLOCKS
        self._lock = threading.Lock()

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        return _epoch_order(self.seed, epoch, self.n_blocks, self.block_windows, self.n_windows)

    def _group(self, epoch: int, group: int) -> np.ndarray:
        return _group_windows(self.seed, epoch, group, self.n_blocks, self.block_windows, self.n_windows)

    def window_ids(self, cursor: int, count: int) -> np.ndarray:
        """The windows (by index in the span) of sequences ``cursor .. cursor + count``."""
        pos = np.arange(cursor, cursor + count)
        epochs, idx = np.divmod(pos, self.n_windows)
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            _, starts = self._order(int(e))
            groups = np.searchsorted(starts, idx[sel], side="right") - 1
            ids = np.empty(int(sel.sum()), np.int64)
            for g in np.unique(groups):
                at = groups == g
                ids[at] = self._group(int(e), int(g))[idx[sel][at] - starts[g]]
            out[sel] = ids
        return out

    def _block_range(self, block: int) -> tuple[int, int]:
        first = block * self.block_windows
        last = min(first + self.block_windows, self.n_windows)
        start = self.span.start + first * self.seq_len
        return start, self.span.start + last * self.seq_len + 1

    def _request(self, block: int) -> None:
        """Starts reading ``block`` unless it is held or on its way (called with the lock held)."""
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return
        self._blocks[block] = self.corpus.store.read_async(*self._block_range(block))
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)  # the least recently used; a pending read is simply dropped
        self.peak_blocks = max(self.peak_blocks, len(self._blocks))

    def _block(self, block: int) -> np.ndarray:
        with self._lock:
            self._request(block)
            held = self._blocks[block]
        if isinstance(held, np.ndarray):
            return held
        t0 = time.perf_counter()
        store = self.corpus.store
        with answered(store.location, store.timeout_s, f"reading {self.name}'s block {block}"):
            ids = np.asarray(held.result(timeout=store.timeout_s))
        self.wait_s += time.perf_counter() - t0
        with self._lock:
            if block in self._blocks:
                self._blocks[block] = ids
        return ids

    def _read_ahead(self, cursor: int) -> None:
        """Starts the reads of the group after the one holding sequence ``cursor`` (and of its own)."""
        epoch, pos = divmod(cursor, self.n_windows)
        order, starts = self._order(epoch)
        group = int(np.searchsorted(starts, pos, side="right") - 1)
        wanted = []
        for _ in range(1 + READ_AHEAD_GROUPS):
            wanted.extend(order[group * SHUFFLE_BLOCKS:(group + 1) * SHUFFLE_BLOCKS].tolist())
            group += 1
            if group * SHUFFLE_BLOCKS >= self.n_blocks:
                epoch, group = epoch + 1, 0
                order, _ = self._order(epoch)
        with self._lock:
            for b in wanted:
                self._request(int(b))

    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray:
        count = steps * batch_size
        ids = self.window_ids(cursor, count)
        out = np.empty((count, self.seq_len + 1), np.int32)
        blocks, local = np.divmod(ids, self.block_windows)
        offsets = np.arange(self.seq_len + 1)
        for b in np.unique(blocks):
            at = blocks == b
            out[at] = self._block(int(b))[local[at, None] * self.seq_len + offsets]
        self._read_ahead(cursor + count)
        rows = with_positions(self.corpus, self.span.start + ids * self.seq_len, out)
        return rows.reshape(steps, batch_size, *rows.shape[1:])


class ShardStream(Protocol):
    """What an island reads its shard through: a :class:`SequenceStream`, or a mixture's
    (``dtrain.data.mixture.MixedStream``)."""

    @property
    def wait_s(self) -> float: ...

    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray: ...


@dataclass(frozen=True)
class IslandShard:
    index: int
    start: int  # token offset of the shard in the corpus (a mixture: in its first source)
    stop: int
    stream: ShardStream


def island_shards(corpus: Corpus, train: Span, islands: int, seq_len: int, seed: int) -> list[IslandShard]:
    """Cuts the train span into ``islands`` contiguous, disjoint shards (nothing is read)."""
    size = len(train) // islands
    out = []
    for i in range(islands):
        start, stop = train.start + i * size, train.start + (i + 1) * size
        stream = SequenceStream(corpus, seq_len, seed=seed * 1_000_003 + i, span=Span(start, stop),
                                name=f"island {i} shard")
        out.append(IslandShard(index=i, start=start, stop=stop, stream=stream))
    return out


def eval_batches(corpus: Corpus, held_out: Span, seq_len: int, batch_size: int, n_batches: int) -> np.ndarray:
    """Fixed eval batches ``[n_batches, batch_size, seq_len + 1]`` spread evenly over the start of the held-out
    span, at most :data:`EVAL_SPAN_CHUNKS` stored chunks of it, read as one range per chunk they touch: the cost
    is bounded whatever the corpus's size (a store's documents are in no particular order, so millions of
    held-out ids are as good a sample as billions)."""
    chunk = corpus.store.chunk_tokens
    held_out = Span(held_out.start, min(held_out.stop, held_out.start + EVAL_SPAN_CHUNKS * chunk))
    n_windows = (len(held_out) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"eval split of {len(held_out)} tokens holds no window of {seq_len + 1}; "
                        "raise data.eval_fraction or data.max_bytes")
    want = n_batches * batch_size
    ids = np.linspace(0, n_windows - 1, num=want).round().astype(np.int64) if want <= n_windows \
        else np.arange(want) % n_windows
    starts = held_out.start + ids * seq_len
    out = np.empty((want, seq_len + 1), np.int32)
    unique = np.unique(starts)
    runs = np.split(unique, np.flatnonzero(np.diff(unique // chunk)) + 1)  # the windows starting in each chunk
    reads = [(int(r[0]), corpus.store.read_async(int(r[0]), int(r[-1]) + seq_len + 1)) for r in runs]
    offsets = np.arange(seq_len + 1)
    for (first, future), run in zip(reads, runs, strict=True):
        with answered(corpus.store.location, corpus.store.timeout_s, "reading the eval windows"):
            ids_read = np.asarray(future.result(timeout=corpus.store.timeout_s))
        at = np.isin(starts, run)
        out[at] = ids_read[(starts[at] - first)[:, None] + offsets]
    rows = with_positions(corpus, starts, out)
    return rows.reshape(n_batches, batch_size, *rows.shape[1:])
