"""Where the coordinator's θ lives: on this process alone, or in ranges over a sharded coordinator's shards.

The composition root (``coordinator/app.py``) decides which once, at start-up, and builds one of the two stores;
everything else (the servicer, the clock's merges, the checkpoint) talks to it through the same few calls and has
no branch on it:

- :class:`LocalTheta`: the merger's θ is the whole model.
- :class:`ShardedTheta`: the lead's merger holds range 0, range shards (``coordinator/shard.py``) the others;
  a push's parts on the other shards are claimed (:meth:`ShardedTheta.whole_norm`), an outer step is prepared on
  every shard and committed on all of them or none (:meth:`ShardedTheta.prepare`, :meth:`ShardedTheta.commit`),
  parts no longer needed are released. :class:`ShardPeers` is the lead's side of the Shard service.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from coordinator.merge_types import NonFiniteResult, Prepared, SpooledPush, Update
from coordinator.merger import Merger
from coordinator.records import PushInfo
from coordinator.shard import (
    CALL_DEADLINE_S,
    MAX_CLAIM_WAIT_S,
    PREPARE_DEADLINE_S,
    SECRET_METADATA_KEY,
    ShardRefused,
    read_secret,
    shard_ranges,
    split_theta,
)
from coordinator.spool import Spool
from dtrain import codec
from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata, channel_credentials, channel_options, keepalive_options, read_token
from dtrain.train.fragments import joined_digest

log = logging.getLogger(__name__)

SHARD_START_WAIT_S = 120.0  # a sharded lead's start: how long it waits for its range shards to be reachable


class PartsRefused(DtrainError):
    """A push's parts on the other shards could not be claimed; ``code``: the gRPC code to refuse the push with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class ThetaStore(Protocol):
    """What the servicer and the clock need of θ's store (:class:`LocalTheta` or :class:`ShardedTheta`)."""

    merger: Merger
    shard_addresses: Sequence[str]  # what a Join reply names (none for a local θ)

    @property
    def digest(self) -> str: ...

    @property
    def theta_norm(self) -> float: ...

    def whole_norm(self, info: PushInfo, spool: Spool, identity: str | None, wait_s: float) -> float: ...

    def spooled(self, spool: Spool, weight: float, scale: float, key: str, norm: float) -> SpooledPush: ...

    def release(self, push_ids: list[str]) -> None: ...

    def prepare(self) -> Any: ...

    def commit(self, prepared: Any) -> Update: ...

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class LocalTheta:
    """θ on this coordinator alone: the merger's whole model."""

    shard_addresses: Sequence[str] = ()

    def __init__(self, merger: Merger):
        self.merger = merger

    @property
    def digest(self) -> str:
        return self.merger.digest

    @property
    def theta_norm(self) -> float:
        return self.merger.theta_norm

    def whole_norm(self, info: PushInfo, spool: Spool, identity: str | None, wait_s: float) -> float:
        """The push's L2 norm: its spool's (the whole push is here)."""
        return spool.norm

    def spooled(self, spool: Spool, weight: float, scale: float, key: str, norm: float) -> SpooledPush:
        """The push as the merger sums it (:meth:`Merger.spooled`)."""
        return self.merger.spooled(spool, weight, scale=scale, key=key)

    def release(self, push_ids: list[str]) -> None:
        """Nothing is held elsewhere."""

    def prepare(self) -> Prepared:
        return self.merger.prepare()

    def commit(self, prepared: Prepared) -> Update:
        return self.merger.commit(prepared)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """The merger is closed by its owner."""


class ShardPeers:
    """The lead's side of the Shard service: one channel per range shard, calls made to all in parallel."""

    def __init__(self, cfg: Config, addresses: Sequence[str], secret: str):
        self.addresses = list(addresses)
        sec = cfg.security
        creds = channel_credentials(sec)
        opts = channel_options(cfg.coordinator.max_message_bytes, sec.server_name) + keepalive_options(server=False)
        self.channels = [grpc.secure_channel(a, creds, opts) if creds else grpc.insecure_channel(a, opts)
                         for a in self.addresses]
        self.stubs = [pb_grpc.ShardStub(c) for c in self.channels]
        self.metadata = auth_metadata(read_token(sec)) + ((SECRET_METADATA_KEY, secret),)

    def _all(self, method: str, request: Any, timeout: float) -> list[Any]:
        """``method`` on every range shard at once; the replies in shard order. ShardRefused naming the first
        shard that refused or could not be reached."""
        # gRPC's own futures: every caller's calls in flight at once (a shared pool would queue one push's Claim,
        # which may wait for its part, behind another's)
        calls = [getattr(stub, method).future(request, timeout=timeout, metadata=self.metadata) for stub in self.stubs]
        out, first = [], None
        for k, call in enumerate(calls, start=1):
            try:
                out.append(call.result())
            except grpc.RpcError as e:
                if first is None:
                    first = ShardRefused(e.code(), f"{method} on coordinator shard {k} ({self.addresses[k - 1]}): "
                                                   f"{e.code().name}: {e.details()}")
        if first is not None:
            raise first
        return out

    def claim(self, info: PushInfo, wait_s: float) -> list[pb.ClaimResponse]:
        return self._all("Claim", pb.ClaimRequest(push_id=info.push_id, island_id=info.island_id,
                                                  wait_s=min(wait_s, MAX_CLAIM_WAIT_S)),
                         CALL_DEADLINE_S + wait_s)

    def prepare(self, version: int, merges: list[pb.MergeEntry]) -> list[pb.PrepareResponse]:
        return self._all("Prepare", pb.PrepareRequest(version=version, merges=merges), PREPARE_DEADLINE_S)

    def commit(self, version: int) -> list[pb.CommitResponse]:
        return self._all("Commit", pb.CommitRequest(version=version), CALL_DEADLINE_S)

    def abort(self, version: int) -> None:
        self._all("Abort", pb.AbortRequest(version=version), CALL_DEADLINE_S)

    def restore(self, version: int, digests: Sequence[str], wait_s: float) -> list[pb.RestoreResponse]:
        """Every range shard at ``version`` (``digests``: their ranges' digests, shard 1 first), retried while a
        shard cannot be reached (it may be starting) for up to ``wait_s``; ShardRefused otherwise."""
        t0 = time.monotonic()
        while True:
            try:
                calls = [stub.Restore.future(pb.RestoreRequest(version=version, params_digest=d),
                                             timeout=PREPARE_DEADLINE_S, metadata=self.metadata)
                         for stub, d in zip(self.stubs, digests, strict=True)]
                out = []
                for k, call in enumerate(calls, start=1):
                    try:
                        out.append(call.result())
                    except grpc.RpcError as e:
                        raise ShardRefused(e.code(), f"Restore on coordinator shard {k} ({self.addresses[k - 1]}): "
                                                     f"{e.code().name}: {e.details()}") from None
                return out
            except ShardRefused as e:
                left = wait_s - (time.monotonic() - t0)
                if e.code != grpc.StatusCode.UNAVAILABLE or left <= 0:
                    raise
                log.info("waiting for the coordinator shards to take version %d (%.0fs left): %s", version, left, e)
                time.sleep(min(1.0, left))

    def release(self, push_ids: list[str]) -> None:
        """Best effort: a shard that cannot be reached keeps the parts until it restarts."""
        if not push_ids:
            return
        try:
            self._all("Release", pb.ReleaseRequest(push_ids=push_ids), CALL_DEADLINE_S)
        except ShardRefused as e:
            log.warning("release of %d parts: %s", len(push_ids), e)

    def close(self) -> None:
        for c in self.channels:
            c.close()


@dataclass
class ShardedPrepared:
    """:meth:`ShardedStep.prepare`'s outcome: the lead's prepared range, every range shard's commit and prepare."""

    prepared: Prepared
    committed: list[pb.CommitResponse]
    replies: list[pb.PrepareResponse]


class ShardedTheta:
    """θ over a sharded coordinator, as its lead sees it: its own range in ``merger``, the others on the range
    shards (``peers``). The outer step has two phases: Prepare on the range shards and its own range, then Commit
    everywhere (the lead's last) when every shard's step is finite, else Abort everywhere and the blamed push's
    NonFiniteResult. Keeps each range's digest and θ's sum of squares for the whole θ's digest and norm."""

    def __init__(self, merger: Merger, peers: ShardPeers, digests: list[str], theta_sq: list[float]):
        self.merger, self.peers = merger, peers
        self.digests, self.theta_sq = digests, theta_sq  # per shard, 0 (the lead) first
        self.shard_addresses: Sequence[str] = tuple(peers.addresses)

    def whole_norm(self, info: PushInfo, spool: Spool, identity: str | None, wait_s: float) -> float:
        """The push's parts on the other shards, claimed (waiting for those still streaming in, up to ``wait_s``);
        returns the whole push's L2 norm. PartsRefused (every part let go: nothing changes anywhere) when a part is
        missing, was pushed under another identity, or a shard cannot be reached."""
        peers = self.peers
        try:
            parts = peers.claim(info, wait_s)
        except ShardRefused as e:
            peers.release([info.push_id])
            raise PartsRefused(grpc.StatusCode.UNAVAILABLE, f"push {info.push_id}: {e}") from None
        for k, part in enumerate(parts, start=1):
            if not part.held:
                peers.release([info.push_id])
                raise PartsRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"push {info.push_id}: its part for coordinator shard {k} "
                                   f"({peers.addresses[k - 1]}) was not received within {wait_s:g}s: nothing of the "
                                   f"push is merged")
            if part.identity != (identity or ""):
                peers.release([info.push_id])
                raise PartsRefused(grpc.StatusCode.PERMISSION_DENIED,
                                   f"push {info.push_id}: its part for coordinator shard {k} came from identity "
                                   f"{part.identity or '(none)'}, this part from {identity or '(none)'}")
        return math.sqrt(spool.norm ** 2 + sum(p.sum_squares for p in parts))

    def spooled(self, spool: Spool, weight: float, scale: float, key: str, norm: float) -> SpooledPush:
        """The lead's part as the merger sums it, with the whole push's norm (the clip caps and the blame go by
        whole pushes, the same on every shard)."""
        return self.merger.spooled(spool, weight, scale=scale, key=key, norm=norm)

    def release(self, push_ids: list[str]) -> None:
        """The pushes' parts on the other shards are let go (best effort)."""
        self.peers.release(push_ids)

    def checkpoint_meta(self) -> dict[str, Any]:
        """A sharded lead's checkpoint also names every shard's digest and θ's sums of squares at its version."""
        return {"shard_digests": list(self.digests), "theta_sum_squares": list(self.theta_sq)}

    def close(self) -> None:
        self.peers.close()

    @property
    def digest(self) -> str:
        return joined_digest(self.digests)

    @property
    def theta_norm(self) -> float:
        return math.sqrt(sum(self.theta_sq))

    def prepare(self) -> ShardedPrepared:
        """Outside the lead's lock: Prepare on every range shard and the lead's own range, then Commit on the range
        shards when every step is finite (else Abort everywhere and the blamed push's NonFiniteResult). The lead's
        own range is committed by :meth:`commit`, under the lock."""
        m = self.merger
        new = m.version + 1
        merges = [pb.MergeEntry(push_id=p.key, weight=p.weight, scale=p.scale, norm=p.norm) for p in m.pending]
        try:
            replies = self.peers.prepare(new, merges)
        except BaseException:
            self._abort(new)
            raise
        failed = [r for r in replies if not r.finite]
        if failed:
            self._abort(new)
            raise NonFiniteResult("a range shard's step", failed[0].blame, failed[0].reason)
        try:
            prepared = m.prepare()
        except BaseException:
            self._abort(new)
            raise
        try:
            committed = self.peers.commit(new)
        except BaseException:
            # Some shard may have committed: the coordinator failed (resume from the checkpoints, every shard at
            # the lead's version). The lead's own range stays at the old version.
            m.abort(prepared)
            raise
        return ShardedPrepared(prepared, list(committed), list(replies))

    def commit(self, done: ShardedPrepared) -> Update:
        """Under the lead's lock: the lead's own range made current; every range's digest and sum of squares kept."""
        update = self.merger.commit(done.prepared)
        self.digests = [self.merger.digest] + [c.params_digest for c in done.committed]
        self.theta_sq = [self.merger.theta_norm ** 2] + [r.theta_sum_squares for r in done.replies]
        return update

    def _abort(self, version: int) -> None:
        try:
            self.peers.abort(version)
        except ShardRefused as e:
            log.warning("abort of version %d: %s", version, e)


def open_theta_store(cfg: Config, merger: Merger, shard_digests: list[str]) -> ThetaStore:
    """The store for this coordinator: :class:`LocalTheta` unless ``coordinator.shards`` > 1, else the lead's
    :class:`ShardedTheta`, once every range shard holds the merger's version (``shard_digests``: every range's
    digest at it, the lead's first; ShardRefused when a shard cannot be brought there within
    SHARD_START_WAIT_S)."""
    if cfg.coordinator.shards <= 1:
        return LocalTheta(merger)
    peers = ShardPeers(cfg, cfg.coordinator.shard_addresses, read_secret(cfg))
    try:
        replies = peers.restore(merger.version, shard_digests[1:], SHARD_START_WAIT_S)
    except BaseException:
        peers.close()
        raise
    theta_sq = [merger.theta_norm ** 2] + [r.theta_sum_squares for r in replies]
    return ShardedTheta(merger, peers, list(shard_digests), theta_sq)


def lead_theta0(cfg: Config, theta: Any, spec: codec.Spec) -> tuple[Any, list[str]]:
    """A new run's θ_0 for the merger (a sharded lead's: range 0's values) and every range's digest (none for a
    local θ)."""
    if cfg.coordinator.shards <= 1:
        return theta, []
    values, digests, _ = split_theta(theta, shard_ranges(spec, cfg.coordinator.shards))
    return values, digests
