"""A TCP proxy on loopback between one island and the coordinator: how ``dtrain simulate`` injects link faults.

The ``cut`` and ``slow`` faults of :mod:`dtrain_cli.fault_spec` put one :class:`LinkProxy` between their island
and the coordinator for the whole run; the driver (:mod:`dtrain_cli.simulate_processes`) cuts, slows and
restores it.

A proxy can also stand for a wide-area link (:class:`LinkShape`, ``dtrain simulate --link 100mbit/100ms`` or
``--island NAME:link=...``): each direction is a pipe of a fixed bandwidth and one-way delay (half the round
trip). A piece of data leaves when the pipe has sent what came before it (``len x 8 / rate`` seconds each: the
serialization of a token bucket whose bucket holds one piece) and arrives half a round trip later; every
connection of the island shares its pipe, and a pipe holds at most about two bandwidth-delay products in flight
(then the sender waits: TCP's back-pressure, as on a real link).

Plain sockets and threads; nothing here knows the protocol it carries.
"""

from __future__ import annotations

import math
import queue
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"ms": 1e-3, "s": 1.0}
PIECE = 1 << 16  # bytes read at a time


class LinkError(ValueError):
    """A malformed ``--link`` value."""


@dataclass(frozen=True)
class LinkShape:
    """A wide-area link: ``rate_bps`` bits per second each way and a round trip of ``rtt_s`` seconds."""

    rate_bps: float
    rtt_s: float

    def __str__(self) -> str:
        return f"{self.rate_bps / 1e6:g}mbit/{self.rtt_s * 1e3:g}ms"

    @property
    def in_flight_bytes(self) -> int:
        """What one direction holds at most: two bandwidth-delay products (at least 4 pieces)."""
        return max(int(2 * self.rate_bps / 8 * self.rtt_s), 4 * PIECE)


def parse_link(text: str) -> LinkShape:
    """``RATE/RTT``, e.g. ``100mbit/100ms`` or ``1gbit/0.2s`` (rates in kbit, mbit or gbit per second)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(kbit|mbit|gbit)\s*/\s*([0-9.]+)\s*(ms|s)\s*", text.lower())
    if not m:
        raise LinkError(f"link {text!r}: expected RATE/RTT such as 100mbit/100ms (kbit, mbit or gbit; ms or s)")
    try:
        rate, rtt = float(m[1]) * _RATE_UNITS[m[2]], float(m[3]) * _TIME_UNITS[m[4]]
    except ValueError:
        raise LinkError(f"link {text!r}: {m[1]!r} or {m[3]!r} is not a number") from None
    if not (math.isfinite(rate) and rate > 0) or not (math.isfinite(rtt) and 0 <= rtt <= 10):
        raise LinkError(f"link {text!r}: the rate must be > 0 and the round trip in [0, 10] s")
    return LinkShape(rate, rtt)


@dataclass
class _Link:
    """The link's state, shared by the proxy's threads under its lock: its mode, the delay when slow and the
    open sockets (both ends of every connection)."""

    mode: str = "pass"  # "pass" | "cut" | "slow"
    delay_s: float = 0.0
    conns: list[socket.socket] = field(default_factory=list)


class LinkProxy:
    """A TCP proxy on 127.0.0.1 between one island and the coordinator, whose link can be cut or slowed.

    ``cut()`` closes every open connection and refuses new ones (accepted, then closed at once) until
    ``restore()``; ``slow(delay_s)`` holds every piece of data that long before forwarding it. Threads: one
    accepting, two per connection; all stop with :meth:`close`."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1", shape: LinkShape | None = None):
        """Listens on a free port of ``host`` (:attr:`port`, where the island connects) and forwards every
        connection to ``host:upstream_port`` (the coordinator's); ``shape``: the link's bandwidth and round trip
        (None: as fast as loopback)."""
        self.upstream = (host, upstream_port)
        self.shape = shape
        self._sent_until = {"up": 0.0, "down": 0.0}  # per direction: when its pipe has sent what it was given
        self.bytes = {"up": 0, "down": 0}  # forwarded, per direction
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self._link = _Link()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop)

    @property
    def mode(self) -> str:
        """``pass``, ``cut`` or ``slow``."""
        return self._link.mode

    def _start(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._server], [], [], 0.2)
            except (OSError, ValueError):  # close() closed the socket while select waited on it: stopping
                return
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
            self._start(self._pipe, client, upstream, "up")
            self._start(self._pipe, upstream, client, "down")

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        """Forwards ``src`` to ``dst``: at once, or through the link's pipe (:meth:`_deliver`) when it has a
        shape; with the ``slow`` fault, each piece is held its delay before it goes on."""
        pipe: queue.Queue[tuple[float, bytes] | None] | None = None
        if self.shape is not None:
            pipe = queue.Queue(maxsize=max(self.shape.in_flight_bytes // PIECE, 4))
            self._start(self._deliver, pipe, dst, src)
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(PIECE)
                if not data:
                    break
                delay = self._link.delay_s if self._link.mode == "slow" else 0.0
                if delay:
                    time.sleep(delay)
                with self._lock:
                    self.bytes[direction] += len(data)
                if pipe is None:
                    dst.sendall(data)
                    continue
                assert self.shape is not None
                with self._lock:  # the island's connections share the pipe: one clock per direction
                    start = max(time.monotonic(), self._sent_until[direction])
                    self._sent_until[direction] = start + len(data) * 8 / self.shape.rate_bps
                    arrives = self._sent_until[direction] + self.shape.rtt_s / 2
                while not self._closed.is_set():  # a full pipe: wait (the sender's TCP window fills, as on a link)
                    try:
                        pipe.put((arrives, data), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except (OSError, ValueError):  # ValueError: cut() closed the socket meanwhile (its fd is -1)
            pass
        finally:
            handed = False
            if pipe is not None:
                try:
                    pipe.put(None, timeout=1)  # the deliverer shuts the sockets once what is in flight arrived
                    handed = True
                except queue.Full:
                    pass
            if not handed:
                _shutdown(src, dst)

    def _deliver(self, pipe: queue.Queue[tuple[float, bytes] | None], dst: socket.socket, src: socket.socket
                 ) -> None:
        """A shaped direction's far end: sends each piece to ``dst`` when it arrives (in order); shuts both
        sockets once the pipe ends."""
        try:
            while not self._closed.is_set():
                try:
                    item = pipe.get(timeout=0.2)
                except queue.Empty:
                    continue
                if item is None:
                    break
                arrives, data = item
                wait = arrives - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            _shutdown(dst, src)

    def cut(self) -> None:
        """Closes every open connection and refuses new ones until :meth:`restore`."""
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
        """Holds every piece of data ``delay_s`` seconds before forwarding it, until :meth:`restore`."""
        with self._lock:
            self._link.mode, self._link.delay_s = "slow", delay_s

    def restore(self) -> None:
        """Passes data through again, at once, and accepts new connections."""
        with self._lock:
            self._link.mode, self._link.delay_s = "pass", 0.0

    def close(self) -> None:
        """Stops listening, closes every connection and joins the proxy's threads (a second each at most)."""
        self._closed.set()
        self._server.close()
        self.cut()
        for t in self._threads:
            t.join(timeout=1)


def _shutdown(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
