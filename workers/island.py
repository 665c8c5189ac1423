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

This module owns the training loop (:class:`Worker`, on the process's main thread) and :func:`run_worker`.
The loop is composed of one object per concern, each saying which thread writes what: the exchange
(:mod:`workers.exchange`: pushes and pulls, on a thread per round), the heartbeat (:mod:`workers.heartbeat`: its
own thread, which reads the loop's :class:`~workers.heartbeat.IslandStatus` and posts to the loop through a
:class:`~workers.heartbeat.Mailbox`), recovery (:mod:`workers.recovery`: rewinds, the NaN/Inf guard, chip
quarantine and remesh, on the loop's thread), membership (:mod:`workers.membership`: the Join and the
coordinator's word, the same on every process of the island) and the run's end (:mod:`workers.ending`: the drain,
the final wait, the final heartbeat, eval and summary, on the loop's thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.config.sections import ROUND_AUTO, Config
from dtrain.health.faults import DeviceFault
from dtrain.models.hf import spec_of
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import max_frame_bytes
from dtrain.runlog import ELAPSED_S, RunLog, fmt_progress, json_number, process_dir
from dtrain.steps.outer import feedback_decay
from dtrain.telemetry import Telemetry, island_counters, require_exporter
from dtrain.train import fragments
from dtrain.train.diloco import Island, advance, fold_in
from dtrain.train.loop import InnerLoop
from dtrain.train.prepare import Setup, prepare
from workers.chip_health import ChipHealth
from workers.client import CoordinatorClient, RunOverError
from workers.ending import RunEnd
from workers.exchange import (
    NOT_TAKEN,
    Downlink,
    Exchange,
    GlobalParams,
    Pending,
    Puller,
    PushClient,
    Uplink,
    WorkerError,
    push_header,
)
from workers.heartbeat import Clock, Evaluator, Heartbeat, IslandStatus, Mailbox
from workers.hosts import HostGroup
from workers.membership import Membership, RetryLines, report_run_over, run_over_already
from workers.pacing import RateMeter, Slowdown, auto_round_seconds, overlap_seconds, retimed
from workers.push_faults import Injection
from workers.recovery import Guard, Recovery, Rewind, Rewinder, in_segment
from workers.rounds import Action, Kind, RoundProgress, Schedule, next_action
from workers.shard_links import ShardedPuller, ShardedPush, ShardLinks
from workers.startup import Startup, enable_compile_cache

LOGGER = "dtrain.worker"  # the island's progress lines (the command line installs the handler)
log = logging.getLogger(LOGGER)


def agreed_action(hosts: HostGroup, action: Action) -> Action:
    """Process 0's next action on every process of the island (a wall-time round ends by process 0's clock)."""
    if hosts.alone:
        return action
    shared: dict[str, Any] = hosts.agree({"kind": action.kind.value, "steps": action.steps, "reason": action.reason})
    return Action(Kind(shared["kind"]), int(shared["steps"]), str(shared["reason"]))


def precompile(setup: Setup, schedule: Schedule) -> None:
    """Compiles every chunk length the schedule uses, the eval and the fold-in, for ``setup``'s inner loop. Done
    after a remesh, and at the start in two parts (:func:`precompile_first`, then :func:`precompile_rest`): a
    first call that compiles mid-run would stall this island's round and, in sync mode, every other island."""
    precompile_first(setup, schedule)
    precompile_rest(setup, schedule)


def precompile_first(setup: Setup, schedule: Schedule) -> None:
    """Compiles what the island's first chunk runs: the state init and the scan of the schedule's first length."""
    first = schedule.first_length()
    setup.loop.precompile({first} if first else set())


def precompile_rest(setup: Setup, schedule: Schedule) -> None:
    """Compiles the scans of the schedule's other chunk lengths, the eval and the fold-in (what
    :func:`precompile_first` left)."""
    loop = setup.loop
    # the state init again too (compiled already: found in JAX's caches)
    loop.precompile(schedule.chunk_lengths() - {schedule.first_length()}, len(setup.eval_batches))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            loop.model.abstract_params, loop.params_sharding)
    fold_in.lower(abstract, abstract, abstract).compile()


class Deferred:
    """Compiling that can wait (:func:`precompile_rest`), on a thread of its own started (:meth:`start`) once the
    island's first chunk is dispatched: the join, the pull of θ and the first chunk's dispatch, the start's
    critical path, share neither the interpreter's lock nor a core with it, and its work overlaps the first
    chunk's device time. :meth:`wait` (which starts it if nothing did) is called before anything else runs, so
    no program the loop calls compiles mid-round; were one called earlier all the same, JAX would compile it on
    the loop's thread too (jit is thread-safe): slower, never wrong. The training loop's object; the thread
    writes only ``error`` and ``seconds``."""

    def __init__(self, name: str, work: Callable[[], None]):
        self.error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            t0 = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - re-raised on the loop's thread by wait()
                self.error = e
            self.seconds = time.perf_counter() - t0

        self.thread: threading.Thread | None = threading.Thread(target=run, daemon=True, name=f"{name}-compile")
        self.started = False

    def start(self) -> None:
        """Starts the thread (once)."""
        if not self.started and self.thread is not None:
            self.started = True
            self.thread.start()

    def wait(self) -> float:
        """Waits for the thread (once); returns the seconds waited, raising what the compile raised."""
        if self.thread is None:
            return 0.0
        t0 = time.perf_counter()
        self.start()
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0


class TrainLog:
    """The training loop's progress report every ``run.log_every`` steps: steps/s since the last mark (for the
    heartbeat's status), a ``train`` event and the island's status line. The loop's own: no other thread uses it."""

    def __init__(self, cfg: Config, name: str, log: RunLog, clock: Clock, mailbox: Mailbox):
        self.cfg, self.name, self.log, self.clock, self.mailbox = cfg, name, log, clock, mailbox
        self.mark = (time.perf_counter(), 0)  # (time, executed steps) of the last report

    def start(self, executed_steps: int) -> None:
        """Steps/s are measured from now (a :meth:`Worker._train` call begins)."""
        self.mark = (time.perf_counter(), executed_steps)

    def report(self, island: Island, anchor: GlobalParams, status: IslandStatus, executed_steps: int) -> None:
        """Measures steps/s since the last mark (from the steps this process ran, ``executed_steps``), records a
        ``train`` event (the latest chunk's mean loss) and shows the island's status line."""
        jax.block_until_ready(island.state.step)  # note: host sync, once per log interval
        now = time.perf_counter()
        # From the steps this process ran, not the island's position: a rewind moves that back (or to another
        # shard), and a negative rate would have the coordinator refuse the island's heartbeats.
        status.steps_per_s = (executed_steps - self.mark[1]) / max(now - self.mark[0], 1e-9)
        self.mark = (now, executed_steps)
        cfg = self.cfg
        tokens_per_s = status.steps_per_s * cfg.train.batch_size * cfg.model.seq_len
        if cfg.worker.round_seconds != ROUND_AUTO:  # auto rounds: the measured rate stands (workers.pacing)
            status.tokens_per_s = tokens_per_s
        loss = status.read_loss()
        self.log.event("train", step=island.steps, loss=json_number(loss), tokens=island.tokens,
                       tokens_per_s=round(tokens_per_s, 1), version=anchor.version, shard=island.index,
                       cursor=island.cursor, utilization=round(self.clock.utilization(), 4))
        total = self.mailbox.total_versions
        shard_end = cfg.train.shard_sequences  # sequences per shard (step rounds)
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
    in the global θ that comes back, until the run's last version (:meth:`run`).

    Args: ``cfg``, the run's config; ``address``, the coordinator's HOST:PORT; ``name``, the island's name;
    ``run_dir``, its folder (events, summary, checkpoints); ``quiet``, no progress lines; ``inject``, push faults
    and ``device_fault``, a faulty device inside the island (testing only: :mod:`workers.push_faults`,
    :mod:`dtrain.health.faults`); ``hosts``, the island's processes when it spans several (:mod:`workers.hosts`):
    process 0 talks to the coordinator.

    Its own attributes belong to the training loop's thread (``telemetry`` is built at the first Join, the
    loop's; a rejoin's, on the heartbeat thread, finds it built). What other threads share is in objects that
    say per field who writes it: :attr:`mailbox` (with the heartbeat thread), the :class:`IslandStatus` the
    heartbeat reports, :attr:`clock` (read by the heartbeat), each :class:`Exchange` and the :class:`Puller`
    (with the exchange threads). ``client`` is thread-safe; its retries report through a
    :class:`~workers.membership.RetryLines` on whichever thread retries."""

    def __init__(self, cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False,
                 inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
                 hosts: HostGroup | None = None, slowdown: float = 1.0, startup: Startup | None = None):
        self.hosts = hosts or HostGroup.single()
        # the start timed by phase (run_worker's, which timed the phases before this); done at the first step
        self.startup: Startup | None = startup or Startup(None, imports=False)
        self._deferred: Deferred | None = None  # compiling that waits for the first chunk (run)
        # auto rounds: when the length was decided and the island's steps then; the last version paced
        self._since_decided: tuple[float, int] | None = None
        self._paced_version = 0
        self.slowdown = Slowdown(slowdown)  # testing: emulated slower hardware (workers.pacing)
        # Push faults need nothing of the other processes: process 0 alone sends the island's pushes (_push).
        if not self.hosts.alone and (cfg.health.enabled or device_fault is not None):
            raise WorkerError(f"an island of {self.hosts.count} processes cannot run chip health ([health] enabled) "
                              f"or device faults yet: run it as one process per island, or set [health] enabled = "
                              f"false")
        self.cfg, self.name, self.run_dir = cfg, name, Path(run_dir)
        require_exporter(cfg.telemetry)  # a missing extra, before anything slow
        # Process 0 writes the island's events and summary; another process its own, under process-I, quietly.
        self.log = RunLog(process_dir(self.run_dir, self.hosts.index), quiet=quiet or not self.hosts.leader,
                         logger=LOGGER)
        # Built at the first Join (its Resource names the run id); until then it records nothing.
        self.telemetry = Telemetry.disabled()
        self.mailbox = Mailbox()
        self.client = CoordinatorClient(address, cfg, on_retry=RetryLines(name, cfg, self.log),
                                        give_up=self.mailbox.stopping)
        self.clock = Clock()
        self.ckpt: Checkpointer | None = None
        self.executed_steps = 0  # inner steps this process has run (rewound ones too): the compute it spent
        self._last_exchange: Exchange | None = None  # the last one folded in
        self._build(inject, device_fault)

    def _build(self, inject: Sequence[Injection], device_fault: DeviceFault | None) -> None:
        """The model, mesh and inner loop, the parameter tree's layout, and the loop's parts."""
        cfg = self.cfg
        # Chip health ([health] enabled) runs the per-device step, whose metrics are the statistics probe; so does an
        # injected device fault (the fault lives in that step), detected or not.
        self.setup = prepare(cfg, cfg.outer.islands, per_device=cfg.health.enabled or device_fault is not None,
                             fault=device_fault)
        self._mark("data")
        health = ChipHealth(cfg.health, self.loop.model.apply, self.loop.mesh, fault=device_fault) \
            if cfg.health.enabled else None
        self.guard = Guard(cfg, self.setup, health, device_fault, self.log, self.name)
        self.schedule = Schedule.from_config(cfg)
        # wall-time rounds: the island's rate, measured in its first chunks (workers.pacing)
        self.rate = RateMeter(cfg.train.batch_size * cfg.model.seq_len) if self.schedule.round_seconds else None
        self.spec = spec_of(self.setup.built.abstract_params)  # from the shapes: θ comes from the coordinator
        self.n = codec.spec_size(self.spec)
        self.tree_digest = codec.spec_digest(self.spec)
        self.ranges = fragments.plan_spec(self.spec, cfg.outer.fragments)  # outer.fragments: one per push, in turn
        self.membership = Membership(cfg, self.name, self.client, self.hosts, self.mailbox, self.log, self.setup,
                                     (self.n, self.tree_digest), self._joined_run)
        # coordinator.shards > 1: θ's ranges, each pushed to and pulled from its coordinator shard
        shards = cfg.coordinator.shards
        self.shard_ranges = fragments.plan_spec(self.spec, shards, "[coordinator] shards") if shards > 1 else ()
        self.links: ShardLinks | None = None
        if self.shard_ranges:
            self.links = ShardLinks(cfg, self.client, self.shard_ranges, lambda address: CoordinatorClient(
                address, cfg, on_retry=RetryLines(self.name, cfg, self.log), give_up=self.mailbox.stopping))
            self.puller: Puller = ShardedPuller(self.links, self.n, lambda m: max_frame_bytes(m, cfg.codec.block),
                                                self.log.event)
        else:
            self.puller = Puller(self.client, self.n, max_frame_bytes(self.n, cfg.codec.block), self.log.event,
                                 self.ranges)
        self.downlink = Downlink(self.puller, self.hosts, self.n, lambda: self.mailbox.island_id)
        self.uplink = Uplink(cfg.codec, self.n, inject, self.client, self.log.event, feedback_decay(cfg), self.ranges,
                             self.shard_ranges)
        self.evaluator = Evaluator(self.setup, self.spec, self.downlink, self.mailbox, self.clock, self.log)
        self.train_log = TrainLog(cfg, self.name, self.log, self.clock, self.mailbox)
        self.rewinder = Rewinder(cfg, self.setup, self.spec, self.guard, self.hosts, self.log, self.name,
                                 self.downlink.pull, lambda: precompile(self.setup, self.schedule))
        self.run_end = RunEnd(cfg, self.name, self.hosts, self.client, self.mailbox, self.membership, self.downlink,
                              self.evaluator, self.guard, self.uplink, self.clock, self.setup, self.log,
                              links=self.links)

    def _joined_run(self, reply: pb.JoinResponse) -> None:
        """At a Join (the first is the training loop's): the island's telemetry starts, named after the run; the
        links to a sharded coordinator's range shards are made (their addresses are in the reply)."""
        if self.links is not None:
            self.links.connect(reply.shard_addresses)
        run_id = reply.run_id
        if self.telemetry.enabled or self.cfg.telemetry.exporter == "none":
            return
        self.telemetry = Telemetry(self.cfg.telemetry, "island", self.name, run_id)
        island_counters(self.telemetry, lambda: self.client.bytes_up, lambda: self.client.bytes_down)
        self.log.subscribe(self.telemetry.on_event)

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
        if self.hosts.alone and self.schedule.round_seconds >= 0:
            # the first chunk's programs now, the rest while the first chunk trains
            precompile_first(self.setup, self.schedule)
            self._deferred = Deferred(self.name, lambda: precompile_rest(self.setup, self.schedule))
        else:
            # An island of several processes compiles in step with its other processes. With auto rounds round 1
            # lasts until every island has timed its training: a wait for compiles after the first chunk would
            # hold every island's round 1 open (and fill it with the fast islands' tokens) meanwhile.
            precompile(self.setup, self.schedule)
        self._mark("compile")
        ckpt = self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=1)
        # Only now join: everything slow is done, so "joined" means "about to train" for the start barrier.
        try:
            joined = self.membership.join_island()
        except RunOverError as e:  # it ended before this island joined
            self._compiled()
            return self.run_end.run_over(f"{e.message} (coordinator at {self.client.address})")
        self._mark("join")
        # Heartbeats start with the lease, on their own thread: the first pull (a whole θ) and the restore may
        # take longer than a lease, and nothing the training loop does may delay them.
        status = IslandStatus(held=(joined.version, ""), steps=0, tokens=0, devices=self.loop.mesh.devices.size,
                              quarantined=self.guard.evidence())
        heartbeat = Heartbeat(self.client, status, self.mailbox, self.cfg.worker.heartbeat_s, self.log.event,
                              rejoin=self.membership.join, utilization=self.clock.utilization)
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
        ckpt.close()
        self.ckpt = None
        self.run_end.extra.update(self.slowdown.summary())
        return self.run_end.finish(island, anchor, status, rounds, t_start, final_wait, self.telemetry)

    def _measured(self, island: Island, r: Round, status: IslandStatus, steps: int, seconds: float) -> None:
        """Wall-time rounds, after a chunk of ``steps`` that took ``seconds``: the rate meter counts it; once the
        rate is known the schedule cuts rounds to their deadline, an auto run's heartbeats report the rate and,
        until round 1 has a length, :meth:`_auto_rounds` tries to give it one."""
        rate = self.rate
        assert rate is not None
        if not rate.done:
            rate.add(steps, seconds)
            if not rate.done:
                return
            self.schedule = dataclasses.replace(self.schedule, step_s=rate.step_s)
            if self.schedule.round_seconds < 0:
                status.tokens_per_s = rate.tokens_per_s  # reported unchanged to the end (workers.pacing)
            self.log.event("rate", tokens_per_s=round(rate.tokens_per_s, 1), step_s=round(rate.step_s, 6),
                           steps=rate.steps)
        if self.schedule.round_seconds < 0:
            self._auto_rounds(island, r, status)

    def _auto_rounds(self, island: Island, r: Round, status: IslandStatus) -> None:
        """``worker.round_seconds = auto``, in round 1 once this island's rate is known: once every live island
        reports one (Status, asked by process 0), the round length from their sum, and the lr schedule stretched
        to this island's steps in the run (:func:`workers.pacing.retimed`) from the next chunk on: the schedule is
        an input of the compiled step (:meth:`dtrain.train.loop.InnerLoop.retime`), so nothing compiles (a remesh
        rebuilds the loop from the same config). Until then nothing changes: round 1 goes on."""
        assert self.rate is not None
        me = self.mailbox.island_id
        own = self.rate.tokens_per_s

        def rates() -> dict[str, Any]:
            run = self.client.status()
            live = [i for i in run.islands if i.state == "live" and i.island_id != me]
            if run.round_seconds:  # decided already (this island joined late, or restarted): the run's length
                return {"decided": run.round_seconds, "rates": [own]}
            if any(not i.tokens_per_s for i in live):
                return {}
            return {"decided": 0.0, "rates": [i.tokens_per_s for i in live] + [own]}

        answer = self.hosts.lead(rates)  # process 0's answer, its own rate last: the same on every process
        if not answer:
            return
        measured: list[float] = answer["rates"]
        own = measured[-1]
        seconds = answer["decided"] or auto_round_seconds(self.cfg, measured)
        status.round_seconds = seconds  # reported from now on: the run's length for an island that joins later
        since = time.perf_counter() - r.anchor.arrived
        self._since_decided = (time.perf_counter(), island.steps)  # the rate the later retimes take is from here
        steps = self._retime(island, seconds, r.anchor.version, since, own)
        self.log.event("auto_rounds", round_seconds=round(seconds, 3), rates=[round(x, 1) for x in measured],
                       tokens_per_s=round(own, 1), schedule_steps=steps, versions=self._versions(),
                       round1_s=round(since, 3), decided=bool(answer["decided"]),
                       overlap_steps=self.schedule.overlap_steps)
        why = ("the run's, decided before this island measured" if answer["decided"] else
               f"{len(measured)} islands, {sum(measured):,.0f} tokens/s together")
        self.log.progress(f"{self.name}: auto rounds of {seconds:.2f}s ({why}; this one {own:,.0f} tokens/s, "
                          f"measured in training); lr schedule over {steps} steps")
        self.run_end.extra.update(round_seconds=seconds, measured_tokens_per_s=own)

    def _versions(self) -> int:
        return self.mailbox.total_versions or self.cfg.rounds

    def _retime(self, island: Island, seconds: float, version: int, since: float, own: float) -> int:
        """Auto rounds: rounds of ``seconds`` from the one that started ``since`` seconds ago from θ_``version``
        on, and the lr schedule stretched over the steps this island takes at ``own`` tokens/s to the run's end
        (:func:`workers.pacing.retimed`; nothing compiles: :meth:`dtrain.train.loop.InnerLoop.retime`; a remesh
        rebuilds the loop from the same config). Returns the schedule's steps."""
        left = max(seconds - since, 0.0) + max(self._versions() - version - 1, 0) * seconds
        t = self.cfg.train
        cfg = retimed(self.cfg, seconds, left, own, done=island.steps * t.batch_size / t.base_batch)
        self.schedule = self.schedule.overlap_for(seconds, overlap_seconds(self.cfg, seconds))
        self.guard.cfg = cfg
        self.setup.loop.retime(cfg)
        return cfg.train.island_steps(cfg.train.steps)

    def _paced(self, island: Island, anchor: GlobalParams) -> None:
        """Auto rounds, once this island has a length: a θ that came with the length of the round starting from
        it (``PullHeader.round_seconds``, the coordinator's pacing: ``coordinator.pacing``) sets the round
        length from now on, and the lr schedule is stretched again at the island's rate since the length was
        decided (process 0's: the same numbers on every process). Once per version."""
        if (self.schedule.round_seconds <= 0 or anchor.round_seconds <= 0 or anchor.version <= self._paced_version
                or self._since_decided is None):
            return
        self._paced_version = anchor.version
        t0, steps0 = self._since_decided
        t = self.cfg.train

        def rate() -> float:
            elapsed, done = time.perf_counter() - t0, island.steps - steps0
            measured = self.rate.tokens_per_s if self.rate is not None else 0.0
            return done * t.batch_size * self.cfg.model.seq_len / elapsed if elapsed > 1.0 and done else measured

        own = float(self.hosts.lead(rate))
        if own <= 0:
            return
        seconds = anchor.round_seconds
        steps = self._retime(island, seconds, anchor.version, time.perf_counter() - anchor.arrived, own)
        self.log.event("paced", version=anchor.version, round_seconds=round(seconds, 4), tokens_per_s=round(own, 1),
                       schedule_steps=steps)

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
            self._paced(island, r.anchor)
            rewind = self.membership.take_rewind()
            if rewind is not None:
                r.anchor, moved = self._rewind(island, r.anchor, r.pending, status, rewind, r.start[0])
                r.pending = None  # finished by the rewind
                if moved:
                    r.restart(island)
                continue
            total = self.mailbox.total_versions
            action = agreed_action(self.hosts, next_action(self.schedule, RoundProgress(
                round_steps=r.steps, island_steps=island.steps, exchange_in_flight=r.pending is not None,
                since_arrival_s=time.perf_counter() - r.anchor.arrived,
                final_version=bool(total) and r.anchor.version >= total,
                end_steps=island.segment[1] // self.cfg.train.batch_size)))
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
                if self.schedule.round_seconds:  # the deadline is about steps done, not queued: dispatch is async
                    jax.block_until_ready(island.state.step)
                    self._measured(island, r, status, n, time.perf_counter() - t0)
                if r.pending is not None and self.hosts.agree(r.pending.exchange.future.done()):
                    r.anchor, r.pending = self._fold_in(island, r.pending, status), None  # without waiting
                if island.steps % self.cfg.run.log_every < n:
                    self.train_log.report(island, r.anchor, status, self.executed_steps)
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
            advance(self.loop, island, n, self.cfg.train.batch_size, on_chunk=lambda _, m: metrics.update(m))
            self.slowdown.end(island.state.step)
        except Exception as e:
            recovery = self.guard.diagnose(e, first, n) if health is not None else None
            if recovery is None:  # not a device's failure: the error stands
                raise
            return self._quarantined(recovery, status)
        self.executed_steps += n
        # One line per chunk: a killed process's compute is known to within a chunk (goodput).
        self.log.event("trained", steps=n, executed=self.executed_steps, shard=island.index, cursor=island.cursor)
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
        assert self.ckpt is not None
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
        client: PushClient = self.client
        if self.hosts.leader:
            # Testing only (workers.push_faults): a push fault due now changes what is sent and how.
            frame, client = self.uplink.frame((anchor.vec - local_vec)[part.start:part.end], header)
            if self.links is not None:
                client = ShardedPush(self.links)
            self.telemetry.record_ratio(4 * part.size, len(frame), "up")
            self.telemetry.annotate(span, push_id=header.push_id, bytes=len(frame))
        exchange = Exchange(client, self.puller, frame, header, anchor, self.mailbox.total_versions,
                            self.mailbox.stopping, self.log.event, self.telemetry, span,
                            stop_told=self.mailbox.stop_told)
        status.exchange = exchange
        if self.hosts.leader:
            exchange.start()
        self.rewinder.checkpoint(island, anchor.version, ckpt)
        return Pending(exchange, at_push)


def run_worker(cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False,
               inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
               hosts: HostGroup | None = None, slowdown: float = 1.0) -> dict[str, Any]:
    """Runs one island to the end of the run (a :class:`Worker`, cleaned up whatever happens).

    Args: ``cfg``, the run's config; ``address``, the coordinator's HOST:PORT; ``name``, the island's name;
    ``run_dir``, its folder; ``quiet``, no progress lines; ``inject``, push faults, and ``device_fault``, a faulty
    device in the island (testing only: :mod:`workers.push_faults`); ``hosts``, this process's place in an island of
    several processes (:mod:`workers.hosts`); ``slowdown``: every chunk takes this many times its measured
    compute time (testing: emulated slower hardware, :class:`workers.pacing.Slowdown`).

    Returns the island's summary (:meth:`Worker.run`), or ``{"island", "run_over"}`` (exit 0, no training) when
    the run is over already: checked first, before the island builds or compiles anything. Raises what ended
    the island otherwise (a :class:`WorkerError`, a :class:`~workers.client.CoordinatorError`, ...)."""
    hosts = hosts or HostGroup.single()
    t0 = time.time()
    startup = Startup(enable_compile_cache(cfg, Path(run_dir)))  # before anything compiles
    jax.devices()  # JAX's backend, once: its start is a phase of its own
    startup.mark("devices")
    client = CoordinatorClient(address, cfg)
    try:
        def say(line: str) -> None:  # before the island's RunLog exists
            if not quiet and hosts.leader:
                log.info(f"{name}: {line}", extra={ELAPSED_S: time.time() - t0})

        over = hosts.lead(lambda: run_over_already(client, cfg, Path(run_dir), say))  # process 0 asks
    finally:
        client.close()
    startup.mark("check")
    if over:
        return report_run_over(RunLog(process_dir(Path(run_dir), hosts.index), quiet=quiet or not hosts.leader,
                                      logger=LOGGER),
                                name, over)
    worker = Worker(cfg, address, name, run_dir, quiet=quiet, inject=inject, device_fault=device_fault,
                    hosts=hosts, slowdown=slowdown, startup=startup)
    try:
        return worker.run()
    finally:
        worker.mailbox.stopping.set()
        worker.telemetry.shutdown()  # flushes (idempotent: a finished run's was shut down already)
        if worker.ckpt is not None:
            try:
                worker.ckpt.close()  # its async writer thread would otherwise keep a failed process alive
            except Exception as e:  # noqa: BLE001 - already failing; the original error is what matters
                worker.log.event("checkpoint_close_failed", error=str(e))
