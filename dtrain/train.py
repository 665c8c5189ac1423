"""The inner step: pure, jitted, sharded over the island's Mesh.

``inner_step(state, batch) -> (state, metrics)`` is a pure function of a
``TrainState`` pytree. :class:`InnerLoop` only binds it to a model and an
optimizer, fuses ``K`` steps into one ``lax.scan`` (on CPU, Python dispatch per
step would dominate a small model), and jits it with ``NamedSharding``s over a
``Mesh(('data', 'fsdp'))`` and buffer donation.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtrain.config import Config, ConfigError, TrainConfig
from dtrain.model import ApplyFn, BuiltModel, Params

if TYPE_CHECKING:
    from dtrain.health import DeviceFault

BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both axes (FSDP is data parallel too)


class TrainState(struct.PyTreeNode):
    step: jax.Array  # int32 scalar: inner steps taken by this island
    params: Params
    opt_state: optax.OptState


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay; decay only on matrices."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw


def loss_fn(apply: ApplyFn, params: Params, batch_BxL1: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``batch[:, :-1] -> batch[:, 1:]``; with ``rows``, of the first
    ``rows`` rows only (the others are padding: a device's share of a batch that does not split evenly)."""
    logits_BxLxV = apply(params, batch_BxL1[:, :-1])
    loss_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch_BxL1[:, 1:])
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


def inner_step(state: TrainState, batch_BxL1: jax.Array, *, apply: ApplyFn,
               tx: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
    loss, grads = jax.value_and_grad(partial(loss_fn, apply))(state.params, batch_BxL1)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    # The NaN/Inf guard: a non-finite gradient makes its norm non-finite (an overflowing one too), at no extra pass
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def inner_steps(state: TrainState, batches_KxBxL1: jax.Array, *, apply: ApplyFn,
                tx: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
    """K inner steps in one ``lax.scan``; metrics come back stacked ``[K]``."""
    return jax.lax.scan(partial(inner_step, apply=apply, tx=tx), state, batches_KxBxL1)


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


class InnerLoop:
    """Binds the pure step to a model, an optimizer and a mesh, and jits it once per chunk length.

    ``per_device=True`` runs :func:`dtrain.chip_step.device_inner_steps` instead of :func:`inner_steps`: each
    device's gradient on its own micro-batch, then an explicit mean (the same loss and optimizer update), with
    per-device metrics and, for tests and the fault harness, an injected device ``fault``. ``donate=False`` keeps
    the state's buffers alive across :meth:`run` (only benchmarks/mfu.py measures that; islands always donate)."""

    def __init__(self, cfg: Config, model: BuiltModel, mesh: Mesh, *, per_device: bool = False,
                 fault: DeviceFault | None = None, donate: bool = True):
        if fault is not None and not per_device:
            raise ValueError("InnerLoop: a device fault is injected into the per-device step only (per_device=True)")
        self.cfg = cfg
        self.model = model
        self.mesh = mesh
        self.per_device = per_device
        self.fault = fault
        self.tx = make_optimizer(cfg.train)
        fsdp = mesh.shape["fsdp"]
        abstract_state = jax.eval_shape(self._init_state, model.abstract_params)
        self.state_sharding = jax.tree.map(lambda x: NamedSharding(mesh, param_spec(x.shape, fsdp)), abstract_state)
        self.params_sharding = self.state_sharding.params
        self.batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))  # [K, B, L+1]
        self.eval_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
        self._replicated = NamedSharding(mesh, P())
        n_devices, B = mesh.devices.size, cfg.train.batch_size
        # Rows of the global batch per device; uneven only on a remeshed island (the per-device step's padding)
        self.rows = rows_per_device(B, n_devices)
        self.padded_batch = max(self.rows) * n_devices  # the batch as laid out on the devices
        if self.padded_batch != B and not per_device:
            raise ConfigError(f"[train] batch_size: {B} is not divisible by the mesh's {n_devices} devices (an "
                              f"uneven split needs the per-device step: [health] enabled)")
        if B % n_devices:  # eval batches are not padded: each device evaluates them whole (eval is rare)
            self.eval_sharding = self._replicated
        if per_device:
            from dtrain.chip_step import device_inner_steps  # chip_step imports this module (via health)
            steps: Any = partial(device_inner_steps, apply=model.apply, tx=self.tx, mesh=mesh, fault=fault,
                                 rows=self.rows)
        else:
            steps = partial(inner_steps, apply=model.apply, tx=self.tx)
        self._scan = jax.jit(
            steps,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, self._replicated),
            donate_argnums=(0,) if donate else (),  # the old state's buffers are reused for the new one
        )
        self._eval = jax.jit(partial(eval_loss, apply=model.apply),
                             in_shardings=(self.params_sharding, self.eval_sharding),
                             out_shardings=self._replicated)
        self._init = jax.jit(self._init_state, in_shardings=(self.params_sharding,),
                             out_shardings=self.state_sharding)

    def _init_state(self, params: Params) -> TrainState:
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

    def init_params(self, seed: int) -> Params:
        return self.place_params(self.model.init(seed))

    def place_params(self, params: Params) -> Params:
        """A fresh, sharded copy (safe to donate later without touching ``params``)."""
        return jax.tree.map(lambda x, s: jax.device_put(jnp.array(x, copy=True), s), params, self.params_sharding)

    def init_state(self, params: Params) -> TrainState:
        return self._init(self.place_params(params))

    def with_params(self, state: TrainState, params: Params) -> TrainState:
        """Replaces the parameters, keeping the optimizer state (DiLoCo: islands keep AdamW moments)."""
        return state.replace(params=self.place_params(params))

    def run(self, state: TrainState, batches_KxBxL1: np.ndarray) -> tuple[TrainState, dict[str, jax.Array]]:
        """K steps; ``state`` is donated and must not be used afterwards. With an injected dead device, raises
        :class:`dtrain.health.DeadDeviceError` (before dispatch) when it fires on one of the K steps."""
        if self.fault is not None and self.fault.kind == "dead":
            from dtrain.health import check_alive
            ids, first = [int(d.id) for d in self.mesh.devices.flat], int(state.step)  # a host sync: dead faults only
            for step in range(first, first + len(batches_KxBxL1)):
                check_alive(self.fault, ids, step)
        batches = jax.device_put(pad_rows(batches_KxBxL1, self.rows), self.batch_sharding)
        return self._scan(state, batches)

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings, as ``jax.ShapeDtypeStruct``s (no memory)."""
        abstract_state = jax.eval_shape(self._init_state, self.model.abstract_params)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state,
                            self.state_sharding)

    def compile_scan(self, k: int) -> jax.stages.Compiled:
        """The jitted scan of ``k`` steps, compiled ahead of time; its ``cost_analysis()`` and
        ``memory_analysis()`` are XLA's view of the step (benchmarks/mfu.py)."""
        L1 = self.cfg.model.seq_len + 1
        return self._scan.lower(self.abstract_state(), jax.ShapeDtypeStruct(
            (k, self.padded_batch, L1), jnp.int32, sharding=self.batch_sharding)).compile()

    def precompile(self, chunk_lengths: set[int], eval_batches: int = 0) -> None:
        """Compiles the state init, the scan for each chunk length and the eval ahead of time (JAX caches the
        executables, so the first real call of each does not stall training, nor, in a multi-island run, the
        others)."""
        state = self.abstract_state()
        self._init.lower(state.params).compile()
        B, L1 = self.cfg.train.batch_size, self.cfg.model.seq_len + 1
        for k in sorted(chunk_lengths):
            self.compile_scan(k)
        if eval_batches:
            self._eval.lower(state.params, jax.ShapeDtypeStruct((eval_batches, B, L1), jnp.int32,
                                                                sharding=self.eval_sharding)).compile()

    def evaluate(self, params: Params, batches_NxBxL1: np.ndarray) -> float:
        loss = self._eval(params, jax.device_put(batches_NxBxL1, self.eval_sharding))
        return float(loss)  # note: a host-device sync point

    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        return float(optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps,
                                                         t.lr * t.min_lr_ratio)(step))


def chunks(total: int, per_call: int, boundaries: tuple[int, ...] = ()) -> list[int]:
    """Splits ``total`` steps into scan lengths of at most ``per_call`` that never cross a boundary."""
    out, done = [], 0
    stops = sorted({b for b in boundaries if 0 < b < total} | {total})
    for stop in stops:
        while done < stop:
            n = min(per_call, stop - done)
            out.append(n)
            done += n
    return out

