"""The coordinator's state machine: islands, leases, shards, rounds, push admission and the end of the run.

Pure decisions over plain data. Every method takes the time as ``now`` (seconds,
from whatever clock the caller injects) and returns its decision together with a
human-readable reason; nothing here reads a clock, does I/O, logs or starts a
thread. The gRPC servicer (``coordinator.server``) is a thin adapter that holds
one lock around every call and turns a :class:`StateError` into the gRPC status
its code names.

A request the state machine refuses raises :class:`StateError` *before* any
change, so a refused request leaves the state exactly as it was.

Model:

- ``version`` counts merged outer steps (θ_version). A round collects the
  pushes that will be merged into ``version + 1``.
- Every island holds one data shard (``islands`` shards in all). A shard is
  free when no *live* island holds it. Exactly-once data: each shard's pushes
  must follow one another without gap or overlap (a push starts exactly at the
  shard's cursor: where its merged and pending data ends), so the merged ranges
  of a shard always form one prefix of it. A push that would break that (its
  range was dropped, rejected or taken over meanwhile) is dropped, and its
  island rewinds to the cursor the reply names and trains that range again.
  Rerouting: a lost island's shard is free; the next island to need one takes
  it, from its cursor: a new island, the lost island returning, or an island
  whose own shard is done (its heartbeat reply says ``rejoin`` while a free
  shard has data left, and its Join moves it there). With step rounds a run
  ends when every shard's data is merged, not after a fixed number of versions.
- Chip health: a heartbeat may carry the devices the island's probes quarantined, each with its evidence
  (:class:`DeviceEvidence`), and the devices it trains on now. The report is checked before anything changes
  (at most the devices the island's mesh holds, each device and mesh index once, indices inside the mesh,
  known probes, bounded details). Quarantine is permanent for the island's record: a device enters
  ``IslandRecord.quarantined`` with the evidence of its first report and a later report that omits it does not
  take it out (a heartbeat without a report, or an island process restarted before its probes find the chip
  again, is no proof the chip is good); ``bad_devices`` is derived from it.
- Liveness changes only through :meth:`CoordinatorState.expire` (the server
  calls it at :meth:`CoordinatorState.next_deadline`) and
  :meth:`CoordinatorState.heartbeat` / :meth:`CoordinatorState.join`.
- A lost island's push (a hung island that wakes up) is a late delta like any
  other (``late_policy``, the contiguity rule) while no live island holds its
  shard; once another took the shard over, it is dropped.
- Pushes: :meth:`admit_push` previews the decision without changing anything
  (the server refuses a push before its payload streams in);
  :meth:`commit_push` decides again, once the payload has arrived (a round may
  have closed meanwhile), records that decision and returns it. A push's weight
  is ``tokens · (1 + staleness)^−α``, the same factor as
  ``dtrain.outer.staleness_weight``.
- A push's weight is bounded by what the coordinator assigned, never the
  island's word alone (:meth:`_check_bounds`, refused INVALID_ARGUMENT): its
  tokens are at most its cursor range × ``model.seq_len``; the range covers at
  most ``coordinator.max_push_steps`` × ``train.batch_size`` sequences (0:
  ``outer.inner_steps``, the length of a step round; with wall-time rounds,
  whose length is an island's speed × ``worker.round_seconds``, there is no
  default cap: set one) and, with step rounds, ends within the shard's
  ``train.steps`` × ``train.batch_size`` sequences; and it starts exactly at
  its shard's cursor (else it is dropped, above), so no data counts twice.
- Norms: with the payload's L2 norm (the server takes it as it spools the
  frame), :meth:`commit_push` rejects ("quarantines") a norm over
  ``coordinator.norm_max_ratio`` × ‖θ‖ (from the first round: a delta that
  would move θ farther than many times its own length), and an outlier: a norm more
  than ``coordinator.norm_z_max`` robust deviations above the median of the
  last ``coordinator.norm_window`` merged norms (``dtrain.outer.robust_z``; once
  ``norm_window_min`` are in), and gives an accepted push the factor that clips
  its norm to ``coordinator.clip_norm`` (:attr:`Admission.scale`). A merge that
  would make θ non-finite rejects pending pushes through :meth:`reject_pending`.
  A rejected push is counted, remembered (a retry is a duplicate) and does not
  hold up its round (:meth:`round_ready` counts its island as having pushed); the
  island's heartbeat replies carry the reason until its next accepted push.
- Idempotency: the ids of pending pushes, and of the last
  ``StateOptions.max_push_ids`` (100 000) merged or dropped ones, are
  remembered; a retry (which arrives within seconds) gets ``"duplicate"`` and is
  never applied twice. Older ids are forgotten, oldest first.
- The end: the run is over once every shard's data is merged (step rounds) or
  ``total_versions`` are merged (wall-time rounds; :meth:`stopped`);
  :meth:`CoordinatorState.finished` says when the coordinator may stop serving
  (every live island holds the last version, or ``linger_s`` has passed).
- Checkpoint: :meth:`to_json` / :meth:`from_json` follow one declared layout,
  ``_Snapshot`` (the records below), read by ``dtrain.schema``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

from dtrain import schema
from dtrain.config import Config, CoordinatorConfig
from dtrain.outer import clip_factor, robust_z, staleness_weight
from dtrain.runlog import json_number
from dtrain.wire import MAX_EVIDENCE, MAX_EVIDENCE_DETAIL, PROBES

MAX_PUSH_IDS = 100_000
MAX_PUSH_ID_LEN = 128
LINGER_S = 10.0
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

Count = Annotated[int, schema.AtLeast(0)]  # an int >= 0 (versions, counters, cursors, tokens)
Finite = Annotated[float, schema.FINITE]  # a finite float (times, rates, weights)
Hardware = Literal["cpu", "gpu", "tpu"]
HARDWARE: tuple[str, ...] = typing.get_args(Hardware)
Probe = Literal["known_answer", "finite", "stats", "replay"]  # dtrain.wire.PROBES: the chip-health probes
assert typing.get_args(Probe) == PROBES
Format = Literal[1]  # to_json layout version
FORMAT: Format = 1


class StateError(ValueError):
    """A request the state machine refuses; the state is unchanged.

    ``code`` is ``"INVALID_ARGUMENT"``, ``"FAILED_PRECONDITION"`` or ``"NOT_FOUND"``; ``str(e)`` is the reason.
    """

    CODES = ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND")

    def __init__(self, code: str, reason: str):
        if code not in self.CODES:
            raise ValueError(f"StateError code {code!r} is not one of {self.CODES}")
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class StateOptions:
    """What the state machine runs by: the config's [coordinator] section as loaded (validated once, by
    ``dtrain.config``), the values derived from the rest of the config, and two constants of its own.
    Build it with :meth:`from_config`."""

    coordinator: CoordinatorConfig  # mode, min_quorum, grace_s, lease_s, late_policy, max_staleness
    islands: int  # outer.islands: the expected islands = the number of data shards
    staleness_alpha: float  # outer.staleness_alpha: a delta s versions stale is weighted by (1+s)^-alpha
    total_versions: int  # the run is over once this many versions are merged
    seq_len: int  # model.seq_len: tokens per sequence (a push's tokens <= its cursor range x seq_len)
    batch_size: int  # train.batch_size: sequences per inner step
    max_push_steps: int  # inner steps one push may cover (coordinator.max_push_steps resolved; 0: no cap)
    shard_steps: int  # inner steps a shard holds in the run (train.steps); 0: no end (wall-time rounds)
    max_push_ids: int = MAX_PUSH_IDS  # merged/dropped push ids remembered for idempotency (oldest forgotten first)
    linger_s: float = LINGER_S  # once the run is over, how long to keep serving islands that lack the last version

    @property
    def shard_end(self) -> int:
        """Sequences in each shard (train.steps x batch_size); 0 with wall-time rounds (no end)."""
        return self.shard_steps * self.batch_size

    @property
    def tokens_total(self) -> int:
        """Tokens in the train split over all shards (0 with wall-time rounds: no end to the data)."""
        return self.islands * self.shard_end * self.seq_len

    @property
    def end_version(self) -> int:
        """The version the run ends at, when it is known ahead (wall-time rounds); 0 when the data decides (step
        rounds: a lost island's shard finished by another takes extra versions). Sent in JoinResponse."""
        return 0 if self.shard_steps else self.total_versions

    def __post_init__(self) -> None:
        if self.max_push_ids < 1:
            raise ValueError(f"StateOptions.max_push_ids={self.max_push_ids}: must be >= 1")
        if not self.linger_s >= 0:
            raise ValueError(f"StateOptions.linger_s={self.linger_s}: must be >= 0")

    @classmethod
    def from_config(cls, cfg: Config, max_push_ids: int = MAX_PUSH_IDS, linger_s: float = LINGER_S) -> StateOptions:
        """The options for ``cfg``: total_versions is ``cfg.rounds`` (sync: one version per round) or
        ``cfg.rounds × outer.islands`` (async: one version per push)."""
        rounds = cfg.rounds if cfg.coordinator.mode == "sync" else cfg.rounds * cfg.outer.islands
        wall_time = cfg.worker.round_seconds > 0
        max_steps = cfg.coordinator.max_push_steps or (0 if wall_time else cfg.outer.inner_steps)
        return cls(coordinator=cfg.coordinator, islands=cfg.outer.islands, staleness_alpha=cfg.outer.staleness_alpha,
                   total_versions=rounds, seq_len=cfg.model.seq_len, batch_size=cfg.train.batch_size,
                   max_push_steps=max_steps, shard_steps=0 if wall_time else cfg.train.steps,
                   max_push_ids=max_push_ids, linger_s=linger_s)


@dataclass(frozen=True)
class DeviceEvidence:
    """One device an island's probes quarantined and why: the heartbeat's DeviceEvidence, workers/chips.py's
    Evidence. A number the probe did not measure is None; NaN and infinities are values (a non-finite norm)."""

    device: Count  # the JAX device id
    index: Count  # its position in the island's original mesh (below IslandRecord.mesh_devices)
    probe: Probe
    step: Count  # the inner step of the state the probe saw
    value: float | None = None  # known_answer: the sum computed; finite, stats: the norm; replay: the device's digest
    expected: float | None = None  # known_answer: the exact sum; replay: the majority's digest
    z: float | None = None  # stats: the norm's robust z-score
    median: float | None = None  # stats: the median norm over the healthy devices
    mismatches: Count | None = None  # known_answer: entries of the result that were wrong; replay: devices outside
    detail: str = ""  # a sentence (at most dtrain.wire.MAX_EVIDENCE_DETAIL characters)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (Status, events): the numbers the probe measured, non-finite ones as strings."""
        return {f.name: json_number(v) if isinstance(v, (int, float)) else v
                for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class IslandRecord:
    island_id: str
    name: str
    hardware: Hardware
    devices: Annotated[int, schema.AtLeast(1)]  # the devices it trains on now: its Join's, then its heartbeats'
    mesh_devices: Annotated[int, schema.AtLeast(1)]  # the most it declared at a Join: its full mesh, which the
    # evidence's indices lie in (a Join after a remesh declares only the healthy devices)
    shard_index: Count
    state: Literal["live", "lost", "stopped"]
    lease_expiry: Finite
    version: Count = 0  # last version the island reported holding
    steps: Count = 0
    tokens_reported: Count = 0
    steps_per_s: Finite = 0.0
    tokens_merged: Count = 0
    pushes_merged: Count = 0
    cursor_merged: Count = 0  # end of the data cursor range of its last merged push
    params_digest: str = ""
    bad_devices: tuple[str, ...] = ()  # str(device) of each quarantined device; else the island's own names
    quarantined: tuple[DeviceEvidence, ...] = ()  # in the order first reported; never shrinks (module docstring)


@dataclass(frozen=True)
class PushInfo:
    """What the server learned from the PushHeader (already type-validated)."""

    push_id: str
    island_id: str
    base_version: Count
    tokens: Count
    inner_steps: Count
    cursor_start: Count
    cursor_end: Count
    shard_index: Count  # the shard the range lies in


@dataclass(frozen=True)
class Admission:
    status: Literal["accept", "duplicate", "drop", "reject"]
    weight: Finite  # merge weight = tokens * (1+staleness)^-alpha (0 for duplicate/drop/reject)
    staleness: Count  # version - base_version
    target_version: Count  # the version this push is (or would have been) merged into
    reason: str
    norm: Finite = 0.0  # the payload's L2 norm (0: not known, e.g. a preview)
    scale: Finite = 1.0  # factor on its values that clips the norm to coordinator.clip_norm (1: not clipped)


@dataclass
class _Pending:
    info: PushInfo  # info.shard_index: the shard its range lies in (its island may move on a later rejoin)
    admission: Admission
    received: Finite


class _Seen(NamedTuple):
    """A push id that is no longer pending: merged into ``target_version``, or dropped. A checkpoint stores
    these as rows (lists), not objects: it may hold 100 000 of them."""

    push_id: str
    island_id: str
    status: Literal["merged", "dropped", "rejected"]
    target_version: Annotated[int, schema.AtLeast(1)]
    staleness: Count


@dataclass(frozen=True)
class _Counters:
    deltas_merged: Count
    deltas_dropped: Count
    duplicates: Count
    tokens_merged: Count
    deltas_rejected: Count  # quarantined norm outliers and pushes that made a merge non-finite


@dataclass(frozen=True)
class _Snapshot:
    """The checkpoint layout (:meth:`CoordinatorState.to_json`); checks that span records are in from_json."""

    format: Format
    run_id: str
    created: Finite
    shards: Count
    version: Count
    counters: _Counters
    islands: list[IslandRecord]
    shard_cursors: list[Count]
    pending: list[_Pending]
    first_pending: Finite | None
    push_ids: list[_Seen]
    norms: list[Finite]  # the L2 norms of the last coordinator.norm_window merged pushes, oldest first


def _ids(ids: list[str]) -> str:
    return ", ".join(ids) if ids else "none"


class CoordinatorState:
    """See the module docstring. Not thread-safe: the caller serializes access."""

    def __init__(self, opts: StateOptions, run_id: str, now: float):
        self.opts = opts
        self.run_id = run_id
        self.created = float(now)
        self.version = 0
        self.islands: dict[str, IslandRecord] = {}
        self.shard_cursors: list[int] = [0] * opts.islands
        self.deltas_merged = 0
        self.deltas_dropped = 0
        self.duplicates = 0
        self.tokens_merged = 0
        self.deltas_rejected = 0
        self.norms: collections.deque[float] = collections.deque(maxlen=opts.coordinator.norm_window)
        self._rejections: dict[str, str] = {}  # island_id -> why its last push was rejected (until one is accepted)
        self._round_rejected: set[str] = set()  # islands whose push for version + 1 was rejected
        self._pending: dict[str, _Pending] = {}  # push_id -> pending push, in arrival order
        self._first_pending: float | None = None
        self._seen: collections.OrderedDict[str, _Seen] = collections.OrderedDict()  # push_id -> record, oldest first
        self._stopped_at: float | None = None  # when the run was over (the last close_round, or a resume after it)

    # -- queries ------------------------------------------------------------------------------------

    def stopped(self) -> bool:
        """Whether the run is over. Step rounds: every shard's data is merged (however many versions that took:
        ``total_versions`` with no faults, more when a lost island's shard was finished by another). Wall-time
        rounds (no end to the data): ``total_versions`` are merged."""
        end = self.opts.shard_end
        if end:
            return all(c >= end for c in self.shard_cursors)
        return self.version >= self.opts.total_versions

    def run_over(self) -> str:
        """The reason given to islands once the run is over (a Join refused, a heartbeat told to stop)."""
        if self.opts.shard_end:
            return (f"the run is over: all {self.opts.islands} shards' data ({self.opts.shard_end} sequences each) "
                    f"merged, in {self.version} versions")
        return f"the run is over: {self.version} of {self.opts.total_versions} versions merged"

    def data_left(self, shard_index: int) -> bool:
        """Whether the shard has data no push covers yet (merged or pending); always with wall-time rounds."""
        return not self.opts.shard_end or self.shard_cursor(shard_index) < self.opts.shard_end

    def live(self) -> list[IslandRecord]:
        return [r for r in self.islands.values() if r.state == "live"]

    def pending(self) -> list[tuple[PushInfo, Admission]]:
        return [(p.info, p.admission) for p in self._pending.values()]

    def push_known(self, push_id: str) -> bool:
        """Whether a push id is pending or remembered as merged/dropped (Heartbeat's push_unknown is the negation)."""
        return push_id in self._pending or push_id in self._seen

    def rejected(self, push_id: str) -> str | None:
        """Why a push was rejected (its island's notice), or None if it was not."""
        seen = self._seen.get(push_id)
        if seen is None or seen.status != "rejected":
            return None
        return self._rejections.get(seen.island_id, f"push {push_id} was rejected")

    def shard_cursor(self, shard_index: int) -> int:
        """Where the shard's merged data ends, counting pushes pending in the open round (they will be merged)."""
        if not 0 <= shard_index < self.opts.islands:
            raise StateError("INVALID_ARGUMENT", f"shard_index={shard_index}: must be in [0, {self.opts.islands})")
        cursor = self.shard_cursors[shard_index]
        for p in self._pending.values():
            if p.info.shard_index == shard_index:
                cursor = max(cursor, p.info.cursor_end)
        return cursor

    def _by_name(self, name: str) -> IslandRecord | None:
        for r in self.islands.values():
            if r.name == name:
                return r
        return None

    def _free_shards(self, exclude: str | None = None) -> list[int]:
        """Shards no live island holds (but ``exclude``), those with data left first (then by index)."""
        held = {r.shard_index for r in self.live() if r.island_id != exclude}
        return sorted((s for s in range(self.opts.islands) if s not in held), key=lambda s: not self.data_left(s))

    def _orphan(self, exclude: str) -> int | None:
        """The free shard with data left, if any (the lowest): a lost island's, for an island with none."""
        free = [s for s in self._free_shards(exclude=exclude) if self.data_left(s)]
        return free[0] if free else None

    def _holders(self) -> str:
        return ", ".join(f"{r.island_id} (shard {r.shard_index})" for r in sorted(self.live(),
                                                                            key=lambda r: r.shard_index))

    def _pending_islands(self) -> set[str]:
        return {p.info.island_id for p in self._pending.values()}

    # -- join / heartbeat / expire ------------------------------------------------------------------

    def join(self, name: str, hardware: str, devices: int, now: float) -> tuple[IslandRecord, str]:
        """Register an island (or take back a returning one); returns its record and why it got that shard."""
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise StateError("INVALID_ARGUMENT", f"island name {name!r}: must match [A-Za-z0-9._-]{{1,64}}")
        if hardware not in HARDWARE:
            raise StateError("INVALID_ARGUMENT", f"hardware {hardware!r}: must be one of {', '.join(HARDWARE)}")
        kind = typing.cast(Hardware, hardware)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise StateError("INVALID_ARGUMENT", f"devices={devices!r}: must be an integer >= 1")
        if self.stopped():
            raise StateError("FAILED_PRECONDITION", f"{self.run_over()}: nothing left to train")
        lease = now + self.opts.coordinator.lease_s
        old = self._by_name(name)
        if old is not None:
            was = old.state
            taker = next((r for r in self.live() if r.shard_index == old.shard_index and r.island_id != old.island_id),
                         None)
            orphan = self._orphan(exclude=old.island_id)
            if taker is None and self.data_left(old.shard_index):
                shard, how = old.shard_index, f"kept shard {old.shard_index}"
            elif orphan is not None:  # the island's shard is done (or taken): it finishes another's
                shard = orphan
                mine = (f"its shard {old.shard_index} was taken over by {taker.island_id}" if taker is not None
                        else f"its shard {old.shard_index} is done")
                how = f"{mine}; took over shard {shard}, which no live island holds and has data left"
            elif taker is None:
                shard, how = old.shard_index, f"kept shard {old.shard_index} (done: no shard has data left to take)"
            else:
                free = self._free_shards(exclude=old.island_id)
                if not free:
                    raise StateError("FAILED_PRECONDITION",
                                     f"{old.island_id} cannot rejoin: its shard {old.shard_index} was taken over by "
                                     f"{taker.island_id} and all {self.opts.islands} shards are held by live "
                                     f"islands: {self._holders()}")
                shard = free[0]
                how = f"its shard {old.shard_index} was taken over by {taker.island_id}, moved to free shard {shard}"
            old.hardware, old.devices, old.shard_index = kind, devices, shard
            old.mesh_devices = max(old.mesh_devices, devices)
            old.state, old.lease_expiry = "live", lease
            return old, (f"rejoined as {old.island_id} (was {was}): {how}, cursor {self.shard_cursor(shard)}")
        free = self._free_shards()
        if not free:
            raise StateError("FAILED_PRECONDITION",
                             f"all {self.opts.islands} shards are held by live islands: {self._holders()}")
        shard = free[0]
        island_id = f"{name}-{shard}"
        n = 1
        while island_id in self.islands:  # cannot happen with one record per name; kept as a guard
            island_id, n = f"{name}-{shard}.{n}", n + 1
        previous = [r for r in self.islands.values() if r.shard_index == shard and r.state == "lost"]
        cursor = self.shard_cursor(shard)
        if previous:
            how = f"took over shard {shard} of lost island {previous[-1].island_id} at cursor {cursor}"
        else:
            how = f"assigned free shard {shard} at cursor {cursor}"
        record = IslandRecord(island_id=island_id, name=name, hardware=kind, devices=devices, mesh_devices=devices,
                              shard_index=shard, state="live", lease_expiry=lease)
        self.islands[island_id] = record
        return record, f"joined as {island_id}: {how}"

    def heartbeat(self, island_id: str, version: int, steps: int, tokens: int, steps_per_s: float,
                  params_digest: str, bad_devices: tuple[str, ...], now: float, *,
                  quarantined: Sequence[Mapping[str, Any]] = (), devices: int = 0) -> tuple[str, str]:
        """Renew a live island's lease and record its report; returns (action, reason).

        ``quarantined``: the devices the island quarantined, as plain data with :class:`DeviceEvidence`'s fields
        (absent numbers left out or None); devices not in the record yet join it. ``devices``: the devices it
        trains on now (0: unchanged). A report that does not fit the island's mesh is refused (see
        :meth:`_check_report`)."""
        record = self.islands.get(island_id)
        if record is None:
            raise StateError("NOT_FOUND", f"unknown island_id {island_id!r}: call Join first")
        for fname, value in (("version", version), ("steps", steps), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateError("INVALID_ARGUMENT", f"{fname}={value!r}: must be an integer >= 0")
        if version > self.version:
            raise StateError("INVALID_ARGUMENT", f"version={version} is ahead of the coordinator's version "
                                                 f"{self.version}: an island cannot hold a future version")
        if not (isinstance(steps_per_s, (int, float)) and math.isfinite(steps_per_s) and steps_per_s >= 0):
            raise StateError("INVALID_ARGUMENT", f"steps_per_s={steps_per_s!r}: must be a finite number >= 0")
        if not isinstance(params_digest, str) or len(params_digest) > 256:
            raise StateError("INVALID_ARGUMENT", "params_digest: must be a string of at most 256 characters")
        bad = tuple(bad_devices)
        if len(bad) > 4096 or not all(isinstance(d, str) and len(d) <= 256 for d in bad):
            raise StateError("INVALID_ARGUMENT", "bad_devices: at most 4096 strings of at most 256 characters")
        report = self._check_report(record, quarantined, devices, bad)
        if record.state == "lost":
            if self.stopped():  # nothing to rejoin for: the island's lease is not renewed either
                return "stop", self.run_over()
            return "rejoin", (f"{island_id}'s lease expired at t={record.lease_expiry:.1f} "
                              f"(now t={now:.1f}): call Join again")
        record.version, record.steps, record.tokens_reported = version, steps, tokens
        record.steps_per_s, record.params_digest = float(steps_per_s), params_digest
        known = {e.device for e in record.quarantined}
        record.quarantined += tuple(e for e in report if e.device not in known)
        record.bad_devices = tuple(str(e.device) for e in sorted(record.quarantined, key=lambda e: e.device)) or bad
        if devices:
            record.devices = devices
        record.lease_expiry = now + self.opts.coordinator.lease_s
        if self.stopped():
            if version >= self.version:  # it holds the last θ; until then finished() waits for it (linger_s)
                record.state = "stopped"
                return "stop", self.run_over()
            return "stop", f"{self.run_over()}: pull version {self.version}, the last"
        if record.state == "stopped":  # stopped in a run that was since resumed with more total_versions
            record.state = "live"
        rejected = f"; {self._rejections[island_id]}" if island_id in self._rejections else ""
        orphan = None if self.data_left(record.shard_index) else self._orphan(exclude=island_id)
        if orphan is not None:
            return "rejoin", (f"{island_id}'s shard {record.shard_index} is done and shard {orphan} has data no "
                              f"live island trains (from cursor {self.shard_cursor(orphan)}): call Join to take it "
                              f"over{rejected}")
        if version < self.version:
            return "pull", f"holding version {version}, the global version is {self.version}: pull{rejected}"
        return "continue", (f"holding the latest version {self.version}; lease renewed until "
                            f"t={record.lease_expiry:.1f}{rejected}")

    @staticmethod
    def _check_report(record: IslandRecord, quarantined: Sequence[Mapping[str, Any]], devices: int,
                      bad_devices: tuple[str, ...]) -> list[DeviceEvidence]:
        """A heartbeat's chip-health report, checked against the island's mesh (``mesh_devices``: the most it
        declared at a Join) and its record; the evidence, or StateError INVALID_ARGUMENT naming the problem."""
        def refuse(why: str) -> typing.NoReturn:
            raise StateError("INVALID_ARGUMENT", why)

        mesh = record.mesh_devices
        if isinstance(devices, bool) or not isinstance(devices, int) or not 0 <= devices <= mesh:
            refuse(f"devices={devices!r}: must be an integer from 0 (not reported) to the {mesh} devices "
                   f"{record.island_id} declared at Join")
        if len(quarantined) > min(mesh, MAX_EVIDENCE):
            refuse(f"quarantined: {len(quarantined)} devices reported, {record.island_id}'s mesh holds {mesh} "
                   f"(declared at Join)")
        report: list[DeviceEvidence] = []
        for i, item in enumerate(quarantined):
            try:
                ev = schema.load(DeviceEvidence, dict(item), partial=True)  # absent numbers: None
            except schema.SchemaError as e:
                refuse(f"{schema.format_path(e.path, f'quarantined[{i}]')}: {e.why}")
            except (TypeError, ValueError) as e:  # not a mapping
                refuse(f"quarantined[{i}]: {e}")
            if len(ev.detail) > MAX_EVIDENCE_DETAIL:
                refuse(f"quarantined[{i}].detail: {len(ev.detail)} characters, at most {MAX_EVIDENCE_DETAIL}")
            if ev.index >= mesh:
                refuse(f"quarantined[{i}].index={ev.index}: outside {record.island_id}'s mesh of {mesh} devices")
            for other in report:
                if other.device == ev.device:
                    refuse(f"quarantined[{i}]: device {ev.device} is named twice")
                if other.index == ev.index:
                    refuse(f"quarantined[{i}]: mesh index {ev.index} is named twice (devices {other.device} and "
                           f"{ev.device})")
            report.append(ev)
        if devices and devices + len(report) > mesh:
            refuse(f"devices={devices} healthy and {len(report)} quarantined: more than the {mesh} devices of "
                   f"{record.island_id}'s mesh")
        known = {e.device for e in record.quarantined}
        total = len(known | {e.device for e in report})
        if total > mesh:
            refuse(f"quarantined: {record.island_id} would have {total} devices quarantined, its mesh holds {mesh}")
        names = {str(e.device) for e in report}
        if report and bad_devices and set(bad_devices) != names:
            refuse(f"bad_devices {sorted(bad_devices)} do not name the quarantined devices {sorted(names)}")
        return report

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Mark live islands whose lease ended (now >= lease_expiry) as lost; returns (island_id, reason) for each.

        Their pending pushes stay in the open round: they were received in full.
        """
        lost = []
        for r in self.islands.values():
            if r.state == "live" and now >= r.lease_expiry:
                r.state = "lost"
                pending = [p.info.push_id for p in self._pending.values() if p.info.island_id == r.island_id]
                keep = f"; its pending push {', '.join(pending)} stays in the open round" if pending else ""
                lost.append((r.island_id, (f"no heartbeat for {self.opts.coordinator.lease_s:g}s: lease expired at "
                                          f"t={r.lease_expiry:.1f}, shard {r.shard_index} is free{keep}")))
        return lost

    def pause_leases(self, seconds: float) -> None:
        """Moves every live island's lease end ``seconds`` later: time in which the coordinator could not hear
        heartbeats (the server calls it when a long merge held its lock past a lease's end), which no island is
        to be blamed for. A dead island is then found that much later."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"pause_leases: seconds={seconds!r}: must be a finite number >= 0")
        for r in self.live():
            r.lease_expiry += seconds

    # -- pushes -------------------------------------------------------------------------------------

    def admit_push(self, info: PushInfo, now: float) -> Admission:
        """What :meth:`commit_push` would decide now, from the push's header alone. Changes nothing: the server
        asks before the payload streams in, to refuse a push (or answer a retry) without receiving it."""
        if not info.push_id or len(info.push_id) > MAX_PUSH_ID_LEN:
            raise StateError("INVALID_ARGUMENT", f"push_id {info.push_id[:MAX_PUSH_ID_LEN + 1]!r}: must be 1 to "
                                                 f"{MAX_PUSH_ID_LEN} characters")
        if info.tokens <= 0:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: tokens={info.tokens}: must be > 0")
        if info.inner_steps <= 0:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: inner_steps={info.inner_steps}: must be > 0")
        if info.base_version < 0 or info.cursor_start < 0:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: base_version and cursor_start must be >= 0")
        if info.cursor_end < info.cursor_start:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: cursor_end={info.cursor_end} is before "
                                                 f"cursor_start={info.cursor_start}")
        record = self.islands.get(info.island_id)
        if record is None:
            raise StateError("NOT_FOUND", f"unknown island_id {info.island_id!r}: call Join first")
        dup = self._duplicate(info)
        if dup is not None:
            return dup
        if info.base_version > self.version:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: base_version={info.base_version} is ahead "
                                                 f"of the coordinator's version {self.version}")
        staleness = self.version - info.base_version
        target = self.version + 1
        if self.stopped():  # weight 0 whatever it claims
            return Admission("drop", 0.0, staleness, target, f"{self.run_over()}: push {info.push_id} dropped")
        self._check_bounds(info)
        cursor = self.shard_cursor(info.shard_index)
        rewind = f"not merged: its range is trained again from shard {info.shard_index}'s cursor {cursor}"
        if record.state == "lost":  # a late delta (a hung island back): judged like any other while its shard
            holder = next((r for r in self.live() if r.shard_index == record.shard_index), None)  # is free
            if holder is not None:
                return Admission("drop", 0.0, staleness, target,
                                 f"{info.island_id}'s lease expired at t={record.lease_expiry:.1f} and "
                                 f"{holder.island_id} took over shard {record.shard_index}: push {info.push_id} "
                                 f"dropped, rejoin (call Join again); {rewind}")
        if info.shard_index != record.shard_index:
            return Admission("drop", 0.0, staleness, target,
                             f"push {info.push_id} covers shard {info.shard_index}, but {info.island_id} now holds "
                             f"shard {record.shard_index}: dropped, {rewind}")
        if info.cursor_start != cursor:
            why = ("overlaps data merged or pending" if info.cursor_start < cursor
                   else "leaves a gap after data merged or pending (a range before it was dropped or rejected)")
            return Admission("drop", 0.0, staleness, target,
                             f"push {info.push_id}'s range [{info.cursor_start}, {info.cursor_end}) {why}: "
                             f"dropped, {rewind}")
        if self.opts.coordinator.mode == "sync" and info.island_id in self._pending_islands():
            prior = next(p for p in self._pending.values() if p.info.island_id == info.island_id)
            raise StateError("FAILED_PRECONDITION",
                             f"{info.island_id} already pushed for version {target} (push {prior.info.push_id}); "
                             f"wait for the round to close")
        if staleness > self.opts.coordinator.max_staleness:
            return Admission("drop", 0.0, staleness, target,
                             f"delta from version {info.base_version} is {staleness} versions stale "
                             f"(max_staleness {self.opts.coordinator.max_staleness}): dropped")
        if staleness > 0 and self.opts.coordinator.late_policy == "drop":
            return Admission("drop", 0.0, staleness, target,
                             f"delta from version {info.base_version} is {staleness} versions stale and "
                             f"late_policy is 'drop': dropped")
        weight = staleness_weight(info.tokens, staleness, self.opts.staleness_alpha)
        if staleness == 0:
            why = f"weight {weight:g} = {info.tokens} tokens"
        else:
            why = (f"{staleness} versions late: weight {weight:g} = {info.tokens} tokens x "
                   f"(1+{staleness})^-{self.opts.staleness_alpha:g}")
        return Admission("accept", weight, staleness, target, f"accepted for version {target}: {why}")

    def _check_bounds(self, info: PushInfo) -> None:
        """Refuses (INVALID_ARGUMENT) a push whose weight the coordinator did not assign: the rules are in the
        module docstring. The reason names the numbers."""
        o = self.opts
        sequences = info.cursor_end - info.cursor_start
        what = f"push {info.push_id} from {info.island_id}"
        if info.tokens > sequences * o.seq_len:
            raise StateError("INVALID_ARGUMENT", f"{what}: tokens={info.tokens} exceed its cursor range "
                             f"[{info.cursor_start}, {info.cursor_end}) = {sequences} sequences x seq_len "
                             f"{o.seq_len} = {sequences * o.seq_len} tokens")
        if o.max_push_steps and sequences > o.max_push_steps * o.batch_size:
            raise StateError("INVALID_ARGUMENT", f"{what}: its cursor range [{info.cursor_start}, {info.cursor_end}) "
                             f"is {sequences} sequences, more than one push may cover: max_push_steps "
                             f"{o.max_push_steps} x batch_size {o.batch_size} = {o.max_push_steps * o.batch_size}")
        shard = info.shard_index
        if shard >= o.islands:
            raise StateError("INVALID_ARGUMENT", f"{what}: shard_index={shard}: must be below {o.islands} shards")
        if o.shard_steps and info.cursor_end > o.shard_steps * o.batch_size:
            raise StateError("INVALID_ARGUMENT", f"{what}: cursor_end={info.cursor_end} is past the end of shard "
                             f"{shard}: train.steps {o.shard_steps} x batch_size {o.batch_size} = "
                             f"{o.shard_steps * o.batch_size} sequences")

    def _duplicate(self, info: PushInfo) -> Admission | None:
        p = self._pending.get(info.push_id)
        if p is not None:
            owner, target, staleness = p.info.island_id, p.admission.target_version, p.admission.staleness
            what = f"is pending in the open round for version {target}"
        else:
            s = self._seen.get(info.push_id)
            if s is None:
                return None
            owner, target, staleness = s.island_id, s.target_version, s.staleness
            what = (f"was merged into version {target}" if s.status == "merged"
                    else f"was {s.status} (round for version {target})")
        if owner != info.island_id:
            raise StateError("INVALID_ARGUMENT", f"push_id {info.push_id!r} was already used by island {owner}")
        return Admission("duplicate", 0.0, staleness, target,
                         f"push {info.push_id} {what}: a retry, not applied again")

    def commit_push(self, info: PushInfo, now: float, norm: float | None = None,
                    theta_norm: float = 0.0) -> Admission:
        """Decide on a push whose payload has arrived, record the decision and return it: pending (accept),
        counted (drop, duplicate, reject); the push id is remembered. Decided afresh, not taken from an earlier
        :meth:`admit_push`: the round may have closed while the payload streamed in.

        ``norm``: the payload's L2 norm; with it, an outlier is rejected and an accepted push gets its clip
        factor (see the module docstring). None: no norm checks (tools and tests of the other rules).
        ``theta_norm``: the L2 norm of the current θ (0: the ratio check is skipped)."""
        admission = self.admit_push(info, now)
        if admission.status == "accept" and norm is not None:
            admission = self._screen_norm(info, admission, norm, theta_norm)
        if admission.status == "reject":
            self._record_rejection(info, admission.target_version, admission.staleness, admission.reason)
        elif admission.status == "duplicate":
            self.duplicates += 1
        elif admission.status == "drop":
            self.deltas_dropped += 1
            self._remember(_Seen(info.push_id, info.island_id, "dropped", admission.target_version,
                                 admission.staleness))
        else:
            if not self._pending:
                self._first_pending = float(now)
            self._pending[info.push_id] = _Pending(info, admission, float(now))
            self._rejections.pop(info.island_id, None)
        return admission

    def _screen_norm(self, info: PushInfo, admission: Admission, norm: float, theta_norm: float) -> Admission:
        """An accepted push, screened by its norm: rejected as an outlier, or accepted with its clip factor."""
        c = self.opts.coordinator
        if not (math.isfinite(norm) and norm >= 0):
            return dataclasses.replace(admission, status="reject", weight=0.0, norm=0.0,
                                       reason=f"rejected: push {info.push_id} has a non-finite norm {norm}")
        if c.norm_max_ratio and theta_norm > 0 and norm > c.norm_max_ratio * theta_norm:
            return dataclasses.replace(
                admission, status="reject", weight=0.0, norm=norm,
                reason=(f"quarantined: push {info.push_id} has L2 norm {norm:.4g}, more than norm_max_ratio "
                        f"{c.norm_max_ratio:g} x the L2 norm of θ ({theta_norm:.4g})"))
        if c.norm_z_max and len(self.norms) >= c.norm_window_min:
            z = robust_z(norm, self.norms)
            if z > c.norm_z_max:
                median = statistics.median(self.norms)
                return dataclasses.replace(
                    admission, status="reject", weight=0.0, norm=norm,
                    reason=(f"quarantined: push {info.push_id} has L2 norm {norm:.4g}, {z:.3g} robust deviations "
                            f"above the median {median:.4g} of the last {len(self.norms)} merged pushes "
                            f"(norm_z_max {c.norm_z_max:g})"))
        scale = clip_factor(norm, c.clip_norm)
        clipped = f"; norm {norm:.4g} clipped to {c.clip_norm:g}" if scale < 1 else ""
        return dataclasses.replace(admission, norm=norm, scale=scale, reason=admission.reason + clipped)

    def _record_rejection(self, info: PushInfo, target: int, staleness: int, reason: str) -> None:
        self.deltas_rejected += 1
        self._remember(_Seen(info.push_id, info.island_id, "rejected", target, staleness))
        self._rejections[info.island_id] = f"your push {info.push_id} was rejected: {reason}"
        if target == self.version + 1:
            self._round_rejected.add(info.island_id)

    def reject_pending(self, push_ids: list[str], reason: str) -> list[PushInfo]:
        """Rejects pending pushes (a merge they would have made non-finite): dropped from the open round,
        counted, remembered as rejected; their islands are told in their heartbeat replies and the round does
        not wait for them. Returns their infos."""
        unknown = [p for p in push_ids if p not in self._pending]
        if unknown:
            raise StateError("NOT_FOUND", f"reject_pending: {', '.join(unknown)} not pending")
        out = []
        for push_id in push_ids:
            p = self._pending.pop(push_id)
            self._record_rejection(p.info, p.admission.target_version, p.admission.staleness, reason)
            out.append(p.info)
        if not self._pending:
            self._first_pending = None
        return out

    def _remember(self, seen: _Seen) -> None:
        self._seen[seen.push_id] = seen
        while len(self._seen) > self.opts.max_push_ids:
            self._seen.popitem(last=False)

    def check_pull(self, island_id: str, have_version: int) -> None:
        """Refuses a pull from an unknown island, or from one claiming a version the coordinator has not made."""
        if island_id not in self.islands:
            raise StateError("NOT_FOUND", f"unknown island_id {island_id!r}: call Join first")
        if have_version > self.version:
            raise StateError("INVALID_ARGUMENT", f"have_version={have_version} is ahead of the coordinator's "
                                                 f"version {self.version}")

    # -- rounds -------------------------------------------------------------------------------------

    def round_ready(self, now: float) -> tuple[bool, str]:
        """Whether the open round can close now, and why (not)."""
        n = len(self._pending)
        if self.stopped():
            return False, self.run_over()
        if self.opts.coordinator.mode == "async":
            if n:
                return True, f"{n} push{'es' if n > 1 else ''} pending (async: merge on arrival)"
            return False, "no pushes pending"
        live = sorted(self.live(), key=lambda r: r.shard_index)
        pushed = self._pending_islands()
        missing = [r.island_id for r in live
                   if r.island_id not in pushed | self._round_rejected and self.data_left(r.shard_index)]
        if n == 0:
            return False, f"waiting for the first push for version {self.version + 1} ({len(live)} live islands)"
        if not missing:
            extra = len(pushed - {r.island_id for r in live})
            lost = f" (+{extra} from islands no longer live)" if extra else ""
            rejected = len(self._round_rejected & {r.island_id for r in live})
            refused = f", {rejected} of them rejected" if rejected else ""
            return True, f"all {len(live)} live islands pushed{refused}{lost}"
        quorum = self.opts.coordinator.min_quorum or len(live)
        assert self._first_pending is not None, "pushes are pending, so the first one's time is set"
        grace_end = self._first_pending + self.opts.coordinator.grace_s
        if n >= quorum and now >= grace_end:
            return True, (f"quorum {n} of {len(live)} after {self.opts.coordinator.grace_s:g}s grace "
                          f"(missing: {_ids(missing)})")
        waiting = f"waiting for {len(missing)} of {len(live)} islands (missing: {_ids(missing)})"
        if n >= quorum:
            return False, f"{waiting}; quorum close possible in {grace_end - now:.1f}s"
        return False, f"{waiting}; a quorum close needs {quorum} pushes, have {n}"

    def close_round(self, now: float) -> tuple[int, list[PushInfo], str]:
        """Merge the open round into version + 1; returns (new_version, merged pushes, reason)."""
        ready, why = self.round_ready(now)
        if not ready:
            raise StateError("FAILED_PRECONDITION", f"the round for version {self.version + 1} cannot close: {why}")
        self.version += 1
        merged = []
        tokens = 0
        for p in self._pending.values():
            info = p.info
            r = self.islands[info.island_id]
            r.tokens_merged += info.tokens
            r.pushes_merged += 1
            r.cursor_merged = info.cursor_end
            self.shard_cursors[info.shard_index] = max(self.shard_cursors[info.shard_index], info.cursor_end)
            tokens += info.tokens
            merged.append(info)
            self._remember(_Seen(info.push_id, info.island_id, "merged", self.version, p.admission.staleness))
            if p.admission.norm > 0:
                self.norms.append(p.admission.norm)
        self.deltas_merged += len(merged)
        self.tokens_merged += tokens
        self._pending.clear()
        self._first_pending = None
        self._round_rejected.clear()
        done = ""
        if self.stopped():
            self._stopped_at = float(now)
            done = f"; the run is over ({self.opts.total_versions} versions)"
        return self.version, merged, (f"merged {len(merged)} deltas ({', '.join(i.island_id for i in merged)}; "
                                      f"{tokens} tokens) into version {self.version} ({why}){done}")

    def finished(self, now: float) -> tuple[bool, str]:
        """Whether the coordinator may stop serving, and why (not): the run is over and no live island lacks
        the last version, or ``linger_s`` has passed since it ended (an island that has not pulled the last
        version by then finds no coordinator)."""
        if not self.stopped():
            return False, f"the run goes on: {self.version} of {self.opts.total_versions} versions merged"
        behind = [r.island_id for r in sorted(self.live(), key=lambda r: r.shard_index) if r.version < self.version]
        over = f"the run is over ({self.version} versions)"
        if not behind:
            return True, f"{over} and every live island holds version {self.version}"
        assert self._stopped_at is not None  # set by close_round and from_json whenever stopped()
        left = self._stopped_at + self.opts.linger_s - now
        if left <= 0:
            return True, (f"{over}; gave up after {self.opts.linger_s:g}s on islands without version "
                          f"{self.version}: {_ids(behind)}")
        return False, f"{over}; waiting up to {left:.1f}s for islands without version {self.version}: {_ids(behind)}"

    def next_deadline(self, now: float) -> float | None:
        """When round_ready, liveness or finished could next change by time alone: the grace end, the earliest
        lease expiry of a live island (may be <= now if expire() is due) or the end of the linger after the
        run. None if nothing is timed."""
        times = [r.lease_expiry for r in self.live()]
        if self.opts.coordinator.mode == "sync" and self._pending and self._first_pending is not None:
            grace_end = self._first_pending + self.opts.coordinator.grace_s
            if grace_end > now:
                times.append(grace_end)
        if self._stopped_at is not None and self._stopped_at + self.opts.linger_s > now:
            times.append(self._stopped_at + self.opts.linger_s)
        return min(times) if times else None

    # -- checkpoint ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON types (for the coordinator checkpoint), laid out as ``_Snapshot``."""
        return schema.dump(_Snapshot(
            format=FORMAT, run_id=self.run_id, created=self.created, shards=self.opts.islands, version=self.version,
            counters=_Counters(self.deltas_merged, self.deltas_dropped, self.duplicates, self.tokens_merged,
                               self.deltas_rejected),
            islands=list(self.islands.values()), shard_cursors=self.shard_cursors,
            pending=list(self._pending.values()), first_pending=self._first_pending,
            push_ids=list(self._seen.values()), norms=list(self.norms)))

    @classmethod
    def from_json(cls, opts: StateOptions, blob: Any, now: float) -> CoordinatorState:
        """Restore from :meth:`to_json`. Every island's lease is renewed to now + lease_s (islands keep training
        through a coordinator outage). Malformed input raises StateError INVALID_ARGUMENT naming the field.

        Pending pushes are restored as they were; the caller must hold their summed deltas too (the server
        checkpoints right after close_round, when none are pending).
        """
        def fail(path: schema.FieldPath, why: str) -> typing.NoReturn:
            raise StateError("INVALID_ARGUMENT", f"bad coordinator state: {schema.format_path(path, 'state')}: {why}")

        try:
            snap = schema.load(_Snapshot, blob)  # every field's type and range
        except schema.SchemaError as e:
            fail(e.path, e.why)
        # What spans records, or needs the options:
        if snap.shards != opts.islands:
            fail(("shards",), f"checkpoint has {snap.shards} shards, the config has {opts.islands} islands")
        if len(snap.shard_cursors) != opts.islands:
            fail(("shard_cursors",), f"expected {opts.islands} entries, got {len(snap.shard_cursors)}")
        state = cls(opts, snap.run_id, snap.created)
        state.version, state.shard_cursors = snap.version, snap.shard_cursors
        c = snap.counters
        state.deltas_merged, state.deltas_dropped = c.deltas_merged, c.deltas_dropped
        state.duplicates, state.tokens_merged, state.deltas_rejected = c.duplicates, c.tokens_merged, c.deltas_rejected
        state.norms.extend(snap.norms)  # the last norm_window of them
        for i, rec in enumerate(snap.islands):
            if rec.shard_index >= opts.islands:
                fail(("islands", i, "shard_index"), f"{rec.shard_index}: must be below {opts.islands} shards")
            if rec.version > snap.version:
                fail(("islands", i, "version"), f"{rec.version} is ahead of the state's version {snap.version}")
            if not NAME_RE.fullmatch(rec.name):
                fail(("islands", i, "name"), f"{rec.name!r} is not a valid island name")
            if rec.island_id in state.islands:
                fail(("islands", i, "island_id"), f"duplicate island_id {rec.island_id!r}")
            if state._by_name(rec.name) is not None:
                fail(("islands", i, "name"), f"duplicate name {rec.name!r}")
            if rec.state == "live" and rec.shard_index not in state._free_shards():
                fail(("islands", i, "shard_index"), f"shard {rec.shard_index} is held by two live islands")
            if rec.devices > rec.mesh_devices:
                fail(("islands", i, "devices"), f"{rec.devices}: more than its mesh_devices {rec.mesh_devices}")
            if len(rec.quarantined) > rec.mesh_devices:
                fail(("islands", i, "quarantined"), f"{len(rec.quarantined)} devices, more than its mesh_devices "
                     f"{rec.mesh_devices}")
            for j, ev in enumerate(rec.quarantined):
                if ev.index >= rec.mesh_devices:
                    fail(("islands", i, "quarantined", j, "index"), f"{ev.index}: outside its mesh of "
                         f"{rec.mesh_devices} devices")
                if any(e.device == ev.device for e in rec.quarantined[:j]):
                    fail(("islands", i, "quarantined", j, "device"), f"device {ev.device} is named twice")
            rec.lease_expiry = now + opts.coordinator.lease_s
            state.islands[rec.island_id] = rec
        for i, seen in enumerate(snap.push_ids):
            if not 0 < len(seen.push_id) <= MAX_PUSH_ID_LEN or seen.push_id in state._seen:
                fail(("push_ids", i, "push_id"), f"{seen.push_id!r}: empty, too long or repeated")
            state._seen[seen.push_id] = seen
            if seen.status == "rejected" and seen.target_version == snap.version + 1:
                state._round_rejected.add(seen.island_id)
        while len(state._seen) > opts.max_push_ids:
            state._seen.popitem(last=False)
        for i, p in enumerate(snap.pending):
            if p.admission.status != "accept":
                fail(("pending", i, "admission", "status"), f"a pending push is 'accept', got {p.admission.status!r}")
            if p.admission.target_version != state.version + 1:
                fail(("pending", i, "admission", "target_version"), f"a pending push is for version "
                     f"{state.version + 1}, got {p.admission.target_version}")
            if p.info.island_id not in state.islands:
                fail(("pending", i, "info", "island_id"), f"unknown island {p.info.island_id!r}")
            if state.push_known(p.info.push_id):
                fail(("pending", i, "info", "push_id"), f"{p.info.push_id!r} is repeated")
            if p.info.shard_index >= opts.islands:
                fail(("pending", i, "info", "shard_index"), f"{p.info.shard_index}: must be below {opts.islands} "
                     f"shards")
            state._pending[p.info.push_id] = p
        if (snap.first_pending is None) == bool(state._pending):
            fail(("first_pending",), "must be a number when pushes are pending, else null")
        state._first_pending = snap.first_pending
        if state.stopped():
            state._stopped_at = float(now)  # a resumed run that was already over lingers from now
        return state

    # -- status -------------------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """Plain-JSON snapshot for the Status RPC and the dashboard."""
        ready, reason = self.round_ready(now)
        islands = []
        for r in sorted(self.islands.values(), key=lambda r: (r.shard_index, r.island_id)):
            d = schema.dump(r)
            d["lease_left_s"] = max(0.0, r.lease_expiry - now) if r.state == "live" else 0.0
            d["quarantined"] = [e.to_json() for e in r.quarantined]  # strict JSON: non-finite numbers as strings
            islands.append(d)
        return {
            "run_id": self.run_id,
            "version": self.version,
            "mode": self.opts.coordinator.mode,
            "total_versions": self.opts.total_versions,
            "stopped": self.stopped(),
            "run_over": self.run_over() if self.stopped() else "",
            "islands": islands,
            "live": len(self.live()),
            "deltas_merged": self.deltas_merged,
            "deltas_dropped": self.deltas_dropped,
            "duplicates": self.duplicates,
            "deltas_rejected": self.deltas_rejected,
            "tokens_merged": self.tokens_merged,
            "shard_cursors": [self.shard_cursor(s) for s in range(self.opts.islands)],
            "round": {"target_version": self.version + 1, "ready": ready, "reason": reason,
                      "pending": [{"push_id": i.push_id, "island_id": i.island_id, "tokens": i.tokens,
                                   "weight": a.weight, "staleness": a.staleness, "norm": a.norm, "scale": a.scale}
                                  for i, a in self.pending()]},
            "next_deadline": self.next_deadline(now),
        }
