"""Chip health inside an island: the probes that find a faulty device.

Pure functions and a thin binder (:class:`Probes`), no I/O. Every probe reports per device of the island's
``Mesh``; a device is named by its position in ``mesh.devices.flat`` (``index``) and by its JAX ``device.id``
(stable when the mesh is rebuilt without a device).

- **Known answer** (:func:`known_answer_values`, :meth:`Probes.known_answer`): each device, on its own (one
  SPMD program over the mesh, no collective), multiplies the integer-valued float32 matrices ``A[i, k] = i + k``
  and ``B[k, j] = k + j`` (``n = 128``),
  compares every entry with its closed form ``C[i, j] = n·i·j + (i + j)·S1 + S2`` (``S1 = Σk``, ``S2 = Σk²``)
  and sums the entries in int32 (wrapping). Every entry is below 2²⁴ and all terms are non-negative, so the
  float32 matmul is exact in any summation order, at any matmul precision whose mantissa holds 8 bits
  (float32, TF32, bfloat16), and an int32 sum wraps the same way on every backend: a correct device gives
  exactly ``T = 3n·S1² + n²·S2`` (mod 2³², :func:`known_answer_expected`) and zero mismatching entries. A device
  whose computation raises (a dead chip) is reported bad with the error.
- **Per-device statistics** (:meth:`Probes.grad_stats`, :func:`outliers`): each device computes the loss and
  the gradient of *its own* micro-batch (the rows of the global batch the island's step gives it, before the
  cross-device reduction), by :func:`dtrain.steps.inner.loss_fn` in a ``shard_map`` over the mesh; the gradient
  norms are compared across devices by a two-sided robust z-score (median and MAD, with a floor).
- **Deterministic replay** (:meth:`Probes.replay`, :func:`digest`, :func:`majority`): the same small piece of
  work (the loss and gradient of a few rows of one device's micro-batch) is computed on every device by the same
  single-device program, all dispatched at once; each device reduces its result to a bit-exact uint32
  :func:`digest` (any flipped bit changes it), and only the D digests come back to the host. A device whose digest
  differs from a strict majority's, or whose computation raises, is a suspect. This needs deterministic programs:
  on CPU and TPU the same program gives the same bits on every healthy device; on GPU, XLA may pick atomics
  (scatter-add in the embedding's backward pass, some reductions) whose order varies from run to run, so run with
  ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``. Without it the healthy devices' digests differ, no strict
  majority forms and the replay is inconclusive (it flags nothing, and finds nothing).
- **NaN/Inf guard** (:func:`all_finite`): a jittable predicate over any pytrees (loss, gradients).

The faults these probes find are injected by :mod:`dtrain.health.faults` (on CPU, where the fake devices never
fail); on GPU/TPU the probes run unchanged (the same ``shard_map`` and per-device ``jit``) on the real chips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtrain.health.faults import DeviceFault, check_alive, inject
from dtrain.models.model import ApplyFn, Params
from dtrain.steps.inner import BATCH_AXES, loss_fn, rows_per_device
from dtrain.steps.outer import robust_scores

KNOWN_ANSWER_N = 128  # every entry of A @ B is below 2**24 (exact in float32) up to n = 128
STAT_Z_MAX = 6.0  # a device whose micro-batch gradient norm lies further than this from the median is flagged
STAT_SPREAD_FLOOR = 0.5  # the deviation the z-score divides by is at least this fraction of |median|
STAT_ABS_FLOOR = 1e-12  # ... and at least this (identical zero values never flag)


# ---------------------------------------------------------------------------------------------- NaN/Inf guard


def all_finite(*trees: Any) -> jax.Array:
    """True (a bool scalar) iff every entry of every leaf is finite. Jittable."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


# ---------------------------------------------------------------------------------------------- known answer


def known_answer_expected(n: int = KNOWN_ANSWER_N) -> int:
    """The int32 (wrapped) sum of ``A @ B`` in closed form: ``3n·S1² + n²·S2`` mod 2³², as a signed int."""
    s1, s2 = n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6
    total = 3 * n * s1 * s1 + n * n * s2
    return (total + 2**31) % 2**32 - 2**31


def known_answer_values(device_id: jax.Array, step: jax.Array, *, n: int = KNOWN_ANSWER_N,
                        fault: DeviceFault | None = None) -> tuple[jax.Array, jax.Array]:
    """On one device: (the int32 sum of ``A @ B``, how many entries differ from their closed form)."""
    if not 1 <= n <= KNOWN_ANSWER_N:
        raise ValueError(f"known answer: n={n} must be in 1..{KNOWN_ANSWER_N} (larger entries are not exact)")
    idx = jnp.arange(n, dtype=jnp.int32)
    a_NxN = (idx[:, None] + idx[None, :]).astype(jnp.float32)  # A[i, k] = i + k; B[k, j] = k + j is the same
    c_NxN = jnp.matmul(a_NxN, a_NxN, precision=jax.lax.Precision.HIGHEST)
    c_NxN = inject(c_NxN, device_id, step, fault)
    s1, s2 = n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6
    expected_NxN = n * idx[:, None] * idx[None, :] + (idx[:, None] + idx[None, :]) * s1 + s2
    mismatches = jnp.sum(c_NxN != expected_NxN.astype(jnp.float32), dtype=jnp.int32)
    finite = jnp.where(jnp.isfinite(c_NxN), c_NxN, 0.0)  # float->int of NaN/Inf is backend-defined
    return jnp.sum(finite.astype(jnp.int32), dtype=jnp.int32), mismatches


def _device_known_answer(fault: DeviceFault | None, ids_D: jax.Array, step: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """The ``shard_map`` body: this device's :func:`known_answer_values`, each ``[1]``."""
    value, mismatches = known_answer_values(ids_D[0], step, fault=fault)
    return value[None], mismatches[None]


@dataclass(frozen=True)
class KnownAnswer:
    """One device's known-answer result."""

    index: int  # position in mesh.devices.flat
    device_id: int
    ok: bool
    value: int | None  # the int32 sum it got (None when the computation raised)
    expected: int
    mismatches: int | None  # entries of A @ B that differ from the closed form
    error: str | None = None  # the exception, when the computation raised


# ---------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Outlier:
    index: int  # position in the values (= in mesh.devices.flat)
    value: float
    z: float


def robust_z(values: Sequence[float], spread_floor: float = STAT_SPREAD_FLOOR) -> np.ndarray:
    """Two-sided robust z-score of each value against all of them: ``|v − median| / σ`` with
    ``σ = max(1.4826 · MAD, spread_floor · |median|, 1e-12)`` (``dtrain.steps.outer.robust_scores``; the floor keeps a
    tight healthy spread, identical values above all, from flagging). A non-finite value has ``z = inf``; the
    median and MAD are taken over the finite values only."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.any():
        return np.full(v.shape, np.inf)
    return np.abs(robust_scores(v, v[finite], spread_floor, STAT_ABS_FLOOR))


def outliers(values: Sequence[float], z_max: float = STAT_Z_MAX,
             spread_floor: float = STAT_SPREAD_FLOOR) -> list[Outlier]:
    """The values whose :func:`robust_z` exceeds ``z_max`` (non-finite values always), with their z-scores.
    Needs at least 3 values to say which one is odd."""
    if len(values) < 3:
        raise ValueError(f"outliers: {len(values)} values; comparing devices needs at least 3")
    z = robust_z(values, spread_floor)
    return [Outlier(i, float(values[i]), float(z[i])) for i in range(len(values)) if z[i] > z_max]


@dataclass(frozen=True)
class GradStats:
    """Per device (in mesh.devices.flat order): its micro-batch's loss and gradient norm, and whether both
    were finite."""

    device_ids: list[int]
    loss: np.ndarray  # float32 [D]
    grad_norm: np.ndarray  # float32 [D]
    finite: np.ndarray  # bool [D]


def micro_batch_grad(apply: ApplyFn, params: Params, batch_bxL1: jax.Array, device_id: jax.Array, step: jax.Array,
                     fault: DeviceFault | None = None, rows: jax.Array | None = None) -> tuple[jax.Array, Params]:
    """One device's (loss, gradient) of ``loss_fn`` on its micro-batch (its first ``rows`` rows when the rest is
    padding), as that device (``fault``) produces it."""
    loss, grads = jax.value_and_grad(partial(loss_fn, apply))(params, batch_bxL1, rows)
    return inject((loss, grads), device_id, step, fault)


def device_grads(apply: ApplyFn, fault: DeviceFault | None, rows: tuple[int, ...] | None, ids_D: jax.Array,
                 params: Params, batch_bxL1: jax.Array, step: jax.Array
                 ) -> tuple[Params, jax.Array, jax.Array, jax.Array]:
    """The ``shard_map`` body of the per-device step (:mod:`dtrain.health.device_step`) and of the statistics probe
    (:meth:`Probes.grad_stats`): (the gradient of the global batch's mean loss, and this device's own micro-batch
    loss, gradient norm and finiteness, each ``[1]``). ``rows``: the real rows per device (None: an even split)."""
    index = jax.lax.axis_index(BATCH_AXES)
    device_id = ids_D[index]
    # The parameters enter replicated; marked as varying per device, their gradient stays this device's own
    # (the gradient of an invariant input would already be summed over the devices).
    params = jax.tree.map(lambda x: jax.lax.pcast(x, BATCH_AXES, to="varying"), params)
    if rows is None or len(set(rows)) == 1:  # even: the mean of the devices' micro-batch means is the batch's
        loss, grads = micro_batch_grad(apply, params, batch_bxL1, device_id, step, fault)
        mean_grads = jax.lax.pmean(grads, BATCH_AXES)
    else:  # uneven (a remeshed island): device j's mean over its rows[j] real rows, weighted by rows[j] / B
        count = jnp.asarray(rows, jnp.int32)[index]
        loss, grads = micro_batch_grad(apply, params, batch_bxL1, device_id, step, fault, rows=count)
        weight = count.astype(jnp.float32) / sum(rows)
        mean_grads = jax.lax.psum(jax.tree.map(lambda g: g * weight, grads), BATCH_AXES)
    norm = optax.tree.norm(grads)
    # NaN/Inf in the loss or any gradient entry makes the norm non-finite (an overflowing norm is garbage too)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    return mean_grads, loss[None], norm[None], finite[None]



# ---------------------------------------------------------------------------------------------- replay

_MIX_1 = 0x85EBCA6B  # murmur3's 32-bit finalizer constants (odd: multiplying by one is a bijection mod 2**32)
_MIX_2 = 0xC2B2AE35


def _words(x: jax.Array) -> jax.Array:
    """The bits of every element of ``x`` as uint32 words, flat (an 8-byte element is two words)."""
    size = x.dtype.itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32).ravel()
    raise ValueError(f"digest: a leaf of dtype {x.dtype} ({size} bytes per element) has no word layout")


def _mix(w: jax.Array) -> jax.Array:
    """A bijection of uint32 (murmur3's finalizer: xor-shifts and odd multiplications, each invertible)."""
    w = w ^ (w >> 16)
    w = w * jnp.uint32(_MIX_1)
    w = w ^ (w >> 13)
    w = w * jnp.uint32(_MIX_2)
    return w ^ (w >> 16)


def digest(tree: Any) -> jax.Array:
    """A bit-exact uint32 digest of every bit of every leaf of ``tree`` (jittable; one scalar on the device that
    computes it).

    The leaves' elements, bitcast to uint32 words ``x_k`` numbered across the leaves in order, are combined as
    ``Σ_k (2k + 1) · mix(x_k)`` in wrapping uint32 arithmetic, ``mix`` a bijection of uint32 (:func:`_mix`).
    Integer addition mod 2³² is exact and order-free, so every backend and every reduction order gives the same
    digest. Any change to one element, a single flipped bit above all, always changes it: the word changes, so
    ``mix`` of it changes by some ``δ ≢ 0`` (mod 2³²), and the digest by ``(2k + 1) · δ``, which an odd factor
    (invertible mod 2³²) keeps nonzero. Changes to several elements cancel only by a coincidence of the mixed
    words (about one chance in 2³²); the positional weights make a permutation of the elements count as a change,
    and the mixing keeps structured faults (every element scaled by 2: each exponent one higher) from cancelling
    the way a plain weighted sum of the words could."""
    total = jnp.uint32(0)
    offset = 0
    for leaf in jax.tree.leaves(tree):
        words = _words(jnp.asarray(leaf))
        weights = jnp.uint32(2 * offset + 1) + jnp.uint32(2) * jnp.arange(words.size, dtype=jnp.uint32)
        total = total + jnp.sum(weights * _mix(words), dtype=jnp.uint32)
        offset += words.size
    return total


def replay_digest(apply: ApplyFn, params: Params, rows_bxL1: jax.Array, device_id: jax.Array, step: jax.Array,
                  fault: DeviceFault | None = None) -> jax.Array:
    """On one device: the :func:`digest` of the (loss, gradient) of ``rows_bxL1`` (:func:`micro_batch_grad`), as
    that device (``fault``) computes it."""
    return digest(micro_batch_grad(apply, params, rows_bxL1, device_id, step, fault))


def _device_replay_digest(apply: ApplyFn, fault: DeviceFault | None, ids_D: jax.Array, params: Params,
                          rows_bxL1: jax.Array, step: jax.Array) -> jax.Array:
    """The ``shard_map`` body: this device's :func:`replay_digest` of the (replicated) rows, ``[1]``."""
    device_id = ids_D[jax.lax.axis_index(BATCH_AXES)]
    # Marked as varying per device, the parameters' gradient is this device's own computation (no collective).
    params = jax.tree.map(lambda x: jax.lax.pcast(x, BATCH_AXES, to="varying"), params)
    return replay_digest(apply, params, rows_bxL1, device_id, step, fault)[None]


def majority(digests: Sequence[int | None]) -> int | None:
    """The digest more than half of the given ones are (None entries, devices that raised, do not count); None
    when there is no strict majority."""
    got = [d for d in digests if d is not None]
    if not got:
        return None
    best = max(set(got), key=got.count)
    return best if 2 * got.count(best) > len(got) else None


@dataclass(frozen=True)
class Replay:
    """The same piece of work (a few rows' loss and gradient) computed on several devices, each result reduced to
    its :func:`digest` on its device.

    ``suspects``: the devices whose computation raised, and, when a strict majority of the others agree
    (``conclusive``), those whose digest differs from the majority's. With no strict majority (every healthy
    device gives the same bits on deterministic hardware, so this means nondeterministic ops, or several faults)
    only the raising devices are suspects."""

    device_ids: list[int]
    digests: list[int | None]  # per device (in device_ids order); None where the computation raised
    majority: int | None  # the digest of the strict majority of the devices that computed; None: no majority
    suspects: list[int]  # device ids, in device_ids order
    error: dict[int, str]  # device id -> exception, for devices whose computation raised (suspects too)

    @property
    def conclusive(self) -> bool:
        return self.majority is not None


def _on_device(tree: Any, device: Any) -> Any:
    """``tree``'s leaves on ``device``: a replicated array's own shard there (no copy), anything else copied."""
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                if shard.device == device and shard.data.shape == x.shape:
                    return shard.data
        return jax.device_put(x, device)
    return jax.tree.map(leaf, tree)


# ---------------------------------------------------------------------------------------------- the binder


@dataclass(frozen=True)
class Started:
    """A probe dispatched and not read yet (:meth:`Probes.known_answer_start`, :meth:`Probes.replay_start`): its
    program's output (device arrays), or the error its dispatch raised, and what reading it needs."""

    step: int
    out: Any  # the program's output, on the devices; None when the dispatch raised
    error: BaseException | None = None
    indices: list[int] = dataclasses.field(default_factory=list)  # replay: the devices it runs on
    rows: np.ndarray | None = None  # replay: the rows it recomputes


def micro_batch(batch_BxL1: np.ndarray, mesh: Mesh, index: int) -> np.ndarray:
    """The rows of the global batch the island's step gives device ``index`` of ``mesh.devices.flat`` (the batch
    is split over ``BATCH_AXES`` in row-major device order, :func:`dtrain.steps.inner.rows_per_device` rows each)."""
    counts = rows_per_device(batch_BxL1.shape[0], mesh.devices.size)
    start = sum(counts[:index])
    return batch_BxL1[start:start + counts[index]]


class Probes:
    """Binds the probes to a model's ``apply``, an island's mesh and an optional injected fault, and jits each
    once. Every method is a host-device sync point (it returns numbers the caller decides on)."""

    def __init__(self, apply: ApplyFn, mesh: Mesh, fault: DeviceFault | None = None):
        if set(mesh.axis_names) != set(BATCH_AXES):
            raise ValueError(f"Probes: the mesh's axes {mesh.axis_names} are not the island's {BATCH_AXES}")
        self.apply = apply
        self.mesh = mesh
        self.fault = fault
        self.devices: list[Any] = list(mesh.devices.flat)
        self.device_ids = [int(d.id) for d in self.devices]
        self._ids_D = jnp.asarray(self.device_ids, jnp.int32)
        self._known = jax.jit(partial(known_answer_values, fault=fault))
        self._known_all = jax.jit(jax.shard_map(
            partial(_device_known_answer, fault), mesh=mesh, in_specs=(P(BATCH_AXES), P()),
            out_specs=(P(BATCH_AXES), P(BATCH_AXES))))
        self._stats = jax.jit(jax.shard_map(
            partial(device_grads, apply, fault, None), mesh=mesh,
            in_specs=(P(), P(), P(BATCH_AXES), P()), out_specs=(P(), *(P(BATCH_AXES),) * 3)))
        self._replay_all = jax.jit(jax.shard_map(
            partial(_device_replay_digest, apply, fault), mesh=mesh,
            in_specs=(P(BATCH_AXES), P(), P(), P()), out_specs=P(BATCH_AXES)))
        self._replay_one = jax.jit(partial(replay_digest, apply, fault=fault))

    def known_answer(self, step: int = 0) -> list[KnownAnswer]:
        """The known-answer computation on every device: one SPMD program over the mesh (each device computes its
        own matmul, no collective) and the ``2·D`` numbers fetched together, the one host sync. If that program
        raises (a dead device), each device is run and read alone (:meth:`_known_answer_each`) to say which.
        :meth:`known_answer_start` and :meth:`known_answer_finish` are its two halves, for a caller that reads the
        result later (the island: after its next chunk is dispatched)."""
        return self.known_answer_finish(self.known_answer_start(step))

    def known_answer_start(self, step: int = 0) -> Started:
        """Dispatches :meth:`known_answer`'s program and returns at once (nothing is read)."""
        try:
            check_alive(self.fault, self.device_ids, step)  # the program runs on every device of the mesh
            return Started(step, self._known_all(self._ids_D, jnp.int32(step)))
        except Exception as e:  # noqa: BLE001 - a dead device raises at dispatch: finish says which
            return Started(step, None, e)

    def known_answer_finish(self, started: Started) -> list[KnownAnswer]:
        """Reads what :meth:`known_answer_start` dispatched (a host sync): :meth:`known_answer`'s result."""
        expected = known_answer_expected()
        try:
            if started.error is not None:
                raise started.error
            value_D, mismatches_D = jax.device_get(started.out)
        except Exception:  # noqa: BLE001 - some device's computation raised: each alone says which
            return self._known_answer_each(started.step)
        return [KnownAnswer(i, did, int(v) == expected and int(m) == 0, int(v), expected, int(m))
                for i, (did, v, m) in enumerate(zip(self.device_ids, value_D, mismatches_D, strict=True))]

    def _known_answer_each(self, step: int) -> list[KnownAnswer]:
        """:meth:`known_answer` on each device separately (all dispatched before any is read)."""
        expected = known_answer_expected()
        pending: list[tuple[Any, BaseException | None]] = []
        for dev, did in zip(self.devices, self.device_ids, strict=True):
            try:
                check_alive(self.fault, [did], step)
                pending.append((self._known(jax.device_put(jnp.int32(did), dev), jax.device_put(jnp.int32(step), dev)),
                                None))
            except Exception as e:  # noqa: BLE001 - a dead device raises at dispatch or when read
                pending.append((None, e))
        out = []
        for i, (did, (result, err)) in enumerate(zip(self.device_ids, pending, strict=True)):
            if err is None:
                try:
                    value, mismatches = (int(x) for x in jax.device_get(result))
                    out.append(KnownAnswer(i, did, value == expected and mismatches == 0, value, expected,
                                           mismatches))
                    continue
                except Exception as e:  # noqa: BLE001
                    err = e
            out.append(KnownAnswer(i, did, False, None, expected, None, f"{type(err).__name__}: {err}"))
        return out

    def grad_stats(self, params: Params, batch_BxL1: np.ndarray | jax.Array, step: int = 0) -> GradStats:
        """Each device's loss and gradient norm on its own micro-batch of ``batch_BxL1`` (one SPMD call: a
        dead device makes it raise; :meth:`known_answer` then says which)."""
        check_alive(self.fault, self.device_ids, step)
        _, loss, norm, finite = jax.device_get(self._stats(self._ids_D, params, jnp.asarray(batch_BxL1),
                                                           jnp.int32(step)))
        return GradStats(self.device_ids, np.asarray(loss), np.asarray(norm), np.asarray(finite))

    def replay(self, params: Params, rows_bxL1: np.ndarray, step: int = 0,
               indices: Sequence[int] | None = None) -> Replay:
        """The (loss, gradient) of ``rows_bxL1`` (a few rows of one device's micro-batch) computed on every device
        ``indices`` (positions in ``mesh.devices.flat``; default: all), each result reduced to its :func:`digest`
        on its own device, and the digests compared by :func:`majority`.

        One SPMD program over the mesh computes it on every device at once (no collective: each device runs the
        same single-device computation on its own copy of the replicated inputs) and the D digests are fetched
        together, the one host sync. If that program raises (a dead device), the computation is dispatched to each
        device ``indices`` separately, all before any is read, and each is read alone to say which raised (each
        device then compiles its own program once). :meth:`replay_start` and :meth:`replay_finish` are its two
        halves."""
        return self.replay_finish(self.replay_start(params, rows_bxL1, step, indices), params)

    def replay_start(self, params: Params, rows_bxL1: np.ndarray, step: int = 0,
                     indices: Sequence[int] | None = None) -> Started:
        """Dispatches :meth:`replay`'s program and returns at once (nothing is read): ``params`` may be donated
        afterwards, the program has them."""
        indices = list(range(len(self.devices))) if indices is None else list(indices)
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"replay: indices {indices} must name distinct devices (at least one)")
        rows = np.asarray(rows_bxL1)
        try:
            check_alive(self.fault, self.device_ids, step)  # the program runs on every device of the mesh
            return Started(step, self._replay_all(self._ids_D, params, rows, jnp.int32(step)), None, indices, rows)
        except Exception as e:  # noqa: BLE001 - a dead device raises at dispatch: finish says which
            return Started(step, None, e, indices, rows)

    def replay_finish(self, started: Started, params: Params) -> Replay:
        """Reads what :meth:`replay_start` dispatched (a host sync): :meth:`replay`'s result. Where that program
        raised, each device computes the rows alone on ``params`` (any parameters of the model do: what is
        compared is whether the devices agree), to say which device raised."""
        indices, rows = started.indices, started.rows
        assert rows is not None, "replay_finish: not a replay_start's"
        ids = [self.device_ids[i] for i in indices]
        errors: dict[int, str] = {}
        try:
            if started.error is not None:
                raise started.error
            all_D = jax.device_get(started.out)
            got = {did: int(all_D[i]) for i, did in zip(indices, ids, strict=True)}
        except Exception:  # noqa: BLE001 - some device's computation raised: each alone says which
            got, errors = self._replay_each(params, rows, indices, started.step)
        digests = [got.get(did) for did in ids]
        agreed = majority(digests)
        suspects = [did for did, d in zip(ids, digests, strict=True)
                    if did in errors or (agreed is not None and d != agreed)]
        return Replay(ids, digests, agreed, suspects, errors)

    def _replay_each(self, params: Params, rows_bxL1: np.ndarray, indices: Sequence[int], step: int
                     ) -> tuple[dict[int, int], dict[int, str]]:
        """:meth:`replay`'s digests computed on each device alone: (device id -> digest, device id -> error)."""
        pending: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for i in indices:
            dev, did = self.devices[i], self.device_ids[i]
            try:
                check_alive(self.fault, [did], step)
                pending[did] = self._replay_one(_on_device(params, dev), *jax.device_put(
                    (rows_bxL1, np.int32(did), np.int32(step)), dev))
            except Exception as e:  # noqa: BLE001 - a dead device raises at dispatch or when read
                errors[did] = f"{type(e).__name__}: {e}"
        got: dict[int, int] = {}
        for did, result in pending.items():
            try:
                got[did] = int(jax.device_get(result))
            except Exception as e:  # noqa: BLE001
                errors[did] = f"{type(e).__name__}: {e}"
        return got, errors
