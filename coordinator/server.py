"""The coordinator's gRPC servicer: a thin adapter over ``state`` (decisions) and ``merger`` (math).

One lock serializes every state change and every touch of the merger (its pending pushes and state files);
receiving, spooling and validating a pushed frame happen outside it, so many
islands can stream at once. The lock is a condition, notified on every change: a background thread
sleeps on it until the state's next deadline (a lease expiry, a round's grace end, the linger after
the run) or a change, then expires leases, closes rounds whose grace has passed and notes when the
run is finished; long-polling pulls and :func:`run_coordinator` wait on it too. After each merge the
whole coordinator (θ, outer momentum, down residual, membership, cursors, applied push ids) is
checkpointed with orbax, atomically.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import math
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, ParamSpec, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.dashboard import Dashboard, check_port_free, dashboard_port, open_dashboard
from coordinator.history import RunHistory, check_eval_reports
from coordinator.merger import MergeOptions, Merger, NonFiniteResult
from coordinator.state import CoordinatorState, DeviceEvidence, PushInfo, StateError, StateOptions
from dtrain import codec
from dtrain.config import Config
from dtrain.errors import CheckpointError, DtrainError
from dtrain.proto import dtrain_pb2 as pb
from dtrain.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.runlog import RunLog
from dtrain.telemetry import RoundSpans, Telemetry, require_exporter, status_gauges
from dtrain.wire import (
    HANDLER_KINDS,
    MAX_EVAL_REPORTS,
    RUN_OVER_METADATA_KEY,
    SERVICE,
    AuthDenied,
    FrameReceiver,
    RawChunk,
    TokenAuthInterceptor,
    WireError,
    channel_options,
    chunk_count,
    chunk_deserializer,
    file_chunk_messages,
    keepalive_options,
    max_frame_bytes,
    read_token,
    serialize,
    server_credentials,
)

if TYPE_CHECKING:
    from dtrain.checkpoint import Checkpointer

P = ParamSpec("P")
R = TypeVar("R")

MAX_PULL_WAIT_S = 30.0
# `dtrain coordinator --after-finish`: what the coordinator does once its run is finished (CoordinatorService)
AfterFinish = Literal["exit", "serve"]
DEAF_S = 0.5  # the ticker woke this much past a deadline: the lock was busy; leases are paused for that time
_STATUS = {"accept": pb.PUSH_STATUS_PENDING, "duplicate": pb.PUSH_STATUS_DUPLICATE, "drop": pb.PUSH_STATUS_DROPPED,
           "reject": pb.PUSH_STATUS_REJECTED}
_ACTIONS = {"continue": pb.ACTION_CONTINUE, "pull": pb.ACTION_PULL, "stop": pb.ACTION_STOP,
            "rejoin": pb.ACTION_REJOIN}
_CODES = {"INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
          "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION, "NOT_FOUND": grpc.StatusCode.NOT_FOUND}
_MEASURES = ("value", "expected", "z", "median", "mismatches")  # DeviceEvidence's optional numbers
# A refusal with one of these codes is a bad request (malformed, over a bound, not matching the run): a
# `request_invalid` event; other refusals (an unknown island, a failed coordinator) are `request_rejected`.
_BAD_REQUEST = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})
AUTH_EVENT_S = 10.0  # `auth_failed`: at most one event per peer host this often; the calls in between are counted
MAX_AUTH_HOSTS = 1024  # hosts tracked for that; beyond them, the rest share one count ("other hosts")
# The RPC this thread serves: its method and island (set by service_handler's wrapper), for _abort's events.
_CALL = threading.local()


def evidence_from_message(e: pb.DeviceEvidence) -> dict[str, Any]:
    """A DeviceEvidence message as the plain data ``CoordinatorState.heartbeat`` checks: the numbers the probe did
    not measure (unset optional fields) left out."""
    data: dict[str, Any] = {"device": e.device, "index": e.index, "probe": e.probe, "step": e.step,
                            "detail": e.detail}
    data.update({name: getattr(e, name) for name in _MEASURES if e.HasField(name)})
    return data


def evidence_to_message(e: DeviceEvidence) -> pb.DeviceEvidence:
    """A recorded device's evidence for Status: numbers the probe did not measure stay unset."""
    return pb.DeviceEvidence(**{k: v for k, v in dataclasses.asdict(e).items() if v is not None})




def fingerprint_mismatch(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """Names every field that differs, e.g. ``model.d_model: coordinator 64, island 32``; '' if equal."""
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            diffs.append(f"{key}: coordinator {ours.get(key, '<missing>')}, island {theirs.get(key, '<missing>')}")
    return "; ".join(diffs)


def has_checkpoint(cfg: Config, run_dir: str | Path) -> bool:
    """Whether RUN_DIR holds a coordinator checkpoint to resume from (good or not: resuming tries each); what
    ``dtrain coordinator --resume=auto`` asks at every start of a restarted Deployment."""
    ckpt_dir = Path(run_dir) / "coordinator"
    return cfg.coordinator.checkpoint and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, cfg: Config, run_dir: str | Path, theta: np.ndarray | Path | None, spec: codec.Spec,
                 clock: Callable[[], float] = time.time, resume: bool = False, quiet: bool = False,
                 after_finish: AfterFinish = "exit"):
        """``after_finish``: what a finished run does (``dtrain coordinator --after-finish``): ``exit`` (health
        NOT_SERVING once finished, :meth:`wait_finished` returns) or ``serve`` (it keeps serving, health SERVING,
        until :meth:`request_stop`: :meth:`wait_stop_requested`)."""
        self.after_finish = after_finish
        self.cfg = cfg
        self.clock = clock
        self.run_dir = Path(run_dir)
        ckpt_dir = self.run_dir / "coordinator"
        if resume and not has_checkpoint(cfg, self.run_dir):
            raise CheckpointError(f"--resume: no coordinator checkpoint in {ckpt_dir}")  # before anything is written
        require_exporter(cfg.telemetry)  # a missing extra, before anything is written
        self.log = RunLog(self.run_dir, quiet=quiet, logger="dtrain.coordinator")
        # The view Status and the dashboard show: a fold over this run's events (a resume reads back the earlier
        # coordinator's), then over each event as it is logged.
        self.history = RunHistory()
        if resume:
            self.history.replay(self.run_dir)
        self.log.subscribe(self.history.observe)
        self.started_at = clock()
        self._push_bytes: dict[str, int] = {}  # frame bytes of each push pending in the open round
        n = cfg.coordinator.max_receiving
        self._receiving = threading.BoundedSemaphore(n) if n > 0 else None  # see PushDelta
        self.streams = FrameStreams()
        self.pull_piece = pull_piece(cfg)
        self.spec = spec
        self.tree_digest = codec.spec_digest(spec)
        self.fingerprint_fields = cfg.fingerprint_fields()
        self.lock = threading.Condition(threading.RLock())  # notified on every change of state (see the docstring)
        self.opts = StateOptions.from_config(cfg)
        if cfg.coordinator.checkpoint:
            from dtrain.checkpoint import Checkpointer  # orbax (and so JAX): only when checkpointing

            # Synchronous: a save hard-links the version's θ/momentum files (FileArraysHandler), O(1).
            self.ckpt: Checkpointer | None = Checkpointer(ckpt_dir, keep=2, async_save=False)
        else:
            self.ckpt = None
        self.loaded_at = clock()  # the state's time of loading: a restored state's leases run from it
        try:
            self._load_state(theta, resume, self.loaded_at)
        except BaseException:  # nothing served yet: release what was opened, leave the checkpoint as it was
            if self.ckpt is not None:
                self.ckpt.close()
            self.log.close()
            raise
        self.max_frame = max_frame_bytes(self.merger.n, cfg.codec.block)
        self.bytes_in = 0
        self.bytes_out = 0
        self.merge_s = 0.0
        # Pushes refused: by the state machine (bad header, a weight over its bound, ...) or for a bad payload.
        self.pushes_refused = 0
        self.fatal: str | None = None  # why the service failed; it then refuses pushes and run_coordinator exits
        # auth_failed events, per peer host: (time.monotonic() of its last event, calls refused since, the last
        # call's peer, method and reason)
        self._auth_failures: dict[str, tuple[float, int, str, str, str]] = {}
        self._auth_lock = threading.Lock()
        self.finished: str | None = None  # why the service may stop serving (the state's decision, or a signal)
        self.stop_requested: str | None = None  # why request_stop was called (a signal), if it was
        self._closing = False
        # grpc.health.v1 (registered by serve()): SERVING until the run is over (after_finish="serve": until asked
        # to stop), the service failed, or it stops.
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._serving: bool | None = None  # what the health service says now (None: nothing yet)
        self.telemetry = Telemetry(cfg.telemetry, "coordinator", "coordinator", self.run_id)
        self.rounds = RoundSpans(self.telemetry)
        status_gauges(self.telemetry, self.status_message)
        self.log.subscribe(self.telemetry.on_event)
        self.dashboard: Dashboard | None = None  # the live view (coordinator/dashboard.py), opened by serve()
        self._ticker = threading.Thread(target=self._tick_loop, name="coordinator-tick", daemon=True)
        self._ticker.start()

    def _load_state(self, theta: np.ndarray | Path | None, resume: bool, now: float) -> None:
        """θ_0 for a new run (``theta``, required then), or everything from the newest good checkpoint.

        Resuming, checkpoints are tried newest first; one that cannot be restored (a corrupt or missing state
        file or metadata, a save that did not finish, a state that does not fit this config) is skipped, and
        once a good one is found each skipped one is set aside (``Checkpointer.set_aside``) with a
        ``checkpoint_skipped`` event and a progress line. If none is good, CheckpointError names each and why."""
        if not resume:
            if theta is None:
                raise ValueError("a new coordinator run needs θ_0")
            self.run_id = uuid.uuid4().hex[:12]
            self.state = CoordinatorState(self.opts, self.run_id, now)
            self.merger = self._merger(theta, 0, None, None)
            return
        assert self.ckpt is not None, "__init__ refuses resume without a coordinator checkpoint"
        skipped: list[tuple[int, str]] = []
        for step in self.ckpt.steps():
            try:
                self._restore(step, now)
                break
            except (CheckpointError, StateError) as e:
                skipped.append((step, " ".join(str(e).split())))  # one line, whatever the underlying error
        else:
            reasons = "; ".join(f"checkpoint {step}: {why}" for step, why in skipped)
            raise CheckpointError(f"--resume: no good coordinator checkpoint in {self.ckpt.directory}: {reasons}")
        for step, why in skipped:
            moved = self.ckpt.set_aside(step)
            self.log.event("checkpoint_skipped", step=step, reason=why, moved_to=str(moved))
            self.log.progress(f"skipped checkpoint {step}: {why} (moved to {moved})")
        self.log.event("coordinator_resumed", version=self.state.version,
                       skipped=[step for step, _ in skipped])
        if skipped:
            self.log.progress(f"resumed from checkpoint {self.state.version}")

    def _merger(self, theta: np.ndarray | Path, version: int, momentum: Path | None, residual: Path | None) -> Merger:
        try:
            return Merger(theta, MergeOptions.from_config(self.cfg), version=version, momentum=momentum,
                          residual=residual, spool_dir=self.run_dir / "spool")
        except ValueError as e:  # a θ/momentum/residual of the wrong size
            raise CheckpointError(f"coordinator state does not match this config's model: {e}") from None

    def _restore(self, step: int, now: float) -> None:
        """The state and merger from checkpoint ``step``, or CheckpointError / StateError saying what is wrong."""
        assert self.ckpt is not None
        version, files, meta = self.ckpt.restore_files(step)
        missing = {"theta", "momentum"} - set(files)
        if missing:
            raise CheckpointError(f"checkpoint {version} lacks {sorted(missing)}: not a coordinator checkpoint")
        if meta.get("version", version) != version or "state" not in meta:
            raise CheckpointError(f"checkpoint {version}: its metadata records version {meta.get('version')} "
                                  f"and {'a' if 'state' in meta else 'no'} coordinator state")
        state = CoordinatorState.from_json(self.opts, meta["state"], now)
        # Files inside the checkpoint: linked into the merger's state folder, not read into memory.
        merger = self._merger(files["theta"], version, files["momentum"], files.get("residual"))
        tree_size = codec.spec_size(self.spec)
        problem = ""
        if merger.n != tree_size:
            problem = f"checkpoint {version} holds {merger.n} parameters, this config's model has {tree_size}"
        elif merger.digest != meta.get("params_digest"):
            problem = (f"checkpoint {version}: θ digest {merger.digest} differs from the recorded "
                       f"{meta.get('params_digest')}")
        if problem:
            merger.close()
            raise CheckpointError(problem)
        self.state, self.run_id, self.merger = state, state.run_id, merger

    # -- helpers ------------------------------------------------------------------------------------

    def _abort(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        """Ends the call with ``code``; every refusal goes through here and is an event naming the method and the
        island (from the request: service_handler notes them): ``request_invalid`` for a bad request
        (:data:`_BAD_REQUEST`), ``request_rejected`` for the others."""
        kind = "request_invalid" if code in _BAD_REQUEST else "request_rejected"
        with self.lock:  # reentrant; the event's listeners (history, telemetry) are updated under the lock
            self.log.event(kind, method=getattr(_CALL, "method", ""), island=getattr(_CALL, "island", ""),
                           code=code.name, error=message)
        context.abort(code, message)

    def auth_failed(self, peer: str, method: str, why: str) -> None:
        """A call refused for its token (:class:`dtrain.wire.TokenAuthInterceptor`'s ``on_denied``): an
        ``auth_failed`` event {peer, method, reason, count} and a progress line, at most one per peer host every
        AUTH_EVENT_S, so a flood of bad calls cannot fill the disk: ``count`` is the calls refused from that host
        since its last event, this one included (the rest are written by :meth:`close`)."""
        host = peer_host(peer)
        now = time.monotonic()
        with self._auth_lock:
            if host not in self._auth_failures and len(self._auth_failures) >= MAX_AUTH_HOSTS:
                host = "other hosts"
            last, count, _, _, _ = self._auth_failures.get(host, (float("-inf"), 0, "", "", ""))
            if now - last < AUTH_EVENT_S:
                self._auth_failures[host] = (last, count + 1, peer, method, why)
                return
            self._auth_failures[host] = (now, 0, peer, method, why)
        self._report_auth_failed(peer, method, why, count + 1)

    def _report_auth_failed(self, peer: str, method: str, why: str, count: int) -> None:
        with self.lock:  # the event's listeners (history, telemetry) are updated under the lock
            self.log.event("auth_failed", peer=peer, method=method, reason=why, count=count)
        self.log.progress(f"refused {count} call{'s' * (count != 1)} from {peer} without the right token ({why}; "
                          f"last: {method.rsplit('/', 1)[-1]})")

    def _decide(self, context: grpc.ServicerContext, decision: Callable[P, R], *args: P.args,
                **kwargs: P.kwargs) -> R:
        """Calls a state-machine method; a refusal (StateError) becomes the gRPC status its code names."""
        try:
            return decision(*args, **kwargs)
        except StateError as e:
            self._abort(context, _CODES[e.code], str(e))
            raise  # unreachable: abort raises

    def _decide_push(self, context: grpc.ServicerContext, decision: Callable[P, R], info: PushInfo, *args: P.args,
                     **kwargs: P.kwargs) -> R:
        """:meth:`_decide` for a push: a refusal is also counted and is a ``push_refused`` event (the caller
        holds the lock)."""
        try:
            return decision(*args, **kwargs)
        except StateError as e:
            self.pushes_refused += 1
            self.log.event("push_refused", island=info.island_id, push_id=info.push_id, code=e.code,
                           tokens=info.tokens, cursor=[info.cursor_start, info.cursor_end], reason=str(e))
            self.log.progress(f"refused push {info.push_id} from {info.island_id}: {e}")
            self._abort(context, _CODES[e.code], str(e))
            raise  # unreachable: abort raises

    def _refuse_payload(self, context: grpc.ServicerContext, info: PushInfo, code: grpc.StatusCode,
                        message: str) -> NoReturn:
        """Refuses a push whose payload is bad (a broken chunk stream, a frame that does not validate): counted,
        a ``push_refused`` event naming the push, and the call ends with ``code``."""
        with self.lock:
            self.pushes_refused += 1
        self.log.event("push_refused", island=info.island_id, push_id=info.push_id, code=code.name,
                       tokens=info.tokens, cursor=[info.cursor_start, info.cursor_end], reason=message)
        self.log.progress(f"refused push {info.push_id} from {info.island_id}: {message}")
        self._abort(context, code, message)

    def _upload_broke(self, context: grpc.ServicerContext, info: PushInfo, received: int, chunks: int) -> NoReturn:
        """A push whose stream ended before its last chunk: the client cancelled the call, lost its connection or
        closed the stream early. Nothing was admitted and the partial spool is discarded as it closes; a
        ``push_aborted`` event. The call ends with INVALID_ARGUMENT (a cancelled caller never sees it); the
        island may send the whole push again under the same push_id."""
        reason = (f"push {info.push_id}: stream truncated: got {received} of {chunks} chunks (the upload was "
                  f"cancelled, cut or closed early); the partial frame is discarded, nothing was applied")
        self.log.event("push_aborted", island=info.island_id, push_id=info.push_id, chunks_received=received,
                       chunks=chunks, reason=reason)
        self.log.progress(f"push {info.push_id} from {info.island_id}: upload broke off after {received} of "
                          f"{chunks} chunks; discarded")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        raise AssertionError("unreachable: abort raises")

    def _refuse_if_failed(self, context: grpc.ServicerContext) -> None:
        if self.fatal:  # the process is on its way out: nothing more may touch the merger
            self._abort(context, grpc.StatusCode.UNAVAILABLE, f"coordinator failed: {self.fatal}")

    def _maybe_merge_locked(self, now: float) -> None:
        if self.fatal:
            return
        ready, reason = self.state.round_ready(now)
        if not ready:
            return
        t0 = time.perf_counter()
        round_span = self.rounds.ready(self.state.version + 1, reason)
        pending = self.state.pending()
        try:
            with self.telemetry.span("dtrain.merge", parent=round_span, version=self.state.version + 1,
                                     pushes=len(pending)):
                update = self.merger.outer_step()
        except NonFiniteResult as e:
            # Not fatal: nothing was committed. The push to blame is rejected (its island is told in its heartbeat
            # replies) and the round is tried again without it, here, if it is still ready.
            version = self.state.version + 1
            (info,) = self.state.reject_pending([e.blame], str(e))
            self.merger.drop_pending([e.blame])
            self._push_bytes.pop(e.blame, None)
            self.log.event("merge_rejected", version=version, island=info.island_id, push_id=info.push_id,
                           what=e.what, reason=str(e))
            self.log.progress(f"v{version}: not committed, rejected push {info.push_id} from {info.island_id}: {e}")
            self.lock.notify_all()
            self._maybe_merge_locked(now)
            return
        except BaseException as e:
            # A failed step (a full disk, say) stops the service. The step only commits at its end, so the
            # previous version's files and the pending spools are intact, but a disk that just failed is not
            # retried blindly: `dtrain coordinator --resume` restarts from the last checkpoint, and the islands
            # push the open round again (HeartbeatResponse.push_unknown).
            self.fatal = f"outer step for version {self.state.version + 1} failed: {type(e).__name__}: {e}"
            self.log.event("coordinator_failed", error=self.fatal)
            self.lock.notify_all()  # wakes run_coordinator
            raise
        version, merged, close_reason = self.state.close_round(now)
        assert version == update.version, (version, update.version)
        # Logged before the checkpoint: a coordinator killed between the two resumes at the previous version,
        # and its coordinator_resumed event tells a reader (dtrain.audit) that this merge was rolled back; the
        # other order would leave a checkpointed version with no record of what went into it.
        self.log.event("round_merged", version=version, reason=f"{reason}; {close_reason}",
                       pushes=[{"island": i.island_id, "push_id": i.push_id, "tokens": i.tokens,
                                "shard": i.shard_index, "start": i.cursor_start, "end": i.cursor_end,
                                "steps": i.inner_steps, "bytes": self._push_bytes.pop(i.push_id, 0),
                                "weight": a.weight, "staleness": a.staleness, "norm": a.norm, "scale": a.scale}
                               for i, a in pending],
                       update_bytes=update.size, params_digest=update.params_digest,
                       merge_s=round(time.perf_counter() - t0, 6))
        if self.ckpt is not None:  # links the new version's files: no copy of θ or momentum
            with self.telemetry.span("dtrain.checkpoint", parent=round_span, version=version):
                self.ckpt.save_files(version, self.merger.state_files(),
                                     {"state": self.state.to_json(), "version": version,
                                      "params_digest": self.merger.digest})
        self.merge_s += time.perf_counter() - t0
        self.telemetry.record_ratio(4 * self.merger.n, update.size, "down")
        self.rounds.close(version, pushes=len(pending), tokens=sum(i.tokens for i, _ in pending),
                          islands=sorted({i.island_id for i, _ in pending}), update_bytes=update.size)
        self.log.progress(f"v{version}: merged {len(merged)} deltas ({reason})")
        self.streams.trim()  # the step's slabs, the merged spools' buffers
        self.lock.notify_all()  # wakes long-polling pulls and the ticker (the run may be over)

    def _tick_loop(self) -> None:
        """The service's clock: expires leases, closes rounds whose grace has passed, notes when the run is
        finished. Sleeps until the state's next deadline, or until a join, heartbeat or push notifies the
        lock (which may move that deadline, or finish the run)."""
        try:
            with self.lock:
                deadline: float | None = None
                while not self._closing:
                    now = self.clock()
                    if deadline is not None and now - deadline > DEAF_S:
                        # The lock was held past the deadline (a long merge): heartbeats waited on it unheard.
                        self.state.pause_leases(now - deadline)
                        self.log.event("leases_paused", seconds=round(now - deadline, 3))
                    for island_id, reason in self.state.expire(now):
                        self.log.event("island_lost", island=island_id, reason=reason)
                        self.log.progress(f"lost {island_id}: {reason}")
                    self._maybe_merge_locked(now)
                    done, why = self.state.finished(now)
                    if done and self.finished is None:
                        self.finished = why
                        self.lock.notify_all()  # wakes run_coordinator
                    self._set_health()
                    deadline = self.state.next_deadline(now)
                    self.lock.wait(None if deadline is None else max(0.0, deadline - now))
                    if deadline is not None and self.clock() < deadline:
                        deadline = None  # woken early, by a notification: not late for anything
        except BaseException as e:  # the coordinator cannot run without it: make it fatal, not silent
            with self.lock:
                if self.fatal is None:
                    self.fatal = f"{type(e).__name__}: {e}"
                    self.log.event("coordinator_failed", error=self.fatal)
                self.lock.notify_all()
                self._set_health()
            raise

    def _set_health(self) -> None:
        """grpc.health.v1: SERVING while the coordinator serves, including after the run's last version while it
        lingers for the islands' last pulls (a readiness probe must keep routing them here); NOT_SERVING once it is
        finished, failed or asked to stop (the ticker calls this on every change). With ``after_finish="serve"``
        a finished run still serves (late islands get its final θ or its end, Status its record), so it stays
        SERVING until it fails or is asked to stop: a liveness probe must not restart it, nor readiness hide it."""
        finished = self.stop_requested if self.after_finish == "serve" else self.finished
        serving = not (finished or self.fatal or self._closing)
        if serving == self._serving:
            return  # unchanged: a Watch hears of changes only
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):  # "": the server as a whole (what a Kubernetes gRPC probe asks by default)
            self.health.set(name, status)

    def wait_finished(self) -> str:
        """Blocks until the service may stop, and says why: the state machine found the run finished (the
        ticker notes it), :meth:`request_stop` was called, or the service failed (then :attr:`fatal` is set).
        Woken by the lock's notifications, not by polling."""
        with self.lock:
            self.lock.wait_for(lambda: self.finished is not None or self.fatal is not None)
            return f"failed: {self.fatal}" if self.fatal else str(self.finished)

    def request_stop(self, reason: str) -> None:
        """Ends :meth:`wait_finished` (and :meth:`wait_stop_requested`) with ``reason``. Safe in a signal handler
        of the waiting thread: the lock is reentrant, and the wait has released it."""
        with self.lock:
            if self.finished is None:
                self.finished = reason
            if self.stop_requested is None:
                self.stop_requested = reason
                self._set_health()
            self.lock.notify_all()

    def wait_stop_requested(self) -> str:
        """Blocks until :meth:`request_stop` is called or the service fails, and says why (``after_finish="serve"``:
        how a finished run's coordinator ends)."""
        with self.lock:
            self.lock.wait_for(lambda: self.stop_requested is not None or self.fatal is not None)
            return f"failed: {self.fatal}" if self.fatal else str(self.stop_requested)

    # -- RPCs ---------------------------------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        diff = fingerprint_mismatch(self.fingerprint_fields, dict(request.fingerprint_fields))
        if diff:
            self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"config fingerprint mismatch: {diff}")
        if len(request.device_kind) > 128:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"device_kind: {len(request.device_kind)} characters, at most 128")
        with self.lock:
            if self.state.stopped():  # the refusal below says why; this tells the island's client to exit 0
                context.set_trailing_metadata(((RUN_OVER_METADATA_KEY, str(self.state.version)),))
            record, reason = self._decide(context, self.state.join, request.island, request.hardware,
                                          request.devices, self.clock())
            cursor = self.state.shard_cursor(record.shard_index)
            version = self.state.version
            view = self.history.island(record.island_id)
            view.device_kind, view.last_seen = request.device_kind, self.clock()
            self.lock.notify_all()  # a new lease: the ticker's next deadline may be sooner
        self.log.event("island_joined", island=record.island_id, name=record.name, shard=record.shard_index,
                       cursor=cursor, hardware=record.hardware, devices=record.devices,
                       device_kind=request.device_kind, reason=reason)
        self.log.progress(f"{record.island_id} joined: shard {record.shard_index}, cursor {cursor} ({reason})")
        return pb.JoinResponse(island_id=record.island_id, version=version, shard_index=record.shard_index,
                               shard_count=self.opts.islands, cursor=cursor, lease_s=self.opts.coordinator.lease_s,
                               run_id=self.run_id, tree_size=self.merger.n, tree_digest=self.tree_digest,
                               total_versions=self.opts.end_version)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        # The reports the state machine does not judge, checked first: a refused heartbeat changes nothing.
        if request.HasField("train_loss") and not (math.isfinite(request.train_loss) and request.train_loss >= 0):
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"train_loss={request.train_loss}: must be a finite number >= 0 (or absent)")
        if not 0.0 <= request.utilization <= 1.0:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"utilization={request.utilization}: must be in [0, 1]")
        evals = [(e.version, e.loss) for e in request.evals[:MAX_EVAL_REPORTS + 1]]
        with self.lock:
            problem = check_eval_reports(evals, self.state.version)
        if problem:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        with self.lock:
            record = self.state.islands.get(request.island_id)
            known = len(record.quarantined) if record is not None else 0  # the record's list only grows
            action, reason = self._decide(
                context, self.state.heartbeat, request.island_id, request.version, request.steps, request.tokens,
                request.steps_per_s, request.params_digest, tuple(request.bad_devices), self.clock(),
                quarantined=[evidence_from_message(e) for e in request.quarantined], devices=request.devices)
            new = record.quarantined[known:] if record is not None else ()
            healthy, name = (record.devices, record.name) if record is not None else (0, "")
            version = self.state.version
            self.lock.notify_all()  # the island's version may finish the run
            if request.params_digest and request.version == version and request.params_digest != self.merger.digest:
                self.log.event("digest_mismatch", island=request.island_id, version=version)
            unknown = bool(request.pending_push_id) and not self.state.push_known(request.pending_push_id)
            view = self.history.island(request.island_id)
            view.utilization, view.last_seen = request.utilization, self.clock()
            if request.HasField("train_loss"):
                view.train_loss = request.train_loss
            recorded = [(v, loss, self.history.tokens_merged_at(v)) for v, loss in evals
                        if self.history.eval_report(request.island_id, v, loss)]
        for v, loss, tokens in recorded:  # the history folds each in (RunLog.subscribe)
            self.log.event("eval", version=v, loss=loss, tokens=tokens, island=request.island_id, name=name)
            self.log.progress(f"v{v}: global eval loss {loss:.4f} ({tokens:,} tokens; evaluated by "
                              f"{request.island_id})")
        for e in new:  # once per (island, device): a later report naming it again adds nothing to the record
            self.log.event("device_quarantined", island=request.island_id, name=name, **e.to_json(), healthy=healthy)
            self.log.progress(f"{request.island_id} quarantined device {e.device} (mesh index {e.index}; {e.probe} "
                              f"probe, step {e.step}): {e.detail}")
        return pb.HeartbeatResponse(action=_ACTIONS[action], version=version, lease_s=self.opts.coordinator.lease_s,
                                    reason=reason, push_unknown=unknown)

    def PushDelta(self, request_iterator: Iterator[pb.PushMessage | RawChunk],
                  context: grpc.ServicerContext) -> pb.PushDeltaResponse:
        first = next(request_iterator, None)  # chunks arrive as RawChunk (wire.chunk_deserializer)
        if first is None or isinstance(first, RawChunk) or first.WhichOneof("kind") != "header":
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a push must start with a PushHeader")
        h = first.header
        # Checked here, not by the state machine: whether a payload fits the model's parameter tree is a
        # property of the merger's θ (like Join's config fingerprint); the state machine holds membership,
        # versions and cursors, and admits a push on those alone.
        if h.tree_digest != self.tree_digest:
            self._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"header tree_digest {h.tree_digest!r} does not match the coordinator's "
                        f"{self.tree_digest!r}: the model's parameter tree differs")
        info = PushInfo(push_id=h.push_id, island_id=h.island_id, base_version=h.base_version, tokens=h.tokens,
                        inner_steps=h.inner_steps, cursor_start=h.cursor_start, cursor_end=h.cursor_end,
                        shard_index=h.shard_index)
        with self.lock:
            self._refuse_if_failed(context)
            # A preview, to refuse the push (an unknown island is NOT_FOUND) before its payload streams in.
            admission = self._decide_push(context, self.state.admit_push, info, info, self.clock())
            if admission.status == "duplicate":  # a retry of a push already received: nothing to receive
                admission = self.state.commit_push(info, self.clock())  # counts the retry
                version = self.state.version
                cursor = self._cursor(info)
        if admission.status == "duplicate":
            self.log.event("push_duplicate", island=info.island_id, push_id=info.push_id)
            return pb.PushDeltaResponse(status=pb.PUSH_STATUS_DUPLICATE, merged_version=admission.target_version,
                                        version=version, reason=admission.reason, cursor=cursor)
        # Its round's span (an accepted preview starts it); a push to be dropped or rejected is a trace of its own.
        round_span = self.rounds.open(admission.target_version) if admission.status == "accept" else None
        try:
            receiver = FrameReceiver(h.total_bytes, h.chunks, h.frame_crc32, self.max_frame,
                                     self.cfg.codec.chunk_bytes)
        except WireError as e:
            self._abort(context, e.code, str(e))
        with self.merger.spool() as spool:
            # At most coordinator.max_receiving frames stream in and decode at once: each holds a zstd decoder and
            # chunk buffers (a few MiB); the others wait here, their data held back by gRPC's flow control.
            if self._receiving is not None:
                self._receiving.acquire()
            receive = self.telemetry.start_span("dtrain.receive", parent=round_span, island=info.island_id,
                                                push_id=info.push_id, version=admission.target_version,
                                                preview=admission.status)
            self.streams.begin()  # counted from here to the finally below: nothing between them can raise
            try:
                for msg in request_iterator:
                    if msg.WhichOneof("kind") != "chunk":
                        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "only chunks may follow the header")
                    spool.write(receiver.add(msg.chunk))
                if receiver.received < receiver.chunks:
                    self._upload_broke(context, info, receiver.received, receiver.chunks)
                receiver.finish()
                self.telemetry.end(receive, bytes=receiver.size)
                with self.telemetry.span("dtrain.validate", parent=round_span, island=info.island_id,
                                         push_id=info.push_id, version=admission.target_version):
                    self.merger.validate(spool)  # the whole frame decodes cleanly before anything is applied
            except WireError as e:
                self._refuse_payload(context, info, e.code, f"push {info.push_id}: {e}")
            except codec.CodecError as e:
                self._refuse_payload(context, info, grpc.StatusCode.INVALID_ARGUMENT,
                                     f"push {info.push_id}: bad frame: {e}")
            except grpc.RpcError:  # grpc's: the call was cancelled while the next chunk was awaited
                self._upload_broke(context, info, receiver.received, receiver.chunks)
            finally:  # a refused or broken upload's span ends here, with what arrived
                self.streams.end()
                if self._receiving is not None:
                    self._receiving.release()
                self.telemetry.end(receive, bytes=receiver.size)
            with self.lock:
                self._refuse_if_failed(context)
                # The decision, made again now that the payload is here (the round may have closed meanwhile),
                # with the payload's norm, and recorded; summing the accepted delta cannot fail for a spool that
                # validate() accepted.
                admission = self._decide_push(context, self.state.commit_push, info, info, self.clock(),
                                              norm=spool.norm, theta_norm=self.merger.theta_norm)
                if admission.status == "accept":
                    self.merger.add_pending(spool, admission.weight, scale=admission.scale, key=info.push_id)
                    self._push_bytes[info.push_id] = receiver.size
                self.bytes_in += receiver.size
                self.telemetry.record_ratio(4 * self.merger.n, receiver.size, "up")
                view = self.history.island(info.island_id)
                view.bytes_in += receiver.size
                view.last_seen = self.clock()
                self.lock.notify_all()  # a first push of a round starts its grace: the ticker's deadline moves
                status = _STATUS[admission.status]
                self._maybe_merge_locked(self.clock())
                version = self.state.version
                cursor = self._cursor(info)
                rejected = self.state.rejected(info.push_id)
                if rejected is not None and admission.status == "accept":  # the merge it completed rejected it
                    status, admission = pb.PUSH_STATUS_REJECTED, dataclasses.replace(admission, reason=rejected)
                elif status == pb.PUSH_STATUS_PENDING and version >= admission.target_version:
                    status = pb.PUSH_STATUS_MERGED
        self.log.event("push_received", island=info.island_id, push_id=info.push_id, status=admission.status,
                       base_version=info.base_version, tokens=info.tokens, weight=admission.weight,
                       staleness=admission.staleness, bytes=receiver.size, norm=admission.norm,
                       scale=admission.scale, reason=admission.reason)
        if admission.status == "reject":
            self.log.event("push_quarantined", island=info.island_id, push_id=info.push_id, norm=admission.norm,
                           reason=admission.reason)
            self.log.progress(f"quarantined push {info.push_id} from {info.island_id}: {admission.reason}")
        return pb.PushDeltaResponse(status=status, merged_version=admission.target_version, version=version,
                                    reason=admission.reason, weight=admission.weight, cursor=cursor)

    def _cursor(self, info: PushInfo) -> int:
        """The push's shard's cursor now (merged + pending data): where its island's next range starts, or where
        it rewinds to when the push was dropped or rejected. Called under the lock, after the state decided."""
        return self.state.shard_cursor(info.shard_index) if info.shard_index < self.opts.islands else 0

    def PullGlobal(self, request: pb.PullRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.PullMessage | bytes]:
        if not 0 <= request.wait_s <= 3600:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"wait_s={request.wait_s}: must be in [0, 3600]")
        with self.lock:
            self._decide(context, self.state.check_pull, request.island_id, request.have_version)
            if request.wait_s > 0 and request.have_version == self.state.version and not request.full:
                self.lock.wait_for(lambda: self.state.version > request.have_version or self.state.stopped()
                                   or not context.is_active(), timeout=min(request.wait_s, MAX_PULL_WAIT_S))
            version = self.state.version
            chain = None if request.full else self.merger.updates_since(request.have_version)
            if chain is None:  # θ itself, lossless; written to disk once per version, streamed from there
                chain, kind = [self.merger.full_update()], pb.PULL_KIND_FULL
            else:
                kind = pb.PULL_KIND_UPDATE
            # Opened under the lock: a frame deleted by a later merge stays readable through its handle.
            frames = [(kind, u.base_version, u.version, u.size, u.crc32, u.params_digest, u.open()) for u in chain]
            final = self.state.stopped() or version == self.opts.end_version
            evaluate = bool(frames) and self.history.assign_eval(request.island_id, version, final,
                                                                 self.cfg.coordinator.eval_every, self.clock())
            self.history.island(request.island_id).last_seen = self.clock()
        if not frames:
            yield pb.PullMessage(header=pb.PullHeader(kind=pb.PULL_KIND_CURRENT, version=version,
                                                      base_version=version, tree_digest=self.tree_digest))
            return
        self.log.event("pull_served", island=request.island_id, have_version=request.have_version,
                       frames=[[pb.PullKind.Name(f[0]), f[1], f[2], f[3]] for f in frames], evaluate=evaluate)
        piece = self.pull_piece
        with self.streams.streaming():
            for kind, base, v, size, crc, digest, handle in frames:
                yield pb.PullMessage(header=pb.PullHeader(
                    kind=kind, version=v, base_version=base, tree_digest=self.tree_digest, total_bytes=size,
                    frame_crc32=crc, chunks=chunk_count(size, piece), params_digest=digest,
                    evaluate=evaluate and v == version))
                yield from file_chunk_messages(handle, piece)
                with self.lock:
                    self.bytes_out += size
                    self.history.island(request.island_id).bytes_out += size

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.status_message()

    def status_message(self) -> pb.StatusResponse:
        """The run's status: what the Status RPC answers and the dashboard shows (as JSON:
        :func:`dtrain.status.message_dict`)."""
        with self.lock:
            now = self.clock()
            st = self.state.status(now)
            h = self.history
            islands = []
            for r in sorted(self.state.islands.values(), key=lambda r: (r.shard_index, r.island_id)):
                view = h.island(r.island_id)
                islands.append(pb.IslandStatus(
                    island_id=r.island_id, name=r.name, state=r.state, version=r.version,
                    tokens_merged=r.tokens_merged, pushes_merged=r.pushes_merged,
                    lease_left_s=max(0.0, r.lease_expiry - now) if r.state == "live" else 0.0,
                    steps_per_s=r.steps_per_s, shard_index=r.shard_index, devices=r.devices,
                    quarantined=[evidence_to_message(e) for e in r.quarantined], hardware=r.hardware,
                    device_kind=view.device_kind, steps=r.steps, tokens=r.tokens_reported,
                    train_loss=view.train_loss, utilization=view.utilization, params_digest=r.params_digest,
                    cursor=self.state.shard_cursor(r.shard_index) if r.shard_index < self.opts.islands else 0,
                    bytes_in=view.bytes_in, bytes_out=view.bytes_out,
                    last_seen_s=max(0.0, now - view.last_seen) if view.last_seen else 0.0))
            rnd = st["round"]
            deadline = st["next_deadline"]
            return pb.StatusResponse(
                run_id=self.run_id, version=self.state.version, mode=self.opts.coordinator.mode, islands=islands,
                tokens_merged=self.state.tokens_merged, bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                deltas_dropped=self.state.deltas_dropped, total_versions=self.opts.end_version,
                tokens_total=self.opts.tokens_total,
                stopped=st["stopped"], run_over=st["run_over"], deltas_merged=self.state.deltas_merged,
                deltas_rejected=self.state.deltas_rejected, duplicates=self.state.duplicates,
                pushes_refused=self.pushes_refused, shard_cursors=st["shard_cursors"],
                round=pb.OpenRound(target_version=rnd["target_version"], ready=rnd["ready"], reason=rnd["reason"],
                                   pending=len(rnd["pending"]),
                                   deadline_s=None if deadline is None else max(0.0, deadline - now)),
                merge_s=self.merge_s, params_digest=self.merger.digest, started_at=self.started_at, now=now,
                eval_loss=h.evals[-1].loss if h.evals else None,
                rounds=h.rounds, evals=h.evals, faults=h.faults)

    def close(self) -> None:
        self.health.enter_graceful_shutdown()  # NOT_SERVING from now on
        if self.dashboard is not None:
            self.dashboard.close()
        with self.lock:
            self._closing = True
            self.lock.notify_all()  # wakes the ticker, which then ends
        self._ticker.join(timeout=5)
        # the refused calls counted since each host's last auth_failed event: before telemetry shuts down
        with self._auth_lock:
            pending = [entry for entry in self._auth_failures.values() if entry[1]]
            self._auth_failures.clear()
        for _, count, peer, method, why in pending:
            self._report_auth_failed(peer, method, why, count)
        self.rounds.close_all()
        self.telemetry.shutdown()  # its last collection reads the Status: before the merger closes
        with self.lock:
            self.merger.close()
        if self.ckpt is not None:
            self.ckpt.close()
        self.log.close()


def serve(cfg: Config, run_dir: str | Path, theta: np.ndarray | Path | None, spec: codec.Spec, port: int | None = None,
          resume: bool = False, quiet: bool = False, clock: Callable[[], float] = time.time,
          after_finish: AfterFinish = "exit", checked: Preflight | None = None
          ) -> tuple[grpc.Server, CoordinatorService, int]:
    """Starts the coordinator; returns (server, service, bound port). ``port=0`` picks a free one.
    ``after_finish``: see :class:`CoordinatorService`. ``checked``: :func:`preflight`'s result when the caller
    already ran it (before θ_0's work), else it runs here, before anything is written to the run folder."""
    c = cfg.coordinator
    address = f"{c.host}:{c.port if port is None else port}"
    token, creds = checked if checked is not None else preflight(cfg, port)
    dash_port = dashboard_port(cfg, port)
    service = CoordinatorService(cfg, run_dir, theta, spec, clock=clock, resume=resume, quiet=quiet,
                                 after_finish=after_finish)
    on_denied: AuthDenied = service.auth_failed
    interceptors: list[grpc.ServerInterceptor] = [TokenAuthInterceptor(token, on_denied)] if token else []
    threads = server_threads(cfg)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                         interceptors=interceptors, options=server_options(cfg),
                         maximum_concurrent_rpcs=threads * 4)
    server.add_generic_rpc_handlers((service_handler(service),))
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind to address": taken since the check above, or not ours to bind
        bound = 0
    if bound == 0:
        service.close()
        raise DtrainError(f"cannot listen on {address}: gRPC could not bind it; if {_IN_USE}")
    if dash_port is not None:
        try:
            service.dashboard = open_dashboard(service, dash_port, token)
        except DtrainError:
            service.close()
            raise
    server.start()
    if service.dashboard is not None:
        service.dashboard.start()
    if resume:  # leases were renewed to the restore's time + lease_s; the islands can reach us only from now on
        with service.lock:
            service.state.pause_leases(max(0.0, clock() - service.loaded_at))
    if not resume:  # once per run: what it is, for a reader of its events (dtrain plot, dtrain.audit)
        o = service.opts
        service.log.event("run_started", run_id=service.run_id, mode=c.mode, islands=o.islands,
                          total_versions=o.end_version, expected_versions=o.total_versions,
                          tokens_total=o.tokens_total, params=service.merger.n,
                          fingerprint=cfg.fingerprint(), config=dataclasses.asdict(cfg))
    dash_url = service.dashboard.url if service.dashboard is not None else None
    service.log.event("coordinator_started", address=f"{c.host}:{bound}", tls=creds is not None,
                      auth=token is not None, mode=c.mode, params=service.merger.n, run_id=service.run_id,
                      dashboard=dash_url)
    service.log.progress(f"coordinator listening on {c.host}:{bound} ({'TLS' if creds else 'plaintext'}, "
                         f"{'token auth' if token else 'no auth'}, {c.mode} mode, {service.merger.n:,} params)"
                         + (f"; dashboard at {dash_url}" if dash_url else "; no dashboard"))
    return server, service, bound


_IN_USE = ("the address is already in use (another coordinator?): stop the other process, or pick another port "
           "with --port or coordinator.port")


# What preflight() read: the bearer token (None: no auth) and the server's TLS credentials (None: plaintext).
Preflight = tuple[str | None, grpc.ServerCredentials | None]


def preflight(cfg: Config, port: int | None) -> Preflight:
    """The checks a coordinator passes before it writes anything: its ports are free (:func:`check_ports_free`),
    the telemetry exporter is installed, its token and TLS files are readable and not deploy/'s placeholders
    (ConfigError otherwise); returns the token and the credentials for :func:`serve`."""
    check_ports_free(cfg, port)
    require_exporter(cfg.telemetry)
    return read_token(cfg.security), server_credentials(cfg.security)


def check_ports_free(cfg: Config, port: int | None) -> None:
    """The gRPC address (``port``, else coordinator.port) and the dashboard's port are free to bind, or a
    DtrainError naming the one that is not."""
    c = cfg.coordinator
    check_address_free(c.host, c.port if port is None else port)
    dash_port = dashboard_port(cfg, port)
    if dash_port is not None:
        check_port_free(c.host, dash_port)


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
                    raise DtrainError(f"cannot listen on {host}:{port}: {_IN_USE}") from None
                raise DtrainError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def server_threads(cfg: Config) -> int:
    """The gRPC server's threads: ``coordinator.workers``, or with 0 (the default) 3 per expected island + 8, at
    least 16. Each island may hold three calls at once (a push stream, a long-polling pull, a heartbeat), each on a
    thread for its whole length: with fewer threads than that, heartbeats queue behind long polls and leases
    expire (benchmarks/scale.py: 64 islands on 16 threads)."""
    return cfg.coordinator.workers or max(16, 3 * cfg.outer.islands + 8)


def stream_share(cfg: Config) -> int:
    """Each island's share of ``coordinator.stream_budget_bytes`` (the budget / ``outer.islands``), at least 64 KiB,
    at most ``coordinator.stream_window_bytes`` where that is set; 0 without a budget."""
    c = cfg.coordinator
    if not c.stream_budget_bytes:
        return 0
    share = max(64 << 10, c.stream_budget_bytes // max(1, cfg.outer.islands))
    return min(share, c.stream_window_bytes) if c.stream_window_bytes else share


def stream_window(cfg: Config) -> int:
    """Each incoming stream's receive window (0: gRPC's auto-tuning): its island's :func:`stream_share`, or
    ``coordinator.stream_window_bytes`` without a budget. The bytes received ahead of the handlers stay near the
    budget however many islands push at once (benchmarks/scale.py)."""
    c = cfg.coordinator
    if not c.stream_window_bytes:
        return 0
    return stream_share(cfg) or c.stream_window_bytes


def pull_piece(cfg: Config) -> int:
    """Bytes per chunk of a pull's frames: ``codec.chunk_bytes``, at most half its island's :func:`stream_share`.
    A pull being sent holds its chunk twice (the message in Python, gRPC's copy until it is on the wire), so the
    pulls of every island at once hold about the budget, not islands x 2 x chunk_bytes (64 islands, 1 MiB chunks:
    +190 MiB). Islands accept any chunk size up to their own ``codec.chunk_bytes``."""
    share = stream_share(cfg)
    return min(cfg.codec.chunk_bytes, share // 2) if share else cfg.codec.chunk_bytes


def server_options(cfg: Config) -> list[tuple[str, int | str]]:
    """The gRPC server's options. With a window (:func:`stream_window`) each incoming stream's receive window is
    fixed at that size (gRPC's BDP probing off), so data received ahead of the handlers, which are CPU-bound
    decoding pushes, is bounded by streams × window: with probing on, 8 pushes over loopback buffered up to
    1.4 model sizes here."""
    c = cfg.coordinator
    # SO_REUSEPORT off: gRPC turns it on by default, which lets a second coordinator bind the same port and
    # share its connections at random; off, the second one's bind fails (see check_address_free).
    opts = channel_options(c.max_message_bytes) + [("grpc.so_reuseport", 0)] + keepalive_options(server=True)
    window = stream_window(cfg)
    if window:
        opts += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]
    return opts


def service_handler(service: pb_grpc.CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The Coordinator service's handlers, one per method of the proto's service: the generated
    ``add_CoordinatorServicer_to_server`` with two differences. Responses go through ``wire.serialize``, so a
    pull streams pre-encoded chunk messages (``wire.chunk_message``: one copy of the data, not three); pushed
    chunks are parsed as views into the received bytes (``wire.chunk_deserializer``: no copy, not two)."""
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
    handlers = {m.name: HANDLER_KINDS[m.client_streaming, m.server_streaming](
        _noting_call(m.name, getattr(service, m.name), m.client_streaming),
        request_deserializer=(chunk_deserializer(pb.PushMessage) if m.name == "PushDelta"
                              else getattr(pb, m.input_type.name).FromString),
        response_serializer=serialize) for m in methods}
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _noting_call(name: str, method: Callable[[Any, grpc.ServicerContext], Any],
                 client_streaming: bool) -> Callable[[Any, grpc.ServicerContext], Any]:
    """``method`` that first notes the call's method name and island in :data:`_CALL` for the service's events
    (gRPC serves each call, its streams included, on one thread): the island from the request's ``island_id``
    (Join: ``island``, the name), or from the first message of a push stream, its header."""
    if client_streaming:
        def noted_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            _CALL.method, _CALL.island = name, ""
            return method(_noting_header(requests), context)
        return noted_stream

    def noted(request: Any, context: grpc.ServicerContext) -> Any:
        _CALL.method, _CALL.island = name, getattr(request, "island_id", "") or getattr(request, "island", "")
        return method(request, context)
    return noted


def _noting_header(requests: Iterator[Any]) -> Iterator[Any]:
    first = next(requests, None)
    if first is None:
        return
    if not isinstance(first, RawChunk) and first.WhichOneof("kind") == "header":
        _CALL.island = first.header.island_id
    yield first
    yield from requests


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string, without its port: ``ipv4:10.0.0.7:53122`` -> ``10.0.0.7``,
    ``ipv6:[::1]:53122`` -> ``[::1]``; anything else (``unix:...``) as it is."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return rest.rpartition(":")[0]
    return peer


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None: nothing to tune."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def return_large_frees_to_the_os() -> None:
    """glibc keeps freed multi-MiB temporaries in per-thread arenas, one per gRPC thread, so the coordinator's
    resident size would creep up to a multiple of the model. A fixed 4 MiB mmap threshold hands anything
    larger back to the OS when freed, while the chunk-sized buffers of every push (1 MiB messages, 256 KiB
    zstd output, 1 MiB slabs) come from the heap and are reused instead of mmap'd and faulted in each time
    (a 1 MiB threshold made rounds ~10% slower); two arenas are enough here. What the heap keeps once the
    streams are done goes back by :class:`FrameStreams`."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-8, 2)  # M_ARENA_MAX
    # Fixing the mmap threshold also pins the trim threshold at 128 KiB, so those buffers would be given
    # back and faulted in again every time; keep up to 16 MiB of free heap.
    libc.mallopt(-1, 16 << 20)  # M_TRIM_THRESHOLD


class FrameStreams:
    """Counts the frames streaming in (pushes) and out (pulls). When the last one ends, and after each merge, the
    free memory the heap kept from their buffers (chunks, decoders, gRPC's copies: megabytes a stream, freed all
    over the heap, so glibc's trim threshold cannot return them) goes back to the OS with ``malloc_trim``, at most
    every ``TRIM_EVERY_S``. Without it a round's pushes leave the heap at their peak and the pulls that follow
    add theirs on top (benchmarks/scale.py: 64 islands, 317 MiB at rest between rounds, 85 MiB with it)."""

    TRIM_EVERY_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self._trimmed = -math.inf
        self.trims = 0

    def begin(self) -> None:
        with self._lock:
            self.active += 1

    def end(self) -> None:
        with self._lock:
            self.active -= 1
            if self.active:
                return
        self.trim()

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def trim(self) -> None:
        libc = _glibc()
        now = time.monotonic()
        with self._lock:
            if libc is None or now - self._trimmed < self.TRIM_EVERY_S:
                return
            self._trimmed = now
            self.trims += 1
        libc.malloc_trim(0)


def initial_parameters_file(cfg: Config, out_dir: str | Path, spec_only: bool = False
                            ) -> tuple[Path | None, codec.Spec]:
    """θ_0 from the run's seed as a file of raw float32 in ``out_dir`` (every island builds the same tree and
    checks its digest), and the tree's spec. ``spec_only``: just the spec (from shapes; no θ_0 is built).

    Computed in a child process (coordinator/init_params.py), so JAX and the model's temporary copies
    never enter the coordinator's memory, and θ_0 itself only as a file the merger links in."""
    import subprocess
    import sys
    import tempfile

    from dtrain.config import to_toml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrain-init-") as tmp:
        (Path(tmp) / "config.toml").write_text(to_toml(cfg))
        done = subprocess.run([sys.executable, "-m", "coordinator.init_params", str(Path(tmp) / "config.toml"),
                               str(out), *(["--spec-only"] if spec_only else [])], capture_output=True, text=True)
    if done.returncode != 0:
        raise DtrainError(f"computing θ_0 failed:\n{done.stderr[-2000:]}")
    return None if spec_only else out / "theta0.f32", json.loads((out / "spec.json").read_text())


def initial_parameters(cfg: Config) -> tuple[np.ndarray, codec.Spec]:
    """θ_0 as an array (tests and tools; the service itself uses :func:`initial_parameters_file`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtrain-theta0-") as tmp:
        path, spec = initial_parameters_file(cfg, tmp)
        assert path is not None
        return np.fromfile(path, "<f4").astype(np.float32), spec


def run_coordinator(cfg: Config, run_dir: str | Path, port: int | None = None, resume: bool = False,
                    quiet: bool = False, after_finish: AfterFinish = "exit") -> dict[str, Any]:
    """``dtrain coordinator``: serves until the run is finished (``CoordinatorState.finished``: the last version
    is merged and the live islands have it, or its linger has passed) or SIGTERM / Ctrl-C; writes
    RUN_DIR/coordinator.json with the bound address as soon as it listens. ``after_finish="serve"`` (a
    Deployment's, which would restart an exited coordinator, resume the finished run and end it again, forever):
    a finished run says so (``run_finished`` event, one progress line) and keeps serving until SIGTERM / Ctrl-C."""
    import signal

    return_large_frees_to_the_os()
    checked = preflight(cfg, port)  # before θ_0's work
    init_dir = Path(run_dir) / "spool" / "init"
    theta0, spec = initial_parameters_file(cfg, init_dir, spec_only=resume)  # resuming: θ is in the checkpoint
    try:
        server, service, bound = serve(cfg, run_dir, theta0, spec, port=port, resume=resume, quiet=quiet,
                                       after_finish=after_finish, checked=checked)
    finally:
        shutil.rmtree(init_dir, ignore_errors=True)  # the merger holds its own link to θ_0
    info = Path(run_dir) / "coordinator.json"
    tmp = info.with_suffix(".tmp")
    dash = service.dashboard
    tmp.write_text(json.dumps({"host": cfg.coordinator.host, "port": bound, "run_id": service.run_id,
                               "dashboard_port": dash.port if dash else None, "dashboard": dash.url if dash else None}))
    tmp.replace(info)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: service.request_stop(f"{signal.Signals(signum).name} received"))
    reason = service.wait_finished()
    if after_finish == "serve" and service.fatal is None and service.stop_requested is None:
        with service.lock:
            version = service.state.version
        service.log.event("run_finished", reason=reason, version=version)
        service.log.progress(f"run finished: {reason}; serving its final θ (version {version}), Status, health "
                             f"and the dashboard until SIGTERM (--after-finish=serve); nothing is left to train: the "
                             f"Deployment may be scaled to 0 (kubectl -n dtrain scale deployment dtrain-coordinator "
                             f"--replicas=0)")
        reason = service.wait_stop_requested()
    if service.fatal:
        server.stop(grace=1.0).wait()
        service.close()
        raise DtrainError(f"coordinator failed: {service.fatal} (restart it with `dtrain coordinator --resume`)")
    server.stop(grace=2.0).wait()
    with service.lock:
        summary = {"version": service.state.version, "tokens_merged": service.state.tokens_merged,
                   "bytes_in": service.bytes_in, "bytes_out": service.bytes_out, "merge_s": service.merge_s,
                   "deltas_dropped": service.state.deltas_dropped, "params_digest": service.merger.digest}
    service.log.event("coordinator_stopped", reason=reason, **summary)
    service.close()
    return summary
