"""Tokenizing a corpus into a token store, in parallel over files and resumable (``dtrain tokenize``).

:func:`tokenize` reads the sources' documents (:mod:`dtrain.data.documents`), encodes each with a tokenizer
(:mod:`dtrain.data.tokenizer`: the end-of-document id after each) and writes them, in file order, into a token store
(:class:`~dtrain.data.token_store.StoreWriter`). With more than one worker it encodes files in a pool of spawned
processes, each sent a file's path and the tokenizer's spec (plain strings) and giving back the file's ids and
document lengths as two numpy arrays; the writer takes them in file order, so the store is the same whatever the
number of workers.

**Resuming.** Every :data:`COMMIT_EVERY_S` seconds, after a whole file, the writer commits (every id and document
end on disk) and the journal ``STORE/tokenize.journal.json`` is rewritten atomically: the files done, the ids and
documents committed, the digest's chain state, the files skipped, and what the run was asked (the sources' paths,
the tokenizer, the field, the limit). Killed at any point and run again with the same arguments, it cuts the arrays
back to the journal's counts and goes on after the last file committed, ending with the store an uninterrupted run
writes (the same ids, document ends and manifest). Run again with other arguments it refuses, naming the
difference. A store being written has no manifest.json, so :meth:`~dtrain.data.token_store.TokenStore.open` refuses
it; the journal is removed once the manifest is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple

import numpy as np

from dtrain import schema
from dtrain.data.documents import SourceFile, enumerate_sources, fingerprint, read_documents
from dtrain.data.token_store import (
    CHUNK_TOKENS,
    MANIFEST,
    Committed,
    DataError,
    Manifest,
    StoreError,
    StoreWriter,
    dtype_for,
)
from dtrain.data.tokenizer import STORE_TOKENIZER_FILE, HFTokenizer, Tokenizer, from_spec, train_bpe
from dtrain.runlog import STATUS_DONE, STATUS_END, STATUS_EVERY_S, STATUS_KEY, STATUS_TOTAL, fmt_bytes, fmt_rate

JOURNAL = "tokenize.journal.json"
JOURNAL_FORMAT = "dtrain-tokenize-journal/1"
COMMIT_EVERY_S = 10.0  # the most work (in seconds) a killed run does again
POOL_MIN_BYTES = 1 << 20  # less than this to read: no process pool (starting one costs more)
ENCODE_BATCH_CHARS = 8 << 20  # a worker encodes a file's documents this many characters at a time

PLAIN_EVERY_S = 10.0  # in a pipe: a progress line at most this often
REDRAW_S = 0.25  # on a terminal: the status line at most this often
FIRST_LINE_S = 1.0  # no progress line before this (a quick job: its start and end lines only)

log = logging.getLogger(__name__)

# (bytes done, bytes total, documents, tokens, files done, files total)
Progress = Callable[[int, int, int, int, int, int], None]


class Skipped(NamedTuple):
    """A file left out (``skip_bad``) and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Journal:
    """An unfinished ``dtrain tokenize``'s record in its store: what it was asked and how far it got."""

    format: str  # JOURNAL_FORMAT
    sources: str  # sha256 of the files' paths, in order
    files: Annotated[int, schema.AtLeast(0)]  # files in all
    tokenizer: str  # Tokenizer.identity()
    trained_vocab_size: Annotated[int, schema.AtLeast(0)]  # a BPE trained here (0: the tokenizer was given)
    field: str
    limit: Annotated[int, schema.AtLeast(0)]
    files_done: Annotated[int, schema.AtLeast(0)]
    done: str  # a sha256 chain over the done files' paths, sizes and modification times: they must not change
    bytes_done: Annotated[int, schema.AtLeast(0)]
    tokens: Annotated[int, schema.AtLeast(0)]
    documents: Annotated[int, schema.AtLeast(0)]
    chain: str  # the digest's chain state (Committed.chain)
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class TokenizeStats:
    """What a :func:`tokenize` did: files read (skipped ones included), the skipped files, documents, ids, bytes
    read, seconds, and how many files an earlier, interrupted run had done."""

    files: int
    skipped: tuple[Skipped, ...]
    documents: int
    tokens: int
    bytes: int
    seconds: float
    resumed_files: int


def _sha(items: object) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def _done_link(chain: str, source: SourceFile) -> str:
    """The files-done chain after one more file: sha256 of the chain so far and the file's path, size and
    modification time (:func:`dtrain.data.documents.fingerprint`)."""
    return _sha([chain, *fingerprint([source])])


def read_journal(out: str | Path) -> Journal | None:
    """The journal of an interrupted ``dtrain tokenize`` into ``out``, or None if there is none."""
    path = Path(out) / JOURNAL
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"token store {out}: cannot read its {JOURNAL}: {e.strerror}") from None
    try:
        journal = schema.load(Journal, json.loads(text))
    except ValueError as e:
        raise StoreError(f"token store {out}: its {JOURNAL} is damaged ({e}): start over with --overwrite") from None
    if journal.format != JOURNAL_FORMAT:
        raise StoreError(f"token store {out}: journal format {journal.format!r}, this dtrain reads "
                         f"{JOURNAL_FORMAT!r}: start over with --overwrite")
    return journal


def _write_journal(out: Path, journal: Journal) -> None:
    tmp = out / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps(schema.dump(journal), indent=1) + "\n")
    os.replace(tmp, out / JOURNAL)


def _check_resumable(out: Path, journal: Journal, asked: Journal, files: Sequence[SourceFile]) -> None:
    """Refuses to go on with an interrupted run that was asked something else, naming what differs."""
    differs = [what for what, a, b in [
        ("the sources (their files or order)", journal.sources, asked.sources),
        ("the tokenizer", journal.tokenizer, asked.tokenizer),
        ("--field", journal.field, asked.field), ("the limit", journal.limit, asked.limit)] if a != b]
    done = ""
    for source in files[:journal.files_done] if not differs else ():
        done = _done_link(done, source)
    if not differs and journal.done != done:
        differs.append(f"the contents of the {journal.files_done} files it had done")
    if differs:
        raise StoreError(f"token store {out}: an interrupted `dtrain tokenize` with other arguments is there "
                         f"({', '.join(differs)} differ): run it with the same arguments to finish it, or start "
                         "over with --overwrite")


def check_out(out: str | Path, sources: Sequence[str | Path], overwrite: bool = False) -> None:
    """Refuses an ``out`` that cannot take a new store (StoreError): a file, a folder inside a source folder, or a
    complete store (unless ``overwrite``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StoreError(f"--out {out}: a file is there, not a folder for a token store")
    where = out.resolve()
    for source in sources:
        folder = Path(source).expanduser().resolve()
        if folder.is_dir() and (where == folder or folder in where.parents):
            raise StoreError(f"--out {out} is inside the source folder {source}: the store's own files would be "
                             "read as sources; put it elsewhere")
    if (out / MANIFEST).exists() and not overwrite:
        raise StoreError(f"token store {out} exists already (its {MANIFEST} is there): choose another --out, or "
                         "--overwrite it")


def trained_or_resumed(files: Sequence[SourceFile], out: str | Path, vocab_size: int, *, field: str = "text",
                       skip_bad: bool = False, overwrite: bool = False) -> HFTokenizer:
    """The byte-level BPE of ``vocab_size`` for a store: the one an interrupted run into ``out`` trained and wrote
    there (training is deterministic: the same one), else one trained now (:func:`dtrain.data.tokenizer.train_bpe`)."""
    journal = None if overwrite else read_journal(out)
    saved = Path(out) / STORE_TOKENIZER_FILE
    if journal is not None and journal.trained_vocab_size == vocab_size and saved.exists():
        log.info("using the BPE tokenizer the interrupted run trained (%s)", saved)
        return HFTokenizer.from_file(saved, eos=None)
    log.info("training a byte-level BPE of %d ids on %d files", vocab_size, len(files))
    return train_bpe(files, vocab_size, field=field, skip_bad=skip_bad)


def tokenize(sources: Sequence[str | Path], out: str | Path, tokenizer: Tokenizer, *, field: str = "text",
             skip_bad: bool = False, workers: int | None = None, limit: int = 0, progress: Progress | None = None,
             overwrite: bool = False, plain_text: bool = False, trained_vocab_size: int = 0,
             commit_every_s: float = COMMIT_EVERY_S, on_commit: Callable[[Journal], None] | None = None,
             executor: Executor | None = None,
             chunk_tokens: int = CHUNK_TOKENS) -> tuple[Manifest, TokenizeStats]:
    """Tokenizes the documents of ``sources`` (files and folders, :func:`dtrain.data.documents.enumerate_sources`;
    ``plain_text``: every file a text file) into a new token store at ``out`` and returns its manifest and what
    was done; an interrupted run into ``out`` with the same arguments is continued (see the module's docstring).

    ``field``: the document text's field in .jsonl(.zst) and column in .parquet. ``skip_bad``: a file that cannot
    be read as its kind is logged, counted and left out (else it raises DataError naming it). ``workers``:
    processes encoding files (default: every core). ``limit``: stop once the store holds this many ids, the last
    document cut there (0: everything). ``progress``: called after each file with (bytes done, bytes total,
    documents, tokens, files done, files total). ``overwrite``: replace a complete store or an interrupted run
    there. ``trained_vocab_size``: the tokenizer is a BPE of that size trained on these sources (recorded so a
    resumed run reuses it). ``on_commit``: called with the journal after each commit (a test's hook).
    ``executor``: who encodes the files (default: here, or a process pool of ``workers``; a
    :class:`dtrain.data.tokenize_ray.RayExecutor` spreads them over a Ray cluster, its tasks writing the ids into
    the store themselves). ``chunk_tokens``: ids per stored chunk (a resumed run keeps its store's).
    Raises DataError when ``skip_bad`` left out every file (nothing good to store)."""
    t0 = time.monotonic()
    files = enumerate_sources(sources, plain_text)
    out = Path(out)
    check_out(out, sources, overwrite)
    asked = Journal(format=JOURNAL_FORMAT, sources=_sha([os.path.abspath(f.path) for f in files]),
                    files=len(files), tokenizer=tokenizer.identity(), trained_vocab_size=trained_vocab_size,
                    field=field, limit=limit, files_done=0, done="", bytes_done=0, tokens=0, documents=0,
                    chain="", skipped=())
    journal = None if overwrite else read_journal(out)
    if journal is not None:
        _check_resumable(out, journal, asked, files)
        log.info("resuming %s: %d of %d files done, %s ids", out, journal.files_done, len(files),
                 f"{journal.tokens:,}")
    else:
        (out / JOURNAL).unlink(missing_ok=True)
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    resume = None if journal is None else Committed(journal.tokens, journal.documents, journal.chain)
    if executor is not None and limit:
        raise DataError("a limit on the ids is for a tokenizer in this process, not for one spread over workers "
                        "that write the store themselves")
    writer = StoreWriter(out, vocab, tokenizer.name, eos, overwrite=overwrite, resume=resume,
                         chunk_tokens=chunk_tokens)
    kind, text, _ = tokenizer.spec()
    if kind == "hf":  # the tokenizer goes with its ids
        tmp = out / (STORE_TOKENIZER_FILE + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / STORE_TOKENIZER_FILE)
    state = journal or asked
    first = state.files_done
    files_done, bytes_done, skipped, done_chain = first, state.bytes_done, list(state.skipped), state.done
    total_bytes = sum(f.size for f in files)
    workers = max(1, os.cpu_count() or 1) if workers is None else workers
    log.info("tokenizing %d files (%s bytes%s) into %s with %s, %d worker%s", len(files) - first,
             f"{total_bytes - bytes_done:,}", f", up to {limit:,} ids" if limit else "", out, tokenizer.name, workers,
             "" if workers == 1 else "s")
    last_commit = time.monotonic()
    done = bool(limit) and writer.tokens >= limit
    todo = [] if done else files[first:]
    results = (local_executor(workers) if executor is None else executor)(todo, tokenizer, field, writer)
    try:
        for source, result in zip(files[first:], results, strict=False):
            error = result[2]
            if error:
                if not skip_bad:
                    raise DataError(error)
                log.warning("skipping %s", error)
                skipped.append(Skipped(str(source.path), error))
            elif isinstance(result, Placed):  # its ids are in the store already, written by the executor's task
                writer.adopt(result.tokens, result.documents)
            else:
                ids, lengths, _ = result
                if limit and writer.tokens + ids.size >= limit:
                    ids, lengths = _cut(ids, lengths, limit - writer.tokens)
                    done = True
                writer.add_documents(ids, lengths)
            files_done, bytes_done = files_done + 1, bytes_done + source.size
            done_chain = _done_link(done_chain, source)
            if progress is not None:
                progress(bytes_done, total_bytes, writer.documents, writer.tokens, files_done, len(files))
            if done:
                break
            if time.monotonic() - last_commit >= commit_every_s and files_done < len(files):
                at = writer.commit()
                journal = dataclasses.replace(asked, files_done=files_done, done=done_chain,
                                              bytes_done=bytes_done, tokens=at.tokens, documents=at.documents,
                                              chain=at.chain, skipped=tuple(skipped))
                _write_journal(out, journal)
                last_commit = time.monotonic()
                if on_commit is not None:
                    on_commit(journal)
    finally:
        results.close()  # stops the pool, or the cluster's tasks
    if skipped and len(skipped) == files_done and files_done == len(files):
        raise DataError(f"every one of the {len(files)} files was bad and skipped (--skip-bad): nothing to store; "
                        f"the first: {skipped[0].reason}")
    manifest = writer.close()
    (out / JOURNAL).unlink(missing_ok=True)
    stats = TokenizeStats(files=files_done, skipped=tuple(skipped), documents=manifest.documents,
                          tokens=manifest.tokens, bytes=bytes_done, seconds=time.monotonic() - t0,
                          resumed_files=first)
    return manifest, stats


def _cut(ids: np.ndarray, lengths: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``keep`` ids and the lengths of the documents they hold (the last one cut short)."""
    ends = np.cumsum(lengths)
    whole = int(np.searchsorted(ends, keep, side="right"))  # documents that end at or before keep
    start = int(ends[whole - 1]) if whole else 0
    kept = lengths[:whole]
    if keep > start:
        kept = np.append(kept, keep - start)
    return ids[:keep], kept


# -- encoding files: the executors ----------------------------------------------------------------------------------

Encoded = tuple[np.ndarray, np.ndarray, str]  # a file's ids, its documents' lengths, and '' or why it is bad


class Placed(NamedTuple):
    """A file whose ids and document ends an executor's task wrote into the store itself, right after the files
    before it: how many of each, and '' or why it is bad (then nothing was written for it)."""

    tokens: int
    documents: int
    error: str


# Who encodes the files, given (the files left to do, in store order; the tokenizer; --field; the store's
# writer): each file's result in that order, either its ids (written by tokenize() here) or, from an executor
# whose workers write the store themselves, a Placed yielded only once its ids are on disk.
Executor = Callable[[Sequence[SourceFile], Tokenizer, str, StoreWriter], Generator[Encoded | Placed, None, None]]

_worker_tokenizer: Tokenizer | None = None
_worker_spec: tuple[str, str, int] | None = None


def local_executor(workers: int) -> Executor:
    """The default executor: files encoded here, or in a pool of ``workers`` processes (:func:`_encoded`)."""

    def run(files: Sequence[SourceFile], tokenizer: Tokenizer, field: str,
            writer: StoreWriter) -> Generator[Encoded | Placed, None, None]:
        yield from _encoded(files, tokenizer, field, workers)

    return run


def encode_files(spec: tuple[str, str, int], files: Sequence[tuple[str, str, int]], field: str) -> list[Encoded]:
    """A worker's job: each file (path, kind, size) encoded with the tokenizer ``spec`` describes, in order. The
    tokenizer is built once per worker process (and single-threaded: one worker per core already)."""
    if _worker_spec != spec:
        _init_worker(spec)
    return [_encode_task(path, kind, size, field) for path, kind, size in files]


def _encoded(files: Sequence[SourceFile], tokenizer: Tokenizer, field: str,
             workers: int) -> Generator[Encoded, None, None]:
    """Each file's :func:`_encode_file`, in order: here, or in a pool of ``workers`` spawned processes (each
    one's tokenizer single-threaded) when there are enough files and bytes."""
    if workers <= 1 or len(files) < 2 or sum(f.size for f in files) < POOL_MIN_BYTES:
        for source in files:
            yield _encode_file(tokenizer, source, field)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process with TensorStore's threads
    pool = ProcessPoolExecutor(min(workers, len(files)), mp_context=context, initializer=_init_worker,
                               initargs=(tokenizer.spec(),))
    try:
        queue: deque[Future[Encoded]] = deque()
        upcoming = iter(files)
        for source in upcoming:
            queue.append(pool.submit(_encode_task, str(source.path), source.kind, source.size, field))
            if len(queue) >= 2 * workers:
                break
        while queue:
            head = queue.popleft()
            try:
                encoded = head.result()
            except BrokenProcessPool:
                raise DataError(f"a tokenizer worker process died (out of memory, or killed) while encoding "
                                f"{len(files)} files; what was committed is kept: run again with fewer --workers "
                                "to continue") from None
            nxt = next(upcoming, None)
            if nxt is not None:
                queue.append(pool.submit(_encode_task, str(nxt.path), nxt.kind, nxt.size, field))
            yield encoded
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _init_worker(spec: tuple[str, str, int]) -> None:
    global _worker_tokenizer, _worker_spec
    os.environ["RAYON_NUM_THREADS"] = "1"  # one process per core already: tokenizers' own threads would contend
    _worker_tokenizer, _worker_spec = from_spec(spec), spec


def _encode_task(path: str, kind: str, size: int, field: str) -> Encoded:
    assert _worker_tokenizer is not None, "the pool's initializer sets the tokenizer"
    return _encode_file(_worker_tokenizer, SourceFile(Path(path), kind, size), field)  # type: ignore[arg-type]


def _encode_file(tokenizer: Tokenizer, source: SourceFile, field: str) -> Encoded:
    """One file's ids and document lengths (ids in the store's dtype), or empty arrays and why it is bad."""
    dtype = np.dtype(np.uint8) if tokenizer.vocab_size <= 256 else np.dtype(dtype_for(tokenizer.vocab_size))
    ids: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    batch: list[str | bytes] = []
    chars = 0
    try:
        for document in read_documents(source, field, raw=tokenizer.raw):
            batch.append(document)
            chars += len(document)
            if chars >= ENCODE_BATCH_CHARS:
                _encode_batch(tokenizer, batch, dtype, ids, lengths)
                batch, chars = [], 0
        if batch:
            _encode_batch(tokenizer, batch, dtype, ids, lengths)
    except DataError as e:
        return np.zeros(0, dtype), np.zeros(0, np.int64), str(e)
    if not ids:
        return np.zeros(0, dtype), np.zeros(0, np.int64), ""
    return np.concatenate(ids), np.concatenate(lengths), ""


def _encode_batch(tokenizer: Tokenizer, batch: list[str | bytes], dtype: np.dtype, ids: list[np.ndarray],
                  lengths: list[np.ndarray]) -> None:
    batch_ids, batch_lengths = tokenizer.encode_documents(batch)
    ids.append(batch_ids.astype(dtype, copy=False))
    lengths.append(batch_lengths)


class ProgressLine:
    """The progress callback of :func:`tokenize` as status records on the ``dtrain.data.tokenize`` logger
    (:mod:`dtrain.runlog`'s attributes, which the command line shows as a live or a plain line); :meth:`end` makes
    the last one final. ``quiet``: none."""

    def __init__(self, quiet: bool):
        self.quiet, self.t0, self.shown = quiet, time.monotonic(), -1.0
        self.last: tuple[str, int, int] | None = None
        self.start: tuple[int, int] | None = None  # bytes and tokens at the first call (a resumed run's are not 0)

    def __call__(self, done: int, total: int, documents: int, tokens: int, files: int, files_total: int) -> None:
        now = time.monotonic()
        if self.start is None:  # rates count from the first file of this run (a resumed run's first)
            self.start = (0, 0) if files <= 1 else (done, tokens)
        elapsed = max(now - self.t0, 1e-9)
        rate = (done - self.start[0]) / elapsed
        eta = f"{(total - done) / rate:.0f}s" if rate > 0 and done < total else "-"
        line = (f"tokenize: {fmt_bytes(done)}/{fmt_bytes(total)} {documents:,} docs {tokens:,} tokens "
                f"tok/s {fmt_rate((tokens - self.start[1]) / elapsed)} files {files}/{files_total} ETA {eta}")
        self.last = line, done, total
        if (now - self.t0 >= FIRST_LINE_S and now - self.shown >= REDRAW_S) or files == files_total:
            self.shown = now
            self._emit(line, done, total, end=False)

    def _emit(self, line: str, done: int, total: int, end: bool) -> None:
        if not self.quiet:
            log.info(line, extra={STATUS_KEY: "tokenize", STATUS_DONE: done, STATUS_TOTAL: total,
                                  STATUS_EVERY_S: PLAIN_EVERY_S, STATUS_END: end})

    def end(self) -> None:
        if self.last is not None:
            self._emit(*self.last, end=True)
