"""Corpora, island shards, resumable streams and the held-out split."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from dtrain.config import DataConfig
from dtrain.data import Corpus, DataError, SequenceStream, eval_batches, island_shards, load_corpus, split

VOCAB = 65536
SEQ = 16


def positional_corpus(tmp_path: Path, n: int = 20_000) -> tuple[Path, Corpus]:
    """A uint16 shard whose token at offset k is k % 65536, so every token names its own position."""
    assert n < VOCAB  # offsets map back to tokens one to one
    path = tmp_path / "pos.bin"
    (np.arange(n) % VOCAB).astype(np.uint16).tofile(path)
    corpus = load_corpus(DataConfig(source=str(path), max_bytes=0), vocab_size=VOCAB)
    return path, corpus


def test_positional_corpus_loads(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    assert corpus.tokens.dtype == np.uint16
    np.testing.assert_array_equal(corpus.tokens, np.arange(20_000))
    assert len(corpus) == 20_000


@pytest.mark.parametrize("islands", [1, 3, 4, 7])
def test_island_shards_disjoint_contiguous(tmp_path: Path, islands: int):
    _, corpus = positional_corpus(tmp_path)
    parts = split(corpus, 0.1, SEQ)
    shards = island_shards(parts.train, islands, SEQ, seed=5)
    size = len(parts.train) // islands
    assert [s.index for s in shards] == list(range(islands))
    assert shards[0].start == 0
    for a, b in itertools.pairwise(shards):
        assert a.stop == b.start
    for s in shards:
        assert s.stop - s.start == size
        np.testing.assert_array_equal(s.stream.tokens, parts.train[s.start:s.stop])
    assert shards[-1].stop <= len(parts.train)
    assert len(parts.train) - shards[-1].stop < islands  # only the remainder of the division is unused


def _window_starts(batch: np.ndarray) -> np.ndarray:
    """Offsets (in the corpus) of each window's first token; checks each window is contiguous."""
    windows = batch.reshape(-1, batch.shape[-1]).astype(np.int64)
    np.testing.assert_array_equal(np.diff(windows, axis=1), 1)  # seq_len+1 consecutive corpus tokens
    return windows[:, 0]


def test_windows_stay_inside_their_island(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    parts = split(corpus, 0.1, SEQ)
    shards = island_shards(parts.train, 4, SEQ, seed=0)
    covered = []
    for s in shards:
        n = s.stream.n_windows
        assert n == (s.stop - s.start - 1) // SEQ
        batch = s.stream.batches(0, 3 * n // 8 + 2, 8)  # more than one epoch
        assert batch.shape == (3 * n // 8 + 2, 8, SEQ + 1) and batch.dtype == np.int32
        starts = _window_starts(batch)
        assert starts.min() >= s.start
        assert starts.max() + SEQ < s.stop  # the last token of every window is inside [start, stop)
        assert ((starts - s.start) % SEQ == 0).all()  # stride seq_len from the shard's start
        covered.append(set(np.unique(batch).tolist()))
    for i in range(len(covered)):
        for j in range(i + 1, len(covered)):
            assert not covered[i] & covered[j], (i, j)
    # nothing from the eval tail
    assert max(max(c) for c in covered) < len(parts.train)


def test_each_window_once_per_epoch_then_new_permutation(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=3000)
    stream = SequenceStream(corpus.tokens, SEQ, seed=11)
    n = stream.n_windows
    assert n == (3000 - 1) // SEQ
    epoch0 = stream.window_ids(0, n)
    epoch1 = stream.window_ids(n, n)
    np.testing.assert_array_equal(np.sort(epoch0), np.arange(n))
    np.testing.assert_array_equal(np.sort(epoch1), np.arange(n))
    assert not np.array_equal(epoch0, epoch1)  # a fresh permutation each epoch
    assert not np.array_equal(epoch0, np.arange(n))  # shuffled
    # the same through the tokens: one epoch of batches uses every window exactly once
    batch = stream.batches(0, n, 1)
    starts = _window_starts(batch)
    np.testing.assert_array_equal(np.sort(starts), np.arange(n) * SEQ)
    # the epoch boundary wraps inside a batch: cursor n-2, 4 windows = 2 from epoch 0, 2 from epoch 1
    wrap = stream.window_ids(n - 2, 4)
    np.testing.assert_array_equal(wrap, np.concatenate([epoch0[-2:], epoch1[:2]]))


def test_stream_deterministic_and_seeded(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=3000)
    a = SequenceStream(corpus.tokens, SEQ, seed=1).batches(7, 5, 4)
    b = SequenceStream(corpus.tokens, SEQ, seed=1).batches(7, 5, 4)
    c = SequenceStream(corpus.tokens, SEQ, seed=2).batches(7, 5, 4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("cursor,k1,k2,bs", [(0, 1, 1, 4), (0, 3, 5, 8), (13, 2, 7, 3), (150, 4, 4, 16),
                                             (0, 20, 20, 16), (171, 1, 30, 5)])
def test_stream_resumable(tmp_path: Path, cursor: int, k1: int, k2: int, bs: int):
    _, corpus = positional_corpus(tmp_path, n=3000)  # 187 windows: several cases cross an epoch
    stream = SequenceStream(corpus.tokens, SEQ, seed=3)
    whole = stream.batches(cursor, k1 + k2, bs)
    fresh = SequenceStream(corpus.tokens, SEQ, seed=3)  # a restarted process: no cached permutations
    parts = np.concatenate([fresh.batches(cursor, k1, bs), fresh.batches(cursor + k1 * bs, k2, bs)])
    np.testing.assert_array_equal(whole, parts)


def test_islands_streams_differ(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    shards = island_shards(split(corpus, 0.1, SEQ).train, 2, SEQ, seed=0)
    ids0 = shards[0].stream.window_ids(0, 50)
    ids1 = shards[1].stream.window_ids(0, 50)
    assert not np.array_equal(ids0, ids1)  # each island has its own shuffle seed


def test_split_and_eval_batches_from_tail_only(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    parts = split(corpus, 0.1, SEQ)
    n = len(corpus)
    assert len(parts.eval) == int(n * 0.1)
    np.testing.assert_array_equal(np.concatenate([parts.train, parts.eval]), corpus.tokens)
    ev = eval_batches(parts.eval, SEQ, batch_size=8, n_batches=4)
    assert ev.shape == (4, 8, SEQ + 1) and ev.dtype == np.int32
    starts = _window_starts(ev)
    assert starts.min() >= len(parts.train)
    assert starts.max() + SEQ < n
    assert len(np.unique(starts)) == 32  # enough windows: all distinct, spread evenly
    assert starts.min() == len(parts.train)  # starts at the first held-out window
    # deterministic
    np.testing.assert_array_equal(ev, eval_batches(parts.eval, SEQ, batch_size=8, n_batches=4))
    # more batches than windows: windows repeat, still from the tail
    small_eval = parts.eval[: 5 * SEQ + 1]
    many = eval_batches(small_eval, SEQ, batch_size=4, n_batches=3)
    s = _window_starts(many)
    assert s.min() >= len(parts.train) and s.max() + SEQ < len(parts.train) + len(small_eval)


def test_split_min_eval_is_one_window(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=1000)
    parts = split(corpus, 0.01, SEQ)  # int(1000 * 0.01) = 10 < seq_len + 1
    assert len(parts.eval) == SEQ + 1


def test_corpus_too_small(tmp_path: Path):
    path = tmp_path / "small.txt"
    path.write_bytes(b"x" * 40)
    corpus = load_corpus(DataConfig(source=str(path), max_bytes=0))
    with pytest.raises(DataError, match="max_bytes"):
        split(corpus, 0.05, 32)


def test_too_many_islands_for_shard(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=1000)
    with pytest.raises(DataError, match="island"):
        island_shards(split(corpus, 0.1, SEQ).train, 100, SEQ, seed=0)


def test_eval_split_too_short():
    with pytest.raises(DataError, match="eval"):
        eval_batches(np.zeros(SEQ, np.uint8), SEQ, 2, 2)


# --- load_corpus -------------------------------------------------------------------------------------


def _load(source: Path | str, max_bytes: int = 0, vocab_size: int = 256) -> Corpus:
    return load_corpus(DataConfig(source=str(source), max_bytes=max_bytes), vocab_size)


def test_missing_source(tmp_path: Path):
    p = tmp_path / "does-not-exist.txt"
    with pytest.raises(DataError) as ei:
        _load(p)
    assert str(p) in str(ei.value)


def test_empty_file(tmp_path: Path):
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    with pytest.raises(DataError) as ei:
        _load(p)
    assert str(p) in str(ei.value) and "empty" in str(ei.value)


def test_folder_of_empty_text_files(tmp_path: Path):
    d = tmp_path / "blank"
    d.mkdir()
    (d / "a.txt").write_bytes(b"")
    (d / "b.txt").write_bytes(b"")
    with pytest.raises(DataError) as ei:
        _load(d)
    assert str(d) in str(ei.value) and "empty" in str(ei.value)
    (d / "c.txt").write_bytes(b"xyz")
    assert _load(d).tokens.tobytes() == b"xyz\n"  # empty files add no separator either


def test_empty_bin_file(tmp_path: Path):
    p = tmp_path / "empty.bin"
    p.write_bytes(b"")
    with pytest.raises(DataError) as ei:
        _load(p, vocab_size=VOCAB)
    assert str(p) in str(ei.value)


def test_empty_folder(tmp_path: Path):
    d = tmp_path / "nothing"
    d.mkdir()
    (d / ".hidden").write_text("ignored")
    with pytest.raises(DataError) as ei:
        _load(d)
    assert str(d) in str(ei.value) and "no files" in str(ei.value)


def test_bin_odd_size(tmp_path: Path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(DataError) as ei:
        _load(p, vocab_size=VOCAB)
    assert str(p) in str(ei.value) and "even" in str(ei.value)


def test_bin_odd_size_in_folder(tmp_path: Path):
    d = tmp_path / "shards"
    d.mkdir()
    np.arange(10, dtype=np.uint16).tofile(d / "a.bin")
    (d / "b.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError) as ei:
        _load(d, vocab_size=VOCAB)
    assert str(d / "b.bin") in str(ei.value)


def test_bin_token_out_of_vocab(tmp_path: Path):
    p = tmp_path / "big.bin"
    np.array([1, 2, 300, 4], np.uint16).tofile(p)
    with pytest.raises(DataError) as ei:
        _load(p, vocab_size=256)
    assert str(p) in str(ei.value) and "300" in str(ei.value) and "vocab_size" in str(ei.value)
    assert len(_load(p, vocab_size=301)) == 4  # 300 < 301 is fine


def test_bytes_need_vocab_256(tmp_path: Path):
    p = tmp_path / "t.txt"
    p.write_text("hello")
    with pytest.raises(DataError, match="vocab_size"):
        _load(p, vocab_size=128)


def test_text_file(tmp_path: Path, text_corpus: Path, text_bytes: bytes):
    c = _load(text_corpus)
    assert c.tokens.dtype == np.uint8
    assert c.tokens.tobytes() == text_bytes + b"\n"  # a newline closes every file
    assert str(text_corpus) in c.description
    c2 = _load(text_corpus, max_bytes=1000)
    assert c2.tokens.tobytes() == text_bytes[:1000]
    assert c2.digest != c.digest and c2.digest == _load(text_corpus, max_bytes=1000).digest


def test_text_folder(tmp_path: Path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_bytes(b"second")
    (d / "a.txt").write_bytes(b"first")
    (d / "sub" / "c.md").write_bytes(b"third")
    (d / ".secret").write_bytes(b"hidden")
    c = _load(d)
    assert c.tokens.tobytes() == b"first\nsecond\nthird\n"  # sorted paths, hidden files skipped
    assert "3 text files" in c.description
    assert _load(d, max_bytes=8).tokens.tobytes() == b"first\nse"


def test_bin_folder(tmp_path: Path):
    d = tmp_path / "shards"
    d.mkdir()
    np.array([5, 6, 7], np.uint16).tofile(d / "01.bin")
    np.array([60000, 1], np.uint16).tofile(d / "00.bin")
    (d / "README.txt").write_text("not tokens")  # a folder with shards reads only the shards
    c = _load(d, vocab_size=VOCAB)
    assert c.tokens.dtype == np.uint16
    np.testing.assert_array_equal(c.tokens, [60000, 1, 5, 6, 7])
    assert "2 token shards" in c.description
    np.testing.assert_array_equal(_load(d, max_bytes=3, vocab_size=VOCAB).tokens, [60000, 1, 5])


def test_builtin_deterministic_and_max_bytes():
    a = load_corpus(DataConfig(source="builtin", max_bytes=100_000))
    b = load_corpus(DataConfig(source="builtin", max_bytes=100_000))
    assert len(a) == 100_000 and a.tokens.dtype == np.uint8
    assert a.digest == b.digest
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = load_corpus(DataConfig(source="builtin", max_bytes=50_000))
    assert len(c) == 50_000
    np.testing.assert_array_equal(c.tokens, a.tokens[:50_000])
    assert b"def " in a.tokens.tobytes()  # it is Python source
