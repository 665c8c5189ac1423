"""Who an island is (``security.identity``): the identity a call carries, for the coordinator's name bindings.

- ``shared``: no identity. One token (``security.token_env``) or one client certificate for everyone: whoever
  holds it may act as any island. For a single trusted team.
- ``token``: each island has a token of its own, sent as the shared one is (``authorization: Bearer``, from
  the island's ``security.token_env``). The coordinator holds only their hashes, in the ``security.island_tokens``
  file: one ``NAME sha256:HEX`` line per island (:func:`hash_line`; ``dtrain admin issue-token NAME`` prints a
  token and its line). The call's identity is ``token:NAME``, and NAME is bound to it from the start.
- ``cert``: mutual TLS; the identity is the client certificate's first URI SAN (``uri:spiffe://...``), or, with
  none, its subject's CN (``cn:...``), as gRPC's auth context reports them (:func:`cert_identity`).

What an identity may do (a name bound to one identity, one identity to one name) is the coordinator's
(``coordinator/bindings.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.config.sections import ISLAND_NAME_RE, ConfigError
from dtrain.net.wire import MAKE_ISLAND_TOKEN, MAKE_ISLAND_TOKENS, PLACEHOLDER

HASH_PREFIX = "sha256:"
TOKEN_BYTES = 32  # an issued token: 32 random bytes, as 64 hex digits


def token_hash(token: str) -> str:
    """What the coordinator stores of a token: ``sha256:`` and the hex SHA-256 of its UTF-8 bytes."""
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def issue_token() -> str:
    """A fresh island token: :data:`TOKEN_BYTES` random bytes as hex."""
    return secrets.token_hex(TOKEN_BYTES)


def hash_line(name: str, token: str) -> str:
    """The ``security.island_tokens`` line that lets ``token`` act as island ``name``."""
    return f"{name} {token_hash(token)}"


class IslandTokens:
    """The islands' token hashes (``security.island_tokens``): which name a presented token acts as."""

    def __init__(self, entries: Mapping[str, str]):
        """``entries``: name -> :func:`token_hash` of its token."""
        self.entries = dict(entries)

    @classmethod
    def read(cls, path: str) -> IslandTokens:
        """The file of ``NAME sha256:HEX`` lines (blank lines and ``#`` comments skipped); ConfigError naming the
        file and line if it cannot be read, a line is malformed, or a name or hash is listed twice."""
        what = f"[security] island_tokens: {path}"
        try:
            text = Path(path).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
        if text.strip().startswith(PLACEHOLDER):
            raise ConfigError(f"{what} holds the placeholder of deploy/coordinator/secret-island-tokens.yaml, not "
                              f"the islands' token hashes: issue one token per island (docs/deploy.md, step 4): "
                              f"{MAKE_ISLAND_TOKEN}; then {MAKE_ISLAND_TOKENS}")
        entries: dict[str, str] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            digest = parts[1][len(HASH_PREFIX):] if len(parts) == 2 and parts[1].startswith(HASH_PREFIX) else ""
            if not (len(parts) == 2 and ISLAND_NAME_RE.fullmatch(parts[0]) and len(digest) == 64
                    and all(c in "0123456789abcdef" for c in digest)):
                raise ConfigError(f"{what}, line {n}: expected 'NAME sha256:HEX' (64 lowercase hex digits), as "
                                  f"`dtrain admin issue-token NAME` prints it")
            name, hashed = parts
            if name in entries:
                raise ConfigError(f"{what}, line {n}: island {name} is listed twice (one token per island)")
            if hashed in entries.values():
                raise ConfigError(f"{what}, line {n}: the same token is listed for two islands (one token per "
                                  f"island)")
            entries[name] = hashed
        if not entries:
            raise ConfigError(f"{what}: lists no island (issue one token per island: `dtrain admin issue-token "
                              f"NAME`)")
        return cls(entries)

    def name_of(self, token: str) -> str | None:
        """The island name ``token`` is issued for, or None: its hash compared with every entry in constant
        time (a wrong token costs the same whichever entry it resembles)."""
        hashed = token_hash(token).encode()
        found = None
        for name, entry in self.entries.items():
            if hmac.compare_digest(hashed, entry.encode()):
                found = name
        return found


def token_identity(name: str) -> str:
    return f"token:{name}"


def cert_identity(auth_context: Mapping[str, Any]) -> str | None:
    """A mutual-TLS peer's identity from gRPC's auth context: ``uri:`` its first URI SAN (``peer_uri``), else
    ``cn:`` its subject's CN (``x509_common_name``); None without a client certificate. (gRPC gives each key a
    list of bytes.)"""
    for key, kind in (("peer_uri", "uri"), ("x509_common_name", "cn")):
        values = list(auth_context.get(key, ()))
        if values:
            return f"{kind}:{values[0].decode(errors='replace')}"
    return None
