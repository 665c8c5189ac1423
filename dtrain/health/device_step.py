"""The per-device inner step: each device's gradient on its own micro-batch, then an explicit mean over devices.

The same step as :func:`dtrain.steps.inner.inner_step` (the same :func:`dtrain.steps.inner.loss_fn`, the same optimizer
``tx`` and update), with the gradient computed in a ``shard_map`` over the island's batch axes: each device
takes ``value_and_grad`` of its own rows of the global batch, and the gradients are averaged by an explicit
``pmean`` over the devices (:func:`dtrain.health.probes.device_grads`, the body the statistics probe runs too).
Between the two, the step has each device's own gradient in hand, which gives it two things the fused step
cannot:

- a :class:`dtrain.health.faults.DeviceFault` injected into one device's (loss, gradient) inside the real jitted step
  (on CPU the stand-in for a faulty chip; on GPU/TPU, with no fault, a faulty chip perturbs it there itself);
- each device's micro-batch loss, gradient norm and finiteness as metrics of the step (``[D]`` per step, in
  ``mesh.devices.flat`` order): the statistics probe (:meth:`dtrain.health.probes.Probes.grad_stats`) for free.

With no fault it computes the same update as the fused step up to float32 rounding: the mean of equal-sized
micro-batch means (and of their gradients) is the full batch's mean, summed in a different order.
Selected by ``InnerLoop(..., per_device=True)``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtrain.health.faults import DeviceFault
from dtrain.health.probes import device_grads
from dtrain.models.model import ApplyFn
from dtrain.steps.inner import BATCH_AXES, TrainState, lr_value, scaled


def device_inner_step(state: TrainState, batch_BxL1: jax.Array, *, apply: ApplyFn, tx: optax.GradientTransformation,
                      sched_4: jax.Array, mesh: Mesh, fault: DeviceFault | None = None,
                      rows: tuple[int, ...] | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One inner step with per-device gradients. ``rows``: the real rows per device (default: an even split of
    ``batch_BxL1``); with an uneven split the batch comes laid out by :func:`dtrain.steps.inner.pad_rows`. Metrics:
    ``loss`` (the global batch's mean loss), ``grad_norm`` (of the averaged gradient), ``finite`` (every device's
    loss and gradient, and the average, finite), and per device ``[D]``: ``device_loss``, ``device_grad_norm``,
    ``device_finite``."""
    n = mesh.devices.size
    rows = rows or (batch_BxL1.shape[0] // n,) * n
    ids_D = jnp.asarray([d.id for d in mesh.devices.flat], jnp.int32)
    grads, loss_D, norm_D, finite_D = jax.shard_map(
        partial(device_grads, apply, fault, rows), mesh=mesh,
        in_specs=(P(), P(), P(BATCH_AXES), P()),
        out_specs=(P(), P(BATCH_AXES), P(BATCH_AXES), P(BATCH_AXES)))(ids_D, state.params, batch_BxL1, state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    updates = scaled(updates, lr_value(state.step, sched_4))
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    weights_D = jnp.asarray(rows, jnp.float32) / sum(rows)
    metrics = {"loss": jnp.sum(loss_D * weights_D), "grad_norm": grad_norm,
               "finite": jnp.all(finite_D) & jnp.isfinite(grad_norm),
               "device_loss": loss_D, "device_grad_norm": norm_D, "device_finite": finite_D}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def device_inner_steps(state: TrainState, batches_KxBxL1: jax.Array, sched_4: jax.Array, *, apply: ApplyFn,
                       tx: optax.GradientTransformation, mesh: Mesh, fault: DeviceFault | None = None,
                       rows: tuple[int, ...] | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """K per-device inner steps in one ``lax.scan``; metrics come back stacked ``[K]`` (``[K, D]`` per device)."""
    return jax.lax.scan(partial(device_inner_step, apply=apply, tx=tx, sched_4=sched_4, mesh=mesh, fault=fault,
                                rows=rows), state, batches_KxBxL1)
