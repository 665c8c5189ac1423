"""A sharded coordinator (``coordinator.shards = S > 1``): θ cut into S contiguous ranges of whole tensors
(``dtrain.train.fragments.plan``), each merged by its own process.

Shard 0, the *lead*, is the coordinator of ``coordinator/service.py`` with its merger over range 0: it alone
holds membership, leases, cursors, admission, the rounds and the audit's events. Shards 1..S-1 are *range
shards* (:class:`RangeShard`): each holds its range's θ, momentum and residual files (its own
:class:`coordinator.merger.Merger`, over the range's values only), receives the islands' parts of their pushes
for its range (PushDelta: the same header, frame and codec checks, the island token) and serves its range's
update frames (PullGlobal), served on the lead's event-loop data plane (``coordinator/shard_plane.py``: no waiting
call holds a thread). It decides nothing: a part it holds is *held* until the lead claims it, merges it or releases
it. The lead reaches it through the Shard service (``coordinator.theta_store.ShardPeers``), every call carrying the
shard secret (``coordinator.shard_secret_file``):

- **Claim**: when the lead has received an island's part 0 of a push, it asks every range shard for its part
  (waiting for one still streaming in): the part's sum of squares (the whole push's L2 norm is the square root
  of the sum over the shards, which the lead screens) and the identity its push carried. A part missing
  anywhere refuses the push: nothing changes anywhere.
- **Prepare / Commit / Abort**: a round closes at the lead. It sends Prepare(version, the pushes with their
  weights, clip factors and whole norms) to every range shard and prepares its own range
  (:meth:`Merger.prepare`): every shard writes its step into temp files and says whether it is finite. Only
  when every one is does the lead send Commit and commit its own, last; otherwise it sends Abort everywhere
  (nothing committed) and the blamed push is dropped, as without shards.
- **Release**: parts of pushes the lead did not take (dropped, rejected, refused) are let go.

Pure plumbing over the merger: no JAX.
"""

from __future__ import annotations

import hmac
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from coordinator.memory import FrameStreams, pull_piece
from coordinator.merge_types import MergeOptions, NonFiniteResult, Prepared, Update
from coordinator.merger import Merger
from coordinator.pull_cache import PullCache
from coordinator.push import PushIntake
from coordinator.records import PushInfo
from coordinator.refusals import CallRefused
from coordinator.spool import Spool
from coordinator.streams import Pulls, PushStreams, Stream
from dtrain import codec
from dtrain.codec import params_digest
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import CheckpointError, DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import PLACEHOLDER, chunk_count
from dtrain.telemetry import Telemetry
from dtrain.train.fragments import Range, plan_spec, range_digests

if TYPE_CHECKING:
    from dtrain.checkpoint import Checkpointer

log = logging.getLogger(__name__)

SECRET_METADATA_KEY = "dtrain-shard-secret"  # the shard secret, on every call of the lead to a range shard
SHARD_SERVICE = pb.DESCRIPTOR.services_by_name["Shard"].full_name
SHARD_METHODS = frozenset(f"/{SHARD_SERVICE}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["Shard"].methods)
MAX_CLAIM_WAIT_S = 60.0
CALL_DEADLINE_S = 30.0  # Claim (plus its wait), Commit, Abort, Release
PREPARE_DEADLINE_S = 600.0  # an outer step of the range: seconds for hundreds of millions of values


def read_secret(cfg: Config) -> str:
    """The shard secret from ``coordinator.shard_secret_file``; ConfigError naming the file if it is missing,
    unreadable or shorter than 16 characters."""
    try:
        secret = Path(path := cfg.coordinator.shard_secret_file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"[coordinator] shard_secret_file: cannot read {path}: {e.strerror or e}") from None
    if secret.startswith(PLACEHOLDER):
        raise ConfigError(f"[coordinator] shard_secret_file: {path} holds the placeholder of "
                          f"deploy/coordinator-sharded/secret-shard.yaml; make a secret: kubectl create secret generic "
                          f"dtrain-shard-secret --from-literal=secret=\"$(openssl rand -hex 32)\" --dry-run=client -o "
                          f"yaml > deploy/coordinator-sharded/secret-shard.yaml")
    if len(secret) < 16:
        raise ConfigError(f"[coordinator] shard_secret_file: {path} holds {len(secret)} characters, at least 16 "
                          f"(e.g. `openssl rand -hex 32 > {path}`)")
    return secret


def shard_ranges(spec: codec.Spec, shards: int) -> tuple[Range, ...]:
    """The S ranges of the tree (the fragments' plan): range k is shard k's. ConfigError: fewer tensors than S."""
    return plan_spec(spec, shards, "[coordinator] shards")


def split_theta(theta: np.ndarray | Path, ranges: Sequence[Range]) -> tuple[np.ndarray, list[str], list[float]]:
    """θ_0 (an array, or a raw float32 file, read through a memory map) cut for the lead: range 0's values, and
    every range's digest and sum of squares (the whole θ's digest and norm, before the shards have stepped)."""
    vec = np.memmap(theta, "<f4", mode="r") if isinstance(theta, (str, Path)) else np.asarray(theta, np.float32)
    if vec.size != ranges[-1].end:
        raise ValueError(f"θ_0 holds {vec.size} values, the model {ranges[-1].end}")
    digests = range_digests(vec, ranges)
    sq = [codec.sum_squares(vec[r.start:r.end]) for r in ranges]
    return np.array(vec[ranges[0].start:ranges[0].end], np.float32), digests, sq


@dataclass
class HeldPart:
    """A push's part for this shard's range, received and validated, waiting for the lead."""

    spool: Spool
    island_id: str
    identity: str
    bytes: int
    at: float  # time.monotonic() of its arrival
    claimed: bool = False  # the lead has claimed it: it stays until merged or released


class ShardRefused(DtrainError):
    """A range shard refused, or could not be reached for, a call of the lead; ``code``: the gRPC code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class RangeShard:
    """Shard ``index`` (>= 1) of a sharded coordinator: the Shard service's calls for the lead, and what PushDelta
    and PullGlobal for its range decide (served on an event loop by ``coordinator/shard_plane.py``). Its state: the
    merger over its range, the parts it holds, the step it has prepared; all under :attr:`lock`."""

    def __init__(self, cfg: Config, index: int, run_dir: str | Path, theta: np.ndarray | Path, spec: codec.Spec,
                 secret: str, identity: Any = None):
        """``theta``: θ_0's values of this shard's range (an array or a raw float32 file); ``identity``: the
        lead's :class:`coordinator.edge.CallerIdentity` (the island identity a push carries), or None."""
        self.cfg, self.index, self.run_dir = cfg, index, Path(run_dir)
        self.ranges = shard_ranges(spec, cfg.coordinator.shards)
        if not 1 <= index < len(self.ranges):
            raise ConfigError(f"--shard {index}: must be in 1..{len(self.ranges) - 1} (shard 0 is the lead)")
        self.range = self.ranges[index]
        self.tree_digest = codec.spec_digest(spec)
        self.secret = secret
        self.identity = identity
        self.lock = threading.Condition(threading.RLock())
        # θ_0's range, kept as a file: a Restore to version 0 (a new run of the lead) starts from it again
        self.theta0 = self.run_dir / f"shard-{index}" / "theta0.f32"
        self.theta0.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.theta0.with_suffix(".tmp")
        if isinstance(theta, (str, Path)):
            shutil.copyfile(theta, tmp)
        else:
            np.ascontiguousarray(theta, "<f4").tofile(tmp)
        tmp.replace(self.theta0)
        self.merger = self._open(self.theta0, 0)
        self.streams = FrameStreams()
        self.intake = PushIntake(cfg, self.merger, Telemetry.disabled(), self.streams)
        # the lead's bounds on open push streams, here too: per peer host, per island, and the idle reaper
        self.push_streams = PushStreams(cfg, self._stream_cancelled)
        self.push_streams.start()
        self.pulls = Pulls(cfg)  # long polls included, per peer host and per island, as at the lead
        self.pull_piece = pull_piece(cfg)
        self.pull_cache = PullCache(cfg.coordinator.pull_cache_bytes)
        self.held: dict[str, HeldPart] = {}
        self.max_held = 4 * cfg.outer.islands + 8  # parts of pushes in flight: a few per island
        self.prepared: Prepared | None = None
        self.prepared_keys: list[str] = []
        # Until the lead has told it its version (Restore, at every start of the lead), the shard serves no
        # island: a restarted shard at θ_0 would otherwise answer for a version it does not hold yet.
        self.restored = False
        self.closing = False
        self.listeners: list[Callable[[], None]] = []  # told of every change (_changed), under the lock
        self.ckpt: Checkpointer | None = None
        if cfg.coordinator.checkpoint:
            from dtrain.checkpoint import Checkpointer

            # 3 kept: the lead checkpoints a version after every shard has, and may fall back one more (a
            # checkpoint of its that does not restore)
            self.ckpt = Checkpointer(self.run_dir / f"coordinator-shard-{index}", keep=3, async_save=False)

    def _open(self, theta: Path, version: int, momentum: Path | None = None,
              residual: Path | None = None) -> Merger:
        merger = Merger(theta, MergeOptions.from_config(self.cfg), version=version, momentum=momentum,
                        residual=residual, spool_dir=self.run_dir / f"shard-{self.index}" / "spool")
        if merger.n != self.range.size:
            merger.close()
            raise ValueError(f"shard {self.index}: θ holds {merger.n} values, its range {self.range.size}")
        return merger

    # -- the lead's calls ---------------------------------------------------------------------------

    def lead_problem(self, metadata: Any) -> str:
        """'' when a call's ``metadata`` carries the shard secret, else why it is refused (UNAUTHENTICATED)."""
        got = ""
        for key, value in metadata or ():
            if key == SECRET_METADATA_KEY and isinstance(value, str):
                got = value
        if got and hmac.compare_digest(got.encode(), self.secret.encode()):
            return ""
        return (f"shard {self.index}: the Shard service answers the lead only (missing or wrong shard secret: "
                f"coordinator.shard_secret_file)")

    def _lead_only(self, context: grpc.ServicerContext) -> None:
        why = self.lead_problem(context.invocation_metadata())
        if why:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    def claim(self, request: pb.ClaimRequest) -> pb.ClaimResponse:
        """The lead's Claim once its wait is over (``coordinator.shard_plane.ShardService.Claim`` awaits the part):
        the part, marked claimed, or held=False when it is not here or was pushed as another island."""
        with self.lock:
            part = self.held.get(request.push_id)
            if part is None or part.island_id != request.island_id:
                return pb.ClaimResponse(held=False, version=self.merger.version)
            part.claimed = True
            return pb.ClaimResponse(held=True, sum_squares=part.spool.norm ** 2, identity=part.identity,
                                    bytes=part.bytes, version=self.merger.version)

    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.PrepareResponse:
        self._lead_only(context)
        with self.lock:
            if request.version != self.merger.version + 1:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.index} holds version "
                              f"{self.merger.version}: cannot prepare version {request.version}")
            if self.prepared is not None:
                self._abort_prepared()
            missing = [m.push_id for m in request.merges if m.push_id not in self.held]
            if missing or not request.merges:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shard {self.index}: no part held for push {', '.join(missing[:4])}" if missing else
                              f"shard {self.index}: a version merges one push at least")
            bad = [m.push_id for m in request.merges if not (m.weight > 0 and 0 < m.scale <= 1
                                                             and math.isfinite(m.norm) and m.norm >= 0)]
            if bad:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"push {bad[0]}: weight must be > 0, scale in "
                                                                f"(0, 1], norm finite and >= 0")
            for m in request.merges:
                self.merger.add_pending(self.held[m.push_id].spool, m.weight, scale=m.scale, key=m.push_id,
                                        norm=m.norm)
            try:
                self.prepared = self.merger.prepare()
            except NonFiniteResult as e:
                self.merger.unpend()
                return pb.PrepareResponse(finite=False, blame=e.blame, reason=str(e))
            except BaseException:
                self.merger.unpend()
                raise
            self.prepared_keys = [m.push_id for m in request.merges]
            p = self.prepared
            return pb.PrepareResponse(finite=True, params_digest=p.digest, theta_sum_squares=p.theta_norm ** 2,
                                      update_bytes=p.update.size)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        self._lead_only(context)
        with self.lock:
            if self.prepared is None or self.prepared.version != request.version:
                if request.version == self.merger.version:  # a retried Commit: already done
                    return pb.CommitResponse(version=self.merger.version, params_digest=self.merger.digest)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.index}: version {request.version} "
                                                                   f"is not prepared")
            self.merger.commit(self.prepared)  # releases the merged parts' spools
            for key in self.prepared_keys:
                self.held.pop(key, None)
            self.prepared, self.prepared_keys = None, []
            version = self.merger.version
            if self.ckpt is not None:
                self.ckpt.save_files(version, self.merger.state_files(),
                                     {"version": version, "params_digest": self.merger.digest, "shard": self.index,
                                      "range": [self.range.start, self.range.end]})
            self._changed()  # long-polling pulls
            return pb.CommitResponse(version=version, params_digest=self.merger.digest)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self._lead_only(context)
        with self.lock:
            if self.prepared is not None and self.prepared.version == request.version:
                self._abort_prepared()
        return pb.AbortResponse()

    def _stream_cancelled(self, stream: Stream, why: str) -> None:
        log.warning("shard %d: %s", self.index, why)

    def _abort_prepared(self) -> None:
        assert self.prepared is not None
        self.merger.abort(self.prepared)
        self.merger.unpend()  # the parts stay held
        self.prepared, self.prepared_keys = None, []

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        self._lead_only(context)
        with self.lock:
            try:
                theta, momentum, residual, digest = self._restorable(request.version)
            except (CheckpointError, OSError) as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.index}: cannot restore version "
                                                                   f"{request.version}: {e}")
            if digest != request.params_digest:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shard {self.index}: its version {request.version} has digest {digest}, the lead "
                              f"recorded {request.params_digest}: not the same run")
            # The parts it holds stay (a part is a push's values, whatever the version: the lead judges it), but
            # unclaimed: a resumed lead claims again those whose pushes the islands send again (the shard answers
            # their parts DUPLICATE), and the rest expire. Their spools live in the merger's folder, which the new
            # merger clears of stale files: they are kept open (an unlinked file stays readable).
            if self.prepared is not None:
                self._abort_prepared()
            for part in self.held.values():
                part.claimed, part.at = False, time.monotonic()
            self.merger.close()  # its folder is the new one's (which clears it)
            self.merger = self._open(theta, request.version, momentum, residual)
            if self.merger.digest != digest:  # a state file that does not hold what its checkpoint recorded
                context.abort(grpc.StatusCode.DATA_LOSS, f"shard {self.index}: version {request.version}'s θ "
                                                         f"reads as digest {self.merger.digest}, recorded {digest}")
            self.intake = PushIntake(self.cfg, self.merger, Telemetry.disabled(), self.streams)
            self.restored = True
            self._changed()
            log.info("coordinator shard %d restored to version %d", self.index, self.merger.version)
            return pb.RestoreResponse(version=self.merger.version, params_digest=self.merger.digest,
                                      theta_sum_squares=self.merger.theta_norm ** 2)

    def _restorable(self, version: int) -> tuple[Path, Path | None, Path | None, str]:
        """The files of ``version`` (its checkpoint's; 0: θ_0) and its range's recorded digest, checked before
        anything is touched. CheckpointError says what is missing. Under the lock."""
        if version == 0:
            return self.theta0, None, None, params_digest(np.fromfile(self.theta0, "<f4"))
        if self.ckpt is None:
            raise CheckpointError("coordinator.checkpoint is off")
        if version not in self.ckpt.steps():
            raise CheckpointError(f"no checkpoint of that version in {self.ckpt.directory} (it has "
                                  f"{sorted(self.ckpt.steps()) or 'none'})")
        step, files, meta = self.ckpt.restore_files(version)
        if meta.get("shard") != self.index or meta.get("range") != [self.range.start, self.range.end]:
            raise CheckpointError(f"checkpoint {step} is shard {meta.get('shard')}'s, values {meta.get('range')}")
        if "theta" not in files or "momentum" not in files:
            raise CheckpointError(f"checkpoint {step} lacks θ or the momentum")
        return files["theta"], files["momentum"], files.get("residual"), str(meta.get("params_digest"))

    def _drop_all(self) -> None:
        """Lets go of every held part and any prepared step. Under the lock."""
        if self.prepared is not None:
            self._abort_prepared()
        for part in self.held.values():
            part.spool.close()
        self.held.clear()

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self._lead_only(context)
        with self.lock:
            for key in request.push_ids:
                if key in self.prepared_keys:
                    continue
                part = self.held.pop(key, None)
                if part is not None:
                    part.spool.close()
        return pb.ReleaseResponse()

    # -- the islands' calls: served by coordinator/shard_plane.py (ShardService, on the data plane) ----------

    def _changed(self) -> None:
        """Under the lock: tells the listeners (the data plane's bell: waiting claims and long-polling pulls) that
        what the shard holds changed (a part held, a version committed or restored, the shard closing)."""
        for listener in list(self.listeners):
            listener()

    def admit_part(self, h: pb.PushHeader) -> pb.PushDeltaResponse | None:
        """A part's header against what the shard holds: the reply for a part it holds already, or None to receive
        it. CallRefused: UNAVAILABLE before the lead restored the shard, RESOURCE_EXHAUSTED (busy) while it holds
        its most parts waiting for the lead."""
        with self.lock:
            self._refuse_until_restored()
            if h.push_id in self.held:
                return pb.PushDeltaResponse(status=pb.PUSH_STATUS_DUPLICATE, version=self.merger.version,
                                            reason=f"shard {self.index} holds this part already")
            if len(self.held) >= self.max_held:
                self._expire()
            if len(self.held) >= self.max_held:
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"shard {self.index} holds {len(self.held)} parts waiting for the lead", busy=True)
        return None

    def hold(self, spool: Spool, info: PushInfo, identity: str | None, size: int) -> pb.PushDeltaResponse:
        """A part received whole and validated: held for the lead (the first of the same push received twice at
        once is kept); the reply."""
        spool.keep()
        with self.lock:
            if info.push_id in self.held:
                spool.close()
            else:
                self.held[info.push_id] = HeldPart(spool, info.island_id, identity or "", size, time.monotonic())
            self._changed()  # a claim waiting for it
            version = self.merger.version
        return pb.PushDeltaResponse(status=pb.PUSH_STATUS_PENDING, version=version,
                                    reason=f"held by shard {self.index} for the lead's decision")

    def _refuse_until_restored(self) -> None:
        """CallRefused UNAVAILABLE (islands retry it) until the lead has restored the shard to its version. Under
        the lock."""
        if not self.restored:
            raise CallRefused(grpc.StatusCode.UNAVAILABLE, f"coordinator shard {self.index} is waiting for the lead "
                                                           f"to give it its version (the lead restores every shard as "
                                                           f"it starts)")

    def _expire(self) -> None:
        """Lets go of parts the lead never claimed for longer than a push could take to reach it (the island's
        push to the lead broke off, or the island died): its stream idle limit plus the claim's wait, twice.
        Under the lock."""
        limit = 2 * (self.cfg.coordinator.stream_idle_s + MAX_CLAIM_WAIT_S)
        now = time.monotonic()
        for key in [k for k, p in self.held.items() if not p.claimed and now - p.at > limit]:
            self.held.pop(key).spool.close()

    def check_pull(self, request: pb.PullRequest) -> None:
        """Whether a pull may be served: CallRefused UNAVAILABLE before the lead restored the shard,
        FAILED_PRECONDITION for a version it does not hold yet."""
        with self.lock:
            self._refuse_until_restored()
            if request.have_version > self.merger.version:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"have_version={request.have_version}: shard {self.index} is at version "
                                  f"{self.merger.version}")

    def pull_messages(self, request: pb.PullRequest) -> Iterator[pb.PullMessage | bytes]:
        """What a pull streams from now: its range's frames from ``have_version`` (decided under the lock; each one
        opened there, so a later merge's deletion leaves it readable), as messages read piece by piece."""
        with self.lock:
            self._refuse_until_restored()
            version = self.merger.version
            full, chain = self.merger.pull_frames(request.have_version, request.full)
            kind = pb.PULL_KIND_FULL if full else pb.PULL_KIND_UPDATE
            frames: list[tuple[pb.PullKind, Update, Any]] = [(kind, u, u.open()) for u in chain]
        if not frames:
            return iter([pb.PullMessage(header=pb.PullHeader(kind=pb.PULL_KIND_CURRENT, version=version,
                                                             base_version=version, tree_digest=self.tree_digest))])
        return self._frames(frames)

    def _frames(self, frames: list[tuple[pb.PullKind, Update, Any]]) -> Iterator[pb.PullMessage | bytes]:
        piece = self.pull_piece
        with self.streams.streaming():
            for frame_kind, u, handle in frames:
                yield pb.PullMessage(header=pb.PullHeader(
                    kind=frame_kind, version=u.version, base_version=u.base_version, tree_digest=self.tree_digest,
                    total_bytes=u.size, frame_crc32=u.crc32, chunks=chunk_count(u.size, piece),
                    params_digest=u.params_digest))
                yield from self.pull_cache.messages(u, handle, piece)  # one build per frame, as at the lead

    def status(self) -> pb.StatusResponse:
        """Its version, its range's digest and which shard it is."""
        with self.lock:
            return pb.StatusResponse(version=self.merger.version, params_digest=self.merger.digest,
                                     mode=f"shard {self.index} of {len(self.ranges)}")

    def close(self) -> None:
        """Lets go of everything it holds (its parts, a prepared step, the merger, the checkpointer)."""
        self.push_streams.stop()
        with self.lock:
            self.closing = True
            self._changed()  # waiting claims and pulls end
            self.listeners.clear()
            self._drop_all()
            self.merger.close()
        if self.ckpt is not None:
            self.ckpt.close()
