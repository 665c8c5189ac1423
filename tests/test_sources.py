"""What ``dtrain tokenize`` and ``data.source`` read: compressed files, Hugging Face ``datasets`` folders and hub
names, ``.jsonl``/``.parquet`` as a data source; and how a run with nothing good, a too-small model vocabulary,
or an interruption ends."""

from __future__ import annotations

import gzip
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

from dtrain.config.sections import DataConfig
from dtrain.data.corpus import DataError, open_corpus
from dtrain.data.documents import enumerate_sources, read_documents
from dtrain.data.token_store import TokenStore
from dtrain.data.tokenize import tokenize
from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from dtrain_cli.tokenize import TEST_INTERRUPT_AFTER_FILES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["first document", "zweites: ä ö ü", "", "a third, <|endoftext|> inside", "🙂 and tabs\t end"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain_cli", "tokenize", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _documents(store: Path) -> list[bytes]:
    """A byte-tokenized store's documents, each without its end-of-document newline."""
    opened = TokenStore.open(store)
    ids = opened.read(0, len(opened)).astype(np.uint8).tobytes()
    ends = [0, *opened.doc_ends().astype(int).tolist()]
    return [ids[a:b - 1] for a, b in zip(ends, ends[1:], strict=False)]


def _jsonl(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: d}) + "\n" for d in docs).encode()


def test_gz_and_zst_files_are_read_and_compressed_columns_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS[:2])))
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS[2:4])))
    (root / "c.txt.gz").write_bytes(gzip.compress(DOCS[4].encode()))
    (root / "d.md.zst").write_bytes(zstandard.ZstdCompressor().compress(b"zstd text"))
    assert [f.kind for f in enumerate_sources([root])] == ["jsonl.gz", "jsonl.zst", "text.gz", "text.zst"]
    tokenize([root], tmp_path / "s", ByteTokenizer(), workers=1)
    assert _documents(tmp_path / "s") == [d.encode() for d in DOCS if d] + [b"zstd text"]
    (root / "e.parquet.gz").write_bytes(b"anything")
    with pytest.raises(DataError, match=r"e.parquet.gz: a compressed parquet file; it compresses its own columns"):
        enumerate_sources([root])
    (root / "e.parquet.gz").unlink()
    (root / "f.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS))[:-9])  # cut short
    with pytest.raises(DataError, match="f.jsonl.gz: not a valid gzip stream"):
        list(read_documents(enumerate_sources([root / "f.jsonl.gz"])[0]))


def test_datasets_folders_are_read_with_field(tmp_path: Path) -> None:
    """A save_to_disk folder (a Dataset's, a DatasetDict's train split) and a folder of the parquet files
    to_parquet writes: the column --field names, in order, through the command line too."""
    import datasets

    datasets.disable_progress_bars()
    texts = [f"row {i}: " + "words " * (i % 7) for i in range(300)] + ["", "last"]
    table = datasets.Dataset.from_dict({"body": texts, "n": list(range(len(texts)))})
    table.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    datasets.DatasetDict({"test": table.select(range(5)), "train": table}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "parquet").mkdir()
    for i in range(2):
        table.shard(2, i, contiguous=True).to_parquet(str(tmp_path / "parquet" / f"train-{i:05d}.parquet"))
    want = [t.encode() for t in texts if t]
    for name in ["saved", "dict", "parquet"]:
        tokenize([tmp_path / name], tmp_path / f"s-{name}", ByteTokenizer(), field="body", workers=1)
        assert _documents(tmp_path / f"s-{name}") == want, name
    assert [f.path.name for f in enumerate_sources([tmp_path / "saved"])] == [
        f"data-0000{i}-of-00003.arrow" for i in range(3)]  # never its state.json or dataset_info.json
    cli = _cli(str(tmp_path / "saved"), "--field", "body", "--tokenizer", "bytes", "--out", str(tmp_path / "s-cli"))
    assert cli.returncode == 0, cli.stderr
    assert _documents(tmp_path / "s-cli") == want
    wrong = _cli(str(tmp_path / "saved"), "--tokenizer", "bytes", "--out", str(tmp_path / "s-wrong"), "--quiet")
    assert wrong.returncode == 1 and "no column 'text' (it has body, n; --field names the document text)" \
        in wrong.stderr and len(wrong.stderr.strip().splitlines()) == 1
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(DataError, match=r"a DatasetDict with no train split \(it has test\): name a split's folder"):
        enumerate_sources([tmp_path / "no-train"])


def test_a_hub_name_without_a_network_is_one_line_at_once(tmp_path: Path) -> None:
    # a hub that does not answer (a closed port on this machine): no retries for minutes
    closed = _cli("hf:someone/corpus", "--tokenizer", "bytes", "--out", str(tmp_path / "s"),
                  env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert closed.returncode == 1 and closed.stderr.strip().splitlines() == [
        "dtrain tokenize: error: hf:someone/corpus: the Hugging Face hub (127.0.0.1) cannot be reached from here "
        "(Connection refused): download the dataset where it can (datasets' save_to_disk, or its parquet files) "
        "and give its folder"]
    offline = _cli("hf:someone/corpus", "--tokenizer", "bytes", "--out", str(tmp_path / "s"),
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert offline.returncode == 1 and len(offline.stderr.strip().splitlines()) == 1
    assert offline.stderr.startswith("dtrain tokenize: error: hf:someone/corpus: cannot fetch it from the Hugging "
                                     "Face hub: ")


def test_jsonl_and_parquet_as_data_source_are_tokenized_as_documents(tmp_path: Path) -> None:
    """Not as raw JSON text: the store holds the field's documents, as `dtrain tokenize` writes them."""
    (tmp_path / "corpus.jsonl").write_bytes(_jsonl(DOCS))
    corpus = open_corpus(DataConfig(source=str(tmp_path / "corpus.jsonl"), max_bytes=0), 256, tmp_path / "cache")
    assert _documents(Path(corpus.store.location)) == [d.encode() for d in DOCS if d]
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"text": DOCS}), folder / "a.parquet")
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(["more"])))
    corpus = open_corpus(DataConfig(source=str(folder), max_bytes=0), 256, tmp_path / "cache")
    assert _documents(Path(corpus.store.location)) == [d.encode() for d in DOCS if d] + [b"more"]
    assert "the documents of 2 files" in corpus.description


def test_a_tokenizer_larger_than_the_model_is_refused_before_tokenizing(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_bytes(_jsonl(DOCS * 50))
    bpe = train_bpe(enumerate_sources([tmp_path / "corpus.jsonl"]), 300)
    bpe.tokenizer.save(str(tmp_path / "tok.json"))
    cache = tmp_path / "cache"
    for tokenizer, ids in [(str(tmp_path / "tok.json"), 300), ("bpe:5000", 5000), ("bytes", 256)]:
        with pytest.raises(DataError, match=rf"data.tokenizer '{tokenizer}' has {ids:,} ids, more than "
                                            rf"model.vocab_size 200: set model.vocab_size >= {ids} \(refused before"):
            open_corpus(DataConfig(source=str(tmp_path / "corpus.jsonl"), tokenizer=tokenizer, max_bytes=0), 200,
                        cache)
    assert not cache.exists() or not any(cache.iterdir())  # nothing trained, nothing tokenized
    assert isinstance(HFTokenizer.from_file(tmp_path / "tok.json"), HFTokenizer)


def test_skip_bad_with_nothing_good_left_fails(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": oops}\n')
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    result = _cli(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--tokenizer", "bytes", "--skip-bad",
                  "--out", str(tmp_path / "s"), "--quiet")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith(
        "dtrain tokenize: error: every one of the 2 files was bad and skipped (--skip-bad): nothing to store; the "
        f"first: {tmp_path / 'a.jsonl'}: line 1 is not valid JSON")


def test_an_interrupted_or_failed_run_says_the_command_that_continues_it(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    for i in range(5):
        (root / f"{i}.jsonl").write_bytes(_jsonl([f"doc {i}.{k}" for k in range(4)]))
    out = tmp_path / "s"
    stopped = _cli(str(root), "--tokenizer", "bytes", "--out", str(out), "--overwrite", "--workers", "1",
                   env={TEST_INTERRUPT_AFTER_FILES: "2"})
    assert stopped.returncode == 130, stopped.stderr
    hint, last = stopped.stderr.strip().splitlines()[-2:]
    command = f"dtrain tokenize {root} --out {out} --tokenizer bytes --workers 1"  # no --overwrite: it continues
    assert hint == f"dtrain tokenize: interrupted: 2 of 5 files are committed in {out}; to continue: {command}"
    assert last == "dtrain tokenize: interrupted"
    (root / "3.jsonl").write_text('{"text": 7}\n')  # a failure after more commits
    failed = _cli(*command.split()[2:], env={TEST_INTERRUPT_AFTER_FILES: "99"})
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-2:] == [
        f"dtrain tokenize: stopped: 3 of 5 files are committed in {out}; to continue: {command}",
        f"dtrain tokenize: error: {root / '3.jsonl'}: line 1: field 'text' is a int, not a string"]
    (root / "3.jsonl").write_bytes(_jsonl(["doc 3.0"]))
    done = _cli(*command.split()[2:])
    assert done.returncode == 0 and "resumed after 3" in done.stdout, done.stderr
    assert _documents(out) == [f"doc {i}.{k}".encode() for i in range(5) for k in range(4 if i != 3 else 1)]
