"""The plain data the coordinator's state machine decides over and checkpoints, and its refusal error.

:class:`StateOptions` (what it runs by, from the config), :class:`IslandRecord` (one island's membership,
lease, shard and reports, with its chip-health :class:`DeviceEvidence`), :class:`PushInfo` (a push's header)
and :class:`Admission` (the decision on it), :class:`PendingPush` and :class:`SeenPush` (a push in the open
round, a push id remembered after it). :class:`StateError` is how every part of the state machine refuses a
request. The rules these records follow are in ``coordinator.state``'s docstring.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

from dtrain import schema
from dtrain.config.derived import parse_binding
from dtrain.config.sections import ISLAND_NAME_RE, Config, CoordinatorConfig
from dtrain.net.wire import PROBES
from dtrain.runlog import json_number
from dtrain.steps.outer import adam_ratio_bound

ADAM_RATIO_STEPS = 100_000  # the steps StateOptions.adam_ratio is the largest over (it levels off long before)
MAX_PUSH_IDS = 100_000
MAX_PUSH_ID_LEN = 128
MAX_DIGEST_LEN = 256  # a reported digest's characters (params_digest, tree_digest, fingerprint)
MAX_DEVICE_LEN = 256  # a device's name in a heartbeat's bad_devices
MAX_BAD_DEVICES = 4096  # names in bad_devices
LINGER_S = 10.0
NAME_RE = ISLAND_NAME_RE

Count = Annotated[int, schema.AtLeast(0)]  # an int >= 0 (versions, counters, cursors, tokens)
Finite = Annotated[float, schema.FINITE]  # a finite float (times, rates, weights)
Hardware = Literal["cpu", "gpu", "tpu"]
HARDWARE: tuple[str, ...] = typing.get_args(Hardware)
Probe = Literal["known_answer", "finite", "stats", "replay"]  # dtrain.net.wire.PROBES: the chip-health probes
assert typing.get_args(Probe) == PROBES


class StateError(ValueError):
    """A request the state machine refuses; the state is unchanged.

    ``code`` is ``"INVALID_ARGUMENT"``, ``"FAILED_PRECONDITION"``, ``"NOT_FOUND"`` or ``"PERMISSION_DENIED"`` (the
    caller's identity may not act as that island); ``str(e)`` is the reason. ``retry_after_s`` > 0: the same
    request is refused for that many seconds more, not after (a throttled island's push,
    ``coordinator.admission.check_standing``); the service sends it as :data:`dtrain.net.wire.RETRY_AFTER_METADATA_KEY`.
    ``stopped``: the caller's island is quarantined and is to stop (its push refused for good); the service marks the
    refusal with :data:`dtrain.net.wire.STOPPED_METADATA_KEY`. ``busy``: refused for now, for a standing the
    island's own heartbeat mends (a lost island's pull, until its heartbeat's rejoin): the service answers
    RESOURCE_EXHAUSTED marked busy (:data:`dtrain.net.wire.BUSY_METADATA_KEY`), which workers retry.
    """

    CODES = ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "PERMISSION_DENIED")

    def __init__(self, code: str, reason: str, retry_after_s: float = 0.0, stopped: bool = False,
                 busy: bool = False):
        if code not in self.CODES:
            raise ValueError(f"StateError code {code!r} is not one of {self.CODES}")
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.stopped = stopped
        self.busy = busy


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
    round_steps: int = 0  # outer.inner_steps: a lost island's segment is split in whole rounds of it
    # (0: of max_push_steps)
    max_push_ids: int = MAX_PUSH_IDS  # merged/dropped push ids remembered for idempotency (oldest forgotten first)
    linger_s: float = LINGER_S  # once the run is over, how long to keep serving islands that lack the last version
    identity: str = "shared"  # security.identity: whose calls may act as which island (coordinator/bindings.py)
    pins: tuple[tuple[str, str], ...] = ()  # security.bindings as (name, identity): the operator's re-bindings
    fragments: int = 1  # outer.fragments: version v + 1 merges fragment v mod fragments (dtrain.train.fragments)
    # What bounds an honest island's Δ (coordinator.admission.honest_ceiling; params 0: no such bound)
    params: int = 0  # values in θ
    inner_lr: float = 0.0  # train.lr: the peak inner learning rate
    adam_ratio: float = 0.0  # the most one AdamW step moves a value, per unit of lr (dtrain.steps.outer)
    weight_decay: float = 0.0  # train.weight_decay
    # data.sources: a mixture's sources by name and their weights (dtrain.data.mixture), for the tokens merged per
    # source; () for one store
    sources: tuple[str, ...] = ()
    source_weights: tuple[float, ...] = ()

    @property
    def shard_end(self) -> int:
        """Sequences in each shard (train.steps x batch_size); 0 with wall-time rounds (no end)."""
        return self.shard_steps * self.batch_size

    @property
    def round_sequences(self) -> int:
        """Sequences in one step round (``outer.inner_steps`` x batch_size): the unit a segment is split in."""
        return max(self.round_steps or self.max_push_steps, 1) * self.batch_size

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
    def from_config(cls, cfg: Config, max_push_ids: int = MAX_PUSH_IDS, linger_s: float = LINGER_S,
                    params: int = 0) -> StateOptions:
        """The options for ``cfg``: total_versions is ``cfg.rounds`` (sync: one version per round) or
        ``cfg.rounds × outer.islands`` (async: one version per push). ``params``: the values in θ (0: no honest
        ceiling on a push the coordinator cannot check yet, ``coordinator.admission.honest_ceiling``)."""
        rounds = cfg.rounds if cfg.coordinator.mode == "sync" else cfg.rounds * cfg.outer.islands
        wall_time = cfg.worker.round_seconds != 0  # > 0, or auto
        # a push covers a round: H steps, or H / outer.fragments with fragments (each push one fragment's)
        max_steps = cfg.coordinator.max_push_steps or (0 if wall_time else cfg.outer.inner_steps // cfg.outer.fragments)
        return cls(coordinator=cfg.coordinator, islands=cfg.outer.islands, staleness_alpha=cfg.outer.staleness_alpha,
                   total_versions=rounds, seq_len=cfg.model.seq_len, batch_size=cfg.train.base_batch,
                   max_push_steps=max_steps, shard_steps=0 if wall_time else cfg.train.steps,
                   round_steps=cfg.outer.inner_steps,
                   max_push_ids=max_push_ids, linger_s=linger_s, identity=cfg.security.identity,
                   pins=tuple(parse_binding(text) for text in cfg.security.bindings), fragments=cfg.outer.fragments,
                   params=params, inner_lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                   adam_ratio=adam_ratio_bound(cfg.train.b1, cfg.train.b2, ADAM_RATIO_STEPS) if params else 0.0,
                   sources=tuple(s.label for s in cfg.data.sources),
                   source_weights=tuple(s.weight for s in cfg.data.sources))


@dataclass(frozen=True)
class DeviceEvidence:
    """One device an island's probes quarantined and why: the heartbeat's DeviceEvidence, workers/chip_health.py's
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
    detail: str = ""  # a sentence (at most dtrain.net.wire.MAX_EVIDENCE_DETAIL characters)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (Status, events): the numbers the probe measured, non-finite ones as strings."""
        return {f.name: json_number(v) if isinstance(v, (int, float)) else v
                for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class IslandRecord:
    """One island as the coordinator knows it: its membership and lease, its shard, its last report and what
    of its data is merged."""

    island_id: str
    name: str
    hardware: Hardware
    devices: Annotated[int, schema.AtLeast(1)]  # the devices it trains on now: its Join's, then its heartbeats'
    mesh_devices: Annotated[int, schema.AtLeast(1)]  # the most it declared at a Join: its full mesh, which the
    # evidence's indices lie in (a Join after a remesh declares only the healthy devices)
    shard_index: Count
    state: Literal["live", "lost", "stopped", "quarantined"]
    lease_expiry: Finite
    segment_start: Count = 0  # where the segment of its shard it trains starts (``Segment.start``; 0: the first)
    version: Count = 0  # last version the island reported holding
    steps: Count = 0
    tokens_reported: Count = 0
    steps_per_s: Finite = 0.0
    tokens_per_s: Finite = 0.0  # its latest reported training rate (measured before its first step with auto rounds)
    tokens_merged: Count = 0
    pushes_merged: Count = 0
    cursor_merged: Count = 0  # end of the data cursor range of its last merged push
    params_digest: str = ""
    bad_devices: tuple[str, ...] = ()  # str(device) of each quarantined device; else the island's own names
    # in the order first reported; never shrinks (``coordinator.membership``'s docstring)
    quarantined: tuple[DeviceEvidence, ...] = ()
    rejections: Count = 0  # its pushes rejected in a row (an accepted push resets it; coordinator.max_rejections)
    throttled_until: Finite = 0.0  # its next push is refused before this time (after a rejection)
    stop_reason: str = ""  # why it was quarantined (state "quarantined"): its heartbeats are told to stop


@dataclass
class Segment:
    """A contiguous range ``[start, end)`` of shard ``shard``'s sequences that one island at a time trains: what
    an island holds. A shard starts as one segment, ``[0, shard_end)``; a lost island's remainder is split into
    several (``coordinator.ledger.PushLedger.split``). ``merged``: where the segment's merged data ends (its merged
    ranges always form one prefix of it). ``end`` 0: no end (wall-time rounds: never split). A segment is named by
    (shard, start), which never changes (a split moves its ``end`` only)."""

    shard: Count
    start: Count
    end: Count
    merged: Count

    @property
    def key(self) -> tuple[int, int]:
        return self.shard, self.start

    def describe(self, shard_end: int) -> str:
        """"shard S" while the segment is the whole shard, else "shard S [start, end)"."""
        if self.start == 0 and self.end == shard_end:
            return f"shard {self.shard}"
        return f"shard {self.shard} [{self.start}, {self.end})"


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
class PendingPush:
    """A push accepted into the open round: its header, the decision on it and when its payload arrived."""

    info: PushInfo  # info.shard_index: the shard its range lies in (its island may move on a later rejoin)
    admission: Admission
    received: Finite


class SeenPush(NamedTuple):
    """A push id that is no longer pending: merged into ``target_version``, dropped or rejected. A checkpoint stores
    these as rows (lists), not objects: it may hold 100 000 of them."""

    push_id: str
    island_id: str
    status: Literal["merged", "dropped", "rejected"]
    target_version: Annotated[int, schema.AtLeast(1)]
    staleness: Count
