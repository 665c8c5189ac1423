"""Source files as documents: what ``dtrain tokenize SRC...`` reads, in the order that defines a store.

Each SRC is a file, a folder (recursed in sorted order; hidden files and folders left out), or ``hf:NAME``, a
dataset on the Hugging Face hub (:func:`hub_files`). A file's kind is its suffix:

- ``.jsonl`` (also ``.jsonl.gz``, ``.jsonl.zst``): one JSON object per line, its document the string in ``field``
  (blank lines are skipped);
- ``.parquet``, and ``.arrow`` (the Arrow stream files a ``datasets`` ``save_to_disk`` folder holds): its
  documents are the string column ``field``, read a batch of rows at a time;
- anything else: a text file, the whole file one document (UTF-8, unless read ``raw`` as bytes); ``.gz`` and
  ``.zst`` are decompressed first.

A folder that ``datasets`` saved (``save_to_disk``: a ``state.json`` naming its data files) is read as those files
in its order; a ``DatasetDict``'s folder (``dataset_dict.json``) as its ``train`` split (name a split's folder for
another). A compressed ``.parquet`` or ``.arrow`` file is refused by name (both compress their own columns).

The documents are the files' in the order given and enumerated, then in their order inside each file. A file that
cannot be read as its kind raises :class:`~dtrain.data.corpus.DataError` naming the file (and line or row) and what is
wrong. An empty document is skipped here: it adds nothing to a store.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import socket
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dtrain.data.token_store import DataError

Kind = Literal["text", "text.gz", "text.zst", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"]
PARQUET_BATCH_ROWS = 4096  # rows of a parquet or arrow file read at a time
HUB = "hf:"  # a source naming a dataset on the Hugging Face hub
HUB_TIMEOUT_S = 5.0  # the hub must answer a TCP connect within this
HUB_DATA_FILES = ["*.parquet", "*.arrow", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst"]


@dataclass(frozen=True)
class SourceFile:
    """One file to tokenize: its path, how its documents are read, and its size in bytes (for progress)."""

    path: Path
    kind: Kind
    size: int


def kind_of(path: Path) -> Kind:
    """A file's kind from its name: ``.jsonl`` (``.gz``, ``.zst``), ``.parquet``, ``.arrow``, else a text file
    (``.gz``, ``.zst``). Raises DataError for a compressed parquet or arrow file."""
    name = path.name.lower()
    compression = next((c for c in ("gz", "zst") if name.endswith("." + c)), "")
    inner = name[:-len(compression) - 1] if compression else name
    if compression and inner.endswith((".parquet", ".arrow")):
        raise DataError(f"{path}: a compressed {inner.rsplit('.', 1)[1]} file; it compresses its own columns: "
                        "decompress it")
    if inner.endswith(".jsonl"):
        return "jsonl" if not compression else "jsonl.gz" if compression == "gz" else "jsonl.zst"
    if not compression and name.endswith(".parquet"):
        return "parquet"
    if not compression and name.endswith(".arrow"):
        return "arrow"
    return "text" if not compression else "text.gz" if compression == "gz" else "text.zst"


def _dataset_folder(path: Path) -> list[Path] | None:
    """The data files of a folder ``datasets`` saved (a Dataset's, or a DatasetDict's train split), in its order;
    None for any other folder."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        if "train" not in splits:
            raise DataError(f"{path}: a DatasetDict with no train split (it has {', '.join(splits) or 'none'}): "
                            "name a split's folder")
        path = path / "train"
    state = path / "state.json"
    if not (state.is_file() and (path / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a datasets state.json ({e})") from None
    return [path / name for name in names]


def hub_files(name: str) -> list[Path]:
    """The data files (:data:`HUB_DATA_FILES`) of the dataset ``name`` on the Hugging Face hub, downloaded into its
    cache once (``huggingface_hub``, which ``pip install 'dtrain[hf]'`` brings), then read like local files: its
    ``train`` files when it names some. Offline (``HF_HUB_OFFLINE``) only what the cache holds; a hub that does not
    answer within :data:`HUB_TIMEOUT_S` is a DataError at once."""
    try:
        import huggingface_hub
    except ImportError:
        raise DataError(f"{HUB}{name}: reading a hub dataset needs pip install 'dtrain[hf]'") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline:
        endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        try:
            socket.create_connection((endpoint.hostname or "", endpoint.port or 443), timeout=HUB_TIMEOUT_S).close()
        except OSError as e:
            raise DataError(f"{HUB}{name}: the Hugging Face hub ({endpoint.hostname}) cannot be reached from here "
                            f"({e.strerror or e}): download the dataset where it can (datasets' save_to_disk, or "
                            "its parquet files) and give its folder") from None
    try:
        folder = Path(huggingface_hub.snapshot_download(name, repo_type="dataset", allow_patterns=HUB_DATA_FILES,
                                                        local_files_only=offline))
    except Exception as e:  # the hub client's errors have no common base
        raise DataError(f"{HUB}{name}: cannot fetch it from the Hugging Face hub: {str(e).splitlines()[0]}") from None
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    train = [p for p in files if "train" in p.relative_to(folder).as_posix()]
    if not (train or files):
        raise DataError(f"{HUB}{name}: no data files ({', '.join(HUB_DATA_FILES)}) in the dataset")
    return train or files


def enumerate_sources(sources: Sequence[str | Path], plain_text: bool = False) -> list[SourceFile]:
    """The files of ``sources`` in store order: each a file, or a folder whose files (recursively, sorted by path,
    hidden ones left out; a ``datasets`` folder's data files) come in its place, or ``hf:NAME``
    (:func:`hub_files`). ``plain_text``: every file is a text file, whatever its suffix.
    Raises DataError for a source that is not there, a folder with no files, or no sources at all."""
    if not sources:
        raise DataError("no sources given: name text files, .jsonl, .jsonl.zst or .parquet files, or folders")
    files: list[SourceFile] = []
    for source in sources:
        path = Path(source).expanduser()
        if str(source).startswith(HUB):
            found = hub_files(str(source)[len(HUB):])
        elif path.is_dir():
            found = _dataset_folder(path) or sorted(
                p for p in path.rglob("*")
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
    path, kind = source.path, source.kind
    try:
        if kind == "text":
            yield from _text(path, path.read_bytes(), raw)
        elif kind == "parquet":
            yield from _parquet(path, field)
        elif kind == "arrow":
            yield from _arrow(path, field)
        else:
            with open(path, "rb") as f:
                if kind == "jsonl":
                    yield from _jsonl(path, f, field)
                else:
                    with _decompressed(path, f, kind.rsplit(".", 1)[1]) as reader:
                        if kind.startswith("jsonl"):
                            yield from _jsonl(path, reader, field)
                        else:
                            yield from _text(path, reader.read(), raw)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:  # gzip's: a truncated or damaged stream
        raise DataError(f"{path}: not a valid gzip stream ({e})") from None


@contextlib.contextmanager
def _decompressed(path: Path, f: Any, compression: str) -> Iterator[Any]:
    """``f`` decompressed (gzip or zstd), as a buffered binary stream."""
    if compression == "gz":
        with gzip.GzipFile(fileobj=f) as gz:
            yield gz
        return
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as reader:
            yield io.BufferedReader(reader)
    except zstandard.ZstdError as e:
        raise DataError(f"{path}: not a valid zstd stream ({e})") from None


def _text(path: Path, blob: bytes, raw: bool) -> Iterator[str | bytes]:
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


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: not a parquet file ({e})") from None
    yield from _column(path, file.schema_arrow, lambda: file.iter_batches(batch_size=PARQUET_BATCH_ROWS,
                                                                          columns=[field]), field)


def _arrow(path: Path, field: str) -> Iterator[str]:
    """An Arrow IPC file, stream format (``datasets``' own) or file format, memory-mapped: one batch at a time."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader: Any = pa.ipc.open_stream(source)
        except pa.ArrowException:
            try:
                source.seek(0)
                file = pa.ipc.open_file(source)
            except pa.ArrowException as e:
                raise DataError(f"{path}: not an Arrow file ({e})") from None
            reader = (file.get_batch(i) for i in range(file.num_record_batches))
            yield from _column(path, file.schema, lambda: reader, field)
            return
        yield from _column(path, reader.schema, lambda: reader, field)


def _column(path: Path, schema: Any, batches: Callable[[], Iterable[Any]], field: str) -> Iterator[str]:
    """The non-empty strings of column ``field`` in a table's ``batches``, row by row."""
    import pyarrow as pa

    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (it has {', '.join(schema.names) or 'none'}; --field names "
                        "the document text)")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {field!r} is {column_type}, not a string")
    row = 0
    try:
        for batch in batches():
            for text in batch.column(batch.schema.get_field_index(field)).to_pylist():
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
