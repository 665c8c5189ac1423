"""The inner step's primitives: the pure step, and the mesh and shardings it runs over.

``inner_step(state, batch, sched) -> (state, metrics)`` is a pure function of a :class:`TrainState` pytree: the
next-token loss (:func:`loss_fn`), AdamW or Muon (:func:`make_optimizer`, :func:`muon_optimizer`) at the
scheduled rate (:func:`lr_value`: warm-up, then cosine decay, whose numbers are an input of the step) and the
NaN/Inf guard; :func:`inner_steps` fuses ``K``
of them into one ``lax.scan`` (on CPU, Python dispatch per step would dominate a small model). This module also
owns the island's ``Mesh(('data', 'fsdp'))`` (:func:`make_mesh`,
:data:`BATCH_AXES`), the FSDP sharding rule (:func:`param_spec`) and a global batch's split over the devices
(:func:`rows_per_device`, :func:`pad_rows`). :class:`dtrain.train.loop.InnerLoop` binds them to a model and jits them;
the per-device variant of the step is :mod:`dtrain.health.device_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from dtrain.config.sections import Config, ConfigError, TrainConfig
from dtrain.models.model import Apply, ApplyFn, Params

BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both axes (FSDP is data parallel too)


class TrainState(struct.PyTreeNode):
    """An island's inner-loop state, a pytree: the step count, the parameters and the optimizer's state."""

    step: jax.Array  # int32 scalar: inner steps taken by this island
    params: Params
    opt_state: optax.OptState


SCHEDULE_ARGS = 4  # schedule_args' length: peak lr, warm-up steps, decay steps (warm-up included), final lr


def schedule_args(cfg: TrainConfig) -> np.ndarray:
    """The inner learning-rate schedule as numbers (float32 ``[peak, warmup, decay, end]``), an argument of the
    jitted step rather than constants compiled into it: an island whose schedule is stretched mid-run (wall-time
    rounds, ``workers.pacing``) changes numbers, not programs.

    By tokens, not by steps: ``steps`` and ``warmup_steps`` count steps of ``base_batch_size`` sequences, so an
    island with a smaller batch (more steps for the same tokens, :meth:`TrainConfig.island_steps`) stretches its
    schedule to match, and the schedules of islands that differ end together."""
    return np.asarray([cfg.lr, cfg.island_steps(cfg.warmup_steps), cfg.island_steps(cfg.steps),
                       cfg.lr * cfg.min_lr_ratio], np.float32)


def lr_value(step: jax.Array | int, sched_4: jax.Array | np.ndarray) -> jax.Array:
    """The inner learning rate at ``step`` for :func:`schedule_args` ``sched_4``: linear warm-up from 0 to the peak
    over the warm-up steps, then cosine decay to the final lr at the decay steps, flat after."""
    peak, warmup, decay, end = (sched_4[i] for i in range(SCHEDULE_ARGS))
    c = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(c / jnp.maximum(warmup, 1.0), 1.0)
    t = jnp.clip((c - warmup) / jnp.maximum(decay - warmup, 1.0), 0.0, 1.0)
    cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
    return jnp.where(c < warmup, warm, cosine)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The inner learning rate by step (:func:`lr_value` of :func:`schedule_args`): warm-up, then cosine decay."""
    sched = schedule_args(cfg)
    return lambda step: lr_value(step, sched)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """The inner optimizer's update direction at a learning rate of 1 (after the optional global-norm clip): the step
    scales it by the scheduled rate (:func:`scaled`), which is an input, not part of the optimizer, so that a
    stretched schedule needs no new program.

    ``train.optimizer = "adamw"``: AdamW, decay only on matrices. ``"muon"``: :func:`muon_optimizer`."""
    tx = muon_optimizer(cfg) if cfg.optimizer == "muon" else _adamw(cfg)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return tx


def _adamw(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW at a learning rate of 1, decay only on matrices."""
    return optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                       mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))


ADAMW_TOP_KEYS = ("head", "pos_embed")  # top-level parameters Muon leaves to AdamW, with every "embedding" leaf


def muon_labels(params: Params) -> Params:
    """Each parameter's optimizer under ``train.optimizer = "muon"``: ``"muon"`` for the hidden weight matrices
    (2-D, or stacked ``[..., m, n]``: each trailing matrix on its own), ``"adamw"`` for the embedding tables (a
    leaf named ``embedding``, and the GPT's ``pos_embed``), the output head, and every norm scale and bias (fewer
    than 2 dimensions), as Muon's authors split them."""
    def label(path: tuple[Any, ...], p: Any) -> str:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        adamw = p.ndim < 2 or keys[0] in ADAMW_TOP_KEYS or keys[-1] == "embedding"
        return "adamw" if adamw else "muon"
    return jax.tree_util.tree_map_with_path(label, params)


def _muon_dims(updates: Params) -> Params:
    """Muon's matrix axes for each (masked) update: the last two, reduction then output (``x @ W``); any leading
    axes are a stack of layers, each orthogonalized alone (optax vmaps over them)."""
    return jax.tree.map(lambda u: u if isinstance(u, optax.MaskedNode) else MuonDimensionNumbers(u.ndim - 2,
                                                                                                 u.ndim - 1),
                        updates, is_leaf=lambda u: isinstance(u, optax.MaskedNode))


def _shape_scale(updates: Params, params: Params | None = None) -> Params:
    """Muon's scale of an orthogonalized ``[..., m, n]`` update: ``sqrt(max(1, n / m))`` (fan-out over fan-in; Keller
    Jordan's, so one ``muon_lr`` suits every shape)."""
    del params
    return jax.tree.map(lambda u: u * max(1.0, u.shape[-1] / u.shape[-2]) ** 0.5, updates)


def muon_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Muon (Jordan et al. 2024) on the hidden matrices, AdamW on the rest (:func:`muon_labels`), at a learning
    rate of 1 for AdamW's part: the matrices' part is scaled by ``muon_lr / lr``, so that the scheduled rate,
    ``lr`` at its peak, gives them ``muon_lr``.

    The matrices' direction is optax's own: ``optax.contrib.scale_by_muon`` (Nesterov momentum ``muon_beta``,
    five quintic Newton-Schulz steps with the coefficients (3.4445, -4.7750, 2.0315) after a Frobenius
    normalization, a tall matrix transposed first), then :func:`_shape_scale` (what optax's private
    ``scale_by_shape`` does by default). ``optax.contrib.muon``, which wraps them, is not used whole: its AdamW
    half runs with Nesterov momentum whenever Muon's does (NAdamW, not AdamW) and decays every parameter it holds
    (norms and biases too), so the two halves are put together here with ``optax.partition``, AdamW's half
    exactly the AdamW of ``train.optimizer = "adamw"``."""
    matrices = optax.chain(
        scale_by_muon(beta=cfg.muon_beta, nesterov=True, weight_dimension_numbers=_muon_dims),
        optax.stateless(_shape_scale),
        optax.add_decayed_weights(cfg.muon_weight_decay),
        optax.scale(-cfg.muon_lr / cfg.lr))  # a descent direction, as optax.adamw(1.0)'s
    return optax.partition({"muon": matrices, "adamw": _adamw(cfg)}, muon_labels)


def scaled(updates: Params, lr: jax.Array) -> Params:
    """:func:`make_optimizer`'s updates at learning rate ``lr``."""
    return jax.tree.map(lambda u: (u * lr).astype(u.dtype), updates)


def token_losses(apply: ApplyFn, params: Params, inputs_BxL: jax.Array, targets_BxL: jax.Array,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
    """Each position's next-token cross-entropy ``[B, L]`` (nats). With a :class:`~dtrain.models.model.Apply` whose
    ``loss_chunk`` is set, the head runs on ``loss_chunk`` positions at a time in a ``lax.scan``, each chunk
    under ``jax.checkpoint``: the float32 logits ``[B, L, V]`` are never held whole, forward or backward (each
    chunk's logits are recomputed for its gradient); the same losses as the whole logits' up to float rounding.
    ``positions_BxL``: each token's position in its document (documents kept apart), or None."""
    chunk = apply.loss_chunk if isinstance(apply, Apply) else 0
    if not chunk:
        logits_BxLxV = apply(params, inputs_BxL) if positions_BxL is None else apply(params, inputs_BxL, positions_BxL)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)
    assert isinstance(apply, Apply)
    x_BxLxD = apply.features(params, inputs_BxL, positions_BxL)
    B, L, D = x_BxLxD.shape
    C = min(chunk, L)
    n = -(-L // C)
    pad = n * C - L  # a last partial chunk is padded, its padding's losses dropped
    x_NxBxCxD = jnp.pad(x_BxLxD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, C, D).transpose(1, 0, 2, 3)
    t_NxBxC = jnp.pad(targets_BxL, ((0, 0), (0, pad))).reshape(B, n, C).transpose(1, 0, 2)

    @jax.checkpoint  # the backward pass recomputes this chunk's logits instead of keeping them
    def chunk_losses(params: Params, x_BxCxD: jax.Array, t_BxC: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(apply.head(params, x_BxCxD), t_BxC)

    _, loss_NxBxC = jax.lax.scan(lambda carry, xs: (carry, chunk_losses(params, *xs)), None, (x_NxBxCxD, t_NxBxC))
    return loss_NxBxC.transpose(1, 0, 2).reshape(B, n * C)[:, :L]


def loss_fn(apply: ApplyFn, params: Params, batch_BxL1: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``batch[:, :-1] -> batch[:, 1:]`` (:func:`token_losses`); with
    ``rows``, of the first ``rows`` rows only (the others are padding: a device's share of a batch that does not
    split evenly). A batch ``[B, 2, L + 1]`` (``data.document_masking``: :func:`dtrain.data.corpus.with_positions`)
    is the tokens and their positions in their documents: documents are kept apart. Every next token counts, a
    document's first too."""
    if batch_BxL1.ndim == 3:
        tokens_BxL1, positions_BxL = batch_BxL1[:, 0], batch_BxL1[:, 1, :-1]
    else:
        tokens_BxL1, positions_BxL = batch_BxL1, None
    loss_BxL = token_losses(apply, params, tokens_BxL1[:, :-1], tokens_BxL1[:, 1:], positions_BxL)
    if rows is None:
        return loss_BxL.mean()
    real_B = jnp.arange(loss_BxL.shape[0]) < rows
    return jnp.sum(jnp.where(real_B[:, None], loss_BxL, 0.0)) / (rows * loss_BxL.shape[1])


def rows_per_device(batch_size: int, devices: int) -> tuple[int, ...]:
    """How many rows of a global batch each device takes, in ``mesh.devices.flat`` order: ``B // D`` each, and one
    more for the first ``B % D`` (an island remeshed on fewer devices keeps its global batch)."""
    if batch_size < devices:
        raise ConfigError(f"[train] batch_size: {batch_size} rows cannot give each of {devices} devices one")
    return tuple(batch_size // devices + (j < batch_size % devices) for j in range(devices))


def pad_rows(batches_KxBxL1: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """The batches laid out for devices that take ``counts`` rows each: device j's rows, then padding (copies of
    row 0, masked out by the loss) up to ``max(counts)`` rows per device. Identity when the counts are equal."""
    if len(set(counts)) == 1:
        return batches_KxBxL1
    b = max(counts)
    offsets = np.cumsum((0, *counts[:-1]))
    index = np.concatenate([np.r_[np.arange(o, o + c), np.zeros(b - c, np.int64)]
                            for o, c in zip(offsets, counts, strict=True)])
    return np.take(batches_KxBxL1, index, axis=1)


def inner_step(state: TrainState, batch_BxL1: jax.Array, *, apply: ApplyFn, tx: optax.GradientTransformation,
               sched_4: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step of ``tx`` at the scheduled rate (``sched_4``: :func:`schedule_args`) on the mean loss of
    ``batch_BxL1`` (tokens ``[B, L + 1]``) under ``apply``. Returns the next state and the step's scalar metrics:
    ``loss``, ``grad_norm`` and ``finite`` (the NaN/Inf guard: loss and gradient both finite)."""
    loss, grads = jax.value_and_grad(partial(loss_fn, apply))(state.params, batch_BxL1)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    updates = scaled(updates, lr_value(state.step, sched_4))
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    # The NaN/Inf guard: a non-finite gradient makes its norm non-finite (an overflowing one too), at no extra pass
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def inner_steps(state: TrainState, batches_KxBxL1: jax.Array, sched_4: jax.Array, *, apply: ApplyFn,
                tx: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
    """K inner steps in one ``lax.scan``; metrics come back stacked ``[K]``."""
    return jax.lax.scan(partial(inner_step, apply=apply, tx=tx, sched_4=sched_4), state, batches_KxBxL1)


def eval_loss(params: Params, batches_NxBxL1: jax.Array, *, apply: ApplyFn) -> jax.Array:
    """Mean loss over fixed eval batches."""
    return jax.lax.map(partial(loss_fn, apply, params), batches_NxBxL1).mean()


def make_mesh(cfg: Config, devices: Sequence[Any] | None = None, *, remesh: bool = False) -> Mesh:
    """The island's ``Mesh(('data', 'fsdp'))``; checks the batch divides over it.

    ``remesh``: the mesh of an island rebuilt on its healthy ``devices`` (all of them), for the per-device step,
    which splits a batch unevenly (:func:`rows_per_device`): no divisibility check, ``[mesh] data`` ignored, and
    ``fsdp`` kept only if it divides the device count (else 1: the parameters are replicated)."""
    devices = list(jax.devices() if devices is None else devices)
    fsdp = cfg.mesh.fsdp
    if remesh:
        fsdp = fsdp if len(devices) % fsdp == 0 else 1
        rows_per_device(cfg.train.batch_size, len(devices))
        return Mesh(np.array(devices, dtype=object).reshape(len(devices) // fsdp, fsdp), BATCH_AXES)
    data = cfg.mesh.data if cfg.mesh.data > 0 else len(devices) // fsdp
    if data < 1 or data * fsdp > len(devices):
        raise ConfigError(f"[mesh] data={cfg.mesh.data} fsdp={fsdp}: needs {max(data, 1) * fsdp} devices, "
                          f"{len(devices)} available")
    if cfg.train.batch_size % (data * fsdp):
        raise ConfigError(f"[train] batch_size: {cfg.train.batch_size} is not divisible by the mesh's "
                          f"{data * fsdp} devices (data={data} x fsdp={fsdp})")
    grid = np.array(devices[: data * fsdp], dtype=object).reshape(data, fsdp)
    return Mesh(grid, BATCH_AXES)


def param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """FSDP rule: shard the largest dimension divisible by the fsdp axis; else replicate."""
    if fsdp > 1:
        for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[dim] % fsdp == 0 and shape[dim] >= fsdp:
                spec: list[str | None] = [None] * len(shape)
                spec[dim] = "fsdp"
                return P(*spec)
    return P()
