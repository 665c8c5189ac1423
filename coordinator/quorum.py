"""When the open round may close and when the coordinator may stop serving, each with its reason, and the next
time either could change by time alone. Pure functions of the state's standing and ``now``: they change
nothing.

- Sync rounds close once every live island with data left has pushed (a rejected push counts as pushed: it
  does not hold up its round, nor does an island throttled after one; while a free segment has data left, an
  island out of data is waited for too: its next heartbeat hands it that segment), or once ``coordinator.min_quorum``
  pushes are in and ``coordinator.grace_s`` has passed since the first; async rounds close on each push.
- The end: the run is over once every shard's data is merged (step rounds) or ``total_versions`` are merged
  (wall-time rounds); the coordinator may stop serving once every live island holds the last version, or
  ``linger_s`` after the run ended.
"""

from __future__ import annotations

from coordinator.ledger import PushLedger
from coordinator.records import IslandRecord, StateOptions


def _ids(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def round_ready(opts: StateOptions, version: int, over: str, live: list[IslandRecord], ledger: PushLedger,
                now: float) -> tuple[bool, str]:
    """Whether the open round (for ``version`` + 1) can close now, and why (not). ``over``: why the run is over,
    "" while it goes on; ``live``: the live islands."""
    n = len(ledger.pending)
    if over:
        return False, over
    if opts.coordinator.mode == "async":
        if n:
            return True, f"{n} push{'es' if n > 1 else ''} pending (async: merge on arrival)"
        return False, "no pushes pending"
    live = sorted(live, key=lambda r: r.shard_index)
    pushed = ledger.pending_islands()
    held = {(r.shard_index, r.segment_start) for r in live}
    # a free segment with data left (a lost island's, or a piece of one) goes to the next live island out of data,
    # at its next heartbeat: the round waits for those islands too, so a piece is trained in this round
    orphans = any(key not in held and ledger.data_left(seg) for key, seg in ledger.segments.items())
    missing = [r.name for r in live  # an island throttled after a rejected push is not waited for
               if r.island_id not in pushed | ledger.round_rejected
               and (orphans or ledger.data_left(ledger.segment(r.shard_index, r.segment_start)))
               and r.throttled_until <= now]
    if n == 0:
        return False, f"waiting for the first push for version {version + 1} ({len(live)} live islands)"
    if not missing:
        extra = len(pushed - {r.island_id for r in live})
        lost = f" (+{extra} from islands no longer live)" if extra else ""
        rejected = len(ledger.round_rejected & {r.island_id for r in live})
        refused = f", {rejected} of them rejected" if rejected else ""
        return True, f"all {len(live)} live islands pushed{refused}{lost}"
    quorum = opts.coordinator.min_quorum or len(live)
    assert ledger.first_pending is not None, "pushes are pending, so the first one's time is set"
    grace_end = ledger.first_pending + opts.coordinator.grace_s
    if n >= quorum and now >= grace_end:
        return True, (f"quorum {n} of {len(live)} after {opts.coordinator.grace_s:g}s grace "
                      f"(missing: {_ids(missing)})")
    waiting = f"waiting for {len(missing)} of {len(live)} islands (missing: {_ids(missing)})"
    if n >= quorum:
        return False, f"{waiting}; quorum close possible in {grace_end - now:.1f}s"
    return False, f"{waiting}; a quorum close needs {quorum} pushes, have {n}"


def finished(opts: StateOptions, version: int, over: str, live: list[IslandRecord], stopped_at: float | None,
             now: float) -> tuple[bool, str]:
    """Whether the coordinator may stop serving, and why (not): the run is over (``over`` is its reason; "" while
    it goes on) and no live island lacks the last version, or ``linger_s`` has passed since it ended at
    ``stopped_at`` (an island that has not pulled the last version by then finds no coordinator)."""
    if not over:
        return False, f"the run goes on: {version} of {opts.total_versions} versions merged"
    behind = [r.name for r in sorted(live, key=lambda r: r.shard_index) if r.version < version]
    done = f"the run is over ({version} versions)"
    if not behind:
        return True, f"{done} and every live island holds version {version}"
    assert stopped_at is not None  # set by close_round and from_json whenever the run is over
    left = stopped_at + opts.linger_s - now
    if left <= 0:
        return True, (f"{done}; gave up after {opts.linger_s:g}s on islands without version "
                      f"{version}: {_ids(behind)}")
    return False, f"{done}; waiting up to {left:.1f}s for islands without version {version}: {_ids(behind)}"


def next_deadline(opts: StateOptions, live: list[IslandRecord], ledger: PushLedger, stopped_at: float | None,
                  now: float) -> float | None:
    """When round_ready, liveness or finished could next change by time alone: the grace end, the earliest
    lease expiry of a live island (may be <= now if expire() is due) or the end of the linger after the
    run (``stopped_at``: when it ended). None if nothing is timed."""
    times = [r.lease_expiry for r in live] + [r.throttled_until for r in live if r.throttled_until > now]
    if opts.coordinator.mode == "sync" and ledger.pending and ledger.first_pending is not None:
        grace_end = ledger.first_pending + opts.coordinator.grace_s
        if grace_end > now:
            times.append(grace_end)
    if stopped_at is not None and stopped_at + opts.linger_s > now:
        times.append(stopped_at + opts.linger_s)
    return min(times) if times else None
