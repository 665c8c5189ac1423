"""What the ``dtrain simulate`` driver reports: its status line while the run goes on, and at the end the run's
summary, aggregated from every island's summary and the run's events (the faults scored, the restarts timed, the
token-range audit), with its closing line.

It reads what :class:`dtrain_cli.simulate_processes.Simulation` did and what the processes wrote; it starts and
stops nothing. The status line is :class:`dtrain_cli.run_watch.RunWatch`'s, the fault entries are scored by
:mod:`dtrain_cli.fault_score`, the audit is :mod:`dtrain.audit`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.audit import Audit, AuditError, AuditParams, audit
from dtrain.config.sections import Config
from dtrain.data.mixture import data_schedule, source_names
from dtrain.runlog import EventTail, process_dir
from dtrain_cli.fault_score import device_quarantines, score_faults
from dtrain_cli.fault_spec import DEVICE_KINDS
from dtrain_cli.run_watch import RunWatch
from dtrain_cli.simulate_processes import Simulation, SimulationError, run_events

STATUS_EVERY_S = 10.0  # the driver's status line, when not on a terminal: one every this many seconds


class StatusLine:
    """The driver's status line (:class:`RunWatch`, from the events the run's processes write): live on a
    terminal, else a line every :data:`STATUS_EVERY_S` seconds; :meth:`show` is the supervising loop's
    ``on_pass`` hook."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        cfg, islands = sim.cfg, sim.islands
        expected = cfg.rounds if cfg.coordinator.mode == "sync" else cfg.rounds * islands
        shard_end = 0 if cfg.worker.round_seconds else cfg.train.shard_sequences  # sequences per shard
        self.watch = RunWatch(islands, expected, shard_end, sim.processes, list(sim.names))
        self.tails = {"": EventTail(sim.out), **{n: EventTail(sim.out / "islands" / n) for n in sim.names}}

    def show(self) -> None:
        """Reads the events written since the last call and logs the status line (a ``simulate`` status record
        on the driver's RunLog)."""
        for name, tail in self.tails.items():
            if name:
                self.watch.island(name, tail.read())
            else:
                self.watch.coordinator(tail.read())
        self.sim.log.status("simulate", self.watch.line(self.sim.running_processes()), done=self.watch.version,
                            total=self.watch.known_total, every_s=STATUS_EVERY_S)


class Interrupted(SimulationError):
    """Ctrl-C stopped the run: the message says where its partial summary is and the command that resumes it."""


def interrupted(sim: Simulation) -> str:
    """After Ctrl-C (every process stopped): the partial summary of ``sim``'s run (``interrupted`` true, the
    version and tokens the coordinator's events record as merged, the ``resume`` command), written to
    ``RUN_DIR/summary.json`` and as a ``run_interrupted`` event of the driver; returns the line to print."""
    out = sim.out
    tokens_at, version = {0: 0}, 0
    for e in run_events(out):
        if e.get("event") == "round_merged":
            version = int(e["version"])
            tokens_at[version] = tokens_at.get(version - 1, max(tokens_at.values())) + sum(
                int(p.get("tokens", 0)) for p in e.get("pushes", []))
        elif e.get("event") == "coordinator_resumed":  # merges after its checkpoint were rolled back
            version = int(e.get("version", 0))
            tokens_at = {v: n for v, n in tokens_at.items() if v <= version}
    command = f"dtrain simulate --resume {out}"
    summary = {"mode": "simulate-processes", "interrupted": True, "version": version,
               "tokens_merged": tokens_at.get(version, 0), "wall_s": time.perf_counter() - sim.t0,
               "run_dir": str(out), "resume": command}
    sim.log.event("run_interrupted", **summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sim.log.close()
    return (f"interrupted at version {version} ({summary['tokens_merged']:,} tokens merged); a partial summary is "
            f"in {out / 'summary.json'}; to go on from there: {command}")


def summarize(sim: Simulation) -> dict[str, Any]:
    """The summary of ``sim``'s finished run (see :func:`dtrain_cli.simulate.run_simulation`), from the islands'
    summaries and the run's events; written to ``RUN_DIR/summary.json`` and the driver's log (a ``run_finished``
    event, its summary and the closing line), which it closes. Raises SimulationError for a run with no finished
    island, islands that ended on different θ, or events the audit cannot account for."""
    out, wall = sim.out, time.perf_counter() - sim.t0
    coord_events = run_events(out)
    island_events = {n: run_events(out / "islands" / n) for n in sim.names}
    checked = _audit(sim.cfg, out, coord_events, island_events)
    summary = run_summary(sim, wall, coord_events, island_events, checked)
    sim.log.event("run_finished", **{k: v for k, v in summary.items() if k != "islands"})
    sim.log.write_summary(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sim.log.progress(_done_line(summary, checked, out / "summary.json"))
    sim.log.close()
    return summary


def run_summary(sim: Simulation, wall: float, coord_events: list[dict[str, Any]],
                island_events: dict[str, list[dict[str, Any]]], checked: Audit) -> dict[str, Any]:
    """The summary of ``sim``'s run (``wall`` seconds long) from its finished islands' summaries (every
    process's) and the run's events; raises SimulationError if the islands did not end on one θ."""
    out, cfg = sim.out, sim.cfg
    unfinished = sim.gone | sim.stopped | set(sim.refused)
    # an island the coordinator quarantined (coordinator.max_rejections) was told to stop early, on its own θ
    quarantined = {n for n in sim.names for e in coord_events
                   if e.get("event") == "island_quarantined" and e.get("island") == n}
    finished = [n for n in sim.names if n not in unfinished | quarantined]
    if not finished:
        raise SimulationError(f"no island finished the run ({len(quarantined)} of {len(sim.names)} quarantined by "
                              f"the coordinator, the others lost or stopped): see {out / 'coordinator.log'}")
    per_island = [json.loads((out / "islands" / n / "summary.json").read_text()) for n in finished]
    # the other processes of each island: the same θ and eval as its process 0 (its tokens and bytes are
    # process 0's alone, the one that pushes)
    followers = [json.loads((process_dir(out / "islands" / n, i) / "summary.json").read_text())
                 for n in finished for i in range(1, sim.processes)]
    evals = {round(s["final_eval_loss"], 6) for s in per_island + followers}
    digests = {s["params_digest"] for s in per_island + followers}
    summary = {
        "mode": "simulate-processes", "final_eval_loss": per_island[0]["final_eval_loss"],
        # the run's tokens are those merged (the audit's); each island's, those it trained (a range trained again
        # after a kill or a rewind counts twice there)
        "rounds": max(s["version"] for s in per_island), "tokens": checked.merged_tokens,
        "tokens_trained": sum(s["tokens"] for s in per_island),
        "bytes_up": sum(s["bytes_up"] for s in per_island), "bytes_down": sum(s["bytes_down"] for s in per_island),
        "wall_s": wall, "islands": per_island, "run_dir": str(out),
        "utilization": min(s["utilization"] for s in per_island),
        "compression_ratio": sum(s["compression_ratio"] for s in per_island) / len(per_island),
        "bit_identical_final_params": len(digests) == 1, "codec": {"up": cfg.codec.up, "down": cfg.codec.down},
        "worker_cpus": sim.shares, "island_processes": sim.processes,
        "faults": score_faults(sim.fired, sim.faults, coord_events, island_events),
        "device_quarantines": device_quarantines(island_events, [f for f in sim.faults if f.kind in DEVICE_KINDS]),
        "faults_not_injected": sim.not_injected,
        "restarts": restarts(sim.fired, island_events),
        "island_settings": {n: s.describe() for n, s in sim.specs.items()},
        "goodput": checked.goodput, "audit": checked.to_dict(),
        **({"source_tokens": {k: v.merged_tokens for k, v in checked.sources.items()}} if checked.sources else {}),
        "unfinished_islands": sorted(unfinished),
        "quarantined_islands": sorted(quarantined),
        "refused_islands": dict(sorted(sim.refused.items())),
    }
    if len(digests) != 1 or len(evals) != 1:
        raise SimulationError(f"islands ended with different parameters: digests {sorted(digests)}")
    return summary


def restarts(fired: Sequence[dict[str, Any]], island_events: dict[str, list[dict[str, Any]]]
             ) -> list[dict[str, Any]]:
    """Each restart of a killed island (a ``kill`` fault with a recovery, from the driver's ``fired`` records):
    ``restart_s``, the seconds from the kill to the restarted island's first step (its ``island_startup`` event,
    :mod:`workers.startup`; None if it took none before the run ended or the island was killed again), and that
    start's phases (seconds, and CPU seconds) and compilation-cache counts."""
    out = []
    for i, f in enumerate(fired):
        if f["kind"] != "kill" or f.get("recovered_t") is None:
            continue
        again = next((g["injected_t"] for g in fired[i + 1:] if g["kind"] == "kill" and g["target"] == f["target"]),
                     math.inf)
        start = next((e for e in island_events.get(f["target"], []) if e["event"] == "island_startup"
                      and f["recovered_t"] <= e["t"] < again), None)
        out.append({"fault": f["fault"], "island": f["target"], "killed_t": f["injected_t"],
                    "restarted_t": f["recovered_t"], "first_step_t": None if start is None else start["t"],
                    "restart_s": None if start is None else round(start["t"] - f["injected_t"], 3),
                    **{k: None if start is None else start.get(k)
                       for k in ("phases", "cpu_s", "cache_hits", "cache_misses")}})
    return out


def _audit(cfg: Config, out: Path, coord_events: list[dict[str, Any]], island_events: dict[str, list[dict[str, Any]]]
           ) -> Audit:
    """The token-range audit and goodput (:mod:`dtrain.audit`) of the run in ``out`` from the coordinator's
    events and every island's (all its processes'); raises SimulationError for events it cannot audit."""
    params = AuditParams.from_config(cfg)
    schedule = data_schedule(cfg.data)
    if schedule is not None:  # a mixture: each source audited through the schedule's ranges
        params = dataclasses.replace(params, sources=tuple(source_names(cfg.data)), source_ranges=schedule.ranges)
    try:
        return audit(coord_events, island_events, params)
    except AuditError as e:
        raise SimulationError(f"token-range audit of {out}: {e}") from None


def _done_line(summary: dict[str, Any], checked: Audit, path: Path) -> str:
    """The driver's last progress line: the run's ``summary`` in one line, written to ``path``."""
    return (f"done: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, "
            f"{summary['tokens']:,} tokens merged, {(summary['bytes_up'] + summary['bytes_down']) / 1e6:.2f} MB "
            f"on the wire, compression {summary['compression_ratio']:.1f}x, utilization "
            f"{summary['utilization']:.3f}, goodput {_fmt_goodput(checked.goodput)}, "
            f"lost {checked.lost_tokens:,} / doubled {checked.doubled_tokens:,} tokens, "
            f"{summary['wall_s']:.1f}s -> {path}")


def _fmt_goodput(goodput: float | None) -> str:
    return "n/a (no step executed)" if goodput is None else f"{goodput:.3f}"


def closing_line(summary: dict[str, Any]) -> str:
    """``dtrain simulate``'s last line, on stdout: what the run came to, and where its summary is."""
    return (f"{summary['run_dir']}: eval loss {summary['final_eval_loss']:.4f} after {summary['rounds']} versions, "
            f"{summary['tokens']:,} tokens merged in {summary['wall_s']:.1f}s; the summary is in "
            f"{os.path.join(summary['run_dir'], 'summary.json')}")

