"""What listens at an address, asked before a client blames the network: :func:`listening` (anything accepts a TCP
connection) and :func:`speaks_tls` (it answers a TLS handshake). A plaintext gRPC client at a TLS port sees only
"the connection was closed"; these name the cause (``security.ca`` unset) instead."""

from __future__ import annotations

import socket
import ssl

from dtrain.net.wire import parse_address

PROBE_TIMEOUT_S = 2.0


def listening(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether something accepts a TCP connection at ``address`` (HOST:PORT): False when it is refused (nothing
    listens), None when that cannot be told within ``timeout_s`` (no answer, a name that does not resolve)."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def speaks_tls(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at ``address`` answers a TLS handshake (its certificate is not checked: only whether it
    speaks TLS; one that wants a client certificate counts too)."""
    host, port = parse_address(address)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=host.strip("[]")):
                return True
    except ssl.SSLError as e:  # an alert from the server (e.g. a client certificate it wants): it speaks TLS
        return "ALERT" in str(e).upper()
    except OSError:
        return False
