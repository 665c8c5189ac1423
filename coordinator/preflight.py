"""The coordinator's checks before anything starts: nothing is written to the run folder until they pass.

Owns :func:`preflight` (free ports, the telemetry exporter, the token and TLS files, secure by default:
:func:`check_exposure`) and a range shard's :func:`shard_preflight`.
"""

from __future__ import annotations

import dataclasses

import grpc

from coordinator.dashboard import check_port_free, dashboard_port
from coordinator.shard import read_secret
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.net.identity import IslandTokens
from dtrain.net.wire import read_token, server_credentials
from dtrain.telemetry import require_exporter

IN_USE = ("the address is already in use (another coordinator?): stop the other process, or pick another port "
           "with --port or coordinator.port")


# What preflight() read: the bearer token (None: no shared token), the server's TLS credentials (None: plaintext)
# and, with security.identity "token", the islands' own tokens (dtrain.net.identity.IslandTokens; else None).
Preflight = tuple[str | None, grpc.ServerCredentials | None, IslandTokens | None]


def preflight(cfg: Config, port: int | None) -> Preflight:
    """The checks a coordinator passes before it writes anything: its ports are free (:func:`check_ports_free`),
    the telemetry exporter is installed, its token and TLS files are readable and not deploy/'s placeholders
    (ConfigError otherwise), and so is the islands' token file with ``security.identity`` "token"; returns the
    token, the credentials and the island tokens for :func:`serve`."""
    check_ports_free(cfg, port)
    require_exporter(cfg.telemetry)
    sec = cfg.security
    token, creds = read_token(sec), server_credentials(sec)
    island_tokens = IslandTokens.read(sec.island_tokens) if sec.identity == "token" else None
    check_exposure(cfg, token is not None or island_tokens is not None, dashboard_port(cfg, port) is not None)
    if cfg.coordinator.shards > 1:
        read_secret(cfg)  # a sharded coordinator's: before θ_0 too
    return token, creds, island_tokens


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only: 127.0.0.0/8, ::1 or localhost. Any other name, and ''
    (every interface), is not."""
    import ipaddress

    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: Config, auth: bool, dashboard: bool = True) -> None:
    """Secure by default: a coordinator that listens beyond loopback (its gRPC address, or its dashboard's when
    ``dashboard``) with no ``auth`` (a token: the operator's or the islands' own) and no mutual TLS serves anyone
    who reaches the port as any island; ConfigError, one line, unless ``security.insecure`` (``dtrain coordinator
    --insecure``) says so in so many words."""
    c, sec = cfg.coordinator, cfg.security
    if auth or sec.client_auth or sec.insecure:
        return
    binds = [("coordinator.host", c.host)] + ([("the dashboard's host", c.dashboard_address)] if dashboard else [])
    exposed = [(what, host) for what, host in binds if not is_loopback(host)]
    if exposed:
        what, host = exposed[0]
        raise ConfigError(f"{what} {host or '(every interface)'} listens beyond loopback with no "
                          f"authentication: anyone who reaches it may act as any island; set a token (the "
                          f"environment variable named by security.token_env, or the islands' own: "
                          f"security.island_tokens) or mutual TLS (security.client_auth), or pass --insecure "
                          f"(security.insecure = true) to serve it open")


def check_ports_free(cfg: Config, port: int | None) -> None:
    """The gRPC address (``port``, else coordinator.port) and the dashboard's port are free to bind, or a
    DtrainError naming the one that is not."""
    c = cfg.coordinator
    check_address_free(c.host, c.port if port is None else port)
    dash_port = dashboard_port(cfg, port)
    if dash_port is not None:
        check_port_free(c.dashboard_address, dash_port)


def check_address_free(host: str, port: int) -> None:
    """Raises DtrainError naming ``host:port`` if it cannot be bound, e.g. another coordinator listens there.

    The server itself binds with SO_REUSEPORT off (:func:`server_options`), so it would fail too; checking first,
    with a plain socket bound the way gRPC binds (SO_REUSEADDR on), gives a clear error before anything is
    started or written, and keeps gRPC's own multi-line bind log off the terminal. Port 0 is always free."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise DtrainError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DtrainError(f"cannot listen on {host}:{port}: {IN_USE}") from None
                raise DtrainError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def shard_preflight(cfg: Config, port: int | None) -> Preflight:
    """:func:`preflight` for a range shard: its port free, its token, TLS, island tokens and shard secret readable
    and not placeholders (ConfigError), before θ_0's work."""
    c = cfg.coordinator
    check_ports_free(dataclasses.replace(cfg, coordinator=dataclasses.replace(c, dashboard_port=-1)), port)
    sec = cfg.security
    token, creds = read_token(sec), server_credentials(sec)
    island_tokens = IslandTokens.read(sec.island_tokens) if sec.identity == "token" else None
    check_exposure(cfg, token is not None or island_tokens is not None, dashboard=False)
    read_secret(cfg)
    return token, creds, island_tokens

