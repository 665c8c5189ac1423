"""Chip health of one island: runs the probes of :mod:`dtrain.health.probes` on a schedule and decides which devices to
quarantine.

The island worker owns one :class:`ChipHealth` (built when ``[health] enabled``) and calls it at chunk
boundaries: :meth:`ChipHealth.start` before the first step, :meth:`ChipHealth.overlap` after each chunk of the
per-device inner step (``InnerLoop(per_device=True)``, whose metrics carry each device's micro-batch gradient norm
and finiteness) is dispatched, :meth:`ChipHealth.flush` before a push, and :meth:`ChipHealth.diagnose` when a chunk
raised (a dead device). Each returns the devices it quarantined just now, each with its evidence.

The checks are overlapped with training: :meth:`ChipHealth.overlap` dispatches the probes due after a chunk
(behind it, on the state it leaves) and reads nothing of it; what the chunk's metrics and those probes say is
read at the next call, once the next chunk is dispatched too, so the host reads results the devices have while
they run the next chunk (no host sync in the hot loop waits for a running chunk). A fault is then found one
chunk later than a synchronous :meth:`ChipHealth.check` finds it, with the same evidence (the inner step the
probe saw); the island's recovery discards that chunk with the rest of its round, and :meth:`ChipHealth.flush`
reads the last chunk's check before every push, so nothing unchecked is pushed.

The quarantine rule (a device, by its JAX ``device.id``, is quarantined by any one of):

1. **a failed known answer** (run on every device at start and every ``known_answer_every`` steps, and after a
   chunk raised): a wrong sum, a mismatching entry, or a computation that raised. Exact arithmetic: one failure is
   proof.
2. **a non-finite device**: its micro-batch loss or gradient was NaN/Inf on some step of the chunk while fewer
   than half of the healthy devices were (when most are non-finite, the training diverged: that is no chip's
   fault, and nothing is quarantined).
3. **a statistics outlier on two consecutive checks**: a check is one inner step's row of per-device gradient
   norms (the per-device step gives one each step at no extra cost; ``stats``); a device whose robust z-score
   (:func:`dtrain.health.probes.outliers` over the healthy devices finite at that step, ``z_max``) exceeds the threshold
   on two consecutive steps, *confirmed by a replay*: a row of that device's own micro-batch of the chunk's last
   batch recomputed on every healthy device (as in rule 4) puts it outside the majority. One outlier step alone
   is forgiven, and so is a suspect the replay clears (:attr:`ChipHealth.cleared`): a micro-batch whose gradient
   is far from the others' (an odd row of data, which a device with one or two rows sees often) is not a chip's
   fault, and a healthy device computes it as its peers do.
4. **a replay suspect outside a strict majority** (every ``replay_every`` steps): a few rows (``REPLAY_ROWS``) of
   one healthy device's micro-batch of the chunk's last batch (the device, and the rows in its micro-batch, taken
   in turn, so that over time every device's data is replayed) have their loss and gradient recomputed on every
   healthy device at once, each reduced to a bit-exact digest on its device
   (:meth:`dtrain.health.probes.Probes.replay`); with at least 3 healthy devices, a device whose digest differs from a
   strict majority's, or whose computation raised, is quarantined. No strict majority (nondeterministic ops: see
   :mod:`dtrain.health.probes`) quarantines nothing.

Quarantined devices leave every later probe: statistics are compared over the healthy devices only (at least 3),
replays run on healthy devices only. Nothing here rebuilds the mesh: the quarantined devices still run the
island's step until the island remeshes on :attr:`ChipHealth.healthy_ids` (or drains when
:meth:`ChipHealth.too_few` says it has fewer than ``min_devices``).

Evidence (:data:`Evidence`), one JSON-ready dict per quarantined device: ``device`` (JAX id), ``index`` (position
in ``mesh.devices.flat``), ``probe`` (``known_answer``, ``finite``, ``stats``, ``replay``), ``step`` (the inner
step of the state the probe saw), ``value`` and ``expected`` (known answer: the sum and the exact sum; replay: the
device's digest, None when it raised, and the majority's), ``mismatches`` (known answer: wrong entries; replay: the
devices outside the majority) or ``z`` and ``median`` (statistics), and ``detail`` (a sentence). Non-finite numbers
are written as strings (``"nan"``, ``"inf"``) so the events stay strict JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

from dtrain.config.ops import HealthConfig
from dtrain.health.faults import DeviceFault
from dtrain.health.probes import STAT_ABS_FLOOR, STAT_SPREAD_FLOOR, KnownAnswer, Probes, Started, micro_batch, outliers
from dtrain.models.model import ApplyFn, Params
from dtrain.runlog import json_number
from dtrain.steps.outer import robust_scores

REPLAY_ROWS = 1  # rows of a device's micro-batch each replay recomputes on every healthy device

Evidence = dict[str, Any]


@dataclass(frozen=True)
class _ReplayStarted:
    """Rule 4's replay, dispatched: the probe, and what its evidence names (the device whose micro-batch it is,
    its first row, how many rows, how many healthy devices computed them)."""

    probe: Started
    source: int
    first: int
    rows: int
    healthy: int


@dataclass(frozen=True)
class _Submitted:
    """A chunk's check, its probes dispatched and nothing read (:meth:`ChipHealth.overlap`)."""

    first: int  # the chunk's first inner step
    end: int  # the step after its last
    metrics: Mapping[str, Any]  # its per-device metrics, device arrays
    last_batch: np.ndarray  # its last batch (a replay's rows come from it)
    known: Started | None  # the known answer, when it was due
    replay: _ReplayStarted | None  # the replay, when it was due


def _due(step: int, every: int) -> int:
    """The first multiple of ``every`` after ``step``."""
    return (step // every + 1) * every


class ChipHealth:
    """The island's chip-health state: which devices are quarantined (with evidence), when each probe last ran,
    and the statistics probe's streak of consecutive outliers, and the chunk whose check :meth:`overlap` left to
    read. Every method is a host-device sync point, but :meth:`overlap`'s only waits for the chunk before the
    one just dispatched."""

    def __init__(self, cfg: HealthConfig, apply: ApplyFn, mesh: Mesh, *, fault: DeviceFault | None = None):
        self.cfg = cfg
        self.probes = Probes(apply, mesh, fault)
        self.device_ids: list[int] = list(self.probes.device_ids)
        self.quarantined: dict[int, Evidence] = {}  # device id -> the evidence that quarantined it
        self._streak: set[int] = set()  # device ids that were statistics outliers on the last check
        # The steps at (or after) which check() runs the next known answer (inf: only start() and diagnose() do) and
        # the next replay: on fixed grids (multiples of the interval), which do not drift with the chunks: with
        # chunks that divide the interval, a probe runs exactly every interval.
        self._next_known: float = cfg.known_answer_every or math.inf
        self._next_replay: float = cfg.replay_every or math.inf
        self._replay_turn = 0  # counts replays: picks the healthy device (and rows) the next replay recomputes
        self.probe_calls: dict[str, int] = {"known_answer": 0, "replay": 0}
        self.cleared: list[Evidence] = []  # statistics suspects a replay cleared (the island logs them)
        self._pending: _Submitted | None = None  # the chunk whose check overlap() left to read

    # ------------------------------------------------------------------------------------------ the island's view

    @property
    def bad_devices(self) -> list[int]:
        """The quarantined device ids, sorted (the heartbeat's ``bad_devices``)."""
        return sorted(self.quarantined)

    @property
    def healthy_ids(self) -> list[int]:
        """The device ids not quarantined, in ``mesh.devices.flat`` order (the devices to remesh on)."""
        return [d for d in self.device_ids if d not in self.quarantined]

    def rebind(self, mesh: Mesh) -> None:
        """The island remeshed on its healthy devices: the probes run on ``mesh`` from now on. Quarantined devices
        stay quarantined with their evidence (whose ``index`` is the device's position in the mesh it was found
        on); the statistics streak and the replay turn start over."""
        ids = [int(d.id) for d in mesh.devices.flat]
        back = sorted(set(ids) & set(self.quarantined))
        if back:
            raise ValueError(f"ChipHealth.rebind: the new mesh holds quarantined devices {back}")
        self.probes = Probes(self.probes.apply, mesh, self.probes.fault)
        self.device_ids = ids
        self._streak.clear()
        self._replay_turn = 0
        self._pending = None  # the old mesh's

    def too_few(self) -> bool:
        """Fewer healthy devices than ``min_devices``: the island must drain."""
        return len(self.healthy_ids) < self.cfg.min_devices

    def _healthy_indices(self) -> list[int]:
        return [i for i, d in enumerate(self.device_ids) if d not in self.quarantined]

    def _quarantine(self, index: int, probe: str, step: int, detail: str, **numbers: float | int | None
                    ) -> Evidence | None:
        did = self.device_ids[index]
        if did in self.quarantined:
            return None
        evidence: Evidence = {"device": did, "index": index, "probe": probe, "step": step,
                              **{k: json_number(v) for k, v in numbers.items()}, "detail": detail}
        self.quarantined[did] = evidence
        self._streak.discard(did)
        return evidence

    # ------------------------------------------------------------------------------------------ the probes

    def start(self, step: int = 0) -> list[Evidence]:
        """The known answer on every device before training; the devices it quarantined."""
        return self._known_answer(step)

    def diagnose(self, step: int) -> list[Evidence]:
        """After a chunk raised (a device's computation failed): the known answer on every healthy device says which
        one; the devices it quarantined (empty: the failure was not a device's)."""
        return self._known_answer(step)

    def _known_answer(self, step: int) -> list[Evidence]:
        self.probe_calls["known_answer"] += 1
        every = self.cfg.known_answer_every
        self._next_known = _due(step, every) if every else math.inf
        return self._known_answer_found(self.probes.known_answer(step), step)

    def _known_answer_found(self, results: list[KnownAnswer], step: int) -> list[Evidence]:
        """Rule 1 on a known answer's results."""
        found = []
        for result in results:
            if result.ok or result.device_id in self.quarantined:
                continue
            detail = (f"known answer raised: {result.error}" if result.error is not None else
                      f"known answer {result.value} != {result.expected} ({result.mismatches} entries wrong)")
            ev = self._quarantine(result.index, "known_answer", step, detail, value=result.value,
                                  expected=result.expected, mismatches=result.mismatches)
            if ev is not None:
                found.append(ev)
        return found

    def check(self, first_step: int, metrics: Mapping[str, Any], params: Params,
              batches_KxBxL1: np.ndarray) -> list[Evidence]:
        """After one chunk of K per-device steps, the first of which ran at inner step ``first_step``: reads the
        chunk's per-device metrics (``device_finite`` and ``device_grad_norm``, ``[K, D]``), then runs the known
        answer and the replay if their step has come (the replay on ``params``, the state after the chunk, and the
        chunk's last batch). The devices quarantined by this check. All at once, a host sync: :meth:`overlap`
        reads a chunk's results while the next one runs."""
        return self._settle(self._submit(first_step, metrics, params, batches_KxBxL1), params)

    # ------------------------------------------------------------------------------------------ overlapped checks

    def overlap(self, first_step: int, metrics: Mapping[str, Any], params: Params,
                batches_KxBxL1: np.ndarray) -> list[Evidence]:
        """:meth:`check` with no host sync on the chunk just dispatched: the probes due after it (the known
        answer, the replay on ``params``) are dispatched now, behind it; what they and its metrics say is read
        at the next call, once the next chunk is dispatched too, or at :meth:`flush`. Returns what the check of
        the chunk before this one found (the island runs one chunk past a fault found so: its recovery discards
        it with the rest of the round)."""
        before, self._pending = self._pending, self._submit(first_step, metrics, params, batches_KxBxL1)
        return self._settle(before, params) if before is not None else []

    def flush(self, params: Params) -> list[Evidence]:
        """Reads the check :meth:`overlap` left pending (a host sync), if any: before the island pushes, nothing
        it trained goes unchecked. ``params``: the island's state now (a statistics suspect's confirming replay
        runs on them)."""
        pending, self._pending = self._pending, None
        return self._settle(pending, params) if pending is not None else []

    def drop(self) -> None:
        """Forgets the pending check: its steps were discarded (a recovery), or its chunk raised."""
        self._pending = None

    @property
    def next_step(self) -> int | None:
        """The inner step the chunk after the pending check starts at (None: no check pending), known without
        reading the state's step counter (a host sync)."""
        return self._pending.end if self._pending is not None else None

    def _submit(self, first_step: int, metrics: Mapping[str, Any], params: Params,
                batches_KxBxL1: np.ndarray) -> _Submitted:
        """The probes due after a chunk dispatched (nothing read): the known answer and the replay when their
        steps have come."""
        steps = int(np.shape(metrics["device_finite"])[0])
        end = first_step + steps
        last_batch = np.asarray(batches_KxBxL1)[-1]
        known = replay = None
        if end >= self._next_known:
            self.probe_calls["known_answer"] += 1
            every = self.cfg.known_answer_every
            self._next_known = _due(end, every) if every else math.inf
            known = self.probes.known_answer_start(end)
        if end >= self._next_replay:
            self._next_replay = _due(end, self.cfg.replay_every)
            replay = self._replay_start(params, last_batch, end)
        return _Submitted(first_step, end, metrics, last_batch, known, replay)

    def _settle(self, sub: _Submitted, params: Params) -> list[Evidence]:
        """Reads a submitted chunk's metrics and probes (a host sync) and applies the quarantine rules."""
        metrics, first_step, end, last_batch = sub.metrics, sub.first, sub.end, sub.last_batch
        finite_KxD = np.asarray(metrics["device_finite"], bool)
        norm_KxD = np.asarray(metrics["device_grad_norm"], np.float64)
        if finite_KxD.ndim != 2 or finite_KxD.shape != norm_KxD.shape or finite_KxD.shape[1] != len(self.device_ids):
            raise ValueError(f"ChipHealth.check: per-device metrics of shape {finite_KxD.shape} / {norm_KxD.shape}; "
                             f"expected [K, {len(self.device_ids)}] (InnerLoop(per_device=True))")
        found: list[Evidence] = []
        suspects: dict[int, Evidence] = {}  # rule 3's, by index, awaiting the replay's word
        # The common case in one call: every healthy device finite on every step of the chunk, and no step with a
        # statistics outlier. Such a step changes nothing but the outlier streak (it ends); the others go one by one.
        healthy = self._healthy_indices()
        quiet_K = np.zeros(finite_KxD.shape[0], bool)
        if self.cfg.stats and len(healthy) >= 3 and finite_KxD[:, healthy].all() \
                and np.isfinite(norm_KxD[:, healthy]).all():
            z_KxH = np.abs(robust_scores(norm_KxD[:, healthy], norm_KxD[:, healthy], STAT_SPREAD_FLOOR, STAT_ABS_FLOOR))
            quiet_K = ~(z_KxH > self.cfg.z_max).any(axis=1)
        for k in range(finite_KxD.shape[0]):
            if quiet_K[k]:
                self._streak.clear()
                continue
            found += self._check_step(first_step + k, finite_KxD[k], norm_KxD[k], suspects)
        for index, ev in suspects.items():
            found += self._confirm(index, ev, params, last_batch, end)
        if sub.known is not None:
            found += self._known_answer_found(self.probes.known_answer_finish(sub.known), end)
        if sub.replay is not None:
            found += self._replay_finish(sub.replay, params)
        return found

    def _check_step(self, step: int, finite_D: np.ndarray, norm_D: np.ndarray,
                    suspects: dict[int, Evidence]) -> list[Evidence]:
        """Rule 2 on one step's row, and rule 3's suspects (added to ``suspects``, to be confirmed by a replay)."""
        healthy = self._healthy_indices()
        found = []
        bad = [i for i in healthy if not finite_D[i]]
        if bad and 2 * len(bad) < len(healthy):
            for i in bad:
                ev = self._quarantine(i, "finite", step, "micro-batch loss or gradient not finite",
                                      value=float(norm_D[i]))
                if ev is not None:
                    found.append(ev)
        if not self.cfg.stats:
            return found
        # Non-finite devices are rule 2's (or, when most are, a divergence's): compared here are the finite ones.
        healthy = [i for i in self._healthy_indices() if finite_D[i] and np.isfinite(norm_D[i])]
        if len(healthy) < 3:  # the statistics cannot say which of two devices is odd
            self._streak.clear()
            return found
        flagged = {healthy[o.index]: o for o in outliers([float(norm_D[i]) for i in healthy], self.cfg.z_max)}
        median = float(np.median([norm_D[i] for i in healthy]))
        streak = set()
        for i, o in flagged.items():
            did = self.device_ids[i]
            if did in self._streak:
                suspects.setdefault(i, {"device": did, "index": i, "probe": "stats", "step": step,
                                        "value": o.value, "z": o.z, "median": median,
                                        "detail": f"gradient norm an outlier on two consecutive steps "
                                                  f"(median {median:.4g}, z_max {self.cfg.z_max})"})
            else:
                streak.add(did)
        self._streak = streak
        return found

    def _confirm(self, index: int, suspect: Evidence, params: Params, batch_BxL1: np.ndarray,
                 step: int) -> list[Evidence]:
        """Rule 3's replay: a row of the suspect's own micro-batch on every healthy device. Outvoted (or raised): the
        suspect is quarantined with the statistics' evidence, and the replay's in the detail; else it is cleared."""
        healthy = self._healthy_indices()
        if index not in healthy or len(healthy) < 3:
            return []
        self.probe_calls["replay"] += 1
        result = self.probes.replay(params, micro_batch(batch_BxL1, self.probes.mesh, index)[:REPLAY_ROWS], step,
                                    healthy)
        did = self.device_ids[index]
        if did not in result.suspects:
            self.cleared.append({**suspect, **{k: json_number(suspect[k]) for k in ("value", "z", "median")},
                                 "detail": suspect["detail"] + "; cleared: a replay of its micro-batch gave the same "
                                 "digest on every healthy device (the data, not the chip)"})
            return []
        why = f"raised: {result.error[did]}" if did in result.error else "outside the majority of digests"
        ev = self._quarantine(index, "stats", suspect["step"], f"{suspect['detail']}; confirmed by a replay of its "
                              f"micro-batch on {len(healthy)} devices ({why})", value=suspect["value"],
                              z=suspect["z"], median=suspect["median"])
        return [ev] if ev is not None else []

    def _replay_start(self, params: Params, batch_BxL1: np.ndarray, step: int) -> _ReplayStarted | None:
        """Rule 4's replay dispatched: a few rows of one healthy device's micro-batch to be recomputed on every
        healthy device (None: fewer than 3 healthy devices, two that differ cannot say which one is wrong)."""
        healthy = self._healthy_indices()
        if len(healthy) < 3:
            return None
        self.probe_calls["replay"] += 1
        turn, self._replay_turn = self._replay_turn, self._replay_turn + 1
        source = healthy[turn % len(healthy)]  # every healthy device's micro-batch in turn ...
        micro = micro_batch(batch_BxL1, self.probes.mesh, source)
        first = (turn // len(healthy)) * REPLAY_ROWS % len(micro)  # ... and, round after round, its other rows
        rows = micro[first:first + REPLAY_ROWS]
        return _ReplayStarted(self.probes.replay_start(params, rows, step, healthy), source, first, len(rows),
                              len(healthy))

    def _replay_finish(self, started: _ReplayStarted, params: Params) -> list[Evidence]:
        """Rule 4 on a dispatched replay's digests: a device outside a strict majority of the digests (or whose
        computation raised) is quarantined."""
        result = self.probes.replay_finish(started.probe, params)
        source, first, step, n_healthy = started.source, started.first, started.probe.step, started.healthy
        rows = range(started.rows)
        found = []
        for did in result.suspects:
            digest = result.digests[result.device_ids.index(did)]
            what = f"raised: {result.error[did]}" if did in result.error else f"gave digest {digest:#010x}"
            agreed = "no majority" if result.majority is None else f"the majority's digest {result.majority:#010x}"
            detail = (f"replay of rows {first}..{first + len(rows) - 1} of device {self.device_ids[source]}'s "
                      f"micro-batch on {n_healthy} devices: this one {what}, {agreed}; "
                      f"{len(result.suspects)} device(s) outside the majority")
            ev = self._quarantine(self.device_ids.index(did), "replay", step, detail, value=digest,
                                  expected=result.majority, mismatches=len(result.suspects))
            if ev is not None:
                found.append(ev)
        return found
