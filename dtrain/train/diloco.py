"""DiLoCo as an outer loop around any inner loop, for islands in one process.

:func:`advance` runs an island's inner steps from its data cursor;
:func:`diloco_round` runs one outer round over several islands with the exact
DiLoCo math (each island its own optimizer state and data shard; all start
the round from the same global θ). The train and simulate commands and the
convergence benchmark are all built from these two.

The outer step on parameter pytrees: :func:`pseudo_gradient` (Δ_i = θ_v − θ_i),
:func:`merge_deltas` (the weighted mean) and :func:`outer_step`, which maps
``dtrain.steps.outer.outer_update`` (the one outer update, shared with the
coordinator's merger) over the pytree and applies it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from dtrain.models.model import Params
from dtrain.steps import outer
from dtrain.steps.inner import TrainState
from dtrain.steps.outer import OuterHParams
from dtrain.train.loop import InnerLoop, chunks


class BatchSource(Protocol):
    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray: ...


class ConcatStream:
    """Several streams read side by side: the batch of synchronous data parallelism over N islands."""

    def __init__(self, streams: Sequence[BatchSource]):
        self.streams = list(streams)

    def batches(self, cursor: int, steps: int, batch_size: int) -> np.ndarray:
        n = len(self.streams)
        if batch_size % n or cursor % n:
            raise ValueError(f"batch {batch_size} and cursor {cursor} must divide over {n} streams")
        # The combined cursor counts sequences from all streams; each stream has given 1/n of them.
        per = batch_size // n
        return np.concatenate([s.batches(cursor // n, steps, per) for s in self.streams], axis=1)


@dataclass
class Island:
    """One replica: its train state, its data, and what it has consumed."""

    index: int
    state: TrainState
    stream: BatchSource
    cursor: int = 0  # sequences consumed from the stream (the resumable data position)
    segment: tuple[int, int] = (0, 0)  # the range of its shard it trains, [start, end) in sequences (a segment,
    #                                    set by the coordinator; end 0: the shard's end)
    steps: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    losses: list[float] = field(default_factory=list)


def advance(loop: InnerLoop, island: Island, steps: int, batch_size: int,
            on_chunk: Callable[[Island, dict[str, jax.Array]], None] | None = None,
            boundaries: tuple[int, ...] = ()) -> Island:
    """Runs ``steps`` inner steps on ``island`` in fused chunks; updates it in place."""
    seq_len = loop.cfg.model.seq_len
    for n in chunks(steps, loop.cfg.train.steps_per_call, boundaries):
        batches = island.stream.batches(island.cursor, n, batch_size)
        island.state, metrics = loop.run(island.state, batches)
        island.cursor += n * batch_size
        island.steps += n
        island.tokens += n * batch_size * seq_len
        if on_chunk is not None:
            on_chunk(island, metrics)
    return island


class OuterState(struct.PyTreeNode):
    version: jax.Array  # int32 scalar: outer steps applied so far (θ_version)
    params: Params  # the global parameters θ_version, float32
    momentum: Params  # the outer momentum m, float32, the same tree as params (stays zero when μ = 0)


def init_outer(params: Params) -> OuterState:
    """Version 0: θ_0 = ``params`` and a zero momentum (placed like the parameters)."""
    return OuterState(version=jnp.zeros((), jnp.int32), params=params,
                      momentum=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))


def pseudo_gradient(global_params: Params, local_params: Params) -> Params:
    """Δ = θ_global − θ_local: the direction the island moved, with the sign of a gradient."""
    return jax.tree.map(lambda glob, loc: (glob - loc).astype(jnp.float32), global_params, local_params)


def merge_deltas(deltas: Sequence[Params], tokens: Sequence[float], staleness: Sequence[int] | None = None,
                 alpha: float = 0.0) -> Params:
    """Token- and staleness-weighted mean of pseudo-gradients (weights: ``outer.merge_weights``)."""
    if len(deltas) != len(tokens) or not deltas:
        raise ValueError(f"need one token count per delta, got {len(deltas)} deltas and {len(tokens)} counts")
    w = outer.merge_weights(tokens, staleness, alpha)
    return jax.tree.map(lambda *ds: sum(w[i] * d for i, d in enumerate(ds)), *deltas)


@partial(jax.jit, static_argnames="hp")
def outer_step(state: OuterState, delta: Params, hp: OuterHParams) -> OuterState:
    """θ_{v+1} = θ_v + u, (u, m') = ``outer.outer_update`` (Δ, m) leaf by leaf: a descent step along the merged
    pseudo-gradient Δ. Jitted, ``hp`` static (one compilation per hyper-parameter record and tree)."""
    steps = jax.tree.map(lambda d, m: outer.outer_update(d, m, hp), delta, state.momentum)  # (u, m') per leaf
    updates = jax.tree.map(lambda _, step: step[0], delta, steps)
    momentum = jax.tree.map(lambda _, step: step[1], delta, steps)
    return OuterState(version=state.version + 1, params=optax.apply_updates(state.params, updates),
                      momentum=momentum)


@dataclass
class RoundResult:
    version: int
    deltas_norm: list[float]
    weights: list[float]
    train_losses: list[float]
    steps: int


def diloco_round(loop: InnerLoop, global_state: OuterState, islands: Sequence[Island], steps: int,
                 batch_size: int, hp: OuterHParams,
                 on_chunk: Callable[[Island, dict[str, jax.Array]], None] | None = None,
                 ) -> tuple[OuterState, RoundResult]:
    """One synchronous DiLoCo round: every island trains ``steps`` from θ_v, then one outer step."""
    deltas, tokens = [], []
    for island in islands:
        island.state = loop.with_params(island.state, global_state.params)
        before = island.tokens
        advance(loop, island, steps, batch_size, on_chunk)
        deltas.append(pseudo_gradient(global_state.params, island.state.params))
        tokens.append(island.tokens - before)
    merged = merge_deltas(deltas, tokens)
    new_state = outer_step(global_state, merged, hp)
    weights = outer.merge_weights(tokens)
    result = RoundResult(
        version=int(new_state.version),
        deltas_norm=[float(optax.tree.norm(d)) for d in deltas],  # note: host sync, once per round
        weights=[float(w) for w in weights],
        train_losses=[i.last_loss for i in islands],
        steps=steps)
    return new_state, result


def round_lengths(total_steps: int, inner_steps: int) -> list[int]:
    """H per round; the last round is shorter when H does not divide the total."""
    return [min(inner_steps, total_steps - s) for s in range(0, total_steps, inner_steps)]


def record_loss(island: Island, metrics: dict[str, jax.Array]) -> None:
    """on_chunk hook: keeps the island's last loss (a host sync per chunk)."""
    losses = np.asarray(metrics["loss"])
    island.last_loss = float(losses[-1])
    island.losses.extend(float(x) for x in losses)


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


@jax.jit
def fold_in(local: optax.Params, at_push: optax.Params, global_params: optax.Params) -> optax.Params:
    """The synchronize step of overlapped DiLoCo (Streaming DiLoCo), pure: θ_local ← θ' + (θ_local − θ_at_push).

    An island that trained on while its push was in flight takes the new global θ' and keeps the progress made
    since the push, so its next pseudo-gradient covers exactly the steps since then. With nothing trained since
    the push (``local`` equal to ``at_push``) it is θ' exactly: plain DiLoCo."""
    return jax.tree.map(lambda x, a, g: g + (x - a), local, at_push, global_params)
