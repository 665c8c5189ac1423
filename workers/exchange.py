"""The island's push/pull exchange with the coordinator: what goes up, what comes down, and how it is checked.

It owns the wire side of a round: :class:`Puller` brings the island's global θ up to the coordinator's latest
version and verifies every frame's digest; :class:`Exchange` runs one round's push and the pulls that follow it on
a thread of its own (returning θ' through a Future); :class:`Pending` is a pushed round not yet folded in;
:class:`Uplink` builds the push frames (Δ compressed with error feedback, or an injected fault's); and
:class:`Downlink` hands process 0's θ to every process of the island. The training loop
(:class:`workers.island.Worker`) decides when any of it happens.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
from opentelemetry.trace import INVALID_SPAN, Span

from dtrain import codec
from dtrain.codec import params_digest
from dtrain.config.sections import CodecConfig
from dtrain.errors import DtrainError
from dtrain.models.model import Params
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import MAX_ROUND_S
from dtrain.telemetry import Telemetry
from dtrain.train import fragments
from dtrain.train.device_codec import DEVICE_BITS, DeviceErrorFeedback
from dtrain.train.diloco import Island
from workers.client import CoordinatorClient, CoordinatorError, PulledFrame
from workers.hosts import HostGroup
from workers.push_faults import Injection, injected_push

PULL_WAIT_S = 5.0  # one long poll; repeated until the awaited version arrives
# A push refused with one of these was not applied and will not be by a retry: the island rewinds and goes on.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
# A push refused while its island is throttled (a backoff after a rejected push) is sent again once the backoff is
# over, at most this many times (a backoff only grows with rejections, which need a push the coordinator judged).
MAX_THROTTLED_WAITS = 8
# Push replies: the coordinator took the push (it goes, or went, into a version), or it did not (a rewind).
TAKEN = (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED, pb.PUSH_STATUS_DUPLICATE)
NOT_TAKEN = (pb.PUSH_STATUS_DROPPED, pb.PUSH_STATUS_REJECTED)


class WorkerError(DtrainError):
    """The island cannot go on: a θ that does not verify, a tree that differs from the coordinator's, a mesh
    without enough healthy devices, a diverging run. Raised by the pulls here, by recovery
    (:mod:`workers.recovery`) and by the training loop (:mod:`workers.island`)."""


class EventLog(Protocol):
    """Records one event (``RunLog.event``)."""

    def __call__(self, kind: str, **fields: Any) -> object: ...


class StopTold(Protocol):
    """Hands the training loop the coordinator's word to stop at the coordinator's version
    (``workers.heartbeat.Mailbox.stop_told``)."""

    def __call__(self, version: int) -> None: ...


class PullClient(Protocol):
    """The part of :class:`CoordinatorClient` a :class:`Puller` uses."""

    def pull(self, island_id: str, have_version: int, wait_s: float = 0.0, full: bool = False,
             max_frame: int | None = None) -> list[PulledFrame]: ...


class PushClient(Protocol):
    """The part of :class:`CoordinatorClient` an :class:`Exchange` uses."""

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse: ...


@dataclass
class GlobalParams:
    """A global θ as the island holds it. Built by the thread that pulled it (an exchange's or the training
    loop's) and handed over whole; after that only the training loop writes it (``arrived``, at the start
    barrier), and ``vec`` is never changed in place (the eval requests keep the very θ that arrived)."""

    vec: np.ndarray  # flat float32 θ_version, bit-identical to the coordinator's
    version: int
    arrived: float = 0.0  # time.perf_counter() when it arrived (wall-time rounds are timed from it)
    digest: str = ""  # its params digest, as verified against the coordinator's on arrival ("" if not checked here)
    round_seconds: float = 0.0  # auto rounds: the length of the round that starts from it (PullHeader.round_seconds;
    #                             0: none given)


class Puller:
    """Brings the island's global θ up to the coordinator's latest version, verifying the digest after every frame.

    A broken update chain or a digest mismatch is answered with one full pull; if that does not verify either,
    the pull fails with a :class:`WorkerError` (no endless re-pulling of a θ that cannot be reproduced).

    Pulls run on an exchange's thread and on the training loop's; both write the eval requests (under
    ``_lock``), which the training loop alone takes (:meth:`take_eval_requests`). The rest is set at
    construction and only read."""

    def __init__(self, client: PullClient, n: int, max_frame: int, log: EventLog,
                 ranges: Sequence[fragments.Range] = ()):
        """``ranges``: the fragments' plan (``outer.fragments`` > 1: an update frame holds one fragment's
        values, ``dtrain.train.fragments.apply_update``); () for none."""
        self.client, self.n, self.max_frame, self.log = client, n, max_frame, log
        self.ranges = tuple(ranges) or fragments.whole(n)
        self._to_evaluate: dict[int, GlobalParams] = {}  # version -> θ_version the coordinator asked to evaluate
        self._lock = threading.Lock()  # pulls run on the exchange's thread and on the training loop's

    def take_eval_requests(self) -> list[GlobalParams]:
        """The global θs the coordinator asked this island to evaluate (PullHeader.evaluate) since the last call,
        oldest version first: each exactly as pulled and verified, before any local progress was folded in."""
        with self._lock:
            out, self._to_evaluate = sorted(self._to_evaluate.values(), key=lambda g: g.version), {}
        return out

    def pull(self, island_id: str, have: GlobalParams | None, wait_s: float = 0.0,
             full: bool = False) -> GlobalParams:
        g, problem = self._pull_once(island_id, have, wait_s, full)
        if problem:
            g, problem = self._pull_once(island_id, None, 0.0, True)  # start over from a full θ, once
            if problem:
                raise WorkerError(f"pull: {problem}, again after a full re-pull")
        if g is None:
            raise WorkerError("the coordinator sent no parameters for a full pull")
        if g is not have:
            g.arrived = time.perf_counter()
        return g

    def _pull_once(self, island_id: str, have: GlobalParams | None, wait_s: float,
                   full: bool) -> tuple[GlobalParams | None, str]:
        frames = self.client.pull(island_id, 0 if have is None else have.version, wait_s=wait_s,
                                  full=full or have is None, max_frame=self.max_frame)
        return self._apply(have, frames)

    def _apply(self, have: GlobalParams | None, frames: list[PulledFrame]) -> tuple[GlobalParams | None, str]:
        """θ after the frames, or the first problem: a broken update chain or a digest mismatch."""
        g = have
        for f in frames:
            h = f.header
            if h.kind == pb.PULL_KIND_CURRENT:  # no frame: the island holds θ_version (sent to ask for an eval)
                if h.evaluate and g is not None and g.version == h.version:
                    with self._lock:
                        self._to_evaluate[g.version] = g
                continue
            size = fragments.update_range(h.version, self.ranges).size if h.kind == pb.PULL_KIND_UPDATE else self.n
            values = codec.dequantize(codec.decode(f.frame, expected_n=size))
            if h.kind == pb.PULL_KIND_FULL:
                g = GlobalParams(values, h.version)
            elif h.kind == pb.PULL_KIND_UPDATE:
                if g is None or h.base_version != g.version:
                    held = "no θ" if g is None else f"v{g.version}"
                    return g, f"the update to v{h.version} applies to v{h.base_version}, the island holds {held}"
                # θ_v = θ_{v-1} + dequantize(update), on the fragment v merged (the whole θ without fragments)
                g = GlobalParams(fragments.apply_update(g.vec, values, h.version, self.ranges), h.version)
            if g is None:
                return g, f"a {pb.PullKind.Name(h.kind)} frame for v{h.version} without a θ to apply it to"
            digest = params_digest(g.vec)
            if digest != h.params_digest:
                self.log("digest_mismatch", version=h.version)
                return g, (f"v{h.version} decodes to params digest {digest}, the coordinator's θ has "
                           f"{h.params_digest}")
            if not 0 <= h.round_seconds <= MAX_ROUND_S:  # NaN fails too
                return g, (f"v{h.version} came with round_seconds={h.round_seconds!r}: must be in "
                           f"[0, {MAX_ROUND_S:g}]")
            g.digest, g.round_seconds = digest, h.round_seconds
            if h.evaluate:  # verified: the exact global θ_version (g.vec is a new array, never changed in place)
                with self._lock:
                    self._to_evaluate[g.version] = g
        return g, ""


class Exchange:
    """One round's push, then pulls until a newer global θ arrives (or the run stops), on a thread of its own.

    It is given everything it uses and returns the new θ (or the error that ended it) through :attr:`future`.
    Shared by three threads; per field, who writes it (the others only read):

    - the constructor's arguments (``header``, ``frame``, ``base``, ...): the training loop, before the thread
      starts; nobody changes them afterwards;
    - :attr:`response`: the exchange's thread (each push and resend); the training loop reads it once
      :attr:`future` is done (the fold-in, :meth:`accepted_range_end`);
    - :attr:`repush`: set by the heartbeat thread when the coordinator has lost the push (a restart), cleared by
      the exchange's thread as it sends the push again;
    - :attr:`future`: resolved by the exchange's thread; the training loop waits on it.

    A push's reply that names a ``stop_reason``, or a refusal marked stopped (``CoordinatorError.stopped_at``),
    says the island is quarantined: the exchange hands that to ``stop_told`` (which sets ``stop``) and ends at
    once, as a heartbeat's STOP would end it; the island pushes nothing more."""

    def __init__(self, client: PushClient, puller: Puller, frame: bytes, header: pb.PushHeader,
                 base: GlobalParams, total_versions: int, stop: threading.Event, log: EventLog,
                 telemetry: Telemetry | None = None, span: Span | None = None, stop_told: StopTold | None = None):
        """``span``: the exchange's ``dtrain.exchange`` span (ended by the fold-in), parent of its push and pull
        spans. ``stop_told``: where the coordinator's word to stop goes (left out: ``stop`` is set)."""
        self.client, self.puller, self.frame, self.header, self.base = client, puller, frame, header, base
        self.total_versions, self.stop, self.log = total_versions, stop, log
        self.stop_told = stop_told
        self.telemetry = telemetry or Telemetry.disabled()
        self.span = span or INVALID_SPAN
        self.repush = threading.Event()
        self.response: pb.PushDeltaResponse | None = None  # the coordinator's answer to the push, once it came
        self.future: Future[GlobalParams] = Future()

    @property
    def push_id(self) -> str:
        return self.header.push_id

    def start(self) -> Future[GlobalParams]:
        # A daemon thread rather than an executor's: a pull stuck in retries never keeps a failed worker alive.
        self.future.set_running_or_notify_cancel()
        threading.Thread(target=self._run, name=f"exchange-{self.push_id}", daemon=True).start()
        return self.future

    def _run(self) -> None:
        try:
            result = self._exchange()
        except BaseException as e:  # noqa: BLE001 - raised in the training loop by future.result()
            self.future.set_exception(e)
        else:
            self.future.set_result(result)

    def _send(self) -> pb.PushDeltaResponse:
        """Pushes the frame; a refusal (a bad frame, a range outside the bounds, an unknown island: nothing of
        it was applied, and a retry would be refused too) is answered as REJECTED at its range's start.

        A push refused because the island is throttled after a rejected push (the refusal names the seconds
        left: ``CoordinatorError.retry_after_s``) is not answered: its payload was never read, so the exchange
        waits the backoff out (a ``push_throttled`` event says for how long; the island trains on meanwhile) and
        sends the same push again, under the same id. Once the coordinator judges it, it is merged like any
        (late) push, or dropped or rejected and its range trained again; nothing is trained twice for the wait.
        At most :data:`MAX_THROTTLED_WAITS` waits for one push (then the refusal stands).

        A push refused because its island is quarantined (``CoordinatorError.stopped_at``), or answered with a
        ``stop_reason`` (its own rejection quarantined the island), stops the island (:meth:`_stopped`)."""
        h = self.header
        waits = 0
        while True:
            try:
                with self.telemetry.span("dtrain.push", parent=self.span, island=h.island_id, push_id=h.push_id,
                                         base_version=h.base_version, bytes=len(self.frame)) as span:
                    response = self.client.push(h, self.frame)
                    self.telemetry.annotate(span, status=pb.PushStatus.Name(response.status),
                                            version=response.version)
                if response.stop_reason:  # this push's rejection quarantined the island
                    self._stopped(response.stop_reason, response.version)
                return response
            except CoordinatorError as e:
                if e.code not in REFUSALS:
                    raise
                if e.stopped_at is not None:  # the island is quarantined: its pushes are refused for good
                    self._stopped(e.message, e.stopped_at)
                elif e.retry_after_s > 0 and waits < MAX_THROTTLED_WAITS and not self.stop.is_set():
                    waits += 1
                    self.log("push_throttled", push_id=h.push_id, wait_s=round(e.retry_after_s, 3),
                             start=h.cursor_start, end=h.cursor_end, error=e.message)
                    if not self.stop.wait(e.retry_after_s):
                        self.repush.clear()  # heartbeats did not find the push meanwhile: this sends it
                        continue
                self.log("push_refused", push_id=h.push_id, code=e.code.name, error=e.message)
                return pb.PushDeltaResponse(status=pb.PUSH_STATUS_REJECTED, reason=str(e), cursor=h.cursor_start)

    def _stopped(self, reason: str, version: int) -> None:
        """The coordinator told the island to stop in its answer to a push (the island is quarantined): a
        ``stop_requested`` event (``by`` push), as a heartbeat's STOP has."""
        self.log("stop_requested", reason=reason, version=version, by="push")
        if self.stop_told is not None:
            self.stop_told(version)
        else:
            self.stop.set()

    def _awaited(self) -> int:
        """The version the push goes (or went) into, if the coordinator took it; 0 otherwise."""
        r = self.response
        return r.merged_version if r is not None and r.status in TAKEN else 0

    def accepted_range_end(self, shard: int, cursor: int) -> int:
        """``cursor`` moved past this push's range if the coordinator took the push and the range covers it on
        ``shard`` (a cursor named before the push arrived); else ``cursor``."""
        h = self.header
        if self._awaited() and h.shard_index == shard and h.cursor_start <= cursor < h.cursor_end:
            return h.cursor_end
        return cursor

    def _exchange(self) -> GlobalParams:
        h = self.header
        response = self.response = self._send()
        self.log("push_sent", push_id=h.push_id, base_version=h.base_version,
                 status=pb.PushStatus.Name(response.status), bytes=len(self.frame), tokens=h.tokens,
                 reason=response.reason, shard=h.shard_index, start=h.cursor_start, end=h.cursor_end,
                 cursor=response.cursor)
        g = self.base
        # Done once θ is newer than the push's base and, for a push pending in a round, holds that round's
        # version: a late push (a hung island back) goes into a round after the next, and the island's next
        # push belongs to the round after that one.
        while (g.version <= self.base.version or g.version < self._awaited()) and not self.stop.is_set():
            if response.status in NOT_TAKEN:
                # Not merged, and no version waits for it: back at once with the newest θ, so the island trains
                # the range again (a rewind) without waiting for a round that may be waiting for it.
                return self._pull(g)
            if self.repush.is_set():  # the coordinator lost our push (restart): send it again
                self.repush.clear()
                response = self.response = self._send()
                self.log("push_resent", push_id=h.push_id, status=pb.PushStatus.Name(response.status),
                         reason=response.reason, cursor=response.cursor)
                continue
            g = self._pull(g, wait_s=PULL_WAIT_S)
            if self.total_versions and g.version >= self.total_versions:
                break
        return g

    def _pull(self, have: GlobalParams, wait_s: float = 0.0) -> GlobalParams:
        """One pull of the exchange (a ``dtrain.pull`` span)."""
        with self.telemetry.span("dtrain.pull", parent=self.span, island=self.header.island_id,
                                 base_version=have.version, wait_s=wait_s) as span:
            g = self.puller.pull(self.header.island_id, have, wait_s=wait_s)
            self.telemetry.annotate(span, version=g.version)
            return g


@dataclass
class Pending:
    """A pushed round whose exchange has not been folded in yet (the training loop's; the exchange's thread
    sees only its :class:`Exchange`)."""

    exchange: Exchange
    at_push: Params  # θ_local when the delta was taken (a device copy: training donates the state)


def push_header(island_id: str, base_version: int, island: Island, steps: int, start: tuple[int, int],
                tree_digest: str, parts: int = 1) -> pb.PushHeader:
    """The header of the island's push of a round of ``steps`` inner steps, from ``start`` = (cursor, tokens) to
    where the island stands, based on global θ ``base_version``; a fresh push id. ``parts``: outer.fragments (the
    push carries fragment ``base_version`` mod parts)."""
    return pb.PushHeader(island_id=island_id, base_version=base_version,
                         fragment=fragments.fragment_of_base(base_version, parts),
                         push_id=f"{island_id}-{uuid.uuid4().hex[:12]}",
                         tokens=island.tokens - start[1], inner_steps=steps,
                         cursor_start=start[0], cursor_end=island.cursor, shard_index=island.index,
                         tree_digest=tree_digest)


class ShardFrames(bytes):
    """A push for a sharded coordinator (``coordinator.shards`` > 1): one frame per range, range 0 first
    (:attr:`frames`); as bytes, their concatenation (its length is the push's size)."""

    frames: tuple[bytes, ...]

    def __new__(cls, frames: Sequence[bytes]) -> ShardFrames:
        out = super().__new__(cls, b"".join(frames))
        out.frames = tuple(frames)
        return out


class Uplink:
    """Builds the island's push frames for one coordinator: Δ quantized to ``codec.up`` with error feedback (what
    quantization left out is carried into the next push), or, when a push fault is due (testing only:
    :mod:`workers.push_faults`), the fault's frame and client. Counts the frames and bytes it built. Used by the
    training loop's thread only (process 0: the others push nothing). A sharded coordinator's is
    :class:`workers.shard_links.ShardedUplink` (same interface); :mod:`workers.app` picks one."""

    def __init__(self, cfg: CodecConfig, n: int, injections: Sequence[Injection], client: CoordinatorClient,
                 log: EventLog, feedback_decay: float = 1.0, ranges: Sequence[fragments.Range] = ()):
        """``feedback_decay``: β of the error feedback (``dtrain.steps.outer.feedback_decay``: SparseLoCo's
        accumulator decays; 1 otherwise); ``ranges``: the parts with an error feedback of their own: the
        fragments' plan (outer.fragments > 1: each push holds one fragment's Δ), or a sharded coordinator's ranges
        (:class:`~workers.shard_links.ShardedUplink`); () for the whole θ."""
        self.cfg, self.n, self.client, self.log = cfg, n, client, log
        self.injections = list(injections)
        self.bits, self.block = cfg.scheme(cfg.up)
        self.ranges = tuple(ranges) or fragments.whole(n)
        on = cfg.error_feedback and self.bits != 32
        # int8 and int4: quantized in jitted code on the island's device (dtrain.train.device_codec: the same frames
        # as the host codec's, byte for byte); the other schemes by the host codec
        self.feedbacks: list[codec.ErrorFeedback | DeviceErrorFeedback] = [
            DeviceErrorFeedback(r.size, self.bits, self.block, feedback_decay) if self.bits in DEVICE_BITS else
            codec.ErrorFeedback(r.size, self.bits, self.block, feedback_decay, cfg.density_of(cfg.up))
            for r in self.ranges] if on else []
        self._fragment = 0  # the fragment of the frame being built (frame's header)
        self._seed = 0  # the mask codec's seed: the version the frame's Δ was trained from (frame's header)
        self.frames_sent = 0
        self.frame_bytes = 0
        self.values_sent = 0

    def frame(self, delta: np.ndarray, header: pb.PushHeader) -> tuple[bytes, PushClient]:
        """The frame to push for Δ = ``delta`` under ``header`` (the values of the fragment it names), and the
        client that pushes it."""
        self._fragment, self._seed = header.fragment, header.base_version
        frame, client = injected_push(self.injections, delta, header, self._encode, self.client, self.bits,
                                      self.cfg, self.log)
        self._count(frame, delta.size)
        return frame, client

    def _count(self, frame: bytes, values: int) -> None:
        """One more frame built, of ``values`` values."""
        self.frames_sent += 1
        self.frame_bytes += len(frame)
        self.values_sent += values

    def _encode(self, delta: np.ndarray) -> bytes:
        """Δ quantized (with its fragment's error feedback, if on) and compressed: the honest frame."""
        return self._encode_part(self._fragment, delta)

    def _encode_part(self, index: int, delta: np.ndarray) -> bytes:
        """One fragment's (or shard range's) Δ, with its own error feedback."""
        k = self.cfg
        q = self.feedbacks[index].compress(delta, self._seed) if self.feedbacks else \
            codec.quantize(delta, self.bits, self.block, k.density_of(k.up), self._seed)
        return codec.encode(q, k.push_level())

    @property
    def compression_ratio(self) -> float:
        """fp32 bytes over frame bytes, over every frame built so far (0.0 before the first)."""
        return (4.0 * self.values_sent / self.frame_bytes) if self.frame_bytes else 0.0


class Downlink:
    """Global θs on every process of the island (:mod:`workers.hosts`): process 0 fetches them (a pull, an
    exchange's θ'), the other processes receive process 0's θ bit for bit. Used by the training loop's thread
    only; an exchange's own pulls go through the :class:`Puller` on the exchange's thread."""

    def __init__(self, puller: Puller, hosts: HostGroup, n: int, island_id: Callable[[], str]):
        """``island_id``: the island's id now (the latest Join's: it changes at a rejoin)."""
        self.puller, self.hosts, self.n, self.island_id = puller, hosts, n, island_id

    def pull(self, have: GlobalParams | None, wait_s: float = 0.0, full: bool = False) -> GlobalParams:
        """Brings θ up to the coordinator's latest version (see :class:`Puller`); on every process of the island."""
        return self.shared(lambda: self.puller.pull(self.island_id(), have, wait_s=wait_s, full=full), have)

    def shared(self, fetch: Callable[[], GlobalParams], have: GlobalParams | None = None) -> GlobalParams:
        """``fetch()`` on process 0 (a pull, an exchange's θ'), its θ bit for bit on every process. ``have``: the θ
        each process holds; when process 0's answer is that θ (no newer version), nothing more is sent."""
        if self.hosts.alone:
            return fetch()
        got: list[GlobalParams] = []

        def lead() -> list[Any]:
            got.append(fetch())
            return [got[0].version, got[0] is have]

        version, same = self.hosts.lead(lead)
        if same:
            assert have is not None
            return have
        vec = self.hosts.share_vec(got[0].vec if got else None, self.n)
        return got[0] if got else GlobalParams(vec, version, arrived=time.perf_counter())

    def eval_requests(self) -> list[GlobalParams]:
        """The global θs the coordinator asked to evaluate (:meth:`Puller.take_eval_requests`), on every process."""
        if self.hosts.alone:
            return self.puller.take_eval_requests()
        taken = self.puller.take_eval_requests() if self.hosts.leader else []
        versions = self.hosts.agree([g.version for g in taken])
        return [GlobalParams(self.hosts.share_vec(taken[i].vec if taken else None, self.n), v)
                for i, v in enumerate(versions)]
