"""The decision on a push: accepted (with its staleness-discounted weight), a duplicate, dropped (its range is
not merged; its island trains it again from the reply's cursor) or rejected as a norm outlier; or refused
(``StateError``) when its header breaks a rule. Pure functions of the push and the state's standing: nothing
here changes anything (``coordinator.state.CoordinatorState.commit_push`` records the decision).

- A push's weight is ``tokens · (1 + staleness)^−α``, the same factor as ``dtrain.steps.outer.staleness_weight``.
- A push's weight is bounded by what the coordinator assigned, never the island's word alone
  (:func:`check_bounds`, refused INVALID_ARGUMENT): its tokens are at most its cursor range × ``model.seq_len``;
  the range covers at most ``coordinator.max_push_steps`` × ``train.batch_size`` sequences (0:
  ``outer.inner_steps``, the length of a step round; with wall-time rounds, whose length is an island's speed ×
  ``worker.round_seconds``, there is no default cap: set one) and, with step rounds, ends within the shard's
  ``train.steps`` × ``train.batch_size`` sequences, and within one segment of it (a range that runs past the end
  of the segment it starts in is refused: the coordinator set that end); and it starts exactly at its segment's
  cursor (else it is dropped), so no data counts twice.
- A lost island's push (a hung island that wakes up) is a late delta like any other (``late_policy``, the
  contiguity rule) while no live island holds its segment; once another took the segment over, it is dropped.
  A push from a segment its island no longer holds (it moved at a rejoin) is dropped too.
- Norms (:func:`screen_norm`, as a push arrives): a non-finite norm is rejected, and so is a norm over
  ``coordinator.norm_max_ratio`` × ‖θ‖ ("quarantined"); an accepted push gets the factor that clips its norm to
  ``coordinator.clip_norm`` (``Admission.scale``). Against the recent merged norms (:func:`screen_history`; in
  async mode as the push arrives, in sync mode when its round closes, by the round screen): a norm over
  ``coordinator.round_norm_ratio`` × the median of the last ``outer.islands`` merged norms (about the last
  round's: a reference that follows the honest norms as they shrink, and holds in a round where few islands
  push, e.g. the last rounds of a shard taken over), and an outlier: a norm more than ``coordinator.norm_z_max``
  robust deviations above the median of the last ``coordinator.norm_window`` merged norms
  (``dtrain.steps.outer.robust_z``; once ``norm_window_min`` are in). In a sync round of 3 pushes or more the first
  gives way to the round screen's ratio to the round's own median, and the robust-z window holds the round's
  norms beside the merged ones: honest norms that grow together move its median, one push in a minority cannot.
  A push that the merged norms cannot check yet (:func:`has_reference`: too few of them, e.g. in the run's first
  rounds or the first after a resume) is clipped, as it arrives, to its honest ceiling (:func:`honest_ceiling`: the
  farthest its claimed AdamW steps can move θ, × :data:`CODEC_SLACK`): an honest push lies under it and is merged as
  it is, a forged one is merged no larger than an honest one could be (``Admission.scale``), never as it is.
- The round screen (:func:`screen_round`, sync mode, when a round closes, from the first round on: its ratio
  needs no history): the screen against the merged norms above, and a pending push whose norm exceeds
  ``coordinator.round_norm_ratio`` × the median norm of the round's pushes is rejected, in rounds of 3 pushes or
  more (one push in a minority cannot move the median); and, with
  ``merge_rule`` ``screened_mean``, a push whose cosine with the coordinate median of the round's pushes is below
  ``coordinator.min_cosine`` (a push pointing away from the others: reversed, or off in a direction of its own);
  in a round of fewer than 3, a push from an island on probation (its last push rejected): in a run of 3 islands
  or more whatever its cosine (it cannot be checked), in a smaller run if its cosine with the outer momentum (the
  recent merged updates' direction) is below ``coordinator.probation_min_cosine``.
- Repeat offenders (:func:`penalize`, :func:`check_standing`): after a rejected push the island's next push is
  refused, before its payload streams in, for ``coordinator.reject_backoff_s`` × 2^(k−1) seconds (k: its
  rejections in a row; the refusal says how many seconds are left, ``StateError.retry_after_s``, and the island
  sends the same push again once they have passed); at ``coordinator.max_rejections`` in a row the island itself
  is quarantined (state ``quarantined``): told to stop with the reason in the answer to the push that quarantined
  it (``PushDeltaResponse.stop_reason``), in the refusal of any later push (``StateError.stopped``, before its
  payload is read) and in its heartbeats' answers; its Joins are refused, and its shard is free for the others
  (``coordinator.membership``'s rerouting) so the run ends. A merged push resets k.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from coordinator.ledger import PushLedger
from coordinator.records import MAX_PUSH_ID_LEN, Admission, IslandRecord, PushInfo, StateError, StateOptions
from dtrain.config.sections import CoordinatorConfig
from dtrain.steps.outer import clip_factor, honest_delta_bound, robust_z, staleness_weight
from dtrain.train.fragments import fragment_of_base, fragment_of_round


def check_header(info: PushInfo) -> None:
    """Refuses (INVALID_ARGUMENT) a push header that no state could accept: its id, counts and range."""
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


def judge(opts: StateOptions, info: PushInfo, record: IslandRecord, version: int, over: str, ledger: PushLedger,
          live: list[IslandRecord]) -> Admission:
    """The decision on a push that is not a retry (``PushLedger.duplicate`` answers those) from ``record``'s
    island, at the coordinator's ``version``; ``over``: why the run is over, "" while it goes on; ``live``: the
    live islands. Refuses (StateError) a push that breaks a rule, else accepts or drops it."""
    if info.base_version > version:
        raise StateError("INVALID_ARGUMENT", f"push {info.push_id}: base_version={info.base_version} is ahead "
                                             f"of the coordinator's version {version}")
    staleness = version - info.base_version
    target = version + 1
    if over:  # weight 0 whatever it claims
        return Admission("drop", 0.0, staleness, target, f"{over}: push {info.push_id} dropped")
    check_bounds(opts, info)
    check_segment(info, ledger)
    misplaced = _misplaced(info, record, ledger, live)
    if misplaced:
        return Admission("drop", 0.0, staleness, target, misplaced)
    c = opts.coordinator
    if c.mode == "sync" and info.island_id in ledger.pending_islands():
        prior = next(p for p in ledger.pending.values() if p.info.island_id == info.island_id)
        raise StateError("FAILED_PRECONDITION",
                         f"{record.name} already pushed for version {target} (push {prior.info.push_id}); "
                         f"wait for the round to close")
    if staleness % opts.fragments:  # outer.fragments: the open round merges another fragment than the push's
        return Admission("drop", 0.0, staleness, target,
                         f"delta from version {info.base_version} holds fragment "
                         f"{fragment_of_base(info.base_version, opts.fragments)}, the round for version {target} "
                         f"merges fragment {fragment_of_round(target, opts.fragments)}: dropped")
    if staleness > c.max_staleness:
        return Admission("drop", 0.0, staleness, target,
                         f"delta from version {info.base_version} is {staleness} versions stale "
                         f"(max_staleness {c.max_staleness}): dropped")
    if staleness > 0 and c.late_policy == "drop":
        return Admission("drop", 0.0, staleness, target,
                         f"delta from version {info.base_version} is {staleness} versions stale and "
                         f"late_policy is 'drop': dropped")
    weight = staleness_weight(info.tokens, staleness, opts.staleness_alpha)
    if staleness == 0:
        why = f"weight {weight:g} = {info.tokens} tokens"
    else:
        why = (f"{staleness} versions late: weight {weight:g} = {info.tokens} tokens x "
               f"(1+{staleness})^-{opts.staleness_alpha:g}")
    return Admission("accept", weight, staleness, target, f"accepted for version {target}: {why}")


def _misplaced(info: PushInfo, record: IslandRecord, ledger: PushLedger, live: list[IslandRecord]) -> str:
    """Why a push's range cannot be merged where it lies (the reason it is dropped), or "" if it can: its island
    lost its segment to another, holds another segment now, or the range does not start at the segment's
    cursor."""
    own = ledger.segment(record.shard_index, record.segment_start)
    where = own.describe(ledger.opts.shard_end)
    cursor = ledger.cursor(own)
    rewind = f"not merged: its range is trained again from {where}'s cursor {cursor}"
    if record.state == "lost":  # a late delta (a hung island back): judged like any other while its segment is free
        holder = next((r for r in live if (r.shard_index, r.segment_start) == own.key), None)
        if holder is not None:
            return (f"{record.name}'s lease expired at t={record.lease_expiry:.1f} and "
                    f"{holder.name} took over {where}: push {info.push_id} "
                    f"dropped, rejoin (call Join again); {rewind}")
    if info.shard_index != record.shard_index:
        return (f"push {info.push_id} covers shard {info.shard_index}, but {record.name} now holds "
                f"{where}: dropped, {rewind}")
    here = ledger.segment_at(info.shard_index, info.cursor_start)
    if here is not None and here.key != own.key:  # it moved to another segment of the shard at a rejoin
        return (f"push {info.push_id} covers {here.describe(ledger.opts.shard_end)}, but {record.name} now "
                f"holds {where}: dropped, {rewind}")
    if info.cursor_start != cursor:
        why = ("overlaps data merged or pending" if info.cursor_start < cursor
               else "leaves a gap after data merged or pending (a range before it was dropped or rejected)")
        return f"push {info.push_id}'s range [{info.cursor_start}, {info.cursor_end}) {why}: dropped, {rewind}"
    return ""


def check_segment(info: PushInfo, ledger: PushLedger) -> None:
    """Refuses (INVALID_ARGUMENT) a push whose range runs past the end of the segment it starts in: the
    coordinator set that end when it split the shard (an island is told its segment's end at its Join), so no
    honest island crosses it (a segment is only split while no live island holds it, at whole rounds past its
    cursor)."""
    seg = ledger.segment_at(info.shard_index, info.cursor_start)
    if seg is not None and seg.end and info.cursor_end > seg.end:
        raise StateError("INVALID_ARGUMENT", f"push {info.push_id} from {info.island_id}: its cursor range "
                         f"[{info.cursor_start}, {info.cursor_end}) runs past the end of the segment it starts in, "
                         f"{seg.describe(ledger.opts.shard_end)}: a push lies within one segment")


def check_bounds(opts: StateOptions, info: PushInfo) -> None:
    """Refuses (INVALID_ARGUMENT) a push whose weight the coordinator did not assign: the rules are in the
    module docstring. The reason names the numbers."""
    o = opts
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


def check_standing(c: CoordinatorConfig, info: PushInfo, record: IslandRecord, now: float) -> None:
    """Refuses (FAILED_PRECONDITION) a push from a quarantined island (``stopped``: the island is told to stop), or
    one that comes while its island is throttled after a rejection (:func:`penalize`): that refusal carries the
    seconds left (``retry_after_s``)."""
    if record.state == "quarantined":
        raise StateError("FAILED_PRECONDITION", f"push {info.push_id} refused: {record.name} is quarantined "
                                                f"({record.stop_reason})", stopped=True)
    if now < record.throttled_until:
        raise StateError("FAILED_PRECONDITION",
                         f"push {info.push_id} refused: {record.name} is throttled for "
                         f"{record.throttled_until - now:.1f}s more after {record.rejections} rejected push"
                         f"{'es' * (record.rejections != 1)} in a row (coordinator.reject_backoff_s "
                         f"{c.reject_backoff_s:g})", retry_after_s=record.throttled_until - now)


def penalize(c: CoordinatorConfig, record: IslandRecord, reason: str, now: float) -> str:
    """Counts a rejected push against its island (``record``, changed in place): one more rejection in a row, its
    next push throttled, and, at ``coordinator.max_rejections`` in a row, the island quarantined. Returns why it
    was quarantined now, else ""."""
    record.rejections += 1
    if c.reject_backoff_s:
        record.throttled_until = now + c.reject_backoff_s * 2 ** min(record.rejections - 1, 16)
    if not c.max_rejections or record.rejections < c.max_rejections:
        return ""
    record.state = "quarantined"
    record.stop_reason = (f"quarantined: {record.rejections} pushes in a row rejected (coordinator.max_rejections "
                          f"{c.max_rejections}), the last: {reason}; shard {record.shard_index} goes to the others")
    return record.stop_reason


def screen_round(c: CoordinatorConfig, infos: Sequence[PushInfo], norms: Sequence[float],
                 cosines: Sequence[float] | None = None, reference: str = "",
                 probation: Sequence[bool] = (), unchecked: bool = False, window: Sequence[float] = (),
                 islands: int = 0) -> list[tuple[str, str]]:
    """The round's pushes (``infos``, with their L2 ``norms``; 0: not known) that the round screen rejects, as
    (push_id, reason): a norm over ``coordinator.round_norm_ratio`` × the median of the round's known norms, in a
    round of 3 or more of them; an outlier against the recent merged norms (:func:`screen_history`, sync mode's
    norm screen; ``window``: the last ``norm_window`` merged norms of the round's fragment, ``islands``: how many
    of the last of them are the recent reference), judged beside the round's norms in a round of 3 or more of
    them; with ``cosines`` (``screened_mean``: each push's cosine with ``reference``, the coordinate median of the
    round's pushes, or with fewer than 3 the outer momentum: ``coordinator.merger.Merger.direction_cosines``), a
    cosine below ``coordinator.min_cosine``: in a round of 3 or more, any push; in a smaller one only a push on
    probation (``probation``: its island's last push was rejected), and below ``coordinator.probation_min_cosine``,
    since an honest delta late in a run may be all but orthogonal to the momentum (cosines of −0.08 to 0.12 in the
    rounds of a shard taken over in ``tiny``). The round ratio needs no history in rounds of 3 pushes or more: it
    holds from the first round on.

    ``unchecked`` (``screened_mean`` in a run of 3 islands or more): in a round of fewer than 3 pushes a push on
    probation is rejected whatever its cosine, since it cannot be checked: the momentum is no test of a reversed
    push (measured in ``tiny``: a −1 x or −3 x island finishing its shard alone once the others were done pushed
    cosines of −0.02 and 0.02 with it, and once one was merged, the momentum held its own direction and its next
    reversed pushes had +0.12 and +0.16). Rejected so, it is quarantined after ``coordinator.max_rejections`` in a
    row and its shard goes to the others, whose pushes are checked by their majority."""
    out: dict[str, str] = {}
    known = [(i, n) for i, n in zip(infos, norms, strict=True) if n > 0]
    if c.round_norm_ratio and len(known) >= 3:
        median = statistics.median(n for _, n in known)
        bound = c.round_norm_ratio * median
        out.update((i.push_id, f"quarantined: push {i.push_id} has L2 norm {n:.4g}, more than round_norm_ratio "
                               f"{c.round_norm_ratio:g} x the median {median:.4g} of the {len(known)} pushes of "
                               f"its round") for i, n in known if n > bound)
    peers = [n for _, n in known] if len(known) >= 3 else []
    for i, n in known:  # against the recent merged norms (``window``, ``islands``): screen_history
        why = "" if i.push_id in out else screen_history(c, i.push_id, n, window, islands, peers)
        if why:
            out[i.push_id] = why
    flags = list(probation) or [False] * len(infos)
    if unchecked and len(infos) < 3:
        for i, watched in zip(infos, flags, strict=True):
            if watched and i.push_id not in out:
                out[i.push_id] = (f"quarantined: push {i.push_id} cannot be checked: {i.island_id}'s last push was "
                                  f"rejected and its round has {len(infos)} push{'es' * (len(infos) != 1)}, too few "
                                  f"for a coordinate median to compare it with (an island on probation is merged "
                                  f"only in a round of 3 pushes or more)")
    if cosines is not None and reference:
        floor, name = (c.min_cosine, "min_cosine") if len(infos) >= 3 else \
            (c.probation_min_cosine, "probation_min_cosine")
        for i, cos, watched in zip(infos, cosines, flags, strict=True):
            if i.push_id not in out and not cos >= floor and (len(infos) >= 3 or watched):
                out[i.push_id] = (f"quarantined: push {i.push_id} points away from the others: cosine {cos:.3g} "
                                  f"with {reference}, below {name} {floor:g}")
    return [(i.push_id, out[i.push_id]) for i in infos if i.push_id in out]


def screen_norm(c: CoordinatorConfig, norms: Sequence[float], info: PushInfo, admission: Admission, norm: float,
                theta_norm: float, islands: int = 0, ceiling: float = 0.0) -> Admission:
    """An accepted push, screened by its norm: rejected as an outlier, or accepted with its clip factor. ``norms``:
    the L2 norms of the last merged pushes; ``theta_norm``: the L2 norm of θ (0: the ratio check is skipped);
    ``islands``: how many of the last merged norms are the recent reference (0: no such check); ``ceiling``: the
    push's honest ceiling (:func:`honest_ceiling`; 0: none), its clip while ``norms`` give no reference
    (:func:`has_reference`)."""
    if not (math.isfinite(norm) and norm >= 0):
        return dataclasses.replace(admission, status="reject", weight=0.0, norm=0.0,
                                   reason=f"rejected: push {info.push_id} has a non-finite norm {norm}")
    if c.norm_max_ratio and theta_norm > 0 and norm > c.norm_max_ratio * theta_norm:
        return dataclasses.replace(
            admission, status="reject", weight=0.0, norm=norm,
            reason=(f"quarantined: push {info.push_id} has L2 norm {norm:.4g}, more than norm_max_ratio "
                    f"{c.norm_max_ratio:g} x the L2 norm of θ ({theta_norm:.4g})"))
    if c.mode != "sync":  # sync: judged when the round closes, beside its round's pushes (screen_round)
        why = screen_history(c, info.push_id, norm, norms, islands)
        if why:
            return dataclasses.replace(admission, status="reject", weight=0.0, norm=norm, reason=why)
    scale = clip_factor(norm, c.clip_norm)
    clipped = f"; norm {norm:.4g} clipped to {c.clip_norm:g}" if scale < 1 else ""
    lone = clip_factor(norm, ceiling) if ceiling > 0 and not has_reference(c, norms, islands) else 1.0
    if lone < scale:
        scale, clipped = lone, (f"; unchecked (too few merged norms to compare it with): norm {norm:.4g} clipped to "
                                f"the honest ceiling {ceiling:.4g} (what {info.inner_steps} AdamW steps can move θ)")
    return dataclasses.replace(admission, norm=norm, scale=scale, reason=admission.reason + clipped)


def has_reference(c: CoordinatorConfig, window: Sequence[float], islands: int) -> bool:
    """Whether the merged norms ``window`` are enough for :func:`screen_history` to check a push against: the
    recent median (``round_norm_ratio``, over the last ``islands``, once min(3, islands) are in) or the robust-z
    window (``norm_z_max``, once ``norm_window_min`` are in)."""
    recent = bool(c.round_norm_ratio and islands and len(list(window)[-islands:]) >= min(3, islands))
    return recent or bool(c.norm_z_max and len(window) >= c.norm_window_min)


CODEC_SLACK = 2.0  # an encoded honest Δ's norm over Δ's: int8 blocks of 1024 add at most √1024 / 254 = 0.13 of it


def honest_ceiling(opts: StateOptions, info: PushInfo, theta_norm: float) -> float:
    """The most an honest island's push ``info`` can weigh in L2 norm, θ at ``theta_norm`` (0: no bound known,
    ``StateOptions.params`` unset, or ``coordinator.norm_max_ratio`` 0: the norm screens that need no history
    off): ``dtrain.steps.outer.honest_delta_bound`` of its inner steps (at most one per sequence of its range,
    whatever it claims) at the peak inner rate, × :data:`CODEC_SLACK` for its quantization and error feedback. The
    schedule is left out (an island with a smaller batch stretches it, so the coordinator does not know its steps'
    rates): the bound holds for any of them."""
    if not (opts.params and opts.inner_lr > 0 and opts.coordinator.norm_max_ratio):
        return 0.0
    steps = min(info.inner_steps, max(info.cursor_end - info.cursor_start, 1))
    return CODEC_SLACK * honest_delta_bound(opts.inner_lr, opts.adam_ratio, opts.weight_decay, opts.params, steps,
                                            theta_norm)


def screen_history(c: CoordinatorConfig, push_id: str, norm: float, window: Sequence[float], islands: int = 0,
                   peers: Sequence[float] = ()) -> str:
    """Why a push of L2 ``norm`` is an outlier against the recent merged norms, or "" if it is not. ``window``: the
    last ``coordinator.norm_window`` merged norms (its fragment's, with outer.fragments); ``islands``: how many of
    the last of them are the recent reference (0: no such check). ``peers``: the norms of the push's round (itself
    included) when they are 3 or more (sync mode, as the round closes), else ().

    Without peers (async mode, or a round of fewer than 3 pushes): a norm over ``round_norm_ratio`` × the median
    of the last ``islands`` merged norms, or more than ``norm_z_max`` robust deviations above the median of the
    window (once ``norm_window_min`` are in). With peers, the round screen's ratio to the round's own median
    stands in for the first, and the robust-z window is the merged norms and the round's together: drift-aware.
    A shift that a round's majority shares (the honest norms growing as a sparse island's error-feedback
    accumulator fills, or a fragment's first exchange covering fewer steps than the next ones) moves that median
    with it; one push in a minority cannot move it, so in a round of honest norms the bound is what it was. (A
    window that holds only merged norms cannot follow such a shift: every push of the round is rejected, nothing
    is merged, the window stays where it was, and every island is quarantined after ``max_rejections`` retries:
    measured, docs/architecture.md.)"""
    if c.round_norm_ratio and islands and not peers:
        recent = list(window)[-islands:]
        if len(recent) >= min(3, islands):
            median = statistics.median(recent)
            if norm > c.round_norm_ratio * median:
                return (f"quarantined: push {push_id} has L2 norm {norm:.4g}, more than round_norm_ratio "
                        f"{c.round_norm_ratio:g} x the median {median:.4g} of the last {len(recent)} merged pushes")
    if c.norm_z_max and len(window) >= c.norm_window_min:
        reference = [*window, *peers]
        z = robust_z(norm, reference)
        if z > c.norm_z_max:
            median = statistics.median(reference)
            what = (f"the last {len(window)} merged pushes and the {len(peers)} of its round" if peers
                    else f"the last {len(window)} merged pushes")
            return (f"quarantined: push {push_id} has L2 norm {norm:.4g}, {z:.3g} robust deviations above the "
                    f"median {median:.4g} of {what} (norm_z_max {c.norm_z_max:g})")
    return ""
