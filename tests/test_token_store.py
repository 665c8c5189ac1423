"""dtrain.data.token_store: a tokenized corpus as TensorStore arrays and a manifest, written once, read by range."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import token_store as token_store
from dtrain.data.token_store import (
    DOC_ENDS,
    FORMAT,
    MANIFEST,
    TOKENS,
    ChainDigest,
    StoreError,
    StoreWriter,
    TokenStore,
    dtype_for,
    kvstore_spec,
)


def _docs(vocab: int, n_docs: int = 7, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 300))) for _ in range(n_docs)]


def _write(path: Path, docs: list[np.ndarray], vocab: int, chunk: int = 64, **kw) -> StoreWriter:
    w = StoreWriter(path, vocab, chunk_tokens=chunk, **kw)
    for d in docs:
        w.add_document(d)
    return w


@pytest.mark.parametrize("vocab", [256, 1 << 16, 50_304 * 2])
def test_a_store_reads_back_what_was_written_by_any_range(tmp_path: Path, vocab: int) -> None:
    docs = _docs(vocab)
    manifest = _write(tmp_path / "s", docs, vocab).close()
    allids = np.concatenate(docs)
    store = TokenStore.open(tmp_path / "s")
    assert store.manifest == manifest and manifest.format == FORMAT
    assert manifest.dtype == ("uint16" if vocab <= 65536 else "uint32") and len(store) == allids.size
    assert manifest.documents == len(docs)
    assert np.array_equal(store.doc_ends(), np.cumsum([d.size for d in docs]))
    for start, stop in [(0, allids.size), (0, 1), (63, 65), (100, 300), (allids.size, allids.size)]:
        got = store.read(start, stop)
        assert got.dtype == np.dtype(manifest.dtype) and np.array_equal(got, allids[start:stop])
    store.verify()


def test_the_digest_is_of_the_ids_and_verify_finds_a_changed_chunk(tmp_path: Path) -> None:
    docs = _docs(256)
    m1 = _write(tmp_path / "a", docs, 256, chunk=64).close()
    m2 = _write(tmp_path / "b", docs, 256, chunk=1000).close()  # other chunking, the same ids: the same digest
    assert m1.digest == m2.digest and m1.digest.startswith("sha256-chain:")
    # a chunk of store a replaced by the same chunk of a store of other ids: the digest check fails
    other = [d[::-1] for d in docs]
    _write(tmp_path / "c", other, 256, chunk=64).close()
    shutil.copy(tmp_path / "c" / TOKENS / "c" / "0", tmp_path / "a" / TOKENS / "c" / "0")
    with pytest.raises(StoreError, match="do not match the manifest's digest"):
        TokenStore.open(tmp_path / "a").verify()


def test_the_digest_is_a_sha256_chain_over_blocks_of_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The definition, spelled out with hashlib: h = 32 zero bytes, then h = sha256(h + block) per block of
    DIGEST_BLOCK ids (little-endian, the store's dtype; the last block shorter); fed in any pieces, the same."""
    monkeypatch.setattr(token_store, "DIGEST_BLOCK", 10)
    ids = np.arange(37, dtype="<u2")
    h = bytes(32)
    for start in range(0, ids.size, 10):
        h = hashlib.sha256(h + ids[start:start + 10].tobytes()).digest()
    for pieces in ([37], [3, 7, 10, 17], [20, 17], [1] * 37):
        d = ChainDigest(2)
        for piece in np.split(ids, np.cumsum(pieces)[:-1]):
            d.update(piece.tobytes())
        assert d.digest() == "sha256-chain:" + h.hex()
    assert ChainDigest(2).digest() == "sha256-chain:" + bytes(32).hex()  # no ids: no link


@pytest.mark.parametrize("extra", [0, 1, 150])
def test_a_writer_resumes_from_its_commit_to_the_same_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           extra: int) -> None:
    """Interrupted after a commit (and after writing ``extra`` more ids it never committed), a writer given the
    commit goes on to the store an uninterrupted one writes: the same ids, document ends and digest."""
    monkeypatch.setattr(token_store, "DIGEST_BLOCK", 50)  # commits fall inside a digest block and across them
    docs = _docs(1000, n_docs=12)
    whole = _write(tmp_path / "whole", docs, 1000).close()
    first = _write(tmp_path / "s", docs[:5], 1000)
    at = first.commit()
    assert (at.tokens, at.documents) == (sum(d.size for d in docs[:5]), 5)
    first.add_document(np.arange(extra) % 1000)
    first.commit()  # written past what the journal will say, then killed
    again = StoreWriter(tmp_path / "s", 1000, resume=at)
    assert (again.tokens, again.documents) == (at.tokens, at.documents)
    for d in docs[5:]:
        again.add_document(d)
    assert again.close() == whole
    store = TokenStore.open(tmp_path / "s")
    assert np.array_equal(store.read(0, len(store)), np.concatenate(docs))
    assert np.array_equal(store.doc_ends(), np.cumsum([d.size for d in docs]))
    store.verify()


def test_a_resume_that_does_not_fit_the_store_is_refused(tmp_path: Path) -> None:
    w = _write(tmp_path / "s", _docs(256, n_docs=2), 256)
    at = w.commit()
    with pytest.raises(StoreError, match="fewer than the"):
        StoreWriter(tmp_path / "s", 256, resume=token_store.Committed(at.tokens + 1, at.documents, at.chain))
    with pytest.raises(StoreError, match="begun with another tokenizer"):
        StoreWriter(tmp_path / "s", 100_000, resume=at)


def test_many_documents_at_once_are_many_documents(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path / "s", 300, chunk_tokens=4)
    w.add_documents(np.arange(10), np.array([3, 0, 7]))
    w.add_document(np.array([299]))
    with pytest.raises(StoreError, match="do not add up"):
        w.add_documents(np.arange(4), np.array([1, 2]))
    w.close()
    store = TokenStore.open(tmp_path / "s")
    assert store.doc_ends().tolist() == [3, 3, 10, 11] and store.read(9, 11).tolist() == [9, 299]


def test_opening_reads_the_manifest_and_metadata_only(tmp_path: Path) -> None:
    """With every chunk of ids gone, the store still opens (nothing of the ids is read); a read then fails,
    naming the range (a missing chunk is an error, never a run of zeros)."""
    _write(tmp_path / "s", _docs(256), 256).close()
    shutil.rmtree(tmp_path / "s" / TOKENS / "c")
    store = TokenStore.open(tmp_path / "s")
    assert len(store) > 0
    with pytest.raises(StoreError, match=r"reading ids \[0, 10\) failed"):
        store.read(0, 10)


def test_an_incomplete_store_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    w = _write(tmp_path / "s", _docs(256), 256)  # never closed: an interrupted write
    assert w.tokens > 0
    with pytest.raises(StoreError, match=r"is not complete: it has no manifest.json"):
        TokenStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match="is not complete"):
        TokenStore.open(tmp_path / "nothing-here")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda m: m.update(format="other/9"), "this dtrain reads"),
    (lambda m: m.update(tokens=m["tokens"] + 1), "its manifest says"),
    (lambda m: m.update(documents=m["documents"] + 1), "document ends"),
    (lambda m: m.update(dtype="uint32"), "does not add up"),
    (lambda m: m.update(vocab_size="many"), "vocab_size"),
    (lambda m: m.pop("digest"), "digest"),
])
def test_a_manifest_that_does_not_match_is_refused(tmp_path: Path, edit, match: str) -> None:
    _write(tmp_path / "s", _docs(256), 256).close()
    path = tmp_path / "s" / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=match):
        TokenStore.open(tmp_path / "s")


def test_a_damaged_manifest_or_array_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "s", _docs(256), 256).close()
    (tmp_path / "s" / MANIFEST).write_text("{not json")
    with pytest.raises(StoreError, match="is not a manifest"):
        TokenStore.open(tmp_path / "s")
    _write(tmp_path / "t", _docs(256), 256).close()
    shutil.rmtree(tmp_path / "t" / DOC_ENDS)
    with pytest.raises(StoreError, match="doc_ends array cannot be opened"):
        TokenStore.open(tmp_path / "t")


def test_the_writer_refuses_bad_ids_and_an_existing_store(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path / "s", 100)
    for bad, match in [(np.array([5, 100]), "id 100 is outside the vocabulary of 100"),
                       (np.array([-1]), "id -1 is outside"), (np.zeros((2, 2), int), "1-D array"),
                       (np.array([0.5]), "integer ids")]:
        with pytest.raises(StoreError, match=match):
            w.add_document(bad)
    assert w.tokens == 0  # nothing of a refused document was kept
    w.add_document(np.array([1, 2, 3]))
    w.close()
    with pytest.raises(StoreError, match="closed"):
        w.add_document(np.array([1]))
    with pytest.raises(StoreError, match="exists already"):
        StoreWriter(tmp_path / "s", 100)
    StoreWriter(tmp_path / "s", 100, overwrite=True).close()  # an empty store, replacing it
    assert len(TokenStore.open(tmp_path / "s")) == 0
    with pytest.raises(StoreError, match="eos_id 100"):
        StoreWriter(tmp_path / "u", 100, eos_id=100)
    with pytest.raises(StoreError, match="outside its"):
        TokenStore.open(tmp_path / "s").read(0, 1)


def test_locations_map_to_kvstores() -> None:
    assert kvstore_spec("gs://bucket/corpora/web") == {"driver": "gcs", "bucket": "bucket", "path": "corpora/web/"}
    assert kvstore_spec("s3://b/x/") == {"driver": "s3", "bucket": "b", "path": "x/"}
    assert kvstore_spec("http://127.0.0.1:8000/s") == {"driver": "http", "base_url": "http://127.0.0.1:8000/s/"}
    assert kvstore_spec("file:///tmp/s")["path"] == "/tmp/s/"
    for bad, match in [("ftp://h/s", "unknown scheme 'ftp'"), ("gs:///path", "no bucket")]:
        with pytest.raises(StoreError, match=match):
            kvstore_spec(bad)
    assert dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """tmp_path served read-only over HTTP on 127.0.0.1 (a store's remote path, without a cloud account)."""
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def test_a_store_is_read_over_http(served: tuple[str, Path]) -> None:
    url, root = served
    docs = _docs(1000)
    manifest = _write(root / "store", docs, 1000).close()
    store = TokenStore.open(f"{url}/store")
    assert store.manifest == manifest
    assert np.array_equal(store.read(10, 200), np.concatenate(docs)[10:200])
    store.verify()
    with pytest.raises(StoreError, match="is not complete"):
        TokenStore.open(f"{url}/no-store")
