"""The coordinator's state machine: islands, leases, shards, rounds and push admission.

Pure decisions over plain data. Every method takes the time as ``now`` (seconds,
from whatever clock the caller injects) and returns its decision together with a
human-readable reason; nothing here reads a clock, does I/O, logs or starts a
thread. The gRPC servicer (``coordinator.server``) is a thin adapter that holds
one lock around every call.

A request the state machine refuses raises :class:`StateError` *before* any
change, so a refused request leaves the state exactly as it was.

Model:

- ``version`` counts merged outer steps (θ_version). A round collects the
  pushes that will be merged into ``version + 1``.
- Every island holds one data shard (``islands`` shards in all). A shard is
  free when no *live* island holds it; a new island takes the lowest free one.
  The merged data cursor is tracked per shard, so an island taking over the
  shard of a lost island resumes exactly where that shard's merged (or
  pending, hence certain to be merged) data ends.
- Liveness changes only through :meth:`CoordinatorState.expire` (the server
  calls it on a timer; :meth:`CoordinatorState.next_deadline` says when) and
  :meth:`CoordinatorState.heartbeat` / :meth:`CoordinatorState.join`.
- Pushes: :meth:`admit_push` decides without changing anything (the server
  then streams and validates the payload), :meth:`commit_push` records the
  decision. A push's weight is ``tokens · (1 + staleness)^−α``
  (``dtrain.outer.staleness_weight``).
- Idempotency: the ids of pending pushes, and of the last
  ``StateOptions.max_push_ids`` (100 000) merged or dropped ones, are
  remembered; a retry (which arrives within seconds) gets ``"duplicate"`` and is
  never applied twice. Older ids are forgotten, oldest first.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import asdict, dataclass

from dtrain.outer import staleness_weight

MAX_PUSH_IDS = 100_000
MAX_PUSH_ID_LEN = 128
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
HARDWARE = ("cpu", "gpu", "tpu")
ISLAND_STATES = ("live", "lost", "stopped")
FORMAT = 1  # to_json layout version


class StateError(Exception):
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
    mode: str = "sync"  # "sync" | "async"
    islands: int = 4  # expected islands = number of data shards
    min_quorum: int = 0  # sync: a round may close with this many pushes once grace has passed (0 = all live islands)
    grace_s: float = 30.0  # sync: seconds after the first push of a round before a quorum close is allowed
    lease_s: float = 15.0  # an island whose lease is not renewed for this long is lost
    late_policy: str = "discount"  # "discount" (weight x (1+s)^-alpha, applied to the open round) | "drop"
    max_staleness: int = 4  # deltas staler than this are dropped under either policy
    staleness_alpha: float = 0.5
    total_versions: int = 0  # the run stops after this many merged versions (0 = never)
    max_push_ids: int = MAX_PUSH_IDS  # merged/dropped push ids remembered for idempotency (oldest forgotten first)

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("sync", "async"):
            problems.append(f"mode {self.mode!r} must be 'sync' or 'async'")
        if self.late_policy not in ("discount", "drop"):
            problems.append(f"late_policy {self.late_policy!r} must be 'discount' or 'drop'")
        if self.islands < 1:
            problems.append(f"islands={self.islands} must be >= 1")
        if self.min_quorum < 0:
            problems.append(f"min_quorum={self.min_quorum} must be >= 0")
        if not self.grace_s >= 0:
            problems.append(f"grace_s={self.grace_s} must be >= 0")
        if not self.lease_s > 0:
            problems.append(f"lease_s={self.lease_s} must be > 0")
        if self.max_staleness < 0:
            problems.append(f"max_staleness={self.max_staleness} must be >= 0")
        if not self.staleness_alpha >= 0:
            problems.append(f"staleness_alpha={self.staleness_alpha} must be >= 0")
        if self.total_versions < 0:
            problems.append(f"total_versions={self.total_versions} must be >= 0")
        if self.max_push_ids < 1:
            problems.append(f"max_push_ids={self.max_push_ids} must be >= 1")
        if problems:
            raise ValueError("bad StateOptions: " + "; ".join(problems))


@dataclass
class IslandRecord:
    island_id: str
    name: str
    hardware: str
    devices: int
    shard_index: int
    state: str  # "live" | "lost" | "stopped"
    lease_expiry: float
    version: int = 0  # last version the island reported holding
    steps: int = 0
    tokens_reported: int = 0
    steps_per_s: float = 0.0
    tokens_merged: int = 0
    pushes_merged: int = 0
    cursor_merged: int = 0  # end of the data cursor range of its last merged push
    params_digest: str = ""
    bad_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class PushInfo:
    """What the server learned from the PushHeader (already type-validated)."""

    push_id: str
    island_id: str
    base_version: int
    tokens: int
    inner_steps: int
    cursor_start: int
    cursor_end: int


@dataclass(frozen=True)
class Admission:
    status: str  # "accept" | "duplicate" | "drop"
    weight: float  # merge weight = tokens * (1+staleness)^-alpha (0 for duplicate/drop)
    staleness: int  # version - base_version
    target_version: int  # the version this push is (or would have been) merged into
    reason: str

    def same_decision(self, other: Admission) -> bool:
        """Equal apart from the wording of the reason."""
        return (self.status, self.weight, self.staleness, self.target_version) == \
            (other.status, other.weight, other.staleness, other.target_version)


@dataclass
class _Pending:
    info: PushInfo
    admission: Admission
    shard_index: int  # the shard the island held when it pushed (it may move on a later rejoin)
    received: float


@dataclass(frozen=True)
class _Seen:
    """A push id that is no longer pending: merged into ``target_version``, or dropped."""

    island_id: str
    status: str  # "merged" | "dropped"
    target_version: int
    staleness: int


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
        self._pending: dict[str, _Pending] = {}  # push_id -> pending push, in arrival order
        self._first_pending: float | None = None
        self._seen: collections.OrderedDict[str, _Seen] = collections.OrderedDict()

    # -- queries ------------------------------------------------------------------------------------

    def stopped(self) -> bool:
        return self.opts.total_versions > 0 and self.version >= self.opts.total_versions

    def live(self) -> list[IslandRecord]:
        return [r for r in self.islands.values() if r.state == "live"]

    def pending(self) -> list[tuple[PushInfo, Admission]]:
        return [(p.info, p.admission) for p in self._pending.values()]

    def push_known(self, push_id: str) -> bool:
        """Whether a push id is pending or remembered as merged/dropped (Heartbeat's push_unknown is the negation)."""
        return push_id in self._pending or push_id in self._seen

    def shard_cursor(self, shard_index: int) -> int:
        """Where the shard's merged data ends, counting pushes pending in the open round (they will be merged)."""
        if not 0 <= shard_index < self.opts.islands:
            raise StateError("INVALID_ARGUMENT", f"shard_index={shard_index}: must be in [0, {self.opts.islands})")
        cursor = self.shard_cursors[shard_index]
        for p in self._pending.values():
            if p.shard_index == shard_index:
                cursor = max(cursor, p.info.cursor_end)
        return cursor

    def _by_name(self, name: str) -> IslandRecord | None:
        for r in self.islands.values():
            if r.name == name:
                return r
        return None

    def _free_shards(self, exclude: str | None = None) -> list[int]:
        held = {r.shard_index for r in self.live() if r.island_id != exclude}
        return [s for s in range(self.opts.islands) if s not in held]

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
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise StateError("INVALID_ARGUMENT", f"devices={devices!r}: must be an integer >= 1")
        lease = now + self.opts.lease_s
        old = self._by_name(name)
        if old is not None:
            was = old.state
            taker = next((r for r in self.live() if r.shard_index == old.shard_index and r.island_id != old.island_id),
                         None)
            if taker is None:
                shard, how = old.shard_index, f"kept shard {old.shard_index}"
            else:
                free = self._free_shards(exclude=old.island_id)
                if not free:
                    raise StateError("FAILED_PRECONDITION",
                                     f"{old.island_id} cannot rejoin: its shard {old.shard_index} was taken over by "
                                     f"{taker.island_id} and all {self.opts.islands} shards are held by live "
                                     f"islands: {self._holders()}")
                shard = free[0]
                how = f"its shard {old.shard_index} was taken over by {taker.island_id}, moved to free shard {shard}"
            old.hardware, old.devices, old.shard_index = hardware, devices, shard
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
        record = IslandRecord(island_id=island_id, name=name, hardware=hardware, devices=devices, shard_index=shard,
                              state="live", lease_expiry=lease)
        self.islands[island_id] = record
        return record, f"joined as {island_id}: {how}"

    def heartbeat(self, island_id: str, version: int, steps: int, tokens: int, steps_per_s: float,
                  params_digest: str, bad_devices: tuple[str, ...], now: float) -> tuple[str, str]:
        """Renew a live island's lease and record its report; returns (action, reason)."""
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
        if record.state == "lost":
            return "rejoin", (f"{island_id}'s lease expired at t={record.lease_expiry:.1f} "
                              f"(now t={now:.1f}): call Join again")
        record.version, record.steps, record.tokens_reported = version, steps, tokens
        record.steps_per_s, record.params_digest, record.bad_devices = float(steps_per_s), params_digest, bad
        record.lease_expiry = now + self.opts.lease_s
        if self.stopped():
            record.state = "stopped"
            return "stop", f"the run is over: {self.version} of {self.opts.total_versions} versions merged"
        if record.state == "stopped":  # stopped in a run that was since resumed with more total_versions
            record.state = "live"
        if version < self.version:
            return "pull", f"holding version {version}, the global version is {self.version}: pull"
        return "continue", (f"holding the latest version {self.version}; lease renewed until "
                            f"t={record.lease_expiry:.1f}")

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
                lost.append((r.island_id, (f"no heartbeat for {self.opts.lease_s:g}s: lease expired at "
                                          f"t={r.lease_expiry:.1f}, shard {r.shard_index} is free{keep}")))
        return lost

    # -- pushes -------------------------------------------------------------------------------------

    def admit_push(self, info: PushInfo, now: float) -> Admission:
        """Decide what to do with a push from its header alone. Changes nothing."""
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
        if record.state == "lost":
            raise StateError("FAILED_PRECONDITION", f"{info.island_id}: lease expired: rejoin (call Join again)")
        if info.base_version > self.version:
            raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: base_version={info.base_version} is ahead "
                                                 f"of the coordinator's version {self.version}")
        staleness = self.version - info.base_version
        target = self.version + 1
        if self.stopped():
            return Admission("drop", 0.0, staleness, target,
                             f"the run is over ({self.version} of {self.opts.total_versions} versions merged): "
                             f"push {info.push_id} dropped")
        if self.opts.mode == "sync" and info.island_id in self._pending_islands():
            prior = next(p for p in self._pending.values() if p.info.island_id == info.island_id)
            raise StateError("FAILED_PRECONDITION",
                             f"{info.island_id} already pushed for version {target} (push {prior.info.push_id}); "
                             f"wait for the round to close")
        if staleness > self.opts.max_staleness:
            return Admission("drop", 0.0, staleness, target,
                             f"delta from version {info.base_version} is {staleness} versions stale "
                             f"(max_staleness {self.opts.max_staleness}): dropped")
        if staleness > 0 and self.opts.late_policy == "drop":
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
                    else f"was dropped (round for version {target})")
        if owner != info.island_id:
            raise StateError("INVALID_ARGUMENT", f"push_id {info.push_id!r} was already used by island {owner}")
        return Admission("duplicate", 0.0, staleness, target,
                         f"push {info.push_id} {what}: a retry, not applied again")

    def commit_push(self, info: PushInfo, admission: Admission, now: float) -> None:
        """Record an admitted push: pending (accept), counted (drop, duplicate). The push id is remembered.

        ``admission`` must be what :meth:`admit_push` decides now (the server admits again under the same
        lock just before); a stale one (e.g. the round closed meanwhile) raises FAILED_PRECONDITION.
        """
        current = self.admit_push(info, now)
        if not current.same_decision(admission):
            raise StateError("FAILED_PRECONDITION",
                             f"push {info.push_id}: stale admission ({admission.status} for version "
                             f"{admission.target_version}); now it is {current.status} for version "
                             f"{current.target_version}: {current.reason}")
        if admission.status == "duplicate":
            self.duplicates += 1
        elif admission.status == "drop":
            self.deltas_dropped += 1
            self._remember(info.push_id, _Seen(info.island_id, "dropped", admission.target_version,
                                               admission.staleness))
        else:
            if not self._pending:
                self._first_pending = float(now)
            self._pending[info.push_id] = _Pending(info, admission, self.islands[info.island_id].shard_index,
                                                   float(now))

    def _remember(self, push_id: str, seen: _Seen) -> None:
        self._seen[push_id] = seen
        while len(self._seen) > self.opts.max_push_ids:
            self._seen.popitem(last=False)

    # -- rounds -------------------------------------------------------------------------------------

    def round_ready(self, now: float) -> tuple[bool, str]:
        """Whether the open round can close now, and why (not)."""
        n = len(self._pending)
        if self.stopped():
            return False, f"the run is over: {self.version} of {self.opts.total_versions} versions merged"
        if self.opts.mode == "async":
            if n:
                return True, f"{n} push{'es' if n > 1 else ''} pending (async: merge on arrival)"
            return False, "no pushes pending"
        live = sorted(self.live(), key=lambda r: r.shard_index)
        pushed = self._pending_islands()
        missing = [r.island_id for r in live if r.island_id not in pushed]
        if n == 0:
            return False, f"waiting for the first push for version {self.version + 1} ({len(live)} live islands)"
        if not missing:
            extra = len(pushed - {r.island_id for r in live})
            lost = f" (+{extra} from islands no longer live)" if extra else ""
            return True, f"all {len(live)} live islands pushed{lost}"
        quorum = self.opts.min_quorum or len(live)
        grace_end = self._first_pending + self.opts.grace_s
        if n >= quorum and now >= grace_end:
            return True, (f"quorum {n} of {len(live)} after {self.opts.grace_s:g}s grace "
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
            self.shard_cursors[p.shard_index] = max(self.shard_cursors[p.shard_index], info.cursor_end)
            tokens += info.tokens
            merged.append(info)
            self._remember(info.push_id, _Seen(info.island_id, "merged", self.version, p.admission.staleness))
        self.deltas_merged += len(merged)
        self.tokens_merged += tokens
        self._pending.clear()
        self._first_pending = None
        done = f"; the run is over ({self.opts.total_versions} versions)" if self.stopped() else ""
        return self.version, merged, (f"merged {len(merged)} deltas ({', '.join(i.island_id for i in merged)}; "
                                      f"{tokens} tokens) into version {self.version} ({why}){done}")

    def next_deadline(self, now: float) -> float | None:
        """When round_ready or liveness could next change by time alone: the grace end or the earliest lease
        expiry of a live island (may be <= now if expire() is due). None if nothing is timed."""
        times = [r.lease_expiry for r in self.live()]
        if self.opts.mode == "sync" and self._pending and self._first_pending is not None:
            grace_end = self._first_pending + self.opts.grace_s
            if grace_end > now:
                times.append(grace_end)
        return min(times) if times else None

    # -- checkpoint ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Everything, as plain JSON types (for the coordinator checkpoint)."""
        islands = []
        for r in self.islands.values():
            d = asdict(r)
            d["bad_devices"] = list(r.bad_devices)
            islands.append(d)
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "created": self.created,
            "shards": self.opts.islands,
            "version": self.version,
            "counters": {"deltas_merged": self.deltas_merged, "deltas_dropped": self.deltas_dropped,
                         "duplicates": self.duplicates, "tokens_merged": self.tokens_merged},
            "islands": islands,
            "shard_cursors": list(self.shard_cursors),
            "pending": [{"info": asdict(p.info), "admission": asdict(p.admission), "shard_index": p.shard_index,
                         "received": p.received} for p in self._pending.values()],
            "first_pending": self._first_pending,
            "push_ids": [[pid, s.island_id, s.status, s.target_version, s.staleness] for pid, s in self._seen.items()],
        }

    @classmethod
    def from_json(cls, opts: StateOptions, blob: dict, now: float) -> CoordinatorState:
        """Restore from :meth:`to_json`. Every island's lease is renewed to now + lease_s (islands keep training
        through a coordinator outage). Malformed input raises StateError INVALID_ARGUMENT naming the field.

        Pending pushes are restored as they were; the caller must hold their accumulated deltas too (the server
        checkpoints right after close_round, when none are pending).
        """
        v = _Reader()
        blob = v.obj(blob, "state")
        if blob.get("format") != FORMAT:
            v.fail("state.format", f"expected {FORMAT}, got {blob.get('format')!r}")
        if v.integer(blob, "shards", "state") != opts.islands:
            v.fail("state.shards", f"checkpoint has {blob['shards']} shards, the config has {opts.islands} islands")
        state = cls(opts, v.text(blob, "run_id", "state"), v.number(blob, "created", "state"))
        state.version = v.integer(blob, "version", "state")
        counters = v.obj(blob.get("counters"), "state.counters")
        for k in ("deltas_merged", "deltas_dropped", "duplicates", "tokens_merged"):
            setattr(state, k, v.integer(counters, k, "state.counters"))
        for i, d in enumerate(v.arr(blob.get("islands"), "state.islands")):
            where = f"state.islands[{i}]"
            d = v.obj(d, where)
            rec = IslandRecord(
                island_id=v.text(d, "island_id", where), name=v.text(d, "name", where),
                hardware=v.text(d, "hardware", where, choices=HARDWARE), devices=v.integer(d, "devices", where, lo=1),
                shard_index=v.integer(d, "shard_index", where, hi=opts.islands - 1),
                state=v.text(d, "state", where, choices=ISLAND_STATES), lease_expiry=now + opts.lease_s,
                version=v.integer(d, "version", where, hi=state.version), steps=v.integer(d, "steps", where),
                tokens_reported=v.integer(d, "tokens_reported", where), steps_per_s=v.number(d, "steps_per_s", where),
                tokens_merged=v.integer(d, "tokens_merged", where), pushes_merged=v.integer(d, "pushes_merged", where),
                cursor_merged=v.integer(d, "cursor_merged", where), params_digest=v.text(d, "params_digest", where),
                bad_devices=tuple(v.text({"x": x}, "x", f"{where}.bad_devices")
                                  for x in v.arr(d.get("bad_devices"), f"{where}.bad_devices")))
            v.number(d, "lease_expiry", where)
            if not NAME_RE.fullmatch(rec.name):
                v.fail(f"{where}.name", f"{rec.name!r} is not a valid island name")
            if rec.island_id in state.islands:
                v.fail(f"{where}.island_id", f"duplicate island_id {rec.island_id!r}")
            if state._by_name(rec.name) is not None:
                v.fail(f"{where}.name", f"duplicate name {rec.name!r}")
            if rec.state == "live" and rec.shard_index not in state._free_shards():
                v.fail(f"{where}.shard_index", f"shard {rec.shard_index} is held by two live islands")
            state.islands[rec.island_id] = rec
        cursors = v.arr(blob.get("shard_cursors"), "state.shard_cursors")
        if len(cursors) != opts.islands:
            v.fail("state.shard_cursors", f"expected {opts.islands} entries, got {len(cursors)}")
        state.shard_cursors = [v.integer({"x": c}, "x", f"state.shard_cursors[{i}]") for i, c in enumerate(cursors)]
        for i, e in enumerate(v.arr(blob.get("push_ids"), "state.push_ids")):
            where = f"state.push_ids[{i}]"
            e = v.arr(e, where)
            if len(e) != 5:
                v.fail(where, f"expected [push_id, island_id, status, target_version, staleness], got {e!r}")
            pid, iid, status, target, stale = e
            row = dict(zip(("push_id", "island_id", "status", "target_version", "staleness"), e))
            v.text(row, "push_id", where), v.text(row, "island_id", where)
            v.text(row, "status", where, choices=("merged", "dropped"))
            v.integer(row, "target_version", where, lo=1), v.integer(row, "staleness", where)
            if not pid or len(pid) > MAX_PUSH_ID_LEN or pid in state._seen:
                v.fail(f"{where}.push_id", f"{pid!r}: empty, too long or repeated")
            state._seen[pid] = _Seen(iid, status, target, stale)
        while len(state._seen) > opts.max_push_ids:
            state._seen.popitem(last=False)
        for i, e in enumerate(v.arr(blob.get("pending"), "state.pending")):
            where = f"state.pending[{i}]"
            e = v.obj(e, where)
            di, da = v.obj(e.get("info"), f"{where}.info"), v.obj(e.get("admission"), f"{where}.admission")
            info = PushInfo(push_id=v.text(di, "push_id", f"{where}.info"),
                            island_id=v.text(di, "island_id", f"{where}.info"),
                            **{k: v.integer(di, k, f"{where}.info") for k in ("base_version", "tokens", "inner_steps",
                                                                          "cursor_start", "cursor_end")})
            adm = Admission(status=v.text(da, "status", f"{where}.admission", choices=("accept",)),
                            weight=v.number(da, "weight", f"{where}.admission"),
                            staleness=v.integer(da, "staleness", f"{where}.admission"),
                            target_version=v.integer(da, "target_version", f"{where}.admission",
                                                 lo=state.version + 1, hi=state.version + 1),
                            reason=v.text(da, "reason", f"{where}.admission"))
            if info.island_id not in state.islands:
                v.fail(f"{where}.info.island_id", f"unknown island {info.island_id!r}")
            if info.push_id in state._pending or info.push_id in state._seen:
                v.fail(f"{where}.info.push_id", f"{info.push_id!r} is repeated")
            state._pending[info.push_id] = _Pending(info, adm, v.integer(e, "shard_index", where, hi=opts.islands - 1),
                                                    v.number(e, "received", where))
        first = blob.get("first_pending")
        if state._pending:
            state._first_pending = v.number(blob, "first_pending", "state")
        elif first is not None:
            v.fail("state.first_pending", "must be null when nothing is pending")
        return state

    # -- status -------------------------------------------------------------------------------------

    def status(self, now: float) -> dict:
        """Plain-JSON snapshot for the Status RPC and the dashboard."""
        ready, reason = self.round_ready(now)
        islands = []
        for r in sorted(self.islands.values(), key=lambda r: (r.shard_index, r.island_id)):
            d = asdict(r)
            d["bad_devices"] = list(r.bad_devices)
            d["lease_left_s"] = max(0.0, r.lease_expiry - now) if r.state == "live" else 0.0
            islands.append(d)
        return {
            "run_id": self.run_id,
            "version": self.version,
            "mode": self.opts.mode,
            "total_versions": self.opts.total_versions,
            "stopped": self.stopped(),
            "islands": islands,
            "live": len(self.live()),
            "deltas_merged": self.deltas_merged,
            "deltas_dropped": self.deltas_dropped,
            "duplicates": self.duplicates,
            "tokens_merged": self.tokens_merged,
            "shard_cursors": [self.shard_cursor(s) for s in range(self.opts.islands)],
            "round": {"target_version": self.version + 1, "ready": ready, "reason": reason,
                      "pending": [{"push_id": i.push_id, "island_id": i.island_id, "tokens": i.tokens,
                                   "weight": a.weight, "staleness": a.staleness} for i, a in self.pending()]},
            "next_deadline": self.next_deadline(now),
        }


class _Reader:
    """Checks a checkpoint blob field by field; every failure names the field."""

    @staticmethod
    def fail(where: str, why: str):
        raise StateError("INVALID_ARGUMENT", f"bad coordinator state: {where}: {why}")

    def obj(self, x, where: str) -> dict:
        if not isinstance(x, dict):
            self.fail(where, f"expected an object, got {type(x).__name__}")
        return x

    def arr(self, x, where: str) -> list:
        if not isinstance(x, list):
            self.fail(where, f"expected a list, got {type(x).__name__}")
        return x

    def _get(self, d: dict, key: str, where: str):
        if key not in d:
            self.fail(f"{where}.{key}", "missing")
        return d[key]

    def text(self, d: dict, key: str, where: str, choices: tuple[str, ...] | None = None) -> str:
        x = self._get(d, key, where)
        if not isinstance(x, str):
            self.fail(f"{where}.{key}", f"expected a string, got {x!r}")
        if choices is not None and x not in choices:
            self.fail(f"{where}.{key}", f"{x!r} is not one of {', '.join(choices)}")
        return x

    def integer(self, d: dict, key: str, where: str, lo: int = 0, hi: int | None = None) -> int:
        x = self._get(d, key, where)
        if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
            rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            self.fail(f"{where}.{key}", f"expected an integer {rng}, got {x!r}")
        return x

    def number(self, d: dict, key: str, where: str) -> float:
        x = self._get(d, key, where)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            self.fail(f"{where}.{key}", f"expected a finite number, got {x!r}")
        return float(x)
