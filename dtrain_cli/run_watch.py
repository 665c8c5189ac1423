"""What the status line of ``dtrain simulate``'s driver says, from the events the run's processes write.

:class:`RunWatch` follows the coordinator's and the islands' events as the driver tails them
(:class:`dtrain.runlog.EventTail`) and renders one line: while the islands start, which have joined and how many
it still waits for (the others are compiling), and each island's latest step and train loss from its own events;
then the progress (:func:`dtrain.runlog.fmt_progress`) with an ETA. The driver's
:class:`dtrain_cli.simulate_report.StatusLine` logs it through the driver's RunLog.
"""

from __future__ import annotations

from typing import Any

from dtrain.runlog import RECENT_VERSIONS, expected_end, fmt_progress


def fmt_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``1h02m``: a duration for a person."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RunWatch:
    """What the driver's status line says, from the events the coordinator and the workers write: while the
    islands start, those joined, how many more it waits for (compiling: an island joins once its programs are
    compiled) and each one's latest step and train loss; then the version out of the total, the data merged, the
    latest global eval loss, the islands' mean train loss and an ETA from the versions' pace. Fed with new events
    (:class:`dtrain.runlog.EventTail`)."""

    def __init__(self, islands: int, expected_versions: int, shard_end: int, processes: int = 1,
                 names: list[str] | None = None):
        """``expected_versions``: the version a run ends at without faults (shown ``~N`` when the coordinator does
        not know the end ahead); ``shard_end``: sequences per shard (0: no end, wall-time rounds); ``processes``:
        worker processes per island; ``names``: the islands' names (default ``island-0`` ..)."""
        self.islands, self.expected, self.shard_end = islands, expected_versions, shard_end
        self.processes = processes
        self.names = names or [f"island-{i}" for i in range(islands)]
        self.joined: set[str] = set()
        self.version = 0
        self.total = 0  # the version the run ends at, as the coordinator told the islands (0: the data decides)
        self.eval_loss: float | None = None
        self.eval_version = 0  # the version the latest eval loss is of
        self.train_loss: dict[str, float] = {}  # island name -> its latest train loss
        self.step: dict[str, int] = {}  # island name -> its latest train event's step
        self.merged: set[tuple[int, int, int]] = set()  # (shard, start, end) of every merged push's range
        self.paces: list[tuple[float, int]] = []  # (t, version) of the first and the latest merge
        self.recent: list[int] = []  # sequences each of the latest versions merged (expected_end's pace)
        self.over = ""

    def coordinator(self, events: list[dict[str, Any]]) -> None:
        """Takes the coordinator's new ``events``: islands joined, versions merged (and their ranges),
        eval losses, the run's end."""
        for e in events:
            kind = e.get("event")
            if kind == "island_joined" and e.get("name"):
                self.joined.add(str(e["name"]))
            elif kind == "round_merged":
                self.version = max(self.version, int(e.get("version", 0)))
                for p in e.get("pushes", ()):  # ranges, not cursors: a shard split in segments grows in places
                    self.merged.add((int(p.get("shard", 0)), int(p.get("start", 0)), int(p.get("end", 0))))
                self.recent = [*self.recent, sum(int(p.get("end", 0)) - int(p.get("start", 0))
                                                 for p in e.get("pushes", ()))][-RECENT_VERSIONS:]
                if isinstance(e.get("t"), (int, float)):
                    self.paces[1:] = [(float(e["t"]), self.version)]
                    if len(self.paces) == 1:
                        self.paces.append(self.paces[0])
            elif kind == "eval":
                loss = e.get("loss", e.get("eval_loss"))
                if isinstance(loss, (int, float)):
                    self.eval_loss, self.eval_version = float(loss), int(e.get("version", 0))
            elif kind == "coordinator_stopped":
                self.over = str(e.get("reason", "stopped"))

    def island(self, name: str, events: list[dict[str, Any]]) -> None:
        """Takes island ``name``'s new ``events``: the run's total versions (its join), its steps and train
        losses."""
        for e in events:
            kind = e.get("event")
            if kind == "joined":
                self.total = int(e.get("total_versions", 0) or 0)
            elif kind == "train" and isinstance(e.get("loss"), (int, float)):
                self.train_loss[name] = float(e["loss"])
                if isinstance(e.get("step"), int):
                    self.step[name] = e["step"]

    def merged_sequences(self) -> int:
        """Sequences merged so far over every shard: the merged ranges' union (a range merged again after a
        coordinator resume counts once)."""
        total, reach = 0, (-1, 0)  # (shard, end) of the union so far
        for shard, start, end in sorted(self.merged):
            if shard != reach[0]:
                reach = (shard, 0)
            total += max(end - max(start, reach[1]), 0)
            reach = (shard, max(reach[1], end))
        return total

    @property
    def known_total(self) -> int:
        """The version the run ends at: the coordinator's, else the one its data is expected to end at
        (:func:`dtrain.runlog.expected_end`: the plan before a merge, then at the latest versions' pace; 0: not
        known)."""
        if self.total or not self.shard_end:
            return self.total or self.expected
        left = self.islands * self.shard_end - self.merged_sequences()
        return expected_end(self.version, left, self.recent, self.expected)

    def eta_s(self) -> float | None:
        """Seconds left at the pace of the versions merged since the first one (None: fewer than two merges
        apart in time, or no end known)."""
        if len(self.paces) < 2 or not self.known_total:
            return None
        (t0, v0), (t1, v1) = self.paces
        if v1 <= v0 or t1 <= t0:
            return None
        return max(self.known_total - v1, 0) * (t1 - t0) / (v1 - v0)

    def _islands_so_far(self) -> str:
        """Each island's latest step and train loss, from its own events (those that trained)."""
        return ", ".join(f"{n} step {self.step[n]} loss {self.train_loss[n]:.4f}" for n in self.names
                         if n in self.step)

    def line(self, running: int) -> str:
        """The status line; ``running``: worker processes alive now."""
        n = self.islands
        procs = f"{running}/{n * self.processes} worker processes running"
        trained = self._islands_so_far()
        if len(self.joined) < n and self.version == 0 and not self.over:
            waiting = [name for name in self.names if name not in self.joined]
            more = len(waiting)
            which = f" ({', '.join(waiting)})" if more <= 4 else ""
            head = (f"simulate: compiling: waiting for {n} islands to join" if not self.joined else
                    f"simulate: {len(self.joined)}/{n} islands joined, waiting for {more} more "
                    f"island{'s' * (more != 1)}{which} (compiling)")
            return f"{head}; {trained}; {procs}" if trained else f"{head}; {procs}"
        if self.version == 0 and not self.over:
            head = f"simulate: {n}/{n} islands joined, training the first round"
            return f"{head}: {trained}" if trained else f"{head}; {procs}"
        losses = list(self.train_loss.values())
        data = (self.merged_sequences(), n * self.shard_end) if self.shard_end else None
        eta = self.eta_s()
        extra = (f"{running}/{n} workers" if self.processes == 1 else
                 f"{running}/{n * self.processes} worker processes")
        if self.over:
            extra += "; the run is over"
        elif eta is not None:
            extra = f"ETA {fmt_duration(eta)}; {extra}"
        return fmt_progress("simulate", version=self.version, total=self.total or f"~{self.known_total}",
                            data=data, loss=sum(losses) / len(losses) if losses else None, eval_loss=self.eval_loss,
                            eval_version=self.eval_version, extra=extra)
