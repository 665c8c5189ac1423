"""Islands joining, reporting and losing their leases: which segment of which shard an island gets (a free
one, its own again, or a lost island's that still has data), what a heartbeat reply tells it, and its chip-health
report.

:class:`Membership` acts on the islands the state owns (``CoordinatorState.islands``) and reads the data's
standing from its ``coordinator.ledger.PushLedger``; every method takes the time as ``now``. A request it
refuses raises ``StateError`` before any change.

Rerouting: an island holds one segment of a shard (``coordinator.records.Segment``; a shard starts as one). A
lost (or quarantined: ``coordinator.admission``) island's segment is free; the next island to need one takes it,
from its cursor: a new island, the lost island returning, or an island whose own segment is done (its heartbeat
reply says ``rejoin`` while a free segment has data left, and its Join moves it there). Splitting: when an island
whose own segment is done takes over a lost island's, the data left is split (``PushLedger.split``) into one
piece per live island, in whole rounds; it trains the first, and each other piece is a free segment the next
island out of data takes (whole: a piece is split again only once its own holder is lost).

Chip health: a heartbeat may carry the devices the island's probes quarantined, each with its evidence
(``DeviceEvidence``), and the devices it trains on now. A quarantined island's heartbeat is told to stop, with
the reason, and its Join is refused. The report is checked before anything changes
(:func:`check_report`). Quarantine is permanent for the island's record: a device enters
``IslandRecord.quarantined`` with the evidence of its first report and a later report that omits it does not
take it out (a heartbeat without a report, or an island process restarted before its probes find the chip
again, is no proof the chip is good); ``bad_devices`` is derived from it.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.ledger import PushLedger
from coordinator.records import (
    HARDWARE,
    MAX_BAD_DEVICES,
    MAX_DEVICE_LEN,
    MAX_DIGEST_LEN,
    NAME_RE,
    DeviceEvidence,
    Hardware,
    IslandRecord,
    Segment,
    StateError,
    StateOptions,
)
from dtrain import schema
from dtrain.net.wire import MAX_EVIDENCE, MAX_EVIDENCE_DETAIL


def check_identity(name: str, hardware: str, devices: int) -> Hardware:
    """A Join's fields checked (INVALID_ARGUMENT naming the field); returns its hardware kind."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise StateError("INVALID_ARGUMENT", f"island name {name!r}: must match [A-Za-z0-9._-]{{1,64}}")
    if hardware not in HARDWARE:
        raise StateError("INVALID_ARGUMENT", f"hardware {hardware!r}: must be one of {', '.join(HARDWARE)}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise StateError("INVALID_ARGUMENT", f"devices={devices!r}: must be an integer >= 1")
    return typing.cast(Hardware, hardware)


def check_heartbeat(version: int, steps: int, tokens: int, steps_per_s: float, params_digest: str,
                    bad_devices: tuple[str, ...], current: int) -> None:
    """A heartbeat's report checked (INVALID_ARGUMENT naming the field); ``current``: the coordinator's version."""
    for fname, value in (("version", version), ("steps", steps), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StateError("INVALID_ARGUMENT", f"{fname}={value!r}: must be an integer >= 0")
    if version > current:
        raise StateError("INVALID_ARGUMENT", f"version={version} is ahead of the coordinator's version "
                                             f"{current}: an island cannot hold a future version")
    if not (isinstance(steps_per_s, (int, float)) and math.isfinite(steps_per_s) and steps_per_s >= 0):
        raise StateError("INVALID_ARGUMENT", f"steps_per_s={steps_per_s!r}: must be a finite number >= 0")
    if not isinstance(params_digest, str) or len(params_digest) > MAX_DIGEST_LEN:
        raise StateError("INVALID_ARGUMENT", f"params_digest: must be a string of at most {MAX_DIGEST_LEN} characters")
    if len(bad_devices) > MAX_BAD_DEVICES or not all(isinstance(d, str) and len(d) <= MAX_DEVICE_LEN
                                                     for d in bad_devices):
        raise StateError("INVALID_ARGUMENT", f"bad_devices: at most {MAX_BAD_DEVICES} strings of at most "
                                             f"{MAX_DEVICE_LEN} characters")


def check_report(record: IslandRecord, quarantined: Sequence[Mapping[str, Any]], devices: int,
                  bad_devices: tuple[str, ...]) -> list[DeviceEvidence]:
    """A heartbeat's chip-health report, checked against the island's mesh (``mesh_devices``: the most it
    declared at a Join) and its record; the evidence, or StateError INVALID_ARGUMENT naming the problem."""
    def refuse(why: str) -> typing.NoReturn:
        raise StateError("INVALID_ARGUMENT", why)

    mesh = record.mesh_devices
    if isinstance(devices, bool) or not isinstance(devices, int) or not 0 <= devices <= mesh:
        refuse(f"devices={devices!r}: must be an integer from 0 (not reported) to the {mesh} devices "
               f"{record.name} declared at Join")
    if len(quarantined) > min(mesh, MAX_EVIDENCE):
        refuse(f"quarantined: {len(quarantined)} devices reported, {record.name}'s mesh holds {mesh} "
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
            refuse(f"quarantined[{i}].index={ev.index}: outside {record.name}'s mesh of {mesh} devices")
        for other in report:
            if other.device == ev.device:
                refuse(f"quarantined[{i}]: device {ev.device} is named twice")
            if other.index == ev.index:
                refuse(f"quarantined[{i}]: mesh index {ev.index} is named twice (devices {other.device} and "
                       f"{ev.device})")
        report.append(ev)
    if devices and devices + len(report) > mesh:
        refuse(f"devices={devices} healthy and {len(report)} quarantined: more than the {mesh} devices of "
               f"{record.name}'s mesh")
    known = {e.device for e in record.quarantined}
    total = len(known | {e.device for e in report})
    if total > mesh:
        refuse(f"quarantined: {record.name} would have {total} devices quarantined, its mesh holds {mesh}")
    names = {str(e.device) for e in report}
    if report and bad_devices and set(bad_devices) != names:
        refuse(f"bad_devices {sorted(bad_devices)} do not name the quarantined devices {sorted(names)}")
    return report


class Membership:
    """The islands' membership, shards and leases, over the state's islands (shared, not copied)."""

    def __init__(self, opts: StateOptions, islands: dict[str, IslandRecord], ledger: PushLedger):
        self.opts = opts
        self.islands = islands
        self.ledger = ledger

    # -- queries ------------------------------------------------------------------------------------

    def live(self) -> list[IslandRecord]:
        """The live islands, in the order they first joined."""
        return [r for r in self.islands.values() if r.state == "live"]

    def by_name(self, name: str) -> IslandRecord | None:
        """The record of the island called ``name``, if it ever joined."""
        for r in self.islands.values():
            if r.name == name:
                return r
        return None

    def segment(self, record: IslandRecord) -> Segment:
        """The segment the island holds (or held, when it was lost)."""
        return self.ledger.segment(record.shard_index, record.segment_start)

    def free_segments(self, exclude: str | None = None) -> list[Segment]:
        """Segments no live island holds (but ``exclude``), those with data left first (then by shard and start)."""
        held = {(r.shard_index, r.segment_start) for r in self.live() if r.island_id != exclude}
        return sorted((seg for key, seg in self.ledger.segments.items() if key not in held),
                      key=lambda seg: (not self.ledger.data_left(seg), seg.key))

    def orphan(self, exclude: str) -> Segment | None:
        """The free segment with data left, if any (the lowest): a lost island's, or a piece of one, for an island
        with none."""
        free = [seg for seg in self.free_segments(exclude=exclude) if self.ledger.data_left(seg)]
        return free[0] if free else None

    def lost_holder(self, seg: Segment) -> IslandRecord | None:
        """The lost (or quarantined) island that held ``seg`` last, if no live island holds it now."""
        holders = [r for r in self.islands.values() if (r.shard_index, r.segment_start) == seg.key]
        if any(r.state == "live" for r in holders):
            return None
        lost = [r for r in holders if r.state in ("lost", "quarantined")]
        return lost[-1] if lost else None

    def holders(self) -> str:
        """The live islands and their segments, for a refusal's reason."""
        shard_end = self.opts.shard_end
        return ", ".join(f"{r.name} ({self.segment(r).describe(shard_end)})"
                         for r in sorted(self.live(), key=lambda r: (r.shard_index, r.segment_start)))

    def describe(self, seg: Segment) -> str:
        return seg.describe(self.opts.shard_end)

    def all_held(self) -> str:
        """"all N shards" (each one segment) or "all N segments of the M shards", for a refusal's reason."""
        n, shards = len(self.ledger.segments), self.opts.islands
        return f"all {shards} shards" if n == shards else f"all {n} segments of the {shards} shards"

    # -- join / heartbeat / expire ------------------------------------------------------------------

    def join(self, name: str, kind: Hardware, devices: int, now: float) -> tuple[IslandRecord, str]:
        """Register an island (or take back a returning one); returns its record and why it got that segment.
        The caller checked the fields (:func:`check_identity`) and that the run goes on."""
        lease = now + self.opts.coordinator.lease_s
        old = self.by_name(name)
        if old is not None and old.state == "quarantined":
            raise StateError("FAILED_PRECONDITION", f"{name} may not join again: {old.stop_reason}")
        if old is not None:
            was = old.state
            seg, how, split = self._rejoin_segment(old)
            if split:
                how += self._split(seg, old)
            old.hardware, old.devices, old.shard_index, old.segment_start = kind, devices, seg.shard, seg.start
            old.mesh_devices = max(old.mesh_devices, devices)
            old.state, old.lease_expiry = "live", lease
            return old, (f"rejoined as {old.island_id} (was {was}): {how}, cursor {self.ledger.cursor(seg)}")
        free = self.free_segments()
        if not free:
            raise StateError("FAILED_PRECONDITION",
                             f"{self.all_held()} are held by live islands: {self.holders()}")
        seg = free[0]
        island_id = f"{name}-{seg.shard}"
        n = 1
        while island_id in self.islands:  # cannot happen with one record per name; kept as a guard
            island_id, n = f"{name}-{seg.shard}.{n}", n + 1
        previous = self.lost_holder(seg)
        cursor = self.ledger.cursor(seg)
        if previous is not None:
            how = f"took over {self.describe(seg)} of lost island {previous.name} at cursor {cursor}"
        else:
            how = f"assigned free {self.describe(seg)} at cursor {cursor}"
        record = IslandRecord(island_id=island_id, name=name, hardware=kind, devices=devices, mesh_devices=devices,
                              shard_index=seg.shard, segment_start=seg.start, state="live", lease_expiry=lease)
        self.islands[island_id] = record
        return record, f"joined as {island_id}: {how}"

    def _rejoin_segment(self, old: IslandRecord) -> tuple[Segment, str, bool]:
        """The segment a returning island gets, how, and whether it is to be split (a lost island's, taken over by
        an island whose own data is done): its own while no live island took it and it has data left, else a
        free segment with data left, else its own (done) or any free one."""
        own = self.segment(old)
        taker = next((r for r in self.live() if (r.shard_index, r.segment_start) == own.key
                      and r.island_id != old.island_id), None)
        orphan = self.orphan(exclude=old.island_id)
        if taker is None and self.ledger.data_left(own):
            return own, f"kept {self.describe(own)}", False
        if orphan is not None:  # the island's segment is done (or taken): it finishes another's
            mine = (f"its {self.describe(own)} was taken over by {taker.name}" if taker is not None
                    else f"its {self.describe(own)} is done")
            lost = self.lost_holder(orphan)
            whose = f" of lost island {lost.name}" if lost is not None else ""
            return orphan, (f"{mine}; took over {self.describe(orphan)}{whose}, which no live island holds and has "
                            f"data left"), lost is not None
        if taker is None:
            return own, f"kept {self.describe(own)} (done: no segment has data left to take)", False
        free = self.free_segments(exclude=old.island_id)
        if not free:
            raise StateError("FAILED_PRECONDITION",
                             f"{old.name} cannot rejoin: its {self.describe(own)} was taken over by "
                             f"{taker.name} and {self.all_held()} are held by live islands: {self.holders()}")
        return free[0], (f"its {self.describe(own)} was taken over by {taker.name}, moved to free "
                         f"{self.describe(free[0])}"), False

    def _split(self, seg: Segment, taker: IslandRecord) -> str:
        """A lost island's segment, taken over by ``taker``: its data left is split into one piece per live
        island (``taker`` counted), in whole rounds (``PushLedger.split``); ``taker`` keeps the first. Returns
        what was done, for the reason ("" when nothing was split)."""
        helpers = len({r.island_id for r in self.live()} | {taker.island_id})
        pieces = self.ledger.split(seg, helpers)
        if not pieces:
            return ""
        return (f", split for {helpers} live islands into {self.describe(seg)} (this island's) and "
                + ", ".join(f"[{p.start}, {p.end})" for p in pieces))

    def heartbeat(self, island_id: str, version: int, steps: int, tokens: int, steps_per_s: float,
                  params_digest: str, bad_devices: tuple[str, ...], now: float, *,
                  quarantined: Sequence[Mapping[str, Any]], devices: int, current: int,
                  over: str, tokens_per_s: float = 0.0) -> tuple[str, str]:
        """Renew a live island's lease and record its report; returns (action, reason). ``current``: the
        coordinator's version; ``over``: why the run is over, "" while it goes on. The parameters are
        ``CoordinatorState.heartbeat``'s."""
        record = self.islands.get(island_id)
        if record is None:
            raise StateError("NOT_FOUND", f"unknown island_id {island_id!r}: call Join first")
        bad = tuple(bad_devices)
        check_heartbeat(version, steps, tokens, steps_per_s, params_digest, bad, current)
        if not (isinstance(tokens_per_s, (int, float)) and math.isfinite(tokens_per_s) and tokens_per_s >= 0):
            raise StateError("INVALID_ARGUMENT", f"tokens_per_s={tokens_per_s!r}: must be a finite number >= 0")
        report = check_report(record, quarantined, devices, bad)
        if record.state == "quarantined":  # its lease is not renewed: it is told to stop, with why
            return "stop", record.stop_reason
        if record.state == "lost":
            if over:  # nothing to rejoin for: the island's lease is not renewed either
                return "stop", over
            return "rejoin", (f"{record.name}'s lease expired at t={record.lease_expiry:.1f} "
                              f"(now t={now:.1f}): call Join again")
        record.version, record.steps, record.tokens_reported = version, steps, tokens
        record.steps_per_s, record.params_digest = float(steps_per_s), params_digest
        if tokens_per_s:  # 0: not measured (yet); the last measurement stands
            record.tokens_per_s = float(tokens_per_s)
        known = {e.device for e in record.quarantined}
        record.quarantined += tuple(e for e in report if e.device not in known)
        record.bad_devices = tuple(str(e.device) for e in sorted(record.quarantined, key=lambda e: e.device)) or bad
        if devices:
            record.devices = devices
        record.lease_expiry = now + self.opts.coordinator.lease_s
        return self._reply(record, current, over)

    def _reply(self, record: IslandRecord, current: int, over: str) -> tuple[str, str]:
        """What a live island that just reported is told: stop, rejoin (its shard is done and another has data
        no live island trains), pull or continue."""
        island_id, version = record.island_id, record.version
        if over:
            if version >= current:  # it holds the last θ; until then finished() waits for it (linger_s)
                record.state = "stopped"
                return "stop", over
            return "stop", f"{over}: pull version {current}, the last"
        if record.state == "stopped":  # stopped in a run that was since resumed with more total_versions
            record.state = "live"
        rejected = self.ledger.notice(island_id)
        own = self.segment(record)
        orphan = None if self.ledger.data_left(own) else self.orphan(exclude=island_id)
        if orphan is not None:
            return "rejoin", (f"{record.name}'s {self.describe(own)} is done and {self.describe(orphan)} has data no "
                              f"live island trains (from cursor {self.ledger.cursor(orphan)}): call Join to "
                              f"take it over{rejected}")
        if version < current:
            return "pull", f"holding version {version}, the global version is {current}: pull{rejected}"
        return "continue", (f"holding the latest version {current}; lease renewed until "
                            f"t={record.lease_expiry:.1f}{rejected}")

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Mark live islands whose lease ended (now >= lease_expiry) as lost; returns (island_id, reason) for each.

        Their pending pushes stay in the open round: they were received in full.
        """
        lost = []
        for r in self.islands.values():
            if r.state == "live" and now >= r.lease_expiry:
                r.state = "lost"
                pending = self.ledger.pending_of(r.island_id)
                keep = f"; its pending push {', '.join(pending)} stays in the open round" if pending else ""
                lost.append((r.island_id, (f"no heartbeat for {self.opts.coordinator.lease_s:g}s: lease expired at "
                                          f"t={r.lease_expiry:.1f}, {self.describe(self.segment(r))} is free{keep}")))
        return lost

    def pause_leases(self, seconds: float) -> None:
        """Moves every live island's lease end ``seconds`` later: time in which the coordinator could not hear
        heartbeats (the server calls it when a long merge held its lock past a lease's end), which no island is
        to be blamed for. A dead island is then found that much later."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"pause_leases: seconds={seconds!r}: must be a finite number >= 0")
        for r in self.live():
            r.lease_expiry += seconds

    # -- forgetting ---------------------------------------------------------------------------------

    def forget(self, now: float) -> list[IslandRecord]:
        """Drops the records of islands lost for ``coordinator.forget_after_s`` (0: never) and returns them, so
        that Status and the checkpoint hold the live islands and the recently lost ones however many joined. An
        island with a push pending in the open round is kept (its merge counts into the record). Nothing else
        changes: shards and their cursors are the ledger's, not the record's (a lost island's shard is free
        already); the island's events stay; its name may join again (a new record)."""
        after = self.opts.coordinator.forget_after_s
        if not after:
            return []
        pending = self.ledger.pending_islands()
        gone = [r for r in self.islands.values()
                if r.state == "lost" and now >= r.lease_expiry + after and r.island_id not in pending]
        for r in gone:
            del self.islands[r.island_id]
            self.ledger.rejections.pop(r.island_id, None)
        return gone

    def next_forget(self) -> float | None:
        """When :meth:`forget` next has a record to drop (None: none lost, or never). An island kept for its
        pending push is not timed: the merge that ends its round wakes the ticker anyway."""
        after = self.opts.coordinator.forget_after_s
        pending = self.ledger.pending_islands()
        lost = [r.lease_expiry + after for r in self.islands.values()
                if r.state == "lost" and r.island_id not in pending]
        return min(lost) if after and lost else None
