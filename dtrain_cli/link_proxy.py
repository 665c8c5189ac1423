"""A TCP proxy on loopback between one island and the coordinator: how ``dtrain simulate`` injects link faults.

The ``cut`` and ``slow`` faults of :mod:`dtrain_cli.fault_spec` put one :class:`LinkProxy` between their island
and the coordinator for the whole run; the driver (:mod:`dtrain_cli.simulate`) cuts, slows and restores it.
Plain sockets and threads; nothing here knows the protocol it carries.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


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

    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        """Listens on a free port of ``host`` (:attr:`port`, where the island connects) and forwards every
        connection to ``host:upstream_port`` (the coordinator's)."""
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
        """``pass``, ``cut`` or ``slow``."""
        return self._link.mode

    def _start(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
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
