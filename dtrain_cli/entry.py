"""The one wrapper around every command-line entry point (``dtrain ...`` and the ``benchmarks/*.py`` scripts):
a user error is one line on stderr and an exit status, never a traceback; the library's log records are shown
(progress lines, live status lines on a terminal: :func:`dtrain_cli.logs.cli_logging`) while the command runs.

- ``dtrain.config.sections.ConfigError`` (a config file, a ``--set``, a flag's value): ``PROG: config error: ...``,
exit 2;
- ``dtrain.errors.DtrainError`` (a run cannot go on as asked) and ``dtrain.data.corpus.DataError`` (a data source):
  ``PROG: error: ...``, exit 1;
- a closed stdout (``dtrain config --reference | head -1``): the rest of the output goes to /dev/null, exit 1,
  as the Python documentation's "Note on SIGPIPE" does it;
- Ctrl-C: ``PROG: interrupted``, exit 130 (the shell's status for SIGINT).

Anything else is a bug and keeps its traceback. With ``DTRAIN_TRACEBACK=1`` in the environment a user error's
traceback is printed too, above its line (for a developer chasing where an error came from, e.g. in the workers a
``dtrain simulate`` starts: they inherit the environment). Usage: ``sys.exit(run_main("benchmarks/x.py", main))``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from dtrain.config.sections import ConfigError
from dtrain.errors import DtrainError
from dtrain_cli.logs import cli_logging


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``dtrain worker: error: ...``), exit status 2: every
    entry point's (``dtrain``, the benchmarks, ``python -m dtrain_cli.probe``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help shows the usage)\n")


def user_error(e: BaseException) -> tuple[int, str] | None:
    """(exit status, label) for an error the user can fix, None for anything else."""
    if isinstance(e, ConfigError):
        return 2, "config error"
    if isinstance(e, DtrainError):
        return 1, "error"
    from dtrain.data.corpus import DataError  # numpy: only once there is an error to classify

    if isinstance(e, DataError):
        return 1, "error"
    return None


def _stdout_to_devnull() -> None:
    """Points stdout's file descriptor at /dev/null, so the interpreter's last flush at exit finds no closed pipe
    (it would print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (replaced by a test's capture): nothing to redirect
        pass
    finally:
        os.close(devnull)


def run_main(prog: str, main: Callable[[], object]) -> int:
    """Calls ``main()`` with the CLI's log handler on the ``dtrain`` logger (:func:`dtrain_cli.logs.cli_logging`)
    and returns its exit status (an int it returned, else 0); the errors above are one line on stderr, prefixed with
    ``prog`` (e.g. ``dtrain simulate``), and their exit status. ``SystemExit`` (argparse's usage errors, exit 2)
    passes through."""
    try:
        try:
            with cli_logging():  # closed before an error's line: live status lines stop above it
                status = main()
        finally:
            sys.stdout.flush()  # a closed pipe shows here, inside the handler, not in the interpreter's exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        known = user_error(e)
        if known is None:
            raise
        code, label = known
        if os.environ.get("DTRAIN_TRACEBACK") == "1":
            import traceback

            traceback.print_exception(e)
        print(f"{prog}: {label}: {e}", file=sys.stderr)
        return code
    return status if isinstance(status, int) and not isinstance(status, bool) else 0
