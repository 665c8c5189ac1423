"""The library logs, the command line shows: a library run prints nothing below WARNING without the CLI's handlers;
``logging.getLogger("dtrain").setLevel(logging.WARNING)`` silences its progress; a user's own handler on
``"dtrain"`` gets the progress and status records (with their extras, and each status line's end when its
RunLog closes); the CLI's handler prints the same ``[ x.xs] text`` lines as before, and goes away after the
command."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from conftest import REPO_ROOT, TINY, make_text
from dtrain.runlog import ELAPSED_S, STATUS_DONE, STATUS_END, STATUS_KEY, STATUS_TOTAL, RunLog
from dtrain_cli.logs import LOGGER, PlainHandler, cli_logging

LINE = re.compile(r"\[ *[0-9.]+s\] (.*)")  # a progress line as the CLI prints it

_LIBRARY_RUN = """
import logging, sys
from dtrain.config.load import load_config
from dtrain.train.runs import run_train
cfg = load_config(sys.argv[1], [f"run.out_dir={sys.argv[2]}", f"data.source={sys.argv[3]}", "data.max_bytes=0",
                                "train.steps=20", "run.log_every=10", "run.eval_every=10"])
run_train(cfg)
logging.getLogger("dtrain.run").warning("a warning still shows")
"""


class Records(logging.Handler):
    """A user's own handler: keeps the records it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def dtrain_logger() -> Iterator[logging.Logger]:
    """The ``dtrain`` logger, its level and handlers put back as they were after the test."""
    logger = logging.getLogger(LOGGER)
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_without_the_clis_handlers_a_library_run_prints_nothing_below_warning(tmp_path):
    """A real run (``dtrain.train.runs.run_train``, not quiet) in a fresh interpreter that configures no logging: its
    progress and status lines are INFO records nobody shows; a warning still reaches stderr (through Python's
    last-resort handler, or the root handler a dependency's ``basicConfig`` put there); events.jsonl records the
    run as before."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(make_text(60_000))
    # one CPU device (not the 8 fake ones of this process's XLA_FLAGS): the run's logging is the same, its programs
    # compile in a fraction of the time
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, "-c", _LIBRARY_RUN, str(TINY), str(tmp_path / "runs"), str(corpus)],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.endswith("a warning still shows") for line in proc.stderr.splitlines()), proc.stderr
    assert not any(LINE.search(line) or "train:" in line for line in proc.stderr.splitlines()), proc.stderr
    assert proc.stdout == ""
    assert (tmp_path / "runs" / "tiny" / "events.jsonl").read_text().count('"event": "train"') == 2


def test_a_users_handler_on_dtrain_gets_the_progress_and_status_records(tmp_path, dtrain_logger, capfd):
    mine = Records()
    dtrain_logger.addHandler(mine)
    dtrain_logger.setLevel(logging.INFO)
    log = RunLog(tmp_path, logger="dtrain.coordinator")
    log.progress("v1: merged 2 deltas (all in)")
    log.status("island-0", "island-0: step 10 v1/4", done=1, total=4)
    log.close()
    progress, status, end = mine.records
    assert (progress.name, progress.levelno, progress.getMessage()) == ("dtrain.coordinator", logging.INFO,
                                                                         "v1: merged 2 deltas (all in)")
    assert getattr(progress, STATUS_KEY, None) is None and getattr(progress, ELAPSED_S) >= 0
    assert status.getMessage() == "island-0: step 10 v1/4"
    assert (getattr(status, STATUS_KEY), getattr(status, STATUS_DONE), getattr(status, STATUS_TOTAL)) == (
        "island-0", 1, 4)
    assert not getattr(status, STATUS_END, False)
    assert (end.getMessage(), getattr(end, STATUS_KEY), getattr(end, STATUS_END)) == ("island-0: step 10 v1/4",
                                                                                       "island-0", True)
    assert capfd.readouterr().err == ""  # the user's handler, nobody else's


def test_dtrain_at_warning_is_silent_but_for_warnings(tmp_path, dtrain_logger):
    mine = Records()
    dtrain_logger.addHandler(mine)
    dtrain_logger.setLevel(logging.WARNING)
    log = RunLog(tmp_path)
    log.progress("a progress line")
    log.status("train", "train: step 10/60", done=10, total=60)
    logging.getLogger("dtrain.worker").warning("a warning")
    log.close()
    assert [r.getMessage() for r in mine.records] == ["a warning"]


def test_the_clis_handler_prints_progress_lines_as_before_and_leaves_with_the_command(tmp_path, dtrain_logger):
    out, before = io.StringIO(), dtrain_logger.level
    log = RunLog(tmp_path)
    with cli_logging(out) as handler:  # a StringIO is no terminal: plain lines
        assert isinstance(handler, PlainHandler) and dtrain_logger.level == logging.INFO
        assert not dtrain_logger.propagate  # a root handler (a dependency's basicConfig) would print each twice
        log.progress("resumed from checkpoint at step 30")
        log.status("train", "train: step 40/60 train loss 3.2000", done=40, total=60)
        logging.getLogger("dtrain.coordinator").warning("a warning")
        with cli_logging(io.StringIO()) as inner:  # a command run from a command: still one handler
            assert inner is handler
            log.progress("inside")
    log.progress("after the command: not shown")
    log.close()
    lines = out.getvalue().splitlines()
    assert [LINE.fullmatch(line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "resumed from checkpoint at step 30", "train: step 40/60 train loss 3.2000", "a warning", "inside"]
    assert lines[0].startswith("[    0.0s] ")  # the format of before: dtrain.runlog.progress_line
    assert handler not in dtrain_logger.handlers and dtrain_logger.level == before and dtrain_logger.propagate
