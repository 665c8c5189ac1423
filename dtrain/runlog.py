"""The run folder: ``events.jsonl`` (one JSON object per event), ``summary.json``, and progress records.

``events.jsonl`` is the machine-readable record of a run. The human-readable lines are Python ``logging`` records
at INFO on one of the progress channels, :data:`CHANNELS` (``dtrain.run``, ``dtrain.coordinator``,
``dtrain.worker``, ``dtrain.simulate``: named loggers under ``dtrain``, one per kind of process, the only logger
names the library types by hand; every other library logger is its module's, ``logging.getLogger(__name__)``).
The library installs no handler and sets no level, so an embedding program routes or silences them with the
standard calls (``logging.getLogger("dtrain").setLevel(logging.WARNING)``; a handler of its own on ``"dtrain"``).
The command line's handlers (:mod:`dtrain_cli.logs`) show them as ``[ 12.3s] text`` lines, and on a terminal as
live status lines that ``rich`` redraws in place.

:meth:`RunLog.progress` logs one line that stays; :meth:`RunLog.status` logs how far something is (an island's
step, version and loss; the simulation's state), a record that carries, as ``extra``, :data:`STATUS_KEY` (which
status line it updates), :data:`STATUS_DONE` and :data:`STATUS_TOTAL` (its bar) and :data:`STATUS_EVERY_S` (the
least seconds between two plain lines of that key). :meth:`RunLog.close` logs each key's last status record again
with :data:`STATUS_END` True: that status line is final (the CLI stops redrawing it; a plain line shows nothing).
Every record of a RunLog carries :data:`ELAPSED_S`, the seconds since the RunLog began, which the
``[ elapsed s]`` of a line shows.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The LogRecord attributes (``extra``) that RunLog's records carry.
ELAPSED_S = "elapsed_s"  # seconds since the RunLog began
STATUS_KEY = "status_key"  # a status record: which status line it updates
STATUS_DONE = "status_done"  # a status record: how far (int or None)
STATUS_TOTAL = "status_total"  # a status record: out of how many (int or None: not known)
STATUS_EVERY_S = "status_every_s"  # a status record: the least seconds between two plain lines of its key
STATUS_END = "status_end"  # a status record: True on the one RunLog.close logs for each key (its last line again)

# The progress channels: the loggers a RunLog's records go to (``RunLog(logger=...)``), named by the kind of
# process, not by module, so that a run's progress is one logger to route whichever module logs it. They are the
# only logger names typed by hand in dtrain/, coordinator/ and workers/ (tests/test_logging.py checks it).
RUN_CHANNEL = "dtrain.run"  # `train` and `simulate --inprocess`
COORDINATOR_CHANNEL = "dtrain.coordinator"  # the coordinator's service
WORKER_CHANNEL = "dtrain.worker"  # an island's worker
SIMULATE_CHANNEL = "dtrain.simulate"  # the process-mode simulate driver
CHANNELS = (RUN_CHANNEL, COORDINATOR_CHANNEL, WORKER_CHANNEL, SIMULATE_CHANNEL)

# What :func:`printable` escapes: the C0 and C1 controls and DEL (ESC starts a terminal's escape sequences, NUL and
# CR/LF forge or hide lines), and the Unicode characters that reorder or hide text on a terminal: the line and
# paragraph separators, the zero-width marks and the bidirectional overrides and isolates.
CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class RunLog:
    """Appends events to ``RUN_DIR/events.jsonl`` and logs progress and status records."""

    def __init__(self, run_dir: str | Path, quiet: bool = False, logger: str = RUN_CHANNEL, t0: float | None = None):
        """``logger``: the name of the logger the records go to (one of :data:`CHANNELS`). ``quiet``: no records
        at all (events are still written). ``t0``: when the run began (``time.time()``; default now): what
        ``elapsed_s`` counts from, for a RunLog made after the command's first lines."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time() if t0 is None else t0
        self._events = open(self.dir / "events.jsonl", "a", buffering=1)
        self.quiet = quiet
        self.logger = logging.getLogger(logger)
        self._status: dict[str, tuple[str, dict[str, Any]]] = {}  # status key -> its last line and extra
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._names: IslandNames | None = None

    def name_islands(self, islands: Callable[[], Mapping[str, tuple[str, int]]]) -> None:
        """From now on, events and progress lines name islands by name (:class:`IslandNames`): ``islands()``
        returns each island id the coordinator knows with its (name, shard now)."""
        self._names = IslandNames(islands)

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Calls ``listener(record)`` after each event is written (the coordinator's dashboard history, its
        telemetry's fault counters): what a run shows and exports is what its events.jsonl records."""
        self._listeners.append(listener)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        if self._names is not None:
            fields = self._names.fields(fields)
        record = {"t": round(time.time(), 3), "elapsed_s": round(time.time() - self.t0, 3), "event": kind, **fields}
        self._events.write(json.dumps(record, default=_jsonable) + "\n")
        for listener in self._listeners:
            listener(record)
        return record

    def progress(self, line: str) -> None:
        """Logs one line that stays (an INFO record; shown as ``[ elapsed s] line``, above any live status
        lines). Control characters in it are escaped (:func:`printable`): a line may quote what a client sent."""
        if not self.quiet:
            if self._names is not None:
                line = self._names.text(line)
            self.logger.info(printable(line), extra={ELAPSED_S: time.time() - self.t0})

    def status(self, key: str, line: str, done: int | None = None, total: int | None = None,
               every_s: float = 0.0) -> None:
        """Logs status line ``key`` as ``line`` (build it with :func:`fmt_progress`): an INFO record with the
        key, ``done`` and ``total`` as ``extra``. On a terminal the CLI redraws that line in place, with a bar of
        ``done`` out of ``total`` when ``total`` is given; in a pipe it prints it as a progress line unless this
        key's line was printed less than ``every_s`` seconds ago."""
        if not self.quiet:
            extra = {STATUS_KEY: key, STATUS_DONE: done, STATUS_TOTAL: total, STATUS_EVERY_S: every_s}
            line = printable(line)
            self._status[key] = line, extra
            self.logger.info(line, extra={**extra, ELAPSED_S: time.time() - self.t0})

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=_jsonable) + "\n")
        tmp.replace(path)  # atomic: readers never see half a summary
        return path

    def close(self) -> None:
        """Closes events.jsonl; logs each status line's end (its last record again, :data:`STATUS_END` True)."""
        for line, extra in self._status.values():
            self.logger.info(line, extra={**extra, ELAPSED_S: time.time() - self.t0, STATUS_END: True})
        self._status.clear()
        self._events.close()


class IslandNames:
    """One island name everywhere a person or a tool reads it. The coordinator keys an island's record by its
    island id, ``NAME-SHARD`` (its name and the shard it got at its first Join, docs/cli.md), which the protocol
    carries; its events and log lines name the island by its name instead, here, in one place: an event's
    ``island`` field holding a known id becomes the name, with the island's shard now as ``shard`` (unless the
    event gives one) and the id as ``island_id``; a list of ids (``islands``, ``confirmed_by``) and the
    ``island`` of a dict in a list (``round_merged``'s pushes) become names; a known id in any other text (a
    reason, an error, a progress line) becomes the name. Push ids (which start with the id) and unknown ids
    (what a client sent) stay as they are. ``islands()``: each id the coordinator knows -> (name, shard now); an
    id seen once keeps its name after its record is forgotten."""

    def __init__(self, islands: Callable[[], Mapping[str, tuple[str, int]]]):
        self.islands = islands
        self.known: dict[str, tuple[str, int]] = {}
        self._pattern: tuple[int, re.Pattern[str] | None] = (0, None)  # built for how many known ids

    def _refresh(self) -> dict[str, tuple[str, int]]:
        self.known.update(self.islands())
        return self.known

    def fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """An event's fields with islands named (see the class docstring)."""
        known = self._refresh()
        out: dict[str, Any] = {}
        for key, value in fields.items():
            if key == "island" and isinstance(value, str) and value in known:
                name, shard = known[value]
                out["island"] = name
                if "shard" not in fields:
                    out["shard"] = shard
                out["island_id"] = value
            elif key in ("island_id", "push_id", "push_ids"):
                out[key] = value
            elif isinstance(value, str):
                out[key] = self._text(value, known)
            elif isinstance(value, list):
                out[key] = [known[v][0] if isinstance(v, str) and v in known else
                            {**v, "island": known[v["island"]][0]} if isinstance(v, dict)
                            and isinstance(v.get("island"), str) and v["island"] in known else v for v in value]
            else:
                out[key] = value
        return out

    def text(self, text: str) -> str:
        """``text`` with each known island id in it written as the island's name."""
        return self._text(text, self._refresh())

    def _text(self, text: str, known: Mapping[str, tuple[str, int]]) -> str:
        if len(known) != self._pattern[0]:  # ids are only ever added: their count says when the pattern is stale
            # longest first: island-1-0.1 before island-1-0
            alternatives = "|".join(re.escape(i) for i in sorted(known, key=len, reverse=True))
            # not inside a longer word or id: a push id (the id and a suffix) stays as it is
            self._pattern = len(known), (re.compile(rf"(?<![\w.-])(?:{alternatives})(?![\w-]|\.\d)")
                                         if known else None)
        pattern = self._pattern[1]
        return text if pattern is None else pattern.sub(lambda m: known[m.group(0)][0], text)


def printable(text: str, limit: int = 0) -> str:
    """``text`` safe to write into a log line or onto a terminal: each control character (:data:`CONTROL_RE`)
    written as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``), so a line stays one line and a terminal
    sees no escape sequence. ``limit`` > 0: at most that many characters of ``text`` are
    kept, followed by ``...(N characters)``. The one escaping function of the coordinator's, the workers' and
    ``dtrain status``'s output: whatever a client sent reaches a log or a terminal only through it."""
    cut = limit > 0 and len(text) > limit
    shown = text[:limit] if cut else text
    shown = CONTROL_RE.sub(_escape, shown)
    return f"{shown}...({len(text):,} characters)" if cut else shown


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def progress_line(elapsed_s: float, line: str) -> str:
    """A progress line as printed: ``[ elapsed s] line`` (the CLI's lines of :meth:`RunLog.progress`; also a
    process's lines from before its RunLog exists)."""
    return f"[{elapsed_s:7.1f}s] {line}"


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def json_number(x: float | int | None) -> float | int | str | None:
    """A number for strict JSON (events, Status): NaN and infinities as ``"nan"``, ``"inf"``, ``"-inf"``; ints and
    None as they are."""
    if x is None or isinstance(x, int) or math.isfinite(x):
        return x
    return str(float(x))


def fmt_bytes(n: int) -> str:
    """A byte count for people: ``812 B``, ``3.0 MiB``, ``1.2 GiB`` (binary units, one decimal)."""
    if n < 1024:
        return f"{n:,} B"
    x = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:,.1f} TiB"


def fmt_rate(x: float) -> str:
    """A rate for a progress line: ``12.3k`` below a million, ``1.23M`` from there."""
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def fmt_progress(name: str, *, step: int | None = None, steps: int = 0, version: int | None = None,
                 total: int | str = 0, data: tuple[int, int] | None = None, loss: float | None = None,
                 eval_loss: float | None = None, eval_version: int | None = None, tokens_per_s: float | None = None,
                 extra: str = "") -> str:
    """A progress line: ``NAME: step S/STEPS vX/TOTAL data C/N train loss L eval loss E (vV) tok/s R EXTRA``, each
    part only when given. ``steps``: the step the run ends at; ``total``: the version the run ends at (0: not known;
    a string such as ``"~3"`` for an estimate); ``data``: (cursor, length) of the data, for a run whose end the data
    decides; ``eval_version``: the version the eval loss is of (the coordinator evaluates every few versions)."""
    parts = [f"{name}:"]
    if step is not None:
        parts.append(f"step {step}/{steps}" if steps else f"step {step}")
    if version is not None:
        parts.append(f"v{version}/{total}" if total else f"v{version}")
    if data is not None:
        parts.append(f"data {data[0]}/{data[1]}")
    if loss is not None:
        parts.append(f"train loss {loss:.4f}")
    if eval_loss is not None:
        parts.append(f"eval loss {eval_loss:.4f}" + (f" (v{eval_version})" if eval_version is not None else ""))
    if tokens_per_s is not None:
        parts.append(f"tok/s {fmt_rate(tokens_per_s)}")
    if extra:
        parts.append(extra)
    return " ".join(parts)


RECENT_VERSIONS = 5  # the versions whose pace :func:`expected_end` projects


def expected_end(version: int, left: int, recent: Sequence[int], planned: int) -> int:
    """The version a run whose data decides its end (step rounds) is expected to end at, the ``~N`` of "v5 of ~N":
    ``version`` plus the versions the data ``left`` takes at the pace of the ``recent`` versions (the data each
    merged, at most the last :data:`RECENT_VERSIONS`: the rounds of the islands live now, so that a lost or
    restarted island's absence moves the figure), or ``planned`` (the run's plan: its data over every island's
    round) before a version was merged. ``left`` and ``recent`` in one unit (tokens, or sequences)."""
    recent = [n for n in recent[-RECENT_VERSIONS:] if n > 0]
    if not recent:
        return max(planned, version)
    per_version = sum(recent) / len(recent)
    return version + max(math.ceil(max(left, 0) / per_version - 1e-9), 0)


class EventTail:
    """Reads a growing ``RUN_DIR/events.jsonl`` (a live run's): each :meth:`read` returns the events appended since
    the last one. A line not yet ended is kept for the next read; one that does not parse (torn by a process killed
    while writing it) is skipped. A file not there yet reads as no events."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "events.jsonl"
        self.offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


def process_dir(island_dir: Path, index: int) -> Path:
    """Where process ``index`` of an island writes its events, summary and log: the island's run folder for
    process 0 (the one that talks to the coordinator), ``process-I`` under it for the others. The worker writes
    there (workers/app.py) and ``dtrain simulate`` and the tests read there."""
    return island_dir if index == 0 else island_dir / f"process-{index}"


def read_events(run_dir: str | Path, skip_torn: bool = False, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The events of ``RUN_DIR/events.jsonl``. ``skip_torn``: leave out lines that do not parse, which a process
    killed while it wrote one leaves behind (a restarted process appends after them); else they raise.
    ``missing_ok``: [] when there is no file to read (a process that never started), else OSError."""
    try:
        with open(Path(run_dir) / "events.jsonl", errors="replace" if skip_torn else "strict") as f:
            lines = [line for line in f if line.strip()]
    except OSError:
        if missing_ok:
            return []
        raise
    if not skip_torn:
        return [json.loads(line) for line in lines]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# The events that record a fault, or a service's answer to one, and the kind each is (:func:`fault_kind`): what the
# coordinator's Status lists as recent faults, the ``dtrain.faults`` metric counts and ``dtrain plot`` marks.
FAULT_EVENTS = {
    "island_lost": "island_lost", "push_quarantined": "delta_rejected", "merge_rejected": "delta_rejected",
    "push_refused": "push_refused", "push_aborted": "push_aborted", "device_quarantined": "device_quarantined",
    "auth_failed": "auth_failed", "request_invalid": "request_invalid", "digest_mismatch": "digest_mismatch",
    "nan_guard": "nan_guard", "coordinator_failed": "coordinator_failed", "coordinator_resumed": "coordinator_resumed",
    "leases_paused": "leases_paused", "checkpoint_skipped": "checkpoint_skipped",
    "eval_disagreement": "eval_disagreement",
}


def fault_kind(record: Mapping[str, Any]) -> str:
    """The fault an event records (:data:`FAULT_EVENTS`; a ``push_received`` with status "drop" is a
    ``delta_dropped``), or ''."""
    kind = str(record.get("event", ""))
    if kind == "push_received":
        return "delta_dropped" if record.get("status") == "drop" else ""
    return FAULT_EVENTS.get(kind, "")
