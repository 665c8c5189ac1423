"""The run folder: ``events.jsonl`` (one JSON object per event), ``summary.json``, and progress lines."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


class RunLog:
    """Appends events to ``RUN_DIR/events.jsonl`` and prints progress lines."""

    def __init__(self, run_dir: str | Path, quiet: bool = False, stream: TextIO | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self._events = open(self.dir / "events.jsonl", "a", buffering=1)
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Calls ``listener(record)`` after each event is written (the coordinator's dashboard history, its
        telemetry's fault counters): what a run shows and exports is what its events.jsonl records."""
        self._listeners.append(listener)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"t": round(time.time(), 3), "elapsed_s": round(time.time() - self.t0, 3), "event": kind, **fields}
        self._events.write(json.dumps(record, default=_jsonable) + "\n")
        for listener in self._listeners:
            listener(record)
        return record

    def progress(self, line: str) -> None:
        if not self.quiet:
            print(f"[{time.time() - self.t0:7.1f}s] {line}", file=self.stream, flush=True)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=_jsonable) + "\n")
        tmp.replace(path)  # atomic: readers never see half a summary
        return path

    def close(self) -> None:
        self._events.close()


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


def fmt_rate(x: float) -> str:
    """A rate for a progress line: ``12.3k`` below a million, ``1.23M`` from there."""
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def read_events(run_dir: str | Path, skip_torn: bool = False) -> list[dict[str, Any]]:
    """The events of ``RUN_DIR/events.jsonl``. ``skip_torn``: leave out lines that do not parse, which a process
    killed while it wrote one leaves behind (a restarted process appends after them); else they raise."""
    with open(Path(run_dir) / "events.jsonl", errors="replace" if skip_torn else "strict") as f:
        lines = [line for line in f if line.strip()]
    if not skip_torn:
        return [json.loads(line) for line in lines]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
