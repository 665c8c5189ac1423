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
  version; the island takes it with the θ (:meth:`workers.island.Worker._paced`) and stretches its lr
  schedule again at its rate since round 1.
- **The lr schedule by tokens** (:func:`retimed`): with wall-time rounds an island's step count is its speed x the
  run's length, so its schedule is stretched to the steps it will take at its rate in what is left of the
  run's ``total_versions`` rounds (at each paced round again, at the rate the island kept since round 1): every
  island's schedule ends with the run. The schedule's numbers are an
  input of the compiled step (``InnerLoop.retime``): stretching it compiles nothing. The stretched config is the
  one the island's inner loop is rebuilt from after a remesh too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax

from dtrain.config.sections import Config


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
