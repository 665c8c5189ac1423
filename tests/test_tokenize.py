"""dtrain tokenize: every source kind into a token store, the byte tokenizer as ``dtrain.data.corpus`` reads bytes, a
trained or given BPE, parallel equal to serial, resuming a killed run to the same store, bad files named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dtrain.data import tokenize as tokenize_module
from dtrain.data.corpus import DataError, builtin_files
from dtrain.data.documents import enumerate_sources
from dtrain.data.token_store import MANIFEST, StoreError, TokenStore
from dtrain.data.tokenize import JOURNAL, tokenize
from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from dtrain_cli.tokenize import TEST_EXIT_AFTER_FILES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["the first document\nwith two lines", "zweites Dokument: ä ö ü ß", "", "a third one, <|endoftext|> inside",
        "🙂 emoji and tabs\t\t end"]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _corpus(root: Path) -> Path:
    """A folder of every kind: text files, .jsonl, .jsonl.zst, .parquet, and a hidden file left out."""
    root.mkdir()
    (root / "a.txt").write_text(DOCS[0])
    (root / "b" / "c").mkdir(parents=True)
    _jsonl(root / "b" / "c" / "d.jsonl", DOCS[1:3])
    (root / "b" / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        _jsonl(root / "tmp.jsonl", DOCS[3:]).read_bytes()))
    (root / "tmp.jsonl").unlink()
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), root / "f.parquet")
    (root / ".hidden.txt").write_text("never read")
    (root / "empty.txt").write_text("")
    return root


# the documents of _corpus in store order (empty ones add nothing)
CORPUS_DOCS = [DOCS[0], DOCS[1], DOCS[3], DOCS[4], *[d for d in DOCS if d]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    root = _corpus(tmp_path_factory.mktemp("bpe") / "corpus")
    return train_bpe(enumerate_sources([root]), 300)


def _ids(store: TokenStore) -> np.ndarray:
    return store.read(0, len(store))


def _documents(store: TokenStore) -> list[np.ndarray]:
    ends = store.doc_ends().astype(np.int64)
    return np.split(_ids(store), ends[:-1]) if ends.size else []


def test_enumeration_follows_the_order_given_then_sorted_paths(tmp_path: Path) -> None:
    root = _corpus(tmp_path / "c")
    files = enumerate_sources([root / "f.parquet", root])
    assert [(f.path.relative_to(root).as_posix(), f.kind) for f in files] == [
        ("f.parquet", "parquet"), ("a.txt", "text"), ("b/c/d.jsonl", "jsonl"), ("b/e.jsonl.zst", "jsonl.zst"),
        ("empty.txt", "text"), ("f.parquet", "parquet")]
    assert [f.kind for f in enumerate_sources([root], plain_text=True)] == ["text"] * 5
    for bad, match in [([tmp_path / "nope"], "no such file or folder"), ([], "no sources given")]:
        with pytest.raises(DataError, match=match):
            enumerate_sources(bad)
    (tmp_path / "void").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        enumerate_sources([tmp_path / "void"])


def test_every_kind_with_a_trained_bpe_decodes_back_to_its_documents(tmp_path: Path, bpe: HFTokenizer) -> None:
    root = _corpus(tmp_path / "c")
    manifest, stats = tokenize([root], tmp_path / "s", bpe, workers=1)
    store = TokenStore.open(tmp_path / "s")
    assert manifest.tokenizer == "tokenizer.json" and manifest.eos_id == bpe.eos_id == 0
    assert (tmp_path / "s" / "tokenizer.json").read_text() == bpe.json_text
    assert (stats.files, stats.skipped, manifest.documents) == (5, (), len(CORPUS_DOCS))
    docs = _documents(store)
    for ids, text in zip(docs, CORPUS_DOCS, strict=True):
        assert ids[-1] == bpe.eos_id and bpe.eos_id not in ids[:-1]  # one eos, last; the literal one is text
        assert bpe.tokenizer.decode(ids[:-1].tolist()) == text
    store.verify()
    assert not (tmp_path / "s" / JOURNAL).exists()


def test_training_is_deterministic_and_needs_room_for_the_bytes(tmp_path: Path, bpe: HFTokenizer) -> None:
    files = enumerate_sources([_corpus(tmp_path / "c")])
    assert train_bpe(files, 300).json_text == bpe.json_text
    with pytest.raises(DataError, match="at least 257 ids"):
        train_bpe(files, 256)


def test_a_given_tokenizer_json_is_copied_into_the_store(tmp_path: Path, bpe: HFTokenizer) -> None:
    bpe.tokenizer.save(str(tmp_path / "tok.json"))
    given = HFTokenizer.from_file(tmp_path / "tok.json")  # eos found by name
    assert given.eos_id == bpe.eos_id
    tokenize([_jsonl(tmp_path / "d.jsonl", DOCS)], tmp_path / "s", given, workers=1)
    assert (tmp_path / "s" / "tokenizer.json").read_text() == (tmp_path / "tok.json").read_text()
    store = TokenStore.open(tmp_path / "s")
    assert store.doc_ends().tolist() == np.cumsum([len(bpe.tokenizer.encode(d).ids) + 1 for d in DOCS if d]).tolist()
    with pytest.raises(DataError, match="no end-of-document token '<bos>'"):
        HFTokenizer.from_file(tmp_path / "tok.json", eos="<bos>")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "bad.json")


def test_a_tokenizer_without_a_known_eos_must_be_told_one(tmp_path: Path, bpe: HFTokenizer) -> None:
    text = bpe.json_text.replace("<|endoftext|>", "<|sep|>")
    with pytest.raises(DataError, match="name its end-of-document token with --eos"):
        HFTokenizer(text)
    assert HFTokenizer(text, eos="<|sep|>").eos_id == 0


@pytest.mark.parametrize("limit", [0, 1, 5_000, 12_345, 10**9])
def test_the_byte_tokenizer_reads_each_file_then_a_newline_cut_at_the_limit(tmp_path: Path, limit: int) -> None:
    """What a text source's first use (dtrain.data.corpus) relies on: each non-empty file's bytes and b"\\n", in order,
    the limit cutting the last document exactly (the ids the in-memory reader before token stores produced)."""
    files = builtin_files()[:40]
    manifest, _ = tokenize(files, tmp_path / "s", ByteTokenizer(), limit=limit, plain_text=True, workers=1)
    store = TokenStore.open(tmp_path / "s")
    expected = b"".join(f.read_bytes() + b"\n" for f in files if f.stat().st_size)
    assert _ids(store).astype(np.uint8).tobytes() == (expected[:limit] if limit else expected)
    assert (manifest.tokenizer, manifest.vocab_size, manifest.eos_id) == ("bytes", 256, 10)
    ends = store.doc_ends()
    assert ends[-1] == len(store) and np.all(np.diff(ends) > 0)


def test_the_byte_tokenizer_takes_any_bytes(tmp_path: Path) -> None:
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    tokenize([tmp_path / "bin.txt"], tmp_path / "s", ByteTokenizer(), workers=1)
    assert _ids(TokenStore.open(tmp_path / "s")).astype(np.uint8).tobytes() == b"\xff\xfe\x00 not utf-8\n"


def test_parallel_equals_serial(tmp_path: Path, bpe: HFTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenize_module, "POOL_MIN_BYTES", 0)  # tiny files: a pool anyway
    root = _corpus(tmp_path / "c")
    seen: list[tuple[int, ...]] = []
    serial, _ = tokenize([root], tmp_path / "serial", bpe, workers=1)
    parallel, stats = tokenize([root], tmp_path / "parallel", bpe, workers=2, progress=lambda *a: seen.append(a))
    assert serial == parallel and stats.files == 5
    assert np.array_equal(_ids(TokenStore.open(tmp_path / "serial")), _ids(TokenStore.open(tmp_path / "parallel")))
    assert seen[-1][0] == seen[-1][1] and seen[-1][2:] == (parallel.documents, parallel.tokens, 5, 5)


def test_an_interrupted_run_resumes_in_process(tmp_path: Path, bpe: HFTokenizer) -> None:
    """Stopped by an error right after a commit, the next run goes on from the journal to the same store; one
    with other arguments is refused, naming the difference."""
    root = _corpus(tmp_path / "c")
    whole, _ = tokenize([root], tmp_path / "whole", bpe, workers=1)

    def stop(journal: tokenize_module.Journal) -> None:
        if journal.files_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tokenize([root], tmp_path / "s", bpe, workers=1, commit_every_s=0, on_commit=stop)
    with pytest.raises(StoreError, match="is not complete: it has no manifest.json"):
        TokenStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match=r"other arguments is there \(--field differ\)"):
        tokenize([root], tmp_path / "s", bpe, field="body", workers=1)
    with pytest.raises(StoreError, match=r"the tokenizer differ"):
        tokenize([root], tmp_path / "s", ByteTokenizer(), workers=1)
    manifest, stats = tokenize([root], tmp_path / "s", bpe, workers=1)
    assert manifest == whole and stats.resumed_files == 2
    assert np.array_equal(_ids(TokenStore.open(tmp_path / "s")), _ids(TokenStore.open(tmp_path / "whole")))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain_cli", "tokenize", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_a_killed_dtrain_tokenize_run_again_writes_the_same_store(tmp_path: Path) -> None:
    """A real process, exiting abruptly (status 137, as SIGKILL) once 3 files are committed; run again it
    finishes the store; the store, its document ends and its manifest are an uninterrupted run's."""
    root = tmp_path / "c"
    root.mkdir()
    for i in range(6):
        _jsonl(root / f"{i}.jsonl", [f"doc {i}.{k} " + "words " * (i * k) for k in range(20)])
    args = [str(root), "--vocab-size", "280", "--workers", "2"]
    killed = _cli(*args, "--out", str(tmp_path / "s"), env={TEST_EXIT_AFTER_FILES: "3"})
    assert killed.returncode == 137, killed.stderr
    journal = json.loads((tmp_path / "s" / JOURNAL).read_text())
    assert journal["files_done"] == 3 and not (tmp_path / "s" / MANIFEST).exists()
    with pytest.raises(StoreError, match="is not complete: it has no manifest.json"):
        TokenStore.open(tmp_path / "s")
    again = _cli(*args, "--out", str(tmp_path / "s"))
    assert again.returncode == 0, again.stderr
    assert "resumed after 3" in again.stdout and "resuming" in again.stderr
    whole = _cli(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    a, b = TokenStore.open(tmp_path / "s"), TokenStore.open(tmp_path / "whole")
    assert a.manifest == b.manifest and np.array_equal(_ids(a), _ids(b))
    assert np.array_equal(a.doc_ends(), b.doc_ends()) and a.manifest.documents == 120
    assert (tmp_path / "s" / MANIFEST).read_text() == (tmp_path / "whole" / MANIFEST).read_text()
    summary = whole.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("tokenize: ") and b.manifest.digest in summary[0]


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of bad file, and what its line says."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (bad / "json.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (bad / "field.jsonl").write_text('{"text": "fine"}\n\n{"body": "x"}\n')
    (bad / "type.jsonl").write_text('{"text": 7}\n')
    (bad / "array.jsonl").write_text('["text"]\n')
    pq.write_table(pa.table({"body": ["x"]}), bad / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), bad / "intcol.parquet")
    (bad / "fake.parquet").write_text("not parquet")
    (bad / "fake.jsonl.zst").write_bytes(b"not zstd at all")
    (bad / "unreadable.txt").write_text("secret")
    (bad / "unreadable.txt").chmod(0)
    return {
        "latin1": (bad / "latin1.txt", "latin1.txt: not UTF-8 (byte 3: unexpected end of data)"),
        "json": (bad / "json.jsonl", "json.jsonl: line 2 is not valid JSON"),
        "field": (bad / "field.jsonl", "field.jsonl: line 3 has no field 'text'"),
        "type": (bad / "type.jsonl", "type.jsonl: line 1: field 'text' is a int, not a string"),
        "array": (bad / "array.jsonl", "array.jsonl: line 1 is a JSON list, not an object"),
        "nocol": (bad / "nocol.parquet", "nocol.parquet: no column 'text' (it has body"),
        "intcol": (bad / "intcol.parquet", "intcol.parquet: column 'text' is int64, not a string"),
        "fake": (bad / "fake.parquet", "fake.parquet: not a parquet file"),
        "zst": (bad / "fake.jsonl.zst", "fake.jsonl.zst: not a valid zstd stream"),
        "unreadable": (bad / "unreadable.txt", "unreadable.txt: cannot read: Permission denied"),
    }


def test_an_unreadable_file_is_named(tmp_path: Path, bpe: HFTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    path, why = _bad_files(tmp_path)["unreadable"]
    if os.geteuid() == 0:  # root reads a file of mode 000: the read fails as it would for anyone else
        def refuse(self: Path) -> bytes:
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(DataError, match=why):
        tokenize([path], tmp_path / "s", bpe, workers=1)
    with pytest.raises(DataError, match=r"every one of the 1 files was bad and skipped \(--skip-bad\): nothing to "
                       rf"store; the first: {path}: cannot read"):  # never an empty store, exit 0
        tokenize([path], tmp_path / "s", bpe, workers=1, skip_bad=True)
    _jsonl(tmp_path / "good.jsonl", DOCS)
    manifest, stats = tokenize([path, tmp_path / "good.jsonl"], tmp_path / "s", bpe, workers=1, skip_bad=True)
    assert manifest.documents == 4 and stats.skipped[0].path == str(path)


@pytest.mark.parametrize("case", ["latin1", "json", "field", "type", "array", "nocol", "intcol", "fake", "zst"])
def test_a_bad_file_is_named_and_skip_bad_skips_it(tmp_path: Path, bpe: HFTokenizer, case: str) -> None:
    path, why = _bad_files(tmp_path)[case]
    with pytest.raises(DataError, match=f"^{path.parent}/{why.replace('(', '.').replace(')', '.')}"):
        tokenize([path], tmp_path / "s", bpe, workers=1)
    _jsonl(tmp_path / "good.jsonl", DOCS)
    manifest, stats = tokenize([tmp_path / "good.jsonl", path], tmp_path / "s", bpe, workers=1, skip_bad=True)
    assert [s.path for s in stats.skipped] == [str(path)] and why in stats.skipped[0].reason
    assert stats.files == 2 and manifest.documents == len([d for d in DOCS if d])


def test_bad_input_through_the_command_line_is_one_line(tmp_path: Path, bpe: HFTokenizer) -> None:
    """Every bad input: one line on stderr naming it, a non-zero exit, no traceback; --skip-bad counts it."""
    bpe.tokenizer.save(str(tmp_path / "tok.json"))
    bad = _bad_files(tmp_path)
    good = _jsonl(tmp_path / "good.jsonl", DOCS)
    cases = [([str(bad["json"][0]), "--tokenizer", str(tmp_path / "tok.json")], 1, bad["json"][1]),
             ([str(bad["nocol"][0]), "--tokenizer", "bytes"], 1, bad["nocol"][1]),
             ([str(good)], 2, "no tokenizer: give --tokenizer FILE"),
             ([str(good), "--tokenizer", str(tmp_path / "nope.json")], 1, "cannot read the tokenizer"),
             ([str(good), "--tokenizer", "bytes", "--eos", "</s>"], 2, "--eos names the end-of-document token"),
             ([str(good), "--tokenizer", "bytes", "--vocab-size", "300"], 2, "not allowed with argument"),
             ([str(good), "--vocab-size", "100"], 2, "a byte-level BPE needs at least 257 ids"),
             ([str(tmp_path / "missing"), "--tokenizer", "bytes"], 1, "no such file or folder"),
             ([str(tmp_path), "--tokenizer", "bytes"], 1, "is inside the source folder")]
    for args, code, why in cases:
        out = tmp_path / "out" if "is inside" not in why else tmp_path / "out-inside"
        result = _cli(*args, "--out", str(out), "--quiet")
        assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and why in result.stderr, result.stderr
        assert result.stderr.startswith("dtrain tokenize: ") and result.stdout == ""
    loud = _cli(*cases[0][0], "--out", str(tmp_path / "out"))  # progress lines above it, then the one line
    assert loud.returncode == 1 and loud.stderr.strip().splitlines()[-1].startswith("dtrain tokenize: error: ")
    assert sum(line.startswith("dtrain tokenize") for line in loud.stderr.splitlines()) == 1
    skipped = _cli(str(good), str(bad["json"][0]), "--tokenizer", str(tmp_path / "tok.json"), "--skip-bad",
                   "--out", str(tmp_path / "out"))
    assert skipped.returncode == 0 and "Traceback" not in skipped.stderr, skipped.stderr
    assert "2 files, 1 skipped" in skipped.stdout and f"skipping {bad['json'][0]}: line 2" in skipped.stderr
    again = _cli(str(good), "--tokenizer", "bytes", "--out", str(tmp_path / "out"))
    assert again.returncode == 1 and "exists already" in again.stderr and len(again.stderr.splitlines()) == 1


def test_a_worker_process_that_dies_is_one_error_naming_what_to_do(tmp_path: Path, bpe: HFTokenizer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool worker killed (the OOM killer) breaks the pool: a DataError saying what happened and how to go on,
    the files committed before it kept."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    class DeadPool:  # what ProcessPoolExecutor's futures raise once one of its processes was killed
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def submit(self, *args: object) -> Future[object]:
            f: Future[object] = Future()
            f.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
            return f

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    monkeypatch.setattr(tokenize_module, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(tokenize_module, "ProcessPoolExecutor", DeadPool)
    with pytest.raises(DataError, match=r"a tokenizer worker process died .* fewer --workers"):
        tokenize([_corpus(tmp_path / "c")], tmp_path / "s", bpe, workers=2)
    with pytest.raises(StoreError, match="not complete"):
        TokenStore.open(tmp_path / "s")
