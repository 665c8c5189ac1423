"""Mixtures of token stores (``data.sources``): a deterministic interleaving by weight, and per-source accounting.

An island's shard of a mixture is one shard of each source (each source's train split cut into one contiguous
shard per island, as for a single store), read through one cursor. Sequence ``c`` of the shard comes from the
source :class:`Schedule` assigns to ``c``, and is that source's ``k``-th sequence, ``k`` the number of earlier
sequences of that source: a pure function of the cursor and the weights, so the island's position in every source
is still one integer, batch ``c`` always holds the same tokens, and every cursor range ``[a, b)`` a push covers is
the source ranges ``[counts(a)[s], counts(b)[s])`` (:meth:`Schedule.counts`). The exactly-once accounting of the
shard's cursor (segments, rewinds, a lost island's split, the audit) is therefore exact per source too, and the
audit and the coordinator's status compute each source's part from the cursor ranges alone.

The schedule: the weights, normalised, are apportioned over a period of :data:`MIX_PERIOD` sequences (largest
remainders), and the period's order is smooth weighted round robin (each step every source gains its quota, the
one furthest ahead is drawn and pays the period), so every prefix of the sequence holds each source's share to
within a sequence or two. It depends on the weights only: the same config gives the same sequence.

This module reads no store and imports no JAX (the coordinator uses :class:`Schedule`); opening a mixture's
stores is :func:`open_mixture`'s, on top of ``dtrain.data.corpus``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dtrain.config.sections import MIX_PERIOD, DataConfig

if TYPE_CHECKING:
    from dtrain.data.corpus import Corpus, IslandShard, ShardStream


class Schedule:
    """Which source each sequence of a mixture comes from, and how many of each the first ``c`` hold."""

    def __init__(self, weights: Sequence[float], period: int = MIX_PERIOD):
        w = np.asarray(weights, np.float64)
        if w.ndim != 1 or w.size < 1 or not np.all(np.isfinite(w)) or not np.all(w > 0):
            raise ValueError(f"mixture weights must be positive numbers, got {list(weights)}")
        exact = w / w.sum() * period
        quota = np.floor(exact).astype(np.int64)
        for i in np.argsort(-(exact - quota), kind="stable")[: period - int(quota.sum())]:
            quota[i] += 1  # largest remainders, ties to the first source
        if np.any(quota < 1):
            raise ValueError(f"a mixture weight below 1/{period} of the total: {list(weights)}")
        self.period, self.quota = period, quota
        order = np.empty(period, np.int64)
        credit = np.zeros(w.size, np.int64)
        for step in range(period):  # smooth weighted round robin over one period
            credit += quota
            pick = int(np.argmax(credit))
            credit[pick] -= period
            order[step] = pick
        self.order = order
        self.order.flags.writeable = False
        prefix = np.zeros((w.size, period + 1), np.int64)
        prefix[:, 1:] = np.cumsum(order[None, :] == np.arange(w.size)[:, None], axis=1)
        self._prefix = prefix

    @property
    def sources(self) -> int:
        return int(self.quota.size)

    def counts(self, cursor: int) -> np.ndarray:
        """Sequences of each source among the first ``cursor`` of the mixture (int64, one per source)."""
        laps, rest = divmod(int(cursor), self.period)
        return laps * self.quota + self._prefix[:, rest]

    def picks(self, cursor: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For sequences ``cursor .. cursor + count``: the source of each, and its index in that source."""
        pos = np.arange(cursor, cursor + count, dtype=np.int64)
        laps, rest = np.divmod(pos, self.period)
        source = self.order[rest]
        return source, laps * self.quota[source] + self._prefix[source, rest]

    def ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        """Each source's sequences ``[a, b)`` that the mixture's sequences ``[start, end)`` are."""
        a, b = self.counts(start), self.counts(end)
        return [(int(x), int(y)) for x, y in zip(a, b, strict=True)]


@lru_cache(maxsize=8)
def schedule_of(weights: tuple[float, ...]) -> Schedule:
    """The schedule of a mixture's weights (cached: the coordinator asks at every status)."""
    return Schedule(weights)


def data_schedule(cfg: DataConfig) -> Schedule | None:
    """The schedule of ``data.sources``; None for a single source."""
    return schedule_of(tuple(s.weight for s in cfg.sources)) if cfg.sources else None


def source_names(cfg: DataConfig) -> list[str]:
    """The sources' names, in order (``data.sources``' labels)."""
    return [s.label for s in cfg.sources]


class MixedStream:
    """One island's shard of a mixture: deterministic, resumable batches whose sequence ``c`` is the sequence
    :class:`Schedule` assigns to ``c`` of that source's own stream (a ``SequenceStream`` over the source's shard).
    The same interface (``dtrain.data.corpus.ShardStream``): ``batches(cursor, steps, batch_size)``, ``wait_s``."""

    def __init__(self, streams: Sequence[ShardStream], schedule: Schedule, seq_len: int):
        if len(streams) != schedule.sources:
            raise ValueError(f"{len(streams)} streams for a schedule of {schedule.sources} sources")
        self.streams, self.schedule, self.seq_len = list(streams), schedule, seq_len

    @property
    def wait_s(self) -> float:
        """Seconds callers waited for reads, over every source."""
        return sum(s.wait_s for s in self.streams)

    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray:
        """``[steps, batch_size, seq_len + 1]`` int32 for sequences ``cursor .. cursor + steps * batch_size`` (with
        ``data.document_masking``: ``[steps, batch_size, 2, seq_len + 1]``, ids and positions)."""
        count = steps * batch_size
        source, _ = self.schedule.picks(cursor, count)
        out: np.ndarray | None = None
        for s, (a, b) in enumerate(self.schedule.ranges(cursor, cursor + count)):
            if b > a:  # the source's own sequences a..b, in order: the rows the schedule gives it
                rows = self.streams[s].batches(a, 1, b - a)[0]  # with data.document_masking: ids and positions
                if out is None:
                    out = np.empty((count, *rows.shape[1:]), np.int32)
                out[source == s] = rows
        assert out is not None, "a schedule gives every pick a source"
        return out.reshape(steps, batch_size, *out.shape[1:])


@dataclass(frozen=True)
class Mixture:
    """The opened sources of ``data.sources``: each one's corpus, its name, and the schedule."""

    corpora: list[Corpus]
    names: list[str]
    schedule: Schedule
    description: str
    digest: str  # identifies the ids used: a hash of the sources' digests and the weights

    def __len__(self) -> int:
        return sum(len(c) for c in self.corpora)


def open_mixture(cfg: DataConfig, vocab_size: int, cache: Path) -> Mixture:
    """Opens every store of ``data.sources`` (:func:`dtrain.data.corpus.open_corpus`, ``data.max_bytes`` of each)
    and checks that they can be mixed: each one a token store, all of one vocabulary, tokenizer and
    end-of-document id. Raises DataError naming the source and what differs."""
    from dtrain.data.corpus import DataError, names_store, open_corpus
    from dtrain.data.token_store import read_store_file

    corpora, first = [], None
    for i, src in enumerate(cfg.sources):
        if not names_store(src.path):
            raise DataError(f"data.sources[{i}] ({src.label}): {src.path!r} is not a token store (no "
                            f"manifest.json there): make one with `dtrain tokenize SRC... --out {src.path}`")
        corpus = open_corpus(replace(cfg, source=src.path, sources=()), vocab_size, cache)
        m = corpus.store.manifest
        tokenizer = read_store_file(src.path, "tokenizer.json", cfg.read_timeout_s) \
            if m.tokenizer == "tokenizer.json" else b""
        ident = (m.vocab_size, m.tokenizer, m.eos_id, hashlib.sha256(tokenizer or b"").hexdigest())
        if first is None:
            first = ident
        elif ident != first:
            what = ("vocabulary" if ident[0] != first[0] else "tokenizer" if ident[1:] != first[1:] else "")
            raise DataError(f"data.sources[{i}] ({src.label}): its {what} differs from data.sources[0]'s "
                            f"({m.vocab_size} ids, tokenizer {m.tokenizer}, eos {m.eos_id}; data.sources[0]: "
                            f"{first[0]} ids, tokenizer {first[1]}, eos {first[2]}"
                            f"{', another tokenizer.json' if ident[:3] == first[:3] else ''}): a mixture's stores "
                            "must be made with one tokenizer")
        corpora.append(corpus)
    names = source_names(cfg)
    schedule = data_schedule(cfg)
    assert schedule is not None
    shares = ", ".join(f"{n} {q / schedule.period:.1%}" for n, q in zip(names, schedule.quota, strict=True))
    digest = hashlib.sha256(repr([(c.digest, q) for c, q in zip(corpora, schedule.quota.tolist(),
                                                                strict=True)]).encode()).hexdigest()[:16]
    return Mixture(corpora, names, schedule, f"mixture of {len(corpora)} stores ({shares}; "
                   f"{sum(len(c) for c in corpora):,} tokens)", digest)


def mixture_shards(mix: Mixture, islands: int, seq_len: int, seed: int, eval_fraction: float
                   ) -> list[IslandShard]:
    """Each island's shard of the mixture: island ``i`` reads shard ``i`` of every source through one
    :class:`MixedStream` (``start``/``stop`` are the first source's token range)."""
    from dtrain.data.corpus import IslandShard, island_shards, split

    per_source = [island_shards(c, split(c, eval_fraction, seq_len).train, islands, seq_len,
                                seed * 7919 + k) for k, c in enumerate(mix.corpora)]
    return [IslandShard(index=i, start=per_source[0][i].start, stop=per_source[0][i].stop,
                        stream=MixedStream([shards[i].stream for shards in per_source], mix.schedule, seq_len))
            for i in range(islands)]


def mixture_eval_batches(mix: Mixture, seq_len: int, batch_size: int, n_batches: int, eval_fraction: float
                         ) -> np.ndarray:
    """Fixed eval batches ``[n_batches, batch_size, seq_len + 1]``: the schedule's first ``n_batches *
    batch_size`` picks, each source's rows from its own held-out split (``dtrain.data.corpus.eval_batches``)."""
    from dtrain.data.corpus import eval_batches, split

    want = n_batches * batch_size
    source, _ = mix.schedule.picks(0, want)
    out: np.ndarray | None = None
    for s, corpus in enumerate(mix.corpora):
        n = int((source == s).sum())
        if n:
            rows = eval_batches(corpus, split(corpus, eval_fraction, seq_len).eval, seq_len, n, 1)[0]
            if out is None:  # with data.document_masking: ids and positions
                out = np.empty((want, *rows.shape[1:]), np.int32)
            out[source == s] = rows
    assert out is not None, "a schedule gives every pick a source"
    return out.reshape(n_batches, batch_size, *out.shape[1:])
