"""Multi-host islands: one island that spans several processes (one per host) of one ``jax.distributed`` job.

The coordinator sees one island: process 0 (the *leader*) is the only one that talks to it (Join, heartbeats,
push, pull, Status). The island's mesh spans every process's devices (``jax.devices()`` after
``jax.distributed.initialize``); each process feeds its rows of the island's global batch (``jax.device_put``
of the global batch onto the mesh's batch sharding keeps each process's own rows only: every process computes the
same batch indices, deterministically, and copies only its slice to its devices).

Protocol (:class:`HostGroup`): the processes run the same :class:`workers.island.Worker` loop in lockstep, so
every collective (an inner-step chunk, a gather of θ at a push, a checkpoint save, an eval) is entered by all of
them in the same order. Everything that is not a deterministic function of what all processes hold is decided by
the leader and broadcast from it, at the point where the loop reads it:

- :meth:`HostGroup.agree`: a JSON value (a decision): whether the coordinator said stop, the planner's next
  action (wall-time rounds depend on the leader's clock), whether the exchange in flight is done, a rewind from
  the coordinator (after a dropped or rejected push, or a rejoin), the Join's reply, evaluation requests, the
  final wait's end. A follower applies what it is told and never reads its own clock or flags for these.
- :meth:`HostGroup.share_vec`: a flat float32 θ (a pull, the exchange's new global θ', a θ to evaluate), sent as
  its bits (uint32; a sum with zeros, exact, so a -0.0 stays -0.0): every process holds a bit-identical θ.
- :meth:`HostGroup.lead`: the leader runs a call to the coordinator; its result, or its error (a
  :class:`workers.client.CoordinatorError` with its code, or another error's message), reaches every process,
  so all take the same branch.
- :meth:`HostGroup.gather`: the island's sharded θ_local as host arrays on every process (a push's Δ: the leader
  encodes and sends it; the others drop it).

All broadcasts are ``jax.experimental.multihost_utils`` collectives over the processes. A process that dies ends
the island: the others block in the next collective until ``jax.distributed`` notices the missing peer and
stops them. Restart the island's processes together (a JobSet restarts the whole job); the island then rejoins
under its name as a single-process island does. Checkpoints are orbax's multi-host ones: every process saves and
restores the sharded state into the island's ``checkpoints`` folder, which must be one folder all of them see
(one path on one machine; a shared file system across hosts).

Where the processes come from (:func:`resolve_processes`): ``--num-processes``, ``--process-id``,
``--jax-coordinator`` (explicit flags win), else the environment: ``DTRAIN_NUM_PROCESSES``,
``DTRAIN_PROCESS_ID``, ``DTRAIN_JAX_COORDINATOR``; ``JOB_COMPLETION_INDEX`` (a Kubernetes indexed Job or a
JobSet) as the process id; SLURM's ``SLURM_NTASKS`` / ``SLURM_PROCID``; a GKE TPU slice's ``TPU_WORKER_HOSTNAMES``
/ ``TPU_WORKER_ID``. For SLURM and TPU slices the coordinator address defaults to ``auto``:
``jax.distributed.initialize()`` finds it itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from dtrain.config.sections import ConfigError
from dtrain.errors import DtrainError
from dtrain.net.wire import parse_address
from workers.client import CoordinatorError, RunOverError

T = TypeVar("T")

AUTO = "auto"  # --jax-coordinator auto: jax.distributed.initialize() detects the cluster (Cloud TPU, SLURM)
ENV_NUM_PROCESSES = "DTRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "DTRAIN_PROCESS_ID"
ENV_JAX_COORDINATOR = "DTRAIN_JAX_COORDINATOR"
ENV_JOB_INDEX = "JOB_COMPLETION_INDEX"  # a Kubernetes indexed Job's (and a JobSet's) pod index
_HEAD = 256  # bytes of a broadcast decision sent in one collective (a longer one takes a second)


class LeaderError(DtrainError):
    """A call process 0 made for the island failed (not with a coordinator error): every process stops."""


@dataclass(frozen=True)
class Processes:
    """How many processes the island has, which one this is, and where ``jax.distributed`` meets."""

    count: int  # 1: a single-process island (no jax.distributed)
    index: int
    coordinator: str  # HOST:PORT of jax.distributed's coordinator (process 0's), or AUTO; '' when count == 1
    source: str = "flags"  # where the values came from, for messages

    @property
    def multi(self) -> bool:
        return self.count > 1 or self.coordinator == AUTO


def _int_value(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {text!r}") from None


def _address(name: str, text: str) -> str:
    text = text.strip()
    if text == AUTO:
        return text
    try:
        parse_address(text)  # the one HOST:PORT rule (--coordinator's too)
    except ValueError as e:
        raise ConfigError(f"{name}: expected HOST:PORT of process 0 (e.g. island-0.island:8476) or {AUTO!r}: "
                          f"{e}") from None
    return text


def resolve_processes(num_processes: int | None, process_id: int | None, jax_coordinator: str | None,
                      env: Mapping[str, str]) -> Processes:
    """The island's processes from the flags (None: not given), else from ``env``; checked.

    Per value, the first that is set wins: the flag, ``DTRAIN_*``, then the platform's variables (process id:
    ``JOB_COMPLETION_INDEX``, ``SLURM_PROCID``, ``TPU_WORKER_ID``; process count: ``SLURM_NTASKS``, the number of
    ``TPU_WORKER_HOSTNAMES``). The coordinator address defaults to ``auto`` under SLURM or on a TPU slice."""
    source = "flags"
    count, index, address = num_processes, process_id, jax_coordinator
    names = {"count": "--num-processes", "index": "--process-id", "address": "--jax-coordinator"}
    platform = ""
    tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if count is None:
        for var, value in ((ENV_NUM_PROCESSES, env.get(ENV_NUM_PROCESSES)), ("SLURM_NTASKS", env.get("SLURM_NTASKS")),
                           ("TPU_WORKER_HOSTNAMES", str(len(tpu_hosts)) if len(tpu_hosts) > 1 else None)):
            if value:
                count, names["count"], source = _int_value(var, value), var, "environment"
                platform = var if var != ENV_NUM_PROCESSES else ""
                break
    if index is None:
        for var in (ENV_PROCESS_ID, ENV_JOB_INDEX, "SLURM_PROCID", "TPU_WORKER_ID"):
            if env.get(var):
                index, names["index"] = _int_value(var, env[var]), var
                break
    if address is None and env.get(ENV_JAX_COORDINATOR):
        address, names["address"] = env[ENV_JAX_COORDINATOR], ENV_JAX_COORDINATOR
    count = 1 if count is None else count
    if count < 1:
        raise ConfigError(f"{names['count']}: the island's process count must be >= 1, got {count}")
    if count == 1:
        if address is not None and address.strip() == AUTO:  # jax finds the processes itself
            return Processes(count, index or 0, AUTO, source)
        if index not in (None, 0):
            raise ConfigError(f"{names['index']}={index} needs a process count above it: pass --num-processes "
                              f"(or {ENV_NUM_PROCESSES})")
        return Processes(1, 0, "", source)
    if index is None:
        raise ConfigError(f"an island of {count} processes ({names['count']}) needs this process's id: pass "
                          f"--process-id (or {ENV_PROCESS_ID}, {ENV_JOB_INDEX})")
    if not 0 <= index < count:
        raise ConfigError(f"{names['index']}={index}: a process id of an island of {count} processes is 0..{count - 1}")
    if address is None:
        if platform in ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
            address = AUTO
        else:
            raise ConfigError(f"an island of {count} processes needs the address of its process 0's "
                              f"jax.distributed service: pass --jax-coordinator HOST:PORT (or {ENV_JAX_COORDINATOR})")
    return Processes(count, index, _address(names["address"], address), source)


def initialize(processes: Processes) -> HostGroup:
    """Starts ``jax.distributed`` for a multi-process island (before anything uses a JAX backend) and returns
    the island's :class:`HostGroup`; a single-process island's without touching JAX's backends."""
    if not processes.multi:
        return HostGroup.single()
    import jax

    # CPU devices take part in cross-process collectives only with a collectives implementation (the fake CPU
    # islands of tests and simulations); accelerators use their own (NCCL, ICI) and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes.coordinator == AUTO:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(processes.coordinator, num_processes=processes.count,
                                   process_id=processes.index)
    return HostGroup(jax.process_index(), jax.process_count())


class HostGroup:
    """The processes of one island, and how process 0's decisions and θs reach the others (see the module
    docstring). With one process every method is the identity (or a plain ``jax.device_get``): no collective."""

    def __init__(self, index: int, count: int):
        self.index, self.count = index, count

    @classmethod
    def single(cls) -> HostGroup:
        return cls(0, 1)

    @property
    def alone(self) -> bool:
        """A single-process island."""
        return self.count == 1

    @property
    def leader(self) -> bool:
        """Process 0: the one that talks to the dtrain coordinator."""
        return self.index == 0

    def _broadcast(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(array, is_source=self.leader))

    def agree(self, value: T) -> T:
        """The leader's ``value`` (JSON: lists come back for tuples) on every process; its own elsewhere ignored."""
        if self.alone:
            return value
        data = json.dumps(value).encode() if self.leader else b""
        head = np.zeros(_HEAD, np.uint8)
        inline = _HEAD - 4
        if self.leader:
            head[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
            head[4:4 + min(len(data), inline)] = np.frombuffer(data[:inline], np.uint8)
        head = self._broadcast(head)
        size = int(head[:4].view(np.uint32)[0])
        payload = head[4:4 + min(size, inline)].tobytes()
        if size > inline:  # a long one (a reason string, many eval requests): the rest in one more collective
            rest = np.zeros(1 << (size - inline - 1).bit_length(), np.uint8)
            if self.leader:
                rest[:size - inline] = np.frombuffer(data[inline:], np.uint8)
            payload += self._broadcast(rest)[:size - inline].tobytes()
        result: T = json.loads(payload)
        return result

    def share_vec(self, vec: np.ndarray | None, n: int) -> np.ndarray:
        """The leader's flat float32 ``vec`` (``n`` values) on every process, bit for bit (``vec`` is ignored
        elsewhere: pass None)."""
        if self.alone:
            assert vec is not None
            return vec
        bits = np.ascontiguousarray(vec, np.float32).view(np.uint32) if self.leader else np.zeros(n, np.uint32)
        return self._broadcast(bits).view(np.float32)

    def lead(self, call: Callable[[], T]) -> T:
        """Runs ``call`` on the leader; every process returns its (JSON) result or raises its error: a
        :class:`CoordinatorError` (or :class:`RunOverError`) with the same code and message, else a
        :class:`LeaderError` naming the leader's."""
        if self.alone:
            return call()
        outcome: dict[str, Any] = {}
        error: BaseException | None = None
        if self.leader:
            try:
                outcome = {"value": call()}
            except Exception as e:  # noqa: BLE001 - handed to every process, then raised on each
                error = e
                outcome = {"error": type(e).__name__, "message": str(e)}
                if isinstance(e, CoordinatorError):
                    outcome.update(code=e.code.name, message=e.message,
                                   run_over=isinstance(e, RunOverError))
        outcome = self.agree(outcome)
        if error is not None:
            raise error
        if "error" not in outcome:
            value: T = outcome["value"]
            return value
        if "code" in outcome:
            kind = RunOverError if outcome["run_over"] else CoordinatorError
            raise kind(grpc.StatusCode[outcome["code"]], outcome["message"])
        raise LeaderError(f"process 0 of the island failed: {outcome['error']}: {outcome['message']}")

    def gather(self, tree: Any) -> Any:
        """A (sharded) pytree of device arrays as host arrays on every process (a collective across processes)."""
        import jax

        if self.alone:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
