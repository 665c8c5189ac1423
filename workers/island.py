"""The island worker: train on the island's mesh; push, pull and fold in without idling.

Per round the island trains H steps (or ``worker.round_seconds`` of wall time),
then pushes Δ = θ_anchor − θ_local (θ_anchor: the global θ its trajectory is
based on), compressed with error feedback. The push and the pulls that follow
it run as an :class:`Exchange` on a thread of its own, which hands the new
global θ' back through a Future. With ``worker.overlap`` training continues
meanwhile; when θ' arrives the island folds it in at the next chunk boundary,
keeping the progress made since the push (``dtrain.diloco.fold_in``,
Streaming-DiLoCo style):

    θ_local ← θ' + (θ_local − θ_at_push);   θ_anchor ← θ'

so the next Δ covers exactly the steps since the last push and no step's
progress is pushed twice or lost. Without overlap the island waits for θ'
right after the push, so θ_local ← θ' exactly (plain DiLoCo). What to do at
each chunk boundary (train, wait, push, stop) is decided by the pure planner
``workers.rounds.next_action``; :meth:`Worker.run` only carries it out. The
island blocks only when the planner says to wait; that time is what
``utilization`` counts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from opentelemetry.trace import INVALID_SPAN, Span

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.chip_faults import DeviceFault
from dtrain.codec import CODEC_BITS, params_digest
from dtrain.config import Config
from dtrain.diloco import Island, advance, fold_in
from dtrain.errors import DtrainError
from dtrain.model import Params
from dtrain.prepare import prepare
from dtrain.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog, fmt_progress, json_number, process_dir, progress_line
from dtrain.step import make_mesh
from dtrain.telemetry import Telemetry, island_counters, require_exporter
from dtrain.train import InnerLoop
from dtrain.wire import MAX_EVAL_REPORTS, max_frame_bytes
from workers.chip_health import ChipHealth, Evidence
from workers.client import CoordinatorClient, CoordinatorError, PulledFrame, RunOverError, cause
from workers.hosts import HostGroup
from workers.push_faults import Injection, injected_push
from workers.rounds import Action, Kind, RoundProgress, Schedule, next_action

PULL_WAIT_S = 5.0  # one long poll; repeated until the awaited version arrives
FINAL_PULL_WAIT_S = 1.0  # after its data: shorter polls, so a shard handed over (a rewind) starts promptly
# A call cut off by the coordinator going away (it stops serving once the run is finished and the islands hold the
# last version): the stop it sent rides on a heartbeat reply that may not be read yet.
COORDINATOR_GONE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE})
MAX_ROLLBACKS = 3  # NaN-guard rollbacks in a row (no push in between) before the island gives up: it diverges
# A push refused with one of these was not applied and will not be by a retry: the island rewinds and goes on.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
# Push replies: the coordinator took the push (it goes, or went, into a version), or it did not (a rewind).
TAKEN = (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED, pb.PUSH_STATUS_DUPLICATE)
NOT_TAKEN = (pb.PUSH_STATUS_DROPPED, pb.PUSH_STATUS_REJECTED)


class WorkerError(DtrainError):
    pass


class EventLog(Protocol):
    """Records one event (``RunLog.event``)."""

    def __call__(self, kind: str, **fields: Any) -> object: ...


class PullClient(Protocol):
    """The part of :class:`CoordinatorClient` a :class:`Puller` uses."""

    def pull(self, island_id: str, have_version: int, wait_s: float = 0.0, full: bool = False,
             max_frame: int | None = None) -> list[PulledFrame]: ...


class PushClient(Protocol):
    """The part of :class:`CoordinatorClient` an :class:`Exchange` uses."""

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse: ...


@dataclass
class GlobalParams:
    vec: np.ndarray  # flat float32 θ_version, bit-identical to the coordinator's
    version: int
    arrived: float = 0.0  # time.perf_counter() when it arrived (wall-time rounds are timed from it)
    digest: str = ""  # its params digest, as verified against the coordinator's on arrival ("" if not checked here)


class Puller:
    """Brings the island's global θ up to the coordinator's latest version, verifying the digest after every frame.

    A broken update chain or a digest mismatch is answered with one full pull; if that does not verify either,
    the pull fails with a :class:`WorkerError` (no endless re-pulling of a θ that cannot be reproduced)."""

    def __init__(self, client: PullClient, n: int, max_frame: int, log: EventLog):
        self.client, self.n, self.max_frame, self.log = client, n, max_frame, log
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
            values = codec.dequantize(codec.decode(f.frame, expected_n=self.n))
            if h.kind == pb.PULL_KIND_FULL:
                g = GlobalParams(values, h.version)
            elif h.kind == pb.PULL_KIND_UPDATE:
                if g is None or h.base_version != g.version:
                    held = "no θ" if g is None else f"v{g.version}"
                    return g, f"the update to v{h.version} applies to v{h.base_version}, the island holds {held}"
                g = GlobalParams(g.vec + values, h.version)  # θ_v = θ_{v-1} + dequantize(update)
            if g is None:
                return g, f"a {pb.PullKind.Name(h.kind)} frame for v{h.version} without a θ to apply it to"
            digest = params_digest(g.vec)
            if digest != h.params_digest:
                self.log("digest_mismatch", version=h.version)
                return g, (f"v{h.version} decodes to params digest {digest}, the coordinator's θ has "
                           f"{h.params_digest}")
            g.digest = digest
            if h.evaluate:  # verified: the exact global θ_version (g.vec is a new array, never changed in place)
                with self._lock:
                    self._to_evaluate[g.version] = g
        return g, ""


class Exchange:
    """One round's push, then pulls until a newer global θ arrives (or the run stops), on a thread of its own.

    It is given everything it uses and returns the new θ (or the error that ended it) through :attr:`future`.
    The heartbeat sets :attr:`repush` when the coordinator has lost the push (a restart): it is sent again."""

    def __init__(self, client: PushClient, puller: Puller, frame: bytes, header: pb.PushHeader,
                 base: GlobalParams, total_versions: int, stop: threading.Event, log: EventLog,
                 telemetry: Telemetry | None = None, span: Span | None = None):
        """``span``: the exchange's ``dtrain.exchange`` span (ended by the fold-in), parent of its push and pull
        spans."""
        self.client, self.puller, self.frame, self.header, self.base = client, puller, frame, header, base
        self.total_versions, self.stop, self.log = total_versions, stop, log
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
        it was applied, and a retry would be refused too) is answered as REJECTED at its range's start."""
        h = self.header
        try:
            with self.telemetry.span("dtrain.push", parent=self.span, island=h.island_id, push_id=h.push_id,
                                     base_version=h.base_version, bytes=len(self.frame)) as span:
                response = self.client.push(h, self.frame)
                self.telemetry.annotate(span, status=pb.PushStatus.Name(response.status), version=response.version)
                return response
        except CoordinatorError as e:
            if e.code not in REFUSALS:
                raise
            self.log("push_refused", push_id=h.push_id, code=e.code.name, error=e.message)
            return pb.PushDeltaResponse(status=pb.PUSH_STATUS_REJECTED, reason=str(e), cursor=h.cursor_start)

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


class LinkWatch:
    """Notices a link to the coordinator that became slow, from heartbeat round trips: once ``warmup`` of them
    set a baseline (their median), ``streak`` round trips in a row above ``factor`` × baseline + ``margin_s``
    are a slow link, and one back under it a recovery. Slow round trips stay out of the baseline. A slow link
    is not a failure (the island keeps its lease); it is reported, since it will make the island's rounds late."""

    def __init__(self, window: int = 30, warmup: int = 5, streak: int = 3, factor: float = 3.0,
                 margin_s: float = 0.010):
        self.rtts: collections.deque[float] = collections.deque(maxlen=window)
        self.warmup, self.streak, self.factor, self.margin_s = warmup, streak, factor, margin_s
        self.over = 0
        self.slow = False

    def observe(self, rtt: float) -> tuple[str, dict[str, float]] | None:
        """Records one round trip; returns ("link_slow" | "link_recovered", fields) when the state changes."""
        if len(self.rtts) < self.warmup:
            self.rtts.append(rtt)
            return None
        baseline = statistics.median(self.rtts)
        limit = self.factor * baseline + self.margin_s
        fields = {"rtt_s": round(rtt, 4), "baseline_s": round(baseline, 4), "limit_s": round(limit, 4)}
        if rtt > limit:
            self.over += 1
            if self.over >= self.streak and not self.slow:
                self.slow = True
                return "link_slow", fields
            return None
        self.over = 0
        self.rtts.append(rtt)
        if self.slow:
            self.slow = False
            return "link_recovered", fields
        return None


@dataclass(frozen=True)
class Rewind:
    """Where the island trains next, set by the coordinator: after a (re)join (its shard and cursor) or after a
    push it dropped or rejected (the cursor its range started at). The island discards what it trained since its
    last accepted push and goes on from here on the newest global θ: no range is merged twice or left out."""

    shard: int
    cursor: int
    reason: str
    joined: bool = False  # from a Join (authoritative: replaces any other); else from a push reply


@dataclass(frozen=True)
class Recovery:
    """The island's own state is not to be trusted (a device was quarantined, or the NaN/Inf guard fired): it goes
    back to its last good state, its last push (optimizer moments from that push's checkpoint, θ the newest
    global one, its data cursor where that push ended), on a mesh of its healthy devices if ``remesh``."""

    reason: str
    remesh: bool = False


@dataclass
class Pending:
    """A pushed round whose exchange has not been folded in yet."""

    exchange: Exchange
    at_push: Params  # θ_local when the delta was taken (a device copy: training donates the state)


@dataclass
class IslandStatus:
    """What the heartbeat reports. The training loop writes it, the heartbeat thread only reads it."""

    # (the global version the island's trajectory is based on, its params digest as verified on arrival, or ""):
    # one attribute, replaced whole, so the heartbeat never pairs one version with another's digest
    held: tuple[int, str]
    steps: int
    tokens: int
    steps_per_s: float = 0.0
    exchange: Exchange | None = None  # in flight: its push id is reported, and a lost push is sent again
    devices: int = 0  # the devices the island trains on (fewer after a quarantine)
    quarantined: tuple[Evidence, ...] = ()  # the quarantined devices' evidence (replaced whole, never mutated)
    chunk_loss: Any = None  # the latest chunk's per-step train losses (a device array, maybe still computing)
    train_loss: float | None = None  # its mean, once read (None: no chunk read yet)
    utilization: float = 0.0  # fraction of the island's training wall time spent in inner steps so far

    @property
    def version(self) -> int:
        return self.held[0]

    def latest_loss(self, block: bool) -> float | None:
        """The mean train loss of the latest chunk; without ``block``, of the latest chunk already computed (the
        heartbeat never waits for the devices)."""
        losses = self.chunk_loss
        if losses is not None and (block or losses.is_ready()):
            self.train_loss = float(np.mean(np.asarray(losses)))  # note: a host-device sync (ready: no wait)
        return self.train_loss


class Worker:
    def __init__(self, cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False,
                 inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
                 hosts: HostGroup | None = None):
        """``inject``: push faults to inject; ``device_fault``: a faulty device inside the island, injected into
        the per-device inner step (testing only: :mod:`workers.inject`, :mod:`dtrain.health`). ``hosts``: the
        island's processes when it spans several (:mod:`workers.hosts`); process 0 talks to the coordinator."""
        self.hosts = hosts or HostGroup.single()
        # Push faults need nothing of the other processes: process 0 alone sends the island's pushes (_push).
        if not self.hosts.alone and (cfg.health.enabled or device_fault is not None):
            raise WorkerError(f"an island of {self.hosts.count} processes cannot run chip health ([health] enabled) "
                              f"or device faults yet: run it as one process per island, or set [health] enabled = "
                              f"false")
        self.cfg = cfg
        self.device_fault = device_fault
        self.injections = list(inject)
        self.name = name
        self.run_dir = Path(run_dir)
        require_exporter(cfg.telemetry)  # a missing extra, before anything slow
        # Process 0 writes the island's events and summary; another process its own, under process-I, quietly.
        self.log = RunLog(process_dir(self.run_dir, self.hosts.index), quiet=quiet or not self.hosts.leader)
        # Built at the first Join (its Resource names the run id); until then it records nothing.
        self.telemetry = Telemetry.disabled()
        self.stopping = threading.Event()  # the island is done (the run is over, or it failed): calls stop retrying
        self.client = CoordinatorClient(address, cfg, on_retry=self._on_retry, give_up=self.stopping)
        # Chip health ([health] enabled) runs the per-device step, whose metrics are the statistics probe; so does an
        # injected device fault (the fault lives in that step), detected or not.
        self.setup = prepare(cfg, cfg.outer.islands, per_device=cfg.health.enabled or device_fault is not None,
                             fault=device_fault)
        self.loop: InnerLoop = self.setup.loop
        self.mesh_devices = self.loop.mesh.devices.size  # the island's devices before any quarantine
        self.health = ChipHealth(cfg.health, self.loop.model.apply, self.loop.mesh, fault=device_fault) \
            if cfg.health.enabled else None
        self.rollbacks = 0  # NaN-guard rollbacks since the last push
        self.nan_rollbacks = 0  # all of them
        self._finite: list[Any] = []  # the NaN/Inf guard's per-step flags not looked at yet (device arrays)
        self.drained = ""  # why the island stopped training early (too few healthy devices), if it did
        self.schedule = Schedule.from_config(cfg)
        template = jax.device_get(self.setup.built.init(cfg.run.seed))
        self.spec, _ = codec.flatten(template)
        self.n = codec.spec_size(self.spec)
        self.tree_digest = codec.spec_digest(self.spec)
        self.puller = Puller(self.client, self.n, max_frame_bytes(self.n, cfg.codec.block), self.log.event)
        k = cfg.codec
        self.up_bits = CODEC_BITS[k.up]
        self.feedback = codec.ErrorFeedback(self.n, self.up_bits, k.block) \
            if k.error_feedback and self.up_bits != 32 else None
        self.island_id = ""
        self.total_versions = 0  # the version the run ends at, if the coordinator knows it ahead (0: it says stop)
        self.final_version = 0  # the coordinator's version when it said the run is over
        self._rewind: Rewind | None = None  # set by the heartbeat thread or a fold-in, applied by the training loop
        self._last_exchange: Exchange | None = None  # the last one folded in
        self._rewind_lock = threading.Lock()
        self.ckpt: Checkpointer | None = None
        self.blocked_s = 0.0
        self.executed_steps = 0  # inner steps this process has run (rewound ones too): the compute it spent
        self.frames_sent = 0
        self.frame_bytes = 0
        self.eval_s = 0.0  # seconds spent evaluating global θs the coordinator asked for while training
        self._active_s = 0.0  # training wall time of the finished _train calls
        self._train_since: float | None = None  # time.perf_counter() when the running _train call began
        self._eval_reports: dict[int, float] = {}  # version -> eval loss, sent by heartbeats until one is answered
        self._evaluated: dict[int, float] = {}  # every version evaluated by this process: each is evaluated once
        self._eval_lock = threading.Lock()
        self._hb_wake = threading.Event()  # set: send a heartbeat now (an eval report is ready, or the island stops)

    RETRY_LINE_S = 30.0  # a retried call's progress line: at its first retry, then at most this often
    _retry_line: tuple[str, float] = ("", float("-inf"))  # the last one's text and time.monotonic() (_on_retry)

    def _on_retry(self, what: str, pause: float, left: float) -> None:
        """Each retry is an event; a progress line says what the island waits for (``what``: the call, the
        coordinator's address and why it failed) and how long it goes on waiting, at the first retry of a call and
        then every RETRY_LINE_S (a 10-minute outage is 20 lines, not one per backoff)."""
        self.log.event("retry", what=what, pause_s=pause, left_s=round(left, 3))
        now = time.monotonic()
        if what == self._retry_line[0] and now - self._retry_line[1] < self.RETRY_LINE_S:
            return
        self._retry_line = (what, now)
        self.log.progress(f"{self.name}: {what}; retrying for {left:.0f}s more, then giving up "
                          f"(worker.retry_total_s={self.cfg.worker.retry_total_s:g})")

    # -- exchange pieces ----------------------------------------------------------------------------

    def join(self) -> pb.JoinResponse:
        devices = self.mesh_devices  # the whole mesh: a quarantined device's evidence names its place in it
        hardware = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
        device_kind = str(getattr(next(iter(self.loop.mesh.devices.flat)), "device_kind", ""))
        resp = self.client.join(self.name, hardware, devices, device_kind=device_kind)
        if resp.tree_digest != self.tree_digest or resp.tree_size != self.n:
            raise WorkerError(f"the coordinator's parameter tree ({resp.tree_size} values, {resp.tree_digest}) "
                              f"differs from this island's ({self.n}, {self.tree_digest})")
        self.island_id = resp.island_id
        self.total_versions = resp.total_versions
        if not self.telemetry.enabled and self.cfg.telemetry.exporter != "none":
            self._start_telemetry(resp.run_id)
        self.log.event("joined", island_id=resp.island_id, shard=resp.shard_index, cursor=resp.cursor,
                       version=resp.version, run_id=resp.run_id, total_versions=resp.total_versions)
        return resp

    def _start_telemetry(self, run_id: str) -> None:
        self.telemetry = Telemetry(self.cfg.telemetry, "island", self.name, run_id)
        island_counters(self.telemetry, lambda: self.client.bytes_up, lambda: self.client.bytes_down)
        self.log.subscribe(self.telemetry.on_event)

    def pull(self, have: GlobalParams | None, wait_s: float = 0.0, full: bool = False) -> GlobalParams:
        """Brings θ up to the coordinator's latest version (see :class:`Puller`); on every process of the island."""
        return self._shared_params(lambda: self.puller.pull(self.island_id, have, wait_s=wait_s, full=full), have)

    # -- the island's processes (workers.hosts): process 0 decides, the others follow ---------------------------

    def _shared_params(self, fetch: Callable[[], GlobalParams], have: GlobalParams | None = None) -> GlobalParams:
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

    def _join_island(self) -> pb.JoinResponse:
        """Process 0 joins (:meth:`join`); every process learns the reply (island id, shard, cursor, version)."""
        if self.hosts.alone:
            return self.join()
        sent = self.hosts.lead(lambda: self.join().SerializeToString().hex())  # JSON carries the message as hex
        reply = pb.JoinResponse.FromString(bytes.fromhex(sent))
        if not self.hosts.leader:
            self.island_id, self.total_versions = reply.island_id, reply.total_versions
            self.log.event("joined", island_id=reply.island_id, shard=reply.shard_index, cursor=reply.cursor,
                           version=reply.version, run_id=reply.run_id, total_versions=reply.total_versions)
        return reply

    def _stopped_after(self, error: CoordinatorError) -> bool:
        """:meth:`_stopped`, once a call failed. If the coordinator went away (:data:`COORDINATOR_GONE`), its stop
        may be in a heartbeat reply the heartbeat thread has not handled yet (the coordinator stops serving as soon
        as the islands hold the last version): process 0 gives it two heartbeat periods before the island decides
        the failure is an error. Seen as `dtrain worker: error: CANCELLED` at the end of about one run in ten on a
        loaded machine."""
        if error.code in COORDINATOR_GONE and self.hosts.leader:
            self.stopping.wait(2 * self.cfg.worker.heartbeat_s)
        return self._stopped()

    def _stopped(self) -> bool:
        """Whether the island stops (the coordinator said so, or it failed): process 0's answer on every process,
        which also learns the run's final and total versions from it."""
        if self.hosts.alone:
            return self.stopping.is_set()
        stop, final_version, total_versions = self.hosts.agree(
            [self.stopping.is_set(), self.final_version, self.total_versions])
        if not self.hosts.leader:  # process 0's heartbeat thread owns its own values
            self.final_version, self.total_versions = final_version, total_versions
            if stop:
                self.stopping.set()
        return bool(stop)

    def _agreed_rewind(self, rewind: Rewind | None) -> Rewind | None:
        """Process 0's rewind (the coordinator's word reaches process 0 only) on every process."""
        if self.hosts.alone:
            return rewind
        shared = self.hosts.agree(dataclasses.asdict(rewind) if rewind is not None else None)
        return Rewind(**shared) if shared is not None else None

    def _agreed_action(self, action: Action) -> Action:
        """Process 0's next action on every process (a wall-time round ends by process 0's clock)."""
        if self.hosts.alone:
            return action
        shared: dict[str, Any] = self.hosts.agree({"kind": action.kind.value, "steps": action.steps,
                                                   "reason": action.reason})
        return Action(Kind(shared["kind"]), int(shared["steps"]), str(shared["reason"]))

    def _eval_requests(self) -> list[GlobalParams]:
        """The global θs the coordinator asked to evaluate (:meth:`Puller.take_eval_requests`), on every process."""
        if self.hosts.alone:
            return self.puller.take_eval_requests()
        taken = self.puller.take_eval_requests() if self.hosts.leader else []
        versions = self.hosts.agree([g.version for g in taken])
        return [GlobalParams(self.hosts.share_vec(taken[i].vec if taken else None, self.n), v)
                for i, v in enumerate(versions)]

    def _push_frame(self, delta: np.ndarray) -> bytes:
        k = self.cfg.codec
        q = self.feedback.compress(delta) if self.feedback is not None else codec.quantize(delta, self.up_bits, k.block)
        return codec.encode(q, k.zstd_level)

    # -- evaluation on request, utilization ------------------------------------------------------------

    def _evaluate_requested(self) -> None:
        """Evaluates each global θ the coordinator asked for (PullHeader.evaluate) on the held-out split, with the
        island's final-eval function, and hands the losses to the heartbeat (woken to send them at once)."""
        requests = self._eval_requests()
        for g in requests:
            loss = self._eval_loss(g)
            with self._eval_lock:
                if math.isfinite(loss):  # the coordinator refuses a non-finite eval report
                    self._eval_reports[g.version] = loss
        if requests:
            self._hb_wake.set()

    def _eval_loss(self, g: GlobalParams) -> float:
        """The held-out eval loss of global θ ``g`` (computed once per version)."""
        if g.version in self._evaluated:
            return self._evaluated[g.version]
        t0 = time.perf_counter()
        loss = self.loop.evaluate(self.loop.place_params(codec.unflatten(self.spec, g.vec)), self.setup.eval_batches)
        seconds = time.perf_counter() - t0
        if self._train_since is not None:  # not inner steps: utilization leaves it out
            self.eval_s += seconds
        self._evaluated[g.version] = loss
        self.log.event("evaluated", version=g.version, eval_loss=json_number(loss), seconds=round(seconds, 4))
        return loss

    def _pending_evals(self) -> list[tuple[int, float]]:
        """The eval reports not yet carried by an answered heartbeat, as (version, loss): the oldest
        :data:`dtrain.wire.MAX_EVAL_REPORTS` (the coordinator refuses a heartbeat with more)."""
        with self._eval_lock:
            return sorted(self._eval_reports.items())[:MAX_EVAL_REPORTS]

    def _evals_answered(self, sent: list[tuple[int, float]]) -> None:
        """A heartbeat carrying ``sent`` was answered: those reports are delivered."""
        with self._eval_lock:
            for version, _ in sent:
                self._eval_reports.pop(version, None)

    def _utilization(self) -> float:
        """Fraction of the island's training wall time so far spent in inner steps: not blocked waiting for a
        global θ, nor evaluating one the coordinator asked for."""
        active = self._active_s
        if self._train_since is not None:
            active += time.perf_counter() - self._train_since
        if active <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self.blocked_s + self.eval_s) / active))

    # -- the loop -----------------------------------------------------------------------------------

    def _heartbeat_loop(self, status: IslandStatus) -> None:
        """One heartbeat every worker.heartbeat_s, one try each (no backoff: the next tick is the retry, so a
        coordinator that comes back hears from the island within a heartbeat, well inside its lease). A run of
        failures is one event, and its end another."""
        failing_since: float | None = None
        link = LinkWatch()
        while not self.stopping.is_set():
            self._hb_wake.wait(self.cfg.worker.heartbeat_s)  # a tick, or woken early (an eval report is ready)
            self._hb_wake.clear()
            if self.stopping.is_set():
                break
            exchange = status.exchange
            evals = self._pending_evals()
            version, digest = status.held
            try:
                t0 = time.perf_counter()
                resp = self.client.heartbeat(0.0, island_id=self.island_id, version=version,
                                             params_digest=digest,
                                             steps=status.steps, tokens=status.tokens, steps_per_s=status.steps_per_s,
                                             pending_push_id=exchange.push_id if exchange is not None else "",
                                             train_loss=_finite_or_none(status.latest_loss(block=False)),
                                             utilization=self._utilization(), evals=evals,
                                             **_chip_report(status.quarantined, status.devices))
                self._evals_answered(evals)
                change = link.observe(time.perf_counter() - t0)
                if change is not None:
                    self.log.event(change[0], **change[1])
            except CoordinatorError as e:
                if failing_since is None:
                    failing_since = time.perf_counter()
                    self.log.event("heartbeat_failed", error=str(e))
                continue
            if failing_since is not None:
                self.log.event("heartbeat_restored", after_s=round(time.perf_counter() - failing_since, 3))
                failing_since = None
            if resp.action == pb.ACTION_STOP:
                self.log.event("stop_requested", reason=resp.reason, version=resp.version)
                self.final_version = resp.version
                self.stopping.set()
            elif resp.action == pb.ACTION_REJOIN:
                self.log.event("rejoin", reason=resp.reason)
                try:
                    joined = self.join()
                    self.post_rewind(Rewind(joined.shard_index, joined.cursor, resp.reason, joined=True))
                except RunOverError as e:
                    self.log.event("stop_requested", reason=str(e))
                    self.stopping.set()
                except CoordinatorError as e:
                    self.log.event("rejoin_failed", error=str(e))
            if resp.push_unknown and exchange is not None:
                exchange.repush.set()

    def post_rewind(self, rewind: Rewind) -> None:
        """Hands the training loop a :class:`Rewind` (applied at its next chunk boundary). One from a Join replaces
        any other; one from a push reply does not replace one from a Join."""
        with self._rewind_lock:
            if rewind.joined or self._rewind is None or not self._rewind.joined:
                self._rewind = rewind

    def _take_rewind(self) -> Rewind | None:
        with self._rewind_lock:
            rewind, self._rewind = self._rewind, None
        return self._agreed_rewind(rewind)

    def _await_peers(self) -> None:
        """Start barrier: wait (up to worker.start_wait_s) until outer.islands islands have joined, so that the
        first round starts together instead of the first island idling through the others' start-up. An
        island that restarts mid-run finds them all joined already and goes straight on."""
        want, limit = self.cfg.outer.islands, self.cfg.worker.start_wait_s
        t0 = time.perf_counter()
        while limit > 0 and not self.stopping.is_set():
            joined = len(self.client.status().islands)  # live, lost or stopped: each has shown up
            if joined >= want:
                break
            if time.perf_counter() - t0 > limit:
                self.log.event("start_wait_timeout", joined=joined, islands=want, waited_s=limit)
                break
            time.sleep(0.1)
        self.log.event("start_barrier", waited_s=round(time.perf_counter() - t0, 3))

    def _precompile(self) -> None:
        """Compiles every chunk length the schedule uses, the eval and the fold-in. Done before joining: a first
        call that compiles mid-run would stall this island's round and, in sync mode, every other island."""
        loop = self.loop
        loop.precompile(self.schedule.chunk_lengths(), len(self.setup.eval_batches))
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                loop.model.abstract_params, loop.params_sharding)
        fold_in.lower(abstract, abstract, abstract).compile()

    def _start_island(self, joined: pb.JoinResponse, g: GlobalParams, ckpt: Checkpointer) -> Island:
        """The island on its shard from the coordinator's cursor, θ from the pull, moments from a checkpoint."""
        loop, cfg = self.loop, self.cfg
        island = Island(index=joined.shard_index, state=self._state_from(g, ckpt),
                        stream=self.setup.shards[joined.shard_index].stream, cursor=int(joined.cursor))
        island.steps = island.cursor // cfg.train.batch_size  # a rejoining island goes on where its data ends
        self.log.event("island_started", name=self.name, shard=joined.shard_index, cursor=island.cursor,
                       version=g.version, devices=len(loop.mesh.devices.flat), host=platform.node(),
                       cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
        self.log.progress(f"{self.name}: shard {joined.shard_index}, cursor {island.cursor}, v{g.version}")
        return island

    def _state_from(self, g: GlobalParams, ckpt: Checkpointer) -> Any:
        """A train state on the island's mesh: θ from ``g``, the optimizer moments from the island's last checkpoint
        (saved at its last push) when there is one of this run, else fresh ones."""
        params = self.loop.place_params(codec.unflatten(self.spec, g.vec))
        state = self.loop.init_state(params)
        ckpt.wait()  # a save still being written is the last push's
        if ckpt.latest_step() is not None:
            _, restored, meta = ckpt.restore(state)  # into this mesh's shardings (a remeshed island's too)
            if meta.get("fingerprint") == self.cfg.fingerprint():
                self.log.event("island_restored", step=meta.get("steps"))
                return restored.replace(params=state.params)  # optimizer moments; θ from the pull
        return state

    # -- chip health -----------------------------------------------------------------------------------

    def _quarantined(self, found: list[Evidence], status: IslandStatus | None) -> None:
        """Logs each device just quarantined, and hands the evidence to the heartbeat."""
        assert self.health is not None
        for ev in found:
            self.log.event("device_quarantined", **ev, healthy=len(self.health.healthy_ids))
            self.log.progress(f"{self.name}: device {ev['device']} quarantined ({ev['probe']}, step {ev['step']}): "
                              f"{ev['detail']}")
        if status is not None:
            status.quarantined = self._evidence()

    def _evidence(self) -> tuple[Evidence, ...]:
        """The quarantined devices' evidence, in the order found (none without chip health)."""
        return tuple(self.health.quarantined.values()) if self.health is not None else ()

    def _too_few(self) -> str:
        """Why the island cannot train on its healthy devices ('' if it can)."""
        if self.health is None or not self.health.too_few():
            return ""
        return (f"{len(self.health.healthy_ids)} healthy device(s) left, fewer than [health] "
                f"min_devices={self.cfg.health.min_devices}")

    def _remesh(self) -> dict[str, Any]:
        """Rebuilds the inner loop on the healthy devices, with the same global batch (the quarantined devices'
        rows go to the others: :func:`dtrain.train.rows_per_device`); the caller compiles it before it trains."""
        assert self.health is not None
        old = self.loop
        healthy = set(self.health.healthy_ids)
        mesh = make_mesh(self.cfg, [d for d in old.mesh.devices.flat if d.id in healthy], remesh=True)
        self.loop = self.setup.loop = InnerLoop(self.cfg, old.model, mesh, per_device=True, fault=self.device_fault)
        self.health.rebind(mesh)
        return {"devices": mesh.devices.size, "device_ids": [int(d.id) for d in mesh.devices.flat],
                "rows_per_device": list(self.loop.rows), "from_devices": old.mesh.devices.size,
                "fsdp": mesh.shape["fsdp"]}

    def _start_health(self) -> None:
        """The known answer on every device before anything compiles; a device that fails it is quarantined and
        the island starts on the others."""
        if self.health is None:
            return
        found = self.health.start(0)
        self._quarantined(found, None)
        too_few = self._too_few()
        if too_few:
            raise WorkerError(f"{too_few}: this island cannot train (see the device_quarantined events in "
                              f"{self.run_dir / 'events.jsonl'})")
        if found:  # the first compile is then the healthy mesh's
            self.log.event("remeshed", **self._remesh(), cursor=0, version=0, restored="start")

    def run(self) -> dict[str, Any]:
        """Precompiles, joins, trains round after round, waits for the run's last θ; returns the summary, or
        ``{"island", "run_over"}`` if the coordinator refuses the Join because the run is over."""
        t_start = time.perf_counter()
        self._start_health()
        self._precompile()
        ckpt = self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=1)
        # Only now join: everything slow is done, so "joined" means "about to train" for the start barrier.
        try:
            joined = self._join_island()
        except RunOverError as e:  # it ended before this island joined
            return self._run_over(f"{e.message} (coordinator at {self.client.address})")
        # Heartbeats start with the lease, on their own thread: the first pull (a whole θ) and the restore may
        # take longer than a lease, and nothing the training loop does may delay them.
        status = IslandStatus(held=(joined.version, ""), steps=0, tokens=0, devices=self.loop.mesh.devices.size,
                              quarantined=self._evidence())
        hb = threading.Thread(target=self._heartbeat_loop, args=(status,), name="heartbeat", daemon=True)
        if self.hosts.leader:  # only process 0 talks to the coordinator
            hb.start()
        anchor = self.pull(None)
        island = self._start_island(joined, anchor, ckpt)
        status.held, status.steps, status.tokens = (anchor.version, anchor.digest), island.steps, island.tokens
        self.hosts.lead(self._await_peers)
        anchor.arrived = time.perf_counter()  # a wall-time round 1 starts now, not when θ_0 arrived
        rounds, final_wait, more = 0, 0.0, True
        while more:  # once its data is done the island waits for the end, unless it is handed more (a rewind)
            t0 = self._train_since = time.perf_counter()
            anchor, pending, n = self._train(island, anchor, status, ckpt)
            rounds, self._active_s, self._train_since = rounds + n, self._active_s + time.perf_counter() - t0, None
            if self.drained:
                anchor = self._drain(island, anchor, pending, status)
                break
            t0 = time.perf_counter()
            anchor, more = self._final_wait(island, anchor, pending, status)
            final_wait += time.perf_counter() - t0
        self.stopping.set()
        self._hb_wake.set()
        if hb.is_alive():
            hb.join(timeout=5)
        ckpt.close()
        self.ckpt = None
        return self._finish(island, anchor, status, rounds, t_start, final_wait)

    def _train(self, island: Island, anchor: GlobalParams, status: IslandStatus,
               ckpt: Checkpointer) -> tuple[GlobalParams, Pending | None, int]:
        """Carries out the planner's actions until it ends the run or the coordinator stops it; returns θ_anchor,
        the exchange still in flight (the last round's, or one cut short by a stop) and the rounds pushed."""
        sched = self.schedule
        pending: Pending | None = None
        round_steps = rounds = 0
        round_start = (island.cursor, island.tokens)
        last_log = (time.perf_counter(), self.executed_steps)
        while not self._stopped():
            self._evaluate_requested()
            rewind = self._take_rewind()
            if rewind is not None:
                anchor, moved = self._apply_rewind(island, anchor, pending, status, rewind, round_start[0])
                pending = None  # finished by the rewind
                if moved:
                    round_steps, round_start = 0, (island.cursor, island.tokens)
                continue
            action = self._agreed_action(next_action(sched, RoundProgress(
                round_steps=round_steps, island_steps=island.steps, exchange_in_flight=pending is not None,
                since_arrival_s=time.perf_counter() - anchor.arrived,
                final_version=bool(self.total_versions) and anchor.version >= self.total_versions)))
            if action.kind is Kind.END_RUN:
                break
            recovery: Recovery | None = None
            if action.kind is Kind.WAIT:
                assert pending is not None
                anchor, pending = self._wait(island, pending, status, action.reason), None
            elif action.kind is Kind.TRAIN:
                n = action.steps
                recovery = self._train_chunk(island, n, status)
                if recovery is None:
                    if sched.round_seconds:  # the deadline is about steps done, not queued: dispatch is async
                        jax.block_until_ready(island.state.step)
                    round_steps += n
                    if pending is not None and self.hosts.agree(pending.exchange.future.done()):
                        anchor, pending = self._fold_in(island, pending, status), None  # without waiting
                    if island.steps % self.cfg.run.log_every < n:
                        last_log = self._log_rate(island, anchor, status, last_log)
            elif self._guard_tripped():  # Kind.END_ROUND with a non-finite step in the round: never pushed
                recovery = self._nan_recovery(island)
            else:  # Kind.END_ROUND: the previous exchange is folded in; push this round's delta
                self.rollbacks = 0
                pending = self._push(island, anchor, round_steps, round_start, status, ckpt)
                round_start = (island.cursor, island.tokens)
                round_steps, rounds = 0, rounds + 1
            if recovery is not None:  # back to the last push's state (on the healthy devices), or drain
                if self.drained:
                    break
                anchor, _ = self._apply_rewind(island, anchor, pending, status,
                                               Rewind(island.index, round_start[0], recovery.reason),
                                               round_start[0], recovery)
                pending, round_steps, round_start = None, 0, (island.cursor, island.tokens)
        return anchor, pending, rounds

    def _train_chunk(self, island: Island, n: int, status: IslandStatus) -> Recovery | None:
        """Runs one chunk of ``n`` inner steps; with chip health, checks it (and diagnoses a chunk that raised).
        A :class:`Recovery` when the island's state since its last push is not to be trusted: a device was
        quarantined (then :attr:`drained` is set if too few are left), or a step was not finite."""
        batch = self.cfg.train.batch_size
        cursor, metrics = island.cursor, {}
        first = int(island.state.step) if self.health is not None else 0  # synced already: the last check read it
        try:
            advance(self.loop, island, n, batch, on_chunk=lambda _, m: metrics.update(m))
        except Exception as e:
            if self.health is None:
                raise
            # Which device failed? The known answer on each, now (at the chunk's last step: a dead chip stays dead).
            # None: not a device's failure, or one gone again (an intermittent one): the error stands.
            found = self.health.diagnose(first + n - 1)
            if not found:
                raise
            self.log.event("chunk_failed", step=first, steps=n, error=f"{type(e).__name__}: {e}")
            return self._quarantine_recovery(found, status, "its computation raised")
        self.executed_steps += n
        # One line per chunk: a killed process's compute is known to within a chunk (goodput).
        self.log.event("trained", steps=n, executed=self.executed_steps, shard=island.index, cursor=island.cursor)
        status.steps, status.tokens = island.steps, island.tokens
        status.chunk_loss, status.utilization = metrics["loss"], self._utilization()
        self._finite.append(metrics["finite"])
        if self.health is None:
            return None  # the NaN/Inf guard is read at the push (no host sync per chunk)
        cleared = len(self.health.cleared)
        found = self.health.check(first, metrics, island.state.params, island.stream.batches(cursor, n, batch))
        for ev in self.health.cleared[cleared:]:
            self.log.event("device_suspect_cleared", **ev)
        if found:
            return self._quarantine_recovery(found, status, "a probe found it")
        return self._nan_recovery(island) if self._guard_tripped() else None

    def _guard_tripped(self) -> bool:
        """The NaN/Inf guard: was any step since the last look not finite (loss or gradient, any device)?"""
        flags, self._finite = self._finite, []
        return not all(bool(np.all(np.asarray(f))) for f in flags)

    def _nan_recovery(self, island: Island) -> Recovery:
        self.rollbacks += 1
        self.nan_rollbacks += 1
        self.log.event("nan_guard", step=island.steps, cursor=island.cursor, rollbacks=self.rollbacks)
        if self.rollbacks > MAX_ROLLBACKS:
            raise WorkerError(f"training diverges: a non-finite loss or gradient again after {MAX_ROLLBACKS} "
                              f"rollbacks to the last push (island step {island.steps}); lower [train] lr or "
                              f"grad_clip, or check the data")
        return Recovery(f"NaN/Inf guard: a non-finite loss or gradient before island step {island.steps}")

    def _quarantine_recovery(self, found: list[Evidence], status: IslandStatus, how: str) -> Recovery:
        assert self.health is not None
        self._quarantined(found, status)
        devices = [ev["device"] for ev in found]
        self.drained = self._too_few()
        return Recovery(f"device(s) {devices} quarantined ({how})", remesh=True)

    def _log_rate(self, island: Island, anchor: GlobalParams, status: IslandStatus,
                  last_log: tuple[float, int]) -> tuple[float, int]:
        """Every run.log_every steps: measures steps/s since the last mark, records a ``train`` event (the latest
        chunk's mean loss) and shows the island's status line; returns the new (time, steps) mark."""
        jax.block_until_ready(island.state.step)  # note: host sync, once per log interval
        now = time.perf_counter()
        # From the steps this process ran, not the island's position: a rewind moves that back (or to another
        # shard), and a negative rate would have the coordinator refuse the island's heartbeats.
        status.steps_per_s = (self.executed_steps - last_log[1]) / max(now - last_log[0], 1e-9)
        tokens_per_s = status.steps_per_s * self.cfg.train.batch_size * self.cfg.model.seq_len
        loss = status.latest_loss(block=True)
        status.utilization = self._utilization()
        self.log.event("train", step=island.steps, loss=json_number(loss), tokens=island.tokens,
                       tokens_per_s=round(tokens_per_s, 1), version=anchor.version, shard=island.index,
                       cursor=island.cursor, utilization=round(status.utilization, 4))
        total = self.total_versions
        shard_end = self.cfg.train.steps * self.cfg.train.batch_size  # sequences per shard (step rounds)
        self.log.status(self.name, fmt_progress(self.name, step=island.steps, version=anchor.version, total=total,
                                                data=None if total else (island.cursor, shard_end), loss=loss,
                                                tokens_per_s=tokens_per_s),
                        done=anchor.version if total else island.cursor, total=total or shard_end)
        return now, self.executed_steps

    def _fold_in(self, island: Island, pending: Pending, status: IslandStatus, fold: bool = True) -> GlobalParams:
        """Waits for the exchange's θ' (raising its error, if it failed) and folds it in; θ' is the new anchor.
        If the coordinator dropped or rejected the push, a :class:`Rewind` to its cursor is posted: the loop
        then trains the push's range again (the fold-in's progress is discarded there). ``fold=False``: θ' only,
        the island's state is about to be replaced (a :class:`Recovery`)."""
        exchange = pending.exchange
        with self.telemetry.ending(exchange.span):  # the exchange's span ends with its fold-in (or its error)
            result = self._shared_params(exchange.future.result)  # process 0's exchange, every process's θ'
            self.telemetry.annotate(exchange.span, version=result.version)
            self._last_exchange = exchange
            with self.telemetry.span("dtrain.fold_in", parent=exchange.span, island=self.island_id,
                                     base_version=exchange.base.version, version=result.version, folded=fold):
                if fold:
                    new_global = self.loop.place_params(codec.unflatten(self.spec, result.vec))
                    island.state = island.state.replace(params=fold_in(island.state.params, pending.at_push,
                                                                       new_global))
        self._evaluate_requested()  # first: the heartbeat that reports the new version carries its eval
        status.exchange, status.held = None, (result.version, result.digest)
        resp, h = pending.exchange.response, pending.exchange.header
        if resp is not None and resp.status in NOT_TAKEN and h.shard_index == island.index:
            self.post_rewind(Rewind(h.shard_index, resp.cursor,
                                    f"push {h.push_id} {pb.PushStatus.Name(resp.status)}: {resp.reason}"))
        return result

    def _apply_rewind(self, island: Island, anchor: GlobalParams, pending: Pending | None, status: IslandStatus,
                      rewind: Rewind, start: int, recovery: Recovery | None = None) -> tuple[GlobalParams, bool]:
        """Moves the island to ``rewind``'s shard and cursor on the newest θ, discarding what it trained since
        ``start`` (the cursor its unpushed progress began at); returns (θ_anchor, whether it moved).
        The exchange in flight is finished first: if the coordinator accepted its push, the rewind starts after
        that push's range; if its island still stands where the coordinator says, nothing is discarded.
        With a ``recovery`` the island's state is replaced whatever the cursor: θ the newest, the optimizer
        moments from the last push's checkpoint, on the healthy devices' mesh if it remeshes."""
        if pending is not None:
            anchor = self._wait(island, pending, status, "rewind: finish the exchange in flight first",
                                fold=recovery is None)
        later = self._take_rewind()  # the fold-in's own (the coordinator dropped or rejected the push), or a Join's
        if later is not None and (later.joined or not rewind.joined):
            rewind = later
        remeshed: dict[str, Any] = {}
        executed_step = self._step_counter(island) if recovery is not None else 0  # before the mesh goes
        if recovery is not None and recovery.remesh:
            remeshed = self._remesh()
        if self._last_exchange is not None:  # its push, taken after the cursor was named, moved the cursor
            rewind = dataclasses.replace(rewind, cursor=self._last_exchange.accepted_range_end(rewind.shard,
                                                                                               rewind.cursor))
        agreed = self._agreed_rewind(rewind)  # process 0 alone knows its last exchange's reply
        assert agreed is not None
        rewind = agreed
        # ``start`` is then the last push's end: the island's progress since that push is what it has not pushed
        if recovery is None and rewind.shard == island.index and rewind.cursor == start:
            self.log.event("rewind_kept", shard=island.index, cursor=start, reason=rewind.reason)
            return anchor, False
        batch = self.cfg.train.batch_size
        discarded = (island.cursor - start) // batch  # unpushed progress, thrown away
        # Steps trained again: a dropped or rejected range, and the progress after it, on the same shard.
        again = (island.cursor - rewind.cursor) // batch if rewind.shard == island.index else 0
        latest = self.pull(anchor)  # the newest θ: the retrained range is pushed against it
        if recovery is None:
            island.state = island.state.replace(params=self.loop.place_params(codec.unflatten(self.spec, latest.vec)))
        else:
            if remeshed:
                self._precompile()
            assert self.ckpt is not None
            # The step counter goes on (a fault tied to device time does not replay with the retrained range)
            step = jax.device_put(jnp.asarray(executed_step, jnp.int32), self.loop.state_sharding.step)
            island.state = self._state_from(latest, self.ckpt).replace(step=step)
            self._finite.clear()
        self.log.event("rewound", from_shard=island.index, from_cursor=island.cursor, to_shard=rewind.shard,
                       to_cursor=rewind.cursor, discarded_steps=discarded, retrained_steps=max(again, 0),
                       version=latest.version, restored=recovery is not None,
                       reason=rewind.reason if recovery is None else recovery.reason)
        if remeshed:
            status.devices = self.loop.mesh.devices.size
            self.log.event("remeshed", **remeshed, cursor=rewind.cursor, version=latest.version,
                           restored="last push")
            self.log.progress(f"{self.name}: remeshed on {remeshed['devices']} devices "
                              f"(rows per device {remeshed['rows_per_device']})")
        self.log.progress(f"{self.name}: rewound to shard {rewind.shard} cursor {rewind.cursor} "
                          f"({discarded} steps discarded): {rewind.reason}")
        island.index, island.stream = rewind.shard, self.setup.shards[rewind.shard].stream
        island.cursor, island.steps = rewind.cursor, rewind.cursor // batch
        status.held, status.steps = (latest.version, latest.digest), island.steps
        return latest, True

    def _wait(self, island: Island, pending: Pending, status: IslandStatus, why: str, fold: bool = True
              ) -> GlobalParams:
        """Folds in the exchange in flight, counting the wait as blocked time. Steps already dispatched are
        compute, not idling: the devices finish them before the clock starts (JAX dispatch is asynchronous, so
        the host reaches this point while they still run)."""
        if fold:
            jax.block_until_ready(island.state.step)
        t0 = time.perf_counter()
        anchor = self._fold_in(island, pending, status, fold)
        waited = time.perf_counter() - t0
        self.blocked_s += waited
        self.log.event("blocked", seconds=round(waited, 4), why=why, version=anchor.version, steps=island.steps)
        return anchor

    def _push(self, island: Island, anchor: GlobalParams, round_steps: int, round_start: tuple[int, int],
              status: IslandStatus, ckpt: Checkpointer) -> Pending:
        """Takes this round's Δ = θ_anchor − θ_local, starts its exchange and checkpoints the island."""
        span = self.telemetry.start_span("dtrain.exchange", island=self.island_id, name=self.name,
                                         base_version=anchor.version, steps=round_steps)
        local = self.hosts.gather(island.state.params)  # note: host sync (a gather across processes), once a round
        _, local_vec = codec.flatten(local)
        at_push = jax.tree.map(jnp.copy, island.state.params)  # kept: the state is donated by training
        header = pb.PushHeader(island_id=self.island_id, base_version=anchor.version,
                               push_id=f"{self.island_id}-{uuid.uuid4().hex[:12]}",
                               tokens=island.tokens - round_start[1], inner_steps=round_steps,
                               cursor_start=round_start[0], cursor_end=island.cursor, shard_index=island.index,
                               tree_digest=self.tree_digest)
        # Another process of the island sends nothing (process 0 pushes) and waits for the same θ'.
        frame, client = b"", self.client  # type: bytes, PushClient
        if self.hosts.leader:
            # Testing only (workers.inject): a push fault due now changes what is sent; otherwise _push_frame(Δ).
            frame, client = injected_push(self.injections, anchor.vec - local_vec, header, self._push_frame,
                                          self.client, self.up_bits, self.cfg.codec, self.log.event)
            self.frames_sent += 1
            self.frame_bytes += len(frame)
            self.telemetry.record_ratio(4 * self.n, len(frame), "up")
            self.telemetry.annotate(span, push_id=header.push_id, bytes=len(frame))
        exchange = Exchange(client, self.puller, frame, header, anchor, self.total_versions, self.stopping,
                            self.log.event, self.telemetry, span)
        status.exchange = exchange
        if self.hosts.leader:
            exchange.start()
        ckpt.save(island.steps, island.state, {"steps": island.steps, "cursor": island.cursor,
                                               "tokens": island.tokens, "version": anchor.version,
                                               "fingerprint": self.cfg.fingerprint()})
        return Pending(exchange, at_push)

    @staticmethod
    def _step_counter(island: Island) -> int:
        """The state's inner-step counter; the island's step where a failed computation took the state with it
        (a real device failure after dispatch: the donated buffers are gone)."""
        try:
            return int(island.state.step)
        except Exception:  # noqa: BLE001 - any runtime error reading a lost buffer
            return island.steps

    def _drain(self, island: Island, anchor: GlobalParams, pending: Pending | None,
               status: IslandStatus) -> GlobalParams:
        """Too few healthy devices: the island stops training. The exchange in flight is finished (a push the
        coordinator took stays merged); the progress since it is dropped. The island then stops heartbeating
        (no final heartbeat either): its lease runs out and the coordinator hands its shard, from the merged
        cursor, to the next island that needs data."""
        if pending is not None:
            anchor = self._wait(island, pending, status, "drain: finish the exchange in flight first", fold=False)
        assert self.health is not None
        self.log.event("drained", reason=self.drained, devices=len(self.health.healthy_ids), shard=island.index,
                       cursor=island.cursor, version=anchor.version)
        self.log.progress(f"{self.name}: drained: {self.drained}; the coordinator reroutes shard {island.index}")
        return anchor

    def _final_wait(self, island: Island, anchor: GlobalParams, pending: Pending | None,
                    status: IslandStatus) -> tuple[GlobalParams, bool]:
        """After the island's data: folds in the exchange still in flight, then waits for the run's last version
        (the coordinator says stop, or the known end version arrives); returns (θ, False). Returns (θ, True) as
        soon as the coordinator hands it more data (a rewind: its push was dropped or rejected, or it takes over
        a lost island's shard)."""
        if pending is not None:
            try:
                anchor = self._fold_in(island, pending, status)
            except CoordinatorError as e:
                if not self._stopped_after(e):
                    raise
                self.log.event("final_pull_failed", version=anchor.version, final_version=self.final_version,
                               error=str(e))
                return anchor, False
        # Other islands may still push (async mode, a slower island, a shard taken over): wait for the run's
        # last version, so every island ends on the same θ; give up if no new version arrives for a sync
        # round's grace (the longest a round waits for a quorum) plus two lease periods (a lost island's lease).
        patience = self.cfg.coordinator.grace_s + 2 * self.cfg.coordinator.lease_s
        last_progress = time.perf_counter()
        while True:
            self._evaluate_requested()
            if self.hosts.agree(bool(self.total_versions) and anchor.version >= self.total_versions):
                break
            if self._stopped():
                if self.hosts.agree(anchor.version >= self.final_version):
                    break
            else:
                with self._rewind_lock:
                    rewound = self._rewind is not None
                if self.hosts.agree(rewound):
                    return anchor, True
            try:
                g_new = self.pull(anchor, wait_s=FINAL_PULL_WAIT_S)
            except CoordinatorError as e:
                if not self._stopped_after(e):
                    raise
                # The run is over and the coordinator stopped serving before this island had the last version (its
                # linger_s ran out, or a pull was in flight as it stopped): it ends on the version it holds.
                if anchor.version < self.final_version:
                    self.log.event("final_pull_failed", version=anchor.version, final_version=self.final_version,
                                   error=str(e))
                break
            if g_new.version > anchor.version:
                anchor, last_progress = g_new, time.perf_counter()
                self._evaluate_requested()  # first: the heartbeat that reports the new version carries its eval
                status.held = (anchor.version, anchor.digest)
            elif self.hosts.agree(time.perf_counter() - last_progress > patience):
                self.log.event("final_wait_timeout", version=anchor.version, final_version=self.final_version)
                break
        return anchor, False

    def _run_over(self, reason: str) -> dict[str, Any]:
        """The run ended before this island joined: nothing to train."""
        self.client.close()
        return _report_run_over(self.log, self.name, reason)

    def _finish(self, island: Island, g: GlobalParams, status: IslandStatus, rounds: int, t_start: float,
                final_wait: float) -> dict[str, Any]:
        """The final heartbeat, eval and summary (``t_start``: when :meth:`run` began)."""
        final_digest = g.digest or params_digest(g.vec)  # verified on arrival, unless it came another way
        final_eval = float("nan")
        active_s = self._active_s
        if not self.drained:  # a drained island lets its lease run out (its shard is then rerouted)
            self._evaluate_requested()  # the final version's eval, if asked, goes with the final heartbeat
            evals = self._pending_evals()
            try:  # best effort, one try: tell the coordinator this island holds the final version (process 0)
                if self.hosts.leader:
                    self.client.heartbeat(budget_s=0.0, island_id=self.island_id, version=g.version,
                                          steps=island.steps, tokens=island.tokens, params_digest=final_digest,
                                          train_loss=_finite_or_none(status.latest_loss(block=True)),
                                          utilization=self._utilization(), evals=evals,
                                          **_chip_report(self._evidence(), self.loop.mesh.devices.size))
                    self._evals_answered(evals)
            except CoordinatorError as e:
                self.log.event("heartbeat_failed", error=str(e))
            final_eval = self._eval_loss(g)
        summary = {
            "island": self.name, "island_id": self.island_id, "shard": island.index, "steps": island.steps,
            "tokens": island.tokens, "cursor": island.cursor, "rounds": rounds, "version": g.version,
            "final_eval_loss": final_eval, "params_digest": final_digest,
            "bytes_up": self.client.bytes_up, "bytes_down": self.client.bytes_down,
            "compression_ratio": (4.0 * self.n * self.frames_sent / self.frame_bytes) if self.frame_bytes else 0.0,
            "utilization": self._utilization(),
            "blocked_s": self.blocked_s, "eval_s": self.eval_s, "final_wait_s": final_wait, "active_s": active_s,
            "wall_s": time.perf_counter() - t_start, "retries": self.client.retries, "overlap": self.cfg.worker.overlap,
            "total_versions": self.final_version or self.total_versions, "fingerprint": self.cfg.fingerprint(),
            "devices": self.loop.mesh.devices.size, "nan_rollbacks": self.nan_rollbacks,
            "quarantined": list(self._evidence()),
            **({"drained": self.drained} if self.drained else {}),
        }
        self.log.event("island_finished", **summary)
        self.log.write_summary(summary)
        if not self.drained:
            self.log.progress(f"{self.name}: done v{g.version}, eval loss {final_eval:.4f}, "
                              f"utilization {summary['utilization']:.3f}")
        self.telemetry.shutdown()
        self.log.close()
        self.client.close()
        return summary


def _finite_or_none(x: float | None) -> float | None:
    """A heartbeat's train loss: None (not sent) unless finite (a diverging chunk's loss is the NaN guard's)."""
    return x if x is not None and math.isfinite(x) else None


def _chip_report(quarantined: tuple[Evidence, ...], devices: int) -> dict[str, Any]:
    """A heartbeat's chip-health fields: the whole report every time (the coordinator keeps each device's first
    evidence; ``bad_devices`` must name the same devices as the evidence)."""
    return {"bad_devices": [str(e["device"]) for e in quarantined], "quarantined": quarantined, "devices": devices}


def run_over_already(client: CoordinatorClient, cfg: Config, run_dir: Path,
                     say: Callable[[str], None] = lambda line: None) -> str:
    """Why an island has nothing to train, asked before any slow start-up: the coordinator says the run is
    over (one Status call, no retries), or it does not answer and the island's own summary.json records that
    it finished the run (same model and codecs). '' otherwise: then Join decides (and retries). ``say``: told
    when the coordinator does not answer and the island goes on building (a worker would otherwise be silent
    for its whole compile)."""
    try:
        status = client.status(budget_s=0.0)
    except CoordinatorError as e:
        status = None
        say(f"the coordinator at {client.address} does not answer yet ({cause(e.code, e.details)}); building "
            f"the island meanwhile, then joining (retried for up to {cfg.worker.retry_total_s:g}s)")
    if status is not None:
        over = status.run_over or f"the run is over: {status.version} versions merged"
        return f"{over} (coordinator at {client.address})" if status.stopped else ""
    try:
        done = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    total = done.get("total_versions") if isinstance(done, dict) else None
    if isinstance(total, int) and total > 0 and done.get("version") == total \
            and done.get("fingerprint") == cfg.fingerprint():
        return (f"this island finished the run (version {total} of {total}, {run_dir / 'summary.json'}) and "
                f"the coordinator at {client.address} does not answer: the run is over (remove summary.json to "
                f"start a new run in this folder)")
    return ""


def _report_run_over(log: RunLog, name: str, reason: str) -> dict[str, Any]:
    """One event, one progress line, and what :func:`run_worker` returns for a run that is over."""
    log.event("run_over", reason=reason)
    log.progress(f"{name}: {reason}: nothing to do")
    log.close()
    return {"island": name, "run_over": reason}


def run_worker(cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False,
               inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
               hosts: HostGroup | None = None) -> dict[str, Any]:
    """Runs one island to the end of the run; returns its summary, or ``{"island", "run_over"}`` (exit 0, no
    training) when the run is over already: checked first, before the island builds or compiles anything.
    ``inject``: push faults; ``device_fault``: a faulty device in the island (testing only: :mod:`workers.inject`);
    ``hosts``: this process's place in an island of several processes (:mod:`workers.hosts`)."""
    hosts = hosts or HostGroup.single()
    t0 = time.time()
    client = CoordinatorClient(address, cfg)
    try:
        def say(line: str) -> None:  # before the island's RunLog exists
            if not quiet and hosts.leader:
                print(progress_line(time.time() - t0, f"{name}: {line}"), file=sys.stderr, flush=True)

        over = hosts.lead(lambda: run_over_already(client, cfg, Path(run_dir), say))  # process 0 asks
    finally:
        client.close()
    if over:
        return _report_run_over(RunLog(process_dir(Path(run_dir), hosts.index), quiet=quiet or not hosts.leader),
                                name, over)
    worker = Worker(cfg, address, name, run_dir, quiet=quiet, inject=inject, device_fault=device_fault,
                    hosts=hosts)
    try:
        return worker.run()
    finally:
        worker.stopping.set()
        worker.telemetry.shutdown()  # flushes (idempotent: a finished run's was shut down already)
        if worker.ckpt is not None:
            try:
                worker.ckpt.close()  # its async writer thread would otherwise keep a failed process alive
            except Exception as e:  # noqa: BLE001 - already failing; the original error is what matters
                worker.log.event("checkpoint_close_failed", error=str(e))
