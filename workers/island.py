"""The island worker: train on the island's mesh; push, pull and fold in without idling.

Per round the island trains H steps (or ``worker.round_seconds`` of wall time),
then pushes Δ = θ_anchor − θ_local (θ_anchor: the global θ its trajectory is
based on), compressed with error feedback. The push and the pulls that follow
it run as an :class:`~workers.exchange.Exchange` on a thread of its own, which
hands the new global θ' back through a Future. With ``worker.overlap`` training
continues meanwhile; when θ' arrives the island folds it in at the next chunk
boundary, keeping the progress made since the push (``dtrain.train.diloco.fold_in``,
Streaming-DiLoCo style):

    θ_local ← θ' + (θ_local − θ_at_push);   θ_anchor ← θ'

so the next Δ covers exactly the steps since the last push and no step's
progress is pushed twice or lost. Without overlap the island waits for θ'
right after the push, so θ_local ← θ' exactly (plain DiLoCo). What to do at
each chunk boundary (train, wait, push, stop) is decided by the pure planner
``workers.rounds.next_action``; :meth:`Worker.run` only carries it out. The
island blocks only when the planner says to wait; that time is what
``utilization`` counts.

This module owns the training loop (:class:`Worker`, on the process's main thread). The loop is composed of one
object per concern, each saying which thread writes what, all built by the composition root
(:func:`workers.app.build_worker`, which also closes them): the link to the coordinator (:mod:`workers.links`:
one coordinator or a sharded one, chosen there once), the exchange (:mod:`workers.exchange`: pushes and pulls, on
a thread per round), the heartbeat (:mod:`workers.heartbeat`: its own thread, which reads the loop's
:class:`~workers.heartbeat.IslandStatus` and posts to the loop through a :class:`~workers.heartbeat.Mailbox`),
recovery (:mod:`workers.recovery`: rewinds, the NaN/Inf guard, chip quarantine and remesh, on the loop's thread),
membership (:mod:`workers.membership`: the Join and the coordinator's word, the same on every process of the
island), the round schedule and its pacing (:mod:`workers.pacing`), compiling ahead (:mod:`workers.compiling`),
and the run's end (:mod:`workers.ending`: the drain, the final wait, the final heartbeat, eval and summary, on the
loop's thread). The progress report every ``run.log_every`` steps is a hook on the loop (:class:`TrainLog`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog, fmt_progress, json_number
from dtrain.telemetry import Telemetry
from dtrain.train import fragments
from dtrain.train.diloco import Island, advance, fold_in
from dtrain.train.loop import InnerLoop
from dtrain.train.prepare import Setup
from workers.client import RunOverError
from workers.compiling import Deferred, precompile, precompile_first, precompile_rest
from workers.ending import RunEnd
from workers.exchange import NOT_TAKEN, Downlink, Exchange, GlobalParams, Pending, PushClient, push_header
from workers.heartbeat import Clock, Evaluator, Heartbeat, IslandStatus, Mailbox
from workers.hosts import HostGroup
from workers.links import CoordinatorLink
from workers.membership import IslandTelemetry, Membership, report_run_over
from workers.pacing import Pacer, Slowdown
from workers.recovery import Guard, Recovery, Rewind, Rewinder, in_segment
from workers.rounds import Action, Kind, RoundProgress, next_action
from workers.startup import Startup


def agreed_action(hosts: HostGroup, action: Action) -> Action:
    """Process 0's next action on every process of the island (a wall-time round ends by process 0's clock)."""
    if hosts.alone:
        return action
    shared: dict[str, Any] = hosts.agree({"kind": action.kind.value, "steps": action.steps, "reason": action.reason})
    return Action(Kind(shared["kind"]), int(shared["steps"]), str(shared["reason"]))


class TrainLog:
    """A hook on the training loop, every ``run.log_every`` steps (:meth:`after_chunk`): steps/s since the last
    mark (for the heartbeat's status), a ``train`` event and the island's status line. The loop's own: no other
    thread uses it.

    Args: ``every``, run.log_every; ``tokens_per_step``, train.batch_size x model.seq_len; ``shard_sequences``,
    train.shard_sequences (a step run's progress bar); ``report_rate``, whether the heartbeat's tokens/s is this
    report's (not with auto rounds: the measured rate stands, :mod:`workers.pacing`)."""

    def __init__(self, *, every: int, tokens_per_step: int, shard_sequences: int, report_rate: bool, name: str,
                 log: RunLog, clock: Clock, mailbox: Mailbox):
        self.every, self.tokens_per_step, self.shard_sequences = every, tokens_per_step, shard_sequences
        self.report_rate, self.name, self.log, self.clock, self.mailbox = report_rate, name, log, clock, mailbox
        self.mark = (time.perf_counter(), 0)  # (time, executed steps) of the last report

    def start(self, executed_steps: int) -> None:
        """Steps/s are measured from now (a :meth:`Worker._train` call begins)."""
        self.mark = (time.perf_counter(), executed_steps)

    def after_chunk(self, island: Island, anchor: GlobalParams, status: IslandStatus, executed_steps: int,
                    n: int) -> None:
        """After a chunk of ``n`` steps: :meth:`report` if the chunk crossed a multiple of ``every``."""
        if island.steps % self.every < n:
            self.report(island, anchor, status, executed_steps)

    def report(self, island: Island, anchor: GlobalParams, status: IslandStatus, executed_steps: int) -> None:
        """Measures steps/s since the last mark (from the steps this process ran, ``executed_steps``), records a
        ``train`` event (the latest chunk's mean loss) and shows the island's status line."""
        jax.block_until_ready(island.state.step)  # note: host sync, once per log interval
        now = time.perf_counter()
        # From the steps this process ran, not the island's position: a rewind moves that back (or to another
        # shard), and a negative rate would have the coordinator refuse the island's heartbeats.
        status.steps_per_s = (executed_steps - self.mark[1]) / max(now - self.mark[0], 1e-9)
        self.mark = (now, executed_steps)
        tokens_per_s = status.steps_per_s * self.tokens_per_step
        if self.report_rate:
            status.tokens_per_s = tokens_per_s
        loss = status.read_loss()
        self.log.event("train", step=island.steps, loss=json_number(loss), tokens=island.tokens,
                       tokens_per_s=round(tokens_per_s, 1), version=anchor.version, shard=island.index,
                       cursor=island.cursor, utilization=round(self.clock.utilization(), 4))
        total = self.mailbox.total_versions
        shard_end = self.shard_sequences  # sequences per shard (step rounds)
        self.log.status(self.name, fmt_progress(self.name, step=island.steps, version=anchor.version, total=total,
                                                data=None if total else (island.cursor, shard_end), loss=loss,
                                                tokens_per_s=tokens_per_s),
                        done=anchor.version if total else island.cursor, total=total or shard_end)


@dataclass
class Round:
    """The training loop's round in progress (:meth:`Worker._train`; no other thread sees it)."""

    anchor: GlobalParams  # θ_anchor: the global θ the island's trajectory is based on
    start: tuple[int, int]  # (cursor, tokens) where the round's unpushed progress began
    steps: int = 0  # inner steps trained in the round
    pending: Pending | None = None  # the exchange in flight, not folded in yet
    pushed: int = 0  # rounds pushed

    def restart(self, island: Island) -> None:
        """A new round from where the island stands (after a push, a rewind or a recovery)."""
        self.steps, self.start = 0, (island.cursor, island.tokens)



class Worker:
    """One island's training loop: precompiles, joins, trains round after round, pushes each round's Δ and folds
    in the global θ that comes back, until the run's last version (:meth:`run`). Built, by keyword, by
    :func:`workers.app.build_worker`, which closes what it opened; the loop only uses the parts.

    Its own attributes belong to the training loop's thread (the telemetry is started at the first Join, the
    loop's; a rejoin's, on the heartbeat thread, finds it started). What other threads share is in objects that
    say per field who writes it: :attr:`mailbox` (with the heartbeat thread), the :class:`IslandStatus` the
    heartbeat reports, :attr:`clock` (read by the heartbeat), each :class:`Exchange` and the link's puller (with
    the exchange threads)."""

    def __init__(self, *, name: str, hosts: HostGroup, startup: Startup | None, log: RunLog, mailbox: Mailbox,
                 clock: Clock, setup: Setup, spec: codec.Spec, ranges: tuple[fragments.Range, ...],
                 link: CoordinatorLink, downlink: Downlink, membership: Membership, guard: Guard, pacer: Pacer,
                 evaluator: Evaluator, rewinder: Rewinder, train_log: TrainLog, run_end: RunEnd,
                 telemetry: IslandTelemetry, slowdown: Slowdown, ckpt: Checkpointer,
                 heartbeat: Callable[[IslandStatus], Heartbeat], batch_size: int, coordinator: str):
        """``startup``: the start timed by phase (run_worker's, which timed the phases before this), done at the
        first step; ``spec``: θ's tree layout; ``ranges``: the fragments' plan (outer.fragments: one per push, in
        turn); ``heartbeat(status)``: the island's heartbeat, reporting ``status``; ``batch_size``:
        train.batch_size; ``coordinator``: its address, as the run-over line names it."""
        self.name, self.hosts, self.startup, self.log, self.mailbox = name, hosts, startup, log, mailbox
        self.clock, self.setup, self.spec, self.ranges, self.link = clock, setup, spec, ranges, link
        self.downlink, self.membership, self.guard, self.pacer = downlink, membership, guard, pacer
        self.evaluator, self.rewinder, self.train_log, self.run_end = evaluator, rewinder, train_log, run_end
        self.tel, self.slowdown, self.ckpt, self.heartbeat = telemetry, slowdown, ckpt, heartbeat
        self.batch_size, self.coordinator = batch_size, coordinator
        self.uplink = link.uplink
        self.tree_digest = codec.spec_digest(spec)
        self.executed_steps = 0  # inner steps this process has run (rewound ones too): the compute it spent
        self._last_exchange: Exchange | None = None  # the last one folded in
        self._deferred: Deferred | None = None  # compiling that waits for the first chunk (run)

    @property
    def telemetry(self) -> Telemetry:
        """The island's telemetry (disabled until the first Join starts it)."""
        return self.tel.now

    @property
    def loop(self) -> InnerLoop:
        """The island's inner loop (rebuilt on the healthy devices by a remesh)."""
        return self.setup.loop

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Precompiles, joins, trains round after round, waits for the run's last θ; returns the summary, or
        ``{"island", "run_over"}`` if the coordinator refuses the Join because the run is over."""
        t_start = time.perf_counter()
        self.guard.start()
        if self.hosts.alone and self.pacer.schedule.round_seconds >= 0:
            # the first chunk's programs now, the rest while the first chunk trains
            precompile_first(self.setup, self.pacer.schedule)
            self._deferred = Deferred(self.name, lambda: precompile_rest(self.setup, self.pacer.schedule))
        else:
            # An island of several processes compiles in step with its other processes. With auto rounds round 1
            # lasts until every island has timed its training: a wait for compiles after the first chunk would
            # hold every island's round 1 open (and fill it with the fast islands' tokens) meanwhile.
            precompile(self.setup, self.pacer.schedule)
        self._mark("compile")
        ckpt = self.ckpt
        # Only now join: everything slow is done, so "joined" means "about to train" for the start barrier.
        try:
            joined = self.membership.join_island()
        except RunOverError as e:  # it ended before this island joined
            self._compiled()
            return report_run_over(self.log, self.name, f"{e.message} (coordinator at {self.coordinator})")
        self._mark("join")
        # Heartbeats start with the lease, on their own thread: the first pull (a whole θ) and the restore may
        # take longer than a lease, and nothing the training loop does may delay them.
        status = IslandStatus(held=(joined.version, ""), steps=0, tokens=0, devices=self.loop.mesh.devices.size,
                              quarantined=self.guard.evidence())
        heartbeat = self.heartbeat(status)
        if self.hosts.leader:  # only process 0 talks to the coordinator
            heartbeat.start()
        anchor = self.downlink.pull(None)
        island = self.rewinder.start_island(joined, anchor, ckpt)
        status.held, status.steps, status.tokens = (anchor.version, anchor.digest), island.steps, island.tokens
        self._mark("pull")
        if self._deferred is None:  # everything is compiled (auto rounds, several processes): an eval of θ_0 asked
            self.evaluator.requested()  # for is start-up, done while the island waits for its peers (not timed)
        self.hosts.lead(self.membership.await_peers)
        self._mark("peers")
        anchor.arrived = time.perf_counter()  # a wall-time round 1 starts now, not when θ_0 arrived
        rounds, final_wait, more = 0, 0.0, True
        while more:  # once its data is done the island waits for the end, unless it is handed more (a rewind)
            self.clock.train_since = time.perf_counter()
            anchor, pending, n = self._train(island, anchor, status, ckpt)
            self.clock.stop()
            rounds += n
            if self.guard.drained:
                anchor = self.run_end.drain(island, anchor, pending, lambda p: self._wait(
                    island, p, status, "drain: finish the exchange in flight first", fold=False))
                break
            t0 = time.perf_counter()
            anchor, more = self.run_end.final_wait(anchor, pending, status,
                                                   lambda p: self._fold_in(island, p, status))
            final_wait += time.perf_counter() - t0
        heartbeat.stop()
        self._compiled()
        ckpt.wait()  # the last push's checkpoint is written before the summary (closed by workers.app)
        return self.run_end.finish(island, anchor, status, rounds, t_start, final_wait, self.telemetry,
                                   {**self.pacer.summary, **self.slowdown.summary()})

    def _train(self, island: Island, anchor: GlobalParams, status: IslandStatus,
               ckpt: Checkpointer) -> tuple[GlobalParams, Pending | None, int]:
        """Carries out the planner's actions until it ends the run or the coordinator stops it; returns θ_anchor,
        the exchange still in flight (the last round's, or one cut short by a stop) and the rounds pushed."""
        r = Round(anchor, (island.cursor, island.tokens))
        self.train_log.start(self.executed_steps)
        first = True
        while not self.membership.stopped():
            if not first:  # the first chunk has run: what was compiled meanwhile is needed from now on
                self._compiled()
            first = False
            if self._deferred is None:  # the eval is among the deferred programs: never compiled mid-round
                self.evaluator.requested()
            self.pacer.paced(island, r.anchor)
            rewind = self.membership.take_rewind()
            if rewind is not None:
                r.anchor, moved = self._rewind(island, r.anchor, r.pending, status, rewind, r.start[0])
                r.pending = None  # finished by the rewind
                if moved:
                    r.restart(island)
                continue
            total = self.mailbox.total_versions
            action = agreed_action(self.hosts, next_action(self.pacer.schedule, RoundProgress(
                round_steps=r.steps, island_steps=island.steps, exchange_in_flight=r.pending is not None,
                since_arrival_s=time.perf_counter() - r.anchor.arrived,
                final_version=bool(total) and r.anchor.version >= total,
                end_steps=island.segment[1] // self.batch_size)))
            if action.kind is Kind.END_RUN:
                break
            recovery = self._act(action, island, r, status, ckpt)
            if recovery is not None:  # back to the last push's state (on the healthy devices), or drain
                if self.guard.drained:
                    break
                r.anchor, _ = self._rewind(island, r.anchor, r.pending, status,
                                           Rewind(island.index, r.start[0], recovery.reason), r.start[0], recovery)
                r.pending = None
                r.restart(island)
        self._compiled()
        return r.anchor, r.pending, r.pushed

    def _act(self, action: Action, island: Island, r: Round, status: IslandStatus,
             ckpt: Checkpointer) -> Recovery | None:
        """Carries out one of the planner's WAIT, TRAIN or END_ROUND actions on the round ``r``; a
        :class:`Recovery` when the island's state since its last push is not to be trusted."""
        if action.kind is Kind.WAIT:
            assert r.pending is not None
            r.anchor, r.pending = self._wait(island, r.pending, status, action.reason), None
            return None
        if action.kind is Kind.TRAIN:
            n = action.steps
            t0 = time.perf_counter()
            recovery = self._train_chunk(island, n, status)
            if recovery is None:
                r.steps += n
                if self.startup is not None:
                    self._first_step(island)
                if self.pacer.schedule.round_seconds:  # the deadline is about steps done, not queued: dispatch
                    jax.block_until_ready(island.state.step)  # is async
                    self.pacer.measured(island, r.anchor, status, n, time.perf_counter() - t0)
                if r.pending is not None and self.hosts.agree(r.pending.exchange.future.done()):
                    r.anchor, r.pending = self._fold_in(island, r.pending, status), None  # without waiting
                self.train_log.after_chunk(island, r.anchor, status, self.executed_steps, n)
            return recovery
        recovery = self.guard.settle(island)  # Kind.END_ROUND: the last chunk's chip check read; a device fault
        if recovery is not None:  # or a non-finite step in the round: never pushed
            return self._quarantined(recovery, status)
        # Kind.END_ROUND: the previous exchange is folded in; push this round's delta
        self.guard.pushed()
        r.pending = self._push(island, r.anchor, r.steps, r.start, status, ckpt)
        r.restart(island)
        r.pushed += 1
        return None

    def _train_chunk(self, island: Island, n: int, status: IslandStatus) -> Recovery | None:
        """Runs one chunk of ``n`` inner steps; with chip health, checks it (and diagnoses a chunk that raised).
        A :class:`Recovery` when the island's state since its last push is not to be trusted: a device was
        quarantined (then the guard's ``drained`` is set if too few are left), or a step was not finite."""
        health = self.guard.health
        cursor, metrics = island.cursor, {}
        first = self.guard.next_first(island) if health is not None else 0  # no sync while a check is pending
        try:
            self.slowdown.start()
            advance(self.loop, island, n, self.batch_size, on_chunk=lambda _, m: metrics.update(m))
            self.slowdown.end(island.state.step)
        except Exception as e:
            recovery = self.guard.diagnose(e, first, n) if health is not None else None
            if recovery is None:  # not a device's failure: the error stands
                raise
            return self._quarantined(recovery, status)
        self.executed_steps += n
        # One line per chunk: a killed process's compute is known to within a chunk (goodput).
        self.log.event("trained", steps=n, executed=self.executed_steps, shard=island.index, cursor=island.cursor,
                       tokens=island.tokens)
        status.steps, status.tokens = island.steps, island.tokens
        status.chunk_loss = (status.chunk_loss[0] + 1, metrics["loss"])
        self.guard.watch(metrics["finite"])
        if health is None:
            return None  # the NaN/Inf guard is read at the push (no host sync per chunk)
        return self._quarantined(self.guard.check_chunk(island, first, n, cursor, metrics), status)

    def _mark(self, phase: str) -> None:
        """Ends start-up phase ``phase`` (:mod:`workers.startup`), until the first step."""
        if self.startup is not None:
            self.startup.mark(phase)

    def _first_step(self, island: Island) -> None:
        """After the island's first chunk: its start-up, phase by phase, as an ``island_startup`` event and a
        progress line (once)."""
        startup, self.startup = self.startup, None
        assert startup is not None
        if self._deferred is not None:  # the first chunk is dispatched: the rest compiles while it runs
            self._deferred.start()
        jax.block_until_ready(island.state.step)  # note: host sync, once: the first step's end
        startup.mark("first_step")
        record = startup.record()
        self.log.event("island_startup", steps=island.steps, shard=island.index, cursor=island.cursor, **record)
        self.log.progress(Startup.line(self.name, record))

    def _compiled(self) -> None:
        """Waits for the programs compiling on their own thread since the start (:class:`Deferred`), once; a
        ``compiled`` event says how long they took and how long the loop waited for them."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            waited = deferred.wait()
            self.clock.exclude(waited)  # start-up, not training time: utilization counts neither way
            self.log.event("compiled", seconds=round(deferred.seconds, 3), waited_s=round(waited, 4))

    def _quarantined(self, recovery: Recovery | None, status: IslandStatus) -> Recovery | None:
        """Hands the heartbeat the quarantined devices' evidence after a chip-health recovery."""
        if recovery is not None and recovery.remesh:
            status.quarantined = self.guard.evidence()
        return recovery

    def _fold_in(self, island: Island, pending: Pending, status: IslandStatus, fold: bool = True) -> GlobalParams:
        """Waits for the exchange's θ' (raising its error, if it failed) and folds it in; θ' is the new anchor.
        If the coordinator dropped or rejected the push, a :class:`Rewind` to its cursor is posted: the loop
        then trains the push's range again (the fold-in's progress is discarded there). ``fold=False``: θ' only,
        the island's state is about to be replaced (a :class:`Recovery`)."""
        exchange = pending.exchange
        with self.telemetry.ending(exchange.span):  # the exchange's span ends with its fold-in (or its error)
            result = self.downlink.shared(exchange.future.result)  # process 0's exchange, every process's θ'
            self.telemetry.annotate(exchange.span, version=result.version)
            self._last_exchange = exchange
            with self.telemetry.span("dtrain.fold_in", parent=exchange.span, island=self.mailbox.island_id,
                                     base_version=exchange.base.version, version=result.version, folded=fold):
                if fold:
                    new_global = self.loop.place_params(codec.unflatten(self.spec, result.vec))
                    island.state = island.state.replace(params=fold_in(island.state.params, pending.at_push,
                                                                       new_global))
        self.evaluator.requested()  # first: the heartbeat that reports the new version carries its eval
        status.exchange, status.held = None, (result.version, result.digest)
        resp, h = exchange.response, exchange.header
        if resp is not None and resp.status in NOT_TAKEN and in_segment(island, h.shard_index, h.cursor_start):
            self.mailbox.post_rewind(Rewind(h.shard_index, resp.cursor,
                                            f"push {h.push_id} {pb.PushStatus.Name(resp.status)}: {resp.reason}"))
        return result

    def _rewind(self, island: Island, anchor: GlobalParams, pending: Pending | None, status: IslandStatus,
                rewind: Rewind, start: int, recovery: Recovery | None = None) -> tuple[GlobalParams, bool]:
        """Finishes the exchange in flight, then moves the island as ``rewind`` (or ``recovery``) says
        (:meth:`Rewinder.apply`: ``start`` is the cursor the unpushed progress began at); returns (θ_anchor,
        whether the island moved). A rewind posted meanwhile (the fold-in's own, or a Join's) takes its place."""
        if pending is not None:
            anchor = self._wait(island, pending, status, "rewind: finish the exchange in flight first",
                                fold=recovery is None)
        # The fold-in's own (the coordinator dropped or rejected the push), or a Join's
        later = self.membership.take_rewind()
        if later is not None and (later.joined or not rewind.joined):
            rewind = later
        anchor, moved = self.rewinder.apply(island, anchor, rewind, start, recovery, self._last_exchange, self.ckpt)
        if moved:
            status.devices = self.loop.mesh.devices.size
            status.held, status.steps = (anchor.version, anchor.digest), island.steps
        return anchor, moved

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
        self.clock.blocked_s += waited
        self.log.event("blocked", seconds=round(waited, 4), why=why, version=anchor.version, steps=island.steps)
        return anchor

    def _push(self, island: Island, anchor: GlobalParams, round_steps: int, round_start: tuple[int, int],
              status: IslandStatus, ckpt: Checkpointer) -> Pending:
        """Takes this round's Δ = θ_anchor − θ_local, starts its exchange and checkpoints the island."""
        island_id = self.mailbox.island_id
        span = self.telemetry.start_span("dtrain.exchange", island=island_id, name=self.name,
                                         base_version=anchor.version, steps=round_steps)
        local = self.hosts.gather(island.state.params)  # note: host sync (a gather across processes), once a round
        _, local_vec = codec.flatten(local)
        header = push_header(island_id, anchor.version, island, round_steps, round_start, self.tree_digest,
                             len(self.ranges))
        part = self.ranges[header.fragment]  # the fragment this push carries (the whole θ without fragments)
        if len(self.ranges) == 1:
            at_push = jax.tree.map(jnp.copy, island.state.params)  # kept: the state is donated by training
        else:  # the fold-in then touches this fragment only; a rewind to this push's end keeps the rest
            at_push = self.loop.place_params(codec.unflatten(self.spec, fragments.at_push(anchor.vec, local_vec,
                                                                                          part)))
            self.rewinder.keep_progress(island.index, island.cursor, fragments.unsent(anchor.vec, local_vec, part))
        # Another process of the island sends nothing (process 0 pushes) and waits for the same θ'.
        frame: bytes = b""
        client: PushClient = self.uplink.client
        if self.hosts.leader:
            # Testing only (workers.push_faults): a push fault due now changes what is sent and how.
            frame, client = self.uplink.frame((anchor.vec - local_vec)[part.start:part.end], header)
            self.telemetry.record_ratio(4 * part.size, len(frame), "up")
            self.telemetry.annotate(span, push_id=header.push_id, bytes=len(frame))
        exchange = Exchange(client, self.link.puller, frame, header, anchor, self.mailbox.total_versions,
                            self.mailbox.stopping, self.log.event, self.telemetry, span,
                            stop_told=self.mailbox.stop_told)
        status.exchange = exchange
        if self.hosts.leader:
            exchange.start()
        self.rewinder.checkpoint(island, anchor.version, ckpt)
        return Pending(exchange, at_push)
