"""The island's link to its coordinator: one kind per deployment, with the same small interface.

A run has one coordinator (:class:`OneCoordinator`) or a sharded one (:class:`ShardedCoordinator`,
``coordinator.shards`` > 1: :mod:`workers.shard_links`). Each kind holds the island's :class:`~workers.exchange.Puller`
(θ down) and :class:`~workers.exchange.Uplink` (Δ up) for that deployment, hears each Join's reply (a sharded
coordinator names its range shards there), counts the bytes moved to and from every coordinator process, and
closes what it opened. :func:`workers.app.coordinator_link` chooses the kind, once, where the island is built; the
training loop (:mod:`workers.island`) and the run's end (:mod:`workers.ending`) use the interface only.
"""

from __future__ import annotations

from typing import Protocol

from dtrain.net.proto import dtrain_pb2 as pb
from workers.client import CoordinatorClient
from workers.exchange import Puller, Uplink
from workers.shard_links import ShardedPuller, ShardedUplink, ShardLinks


class Traffic(Protocol):
    """Bytes the island moved to and from the coordinator, every process of it (the summary's)."""

    @property
    def bytes_up(self) -> int: ...

    @property
    def bytes_down(self) -> int: ...


class CoordinatorLink(Traffic, Protocol):
    """What the island holds of its coordinator, whichever kind it is."""

    @property
    def puller(self) -> Puller:
        """θ down: the exchanges' pulls and the training loop's (through a Downlink)."""

    @property
    def uplink(self) -> Uplink:
        """Δ up: the push frames and the client that sends them."""

    def joined(self, reply: pb.JoinResponse) -> None:
        """At each Join (the training loop's, or a rejoin on the heartbeat thread)."""

    def close(self) -> None:
        """Closes what the link opened (not the island's own client: :mod:`workers.app` closes that)."""


class OneCoordinator:
    """One coordinator: the island's client pulls and pushes everything."""

    def __init__(self, client: CoordinatorClient, puller: Puller, uplink: Uplink):
        self.client, self.puller, self.uplink = client, puller, uplink

    def joined(self, reply: pb.JoinResponse) -> None:
        """Nothing to connect: the coordinator the island joined serves all of θ."""

    @property
    def bytes_up(self) -> int:
        return self.client.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.client.bytes_down

    def close(self) -> None:
        """Nothing of its own to close."""


class ShardedCoordinator:
    """A sharded coordinator: the lead (the island's client) and range shards 1..S-1, whose clients are made at
    each Join from the addresses the lead names (:class:`~workers.shard_links.ShardLinks`)."""

    def __init__(self, links: ShardLinks, puller: ShardedPuller, uplink: ShardedUplink):
        self.links, self.puller, self.uplink = links, puller, uplink

    def joined(self, reply: pb.JoinResponse) -> None:
        """The range shards' clients, from the addresses in the Join's reply."""
        self.links.connect(reply.shard_addresses)

    @property
    def bytes_up(self) -> int:
        return self.links.lead.bytes_up + self.links.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.links.lead.bytes_down + self.links.bytes_down

    def close(self) -> None:
        """Closes the range shards' clients."""
        self.links.close()
