"""The library logs, the command line shows: a library run prints nothing below WARNING without the CLI's handlers;
``logging.getLogger("dtrain").setLevel(logging.WARNING)`` silences its progress; a user's own handler on
``"dtrain"`` gets the progress and status records (with their extras, and each status line's end when its
RunLog closes); the CLI's handler prints the same ``[ x.xs] text`` lines as before, and goes away after the
command. Library modules log on their own module's logger (``coordinator.*`` ones too reach the CLI's handler);
the only logger names typed by hand are the RunLog progress channels."""

from __future__ import annotations

import ast
import io
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO_ROOT, TINY, make_text
from dtrain.runlog import CHANNELS, ELAPSED_S, STATUS_DONE, STATUS_END, STATUS_KEY, STATUS_TOTAL, RunLog
from dtrain_cli.logs import LOGGERS, PlainHandler, cli_logging, quiet

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
def project_loggers() -> Iterator[list[logging.Logger]]:
    """The loggers of the project's library packages (``dtrain``, ``coordinator``, ``workers``), their levels and
    handlers put back as they were after the test."""
    loggers = [logging.getLogger(name) for name in LOGGERS]
    before = [(logger.level, list(logger.handlers)) for logger in loggers]
    yield loggers
    for logger, (level, handlers) in zip(loggers, before, strict=True):
        logger.setLevel(level)
        logger.handlers[:] = handlers


@pytest.fixture
def dtrain_logger(project_loggers: list[logging.Logger]) -> logging.Logger:
    """The ``dtrain`` logger, its level and handlers put back as they were after the test."""
    return project_loggers[0]


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


def test_in_a_pipe_a_status_line_is_not_repeated_unchanged_and_the_clock_only_goes_forward(tmp_path, dtrain_logger):
    """Two RunLogs of one process, the later one started 30 s into the command (``t0``) and one started at its
    own creation (as a RunLog made after slow start-up work was): the lines' elapsed never goes back. A status
    line (every_s 0: each may print) is printed again only when its text changed."""
    import time

    out = io.StringIO()
    early, late = RunLog(tmp_path / "a", t0=time.time() - 30.0), RunLog(tmp_path / "b")
    with cli_logging(out):
        early.progress("token store written")
        for text in ("simulate: waiting", "simulate: waiting", "simulate: island-0 step 10", "simulate: waiting"):
            late.status("simulate", text)
    early.close()
    late.close()
    lines = out.getvalue().splitlines()
    assert [LINE.fullmatch(line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "token store written", "simulate: waiting", "simulate: island-0 step 10", "simulate: waiting"]
    elapsed = [float(line[1:].split("s]")[0]) for line in lines]
    assert elapsed[0] >= 30.0 and elapsed == sorted(elapsed)


def test_a_coordinator_modules_records_reach_the_clis_handler_and_quiet_keeps_its_warnings(project_loggers):
    """``coordinator.*`` modules log under ``coordinator`` (their own module's logger), not under ``dtrain``: the
    CLI's one handler shows them (and a ``workers.*`` module's), ``--quiet`` silences their INFO records but not their
    warnings, and after the command every package logger is as it was."""
    from coordinator import shard, streams

    assert LOGGERS == ("dtrain", "coordinator", "workers")
    before = [(logger.level, logger.propagate) for logger in project_loggers]
    out = io.StringIO()
    with cli_logging(out) as handler:
        logging.getLogger(streams.__name__).warning("recording an idle push stream failed")
        logging.getLogger(shard.__name__).info("coordinator shard 1 restored to version 3")
        logging.getLogger("workers.island").info("an island module's line")
        quiet()
        logging.getLogger(shard.__name__).info("not shown: --quiet")
        logging.getLogger(streams.__name__).warning("a warning still shows")
        assert all(handler in logger.handlers and not logger.propagate for logger in project_loggers)
    assert [LINE.fullmatch(line).group(1) for line in out.getvalue().splitlines()] == [  # type: ignore[union-attr]
        "recording an idle push stream failed", "coordinator shard 1 restored to version 3",
        "an island module's line", "a warning still shows"]
    assert [(logger.level, logger.propagate) for logger in project_loggers] == before
    assert not any(handler in logger.handlers for logger in project_loggers)


def hand_typed_loggers(source: str) -> list[str]:
    """The logger names typed by hand in a module's ``source`` that are not a RunLog progress channel
    (:data:`dtrain.runlog.CHANNELS`): a string (or f-string) passed to ``getLogger`` or as ``RunLog(logger=...)``,
    directly or through a module-level name bound to a string."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name == "getLogger" and node.args:
            given = node.args[0]
        elif name == "RunLog":
            given = next((k.value for k in node.keywords if k.arg == "logger"), None)
        else:
            continue
        if isinstance(given, ast.Name) and given.id in constants:
            text = constants[given.id]
        elif isinstance(given, ast.Constant) and isinstance(given.value, str):
            text = given.value
        elif isinstance(given, ast.JoinedStr):
            text = ast.unparse(given)
        else:
            continue  # __name__, or a name the caller was given
        if text not in CHANNELS:
            found.append(f"line {node.lineno}: {text}")
    return found


def test_library_modules_log_on_their_own_modules_logger_not_a_name_typed_by_hand():
    """Every logger in dtrain/, coordinator/ and workers/ is ``logging.getLogger(__name__)``, but the RunLog
    progress channels, named in one place (:data:`dtrain.runlog.CHANNELS`)."""
    assert hand_typed_loggers('import logging\nlog = logging.getLogger("dtrain.data.corpus")\n') == [
        "line 2: dtrain.data.corpus"]
    assert hand_typed_loggers('from logging import getLogger\nNAME = "dtrain.coordinator.shard"\n'
                              'log = getLogger(NAME)\nother = getLogger(f"dtrain.{NAME}")\n') == [
        "line 3: dtrain.coordinator.shard", "line 4: f'dtrain.{NAME}'"]
    assert hand_typed_loggers('r = RunLog(d, logger="dtrain.shard")\nlog = logging.getLogger(__name__)\n'
                              'w = RunLog(d, logger="dtrain.worker")\n') == ["line 1: dtrain.shard"]
    root = Path(REPO_ROOT)
    files = sorted(p for package in ("dtrain", "coordinator", "workers") for p in (root / package).rglob("*.py"))
    assert len(files) > 50
    typed = {str(p.relative_to(root)): found for p in files if (found := hand_typed_loggers(p.read_text()))}
    assert typed == {}
