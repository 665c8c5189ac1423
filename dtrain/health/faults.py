"""Device faults injected into an island's computations: the stand-in for a faulty chip in tests and the harness.

A :class:`DeviceFault` perturbs one device's outputs inside a jitted computation (:func:`inject`), keyed by the
device's ``id``: its results scaled, bits flipped (always or with a probability per call, from a key folded with
the step), or its computation raising (a dead device: :func:`check_alive`, on the host at dispatch, raises
:class:`DeadDeviceError` as a lost chip's ``XlaRuntimeError`` reaches a worker). On CPU the fake devices of
``--xla_force_host_platform_device_count`` are the devices; on GPU/TPU a real fault takes the place of
:func:`inject`. The probes that find these faults are :mod:`dtrain.health.probes`; the per-device step they are
injected into is :mod:`dtrain.health.device_step`. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

FAULT_KINDS = ("scale", "bitflip", "dead")
# DeviceFault's options as a fault spec gives them (--fault device-KIND, --device-fault): their types, and the kinds
# each applies to (the one table the driver's and the worker's parsers read)
FAULT_OPTIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "prob": (float, FAULT_KINDS), "seed": (int, FAULT_KINDS), "until": (int, FAULT_KINDS),
    "factor": (float, ("scale",)), "bit": (int, ("bitflip",)), "rate": (float, ("bitflip",))}


@dataclass(frozen=True)
class DeviceFault:
    """One device's outputs perturbed inside the jitted probes (:mod:`dtrain.health.probes`) and the per-device
    step (:mod:`dtrain.health.device_step`). Hashable: a static argument of ``jit``."""

    kind: str  # "scale": outputs × factor; "bitflip": bit `bit` flipped; "dead": its computations raise
    device: int  # the JAX device id of the faulty device
    prob: float = 1.0  # probability that the fault fires on one call (1: always; below 1: intermittent)
    factor: float = 10.0  # "scale": the factor
    bit: int = 22  # "bitflip": which bit of each float32 element (22: the mantissa's highest; 30: exponent's)
    rate: float = 1.0  # "bitflip": fraction of elements whose bit flips when the fault fires
    seed: int = 0  # the fault's key: fold_in(PRNGKey(seed), step) decides firing and flipped elements
    start: int = 0  # the first inner step the fault can fire on (the onset of a chip going bad)
    until: int = 0  # the first inner step it no longer fires on (0: never stops; a transient fault: start + 1)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"DeviceFault.kind: {self.kind!r} is not one of {FAULT_KINDS}")
        if self.device < 0:
            raise ValueError(f"DeviceFault.device: {self.device} is not a device id (>= 0)")
        if not 0.0 < self.prob <= 1.0:
            raise ValueError(f"DeviceFault.prob: {self.prob} is not in (0, 1]")
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"DeviceFault.rate: {self.rate} is not in (0, 1]")
        if not 0 <= self.bit < 32:
            raise ValueError(f"DeviceFault.bit: {self.bit} is not a bit of a 32-bit float (0..31)")
        if not math.isfinite(self.factor):
            raise ValueError(f"DeviceFault.factor: {self.factor} is not finite")
        if self.start < 0:
            raise ValueError(f"DeviceFault.start: {self.start} is not an inner step (>= 0)")
        if self.until and self.until <= self.start:
            raise ValueError(f"DeviceFault.until: {self.until} must be after start ({self.start}), or 0 (never stops)")


    def found_by(self, evidence: Mapping[str, Any]) -> bool:
        """Whether a quarantine's evidence (``device``, ``step``) found this fault: its device, at or after the
        step it could first fire on (an earlier quarantine of the device is a false positive)."""
        return evidence.get("device") == self.device and int(evidence.get("step", -1)) >= self.start


class DeadDeviceError(RuntimeError):
    """A computation was dispatched to a device injected as dead (what a lost chip's ``XlaRuntimeError`` is to a
    worker)."""


def _fires(fault: DeviceFault, step: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """(does the fault fire at ``step``, the key for its bit flips): the same draw in a jitted computation and on
    the host. Only on steps in ``[fault.start, fault.until)``."""
    fire_key, flip_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(fault.seed), step))
    window = jnp.asarray(step) >= fault.start
    if fault.until:
        window &= jnp.asarray(step) < fault.until
    return jax.random.bernoulli(fire_key, fault.prob) & window, flip_key


def check_alive(fault: DeviceFault | None, device_ids: Sequence[int], step: int) -> None:
    """Raises :class:`DeadDeviceError` if ``fault`` is a dead device among ``device_ids`` that fires at ``step``.

    Called on the host before dispatching a computation to those devices. A dead device is modelled here and not
    inside the computation: a computation that raises on one device (an ``io_callback``) inside a program with
    collectives leaves the other fake CPU devices waiting at the rendezvous until XLA aborts the process, and a
    raising callback leaves JAX's runtime token failed for the rest of the process."""
    if fault is not None and fault.kind == "dead" and fault.device in device_ids and bool(_fires(fault, step)[0]):
        raise DeadDeviceError(f"device {fault.device} is dead (injected fault, step {step})")


def _flip(x: jax.Array, key: jax.Array, fault: DeviceFault) -> jax.Array:
    if x.dtype.itemsize != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x  # bit flips are modelled on 32-bit floats only (gradients, losses, probe results)
    mask = jax.random.bernoulli(key, fault.rate, x.shape)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    flipped = jnp.where(mask, bits ^ jnp.uint32(1 << fault.bit), bits)
    return jax.lax.bitcast_convert_type(flipped, x.dtype)


def inject(tree: Any, device_id: jax.Array | int, step: jax.Array | int, fault: DeviceFault | None) -> Any:
    """``tree`` as the device ``device_id`` would produce it under ``fault`` at ``step`` (jittable; ``fault``
    is static): scaled, or with bits flipped. Identity where ``fault`` is None or "dead" (see
    :func:`check_alive`), on other devices, and on steps where the fault does not fire (probability
    ``fault.prob``)."""
    if fault is None or fault.kind == "dead":
        return tree
    fire, flip_key = _fires(fault, step)
    fires = (jnp.asarray(device_id) == fault.device) & fire
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        bad = x * jnp.asarray(fault.factor, x.dtype) if fault.kind == "scale" else \
            _flip(x, jax.random.fold_in(flip_key, i), fault)
        out.append(jnp.where(fires, bad, x))
    return jax.tree.unflatten(treedef, out)
