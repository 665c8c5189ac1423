"""Fault injection for ``dtrain simulate``: the ``--fault SPEC`` grammar and a TCP proxy for link faults.

A spec is ``KIND[:TARGET]@WHEN[+DURATION][,KEY=VALUE...]``:

- ``KIND``: ``kill`` (SIGKILL an island; with ``+DURATION`` it is started again that long after),
  ``hang`` (SIGSTOP an island, SIGCONT after ``DURATION``), ``kill-coordinator`` (SIGKILL the coordinator;
  with ``+DURATION`` it is started again with ``--resume`` on the same port), ``cut`` (the island's link to
  the coordinator drops every connection and accepts none for ``DURATION``), ``slow`` (the island's link
  delays every piece of data by ``delay=MS`` milliseconds for ``DURATION``); the push faults ``nan`` (the
  island's next push carries a NaN), ``poison`` (its real delta x -1000, honest tokens), ``inflate`` (a
  constant delta as large as the codec carries, tokens claimed 10**9) and ``truncate`` (its upload is cancelled
  after about half of its chunks, then sent whole again): the driver passes these to the island's worker
  (``dtrain worker --inject KIND@vN``), which corrupts its first push based on version >= N
  (:mod:`workers.inject` says exactly what is sent and what in the coordinator stops it).
- ``TARGET``: an island name (``island-0`` ... ``island-N-1``); none for ``kill-coordinator``.
- ``WHEN``: ``vN`` (once the coordinator has merged version N) or ``Ns`` (N seconds after the workers
  were started); push faults take ``vN`` only (the island's first push based on version N or later).
- ``DURATION``: seconds, e.g. ``+10s``; ``hang``, ``cut`` and ``slow`` need one; push faults take none.

Examples: ``kill:island-1@v3+10s``, ``hang:island-2@20s+30s``, ``kill-coordinator@v5+3s``,
``cut:island-0@v2+8s``, ``slow:island-3@10s+20s,delay=200``, ``nan:island-1@v2``, ``truncate:island-0@v1``.

Everything here is plain parsing and sockets; the driver (:mod:`dtrain_cli.simulate`) decides when a fault
fires and records it in the run's events.
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from dtrain.config import ConfigError

PUSH_KINDS = ("nan", "poison", "inflate", "truncate")  # injected by the island's worker (workers.inject)
KINDS = ("kill", "hang", "kill-coordinator", "cut", "slow", *PUSH_KINDS)
NEEDS_DURATION = ("hang", "cut", "slow")
LINK_KINDS = ("cut", "slow")
_SPEC_RE = re.compile(r"(?P<kind>[a-z-]+)(?::(?P<target>[A-Za-z0-9._-]+))?@(?P<when>v\d+|\d+(?:\.\d+)?s)"
                      r"(?:\+(?P<duration>\d+(?:\.\d+)?)s)?(?P<opts>(?:,[a-z_]+=[0-9.]+)*)")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    target: str  # an island name, or "coordinator"
    at_version: int | None  # fire once this version is merged ...
    at_s: float | None  # ... or this many seconds after the workers started
    duration_s: float | None  # restart / resume / restore after this long (None: never)
    delay_ms: float = 0.0  # slow: added per forwarded piece of data
    text: str = ""  # the spec as given

    def describe(self) -> str:
        when = f"after version {self.at_version}" if self.at_version is not None else f"at {self.at_s:g}s"
        return f"{self.kind} {self.target} {when}" + (f" for {self.duration_s:g}s" if self.duration_s else "")


def parse_fault(text: str, islands: int) -> FaultSpec:
    """One ``--fault`` value; raises ConfigError naming what is wrong."""
    m = _SPEC_RE.fullmatch(text.strip())
    if m is None:
        raise ConfigError(f"--fault {text!r}: expected KIND[:ISLAND]@(vN|Ns)[+Ds][,delay=MS], "
                          f"e.g. kill:island-1@v3+10s")
    kind, target = m["kind"], m["target"]
    if kind not in KINDS:
        raise ConfigError(f"--fault {text!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    names = [f"island-{i}" for i in range(islands)]
    if kind == "kill-coordinator":
        if target:
            raise ConfigError(f"--fault {text!r}: kill-coordinator takes no target")
        target = "coordinator"
    elif not target:
        raise ConfigError(f"--fault {text!r}: {kind} needs an island, e.g. {kind}:{names[-1]}@v2")
    elif target not in names:
        raise ConfigError(f"--fault {text!r}: target {target!r} is not an island of this run "
                          f"({names[0]} .. {names[-1]})")
    duration = float(m["duration"]) if m["duration"] else None
    if kind in PUSH_KINDS:
        if not m["when"].startswith("v"):
            raise ConfigError(f"--fault {text!r}: {kind} fires at a version only (the island's first push based "
                              f"on it), e.g. {kind}:{target}@v2")
        if m["duration"]:
            raise ConfigError(f"--fault {text!r}: {kind} takes no duration (it corrupts one push)")
    if kind in NEEDS_DURATION and not duration:
        raise ConfigError(f"--fault {text!r}: {kind} needs a duration, e.g. {kind}:{target}@v2+10s")
    opts = dict(kv.split("=") for kv in m["opts"].split(",") if kv)
    unknown = set(opts) - ({"delay"} if kind == "slow" else set())
    if unknown:
        raise ConfigError(f"--fault {text!r}: unknown option(s) {', '.join(sorted(unknown))}")
    delay = float(opts.get("delay", 100.0 if kind == "slow" else 0.0))
    when = m["when"]
    at_version = int(when[1:]) if when.startswith("v") else None
    at_s = float(when[:-1]) if at_version is None else None
    return FaultSpec(kind=kind, target=target, at_version=at_version, at_s=at_s, duration_s=duration,
                     delay_ms=delay, text=text.strip())


@dataclass
class _Link:
    mode: str = "pass"  # "pass" | "cut" | "slow"
    delay_s: float = 0.0
    conns: list[socket.socket] = field(default_factory=list)


class LinkProxy:
    """A TCP proxy on 127.0.0.1 between one island and the coordinator, whose link can be cut or slowed.

    ``cut()`` closes every open connection and refuses new ones (accepted, then closed at once) until
    ``restore()``; ``slow(delay_s)`` holds every piece of data that long before forwarding it. Threads: one
    accepting, two per connection; all stop with :meth:`close`."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self._link = _Link()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop)

    @property
    def mode(self) -> str:
        return self._link.mode

    def _start(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._server], [], [], 0.2)
            if not ready:
                continue
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._link.mode == "cut":
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    client.close()
                    continue
                self._link.conns += [client, upstream]
            self._start(self._pipe, client, upstream)
            self._start(self._pipe, upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                delay = self._link.delay_s if self._link.mode == "slow" else 0.0
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: cut() closed the socket meanwhile (its fd is -1)
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self._link.mode = "cut"
            conns, self._link.conns = self._link.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def slow(self, delay_s: float) -> None:
        with self._lock:
            self._link.mode, self._link.delay_s = "slow", delay_s

    def restore(self) -> None:
        with self._lock:
            self._link.mode, self._link.delay_s = "pass", 0.0

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        self.cut()
        for t in self._threads:
            t.join(timeout=1)
