"""Corpora as token stores, island shards, resumable streams and the held-out split."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from dtrain.config.sections import DataConfig
from dtrain.data.corpus import (
    EVAL_SPAN_CHUNKS,
    READ_AHEAD_GROUPS,
    SHUFFLE_BLOCKS,
    Corpus,
    DataError,
    SequenceStream,
    Span,
    eval_batches,
    island_shards,
    open_corpus,
    split,
    store_location,
)
from dtrain.data.token_store import StoreWriter, TokenStore

VOCAB = 65536
SEQ = 16


def _all(corpus: Corpus) -> np.ndarray:
    return corpus.read(0, len(corpus))


def _text(corpus: Corpus) -> bytes:
    """A byte-tokenized corpus's ids as the bytes they are."""
    return _all(corpus).astype(np.uint8).tobytes()


def positional_corpus(tmp_path: Path, n: int = 20_000) -> tuple[Path, Corpus]:
    """A uint16 shard whose token at offset k is k % 65536, so every token names its own position."""
    assert n < VOCAB  # offsets map back to tokens one to one
    path = tmp_path / "pos.bin"
    (np.arange(n) % VOCAB).astype(np.uint16).tofile(path)
    corpus = open_corpus(DataConfig(source=str(path), max_bytes=0), VOCAB, tmp_path / "cache")
    return path, corpus


def positional_store(tmp_path: Path, n: int, chunk: int) -> Corpus:
    """The positional corpus as a store of small chunks, so a shard holds many blocks."""
    w = StoreWriter(tmp_path / f"pos-{n}-{chunk}", VOCAB, chunk_tokens=chunk)
    w.add_document(np.arange(n))
    w.close()
    store = TokenStore.open(tmp_path / f"pos-{n}-{chunk}")
    return Corpus(store=store, size=n, description="positional", digest="pos")


def _stream(corpus: Corpus, seed: int) -> SequenceStream:
    return SequenceStream(corpus, SEQ, seed=seed)


def test_positional_corpus_loads(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    assert corpus.store.manifest.dtype == "uint16"
    np.testing.assert_array_equal(_all(corpus), np.arange(20_000))
    assert len(corpus) == 20_000


@pytest.mark.parametrize("islands", [1, 3, 4, 7])
def test_island_shards_disjoint_contiguous(tmp_path: Path, islands: int):
    _, corpus = positional_corpus(tmp_path)
    parts = split(corpus, 0.1, SEQ)
    shards = island_shards(corpus, parts.train, islands, SEQ, seed=5)
    size = len(parts.train) // islands
    assert [s.index for s in shards] == list(range(islands))
    assert shards[0].start == 0
    for a, b in itertools.pairwise(shards):
        assert a.stop == b.start
    for s in shards:
        assert s.stop - s.start == size
        assert s.stream.span == Span(s.start, s.stop)
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
    shards = island_shards(corpus, parts.train, 4, SEQ, seed=0)
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
    stream = _stream(corpus, seed=11)
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
    a = _stream(corpus, seed=1).batches(7, 5, 4)
    b = _stream(corpus, seed=1).batches(7, 5, 4)
    c = _stream(corpus, seed=2).batches(7, 5, 4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("cursor,k1,k2,bs", [(0, 1, 1, 4), (0, 3, 5, 8), (13, 2, 7, 3), (150, 4, 4, 16),
                                             (0, 20, 20, 16), (171, 1, 30, 5)])
def test_stream_resumable(tmp_path: Path, cursor: int, k1: int, k2: int, bs: int):
    _, corpus = positional_corpus(tmp_path, n=3000)  # 187 windows: several cases cross an epoch
    stream = _stream(corpus, seed=3)
    whole = stream.batches(cursor, k1 + k2, bs)
    fresh = _stream(corpus, seed=3)  # a restarted process: no cached permutations
    parts = np.concatenate([fresh.batches(cursor, k1, bs), fresh.batches(cursor + k1 * bs, k2, bs)])
    np.testing.assert_array_equal(whole, parts)


def test_islands_streams_differ(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    shards = island_shards(corpus, split(corpus, 0.1, SEQ).train, 2, SEQ, seed=0)
    ids0 = shards[0].stream.window_ids(0, 50)
    ids1 = shards[1].stream.window_ids(0, 50)
    assert not np.array_equal(ids0, ids1)  # each island has its own shuffle seed


def test_split_and_eval_batches_from_tail_only(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path)
    parts = split(corpus, 0.1, SEQ)
    n = len(corpus)
    assert len(parts.eval) == int(n * 0.1)
    assert parts.train == Span(0, n - len(parts.eval)) and parts.eval.stop == n
    ev = eval_batches(corpus, parts.eval, SEQ, batch_size=8, n_batches=4)
    assert ev.shape == (4, 8, SEQ + 1) and ev.dtype == np.int32
    starts = _window_starts(ev)
    assert starts.min() >= len(parts.train)
    assert starts.max() + SEQ < n
    assert len(np.unique(starts)) == 32  # enough windows: all distinct, spread evenly
    assert starts.min() == len(parts.train)  # starts at the first held-out window
    # deterministic
    np.testing.assert_array_equal(ev, eval_batches(corpus, parts.eval, SEQ, batch_size=8, n_batches=4))
    # more batches than windows: windows repeat, still from the tail
    small_eval = Span(parts.eval.start, parts.eval.start + 5 * SEQ + 1)
    many = eval_batches(corpus, small_eval, SEQ, batch_size=4, n_batches=3)
    s = _window_starts(many)
    assert s.min() >= len(parts.train) and s.max() + SEQ < len(parts.train) + len(small_eval)


def test_split_min_eval_is_one_window(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=1000)
    parts = split(corpus, 0.01, SEQ)  # int(1000 * 0.01) = 10 < seq_len + 1
    assert len(parts.eval) == SEQ + 1


def test_corpus_too_small(tmp_path: Path):
    path = tmp_path / "small.txt"
    path.write_bytes(b"x" * 40)
    corpus = open_corpus(DataConfig(source=str(path), max_bytes=0), 256, tmp_path / "cache")
    with pytest.raises(DataError, match="max_bytes"):
        split(corpus, 0.05, 32)


def test_too_many_islands_for_shard(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=1000)
    with pytest.raises(DataError, match="island"):
        island_shards(corpus, split(corpus, 0.1, SEQ).train, 100, SEQ, seed=0)


def test_eval_split_too_short(tmp_path: Path):
    _, corpus = positional_corpus(tmp_path, n=1000)
    with pytest.raises(DataError, match="eval"):
        eval_batches(corpus, Span(0, SEQ), SEQ, 2, 2)


# --- open_corpus -------------------------------------------------------------------------------------


def _load(source: Path | str, max_bytes: int = 0, vocab_size: int = 256, cache: Path | None = None) -> Corpus:
    cache = cache or Path(str(source)).parent / "cache"
    return open_corpus(DataConfig(source=str(source), max_bytes=max_bytes), vocab_size, cache)


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
    assert _text(_load(d)) == b"xyz\n"  # empty files add no separator either


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
    assert c.store.manifest.tokenizer == "bytes" and c.store.manifest.vocab_size == 256
    assert _text(c) == text_bytes + b"\n"  # a newline closes every file
    assert str(text_corpus) in c.description
    c2 = _load(text_corpus, max_bytes=1000)
    assert _text(c2) == text_bytes[:1000]
    assert c2.digest != c.digest and c2.digest == _load(text_corpus, max_bytes=1000).digest


def test_text_folder(tmp_path: Path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_bytes(b"second")
    (d / "a.txt").write_bytes(b"first")
    (d / "sub" / "c.md").write_bytes(b"third")
    (d / ".secret").write_bytes(b"hidden")
    c = _load(d)
    assert _text(c) == b"first\nsecond\nthird\n"  # sorted paths, hidden files skipped
    assert "3 text files" in c.description
    assert _text(_load(d, max_bytes=8)) == b"first\nse"


def test_bin_folder(tmp_path: Path):
    d = tmp_path / "shards"
    d.mkdir()
    np.array([5, 6, 7], np.uint16).tofile(d / "01.bin")
    np.array([60000, 1], np.uint16).tofile(d / "00.bin")
    (d / "README.txt").write_text("not tokens")  # a folder with shards reads only the shards
    c = _load(d, vocab_size=VOCAB)
    assert c.store.manifest.dtype == "uint16"
    np.testing.assert_array_equal(_all(c), [60000, 1, 5, 6, 7])
    assert "2 token shards" in c.description
    np.testing.assert_array_equal(_all(_load(d, max_bytes=3, vocab_size=VOCAB)), [60000, 1, 5])


def test_builtin_deterministic_and_max_bytes(tmp_path: Path):
    a = open_corpus(DataConfig(source="builtin", max_bytes=100_000), 256, tmp_path / "a")
    b = open_corpus(DataConfig(source="builtin", max_bytes=100_000), 256, tmp_path / "b")
    assert len(a) == 100_000
    assert a.digest == b.digest
    np.testing.assert_array_equal(_all(a), _all(b))
    c = open_corpus(DataConfig(source="builtin", max_bytes=50_000), 256, tmp_path / "a")
    assert len(c) == 50_000
    np.testing.assert_array_equal(_all(c), _all(a)[:50_000])
    assert b"def " in _text(a)  # it is Python source
    assert len(list((tmp_path / "a").iterdir())) == 2  # one store per prefix, each made once


# --- streaming from a store of many chunks ---------------------------------------------------------------


def test_stream_blocks_groups_and_read_ahead(tmp_path: Path):
    corpus = positional_store(tmp_path, n=50_000, chunk=1024)  # 64 windows a block, 49 blocks, 7 groups
    stream = _stream(corpus, seed=4)
    n = stream.n_windows
    assert stream.block_windows == 1024 // SEQ and stream.n_blocks == -(-n // stream.block_windows)
    epoch0 = stream.window_ids(0, n)
    np.testing.assert_array_equal(np.sort(epoch0), np.arange(n))  # each window once per epoch
    group_span = int(stream._order(0)[1][1])  # 8 blocks of 64 windows, less if the short last block is one
    first = set((epoch0[:group_span] // stream.block_windows).tolist())
    assert len(first) == SHUFFLE_BLOCKS  # the first group's windows come from its 8 blocks, mixed
    assert first != set(range(SHUFFLE_BLOCKS))  # the blocks are permuted, not taken in order
    assert not np.array_equal(stream.window_ids(n, n), epoch0)  # a new order each epoch
    batch = stream.batches(0, 4, 8)
    np.testing.assert_array_equal(_window_starts(batch), epoch0[:32] * SEQ)  # the tokens of those windows
    # the group being read and the next one are held or on their way; nothing else
    assert len(stream._blocks) == 2 * SHUFFLE_BLOCKS
    # two epochs later, memory is still a few groups
    for c in range(32, 2 * n, 256):
        stream.batches(c, 32, 8)
    assert stream.peak_blocks <= (2 + READ_AHEAD_GROUPS) * SHUFFLE_BLOCKS < stream.n_blocks
    assert stream.wait_s >= 0.0


@pytest.mark.parametrize("cursor,k1,k2,bs", [(0, 3, 5, 64), (500, 7, 9, 33), (3000, 10, 10, 17)])
def test_stream_resumable_across_groups(tmp_path: Path, cursor: int, k1: int, k2: int, bs: int):
    corpus = positional_store(tmp_path, n=50_000, chunk=1024)
    whole = _stream(corpus, seed=3).batches(cursor, k1 + k2, bs)
    fresh = _stream(corpus, seed=3)
    parts = np.concatenate([fresh.batches(cursor, k1, bs), fresh.batches(cursor + k1 * bs, k2, bs)])
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(_window_starts(whole), fresh.window_ids(cursor, (k1 + k2) * bs) * SEQ)


def test_eval_batches_across_chunks(tmp_path: Path):
    corpus = positional_store(tmp_path, n=50_000, chunk=1024)
    parts = split(corpus, 0.2, SEQ)  # 10,000 held-out ids over 10 chunks, the windows from the first 8
    ev = eval_batches(corpus, parts.eval, SEQ, batch_size=8, n_batches=4)
    starts = _window_starts(ev)
    assert len(np.unique(starts)) == 32 and starts.min() == parts.eval.start
    assert starts.max() + SEQ < parts.eval.start + EVAL_SPAN_CHUNKS * 1024  # over 8 chunks at most, not 10
    assert len(np.unique(starts // 1024)) >= EVAL_SPAN_CHUNKS  # spread over them


# --- stores as sources --------------------------------------------------------------------------------------


def _store(path: Path, ids: np.ndarray, vocab: int = 1000) -> Path:
    w = StoreWriter(path, vocab)
    w.add_document(ids)
    w.close()
    return path


def test_store_source_by_path_and_url(tmp_path: Path):
    path = _store(tmp_path / "store", np.arange(5000) % 1000)
    for source in (str(path), path.as_uri()):
        c = open_corpus(DataConfig(source=source, max_bytes=0), 1000, tmp_path / "cache")
        assert len(c) == 5000 and source in c.description
        np.testing.assert_array_equal(_all(c), np.arange(5000) % 1000)
    cut = open_corpus(DataConfig(source=str(path), max_bytes=1200), 1000, tmp_path / "cache")
    assert len(cut) == 1200 and cut.digest.endswith("@1200")
    assert not (tmp_path / "cache").exists()  # a store is read where it is, never copied


def test_store_vocab_over_model_vocab(tmp_path: Path):
    path = _store(tmp_path / "store", np.arange(10), vocab=50304)
    with pytest.raises(DataError) as ei:
        open_corpus(DataConfig(source=str(path)), 256, tmp_path / "cache")
    assert "50304" in str(ei.value) and "model.vocab_size" in str(ei.value)


def test_incomplete_store_refused(tmp_path: Path):
    w = StoreWriter(tmp_path / "half", 1000)
    w.add_document(np.arange(10))  # never closed: no manifest
    with pytest.raises(DataError) as ei:
        open_corpus(DataConfig(source=str(tmp_path / "half")), 1000, tmp_path / "cache")
    assert "not complete" in str(ei.value) and "manifest.json" in str(ei.value)


def test_cached_store_reused_until_the_source_changes(tmp_path: Path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"hello world " * 100)
    cache = tmp_path / "cache"
    first = store_location(DataConfig(source=str(text), max_bytes=0), cache)
    made = (Path(first) / "manifest.json").stat().st_mtime_ns
    assert store_location(DataConfig(source=str(text), max_bytes=0), cache) == first
    assert (Path(first) / "manifest.json").stat().st_mtime_ns == made  # not written again
    text.write_bytes(b"something else entirely")
    second = store_location(DataConfig(source=str(text), max_bytes=0), cache)
    assert second != first
    assert _text(open_corpus(DataConfig(source=str(text), max_bytes=0), 256, cache)) == b"something else entirely\n"
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no half-made store left behind


def test_a_text_source_with_a_trained_bpe_or_a_given_tokenizer(tmp_path: Path):
    from tokenizers import Tokenizer

    d = tmp_path / "docs"
    d.mkdir()
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20 for i in range(30)]
    for i, t in enumerate(texts):
        (d / f"{i:02}.py").write_text(t)
    bpe = open_corpus(DataConfig(source=str(d), max_bytes=0, tokenizer="bpe:300"), 300, tmp_path / "cache")
    m = bpe.store.manifest
    assert (m.tokenizer, m.vocab_size, m.documents) == ("tokenizer.json", 300, 30)
    saved = Path(bpe.store.location) / "tokenizer.json"
    tok = Tokenizer.from_file(str(saved))
    ends = bpe.store.doc_ends()
    first = _all(bpe)[: int(ends[0])]
    assert first[-1] == m.eos_id and tok.decode(first[:-1].tolist()) == texts[0]  # each document, then its eos
    assert len(bpe) < len("".join(texts))  # merges: fewer ids than bytes
    # the same tokenizer, given as a file: the same ids, a store of its own (the cache key names the tokenizer)
    given = open_corpus(DataConfig(source=str(d), max_bytes=0, tokenizer=str(saved)), 300, tmp_path / "cache")
    assert given.store.location != bpe.store.location
    np.testing.assert_array_equal(_all(given), _all(bpe))
    with pytest.raises(DataError, match="vocabulary has 300 ids"):
        open_corpus(DataConfig(source=str(d), max_bytes=0, tokenizer="bpe:300"), 256, tmp_path / "cache")
