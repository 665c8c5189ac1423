"""``dtrain dashboard RUN_DIR``: the coordinator's page for a run that is over (or whose coordinator is gone), served
from the files the coordinator wrote: its ``events.jsonl`` (folded as a resumed coordinator folds them:
:meth:`coordinator.history.RunHistory.replay`) and its ``history.json`` (the islands' train losses).

The page and its two documents are the live dashboard's (:class:`coordinator.dashboard.Dashboard`): ``/api/status``
is a Status document rebuilt from the events (the islands' rows from their Join and merge records, every island
``stopped``), ``/api/history`` the history with ``"source": "files"``. No auth: it binds 127.0.0.1 unless told
otherwise, and serves only what the run folder holds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coordinator.dashboard import Dashboard
from coordinator.history import RunHistory, island_of
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from dtrain.status_doc import message_dict


def run_status(run_dir: Path, history: RunHistory, now: float) -> dict[str, Any]:
    """The Status document of a run from its events (what a Status call answered at its end, as near as the
    events record it)."""
    rows: dict[str, pb.IslandStatus] = {}
    run: dict[str, Any] = {}
    end: dict[str, Any] = {}
    stopped: dict[str, Any] = {}
    version = tokens = bytes_in = 0
    for e in read_events(run_dir, skip_torn=True):
        kind = e.get("event")
        if kind == "run_started":
            run = e
        elif kind == "island_joined":
            name = island_of(e)
            row = rows.setdefault(name, pb.IslandStatus(island_id=str(e.get("island_id") or name),
                                                        name=str(e.get("name", name))))
            row.shard_index, row.hardware = int(e.get("shard", 0)), str(e.get("hardware", ""))
            row.devices, row.device_kind = int(e.get("devices", 0)), str(e.get("device_kind", ""))
        elif kind == "round_merged":
            version = int(e["version"])
            for p in e.get("pushes", []):
                row = rows.setdefault(island_of(p), pb.IslandStatus(island_id=str(p.get("island_id") or island_of(p)),
                                                                    name=island_of(p)))
                row.tokens_merged += int(p.get("tokens", 0))
                row.pushes_merged += 1
                row.version = version
                row.bytes_in += int(p.get("bytes", 0))
                bytes_in += int(p.get("bytes", 0))
        elif kind == "coordinator_resumed":
            version = int(e.get("version", 0))
        elif kind == "run_finished":
            end = e
        elif kind == "coordinator_stopped":
            stopped = e
    tokens = history.tokens_merged_at(version)
    last = history.series.points[-1]["train_loss"] if history.series.points else {}
    for row in rows.values():
        row.state = "stopped"
        if row.name in last:
            row.train_loss = last[row.name]
    evals = history.evals
    ordered = sorted(rows.values(), key=_row_order)
    doc = pb.StatusResponse(
        run_id=str(run.get("run_id", "")), version=version, mode=str(run.get("mode", "")),
        islands=ordered, tokens_merged=tokens,
        bytes_in=int(stopped.get("bytes_in", bytes_in)), bytes_out=int(stopped.get("bytes_out", 0)),
        total_versions=int(run.get("total_versions") or 0), tokens_total=int(run.get("tokens_total") or 0),
        stopped=True, run_over=str(end.get("reason", "")) or "the coordinator stopped before the run finished",
        deltas_merged=sum(int(r.pushes_merged) for r in rows.values()), merge_s=float(stopped.get("merge_s", 0.0)),
        params_digest=str(stopped.get("params_digest", "")), started_at=history.series.started_at or 0.0, now=now,
        eval_loss=evals[-1].loss if evals else None, eval_confirmed=bool(evals) and evals[-1].confirmed,
        rounds=history.rounds, evals=evals, faults=history.faults)
    return message_dict(doc)


def _row_order(row: pb.IslandStatus) -> tuple[int, str]:
    return row.shard_index, row.island_id


def serve_run(run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> Dashboard:
    """The dashboard of the run in ``run_dir``, bound on ``host:port`` and serving (call ``close()`` to stop).
    DtrainError: no events there, or the port cannot be bound."""
    run_dir = Path(run_dir)
    if not (run_dir / "events.jsonl").is_file():
        raise DtrainError(f"{run_dir}: no events.jsonl: not a run folder a coordinator wrote (give the folder "
                          f"dtrain simulate printed, or the coordinator's --run-dir)")
    history = RunHistory()
    history.replay(run_dir)
    status = run_status(run_dir, history, time.time())

    def history_doc() -> dict[str, Any]:
        return {**history.series.doc(), "source": "files"}

    dash = Dashboard(host, port, None, None, lambda: status, lambda *a: None, history=history_doc)
    dash.start()
    return dash
