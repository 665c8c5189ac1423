"""The coordinator's live view: an HTTP page and its JSON endpoint, served beside the gRPC service.

``GET /api/status`` answers the Status RPC's document as JSON (:func:`dtrain.status_doc.message_dict`, the same
document ``dtrain status --json`` prints); ``GET /api/history`` the run's history per version
(:meth:`coordinator.series.RunSeries.doc`); ``GET /`` answers the page (``coordinator/dashboard.html``, plain
HTML/JS/CSS with no external resource: it reads the history on load, polls ``/api/status`` and draws its charts as
inline SVG). ``dtrain dashboard RUN_DIR`` serves the same page and documents from a run's files
(:mod:`coordinator.run_view`). Auth is the
gRPC admin side's: with a token configured (``security.token_env``) every request needs
``Authorization: Bearer TOKEN``; the page alone may also be opened as ``/?token=TOKEN`` (its script then sends the
header). With the islands' own tokens on the gRPC side (auth on) and no operator token, it answers no one: the
dashboard needs the operator's token whenever auth is on. With TLS configured for gRPC the page is served over
HTTPS with the same certificate and key (and, with ``security.client_auth``, the same client-certificate check).

A stdlib ``ThreadingHTTPServer`` in a daemon thread: each request runs in its own thread and takes the service's
lock only for the status snapshot, so the page cannot slow the rounds down beyond one Status call per poll.
"""

from __future__ import annotations

import hmac
import json
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dtrain.config.ops import SecurityConfig
from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import bearer_matches
from dtrain.runlog import printable
from dtrain.status_doc import message_dict

STATUS_PATH = "/api/status"
HISTORY_PATH = "/api/history"
PAGE_PATHS = ("/", "/index.html")
REQUEST_TIMEOUT_S = 10.0  # a client that sends nothing (or never finishes its TLS handshake) is dropped after this
# Nothing outside this server may be loaded or contacted by the page: its script and style are inline, it talks
# to /api/status and /api/history only, and its charts are inline SVG.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


def dashboard_port(cfg: Config, grpc_port: int | None = None) -> int | None:
    """The port the dashboard binds: ``coordinator.dashboard_port``, except that a coordinator started on port 0
    (any free port: ``dtrain simulate``, tests) takes any free port for its dashboard too, so that such
    coordinators never contend for the configured one. None: no dashboard (``dashboard_port = -1``)."""
    port = cfg.coordinator.dashboard_port
    if port < 0:
        return None
    effective_grpc = cfg.coordinator.port if grpc_port is None else grpc_port
    return 0 if effective_grpc == 0 else port


def tls_context(sec: SecurityConfig) -> ssl.SSLContext | None:
    """HTTPS with the gRPC server's certificate and key (``security.server_cert``/``server_key``); with
    ``client_auth``, clients must present a certificate signed by ``security.ca``, as on gRPC. None: plain HTTP."""
    if not sec.server_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(Path(sec.server_cert).expanduser(), Path(sec.server_key).expanduser())
        if sec.client_auth:
            ctx.load_verify_locations(cafile=Path(sec.ca).expanduser())
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as e:
        raise DtrainError(f"[security] server_cert, server_key, ca: the dashboard's HTTPS cannot use them: {e} "
                          f"(or set coordinator.dashboard_port = -1: no dashboard)") from None
    return ctx


def page_html() -> bytes:
    """The page, a file of this package (``coordinator/dashboard.html``)."""
    return resources.files("coordinator").joinpath("dashboard.html").read_bytes()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    dashboard: Dashboard

    def finish_request(self, request: Any, client_address: Any) -> None:
        # In the request's own thread: a TLS handshake here cannot hold up the accepting thread.
        request.settimeout(REQUEST_TIMEOUT_S)
        ctx = self.dashboard.tls
        if ctx is not None:
            try:
                request = ctx.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):  # not TLS, a refused certificate, a timeout: nothing to answer
                request.close()
                return
        super().finish_request(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _bind(host: str, port: int) -> _Server:
    bind_host = host.strip("[]")
    cls = _Server6 if ":" in bind_host else _Server
    try:
        return cls((bind_host, port), _Handler, bind_and_activate=True)
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, socket.gaierror):
            why = f"cannot resolve {host!r}"
        raise DtrainError(f"cannot listen on {host}:{port} for the dashboard: {why}; pick another port with "
                          f"coordinator.dashboard_port (0: any free port, -1: no dashboard)") from None


def check_port_free(host: str, port: int) -> None:
    """Raises DtrainError naming the dashboard's ``host:port`` if it cannot be bound (bound as the dashboard binds
    it, then released), so a taken port fails before anything is started or written. Port 0 is always free."""
    if port:
        _bind(host, port).server_close()


class Dashboard:
    """The HTTP server: bound on construction (so a taken port fails before anything else starts), serving from
    :meth:`start` until :meth:`close`.

    ``status``: the Status document as plain JSON; ``auth_failed(peer, method, why)``: records a refused request,
    as the gRPC side's refusals are (:meth:`coordinator.refusals.AuthFailures.failed`: one rate-limited
    ``auth_failed`` event per peer host), with ``method`` = ``GET /PATH``."""

    def __init__(self, host: str, port: int, token: str | None, tls: ssl.SSLContext | None,
                 status: Callable[[], dict[str, Any]], auth_failed: Callable[[str, str, str], None],
                 auth_on: bool = False, history: Callable[[], dict[str, Any]] | None = None):
        """``auth_on``: the gRPC side checks tokens (the islands' own, with no operator token): then the
        dashboard answers no one without the operator's ``token``. ``history``: the run's history document
        (``GET /api/history``; None: an empty one)."""
        self.host, self.tls, self.status = host, tls, status
        self.history = history or (lambda: {"points": [], "evals": [], "recoveries": []})
        self._token = token
        self.auth_on, self.has_token = auth_on, bool(token)
        self.auth_failed = auth_failed
        self.page = page_html()
        self.server = _bind(host, port)
        self.server.dashboard = self
        self.port: int = self.server.server_address[1]
        self._thread: threading.Thread | None = None
        self._closing = threading.Lock()

    @property
    def url(self) -> str:
        """The page's address (without the token)."""
        host = f"[{self.host.strip('[]')}]" if ":" in self.host.strip("[]") else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="dashboard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops serving and releases the port (idempotent); requests in flight finish on their own (daemon)
        threads."""
        with self._closing:
            if self._thread is not None:
                self.server.shutdown()
                self._thread.join(timeout=5)
                self._thread = None
            self.server.server_close()

    def authorized(self, header: str, query_token: str | None) -> bool:
        """With no token configured, only when auth is off (:attr:`auth_on`); else the ``Authorization`` header,
        or (the page only) ``?token=``; both compared in constant time."""
        if not self._token:
            return not self.auth_on
        if bearer_matches(header, self._token):
            return True
        return query_token is not None and hmac.compare_digest(query_token.encode(), self._token.encode())


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "dtrain-dashboard"
    sys_version = ""
    # HTTP/1.0: one request per connection, so a closed dashboard (close()) leaves no kept-alive connection
    # serving; a page polling every 1.5 s opens a connection per poll, which costs nothing here.
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the stdlib's access log would print each poll, and a ``?token=`` with it."""

    def do_GET(self) -> None:
        dash = self.server.dashboard
        url = urlsplit(self.path)
        path = url.path
        if path not in PAGE_PATHS and path not in (STATUS_PATH, HISTORY_PATH):
            self._send(404, _error(f"no such path: {printable(path, 64)} (the page is /, the status document "
                                   f"{STATUS_PATH}, the history {HISTORY_PATH})"))
            return
        query = parse_qs(url.query).get("token") if path in PAGE_PATHS else None
        if not dash.authorized(self.headers.get("Authorization", ""), query[-1] if query else None):
            why = "missing or wrong bearer token" if dash.has_token else "no operator token set while auth is on"
            dash.auth_failed(peer_name(self.client_address), f"GET {path}", why)
            self._send(401, _error(f"{why} (send 'Authorization: Bearer TOKEN', or open the page as /?token=TOKEN; "
                                   f"the operator's token is in the environment variable named by "
                                   f"security.token_env of the coordinator)"),
                       extra={"WWW-Authenticate": 'Bearer realm="dtrain"'})
            return
        if path in (STATUS_PATH, HISTORY_PATH):
            try:
                doc = dash.status() if path == STATUS_PATH else dash.history()
                body = json.dumps(doc, allow_nan=False).encode()
            except Exception as e:  # noqa: BLE001  # the status could not be read: say so, keep serving
                self._send(500, _error(f"{path[5:]} unavailable: {type(e).__name__}: {e}"))
                return
            self._send(200, body)
        else:
            self._send(200, dash.page, content_type="text/html; charset=utf-8")

    def do_HEAD(self) -> None:
        self._not_allowed()

    def do_POST(self) -> None:
        self._not_allowed()

    def do_PUT(self) -> None:
        self._not_allowed()

    def do_DELETE(self) -> None:
        self._not_allowed()

    def do_PATCH(self) -> None:
        self._not_allowed()

    def do_OPTIONS(self) -> None:
        self._not_allowed()

    def _not_allowed(self) -> None:
        self.close_connection = True  # a body it may have sent is not read
        self._send(405, _error(f"method {self.command} not allowed: the dashboard answers GET only"),
                   extra={"Allow": "GET"})

    def _send(self, code: int, body: bytes, content_type: str = "application/json",
              extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the page's URL may hold ?token=
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


def peer_name(address: Any) -> str:
    """A client's address as gRPC names peers: ``ipv4:HOST:PORT`` or ``ipv6:[HOST]:PORT``."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def open_dashboard(cfg: Config, port: int, token: str | None, status_message: Callable[[], pb.StatusResponse],
                   auth_failed: Callable[[str, str, str], None], auth_on: bool = False,
                   history: Callable[[], dict[str, Any]] | None = None) -> Dashboard:
    """The coordinator's dashboard on ``coordinator.dashboard_host`` (else ``coordinator.host``) and ``port``,
    bound (not yet serving): ``status_message()`` (the service's Status) as JSON; a refused request goes to
    ``auth_failed(peer, method, why)`` (the service's :meth:`coordinator.refusals.AuthFailures.failed`, method
    ``GET /PATH``: an ``auth_failed`` event, which its history lists among the run's faults). ``auth_on``: the
    gRPC side checks tokens: with no operator ``token`` the dashboard then answers no one. ``history``: the run's
    history document (the service's :meth:`coordinator.series.RunSeries.doc`)."""

    def status() -> dict[str, Any]:
        return message_dict(status_message())

    return Dashboard(cfg.coordinator.dashboard_address, port, token, tls_context(cfg.security), status, auth_failed,
                     auth_on=auth_on, history=history)
