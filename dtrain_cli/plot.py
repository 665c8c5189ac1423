"""``dtrain plot RUN_DIR``: PNGs of a run, from the events files its processes wrote.

It reads ``RUN_DIR/events.jsonl`` (the coordinator's; ``dtrain train`` and ``simulate --inprocess`` write theirs
there too), ``RUN_DIR/islands/NAME/events.jsonl`` (each island's) and ``RUN_DIR/driver/events.jsonl`` (the
simulate driver's injected faults), a live run's as well: a line still being written is left out. The series are
built by the pure :func:`run_series`; :func:`write_plots` draws them (matplotlib, Agg backend):

- ``loss.png``: train loss per island against the island's tokens; global eval loss (the coordinator's ``eval``
  events, the islands' final eval) against the tokens merged.
- ``bytes.png``: cumulative frame bytes up (pushes) and down (pulls) over time, per island and in all.
- ``utilization.png``: each island's fraction of its training time in inner steps, over time.
- ``timeline.png``: one lane per island (and the coordinator): merges, joins and rejoins, lost islands, dropped,
  rejected or refused pushes, quarantined devices, NaN-guard rollbacks, rewinds, injected faults and recoveries.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.runlog import fault_kind, read_events

Point = tuple[float, float]

COORDINATOR = "coordinator"
# Timeline marks: event -> (label, matplotlib marker, color). The label groups them in the legend.
MARKS: dict[str, tuple[str, str, str]] = {
    "round_merged": ("round merged", "|", "0.6"),
    "island_joined": ("joined", ">", "tab:green"),
    "rejoined": ("rejoined", ">", "tab:olive"),
    "island_lost": ("island lost (lease)", "X", "tab:red"),
    "push_dropped": ("push dropped", "v", "tab:orange"),
    "push_rejected": ("push rejected / refused", "v", "tab:red"),
    "device_quarantined": ("device quarantined", "s", "tab:purple"),
    "nan_guard": ("NaN guard", "D", "tab:brown"),
    "rewound": ("rewound", "<", "tab:cyan"),
    "remeshed": ("remeshed / drained", "P", "tab:pink"),
    "heartbeat_failed": ("heartbeats failing", ".", "tab:gray"),
    "link_slow": ("link slow", "1", "tab:gray"),
    "fault_injected": ("fault injected", "*", "black"),
    "fault_recovered": ("fault recovered", "+", "black"),
    "coordinator_resumed": ("coordinator resumed", "o", "tab:blue"),
    "request_rejected": ("request rejected", "x", "tab:red"),
    "coordinator_fault": ("coordinator fault", "x", "tab:brown"),
}
# The coordinator's fault events (dtrain.runlog.fault_kind: the one classification, also Status's and the
# dtrain.faults metric's) as timeline marks, and the lane each goes on: its island's, or the coordinator's.
FAULT_MARKS = {"delta_dropped": "push_dropped", "delta_rejected": "push_rejected", "push_refused": "push_rejected",
               "push_aborted": "push_rejected", "island_lost": "island_lost",
               "coordinator_resumed": "coordinator_resumed", "request_invalid": "request_rejected",
               "auth_failed": "request_rejected"}
ISLAND_FAULTS = frozenset({"delta_dropped", "delta_rejected", "push_refused", "push_aborted", "island_lost"})


class PlotError(DtrainError):
    """The run folder cannot be plotted (missing, or no events yet)."""


@dataclass(frozen=True)
class Mark:
    t: float  # seconds since the run's first event
    lane: str  # an island's name, or "coordinator"
    kind: str  # a key of MARKS
    detail: str = ""


@dataclass
class RunSeries:
    """What the plots show, each series sorted by its x."""

    train_loss: dict[str, list[Point]] = field(default_factory=dict)  # island -> (its tokens, train loss)
    eval_loss: list[Point] = field(default_factory=list)  # global θ: (tokens merged, eval loss)
    final_eval: dict[str, Point] = field(default_factory=dict)  # island -> (tokens merged, its final eval loss)
    bytes_up: dict[str, list[Point]] = field(default_factory=dict)  # island (or "all") -> (s, cumulative bytes)
    bytes_down: dict[str, list[Point]] = field(default_factory=dict)
    utilization: dict[str, list[Point]] = field(default_factory=dict)  # island -> (s, utilization so far)
    marks: list[Mark] = field(default_factory=list)
    lanes: list[str] = field(default_factory=list)  # the timeline's lanes, top to bottom


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]],
                                           list[dict[str, Any]]]:
    """The events of a run folder: (the top-level events, each island's, the driver's); torn lines left out.
    PlotError when the folder is missing or holds no events file at all."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlotError(f"{root}: no such run folder (give RUN_DIR, e.g. runs/tiny)")
    top = _events(root)
    islands = {p.parent.name: _events(p.parent) for p in sorted(root.glob("islands/*/events.jsonl"))}
    driver = _events(root / "driver")
    if top is None and not islands:
        raise PlotError(f"{root}: no events.jsonl here nor in islands/*/ (not a run folder, or the run has not "
                        f"started yet)")
    return top or [], {k: v or [] for k, v in islands.items()}, driver or []


def _events(folder: Path) -> list[dict[str, Any]] | None:
    if not (folder / "events.jsonl").is_file():
        return None
    return read_events(folder, skip_torn=True)


def _num(x: Any) -> float | None:
    """A finite or non-finite float from an event field (``"nan"``/``"inf"`` strings too); None if not a number."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _x(point: Point) -> float:
    """A point's x: series are sorted by it, keeping the order of points with the same x (a stable sort)."""
    return point[0]


def run_series(top: list[dict[str, Any]], islands: dict[str, list[dict[str, Any]]],
               driver: list[dict[str, Any]]) -> RunSeries:
    """The plotted series from a run's events (:func:`read_run`): the top-level events, each island's (by name)
    and the simulate driver's. Times are seconds since the run's first event."""
    every = [e for evs in (top, driver, *islands.values()) for e in evs if isinstance(e.get("t"), (int, float))]
    t0 = min((float(e["t"]) for e in every), default=0.0)
    # the coordinator's island id -> the island's name
    started = next((e for e in top if e.get("event") == "run_started"), None)
    cfg = started.get("config", {}) if started else {}
    tokens_per_step = int(cfg.get("train", {}).get("batch_size", 0)) * int(cfg.get("model", {}).get("seq_len", 0))
    single = started is not None and started.get("mode") == "train"  # dtrain train: one island, events at the top
    s = RunSeries()
    s.train_loss, s.eval_loss, s.final_eval = _losses(top, islands, tokens_per_step, single)
    s.bytes_up, s.bytes_down = _bytes(top, t0)
    s.utilization = _utilization(islands, t0)
    marks = [*_top_marks(top, islands, t0, single), *_island_marks(islands, t0), *_driver_marks(driver, t0)]
    s.marks = sorted(marks, key=lambda m: m.t)
    island_lanes = sorted({m.lane for m in marks if m.lane != COORDINATOR} | set(islands))
    s.lanes = [COORDINATOR, *island_lanes] if any(m.lane == COORDINATOR for m in marks) or top else island_lanes
    return s


def _losses(top: list[dict[str, Any]], islands: dict[str, list[dict[str, Any]]], tokens_per_step: int,
            single: bool) -> tuple[dict[str, list[Point]], list[Point], dict[str, Point]]:
    """(train loss per island against its tokens, the global eval loss against the tokens merged, each island's
    final eval loss at the tokens merged into its version), each series sorted by its x. ``tokens_per_step``:
    a ``dtrain train`` eval's tokens per step (its events name the step); ``single``: a ``dtrain train`` run."""
    train: dict[str, list[Point]] = defaultdict(list)
    for name, evs in islands.items():
        for e in evs:
            if e.get("event") == "train":
                loss, tokens = _num(e.get("loss")), _num(e.get("tokens"))
                if loss is not None and tokens is not None:
                    train[name].append((tokens, loss))
    eval_loss: list[Point] = []
    merged_tokens: dict[int, float] = {}  # version -> tokens merged into it
    total = 0.0
    for e in top:
        kind = e.get("event")
        if kind == "round_merged":
            if "pushes" in e:
                total += sum(float(p.get("tokens", 0)) for p in e["pushes"])
            elif _num(e.get("tokens")) is not None:  # simulate --inprocess: the islands' tokens so far
                total = float(e["tokens"])
            merged_tokens[int(e.get("version", 0))] = total
            losses = e.get("train_losses")
            if isinstance(losses, list):  # simulate --inprocess: one loss per island per round
                for i, loss in enumerate(losses):
                    if _num(loss) is not None:
                        train[f"island-{i}"].append((total / len(losses), float(loss)))
            if _num(e.get("eval_loss")) is not None:
                eval_loss.append((total, float(e["eval_loss"])))
        elif kind == "train" and single:
            loss, tokens = _num(e.get("loss")), _num(e.get("tokens"))
            if loss is not None and tokens is not None:
                train["train"].append((tokens, loss))
    eval_loss += _evals(top, merged_tokens, tokens_per_step)
    final_eval: dict[str, Point] = {}
    for name, evs in islands.items():
        done = next((e for e in reversed(evs) if e.get("event") == "island_finished"), None)
        loss = _num(done.get("final_eval_loss")) if done else None
        if done is not None and loss is not None:
            final_eval[name] = (merged_tokens.get(int(done.get("version", 0)), total), loss)
    return {k: sorted(v, key=_x) for k, v in sorted(train.items())}, sorted(eval_loss, key=_x), final_eval


def _evals(top: list[dict[str, Any]], merged_tokens: dict[int, float], tokens_per_step: int) -> list[Point]:
    """The top-level ``eval`` events as (tokens, loss): an eval without its tokens takes its version's
    (``merged_tokens``), or a ``dtrain train`` eval its step's."""
    points = []
    for e in top:
        if e.get("event") == "eval":
            loss = _num(e.get("loss", e.get("eval_loss")))
            tokens = _num(e.get("tokens"))
            if tokens is None and e.get("version") is not None:
                tokens = merged_tokens.get(int(e["version"]))
            if tokens is None and e.get("step") is not None:  # dtrain train: its step's tokens
                tokens = float(int(e["step"]) * tokens_per_step)
            if loss is not None and tokens is not None:
                points.append((tokens, loss))
    return points


def _bytes(top: list[dict[str, Any]], t0: float) -> tuple[dict[str, list[Point]], dict[str, list[Point]]]:
    """Cumulative frame bytes (up, down) over time per island and in ``all``: the coordinator's view, what it
    received and sent."""
    up: dict[str, float] = defaultdict(float)
    down: dict[str, float] = defaultdict(float)
    bytes_up: dict[str, list[Point]] = defaultdict(list)
    bytes_down: dict[str, list[Point]] = defaultdict(list)
    for e in top:
        kind, t = e.get("event"), float(e.get("t", t0)) - t0
        if kind == "push_received" and _num(e.get("bytes")) is not None:
            who = str(e.get("island"))  # the island's name (dtrain.runlog.IslandNames)
            up[who] += float(e["bytes"])
            up["all"] += float(e["bytes"])
            bytes_up[who].append((t, up[who]))
            bytes_up["all"].append((t, up["all"]))
        elif kind == "pull_served":
            size = sum(float(f[3]) for f in e.get("frames", ()) if isinstance(f, list) and len(f) > 3)
            who = str(e.get("island"))  # the island's name (dtrain.runlog.IslandNames)
            down[who] += size
            down["all"] += size
            bytes_down[who].append((t, down[who]))
            bytes_down["all"].append((t, down["all"]))
        elif kind == "round_merged" and "bytes_up" in e:  # simulate --inprocess: running totals
            bytes_up["all"].append((t, float(e["bytes_up"])))
            bytes_down["all"].append((t, float(e.get("bytes_down", 0))))
    return dict(sorted(bytes_up.items())), dict(sorted(bytes_down.items()))


def _utilization(islands: dict[str, list[dict[str, Any]]], t0: float) -> dict[str, list[Point]]:
    """Each island's utilization over time (its ``train`` events carry it, and its ``island_finished``)."""
    series = {}
    for name, evs in sorted(islands.items()):
        points = [(float(e["t"]) - t0, float(e["utilization"])) for e in evs
                  if e.get("event") == "train" and _num(e.get("utilization")) is not None]
        done = next((e for e in reversed(evs) if e.get("event") == "island_finished"), None)
        if done is not None and _num(done.get("utilization")) is not None:
            points.append((float(done["t"]) - t0, float(done["utilization"])))
        if points:
            series[name] = sorted(points, key=_x)
    return series


def _top_marks(top: list[dict[str, Any]], islands: dict[str, list[dict[str, Any]]], t0: float,
               single: bool) -> list[Mark]:
    """The timeline marks of the top-level events: merges, joins and rejoins, the coordinator's faults (on their
    island's lane or its own), a train run's NaN guard, quarantines of islands that wrote no events."""
    marks: list[Mark] = []
    seen_names: set[str] = set()
    for e in top:
        kind, t = str(e.get("event")), float(e.get("t", t0)) - t0
        who = str(e["island"]) if e.get("island") is not None else COORDINATOR  # the island's name
        if kind == "round_merged":
            marks.append(Mark(t, COORDINATOR, kind, f"v{e.get('version')}"))
        elif kind == "island_joined":
            name = str(e.get("name", who))
            marks.append(Mark(t, name, "rejoined" if name in seen_names else kind, str(e.get("reason", ""))))
            seen_names.add(name)
        elif kind == "device_quarantined":
            if not islands.get(who):  # the island's own event is drawn otherwise
                marks.append(Mark(t, who, kind, str(e.get("detail", ""))))
        elif kind == "nan_guard" and single:  # a train run's own
            marks.append(Mark(t, "train", kind))
        elif fault_kind(e) or kind == "request_rejected":  # not a fault (an unknown island, ...), still drawn
            fault = fault_kind(e) or "request_invalid"
            marks.append(Mark(t, who if fault in ISLAND_FAULTS else COORDINATOR,
                              FAULT_MARKS.get(fault, "coordinator_fault"),
                              f"{kind}: {e.get('reason', e.get('error', e.get('version', '')))}"))
    return marks


def _island_marks(islands: dict[str, list[dict[str, Any]]], t0: float) -> list[Mark]:
    """The timeline marks of the islands' own events: quarantines, NaN guards, rewinds, remeshes, failing
    heartbeats, slow links, the push faults they injected."""
    marks = []
    for name, evs in islands.items():
        for e in evs:
            kind, t = str(e.get("event")), float(e.get("t", t0)) - t0
            if kind in ("device_quarantined", "nan_guard", "rewound", "heartbeat_failed", "link_slow",
                        "fault_injected"):
                marks.append(Mark(t, name, kind, str(e.get("detail", e.get("reason", e.get("fault", ""))))))
            elif kind in ("remeshed", "drained"):
                marks.append(Mark(t, name, "remeshed", kind))
    return marks


def _driver_marks(driver: list[dict[str, Any]], t0: float) -> list[Mark]:
    """The timeline marks of the simulate driver's events: the faults it injected and their recoveries, on the
    lane of what they hit, and the islands it stopped."""
    marks = []
    targets: dict[str, str] = {}  # fault text -> the island (or the coordinator) it hit
    for e in driver:
        kind, t = str(e.get("event")), float(e.get("t", t0)) - t0
        if kind == "fault_injected":
            lane = str(e.get("target") or COORDINATOR)
            targets[str(e.get("fault"))] = lane
            marks.append(Mark(t, lane, kind, str(e.get("fault", ""))))
        elif kind == "fault_recovered":
            marks.append(Mark(t, targets.get(str(e.get("fault")), COORDINATOR), kind, str(e.get("action", ""))))
        elif kind == "worker_stopped":
            marks.append(Mark(t, str(e.get("island", COORDINATOR)), "fault_recovered", "stopped by the driver"))
    return marks


def write_plots(series: RunSeries, out: Path, title: str) -> list[Path]:
    """Draws the PNGs that have data (``loss.png``, ``bytes.png``, ``utilization.png``, ``timeline.png``) into
    ``out``, each titled ``TITLE: NAME``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw in (("loss.png", _draw_loss), ("bytes.png", _draw_bytes), ("utilization.png", _draw_utilization),
                       ("timeline.png", _draw_timeline)):
        fig = draw(plt, series)
        if fig is None:
            continue
        fig.suptitle(f"{title}: {name.removesuffix('.png')}")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _draw_loss(plt: Any, series: RunSeries) -> Any:
    """The loss figure (train loss per island, eval loss of the global θ and the islands' final ones); None
    without a loss."""
    if not (series.train_loss or series.eval_loss or series.final_eval):
        return None
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in series.train_loss.items():
        ax_train.plot(*zip(*points, strict=True), marker=".", label=name)
    ax_train.set(xlabel="tokens trained by the island", ylabel="train loss (latest chunk)", title="train loss")
    if series.eval_loss:
        ax_eval.plot(*zip(*series.eval_loss, strict=True), marker="o", color="black", label="global θ")
    for name, (x, y) in series.final_eval.items():
        ax_eval.scatter([x], [y], marker="*", s=120, label=f"{name} final", zorder=3)
    ax_eval.set(xlabel="tokens merged", ylabel="held-out eval loss", title="eval loss")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


def _draw_bytes(plt: Any, series: RunSeries) -> Any:
    """The bytes figure (cumulative MB up and down, per island and in all); None without bytes."""
    if not (series.bytes_up or series.bytes_down):
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, data, style in (("up", series.bytes_up, "-"), ("down", series.bytes_down, "--")):
        for name, points in data.items():
            xs, ys = zip(*points, strict=True)
            ax.step(xs, [y / 1e6 for y in ys], style, where="post", label=f"{name} {label}",
                    linewidth=2.5 if name == "all" else 1.2)
    ax.set(xlabel="seconds since the run started", ylabel="MB (frames, cumulative)",
           title="bytes up (pushes) and down (pulls)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _draw_utilization(plt: Any, series: RunSeries) -> Any:
    """The utilization figure (each island's, over time); None without one."""
    if not series.utilization:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, points in series.utilization.items():
        ax.plot(*zip(*points, strict=True), marker=".", label=name)
    ax.set(xlabel="seconds since the run started", ylabel="fraction of training time in inner steps",
           ylim=(0, 1.05), title="utilization")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _draw_timeline(plt: Any, series: RunSeries) -> Any:
    """The timeline figure (one lane per island and the coordinator, a marker per kind of mark); None without
    a mark."""
    if not series.marks:
        return None
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.6 * len(series.lanes)))
    row = {lane: i for i, lane in enumerate(series.lanes)}
    by_kind: dict[str, list[Mark]] = defaultdict(list)
    for m in series.marks:
        by_kind[m.kind].append(m)
    for kind, marks in by_kind.items():
        label, marker, color = MARKS[kind]
        ax.scatter([m.t for m in marks], [row[m.lane] for m in marks], marker=marker, color=color, s=60,
                   label=label, zorder=3)
    ax.set_yticks(range(len(series.lanes)), series.lanes)
    ax.set_ylim(len(series.lanes) - 0.5, -0.5)
    ax.set(xlabel="seconds since the run started", title="timeline: faults and detections")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Reads the run folder's events and writes its PNGs (default ``RUN_DIR/plots``); returns their paths.
    PlotError when the folder is missing or has no event to plot yet."""
    root = Path(run_dir)
    series = run_series(*read_run(root))
    written = write_plots(series, Path(out) if out is not None else root / "plots", root.resolve().name)
    if not written:
        raise PlotError(f"{root}: no losses, bytes or marks in its events yet (the workers may still be "
                        f"compiling): try again in a moment")
    return written


def main(run_dir: str, out: str | None) -> int:
    """``dtrain plot``: prints each PNG written; one line and exit 1 on an error."""
    try:
        paths = plot_run(run_dir, out)
    except (PlotError, OSError) as e:
        print(f"dtrain plot: error: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
