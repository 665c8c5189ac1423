"""The run's history per version, as the dashboard draws it on load (``GET /api/history``) and ``dtrain dashboard
RUN_DIR`` serves it after the run: one point per merged version (when, tokens merged, bytes, merge time, pushes,
tokens/s since the version before, each island's latest train loss), the recoveries (a coordinator resumed, an
island lost, an island that joined again), when the run started and finished, and the version its data is
expected to end at (:func:`dtrain.runlog.expected_end`, at the pace of the latest versions: a lost island moves it).

A fold over the coordinator's events (:meth:`RunSeries.observe`, fed by :class:`coordinator.history.RunHistory`),
bounded in memory: past :data:`MAX_POINTS` points every other one is dropped (the newest is always kept) and
:attr:`RunSeries.stride` doubles, so a long run keeps its whole shape at a coarser grain. The islands' train losses
come from their heartbeats, which are not events: the coordinator writes the series to ``RUN_DIR/history.json``
(:data:`HISTORY_FILE`; after a merge at most every :data:`SAVE_EVERY_S`, and when the run finishes or the
coordinator stops), and a replay (``--resume``, ``dtrain dashboard``) takes the losses back from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dtrain.runlog import expected_end

HISTORY_FILE = "history.json"
MAX_POINTS = 2000  # points kept in memory (and in the file) before every other one is dropped
SAVE_EVERY_S = 2.0  # the file is rewritten after a merge at most this often (and at the run's end)
MAX_RECOVERIES = 200  # recoveries kept (the newest)


class RunSeries:
    """The fold (see the module docstring). Not thread-safe by itself: the coordinator feeds it under its lock,
    and :meth:`doc` copies what it reads."""

    def __init__(self, path: Path | None = None) -> None:
        """``path``: the file to keep (:meth:`save`); None: none (a replay of a finished run)."""
        self.path = path
        self.points: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []  # {version, tokens, loss, t, confirmed}
        self.stride = 1
        self.run: dict[str, Any] = {}  # run_id, total_versions, expected_versions, tokens_total, islands, mode
        self.started_at: float | None = None
        self.finished: dict[str, Any] | None = None  # {"t", "reason", "version"} once the run finished
        self.stopped_at: float | None = None
        self.known_losses: dict[int, dict[str, float]] = {}  # version -> train losses, from an earlier file
        self._last_merge_t: float | None = None
        self._lost: dict[str, float] = {}  # island -> when it was lost (a later join is a rejoin)
        self._joined: set[str] = set()
        self._names: dict[str, str] = {}  # island id -> its name (its Join's): what the page shows
        self._saved_at = 0.0
        self.expected: int | None = None  # the version the data is expected to end at, after the latest merge

    def load_losses(self, run_dir: Path) -> None:
        """Takes the train losses back from ``run_dir``'s history file, if any (a replay: heartbeats are not
        events). A file that cannot be read is ignored: the losses are then missing from the chart, nothing else."""
        try:
            doc = json.loads((Path(run_dir) / HISTORY_FILE).read_text())
            self.known_losses = {int(p["version"]): dict(p.get("train_loss") or {}) for p in doc["points"]}
        except (OSError, ValueError, KeyError, TypeError):
            self.known_losses = {}

    def observe(self, record: dict[str, Any], tokens: int, train_losses: dict[str, float]) -> None:
        """Folds one event. ``tokens``: tokens merged into the event's version (cumulative; round_merged only);
        ``train_losses``: the islands' latest train losses (their heartbeats) at this event."""
        kind = record.get("event")
        t = float(record.get("t", 0.0))
        if kind == "run_started":
            self.run = {k: record.get(k) for k in ("run_id", "mode", "islands", "total_versions",
                                                   "expected_versions", "tokens_total")}
            self.started_at = t
        elif kind == "coordinator_started" and self.started_at is None:
            self.started_at = t
        elif kind == "round_merged":
            self._merged(record, t, tokens, train_losses)
        elif kind == "eval":
            self.evals.append({"version": int(record["version"]), "tokens": int(record.get("tokens", 0)),
                               "loss": float(record["loss"]), "t": t, "confirmed": bool(record.get("confirmed"))})
            if len(self.evals) > MAX_POINTS:
                self.evals = [e for i, e in enumerate(self.evals) if i % 2 == 0 or i == len(self.evals) - 1]
        elif kind == "coordinator_resumed":
            version = int(record.get("version", 0))
            self.points = [p for p in self.points if p["version"] <= version]
            self._last_merge_t = None  # the time down is not a slow round
            self._recovery(t, "coordinator", "", version, f"coordinator resumed from version {version}")
        elif kind == "island_lost":
            island = self._name(record)
            self._lost[island] = t
            self._recovery(t, "lost", island, self._version(), f"{island} lost: {record.get('reason', '')}")
        elif kind == "island_joined":
            # the islands' train losses are keyed by island id (their heartbeats'): the id -> the name shown
            self._names[str(record.get("island_id") or record.get("island", ""))] = str(record.get("name")
                                                                                        or record.get("island", ""))
            island = self._name(record)
            if island in self._joined:
                since = self._lost.pop(island, None)
                after = f" after {t - since:.0f} s" if since is not None else ""
                self._recovery(t, "rejoined", island, self._version(), f"{island} joined again{after}")
            self._joined.add(island)
        elif kind == "run_finished":
            self.finished = {"t": t, "reason": record.get("reason", ""), "version": record.get("version")}
            self.save(force=True, now=t)
        elif kind == "coordinator_stopped":
            self.stopped_at = t
            if record.get("run_over") and self.finished is None:  # the coordinator exited at the run's end
                self.finished = {"t": t, "reason": record.get("reason", ""), "version": record.get("version")}
            self.save(force=True, now=t)

    def _name(self, record: dict[str, Any]) -> str:
        island = str(record.get("island", ""))
        return self._names.get(island, island)

    def _version(self) -> int:
        return self.points[-1]["version"] if self.points else 0

    def _recovery(self, t: float, kind: str, island: str, version: int, text: str) -> None:
        self.recoveries.append({"t": t, "kind": kind, "island": island, "version": version, "text": text})
        del self.recoveries[:-MAX_RECOVERIES]

    def _merged(self, record: dict[str, Any], t: float, tokens: int, train_losses: dict[str, float]) -> None:
        version = int(record["version"])
        pushes = record.get("pushes", [])
        round_tokens = sum(int(p.get("tokens", 0)) for p in pushes)
        rate = None
        if self._last_merge_t is not None and t > self._last_merge_t:
            rate = round(round_tokens / (t - self._last_merge_t), 3)
        self._last_merge_t = t
        losses = train_losses or self.known_losses.get(version, {})
        self.points.append({"version": version, "t": t, "tokens": tokens, "round_tokens": round_tokens,
                            "pushes": len(pushes), "bytes_in": sum(int(p.get("bytes", 0)) for p in pushes),
                            "merge_s": float(record.get("merge_s", 0.0)), "tokens_per_s": rate,
                            "train_loss": {n: float(v) for n, v in sorted((self._names.get(k, k), v)
                                                                          for k, v in losses.items())
                                           if n not in self._lost}})  # a lost island's last loss is stale
        if len(self.points) > MAX_POINTS:
            last = len(self.points) - 1
            self.points = [p for i, p in enumerate(self.points) if i % 2 == 0 or i == last]
            self.stride *= 2
        total, plan = int(self.run.get("tokens_total") or 0), int(self.run.get("expected_versions") or 0)
        if total and not self.run.get("total_versions"):  # the data decides the end: "v5 of ~N"
            self.expected = expected_end(version, total - tokens, [p["round_tokens"] for p in self.points], plan)
        self.save(now=t)

    def doc(self) -> dict[str, Any]:
        """The history document (JSON-able)."""
        return {"source": "coordinator", "run": dict(self.run), "expected_versions": self.expected,
                "started_at": self.started_at,
                "finished": self.finished, "stopped_at": self.stopped_at, "stride": self.stride,
                "points": list(self.points), "evals": list(self.evals), "recoveries": list(self.recoveries)}

    def save(self, force: bool = False, now: float = 0.0) -> None:
        """Writes :meth:`doc` to :attr:`path` (atomically: a reader never sees half a file), unless one was written
        less than :data:`SAVE_EVERY_S` ago (``force``: regardless). No path: nothing."""
        if self.path is None or (not force and now - self._saved_at < SAVE_EVERY_S):
            return
        self._saved_at = now
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.doc(), allow_nan=False))
            os.replace(tmp, self.path)
        except (OSError, ValueError):  # a view, not the record: events.jsonl is; the next save tries again
            tmp.unlink(missing_ok=True)
