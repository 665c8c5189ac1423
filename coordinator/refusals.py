"""Refused calls, counted in full and logged at a bounded rate.

Every call the coordinator refuses is counted by its kind (``"Join: FAILED_PRECONDITION"``: the method and the
status code; ``"auth"`` for a missing or wrong token), and Status reports the counts (``refusals``). Its event and
progress line are written for the first ``coordinator.refusal_events`` refusals of a kind in each window of
:data:`WINDOW_S`; the others of that window are summed into one ``refusals_suppressed`` event (``refused``: the kind,
``count``, ``window_s``) written when the kind's window is over (at its next refusal, at the next refusal of any
kind after it, or at the service's close). A flood of refused Joins then costs a few events a minute, however
many there are. Kinds are few (methods x codes), so the table stays small. Not thread-safe: the service calls it
under its lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

WINDOW_S = 60.0  # the rate window: coordinator.refusal_events refusals of a kind are logged in each


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class RefusalLog:
    """The counts (:attr:`counts`) and the rate limit (see the module docstring)."""

    def __init__(self, per_window: int, window_s: float = WINDOW_S):
        if per_window < 1:
            raise ValueError(f"RefusalLog: per_window={per_window}: must be >= 1")
        self.per_window, self.window_s = per_window, window_s
        self.counts: Counter[str] = Counter()
        self._windows: dict[str, _Window] = {}

    def refused(self, kind: str, now: float) -> tuple[bool, list[tuple[str, int]]]:
        """Counts one refusal of ``kind`` at ``now``; returns whether to log it, and the (kind, count) of the
        suppressed refusals of windows now over, to be logged as ``refusals_suppressed`` events."""
        self.counts[kind] += 1
        over = self.due(now)
        w = self._windows.get(kind)
        if w is None:
            w = self._windows[kind] = _Window(now)
        if w.logged < self.per_window:
            w.logged += 1
            return True, over
        w.suppressed += 1
        return False, over

    def due(self, now: float | None = None) -> list[tuple[str, int]]:
        """The suppressed counts of windows over at ``now`` (None: all, at the close), each reported once; those
        windows end (the next refusal of their kind starts a new one)."""
        out = []
        for kind, w in list(self._windows.items()):
            if now is None or now - w.start >= self.window_s:
                if w.suppressed:
                    out.append((kind, w.suppressed))
                del self._windows[kind]
        return out
