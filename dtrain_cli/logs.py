"""The command line's handlers for dtrain's log records (the library only logs: :mod:`dtrain.runlog`).

The one place that configures logging. The library logs on its modules' loggers (``logging.getLogger(__name__)``:
``dtrain.*``, ``coordinator.*``, ``workers.*``) and on the RunLog progress channels under ``dtrain``
(:data:`dtrain.runlog.CHANNELS`); :data:`LOGGERS` are the three packages' loggers above them all.
:func:`cli_logging` gives each of them the same one handler, at INFO, for the length of a command
(:func:`dtrain_cli.entry.run_main`, so every ``dtrain`` command and benchmark has it), and :func:`quiet` is what
``--quiet`` does to them:

- in a pipe or a file (a worker's ``worker.log``, a test's capture): :class:`PlainHandler`, one
  ``[ elapsed s] text`` line per record (:func:`dtrain.runlog.progress_line`), a status key's line at most once
  per its ``every_s`` seconds;
- on a terminal: :class:`LiveHandler`, the same lines above live status lines that ``rich`` redraws in place, with
  a bar when a status line's total is known, until their RunLog closes (its status-end records): then the last
  state stays on the terminal and what the command prints next (its summary on stdout) comes below.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import coordinator
import dtrain
import workers
from dtrain.runlog import ELAPSED_S, STATUS_DONE, STATUS_END, STATUS_EVERY_S, STATUS_KEY, STATUS_TOTAL, progress_line

# The loggers the handler goes on: the project's library packages', above every library logger (each module's and
# each progress channel)
LOGGERS = (dtrain.__name__, coordinator.__name__, workers.__name__)
STATUS_REFRESH_HZ = 4  # how often a live status line is redrawn


class LineFormatter(logging.Formatter):
    """A record as a progress line, ``[ elapsed s] text``: elapsed from the record's ``elapsed_s`` (a RunLog's),
    else since ``t0``, and never less than the line before it showed (two clocks of one process, a RunLog's and
    the command's, may be a moment apart); a traceback, if the record has one, below it."""

    def __init__(self, t0: float):
        super().__init__()
        self.t0 = t0
        self.shown = 0.0  # the elapsed seconds of the latest line formatted

    def format(self, record: logging.LogRecord) -> str:
        elapsed = getattr(record, ELAPSED_S, None)
        self.shown = max(self.shown, record.created - self.t0 if elapsed is None else float(elapsed))
        text = progress_line(self.shown, record.getMessage())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class PlainHandler(logging.Handler):
    """Each record as a line on ``stream``; a status record only when its key's last line is at least its
    ``every_s`` seconds old and said something else (a line that did not change is not printed again), a
    status-end record never."""

    def __init__(self, stream: TextIO, t0: float | None = None):
        super().__init__()
        self.stream = stream
        self.setFormatter(LineFormatter(time.time() if t0 is None else t0))
        self._shown: dict[str, float] = {}  # status key -> when its line was last printed
        self._said: dict[str, str] = {}  # status key -> the text of its line last printed

    def emit(self, record: logging.LogRecord) -> None:
        try:
            key = getattr(record, STATUS_KEY, None)
            if key is not None:
                if getattr(record, STATUS_END, False):
                    return
                now, text = time.monotonic(), record.getMessage()
                if now - self._shown.get(key, -math.inf) < float(getattr(record, STATUS_EVERY_S, 0.0)):
                    return
                if self._said.get(key) == text:
                    return
                self._shown[key], self._said[key] = now, text
            self.stream.write(self.format(record) + "\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)


class LiveHandler(logging.Handler):
    """Status records as live lines redrawn in place (a ``rich`` Progress, started by the first one, with a bar of
    done out of total when the total is known); other records as lines above them. Once every live line has had
    its status-end record, or at :meth:`close`, the live lines stop, leaving their last state on the terminal (a
    later status record starts new ones)."""

    def __init__(self, stream: TextIO, t0: float | None = None):
        super().__init__()
        self.stream = stream
        self.setFormatter(LineFormatter(time.time() if t0 is None else t0))
        self._bar: Any = None  # rich.progress.Progress, started by the first status record
        self._tasks: dict[str, Any] = {}  # status key -> its rich task id
        self._open: set[str] = set()  # status keys not ended yet

    def emit(self, record: logging.LogRecord) -> None:
        try:
            key = getattr(record, STATUS_KEY, None)
            if key is None:
                self._line(self.format(record))
            elif not getattr(record, STATUS_END, False):
                self._draw(key, record)
                self._open.add(key)
            elif key in self._open:  # its final state; the last line to end stops them all
                self._draw(key, record)
                self._open.discard(key)
                if not self._open:
                    self._stop()
        except Exception:
            self.handleError(record)

    def _draw(self, key: str, record: logging.LogRecord) -> None:
        done, total = getattr(record, STATUS_DONE, None), getattr(record, STATUS_TOTAL, None)
        bar, line = self._live_bar(), record.getMessage()
        if key in self._tasks:
            bar.update(self._tasks[key], description=line, total=total or None, completed=done or 0)
        else:
            self._tasks[key] = bar.add_task(line, total=total or None, completed=done or 0)

    def _line(self, text: str) -> None:
        if self._bar is None:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        from rich.text import Text

        self._bar.console.print(Text(text), soft_wrap=True)  # one line, as in a pipe

    def _live_bar(self) -> Any:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=self.stream, force_terminal=True)
            self._bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                                 TimeElapsedColumn(), console=console, refresh_per_second=STATUS_REFRESH_HZ)
            self._bar.start()
        return self._bar

    def _stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()  # the last state of the live lines stays on the terminal
            self._bar = None
        self._tasks.clear()
        self._open.clear()

    def close(self) -> None:
        self.acquire()
        try:
            self._stop()
        finally:
            self.release()
        super().close()


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for one without ``isatty`` or a closed one)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def make_handler(stream: TextIO | None = None, live: bool | None = None) -> logging.Handler:
    """The handler for ``stream`` (default: stderr now): :class:`LiveHandler` when ``live`` (None: when the stream
    is a terminal), else :class:`PlainHandler`."""
    stream = sys.stderr if stream is None else stream
    live = is_terminal(stream) if live is None else live
    return LiveHandler(stream) if live else PlainHandler(stream)


@contextmanager
def cli_logging(stream: TextIO | None = None, live: bool | None = None) -> Iterator[logging.Handler]:
    """For the length of the block: :func:`make_handler`'s handler on each of :data:`LOGGERS`, which log at INFO
    and only there (no propagation to the root logger's handlers); after it the handler is closed (live lines
    stopped) and removed, and each logger's level and propagation are as they were. Inside
    another such block (a command run from a command) the outer block's handler stays the only one."""
    loggers = [logging.getLogger(name) for name in LOGGERS]
    outer = next((h for h in loggers[0].handlers if isinstance(h, (PlainHandler, LiveHandler))), None)
    if outer is not None:
        yield outer
        return
    handler = make_handler(stream, live)
    before = [(logger, logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # not also through a root handler a dependency's basicConfig() put there
    try:
        yield handler
    finally:
        for logger, level, propagate in before:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        handler.close()


def quiet() -> None:
    """``--quiet``: no progress lines, the library's INFO records of every module and channel with them; its
    warnings still show. Sets :data:`LOGGERS` to WARNING (:func:`cli_logging` puts their levels back after the
    command)."""
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
