"""How fast an island trains, emulated and measured: the slowdown, the rate meter and the auto round length.

- **Slowdown** (:class:`Slowdown`; testing: ``dtrain worker --slowdown K``, what ``dtrain simulate --island
  NAME:slowdown=K`` passes): after each chunk the island waits until the chunk's steps are done, measures how
  long they took (t) and sleeps ``(K - 1) t``, so every step takes K times its measured compute time on whatever
  share of the host it has: slower hardware, emulated on one machine. The sleep counts as compute, as a slower
  chip's time would (the island's utilization does not change); the summary reports the factor and the seconds
  slept.
- **The rate, measured in training** (:class:`RateMeter`, wall-time rounds): the island times its first
  chunks of real training (after the start barrier, every island training at once; the first chunk left out),
  which gives its seconds per step (wall-time rounds then cut each round's last chunks to end it within half a
  step of its deadline: ``workers.rounds``) and, with ``worker.round_seconds = auto``, its token rate, reported
  in every heartbeat from then on (``HeartbeatRequest.tokens_per_s``, constant; the coordinator shows it in
  Status).
- **The auto round length** (:func:`auto_round_seconds`): round 1 of an auto run has no length yet: every
  island trains on and, at each chunk boundary once its own rate is known, reads the others' from Status
  (process 0 asks). When every live island has one it takes ``round_seconds = islands x outer.inner_steps x
  train.base_batch x model.seq_len / the sum of the rates``: the time in which the islands together train the
  tokens of H steps of the run's batch per island, so a round brings in what a step round would and the run's
  ``train.steps`` / H rounds train its tokens whatever the speeds (the slowest island takes fewer than H steps
  a round, the fast ones more). Every island reads the same rates (each reported unchanged to the end), so all
  take the same length; round 1 then ends at that length after the start, or at once if that moment has passed
  (round 1 is at least as long as the slowest island's measurement). Nobody waits for the measurement: the fast islands
  train through it. Each island reports the length it took in its heartbeats, and the coordinator keeps the first
  (``StatusResponse.round_seconds``): an island that joins later (or comes back) takes the run's length as it is
  rather than one of its own.
- **The rounds after the first, paced** (sync rounds; ``coordinator.pacing``): round 1 carries several rounds'
  tokens (the fast islands train through the measurement) and the rates measured in it are not the run's, so the
  coordinator gives each version it commits the length of the round that starts from it
  (``PullHeader.round_seconds``), such that the run merges ``train.steps`` / H step rounds' tokens by its last
  version; the island takes it with the θ (:meth:`Pacer.paced`) and stretches its lr schedule again at its rate
  since round 1.
- **The lr schedule by tokens** (:func:`retimed`): with wall-time rounds an island's step count is its speed x the
  run's length, so its schedule is stretched to the steps it will take at its rate in what is left of the
  run's ``total_versions`` rounds (at each paced round again, at the rate the island kept since round 1): every
  island's schedule ends with the run. The schedule's numbers are an
  input of the compiled step (``InnerLoop.retime``): stretching it compiles nothing. The stretched config is the
  one the island's inner loop is rebuilt from after a remesh too.

:class:`Pacer` carries all of this out for the training loop (:mod:`workers.island`): it owns the island's round
:class:`~workers.rounds.Schedule` and changes it as the rate and the round length become known.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog
from dtrain.train.diloco import Island
from workers.exchange import GlobalParams
from workers.heartbeat import IslandStatus, Mailbox
from workers.hosts import HostGroup
from workers.rounds import Schedule


class Slowdown:
    """Makes each chunk take ``factor`` times its measured compute time (``factor`` 1: nothing). The training
    loop's own."""

    def __init__(self, factor: float = 1.0):
        if not factor >= 1.0:
            raise ValueError(f"slowdown: must be >= 1, got {factor}")
        self.factor = factor
        self.slept_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        """A chunk is about to be dispatched."""
        self._t0 = time.perf_counter()

    def end(self, state_step: jax.Array) -> None:
        """The chunk was dispatched: waits for it (``state_step``: the state's step, ready when it is) and sleeps
        ``(factor - 1)`` x its compute time."""
        if self.factor == 1.0:
            return
        jax.block_until_ready(state_step)
        pause = (self.factor - 1.0) * (time.perf_counter() - self._t0)
        time.sleep(pause)
        self.slept_s += pause

    def summary(self) -> dict[str, float]:
        """What the island's summary says of it (nothing without a slowdown)."""
        return {"slowdown": self.factor, "slowdown_sleep_s": round(self.slept_s, 3)} if self.factor != 1.0 else {}


class RateMeter:
    """The island's training rate, measured in training (wall-time rounds): the chunks after the first ``skip``
    (warm-up), ``chunks`` of them, each timed from its dispatch until its steps are done (the slowdown's sleep and
    the host's time between chunks included: what a round's deadline sees). The training loop's own."""

    def __init__(self, tokens_per_step: int, skip: int = 1, chunks: int = 1):
        self.tokens_per_step, self.skip, self.chunks = tokens_per_step, skip, chunks
        self.seen, self.steps, self.seconds = 0, 0, 0.0

    @property
    def done(self) -> bool:
        return self.seen >= self.skip + self.chunks

    def add(self, steps: int, seconds: float) -> None:
        """One chunk of ``steps`` steps took ``seconds`` (ignored once the rate is known, and while warming up)."""
        if self.done:
            return
        self.seen += 1
        if self.seen > self.skip:
            self.steps, self.seconds = self.steps + steps, self.seconds + seconds

    @property
    def step_s(self) -> float:
        """Seconds per inner step (0 until measured)."""
        return self.seconds / self.steps if self.done and self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second (0 until measured)."""
        return self.steps * self.tokens_per_step / self.seconds if self.done and self.seconds > 0 else 0.0


def auto_round_seconds(cfg: Config, rates: Sequence[float]) -> float:
    """``worker.round_seconds = auto``: the time in which the islands of token ``rates``, together, train the tokens
    of ``outer.inner_steps`` steps of ``train.base_batch`` sequences per island (each island's steps then go as
    its rate, the mean island's are H): a round brings in the tokens of a step round, so ``train.steps`` /
    ``outer.inner_steps`` rounds train the run's tokens whatever the islands' speeds."""
    if not rates or min(rates) <= 0:
        raise ValueError(f"auto round length: needs every island's measured rate, got {list(rates)}")
    return len(rates) * cfg.outer.inner_steps * cfg.train.base_batch * cfg.model.seq_len / sum(rates)


def overlap_seconds(cfg: Config, round_seconds: float) -> float:
    """``worker.round_seconds = auto``: the overlap budget of every island, in seconds: the share τ / H of the round
    (``worker.max_overlap_steps`` / ``outer.inner_steps``, as a step round's τ steps of H), so that a fast island
    trains on past a push as long as the mean island may (the slowest island keeps τ of its own steps at least:
    ``workers.rounds.Schedule.overlap_for``)."""
    return cfg.worker.max_overlap_steps * round_seconds / cfg.outer.inner_steps if cfg.worker.overlap else 0.0


def retimed(cfg: Config, round_seconds: float, seconds_left: float, tokens_per_s: float, done: float = 0.0
            ) -> Config:
    """``cfg`` with its lr schedule stretched over the steps an island of rate ``tokens_per_s`` takes in the run:
    ``done`` steps of ``train.base_batch`` sequences taken, and ``seconds_left`` of training at that rate to come
    (``train.steps`` and ``warmup_steps`` scaled together): the schedules of islands of different speeds end
    together. ``worker.round_seconds`` becomes ``round_seconds``."""
    t = cfg.train
    steps = max(round(done + seconds_left * tokens_per_s / (t.base_batch * cfg.model.seq_len)), 2)
    warmup = min(round(t.warmup_steps * steps / t.steps), steps - 1)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, steps=steps, warmup_steps=warmup),
                               worker=dataclasses.replace(cfg.worker, round_seconds=round_seconds))


class Pacer:
    """The island's round schedule and its pacing (wall-time rounds): the rate measured in training, the auto
    round length, the paced rounds after it, each with the lr schedule stretched (:func:`retimed`). The training
    loop's own (its thread alone calls it); what it decided for the summary is in :attr:`summary`.

    Args: ``cfg``, the run's config (what :func:`retimed` stretches); ``hosts``, the island's processes (process
    0's numbers go to every process); ``status``, the coordinator's Status call (process 0's); ``mailbox``, the
    island's id and the run's total versions; ``retime(cfg)``, hands a stretched config to the parts that train
    from it (the inner loop, recovery's guard); ``log`` and ``name``, the island's."""

    def __init__(self, cfg: Config, hosts: HostGroup, status: Callable[[], pb.StatusResponse], mailbox: Mailbox,
                 retime: Callable[[Config], None], log: RunLog, name: str):
        self.cfg, self.hosts, self.status, self.mailbox, self.retime = cfg, hosts, status, mailbox, retime
        self.log, self.name = log, name
        self.schedule = Schedule.from_config(cfg)
        # wall-time rounds: the island's rate, measured in its first chunks
        self.rate = RateMeter(cfg.train.batch_size * cfg.model.seq_len) if self.schedule.round_seconds else None
        # auto rounds: when the length was decided and the island's steps then; the last version paced
        self._since_decided: tuple[float, int] | None = None
        self._paced_version = 0
        self.summary: dict[str, Any] = {}  # what the island's summary says of the auto round length

    def measured(self, island: Island, anchor: GlobalParams, status: IslandStatus, steps: int,
                 seconds: float) -> None:
        """Wall-time rounds, after a chunk of ``steps`` that took ``seconds`` (the round from ``anchor``): the
        rate meter counts it; once the rate is known the schedule cuts rounds to their deadline, an auto run's
        heartbeats report the rate and, until round 1 has a length, :meth:`_auto_rounds` tries to give it one."""
        rate = self.rate
        assert rate is not None
        if not rate.done:
            rate.add(steps, seconds)
            if not rate.done:
                return
            self.schedule = dataclasses.replace(self.schedule, step_s=rate.step_s)
            if self.schedule.round_seconds < 0:
                status.tokens_per_s = rate.tokens_per_s  # reported unchanged to the end
            self.log.event("rate", tokens_per_s=round(rate.tokens_per_s, 1), step_s=round(rate.step_s, 6),
                           steps=rate.steps)
        if self.schedule.round_seconds < 0:
            self._auto_rounds(island, anchor, status)

    def _auto_rounds(self, island: Island, anchor: GlobalParams, status: IslandStatus) -> None:
        """``worker.round_seconds = auto``, in round 1 once this island's rate is known: once every live island
        reports one (Status, asked by process 0), the round length from their sum, and the lr schedule stretched
        to this island's steps in the run (:func:`retimed`) from the next chunk on: the schedule is an input of
        the compiled step (:meth:`dtrain.train.loop.InnerLoop.retime`), so nothing compiles (a remesh rebuilds the
        loop from the same config). Until then nothing changes: round 1 goes on."""
        assert self.rate is not None
        me = self.mailbox.island_id
        own = self.rate.tokens_per_s

        def rates() -> dict[str, Any]:
            run = self.status()
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
        since = time.perf_counter() - anchor.arrived
        self._since_decided = (time.perf_counter(), island.steps)  # the rate the later retimes take is from here
        steps = self._retime(island, seconds, anchor.version, since, own)
        self.log.event("auto_rounds", round_seconds=round(seconds, 3), rates=[round(x, 1) for x in measured],
                       tokens_per_s=round(own, 1), schedule_steps=steps, versions=self._versions(),
                       round1_s=round(since, 3), decided=bool(answer["decided"]),
                       overlap_steps=self.schedule.overlap_steps)
        why = ("the run's, decided before this island measured" if answer["decided"] else
               f"{len(measured)} islands, {sum(measured):,.0f} tokens/s together")
        self.log.progress(f"{self.name}: auto rounds of {seconds:.2f}s ({why}; this one {own:,.0f} tokens/s, "
                          f"measured in training); lr schedule over {steps} steps")
        self.summary.update(round_seconds=seconds, measured_tokens_per_s=own)

    def _versions(self) -> int:
        return self.mailbox.total_versions or self.cfg.rounds

    def _retime(self, island: Island, seconds: float, version: int, since: float, own: float) -> int:
        """Auto rounds: rounds of ``seconds`` from the one that started ``since`` seconds ago from θ_``version``
        on, and the lr schedule stretched over the steps this island takes at ``own`` tokens/s to the run's end
        (:func:`retimed`; nothing compiles: :meth:`dtrain.train.loop.InnerLoop.retime`; a remesh rebuilds the
        loop from the same config). Returns the schedule's steps."""
        left = max(seconds - since, 0.0) + max(self._versions() - version - 1, 0) * seconds
        t = self.cfg.train
        cfg = retimed(self.cfg, seconds, left, own, done=island.steps * t.batch_size / t.base_batch)
        self.schedule = self.schedule.overlap_for(seconds, overlap_seconds(self.cfg, seconds))
        self.retime(cfg)
        return cfg.train.island_steps(cfg.train.steps)

    def paced(self, island: Island, anchor: GlobalParams) -> None:
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
