"""The island's inner loop: the step of :mod:`dtrain.steps.inner` bound to a model, a mesh and chip health, and jitted.

:class:`InnerLoop` binds the pure step (:func:`dtrain.steps.inner.inner_steps`, or with chip health the per-device step
:func:`dtrain.health.device_step.device_inner_steps`) to a model and an optimizer, and jits it once per chunk length
with ``NamedSharding``s over the island's ``Mesh(('data', 'fsdp'))`` and buffer donation; :func:`chunks` cuts a run of
inner steps into the scan lengths it is called with.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtrain.config.sections import Config, ConfigError
from dtrain.health.device_step import device_inner_steps
from dtrain.health.faults import DeviceFault, check_alive
from dtrain.models.model import BuiltModel, Params
from dtrain.steps.inner import (
    BATCH_AXES,
    TrainState,
    eval_loss,
    inner_steps,
    lr_value,
    make_optimizer,
    pad_rows,
    param_spec,
    rows_per_device,
    schedule_args,
)


class InnerLoop:
    """Binds the pure step to a model, an optimizer and a mesh, and jits it once per chunk length.

    Args:
        cfg: the run's config: ``[train]`` gives the optimizer (:func:`dtrain.steps.inner.make_optimizer`) and the
        global
            batch size, ``[model] seq_len`` the batches' length.
        model: the built model whose ``apply`` the step differentiates.
        mesh: the island's ``Mesh(('data', 'fsdp'))`` (:func:`dtrain.steps.inner.make_mesh`); the parameters and the
            optimizer state are sharded over ``fsdp`` by :func:`dtrain.steps.inner.param_spec`, the batches' rows over
            both axes.
        per_device: run :func:`dtrain.health.device_step.device_inner_steps` instead of
        :func:`dtrain.steps.inner.inner_steps`:
            each device's gradient on its own micro-batch, then an explicit mean (the same loss and optimizer
            update), with per-device metrics for chip health; needed on a remeshed island, whose devices take
            uneven shares of the batch (:func:`dtrain.steps.inner.rows_per_device`).
        fault: for tests and the fault harness, a device fault injected into the per-device step (``per_device``
            only).
        donate: ``False`` keeps the state's buffers alive across :meth:`run` (only benchmarks/mfu.py measures
            that; islands always donate).

    Raises:
        ValueError: a ``fault`` without ``per_device``.
        ConfigError: the global batch does not split evenly over the mesh and ``per_device`` is off.

    Attributes callers read: ``cfg``, ``model`` and ``mesh`` (as given); ``rows`` (the real rows of the global
    batch per device, in ``mesh.devices.flat`` order); ``padded_batch`` (the batch's rows as laid out on the
    devices); ``state_sharding``, ``params_sharding`` and ``batch_sharding`` (the ``NamedSharding``s of the
    state, of its parameters and of the ``[K, B, L + 1]`` batches)."""

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
        self._replicated = NamedSharding(mesh, P())
        self._sched = jax.device_put(schedule_args(cfg.train), self._replicated)  # the lr schedule: an input
        fsdp = mesh.shape["fsdp"]
        abstract_state = jax.eval_shape(self._init_state, model.abstract_params)
        self.state_sharding = jax.tree.map(lambda x: NamedSharding(mesh, param_spec(x.shape, fsdp)), abstract_state)
        self.params_sharding = self.state_sharding.params
        self.batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))  # [K, B, L+1]
        self.eval_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
        n_devices, B = mesh.devices.size, cfg.train.batch_size
        # Rows of the global batch per device; uneven only on a remeshed island (the per-device step's padding)
        self.rows = rows_per_device(B, n_devices)
        self.padded_batch = max(self.rows) * n_devices  # the batch as laid out on the devices
        if self.padded_batch != B and not per_device:
            raise ConfigError(f"[train] batch_size: {B} is not divisible by the mesh's {n_devices} devices (an "
                              f"uneven split needs the per-device step: [health] enabled)")
        # Eval batches (of the run's batch size, train.base_batch) are not padded: each device evaluates them whole
        # (eval is rare) when they do not split, and when islands differ (base_batch_size set), so that islands
        # with different meshes compute the same eval loss.
        if cfg.train.base_batch % n_devices or cfg.train.base_batch_size:
            self.eval_sharding = self._replicated
        if per_device:
            steps: Any = partial(device_inner_steps, apply=model.apply, tx=self.tx, mesh=mesh, fault=fault,
                                 rows=self.rows)
        else:
            steps = partial(inner_steps, apply=model.apply, tx=self.tx)
        self._scan = jax.jit(
            steps,
            in_shardings=(self.state_sharding, self.batch_sharding, self._replicated),
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
        """The model's initial parameters for ``seed`` (or ``model.init_from``'s Hugging Face folder:
        :func:`dtrain.models.hf.load_params`), placed on the mesh (sharded as :meth:`place_params`)."""
        if self.model.cfg.init_from:
            from dtrain.config.sections import ConfigError
            from dtrain.models import hf

            try:
                return self.place_params(hf.load_params(self.model.cfg, self.model.abstract_params))
            except hf.HFError as e:
                raise ConfigError(f"model.init_from: {e}") from None
        return self.place_params(self.model.init(seed))

    def place_params(self, params: Params) -> Params:
        """``params`` (a host or device pytree of the model's shapes) as a fresh copy sharded over the mesh: safe
        to donate later without touching ``params``. A host array (θ from a pull) is copied on the host and
        transferred, with no program to run (a copy program per leaf shape would be one more thing a restart loads
        from the compilation cache, leaf by leaf): on a CPU backend the transfer may alias the buffer it is given
        (it did here even with ``may_alias=False``, for some shapes and shardings), so it is given a copy no one
        else holds."""
        return jax.tree.map(lambda x, s: jax.device_put(jnp.array(x, copy=True), s) if isinstance(x, jax.Array)
                            else jax.device_put(np.array(x, copy=True), s), params, self.params_sharding)

    def init_state(self, params: Params) -> TrainState:
        """A step-0 :class:`dtrain.steps.inner.TrainState` from ``params`` (copied onto the mesh) with a fresh optimizer
        state, sharded as the jitted step takes it."""
        return self._init(self.place_params(params))

    def with_params(self, state: TrainState, params: Params) -> TrainState:
        """``state`` with its parameters replaced by a sharded copy of ``params``, keeping the step count and the
        optimizer state (DiLoCo: islands keep their AdamW moments across rounds)."""
        return state.replace(params=self.place_params(params))

    def run(self, state: TrainState, batches_KxBxL1: np.ndarray) -> tuple[TrainState, dict[str, jax.Array]]:
        """K inner steps in one jitted ``lax.scan``.

        Args:
            state: the state to step from; it is donated and must not be used afterwards.
            batches_KxBxL1: K global batches of ``L + 1`` tokens (int32 ``[K, B, L + 1]``, ``B`` the config's
                batch size); laid out for uneven device shares by :func:`dtrain.steps.inner.pad_rows` here.

        Returns:
            ``(state after K steps, metrics)``: each metric stacked ``[K]`` (``loss``, ``grad_norm``, ``finite``),
            and with ``per_device`` also ``[K, D]`` per device (``device_loss``, ``device_grad_norm``,
            ``device_finite``); device arrays, not yet synced to the host.

        Raises:
            dtrain.health.faults.DeadDeviceError: an injected dead device fires on one of the K steps (checked on the
                host before dispatch)."""
        if self.fault is not None and self.fault.kind == "dead":
            ids, first = [int(d.id) for d in self.mesh.devices.flat], int(state.step)  # a host sync: dead faults only
            for step in range(first, first + len(batches_KxBxL1)):
                check_alive(self.fault, ids, step)
        batches = jax.device_put(pad_rows(batches_KxBxL1, self.rows), self.batch_sharding)
        return self._scan(state, batches, self._sched)

    def abstract_state(self) -> TrainState:
        """The :class:`dtrain.steps.inner.TrainState`'s shapes, dtypes and shardings as ``jax.ShapeDtypeStruct``s (no
        memory allocated)."""
        abstract_state = jax.eval_shape(self._init_state, self.model.abstract_params)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state,
                            self.state_sharding)

    def compile_scan(self, k: int) -> jax.stages.Compiled:
        """The jitted scan of ``k`` steps (:meth:`run`'s program), compiled ahead of time and returned; its
        ``cost_analysis()`` and ``memory_analysis()`` are XLA's view of the step (benchmarks/mfu.py)."""
        return self._scan.lower(self.abstract_state(), jax.ShapeDtypeStruct(
            (k, self.padded_batch, *self.row_shape), jnp.int32, sharding=self.batch_sharding), self._sched).compile()

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One sequence of a batch: ``L + 1`` ids, or with ``data.document_masking`` those and their positions."""
        L1 = self.cfg.model.seq_len + 1
        return (2, L1) if self.cfg.data.document_masking else (L1,)

    def precompile(self, chunk_lengths: set[int], eval_batches: int = 0) -> None:
        """Compiles the state init, the scan for each of ``chunk_lengths`` (the ``K`` :meth:`run` will be called
        with) and, when ``eval_batches`` (the number of eval batches :meth:`evaluate` takes) is nonzero, the eval,
        all ahead of time. JAX caches the executables, so the first real call of each does not stall training, nor,
        in a multi-island run, the others."""
        state = self.abstract_state()
        self._init.lower(state.params).compile()
        B = self.cfg.train.base_batch
        for k in sorted(chunk_lengths):
            self.compile_scan(k)
        if eval_batches:
            self._eval.lower(state.params, jax.ShapeDtypeStruct((eval_batches, B, *self.row_shape), jnp.int32,
                                                                sharding=self.eval_sharding)).compile()

    def evaluate(self, params: Params, batches_NxBxL1: np.ndarray) -> float:
        """The mean next-token loss (nats per token) of ``params`` (placed as :meth:`place_params` places them)
        over ``N`` fixed eval batches ``[N, B, L + 1]``. A host-device sync point."""
        loss = self._eval(params, jax.device_put(batches_NxBxL1, self.eval_sharding))
        return float(loss)  # note: a host-device sync point

    def lr_at(self, step: int) -> float:
        """The optimizer's learning rate at inner step ``step`` (warm-up, then cosine decay)."""
        return float(lr_value(step, schedule_args(self.cfg.train)))

    def retime(self, cfg: Config) -> None:
        """Trains on with the lr schedule of ``cfg`` (this loop's config with other ``train.steps`` and
        ``train.warmup_steps``: an island's schedule stretched to the steps it takes in a wall-time run) from the
        next :meth:`run`: the schedule's numbers are an input of the compiled step, so nothing is compiled again."""
        self.cfg = cfg
        self._sched = jax.device_put(schedule_args(cfg.train), self._replicated)


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

