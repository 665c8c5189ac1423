"""The island's round planner: a pure function from the schedule and the round's progress to the next action.

The island loop (``workers.island.Worker``) asks :func:`next_action` what to do
at every chunk boundary and does it: train ``n`` steps, wait for the exchange
in flight (and fold its θ in), end the round (push), or end the run. All of the
schedule lives here: step rounds of ``H`` inner steps or wall-time rounds of
``round_seconds``, the overlap budget τ, chunk lengths of at most
``steps_per_call`` that stop exactly at τ, and the total step budget.
:meth:`Schedule.chunk_lengths` replays the planner to find every chunk length a
run uses, so the island compiles exactly those before it joins.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from dtrain.config.sections import Config


class Kind(enum.Enum):
    TRAIN = "train"  # run ``n`` inner steps
    WAIT = "wait"  # block until the exchange in flight returns, then fold its θ in
    END_ROUND = "end_round"  # push this round's delta (no exchange is in flight)
    END_RUN = "end_run"  # no more rounds


@dataclass(frozen=True)
class Action:
    kind: Kind
    steps: int = 0  # TRAIN: the chunk length
    reason: str = ""  # WAIT: why the island blocks (the ``why`` of its ``blocked`` event)


@dataclass(frozen=True)
class Schedule:
    """The island's round schedule, from the config."""

    inner_steps: int  # H: inner steps per round (step rounds)
    steps_per_call: int  # longest fused chunk
    total_steps: int  # the island's step budget (step rounds)
    overlap: bool  # train on while the exchange is in flight
    overlap_steps: int  # τ: steps a round may take with the exchange in flight (0 without overlap)
    round_seconds: float  # > 0: a round is this long after θ arrived (wall-time rounds; H and the budget unused);
    #                       < 0: auto, not resolved yet (a round goes on until it is)
    step_s: float = 0.0  # wall-time rounds: the island's measured seconds per inner step (0: not measured yet)

    @classmethod
    def from_config(cls, cfg: Config) -> Schedule:
        w = cfg.worker
        t = cfg.train  # H and the budget count steps of train.base_batch_size sequences: the island's own steps
        # outer.fragments: a push (of one fragment) every H / fragments steps
        return cls(inner_steps=t.island_steps(cfg.outer.inner_steps // cfg.outer.fragments),
                   steps_per_call=t.steps_per_call,
                   total_steps=t.island_steps(t.steps), overlap=w.overlap,
                   overlap_steps=w.max_overlap_steps if w.overlap else 0, round_seconds=w.round_seconds)

    def chunk_lengths(self) -> set[int]:
        """Every chunk length :func:`next_action` asks for in a run from step 0 (the scan lengths to compile).

        Chunk lengths do not depend on the exchange, only on the steps taken: step rounds replay the first
        round and the last (the rounds between repeat the first); wall-time rounds replay one round until the
        overlap budget is behind it and one more chunk (after that every chunk is ``steps_per_call``)."""
        if self.round_seconds:
            # auto (< 0, not resolved yet): the lengths of a round that has not ended (they do not depend on it);
            # once the step time is measured, the fitted lengths too (they end a round on its deadline)
            probe = dataclasses.replace(self, round_seconds=math.inf, step_s=0.0)
            lengths, done = set(self.fit_lengths()), 0
            while True:
                n = next_action(probe, RoundProgress(round_steps=done, island_steps=done)).steps
                lengths.add(n)
                done += n
                if done > self.overlap_steps:
                    return lengths
        last_start = (max(self.total_steps - 1, 0) // self.inner_steps) * self.inner_steps
        return _round_chunks(self, 0) | _round_chunks(self, last_start)


    def overlap_for(self, round_seconds: float, tau_seconds: float) -> Schedule:
        """Wall-time rounds of ``round_seconds``, with the measured step time: the schedule whose overlap budget
        is at least ``tau_seconds`` of this island's steps (never fewer steps than τ). Auto rounds give every
        island the same time, the share τ / H of the round (``workers.pacing.overlap_seconds``), not the same
        steps: a fast island's τ steps would be over long before the slowest island's push arrived."""
        steps = self.overlap_steps
        if self.overlap and self.step_s > 0 and tau_seconds > 0:
            steps = max(steps, math.ceil(tau_seconds / self.step_s))
        return dataclasses.replace(self, round_seconds=round_seconds, overlap_steps=steps)

    def first_length(self) -> int:
        """The chunk length a run's first round starts with (0 when there is no step to take)."""
        probe = dataclasses.replace(self, round_seconds=math.inf, step_s=0.0) if self.round_seconds else self
        return next_action(probe, RoundProgress(round_steps=0, island_steps=0)).steps

    def fit_lengths(self) -> tuple[int, ...]:
        """Wall-time rounds: the chunk lengths a round with a measured step time is cut into, so that it ends
        within half a step of its deadline: ``steps_per_call`` and the powers of two below it (any step count
        is a sum of a few of them)."""
        out, k = {self.steps_per_call}, 1
        while k < self.steps_per_call:
            out.add(k)
            k *= 2
        return tuple(sorted(out))


@dataclass(frozen=True)
class RoundProgress:
    """Where the island stands, at a chunk boundary."""

    round_steps: int  # inner steps taken in this round
    island_steps: int  # inner steps this island has taken in the run
    exchange_in_flight: bool = False  # the previous round's push (or its pull) has not returned
    since_arrival_s: float = 0.0  # seconds since the current global θ arrived (wall-time rounds end on it)
    final_version: bool = False  # the island holds the run's last global version
    end_steps: int = 0  # step rounds: the island's segment of its shard ends at this island step (0: the schedule's
    #                     total_steps, the shard's end)


def next_action(s: Schedule, p: RoundProgress) -> Action:
    """What the island does next.

    At a round's start the run ends once the island holds the last version, or (step rounds) has taken its
    step budget (to the end of its segment); an exchange still in flight is then finished outside the rounds.
    An exchange in flight is waited for once the round has taken τ steps (without overlap τ = 0: right after
    the push), and before a round may end. A step round ends after H steps (or when the budget runs out); a
    wall-time round ends ``round_seconds`` after the current θ arrived, once it has taken a step; while an
    exchange is in flight that moment is not known yet, and the overlap budget bounds the wait for it. Chunks are
    at most ``steps_per_call`` long and stop exactly at τ in every round, so every round runs the same lengths."""
    budget = p.end_steps or s.total_steps  # step rounds: where the island's data (its segment) ends
    if p.round_steps == 0 and (p.final_version or (not s.round_seconds and p.island_steps >= budget)):
        return Action(Kind.END_RUN)
    if p.exchange_in_flight and p.round_steps >= s.overlap_steps:
        return Action(Kind.WAIT, reason="overlap budget spent" if s.overlap else "no overlap")
    if s.round_seconds:
        left = s.round_seconds - p.since_arrival_s  # < 0 unresolved (auto): never ends by time
        if s.round_seconds > 0 and not p.exchange_in_flight and p.round_steps and (
                left <= 0 or left < s.step_s / 2):
            return Action(Kind.END_ROUND)
        if s.step_s > 0 and s.round_seconds > 0:
            # the steps left to the deadline at the measured step time (with the exchange in flight, a whole
            # chunk: the deadline waits for it), in the fitted lengths
            want = s.steps_per_call if p.exchange_in_flight else max(round(left / s.step_s), 1)
            if p.round_steps < s.overlap_steps:
                want = min(want, s.overlap_steps - p.round_steps)
            return Action(Kind.TRAIN, steps=max(k for k in s.fit_lengths() if k <= want))
        n = s.steps_per_call
    else:
        n = min(s.steps_per_call, s.inner_steps - p.round_steps, budget - p.island_steps)
        if n <= 0:
            if p.exchange_in_flight:
                return Action(Kind.WAIT, reason="round ended before the exchange")
            return Action(Kind.END_ROUND)
    if p.round_steps < s.overlap_steps:
        n = min(n, s.overlap_steps - p.round_steps)
    return Action(Kind.TRAIN, steps=n)


def _round_chunks(s: Schedule, start: int) -> set[int]:
    """The chunk lengths of one step round that starts at island step ``start``."""
    lengths, done = set(), 0
    while (a := next_action(s, RoundProgress(round_steps=done, island_steps=start + done))).kind is Kind.TRAIN:
        lengths.add(a.steps)
        done += a.steps
    return lengths
