"""gRPC's own TLS handshake lines, folded into one rate-limited line of the coordinator's log.

gRPC's C core logs each failed TLS handshake (a client speaking plaintext to a TLS port, a wrong CA, a port scanner)
as an INFO line of its own, through absl, straight to file descriptor 2: ``I1128 08:09:36.339893 12668
ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: ...``, one per connection attempt, a
few a second from one misconfigured island. No Python logging filter sees them (they never pass through Python);
``GRPC_VERBOSITY=ERROR`` silences them, and with them the fact that handshakes fail. :class:`HandshakeFold` instead
puts a pipe under descriptor 2: every line passes through unchanged except gRPC's handshake lines, which are counted
and said as one line (:func:`fold_line`) when the first comes and then at most every :data:`FOLD_EVERY_S` (the
count since), and once more at the close for the rest. Only ``dtrain coordinator`` with TLS installs it.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time

log = logging.getLogger(__name__)

FOLD_EVERY_S = 60.0
# gRPC's handshake lines: its TLS transport's and its handshaker's source files, or the message itself.
NOISE = re.compile(rb"ssl_transport_security\.cc|security_handshaker\.cc|Handshake failed with error")
_REASON = re.compile(rb"OPENSSL_internal:([A-Z_]+)")


def fold_line(count: int, window_s: float | None, reason: str) -> str:
    """The one line said for ``count`` failed handshakes (``window_s``: over how long; None: the first)."""
    why = f" ({reason})" if reason else ""
    hint = ("a client speaking plaintext to this TLS port (WRONG_VERSION_NUMBER: it has no security.ca, or no "
            "--tls-ca for dtrain status), or one that trusts another CA or sends no or the wrong client certificate")
    when = "a TLS handshake failed" if window_s is None else \
        f"{count} more TLS handshake{'s' * (count != 1)} failed in the last {window_s:.0f} s"
    return f"{when}{why}: {hint}; gRPC's own lines for them are folded into this one, at most every " \
           f"{FOLD_EVERY_S:.0f} s"


class HandshakeFold:
    """The pipe under descriptor 2 (see the module docstring): :meth:`install`, then :meth:`close` (also at exit)."""

    def __init__(self, every_s: float = FOLD_EVERY_S):
        self.every_s = every_s
        self.count = 0  # handshake lines not said yet
        self.total = 0
        self.reason = ""
        self._said_at: float | None = None
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        read, write = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="grpc-noise", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _pump(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                if NOISE.search(line):
                    self._noise(line)
                elif self._saved is not None:
                    os.write(self._saved, line)

    def _noise(self, line: bytes) -> None:
        self.count += 1
        self.total += 1
        found = _REASON.search(line)
        self.reason = found.group(1).decode() if found else self.reason
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= self.every_s:
            self._say(now)

    def _say(self, now: float) -> None:
        first = self._said_at is None
        window = None if first else now - self._said_at  # type: ignore[operator]
        log.warning(fold_line(self.count, window, self.reason))  # through the pipe: it is not a handshake line
        self._said_at, self.count = now, 0

    def close(self) -> None:
        """Restores descriptor 2 (the pipe ends; its last lines are passed on) and says the handshakes not said."""
        if self._saved is None:
            return
        for stream in (logging.getLogger().handlers):
            flush = getattr(stream, "flush", None)
            if flush is not None:
                flush()
        os.dup2(self._saved, 2)  # closes the pipe's last writer: the pump reads to its end
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.count:
            self._say(time.monotonic())
        os.close(self._saved)
        self._saved = None
