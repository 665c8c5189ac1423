"""What the status line of ``dtrain simulate``'s driver says, from the events the run's processes write.

:class:`RunWatch` follows the coordinator's and the islands' events as the driver tails them
(:class:`dtrain.runlog.EventTail`) and renders one line: what the run waits for, then its progress
(:func:`dtrain.runlog.fmt_progress`). The driver's :class:`dtrain_cli.simulate_report.StatusLine` logs it
through the driver's RunLog.
"""

from __future__ import annotations

from typing import Any

from dtrain.runlog import fmt_progress


class RunWatch:
    """What the driver's status line says, from the events the coordinator and the workers write: what the run
    waits for (workers compiling before they join, the first round), then the version out of the total, the latest
    global eval loss and the islands' latest train loss. Fed with new events (:class:`dtrain.runlog.EventTail`)."""

    def __init__(self, islands: int, expected_versions: int, shard_end: int, processes: int = 1):
        """``expected_versions``: the version a run ends at without faults (shown ``~N`` when the coordinator does
        not know the end ahead); ``shard_end``: sequences per shard (0: no end, wall-time rounds); ``processes``:
        worker processes per island (the line counts islands joined and processes running)."""
        self.islands, self.expected, self.shard_end = islands, expected_versions, shard_end
        self.processes = processes
        self.joined: set[str] = set()
        self.version = 0
        self.total = 0  # the version the run ends at, as the coordinator told the islands (0: the data decides)
        self.eval_loss: float | None = None
        self.eval_version = 0  # the version the latest eval loss is of
        self.train_loss: dict[str, float] = {}  # island name -> its latest train loss
        self.merged: set[tuple[int, int, int]] = set()  # (shard, start, end) of every merged push's range
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
            elif kind == "eval":
                loss = e.get("loss", e.get("eval_loss"))
                if isinstance(loss, (int, float)):
                    self.eval_loss, self.eval_version = float(loss), int(e.get("version", 0))
            elif kind == "coordinator_stopped":
                self.over = str(e.get("reason", "stopped"))

    def island(self, name: str, events: list[dict[str, Any]]) -> None:
        """Takes island ``name``'s new ``events``: the run's total versions (its join) and its train losses."""
        for e in events:
            kind = e.get("event")
            if kind == "joined":
                self.total = int(e.get("total_versions", 0) or 0)
            elif kind == "train" and isinstance(e.get("loss"), (int, float)):
                self.train_loss[name] = float(e["loss"])

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
        """The version the run ends at: the coordinator's, else the expected one (0: not known)."""
        return self.total or self.expected

    def line(self, running: int) -> str:
        """The status line; ``running``: worker processes alive now."""
        n = self.islands
        # one process per island: an island is "a worker"; with several, islands join and processes run
        unit, procs = ("workers", "") if self.processes == 1 else ("islands", f"/{n * self.processes} processes")
        if not self.joined:
            return f"simulate: waiting for {n} {unit} to join (compiling; {running}{procs} running)"
        if self.version == 0 and not self.over:
            return f"simulate: {len(self.joined)}/{n} {unit} joined, waiting for the first round"
        losses = list(self.train_loss.values())
        data = (self.merged_sequences(), n * self.shard_end) if self.shard_end else None
        return fmt_progress("simulate", version=self.version, total=self.total or (f"~{self.expected}"),
                            data=data, loss=sum(losses) / len(losses) if losses else None, eval_loss=self.eval_loss,
                            eval_version=self.eval_version,
                            extra=(f"{running}/{n} workers" if self.processes == 1 else
                                   f"{running}/{n * self.processes} worker processes")
                            + ("; the run is over" if self.over else ""))
