"""How fast an island trains, emulated and measured: the slowdown, the calibration and the auto round length.

- **Slowdown** (:class:`Slowdown`; testing: ``dtrain worker --slowdown K``, what ``dtrain simulate --island
  NAME:slowdown=K`` passes): after each chunk the island waits until the chunk's steps are done, measures how
  long they took (t) and sleeps ``(K - 1) t``, so every step takes K times its measured compute time on whatever
  share of the host it has: slower hardware, emulated on one machine. The sleep counts as compute, as a slower
  chip's time would (the island's utilization does not change); the summary reports the factor and the seconds
  slept.
- **Calibration** (:func:`calibrate`, with ``worker.round_seconds = auto``): after it has compiled and before it
  joins, the island times chunks of its step on a throwaway copy of its initial state (the slowdown included)
  and reports the token rate in every heartbeat (``HeartbeatRequest.tokens_per_s``; the coordinator shows it in
  Status).
- **The auto round length** (:func:`auto_round_seconds`): once every island has joined and reported a rate,
  each island reads the rates from Status and takes ``round_seconds = outer.inner_steps x train.base_batch x
  model.seq_len / the slowest rate``: the time the slowest island needs for H steps of the run's batch. Every
  island reads the same rates (each is its calibration, reported until the end), so all take the same length.
- **The lr schedule by tokens** (:func:`retimed`): with wall-time rounds an island's step count is its speed x the
  run's length, so its schedule is stretched to the steps it will take in ``total_versions`` rounds at its rate:
  every island's schedule ends with the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax

from dtrain.config import Config
from dtrain.prepare import Setup


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


def calibrate(setup: Setup, slowdown: float = 1.0, chunks: int = 3) -> float:
    """The island's training rate in tokens per second: ``chunks`` chunks of ``train.steps_per_call`` steps of its
    compiled step on a throwaway state (the first warms up; the fastest of the others counts), each as long as
    the ``slowdown`` makes it. Draws from shard 0 at cursor 0 (nothing of the island's own changes)."""
    loop, cfg = setup.loop, setup.cfg
    n, batch = cfg.train.steps_per_call, cfg.train.batch_size
    batches = setup.shards[0].stream.batches(0, n, batch)
    state = loop.init_state(loop.init_params(cfg.run.seed))
    times = []
    for _ in range(max(chunks, 2)):
        t0 = time.perf_counter()
        state, _ = loop.run(state, batches)
        jax.block_until_ready(state.step)
        times.append(time.perf_counter() - t0)
    return n * batch * cfg.model.seq_len / (min(times[1:]) * slowdown)


def auto_round_seconds(cfg: Config, rates: Sequence[float]) -> float:
    """``worker.round_seconds = auto``: the time the slowest of the islands' token ``rates`` takes for
    ``outer.inner_steps`` steps of ``train.base_batch`` sequences."""
    if not rates or min(rates) <= 0:
        raise ValueError(f"auto round length: needs every island's measured rate, got {list(rates)}")
    return cfg.outer.inner_steps * cfg.train.base_batch * cfg.model.seq_len / min(rates)


def retimed(cfg: Config, round_seconds: float, versions: int, tokens_per_s: float) -> Config:
    """``cfg`` with its lr schedule stretched over the steps an island of rate ``tokens_per_s`` takes in
    ``versions`` wall-time rounds of ``round_seconds`` (``train.steps`` and ``warmup_steps`` scaled together, in
    steps of ``train.base_batch`` sequences): the schedules of islands of different speeds end together."""
    t = cfg.train
    steps = max(round(versions * round_seconds * tokens_per_s / (t.base_batch * cfg.model.seq_len)), 2)
    warmup = min(round(t.warmup_steps * steps / t.steps), steps - 1)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, steps=steps, warmup_steps=warmup),
                               worker=dataclasses.replace(cfg.worker, round_seconds=round_seconds))
