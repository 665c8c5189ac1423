"""The coordinator's state machine: islands, leases, shards, rounds, push admission and the end of the run.

Pure decisions over plain data. Every method takes the time as ``now`` (seconds,
from whatever clock the caller injects) and returns its decision together with a
human-readable reason; nothing here reads a clock, does I/O, logs or starts a
thread. The gRPC servicer (``coordinator.service``) is a thin adapter that holds
one lock around every call and turns a :class:`StateError` into the gRPC status
its code names.

A request the state machine refuses raises :class:`StateError` *before* any
change, so a refused request leaves the state exactly as it was.

:class:`CoordinatorState` is the one object the server holds; it owns the
version, the islands and the counters, and puts together the parts, each in its
own module:

- ``coordinator.records``: the plain data (options, island records, push
  headers and decisions) and :class:`StateError`;
- ``coordinator.membership``: joins, heartbeats and leases, which shard an
  island gets, its chip-health report;
- ``coordinator.ledger``: the exactly-once accounting of the data (segments
  and their cursors, the open round's pending pushes, remembered push ids);
- ``coordinator.admission``: the decision on a push;
- ``coordinator.quorum``: when a round may close and when the coordinator may
  stop;
- ``coordinator.snapshot``: the checkpoint layout and its checks.

Model:

- ``version`` counts merged outer steps (θ_version). A round collects the
  pushes that will be merged into ``version + 1``.
- Every island holds one segment of a data shard (``islands`` shards in all;
  a shard is one segment until a lost island's data left is split). A segment
  is free when no *live* island holds it. Exactly-once data: each segment's
  pushes must follow one another without gap or overlap (a push starts exactly
  at the segment's cursor: where its merged and pending data ends, and ends
  within it), so the merged ranges of a segment always form one prefix of it. A
  push that would break that (its range was dropped, rejected or taken over
  meanwhile) is dropped, and its island rewinds to the cursor the reply names
  and trains that range again. Rerouting: a lost island's segment is free; the
  next island to need one takes it, from its cursor, and an island whose own
  segment is done that takes it splits its data left across the live islands
  (``coordinator.membership``). With step rounds a run ends when every shard's
  data is merged, not after a fixed number of versions.
- Chip health: a heartbeat may carry the devices the island's probes
  quarantined, each with its evidence (:class:`DeviceEvidence`); quarantine is
  permanent for the island's record (``coordinator.membership``).
- Liveness changes only through :meth:`CoordinatorState.expire` (the server
  calls it at :meth:`CoordinatorState.next_deadline`) and
  :meth:`CoordinatorState.heartbeat` / :meth:`CoordinatorState.join`.
- Forgetting: a lost island's record is dropped ``coordinator.forget_after_s`` after its lease ended, unless a
  push of its is pending (:meth:`CoordinatorState.forget`, at :meth:`CoordinatorState.next_deadline`); shards
  and cursors are the ledger's and do not change.
- Pushes: :meth:`CoordinatorState.admit_push` previews the decision without
  changing anything (the server refuses a push before its payload streams in);
  :meth:`CoordinatorState.commit_push` decides again, once the payload has
  arrived (a round may have closed meanwhile), records that decision and
  returns it. The rules (weights, bounds, late deltas, norms) are in
  ``coordinator.admission``. A merge that would make θ non-finite rejects
  pending pushes through :meth:`CoordinatorState.reject_pending`. A rejected
  push is counted, remembered (a retry is a duplicate) and does not hold up its
  round (``coordinator.quorum``); the island's heartbeat replies carry the
  reason until its next accepted push.
- Idempotency: the ids of pending pushes, and of the last
  ``StateOptions.max_push_ids`` (100 000) merged or dropped ones, are
  remembered; a retry (which arrives within seconds) gets ``"duplicate"`` and is
  never applied twice. Older ids are forgotten, oldest first.
- The end: the run is over once every shard's data is merged (step rounds) or
  ``total_versions`` are merged (wall-time rounds;
  :meth:`CoordinatorState.stopped`); :meth:`CoordinatorState.finished` says
  when the coordinator may stop serving (every live island holds the last
  version, or ``linger_s`` has passed).
- Checkpoint: :meth:`CoordinatorState.to_json` /
  :meth:`CoordinatorState.from_json` follow one declared layout,
  ``coordinator.snapshot.Snapshot``, read by ``dtrain.schema``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator import admission, quorum, snapshot
from coordinator.bindings import Bindings
from coordinator.ledger import PushLedger
from coordinator.membership import Membership, check_identity
from coordinator.pacing import Pace
from coordinator.records import Admission, IslandRecord, PushInfo, SeenPush, Segment, StateError, StateOptions
from dtrain import schema
from dtrain.net.wire import MAX_ROUND_S


class CoordinatorState:
    """See the module docstring. Not thread-safe: the caller serializes access."""

    def __init__(self, opts: StateOptions, run_id: str, now: float):
        self.opts = opts
        self.run_id = run_id
        self.created = float(now)
        self.version = 0
        self.islands: dict[str, IslandRecord] = {}
        self.deltas_merged = 0
        self.deltas_dropped = 0
        self.duplicates = 0
        self.tokens_merged = 0
        self.deltas_rejected = 0
        self.ledger = PushLedger(opts)
        self.members = Membership(opts, self.islands, self.ledger)
        self.bindings = Bindings(opts.identity, dict(opts.pins))  # which identity may act as which island
        self._stopped_at: float | None = None  # when the run was over (the last close_round, or a resume after it)
        # worker.round_seconds = auto: the run's round length, the first an island reported since this start (every
        # island reports its own in each heartbeat, so a restarted coordinator learns it again from the first one)
        self.round_seconds = 0.0
        self.pace: Pace | None = None  # and from then on (sync rounds) each round's length (coordinator.pacing)
        self.quarantined_islands: list[tuple[str, str]] = []  # (island_id, why) quarantined since take_quarantined

    # -- queries ------------------------------------------------------------------------------------

    def stopped(self) -> bool:
        """Whether the run is over. Step rounds: every shard's data is merged (however many versions that took:
        ``total_versions`` with no faults, more when a lost island's shard was finished by another). Wall-time
        rounds (no end to the data): ``total_versions`` are merged."""
        if self.opts.shard_end:
            return self.ledger.all_merged()
        return self.version >= self.opts.total_versions

    def run_over(self) -> str:
        """The reason given to islands once the run is over (a Join refused, a heartbeat told to stop)."""
        if self.opts.shard_end:
            return (f"the run is over: all {self.opts.islands} shards' data ({self.opts.shard_end} sequences each) "
                    f"merged, in {self.version} versions")
        return f"the run is over: {self.version} of {self.opts.total_versions} versions merged"

    def _over(self) -> str:
        """Why the run is over, "" while it goes on: how the parts are told."""
        return self.run_over() if self.stopped() else ""

    def data_left(self, shard_index: int) -> bool:
        """Whether any segment of the shard has data no push covers yet (merged or pending); always with wall-time
        rounds."""
        return any(self.ledger.data_left(seg) for seg in self.ledger.of_shard(shard_index))

    def segment(self, record: IslandRecord) -> Segment:
        """The segment of its shard the island holds (or held, when lost): its range is ``[start, end)``
        (``end`` 0: no end), its cursor :meth:`segment_cursor`."""
        return self.members.segment(record)

    def segment_cursor(self, seg: Segment) -> int:
        """Where the segment's merged data ends, counting pushes pending in the open round: where its holder's
        next push starts."""
        return self.ledger.cursor(seg)

    def push_cursor(self, info: PushInfo) -> int:
        """The cursor of the segment the push's range starts in (0 if none): where its island's next range
        starts, or where it rewinds to when the push was dropped or rejected."""
        seg = self.ledger.segment_at(info.shard_index, info.cursor_start)
        return self.ledger.cursor(seg) if seg is not None else 0

    def live(self) -> list[IslandRecord]:
        """The live islands, in the order they first joined."""
        return self.members.live()

    def pending(self) -> list[tuple[PushInfo, Admission]]:
        """The pushes pending in the open round, in arrival order."""
        return [(p.info, p.admission) for p in self.ledger.pending.values()]

    def is_pending(self, push_id: str) -> bool:
        """Whether the push is pending in the open round."""
        return push_id in self.ledger.pending

    def push_known(self, push_id: str) -> bool:
        """Whether a push id is pending or remembered as merged/dropped (Heartbeat's push_unknown is the negation)."""
        return self.ledger.push_known(push_id)

    def stop_reason(self, island_id: str) -> str:
        """Why the island is quarantined (it is to stop), or "" if it is not (or is unknown)."""
        record = self.islands.get(island_id)
        return record.stop_reason if record is not None and record.state == "quarantined" else ""

    def rejected(self, push_id: str) -> str | None:
        """Why a push was rejected (its island's notice), or None if it was not."""
        return self.ledger.rejected(push_id)

    def shard_cursor(self, shard_index: int) -> int:
        """The shard's sequences merged or pending in the open round, over its segments (its cursor while it is
        one segment)."""
        return self.ledger.shard_cursor(shard_index)

    def check_pull(self, island_id: str, have_version: int) -> None:
        """Refuses a pull from an unknown island, or from one claiming a version the coordinator has not made. A
        lost or quarantined island gets no data-plane service: a quarantined one's pull is refused for good
        (``stopped``), a lost one's until it rejoins (``busy``: its worker retries while its heartbeat, answered
        rejoin, calls Join)."""
        record = self.islands.get(island_id)
        if record is None:
            raise StateError("NOT_FOUND", f"unknown island_id {island_id!r}: call Join first")
        if record.state == "quarantined":
            raise StateError("FAILED_PRECONDITION", f"pull refused: {record.name} is quarantined "
                                                    f"({record.stop_reason})", stopped=True)
        if record.state == "lost":
            raise StateError("FAILED_PRECONDITION", f"pull refused: {record.name} is lost (its lease expired at "
                                                    f"t={record.lease_expiry:.1f}): rejoin (call Join again) to "
                                                    f"pull", busy=True)
        if have_version > self.version:
            raise StateError("INVALID_ARGUMENT", f"have_version={have_version} is ahead of the coordinator's "
                                                 f"version {self.version}")

    # -- join / heartbeat / expire ------------------------------------------------------------------

    def join(self, name: str, hardware: str, devices: int, now: float,
             identity: str | None = None) -> tuple[IslandRecord, str]:
        """Register an island (or take back a returning one); returns its record and why it got that shard.
        ``identity``: the caller's (``coordinator.bindings``; None: none, as in shared mode); a first Join binds
        the name to it, another identity is refused (PERMISSION_DENIED)."""
        kind = check_identity(name, hardware, devices)
        self.bindings.check(name, identity)
        if self.stopped():
            raise StateError("FAILED_PRECONDITION", f"{self.run_over()}: nothing left to train")
        joined = self.members.join(name, kind, devices, now)
        self.bindings.bind(name, identity)
        return joined

    def authorize(self, island_id: str, identity: str | None) -> None:
        """Refuses (PERMISSION_DENIED) a call as ``island_id`` (a heartbeat, push or pull) from an identity its
        name is not bound to (``coordinator.bindings``); an unknown island is left to the call itself (NOT_FOUND).
        A name with no binding (joined after the checkpoint this state was restored from) is bound to the caller."""
        record = self.islands.get(island_id)
        if record is not None:
            self.bindings.check(record.name, identity, island_id=island_id)
            self.bindings.bind(record.name, identity)

    def heartbeat(self, island_id: str, version: int, steps: int, tokens: int, steps_per_s: float,
                  params_digest: str, bad_devices: tuple[str, ...], now: float, *,
                  quarantined: Sequence[Mapping[str, Any]] = (), devices: int = 0,
                  tokens_per_s: float = 0.0, round_seconds: float = 0.0) -> tuple[str, str]:
        """Renew a live island's lease and record its report; returns (action, reason).

        ``quarantined``: the devices the island quarantined, as plain data with :class:`DeviceEvidence`'s fields
        (absent numbers left out or None); devices not in the record yet join it. ``devices``: the devices it
        trains on now (0: unchanged); ``tokens_per_s``: its measured training rate (0: none);
        ``round_seconds``: the auto round length it took (0: none yet; the first one becomes the run's,
        :attr:`round_seconds`). A report that does not fit the island's mesh is refused (see
        ``coordinator.membership.check_report``), as is a round length in a run of step rounds or outside
        (0, MAX_ROUND_S]."""
        if round_seconds and (self.opts.shard_end or not (isinstance(round_seconds, (int, float))
                                                          and 0 < round_seconds <= MAX_ROUND_S)):
            why = "the run has step rounds" if self.opts.shard_end else f"must be in (0, {MAX_ROUND_S:g}] seconds"
            raise StateError("INVALID_ARGUMENT", f"round_seconds={round_seconds!r}: {why}")
        answer = self.members.heartbeat(island_id, version, steps, tokens, steps_per_s, params_digest, bad_devices,
                                        now, quarantined=quarantined, devices=devices, current=self.version,
                                        over=self._over(), tokens_per_s=tokens_per_s)
        if round_seconds and not self.round_seconds and self.islands[island_id].state == "live":
            self.round_seconds = float(round_seconds)
            if self.opts.coordinator.mode == "sync":  # the rounds after the first are paced (coordinator.pacing)
                o = self.opts  # a version is to bring in a step round's tokens from every shard
                self.pace = Pace(self.round_seconds, o.islands * o.round_sequences * o.seq_len, o.total_versions,
                                 sum(r.tokens_per_s for r in self.live()))
        return answer

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Mark live islands whose lease ended (now >= lease_expiry) as lost; returns (island_id, reason) for each.

        Their pending pushes stay in the open round: they were received in full.
        """
        return self.members.expire(now)

    def forget(self, now: float) -> list[IslandRecord]:
        """Drops the records of islands lost for ``coordinator.forget_after_s`` and returns them
        (``coordinator.membership.Membership.forget``; the server calls it with :meth:`expire`)."""
        return self.members.forget(now)

    def pause_leases(self, seconds: float) -> None:
        """Moves every live island's lease end ``seconds`` later: time in which the coordinator could not hear
        heartbeats (the server calls it when a long merge held its lock past a lease's end), which no island is
        to be blamed for. A dead island is then found that much later."""
        self.members.pause_leases(seconds)

    # -- pushes -------------------------------------------------------------------------------------

    def admit_push(self, info: PushInfo, now: float) -> Admission:
        """What :meth:`commit_push` would decide now, from the push's header alone. Changes nothing: the server
        asks before the payload streams in, to refuse a push (or answer a retry) without receiving it."""
        admission.check_header(info)
        record = self.islands.get(info.island_id)
        if record is None:
            raise StateError("NOT_FOUND", f"unknown island_id {info.island_id!r}: call Join first")
        dup = self.ledger.duplicate(info)
        if dup is not None:
            return dup
        admission.check_standing(self.opts.coordinator, info, record, now)
        return admission.judge(self.opts, info, record, self.version, self._over(), self.ledger, self.live())

    def commit_push(self, info: PushInfo, now: float, norm: float | None = None,
                    theta_norm: float = 0.0) -> Admission:
        """Decide on a push whose payload has arrived, record the decision and return it: pending (accept),
        counted (drop, duplicate, reject); the push id is remembered. Decided afresh, not taken from an earlier
        :meth:`admit_push`: the round may have closed while the payload streamed in.

        ``norm``: the payload's L2 norm; with it, an outlier is rejected and an accepted push gets its clip
        factor (``coordinator.admission.screen_norm``). None: no norm checks (tools and tests of the other
        rules). ``theta_norm``: the L2 norm of the current θ (0: the ratio check is skipped)."""
        decision = self.admit_push(info, now)
        if decision.status == "accept" and norm is not None:
            window = self.ledger.norm_window(decision.target_version)  # (its fragment's, with outer.fragments)
            decision = admission.screen_norm(self.opts.coordinator, window, info, decision, norm, theta_norm,
                                             islands=self.opts.islands,
                                             ceiling=admission.honest_ceiling(self.opts, info, theta_norm))
        if decision.status == "reject":
            self._record_rejection(info, decision.target_version, decision.staleness, decision.reason, now)
        elif decision.status == "duplicate":
            self.duplicates += 1
        elif decision.status == "drop":
            self.deltas_dropped += 1
            self.ledger.remember(SeenPush(info.push_id, info.island_id, "dropped", decision.target_version,
                                          decision.staleness))
        else:
            self.ledger.add_pending(info, decision, now)
        return decision

    def _record_rejection(self, info: PushInfo, target: int, staleness: int, reason: str, now: float) -> None:
        """Counts a rejected push, against its island too: its next push is throttled and, at
        ``coordinator.max_rejections`` in a row, the island is quarantined (``coordinator.admission.penalize``)."""
        self.deltas_rejected += 1
        self.ledger.record_rejection(info, target, staleness, reason, self.version)
        record = self.islands.get(info.island_id)
        if record is not None and record.state != "quarantined":
            why = admission.penalize(self.opts.coordinator, record, reason, now)
            if why:
                self.quarantined_islands.append((record.island_id, why))

    def take_quarantined(self) -> list[tuple[str, str]]:
        """The islands quarantined since the last call, each with why (the caller logs them)."""
        out, self.quarantined_islands = self.quarantined_islands, []
        return out

    def reject_pending(self, push_ids: list[str], reason: str, now: float = 0.0) -> list[PushInfo]:
        """Rejects pending pushes (a merge they would have made non-finite, or a round screen): dropped from the
        open round (their spools and parts on the range shards let go: ``coordinator.pending.PendingSet.take``),
        counted, remembered as rejected; their islands are told in their heartbeat replies and the
        round does not wait for them. Returns their infos."""
        out = []
        for p in self.ledger.take_pending(push_ids):
            self._record_rejection(p.info, p.admission.target_version, p.admission.staleness, reason, now)
            out.append(p.info)
        return out

    def screen_round(self, cosines: dict[str, float] | None = None, reference: str = "",
                     screened: bool = False) -> list[tuple[str, str]]:
        """The pending pushes the round screen rejects (``coordinator.admission.screen_round``; ``cosines``: push id
        -> its cosine with ``reference``, for the direction screen; ``screened``: the merge rule is
        ``screened_mean``, whose round of fewer than 3 pushes in a run of 3 islands or more rejects a push on
        probation), as (push_id, reason); changes nothing (the caller rejects them with :meth:`reject_pending`)."""
        if self.opts.coordinator.mode != "sync":
            return []
        pending = list(self.ledger.pending.values())
        return admission.screen_round(self.opts.coordinator, [p.info for p in pending],
                                      [p.admission.norm for p in pending],
                                      None if cosines is None else [cosines.get(p.info.push_id, 1.0) for p in pending],
                                      reference, [self._on_probation(p.info.island_id) for p in pending],
                                      unchecked=screened and self.opts.islands >= 3,
                                      window=self.ledger.norm_window(self.version + 1), islands=self.opts.islands)

    def _on_probation(self, island_id: str) -> bool:
        """Whether the island's last push was rejected (its rejections in a row: ``coordinator.admission``)."""
        record = self.islands.get(island_id)
        return record is not None and record.rejections > 0

    # -- rounds -------------------------------------------------------------------------------------

    def round_ready(self, now: float) -> tuple[bool, str]:
        """Whether the open round can close now, and why (not) (``coordinator.quorum.round_ready``)."""
        return quorum.round_ready(self.opts, self.version, self._over(), self.live(), self.ledger, now)

    def close_round(self, now: float, decided: str = "") -> tuple[int, list[PushInfo], str]:
        """Merge the open round into version + 1; returns (new_version, merged pushes, reason). ``decided``: why the
        round was found ready when its outer step began (the clock computes the step outside the lock, and an
        island may join or be lost meanwhile: the round it snapshotted closes all the same); "": decide now."""
        ready, why = (True, decided) if decided else self.round_ready(now)
        if not ready:
            raise StateError("FAILED_PRECONDITION", f"the round for version {self.version + 1} cannot close: {why}")
        self.version += 1
        merged = [p.info for p in self.ledger.merge_round(self.version)]
        for info in merged:
            r = self.islands[info.island_id]
            r.rejections, r.throttled_until = 0, 0.0  # a merged push ends a run of rejections
            r.tokens_merged += info.tokens
            r.pushes_merged += 1
            r.cursor_merged = info.cursor_end
        tokens = sum(info.tokens for info in merged)
        self.deltas_merged += len(merged)
        self.tokens_merged += tokens
        if self.pace is not None:
            self.pace.committed(self.version, now, self.tokens_merged)
        done = ""
        if self.stopped():
            self._stopped_at = float(now)
            done = f"; the run is over ({self.version} versions)"
        names = ", ".join(self.islands[i.island_id].name for i in merged)
        return self.version, merged, (f"merged {len(merged)} deltas ({names}; "
                                      f"{tokens} tokens) into version {self.version} ({why}){done}")

    def finished(self, now: float) -> tuple[bool, str]:
        """Whether the coordinator may stop serving, and why (not) (``coordinator.quorum.finished``)."""
        return quorum.finished(self.opts, self.version, self._over(), self.live(), self._stopped_at, now)

    def next_deadline(self, now: float) -> float | None:
        """When round_ready, liveness or finished could next change by time alone
        (``coordinator.quorum.next_deadline``), or a lost island's record is due to be forgotten. None if nothing
        is timed."""
        times = [t for t in (quorum.next_deadline(self.opts, self.live(), self.ledger, self._stopped_at, now),
                             self.members.next_forget()) if t is not None]
        return min(times) if times else None

    # -- checkpoint ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON types (for the coordinator checkpoint), laid out as ``snapshot.Snapshot``."""
        book = self.ledger
        return schema.dump(snapshot.Snapshot(
            format=snapshot.FORMAT, run_id=self.run_id, created=self.created, shards=self.opts.islands,
            version=self.version,
            counters=snapshot.Counters(self.deltas_merged, self.deltas_dropped, self.duplicates, self.tokens_merged,
                                       self.deltas_rejected),
            islands=list(self.islands.values()), segments=list(book.segments.values()),
            pending=list(book.pending.values()), first_pending=book.first_pending,
            push_ids=list(book.seen.values()), norms=list(book.norms), bindings=self.bindings.rows()))

    @classmethod
    def from_json(cls, opts: StateOptions, blob: Any, now: float) -> CoordinatorState:
        """Restore from :meth:`to_json`. Every island's lease is renewed to now + lease_s (islands keep training
        through a coordinator outage). Malformed input raises StateError INVALID_ARGUMENT naming the field
        (``coordinator.snapshot.load``).

        Pending pushes are restored as they were; the caller must hold their summed deltas too (the server
        checkpoints right after close_round, when none are pending).
        """
        snap = snapshot.load(opts, blob)
        state = cls(opts, snap.run_id, snap.created)
        state.version = snap.version
        c = snap.counters
        state.deltas_merged, state.deltas_dropped = c.deltas_merged, c.deltas_dropped
        state.duplicates, state.tokens_merged, state.deltas_rejected = c.duplicates, c.tokens_merged, c.deltas_rejected
        for rec in snap.islands:
            rec.lease_expiry = now + opts.coordinator.lease_s
            state.islands[rec.island_id] = rec
        state.bindings = Bindings(opts.identity, dict(opts.pins), snap.bindings)
        state.ledger.restore(snap.segments, snap.norms, snap.push_ids, snap.pending, snap.first_pending,
                             snap.version)
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
            "run_over": self._over(),
            "islands": islands,
            "live": len(self.live()),
            "deltas_merged": self.deltas_merged,
            "deltas_dropped": self.deltas_dropped,
            "duplicates": self.duplicates,
            "deltas_rejected": self.deltas_rejected,
            "tokens_merged": self.tokens_merged,
            "shard_cursors": [self.shard_cursor(s) for s in range(self.opts.islands)],
            "segments": [{"shard": seg.shard, "start": seg.start, "end": seg.end, "merged": seg.merged,
                          "cursor": self.ledger.cursor(seg)} for seg in self.ledger.segments.values()],
            "round": {"target_version": self.version + 1, "ready": ready, "reason": reason,
                      "pending": [{"push_id": i.push_id, "island_id": i.island_id, "tokens": i.tokens,
                                   "weight": a.weight, "staleness": a.staleness, "norm": a.norm, "scale": a.scale}
                                  for i, a in self.pending()]},
            "next_deadline": self.next_deadline(now),
        }
