"""``dtrain tokenize SRC... --out STORE``: a corpus into a token store (:func:`dtrain.tokenize.tokenize`).

The tokenizer is a tokenizer.json (``--tokenizer FILE``, its end-of-document token from ``--eos`` or found by
name), the byte tokenizer (``--tokenizer bytes``), or a byte-level BPE of ``--vocab-size`` ids trained on the
sources. Progress is a status line on the ``dtrain.tokenize`` logger (bytes, documents, tokens/s, ETA: redrawn
on a terminal, a plain line every :data:`PLAIN_EVERY_S` seconds in a pipe); the command ends with one summary
line on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable

from dtrain.config import ConfigError
from dtrain.runlog import (
    STATUS_DONE,
    STATUS_END,
    STATUS_EVERY_S,
    STATUS_KEY,
    STATUS_TOTAL,
    fmt_bytes,
    fmt_rate,
)
from dtrain.tokenize import COMMIT_EVERY_S, Journal, check_out, tokenize, trained_or_resumed
from dtrain.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BYTES = "bytes"  # --tokenizer bytes: the byte tokenizer
PLAIN_EVERY_S = 10.0  # in a pipe: a progress line at most this often
REDRAW_S = 0.25  # on a terminal: the status line at most this often
# A test's hook: commit after every file and exit abruptly (status 137, as SIGKILL) once this many are committed.
TEST_EXIT_AFTER_FILES = "DTRAIN_TOKENIZE_TEST_EXIT_AFTER_FILES"


class ProgressLine:
    """The progress callback of :func:`dtrain.tokenize.tokenize` as status records (:mod:`dtrain.runlog`'s
    attributes, which :mod:`dtrain_cli.logs` shows); :meth:`end` makes the last one final."""

    def __init__(self, quiet: bool):
        self.log = logging.getLogger("dtrain.tokenize")  # the command line's own logger, under dtrain
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
        if now - self.shown >= REDRAW_S or files == files_total:
            self.shown = now
            self._emit(line, done, total, end=False)

    def _emit(self, line: str, done: int, total: int, end: bool) -> None:
        if not self.quiet:
            self.log.info(line, extra={STATUS_KEY: "tokenize", STATUS_DONE: done, STATUS_TOTAL: total,
                                       STATUS_EVERY_S: PLAIN_EVERY_S, STATUS_END: end})

    def end(self) -> None:
        if self.last is not None:
            self._emit(*self.last, end=True)


def choose_tokenizer(args: argparse.Namespace) -> tuple[Tokenizer, int]:
    """The tokenizer the flags name, and the vocabulary size of a BPE trained here (0: none)."""
    if args.tokenizer is None and args.vocab_size is None:
        raise ConfigError("no tokenizer: give --tokenizer FILE (a Hugging Face tokenizer.json), --tokenizer bytes, "
                          "or --vocab-size N to train a byte-level BPE on the sources")
    if args.eos is not None and (args.tokenizer in (None, BYTES)):
        raise ConfigError("--eos names the end-of-document token of a --tokenizer FILE (the byte tokenizer's is "
                          "b'\\n', a trained BPE's <|endoftext|>)")
    check_out(args.out, args.sources, args.overwrite)  # before a tokenizer is trained for nothing
    if args.tokenizer == BYTES:
        return ByteTokenizer(), 0
    if args.tokenizer is not None:
        return HFTokenizer.from_file(args.tokenizer, eos=args.eos), 0
    from dtrain.documents import enumerate_sources

    files = enumerate_sources(args.sources)
    tok = trained_or_resumed(files, args.out, args.vocab_size, field=args.field, skip_bad=args.skip_bad,
                             overwrite=args.overwrite)
    return tok, args.vocab_size


def main(args: argparse.Namespace) -> int:
    """Runs ``dtrain tokenize`` with its parsed flags; prints the summary line; returns 0."""
    t0 = time.monotonic()
    loggers = [logging.getLogger(name) for name in ("dtrain.data", "dtrain.tokenize")]
    levels = [logger.level for logger in loggers]
    if args.quiet:  # warnings (a skipped file) still show
        for logger in loggers:
            logger.setLevel(logging.WARNING)
    try:
        return _tokenize(args, t0)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _tokenize(args: argparse.Namespace, t0: float) -> int:
    tokenizer, trained = choose_tokenizer(args)
    commit_every_s, on_commit = _test_hook()
    line = ProgressLine(args.quiet)
    try:
        manifest, stats = tokenize(args.sources, args.out, tokenizer, field=args.field, skip_bad=args.skip_bad,
                                   workers=args.workers, progress=line, overwrite=args.overwrite,
                                   trained_vocab_size=trained, on_commit=on_commit, commit_every_s=commit_every_s)
    finally:
        line.end()
    seconds = time.monotonic() - t0
    skipped = f", {len(stats.skipped)} skipped" if stats.skipped else ""
    resumed = f", resumed after {stats.resumed_files}" if stats.resumed_files else ""
    print(f"tokenize: {manifest.tokens:,} tokens, {manifest.documents:,} documents, {stats.files:,} files"
          f"{skipped}{resumed} -> {args.out} ({manifest.tokenizer}, vocab {manifest.vocab_size:,}, "
          f"{manifest.digest}) in {seconds:.1f} s, {stats.bytes / max(seconds, 1e-9) / 1e6:.1f} MB/s")
    return 0


def _test_hook() -> tuple[float, Callable[[Journal], None] | None]:
    """(commit_every_s, on_commit) of :data:`TEST_EXIT_AFTER_FILES`; without it, the defaults."""
    text = os.environ.get(TEST_EXIT_AFTER_FILES)
    if not text:
        return COMMIT_EVERY_S, None
    after = int(text)

    def exit_abruptly(journal: Journal) -> None:
        if journal.files_done >= after:
            os._exit(137)  # as if killed: no cleanup, no flush

    return 0.0, exit_abruptly
