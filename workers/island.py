"""The island worker: train on the island's mesh; push, pull and fold in without idling.

Per round the island trains H steps (or ``worker.round_seconds`` of wall time),
then pushes Δ = θ_anchor − θ_local (θ_anchor: the global θ its trajectory is
based on), compressed with error feedback. With ``worker.overlap`` the push
and the following pull run in a background thread while training continues;
when the new global θ' arrives the island folds it in at the next chunk
boundary, keeping the progress made since the push (Streaming-DiLoCo style):

    θ_local ← θ' + (θ_local − θ_at_push);   θ_anchor ← θ'

so the next Δ covers exactly the steps since the last push and no step's
progress is pushed twice or lost. Without overlap θ_local ← θ' exactly
(plain DiLoCo). The island only blocks when a round ends before the previous
exchange has finished; that time is what ``utilization`` counts.
"""

from __future__ import annotations

import os
import platform
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.codec import CODEC_BITS, params_digest
from dtrain.config import Config
from dtrain.diloco import Island, advance
from dtrain.errors import DtrainError
from dtrain.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog
from dtrain.runs import prepare
from dtrain.train import chunks, fmt_rate
from dtrain.wire import max_frame_bytes
from workers.client import CoordinatorClient, CoordinatorError

PULL_WAIT_S = 5.0  # one long poll; repeated until the awaited version arrives


class WorkerError(DtrainError):
    pass


@jax.jit
def _fold_in(local: Any, at_push: Any, global_params: Any) -> Any:
    return jax.tree.map(lambda l, a, g: g + (l - a), local, at_push, global_params)


@dataclass
class GlobalParams:
    vec: np.ndarray  # flat float32 θ_version, bit-identical to the coordinator's
    version: int
    arrived: float = 0.0  # time.perf_counter() when it arrived (wall-time rounds are timed from it)


class Exchange(threading.Thread):
    """One round's push, then pulls until a newer global θ arrives (or the run stops)."""

    def __init__(self, worker: "Worker", frame: bytes, header: pb.PushHeader, base: GlobalParams):
        super().__init__(name=f"exchange-{header.push_id}", daemon=True)
        self.worker, self.frame, self.header, self.base = worker, frame, header, base
        self.result: GlobalParams | None = None
        self.error: BaseException | None = None
        self.response: pb.PushDeltaResponse | None = None
        self.repush = threading.Event()

    def run(self) -> None:
        try:
            self.response = self.worker.client.push(self.header, self.frame)
            self.worker.log.event("push_sent", push_id=self.header.push_id, base_version=self.header.base_version,
                                  status=pb.PushStatus.Name(self.response.status), bytes=len(self.frame),
                                  tokens=self.header.tokens, reason=self.response.reason)
            g = self.base
            while g.version <= self.base.version and not self.worker.stopping.is_set():
                if self.repush.is_set():  # the coordinator lost our push (restart): send it again
                    self.repush.clear()
                    self.response = self.worker.client.push(self.header, self.frame)
                    self.worker.log.event("push_resent", push_id=self.header.push_id)
                g = self.worker.pull(g, wait_s=PULL_WAIT_S)
                if self.worker.total_versions and g.version >= self.worker.total_versions:
                    break
            self.result = g
        except BaseException as e:  # surfaced to the training loop
            self.error = e


class Worker:
    def __init__(self, cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False):
        self.cfg = cfg
        self.name = name
        self.run_dir = Path(run_dir)
        self.log = RunLog(self.run_dir, quiet=quiet)
        self.client = CoordinatorClient(address, cfg, on_retry=self._on_retry)
        self.setup = prepare(cfg, cfg.outer.islands)
        self.loop = self.setup.loop
        template = jax.device_get(self.setup.built.init(cfg.run.seed))
        self.spec, _ = codec.flatten(template)
        self.n = codec.spec_size(self.spec)
        self.tree_digest = codec.spec_digest(self.spec)
        self.max_frame = max_frame_bytes(self.n, cfg.codec.block)
        k = cfg.codec
        self.up_bits = CODEC_BITS[k.up]
        self.feedback = codec.ErrorFeedback(self.n, self.up_bits, k.block) \
            if k.error_feedback and self.up_bits != 32 else None
        self.stopping = threading.Event()
        self.island_id = ""
        self.total_versions = 0
        self.pending_push_id = ""
        self.exchange: Exchange | None = None
        self.ckpt: Checkpointer | None = None
        self.blocked_s = 0.0
        self.frames_sent = 0
        self.frame_bytes = 0
        self.pushes = 0

    def _on_retry(self, what: str, pause: float) -> None:
        self.log.event("retry", what=what, pause_s=pause)
        self.log.progress(f"{self.name}: {what}, retrying in {pause:.1f}s")

    # -- exchange pieces ----------------------------------------------------------------------------

    def join(self) -> pb.JoinResponse:
        devices = len(self.loop.mesh.devices.flat)
        hardware = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
        resp = self.client.join(self.name, hardware, devices)
        if resp.tree_digest != self.tree_digest or resp.tree_size != self.n:
            raise WorkerError(f"the coordinator's parameter tree ({resp.tree_size} values, {resp.tree_digest}) "
                              f"differs from this island's ({self.n}, {self.tree_digest})")
        self.island_id = resp.island_id
        self.total_versions = resp.total_versions
        self.log.event("joined", island_id=resp.island_id, shard=resp.shard_index, cursor=resp.cursor,
                       version=resp.version, run_id=resp.run_id)
        return resp

    def pull(self, have: GlobalParams | None, wait_s: float = 0.0, full: bool = False) -> GlobalParams:
        """Brings θ up to the coordinator's latest version; verifies the digest after every frame."""
        have_version = 0 if have is None else have.version
        frames = self.client.pull(self.island_id, have_version, wait_s=wait_s, full=full or have is None,
                                  max_frame=self.max_frame)
        g = have
        for f in frames:
            h = f.header
            values = codec.dequantize(codec.decode(f.frame, expected_n=self.n))
            if h.kind == pb.PULL_KIND_FULL:
                g = GlobalParams(values, h.version)
            elif h.kind == pb.PULL_KIND_UPDATE:
                if g is None or h.base_version != g.version:
                    return self.pull(None, full=True)
                g = GlobalParams(g.vec + values, h.version)  # θ_v = θ_{v-1} + dequantize(update)
            if params_digest(g.vec) != h.params_digest:
                self.log.event("digest_mismatch", version=h.version)
                return self.pull(None, full=True)
        if g is None:
            raise WorkerError("the coordinator sent no parameters for a full pull")
        if g is not have:
            g.arrived = time.perf_counter()
        return g

    def _push_frame(self, delta: np.ndarray) -> bytes:
        k = self.cfg.codec
        q = self.feedback.compress(delta) if self.feedback is not None else codec.quantize(delta, self.up_bits, k.block)
        return codec.encode(q, k.zstd_level)

    # -- the loop -----------------------------------------------------------------------------------

    def _heartbeat_loop(self, island: Island, g_ref: list[GlobalParams], rate: list[float]) -> None:
        while not self.stopping.wait(self.cfg.worker.heartbeat_s):
            try:
                g = g_ref[0]
                resp = self.client.heartbeat(island_id=self.island_id, version=g.version, steps=island.steps,
                                             tokens=island.tokens, steps_per_s=rate[0],
                                             pending_push_id=self.pending_push_id)
            except CoordinatorError as e:
                self.log.event("heartbeat_failed", error=str(e))
                continue
            if resp.action == pb.ACTION_STOP:
                self.log.event("stop_requested", reason=resp.reason)
                self.stopping.set()
            elif resp.action == pb.ACTION_REJOIN:
                self.log.event("rejoin", reason=resp.reason)
                try:
                    self.join()
                except CoordinatorError as e:
                    self.log.event("rejoin_failed", error=str(e))
            if resp.push_unknown and self.exchange is not None:
                self.exchange.repush.set()

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

    def run(self) -> dict[str, Any]:
        cfg, loop = self.cfg, self.loop
        t, w = cfg.train, cfg.worker
        B = t.batch_size
        t_start = time.perf_counter()
        # Compile every scan length a round uses (and the eval) before joining: a first call that compiles
        # mid-run would stall this island's round and, in sync mode, every other island with it.
        tau = w.max_overlap_steps if w.overlap else 0
        lengths = ({t.steps_per_call, min(tau, t.steps_per_call)} - {0} if w.round_seconds else
                   set(chunks(cfg.outer.inner_steps, t.steps_per_call, (tau,) if tau else ())))
        loop.precompile(lengths, len(self.setup.eval_batches))
        if w.overlap:  # and the fold-in
            abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                    loop.model.abstract_params, loop.params_sharding)
            _fold_in.lower(abstract, abstract, abstract).compile()
        ckpt = self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=1)
        # Only now join: everything slow is done, so "joined" means "about to train" for the start barrier.
        joined = self.join()
        g = self.pull(None)
        shard = self.setup.shards[joined.shard_index]
        params = loop.place_params(codec.unflatten(self.spec, g.vec))
        island = Island(index=joined.shard_index, state=loop.init_state(params), stream=shard.stream,
                        cursor=int(joined.cursor))
        island.steps = island.cursor // B  # a rejoining island continues where its shard's merged data ends
        if ckpt.latest_step() is not None:
            _, restored, meta = ckpt.restore(island.state)
            if meta.get("fingerprint") == cfg.fingerprint():
                island.state = restored.replace(params=island.state.params)  # optimizer moments; θ from the pull
                self.log.event("island_restored", step=meta.get("steps"))
        self.log.event("island_started", name=self.name, shard=joined.shard_index, cursor=island.cursor,
                       version=g.version, devices=len(loop.mesh.devices.flat), host=platform.node(),
                       cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
        self.log.progress(f"{self.name}: shard {joined.shard_index}, cursor {island.cursor}, v{g.version}")

        g_ref, rate = [g], [0.0]
        hb = threading.Thread(target=self._heartbeat_loop, args=(island, g_ref, rate), daemon=True)
        hb.start()
        self._await_peers()
        g.arrived = time.perf_counter()  # a wall-time round 1 starts now, not when θ_0 arrived
        anchor = g
        at_push: Any = None
        last_push = (island.cursor, island.tokens)
        t_train0 = time.perf_counter()
        last_log = [t_train0, island.steps]
        final_wait = 0.0
        rounds = 0

        def fold_in(result: GlobalParams) -> None:
            nonlocal anchor, at_push
            new_global = loop.place_params(codec.unflatten(self.spec, result.vec))
            island.state = island.state.replace(params=_fold_in(island.state.params, at_push, new_global))
            anchor, at_push = result, None
            g_ref[0] = result

        def wait_for_exchange(why: str) -> None:
            """Folds in the exchange in flight, counting the wait as blocked time. Steps already dispatched
            are compute, not idling: the devices finish them before the clock starts (JAX dispatch is
            asynchronous, so the host reaches this point while they still run)."""
            jax.block_until_ready(island.state.step)
            t0 = time.perf_counter()
            finish_exchange()
            waited = time.perf_counter() - t0
            self.blocked_s += waited
            self.log.event("blocked", seconds=round(waited, 4), why=why, version=anchor.version,
                           steps=island.steps)

        def finish_exchange() -> None:
            ex = self.exchange
            assert ex is not None
            ex.join()
            self.exchange = None
            if ex.error is not None:
                raise ex.error
            assert ex.result is not None
            self.pending_push_id = ""
            fold_in(ex.result)

        while not self.stopping.is_set():
            if self.total_versions and anchor.version >= self.total_versions:
                break
            if not cfg.worker.round_seconds and island.steps >= t.steps:
                break
            round_steps = 0
            while not self.stopping.is_set():
                if self.exchange is not None and round_steps >= w.max_overlap_steps:
                    wait_for_exchange("overlap budget spent")  # fold the new θ in before going on
                if w.round_seconds:
                    # The round ends round_seconds after the current global θ arrived (not after this
                    # island's own push): every island receives a version at about the same moment, so
                    # all of them push together and none waits for a straggler. While the previous
                    # exchange is in flight the deadline is not known yet; the overlap budget bounds that.
                    if (self.exchange is None and round_steps
                            and time.perf_counter() - anchor.arrived >= w.round_seconds):
                        break
                    n = t.steps_per_call
                else:
                    n = min(t.steps_per_call, cfg.outer.inner_steps - round_steps, t.steps - island.steps)
                    if n <= 0:
                        break
                if w.overlap and w.max_overlap_steps and round_steps < w.max_overlap_steps:
                    # Stop exactly at the overlap budget, in every round (with or without an exchange in
                    # flight): each round then runs the same chunk lengths, all compiled before the island
                    # joined, so no island stalls the others by compiling in the middle of the run.
                    n = min(n, w.max_overlap_steps - round_steps)
                advance(loop, island, n, B)
                if w.round_seconds:  # the deadline is about steps done, not steps queued: JAX dispatch is async
                    jax.block_until_ready(island.state.step)
                round_steps += n
                if self.exchange is not None and not self.exchange.is_alive():
                    finish_exchange()  # fold the new global θ in without waiting
                if island.steps % cfg.run.log_every < n:
                    jax.block_until_ready(island.state.step)  # note: host sync, once per log interval
                    now = time.perf_counter()
                    rate[0] = (island.steps - last_log[1]) / max(now - last_log[0], 1e-9)
                    last_log[:] = [now, island.steps]
                    self.log.progress(f"{self.name}: step {island.steps} v{anchor.version} "
                                      f"tok/s {fmt_rate(rate[0] * B * cfg.model.seq_len)}")
            if self.stopping.is_set() or round_steps == 0:
                break
            # Round end: the previous exchange must be folded in before the next delta is taken.
            if self.exchange is not None:
                wait_for_exchange("round ended before the exchange")
            local = jax.device_get(island.state.params)  # note: host sync, once per round
            _, local_vec = codec.flatten(local)
            at_push = jax.tree.map(jnp.copy, island.state.params)  # kept: the state is donated by training
            frame = self._push_frame(anchor.vec - local_vec)
            push_id = f"{self.island_id}-{uuid.uuid4().hex[:12]}"
            header = pb.PushHeader(island_id=self.island_id, base_version=anchor.version, push_id=push_id,
                                   tokens=island.tokens - last_push[1], inner_steps=round_steps,
                                   cursor_start=last_push[0], cursor_end=island.cursor,
                                   tree_digest=self.tree_digest)
            last_push = (island.cursor, island.tokens)
            self.pending_push_id = push_id
            self.frames_sent += 1
            self.frame_bytes += len(frame)
            rounds += 1
            self.exchange = Exchange(self, frame, header, anchor)
            self.exchange.start()
            ckpt.save(island.steps, island.state, {"steps": island.steps, "cursor": island.cursor,
                                                   "tokens": island.tokens, "version": anchor.version,
                                                   "fingerprint": cfg.fingerprint()})
            done = (not w.round_seconds and island.steps >= t.steps)
            if done:
                t0 = time.perf_counter()
                finish_exchange()
                final_wait += time.perf_counter() - t0
            elif not w.overlap:
                wait_for_exchange("no overlap")
        active_s = time.perf_counter() - t_train0 - final_wait
        t0 = time.perf_counter()
        if self.exchange is not None:  # stopped mid-round with an exchange in flight
            finish_exchange()
        # Other islands may still push (async mode, or a slower island): wait for the run's last version, so
        # every island ends on the same θ; give up if no new version arrives for two lease periods.
        last_progress = time.perf_counter()
        while self.total_versions and anchor.version < self.total_versions:
            g_new = self.pull(anchor, wait_s=PULL_WAIT_S)
            if g_new.version > anchor.version:
                anchor, last_progress = g_new, time.perf_counter()
                g_ref[0] = anchor
            elif time.perf_counter() - last_progress > 2 * cfg.coordinator.lease_s:
                self.log.event("final_wait_timeout", version=anchor.version, total_versions=self.total_versions)
                break
        final_wait += time.perf_counter() - t0
        self.stopping.set()
        hb.join(timeout=5)
        ckpt.close()
        self.ckpt = None
        g = anchor
        final_digest = params_digest(g.vec)
        try:  # best effort, one try: tell the coordinator this island holds the final version
            self.client.heartbeat(budget_s=0.0, island_id=self.island_id, version=g.version, steps=island.steps,
                                  tokens=island.tokens, params_digest=final_digest)
        except CoordinatorError as e:
            self.log.event("heartbeat_failed", error=str(e))
        final_params = loop.place_params(codec.unflatten(self.spec, g.vec))
        final_eval = loop.evaluate(final_params, self.setup.eval_batches)
        summary = {
            "island": self.name, "island_id": self.island_id, "shard": island.index, "steps": island.steps,
            "tokens": island.tokens, "cursor": island.cursor, "rounds": rounds, "version": g.version,
            "final_eval_loss": final_eval, "params_digest": final_digest,
            "bytes_up": self.client.bytes_up, "bytes_down": self.client.bytes_down,
            "compression_ratio": (4.0 * self.n * self.frames_sent / self.frame_bytes) if self.frame_bytes else 0.0,
            "utilization": 1.0 - self.blocked_s / active_s if active_s > 0 else 0.0,
            "blocked_s": self.blocked_s, "final_wait_s": final_wait, "active_s": active_s,
            "wall_s": time.perf_counter() - t_start, "retries": self.client.retries, "overlap": w.overlap,
        }
        self.log.event("island_finished", **summary)
        self.log.write_summary(summary)
        self.log.progress(f"{self.name}: done v{g.version}, eval loss {final_eval:.4f}, "
                          f"utilization {summary['utilization']:.3f}")
        self.log.close()
        self.client.close()
        return summary


def run_worker(cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    worker = Worker(cfg, address, name, run_dir, quiet=quiet)
    try:
        return worker.run()
    finally:
        worker.stopping.set()
        if worker.ckpt is not None:
            try:
                worker.ckpt.close()  # its async writer thread would otherwise keep a failed process alive
            except Exception as e:  # noqa: BLE001 - already failing; the original error is what matters
                worker.log.event("checkpoint_close_failed", error=str(e))

