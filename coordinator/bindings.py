"""Which identity may act as which island (``security.identity`` "token" or "cert"; ``dtrain/net/identity.py`` says
what an identity is): a name is bound to one identity, and an identity to one name.

- A name is bound to the identity that first joined with it (checkpointed with the state, at each merge; a name
  that joined after the checkpoint a restarted coordinator resumed from is bound again by its island's next call);
  another identity cannot join, push, pull or heartbeat as that island (PERMISSION_DENIED). With "token", every
  name is bound from the start to its own token's identity (``token:NAME``, the ``security.island_tokens`` file's
  line for NAME): a token acts only as its own island, and a name no token is issued for cannot join.
- One identity is one island: an identity bound to a name cannot join under a second one (the Sybil case), even
  after its island was lost or forgotten.
- Only the operator re-binds: ``security.bindings`` pins (``NAME=IDENTITY``) override both rules above, read at
  the coordinator's start (change the config, restart it with ``--resume``).
- "shared": no identities, nothing is checked (any holder of the shared token may act as any island).

Pure: :class:`Bindings` raises ``StateError`` PERMISSION_DENIED before any change; :meth:`Bindings.bind` records a
binding once the Join it checked succeeded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from coordinator.records import StateError
from dtrain.net.identity import token_identity

MAX_IDENTITY_LEN = 1024  # a bound identity's characters (a certificate's URI SAN or CN, a token's name)
_HOW = "the operator re-binds a name with a security.bindings pin (docs/security.md)"


class Binding(NamedTuple):
    """A name bound at its first Join (a checkpoint row)."""

    name: str
    identity: str


class Bindings:
    """The names' identities under ``mode`` (``security.identity``): ``pins`` (name -> identity, the
    operator's ``security.bindings``) over ``learned`` (name -> identity, from first Joins; checkpointed)."""

    def __init__(self, mode: str, pins: Mapping[str, str], learned: Iterable[Binding] = ()):
        self.mode = mode
        self.pins = dict(pins)
        self.learned = {b.name: b.identity for b in learned}

    def rows(self) -> list[Binding]:
        """The learned bindings, for the checkpoint."""
        return [Binding(name, identity) for name, identity in self.learned.items()]

    def bound(self, name: str) -> str | None:
        """The identity that may act as ``name``, None while none may (a name no one joined with yet)."""
        if name in self.pins:
            return self.pins[name]
        if self.mode == "token":
            return token_identity(name)
        return self.learned.get(name)

    def name_of(self, identity: str) -> str | None:
        """The name ``identity`` is bound to, if any (a pin first)."""
        for name in [*self.pins, *self.learned]:
            if self.bound(name) == identity:
                return name
        if self.mode == "token" and identity.startswith("token:") and self.bound(identity[6:]) == identity:
            return identity[6:]
        return None

    def check(self, name: str, identity: str | None, island_id: str = "") -> None:
        """Refuses (PERMISSION_DENIED, naming the caller and why) an ``identity`` that may not act as island
        ``name`` (``island_id``: its record, for a call after Join): the name is bound to another identity, or,
        unbound, would be bound to one that has a name already. Nothing is checked with identity "shared"."""
        if self.mode == "shared":
            return
        who = island_id or name
        if identity is None:
            carries = ("an island's own token (the shared token is the operator's: Status and the dashboard)"
                       if self.mode == "token" else "a client certificate")
            raise StateError("PERMISSION_DENIED", f"the call carries no island identity, so it cannot act as "
                                                  f"island {who}: security.identity is {self.mode!r}, an island "
                                                  f"needs {carries}")
        if len(identity) > MAX_IDENTITY_LEN:
            raise StateError("PERMISSION_DENIED", f"the call's identity is {len(identity)} characters, more than "
                                                  f"{MAX_IDENTITY_LEN}: not an island's")
        bound = self.bound(name)
        if bound is not None and bound != identity:
            issued = " (a token acts only as the name it is issued for)" if self.mode == "token" else ""
            raise StateError("PERMISSION_DENIED", f"{identity} may not act as island {who}: the name {name} is "
                                                  f"bound to another identity{issued}; {_HOW}")
        other = self.name_of(identity) if bound is None else None
        if other is not None and other != name:
            raise StateError("PERMISSION_DENIED", f"{identity} cannot act as {name}: it is island {other}'s "
                                                  f"identity, and one identity is one island; {_HOW}")

    def bind(self, name: str, identity: str | None) -> None:
        """Records the identity a call (checked by :meth:`check`) came with, if the name had none: at a first
        Join, or, for a name whose binding was made after the last checkpoint a restarted coordinator resumed
        from, at the island's next call."""
        if self.mode != "shared" and identity is not None and self.bound(name) is None:
            self.learned[name] = identity
