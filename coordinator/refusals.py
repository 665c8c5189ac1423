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

import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from coordinator.records import PushInfo
from coordinator.streams import peer_host
from dtrain.runlog import RunLog, printable

WINDOW_S = 60.0  # the rate window: coordinator.refusal_events refusals of a kind are logged in each
AUTH_EVENT_S = 10.0  # `auth_failed`: at most one event per peer host this often; the calls in between are counted
MAX_AUTH_HOSTS = 1024  # hosts tracked for that; beyond them, the rest share one count ("other hosts")
MAX_METHOD_SHOWN = 128  # characters of a refused call's method (a client names it) an event keeps


class CallRefused(Exception):
    """A call the coordinator refuses, raised by the code that decides it (the open round's push,
    ``coordinator/open_round.py``) for the servicer to record and answer (``CoordinatorService.answer``): ``code``
    and the message (``str(e)``); ``push``: a refused push's header (counted in pushes_refused, a ``push_refused``
    event); ``busy``, ``retry_after_s``, ``stopped``: what its trailing metadata says (``CoordinatorService._abort``).
    ``record=False``: not a refusal but an upload that broke off (its ``push_aborted`` event is its record)."""

    def __init__(self, code: grpc.StatusCode, message: str, push: PushInfo | None = None, busy: bool = False,
                 retry_after_s: float = 0.0, stopped: bool = False, record: bool = True):
        super().__init__(message)
        self.code, self.push, self.busy, self.record = code, push, busy, record
        self.retry_after_s, self.stopped = retry_after_s, stopped


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


class AuthFailures:
    """Calls refused for their token, recorded: an ``auth_failed`` event {peer, method, reason, count} and a
    progress line, at most one per peer host every AUTH_EVENT_S, so a flood of bad calls cannot fill the disk:
    ``count`` is the calls refused from that host since its last event, the last one included (the rest are
    written by :meth:`flush`). Events are logged under the service's ``lock`` (their listeners, the history and
    telemetry, are updated under it)."""

    def __init__(self, log: RunLog, lock: threading.Condition, counts: Counter[str] | None = None):
        """``counts``: where each refused call is counted, as ``"auth"`` (the service's Status refusals)."""
        self.log, self.lock = log, lock
        self.counts: Counter[str] = Counter() if counts is None else counts
        # per peer host: (time.monotonic() of its last event, calls refused since, the last call's peer, method
        # and reason)
        self._hosts: dict[str, tuple[float, int, str, str, str]] = {}
        self._lock = threading.Lock()

    def failed(self, peer: str, method: str, why: str) -> None:
        """A call refused for its token (:class:`dtrain.net.wire.TokenAuthInterceptor`'s ``on_denied``; the dashboard
        calls it too, with ``method`` = ``GET /PATH``)."""
        host = peer_host(peer)
        now = time.monotonic()
        with self.lock:
            self.counts["auth"] += 1
        with self._lock:
            if host not in self._hosts and len(self._hosts) >= MAX_AUTH_HOSTS:
                host = "other hosts"
            last, count, _, _, _ = self._hosts.get(host, (float("-inf"), 0, "", "", ""))
            if now - last < AUTH_EVENT_S:
                self._hosts[host] = (last, count + 1, peer, method, why)
                return
            self._hosts[host] = (now, 0, peer, method, why)
        self._report(peer, printable(method, MAX_METHOD_SHOWN), why, count + 1)

    def flush(self) -> None:
        """Records the refused calls counted since each host's last event (at the service's close)."""
        with self._lock:
            pending = [entry for entry in self._hosts.values() if entry[1]]
            self._hosts.clear()
        for _, count, peer, method, why in pending:
            self._report(peer, method, why, count)

    def _report(self, peer: str, method: str, why: str, count: int) -> None:
        with self.lock:
            self.log.event("auth_failed", peer=peer, method=method, reason=why, count=count)
        self.log.progress(f"refused {count} call{'s' * (count != 1)} from {peer} without the right token ({why}; "
                          f"last: {method.rsplit('/', 1)[-1]})")
