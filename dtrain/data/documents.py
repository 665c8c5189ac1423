"""Source files as documents: what ``dtrain tokenize SRC...`` reads, in the order that defines a store.

Each SRC is a file or a folder (recursed in sorted order; hidden files and folders left out). A file's kind is
its suffix:

- ``.jsonl``, ``.jsonl.zst``: one JSON object per line, its document the string in ``field`` (blank lines are
  skipped);
- ``.parquet``: its documents are the string column ``field``, row by row;
- anything else: a text file, the whole file one document (UTF-8, unless read ``raw`` as bytes).

The documents are the files' in the order given and enumerated, then in their order inside each file. A file that
cannot be read as its kind raises :class:`~dtrain.data.corpus.DataError` naming the file (and line or row) and what is
wrong. An empty document is skipped here: it adds nothing to a store.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dtrain.data.token_store import DataError

Kind = Literal["text", "jsonl", "jsonl.zst", "parquet"]
PARQUET_BATCH_ROWS = 4096  # rows of a parquet file read at a time


@dataclass(frozen=True)
class SourceFile:
    """One file to tokenize: its path, how its documents are read, and its size in bytes (for progress)."""

    path: Path
    kind: Kind
    size: int


def kind_of(path: Path) -> Kind:
    """A file's kind from its name: ``.jsonl``, ``.jsonl.zst``, ``.parquet``, else a text file."""
    name = path.name.lower()
    if name.endswith(".jsonl.zst"):
        return "jsonl.zst"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def enumerate_sources(sources: Sequence[str | Path], plain_text: bool = False) -> list[SourceFile]:
    """The files of ``sources`` in store order: each a file, or a folder whose files (recursively, sorted by path,
    hidden ones left out) come in its place. ``plain_text``: every file is a text file, whatever its suffix.
    Raises DataError for a source that is not there, a folder with no files, or no sources at all."""
    if not sources:
        raise DataError("no sources given: name text files, .jsonl, .jsonl.zst or .parquet files, or folders")
    files: list[SourceFile] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise DataError(f"{path}: the folder holds no files")
        elif path.exists():
            found = [path]
        else:
            raise DataError(f"{path}: no such file or folder")
        for p in found:
            try:
                size = p.stat().st_size
            except OSError as e:
                raise DataError(f"{p}: cannot read: {e.strerror}") from None
            files.append(SourceFile(p, "text" if plain_text else kind_of(p), size))
    return files


def read_documents(source: SourceFile, field: str = "text", raw: bool = False) -> Iterator[str | bytes]:
    """The non-empty documents of ``source``, in order: strings, or for a text file read ``raw`` its bytes (no
    decoding at all). Raises DataError naming the file (and line or row) when it cannot be read as its kind:
    unreadable, not UTF-8, a line that is not a JSON object, a missing ``field``, a field that is not a string."""
    path = source.path
    try:
        if source.kind == "text":
            yield from _text(path, raw)
        elif source.kind == "parquet":
            yield from _parquet(path, field)
        else:
            with open(path, "rb") as f:
                if source.kind == "jsonl":
                    yield from _jsonl(path, f, field)
                else:
                    yield from _jsonl_zst(path, f, field)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _text(path: Path, raw: bool) -> Iterator[str | bytes]:
    blob = path.read_bytes()
    if not blob:
        return
    if raw:
        yield blob
        return
    try:
        yield blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}: {e.reason}); the byte tokenizer takes any "
                        "bytes") from None


def _jsonl(path: Path, lines: Any, field: str) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {number} is not UTF-8 ({e.reason})") from None
        except ValueError as e:
            raise DataError(f"{path}: line {number} is not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}: line {number} is a JSON {type(record).__name__}, not an object")
        if field not in record:
            raise DataError(f"{path}: line {number} has no field {field!r} (--field names the document text)")
        text = record[field]
        if not isinstance(text, str):
            raise DataError(f"{path}: line {number}: field {field!r} is a {type(text).__name__}, not a string")
        if text:
            yield text


def _jsonl_zst(path: Path, f: Any, field: str) -> Iterator[str]:
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as reader:
            yield from _jsonl(path, io.BufferedReader(reader), field)
    except zstandard.ZstdError as e:
        raise DataError(f"{path}: not a valid zstd stream ({e})") from None


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: not a parquet file ({e})") from None
    schema = file.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (it has {', '.join(schema.names) or 'none'}; --field names "
                        "the document text)")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {field!r} is {column_type}, not a string")
    row = 0
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    raise DataError(f"{path}: row {row}: column {field!r} is null, not a string")
                if text:
                    yield text
    except pa.ArrowException as e:
        raise DataError(f"{path}: reading row {row + 1} failed ({e})") from None


def fingerprint(files: Sequence[SourceFile]) -> list[tuple[str, int, int]]:
    """Each file's absolute path, size and modification time (ns): what says a resumed run reads the same files."""
    out = []
    for f in files:
        try:
            stat = f.path.stat()
        except OSError as e:
            raise DataError(f"{f.path}: cannot read: {e.strerror}") from None
        out.append((os.path.abspath(f.path), stat.st_size, stat.st_mtime_ns))
    return out
