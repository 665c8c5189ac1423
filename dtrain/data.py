"""Corpora, deterministic per-island slices, resumable cursors, a held-out split.

A corpus is one flat array of token ids (uint8 for bytes, uint16 for token
shards). Its tail (``eval_fraction``) is held out for eval; the rest is cut into
one contiguous, disjoint shard per island. A shard is read as windows of
``seq_len + 1`` tokens at stride ``seq_len``, in a fresh seeded permutation per
epoch. An island's whole position in its data is one integer, the cursor (the
number of sequences it has consumed), so checkpoints and token accounting only
carry that integer: batch ``c`` always holds the same tokens.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from dtrain.config import DataConfig


class DataError(ValueError):
    """A data source problem; the message names the path."""


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # [N] uint8 or uint16
    description: str
    digest: str  # sha256 prefix of the tokens, recorded in events

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


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


def _read_bytes(files: list[Path], limit: int) -> np.ndarray:
    chunks, total = [], 0
    for path in files:
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror}") from None
        if not blob:
            continue  # an empty file adds nothing, not even the separator
        chunks.append(blob + b"\n")
        total += len(blob) + 1
        if limit and total >= limit:
            break
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return data[:limit] if limit else data


def _read_shards(files: list[Path], limit: int, vocab_size: int) -> np.ndarray:
    parts, total = [], 0
    for path in files:
        try:
            arr = np.fromfile(path, dtype=np.uint16)
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror}") from None
        if path.stat().st_size % 2:
            raise DataError(f"{path}: a uint16 token shard must have an even byte size, got {path.stat().st_size}")
        if arr.size and int(arr.max()) >= vocab_size:
            raise DataError(f"{path}: token id {int(arr.max())} >= model.vocab_size {vocab_size}; "
                            "raise model.vocab_size to cover the shard's vocabulary")
        parts.append(arr)
        total += arr.size
        if limit and total >= limit:
            break
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return data[:limit] if limit else data


def load_corpus(cfg: DataConfig, vocab_size: int = 256) -> Corpus:
    """Loads the configured source; missing, empty or unreadable data raises DataError."""
    source = cfg.source
    if source == "builtin":
        tokens = _read_bytes(builtin_files(), cfg.max_bytes)
        desc = f"builtin: Python {sysconfig.get_python_version()} standard library sources"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data.source {source!r}: no such file or folder")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            shards = [p for p in files if p.suffix == ".bin"]
            if shards:
                tokens, desc = _read_shards(shards, cfg.max_bytes, vocab_size), f"{len(shards)} token shards in {path}"
            elif files:
                tokens, desc = _read_bytes(files, cfg.max_bytes), f"{len(files)} text files in {path}"
            else:
                raise DataError(f"data.source {source!r}: the folder holds no files")
        elif path.suffix == ".bin":
            tokens, desc = _read_shards([path], cfg.max_bytes, vocab_size), f"token shard {path}"
        else:
            tokens, desc = _read_bytes([path], cfg.max_bytes), f"text file {path}"
    if tokens.size == 0:
        raise DataError(f"data.source {source!r}: empty (no tokens)")
    if tokens.dtype == np.uint8 and vocab_size < 256:
        raise DataError(f"data.source {source!r}: byte data needs model.vocab_size >= 256, got {vocab_size}")
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]
    return Corpus(tokens=tokens, description=f"{desc} ({tokens.size:,} tokens)", digest=digest)


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    eval: np.ndarray


def split(corpus: Corpus, eval_fraction: float, seq_len: int) -> Split:
    n = len(corpus)
    n_eval = max(int(n * eval_fraction), seq_len + 1)
    if n - n_eval < 2 * (seq_len + 1):
        raise DataError(f"corpus too small: {n} tokens leave no training data after holding out {n_eval} "
                        f"for eval with seq_len {seq_len}; use a larger source or data.max_bytes")
    return Split(train=corpus.tokens[: n - n_eval], eval=corpus.tokens[n - n_eval:])


@lru_cache(maxsize=4)
def _window_permutation(seed: int, epoch: int, n_windows: int) -> np.ndarray:
    """The order of a stream's windows in ``epoch``. Cached here, keyed by the arguments, not on the stream (an
    ``lru_cache`` on the method would keep the last streams and their tokens alive); read-only, as it is shared."""
    perm = np.random.default_rng([seed, epoch]).permutation(n_windows)
    perm.flags.writeable = False
    return perm


class SequenceStream:
    """Deterministic, resumable batches of windows from one token shard.

    ``batches(cursor, steps, batch_size)`` returns ``[steps, batch_size, seq_len + 1]``
    int32 for sequences ``cursor .. cursor + steps * batch_size``: a pure
    function of the cursor, so resuming is exact.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, name: str = "shard"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{name}: {len(tokens)} tokens hold no window of seq_len+1={seq_len + 1}; "
                            "use a larger corpus (data.max_bytes) or fewer islands")

    def window_ids(self, cursor: int, count: int) -> np.ndarray:
        pos = np.arange(cursor, cursor + count)
        epochs, idx = np.divmod(pos, self.n_windows)
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = _window_permutation(self.seed, int(e), self.n_windows)[idx[sel]]
        return out

    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray:
        starts = self.window_ids(cursor, steps * batch_size) * self.seq_len
        offsets = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[offsets].astype(np.int32).reshape(steps, batch_size, self.seq_len + 1)


@dataclass(frozen=True)
class IslandShard:
    index: int
    start: int  # token offset of the shard in the train split
    stop: int
    stream: SequenceStream


def island_shards(train: np.ndarray, islands: int, seq_len: int, seed: int) -> list[IslandShard]:
    """Cuts the train split into ``islands`` contiguous, disjoint shards."""
    size = len(train) // islands
    out = []
    for i in range(islands):
        start, stop = i * size, (i + 1) * size
        stream = SequenceStream(train[start:stop], seq_len, seed=seed * 1_000_003 + i, name=f"island {i} shard")
        out.append(IslandShard(index=i, start=start, stop=stop, stream=stream))
    return out


def eval_batches(eval_tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> np.ndarray:
    """Fixed eval batches ``[n_batches, batch_size, seq_len + 1]`` spread evenly over the held-out split."""
    n_windows = (len(eval_tokens) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"eval split of {len(eval_tokens)} tokens holds no window of {seq_len + 1}; "
                        "raise data.eval_fraction or data.max_bytes")
    want = n_batches * batch_size
    ids = np.linspace(0, n_windows - 1, num=want).round().astype(np.int64) if want <= n_windows \
        else np.arange(want) % n_windows
    offsets = ids[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return eval_tokens[offsets].astype(np.int32).reshape(n_batches, batch_size, seq_len + 1)
