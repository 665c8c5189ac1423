"""``dtrain tokenize SRC... --out STORE``: a corpus into a token store (:func:`dtrain.data.tokenize.tokenize`).

The tokenizer is a tokenizer.json (``--tokenizer FILE``, its end-of-document token from ``--eos`` or found by
name), the byte tokenizer (``--tokenizer bytes``), or a byte-level BPE of ``--vocab-size`` ids trained on the
sources. Progress is a status line on :mod:`dtrain.data.tokenize`'s logger (bytes, documents, tokens/s, ETA:
redrawn on a terminal, a plain line every :data:`dtrain.data.tokenize.PLAIN_EVERY_S` seconds in a pipe); the command
ends with one summary line on stdout. ``--quiet`` silences the INFO records of the modules it runs (their warnings,
a skipped file, still show)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dtrain.config.sections import ConfigError
from dtrain.data import token_store
from dtrain.data import tokenize as tokenizing
from dtrain.data.token_store import DataError
from dtrain.data.tokenize import (
    COMMIT_EVERY_S,
    Journal,
    ProgressLine,
    check_out,
    read_journal,
    tokenize,
    trained_or_resumed,
)
from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BYTES = "bytes"  # --tokenizer bytes: the byte tokenizer
# A test's hook: commit after every file and exit abruptly (status 137, as SIGKILL) once this many are committed.
TEST_EXIT_AFTER_FILES = "DTRAIN_TOKENIZE_TEST_EXIT_AFTER_FILES"
# A test's hook: commit after every file and raise KeyboardInterrupt (as Ctrl-C) once this many are committed.
TEST_INTERRUPT_AFTER_FILES = "DTRAIN_TOKENIZE_TEST_INTERRUPT_AFTER_FILES"


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
    from dtrain.data.documents import enumerate_sources

    files = enumerate_sources(args.sources)
    tok = trained_or_resumed(files, args.out, args.vocab_size, field=args.field, skip_bad=args.skip_bad,
                             overwrite=args.overwrite)
    return tok, args.vocab_size


def main(args: argparse.Namespace) -> int:
    """Runs ``dtrain tokenize`` with its parsed flags; prints the summary line; returns 0."""
    t0 = time.monotonic()
    loggers = [token_store.log, tokenizing.log]  # the modules it runs that log
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
    executor = None
    if args.ray is not None:
        from dtrain.data.tokenize_ray import RayExecutor

        executor = RayExecutor(args.ray)
        executor.connect()  # before any work (a BPE trained): Ray missing or an address not answering, at once
    tokenizer, trained = choose_tokenizer(args)
    commit_every_s, on_commit = _test_hook()
    line = ProgressLine(args.quiet)
    try:
        manifest, stats = tokenize(args.sources, args.out, tokenizer, field=args.field, skip_bad=args.skip_bad,
                                   workers=args.workers, progress=line, overwrite=args.overwrite,
                                   trained_vocab_size=trained, on_commit=on_commit, commit_every_s=commit_every_s,
                                   executor=executor)
    except (KeyboardInterrupt, DataError) as e:
        journal = read_journal(args.out) if Path(args.out).is_dir() else None
        if journal is not None or isinstance(e, KeyboardInterrupt):  # say how to go on
            kept = (f"{journal.files_done:,} of {journal.files:,} files are committed in {args.out}"
                    if journal is not None else "nothing was committed yet")
            print(f"dtrain tokenize: {'interrupted' if isinstance(e, KeyboardInterrupt) else 'stopped'}: {kept}; "
                  f"to continue: {resume_command(args)}", file=sys.stderr)
        raise
    finally:
        line.end()
    seconds = time.monotonic() - t0
    skipped = f", {len(stats.skipped)} skipped" if stats.skipped else ""
    resumed = f", resumed after {stats.resumed_files}" if stats.resumed_files else ""
    print(f"tokenize: {manifest.tokens:,} tokens, {manifest.documents:,} documents, {stats.files:,} files"
          f"{skipped}{resumed} -> {args.out} ({manifest.tokenizer}, vocab {manifest.vocab_size:,}, "
          f"{manifest.digest}) in {seconds:.1f} s, {stats.bytes / max(seconds, 1e-9) / 1e6:.1f} MB/s")
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: its arguments, without --overwrite (which would start over)."""
    words = ["dtrain", "tokenize", *args.sources, "--out", args.out]
    for flag, value in [("--tokenizer", args.tokenizer), ("--vocab-size", args.vocab_size), ("--eos", args.eos),
                        ("--ray", args.ray)]:
        if value is not None:
            words += [flag, str(value)]
    if args.field != "text":
        words += ["--field", args.field]
    words += ["--workers", str(args.workers)] + (["--skip-bad"] if args.skip_bad else [])
    return shlex.join(words)


def _test_hook() -> tuple[float, Callable[[Journal], None] | None]:
    """(commit_every_s, on_commit) of :data:`TEST_EXIT_AFTER_FILES` or :data:`TEST_INTERRUPT_AFTER_FILES`; without
    them, the defaults."""
    killed, interrupted = os.environ.get(TEST_EXIT_AFTER_FILES), os.environ.get(TEST_INTERRUPT_AFTER_FILES)
    if not (killed or interrupted):
        return COMMIT_EVERY_S, None
    after = int(killed or interrupted or 0)

    def stop(journal: Journal) -> None:
        if journal.files_done >= after:
            if killed:
                os._exit(137)  # as if killed: no cleanup, no flush
            raise KeyboardInterrupt  # as Ctrl-C

    return 0.0, stop
