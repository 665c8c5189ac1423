"""The scoring of ``dtrain simulate``'s injected faults against what the run detected and did about them.

Pure functions over a finished run's events (the coordinator's, each island's: every process of it) and the
fault specs (:mod:`dtrain_cli.fault_spec`): for each fault, when it was injected, which event showed that the
system noticed it (``detected_by``, ``detection_s``), the action taken and the recovery. These are the
summary's ``faults`` and ``device_quarantines`` (:func:`score_faults`, :func:`device_quarantines`); the driver
records what it injected itself (:mod:`dtrain_cli.simulate_processes`) and reads the events
(:mod:`dtrain_cli.simulate_report`), and nothing here reads a file or starts a process.

- the driver's faults (``kill``, ``hang``, ``cut``, ``kill-coordinator``, ``slow``; its ``fault_injected``
  records): :func:`driver_fault_detection`;
- push faults (the worker's own ``fault_injected`` event, found by :func:`push_fault_event`):
  :func:`push_detection`, the coordinator's first answer to the bad push by its push id;
- device faults: :func:`device_fault_entry` (the island's ``device_quarantined`` of the fault's device) and
  :func:`device_fault_reached` (whether the island ran the fault's start step at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dtrain_cli.fault_spec import DEVICE_KINDS, PUSH_KINDS, FaultSpec

Events = list[dict[str, Any]]

# The coordinator's events that answer a bad push, and the action each means (push_refused and push_aborted
# are told apart further in push_detection).
PUSH_DETECTIONS = {"push_quarantined": "quarantined", "merge_rejected": "rejected: non-finite merge",
                   "push_refused": "refused", "push_aborted": "upload aborted"}


def score_faults(fired: Sequence[dict[str, Any]], faults: Sequence[FaultSpec], coord_events: Events,
                 island_events: dict[str, Events]) -> list[dict[str, Any]]:
    """Each injected fault with when the system noticed it and what it did: the summary's ``faults``.

    Args:
        fired: the driver's record of each fault it injected itself (``fault``, ``kind``, ``target``,
            ``injected_t``, ``version``, ``recovered_t``, ``recovery``), in injection order.
        faults: every fault spec of the run (push and device faults are scored where they fired).
        coord_events: the coordinator's events.
        island_events: island name -> its events (all its processes').

    Returns one entry per injected fault: the driver's faults first (:func:`driver_fault_detection`), then
    the push faults that fired (:func:`push_detection`), then the device faults that were reached
    (:func:`device_fault_entry`)."""
    result = [driver_fault_detection(f, coord_events, island_events) for f in fired]
    for spec in faults:
        injected = push_fault_event(spec, island_events[spec.target]) if spec.kind in PUSH_KINDS else None
        if injected is not None:
            result.append(push_detection(spec, injected, coord_events, island_events[spec.target]))
    device_faults = [f for f in faults if f.kind in DEVICE_KINDS]
    result += [device_fault_entry(f, island_events[f.target], device_faults) for f in device_faults
               if device_fault_reached(f, island_events[f.target])]
    return result


def driver_fault_detection(fired: dict[str, Any], coord_events: Events, island_events: dict[str, Events]
                           ) -> dict[str, Any]:
    """A fault the driver injected itself (``fired``: its record, see :func:`score_faults`) with its detection.

    ``kill``, ``hang`` and ``cut``: the coordinator notices a dead or hung island when its lease expires
    (``island_lost``), or earlier when a restarted one joins again under the same name (not a live island
    moving to another shard); ``kill-coordinator``: the islands' first ``retry`` or ``heartbeat_failed``;
    ``slow`` (not a failure: the island keeps its lease): the island's ``link_slow``.

    Returns ``fired`` with ``detected_t``, ``detection_s`` (from ``injected_t``), ``detected_by`` (the event;
    None: not detected) and ``action`` added."""
    t = fired["injected_t"]
    seen: dict[str, Any] | None
    if fired["kind"] in ("kill", "hang", "cut"):
        target = fired["target"]
        seen = next((e for e in coord_events if e["t"] >= t and e.get("name", e.get("island")) is not None
                     and (e.get("event") == "island_lost" and e.get("island") == target
                          or e.get("event") == "island_joined" and e.get("name") == target
                          and "is done; took over" not in str(e.get("reason", "")))), None)
        action = {"island_lost": "lease expired: dropped from the round; its shard's unmerged data goes "
                                 "to the next island to take the shard",
                  "island_joined": "rejoined before its lease expired: kept its shard, from the "
                                   "coordinator's cursor",
                  None: "none: lease not expired"}[seen.get("event") if seen else None]
    elif fired["kind"] == "kill-coordinator":
        seen = min((e for evs in island_events.values() for e in evs
                    if e.get("event") in ("retry", "heartbeat_failed") and e["t"] >= t),
                   key=lambda e: e["t"], default=None)
        action = "islands retried with backoff"
    else:  # slow: not a failure (the island keeps its lease); the island notices its round trips grow
        seen = next((e for e in island_events.get(fired["target"], [])
                     if e.get("event") == "link_slow" and e["t"] >= t), None)
        action = "the island reported its link slow (heartbeat round trips); it keeps its lease"
    return {**fired, "detected_t": seen["t"] if seen else None,
            "detection_s": round(seen["t"] - t, 3) if seen else None,
            "detected_by": seen.get("event") if seen else None, "action": action}


def push_fault_event(spec: FaultSpec, island_events: Events) -> dict[str, Any] | None:
    """The island's ``fault_injected`` event for push fault ``spec`` (``island_events``: its island's events),
    or None if it has not fired (yet)."""
    return next((e for e in island_events
                 if e.get("event") == "fault_injected" and e.get("fault_kind") == spec.kind
                 and e.get("at_version") == spec.at_version), None)


def push_detection(spec: FaultSpec, injected: dict[str, Any], coord_events: Events, island_events: Events
                   ) -> dict[str, Any]:
    """A push fault's summary entry.

    Args:
        spec: the push fault.
        injected: its island's ``fault_injected`` event (:func:`push_fault_event`): the push id and the time.
        coord_events: the coordinator's events.
        island_events: the fault's island's events.

    Returns the entry: the coordinator's first event about the bad push (by its push id) as ``detected_by``
    and the action it took, latency (``detection_s``) from the island's ``fault_injected``, whether the push
    was merged all the same, and its recovery (:func:`_push_recovery`)."""
    push_id = injected["push_id"]
    about = [e for e in coord_events if e.get("push_id") == push_id]
    seen = next((e for e in about if e.get("event") in PUSH_DETECTIONS), None)
    merged = any(p.get("push_id") == push_id for e in coord_events if e.get("event") == "round_merged"
                 for p in e.get("pushes", ()))
    recovered, recovery = _push_recovery(push_id, seen, about, island_events)
    if seen is None:
        action = "merged: not detected" if merged else "none: not detected"
    elif seen["event"] == "push_refused":
        reason = str(seen.get("reason", ""))
        action = ("refused: bad frame" if "bad frame" in reason else
                  "refused: tokens beyond its assigned range" if "exceed its cursor range" in reason else
                  f"refused: {seen.get('code')}")
    elif seen["event"] == "push_aborted":  # recovered: the coordinator received it again (_push_recovery)
        action = "upload retried" if recovered is not None else "upload discarded, not retried"
    else:
        action = PUSH_DETECTIONS[seen["event"]]
    t = injected["t"]
    return {"fault": spec.text, "kind": spec.kind, "target": spec.target, "injected_t": t,
            "version": injected.get("base_version"), "recovered_t": recovered, "recovery": recovery,
            "push_id": push_id,
            "merged": merged, "detected_t": seen["t"] if seen else None,
            "detection_s": round(seen["t"] - t, 3) if seen else None,
            "detected_by": seen["event"] if seen else None, "action": action}


def _push_recovery(push_id: str, seen: dict[str, Any] | None, about: Events, island_events: Events
                   ) -> tuple[float | None, str | None]:
    """How the run recovered from bad push ``push_id`` that the coordinator answered with ``seen`` (None: not
    detected): an aborted upload by the coordinator's next ``push_received`` of it (``about``: its events about
    the push); a push not merged by the island's ``rewound`` naming it (it trains its range again). Returns
    (when, how), (None, None) where neither happened."""
    if seen is None:
        return None, None
    if seen["event"] == "push_aborted":
        retry = next((e for e in about if e.get("event") == "push_received" and e["t"] >= seen["t"]), None)
        return (retry["t"], "upload sent again") if retry is not None else (None, None)
    rewound = next((e for e in island_events
                    if e.get("event") == "rewound" and push_id in str(e.get("reason", ""))), None)
    if rewound is None:
        return None, None
    return rewound["t"], (f"the island rewound to cursor {rewound.get('to_cursor')} and trained the range again "
                          f"({rewound.get('retrained_steps')} steps)")


def _quarantine_fault(island: str, evidence: dict[str, Any], device_faults: Sequence[FaultSpec]) -> FaultSpec | None:
    """The device fault of ``island`` that a ``device_quarantined`` event (``evidence``) found: one on the same
    device whose start step is not after the evidence's step; None: a false positive (a healthy device
    quarantined, or the faulty one before its fault could fire)."""
    return next((f for f in device_faults if f.target == island and f.device_fault is not None
                 and f.device_fault.found_by(evidence)), None)


def device_quarantines(island_events: dict[str, Events], device_faults: Sequence[FaultSpec]
                       ) -> list[dict[str, Any]]:
    """Every ``device_quarantined`` event of every island (``island_events``: island name -> its events), in
    time order, as {island, t, device, probe, step, detail, fault}: ``fault`` is the device fault of
    ``device_faults`` (its spec text) that the quarantine found, or None for a false positive (see
    :func:`_quarantine_fault`). The summary's ``device_quarantines``."""
    found = []
    for island, events in island_events.items():
        for e in events:
            if e.get("event") == "device_quarantined":
                f = _quarantine_fault(island, e, device_faults)
                found.append({"island": island, "t": e["t"], "device": e.get("device"), "probe": e.get("probe"),
                              "step": e.get("step"), "detail": e.get("detail"), "fault": f.text if f else None})
    return sorted(found, key=lambda q: q["t"])


def device_fault_reached(spec: FaultSpec, island_events: Events) -> bool:
    """Whether device fault ``spec`` was injected, from its island's events (``island_events``): some process of
    the island ran past its start step (a ``trained`` event's ``executed``), or the island quarantined the
    device for it."""
    fault = spec.device_fault
    assert fault is not None, spec
    return any(e.get("event") == "trained" and int(e["executed"]) > fault.start
               or e.get("event") == "device_quarantined" and _quarantine_fault(spec.target, e, [spec]) is not None
               for e in island_events)


def device_fault_entry(spec: FaultSpec, island_events: Events, device_faults: Sequence[FaultSpec]
                       ) -> dict[str, Any]:
    """A device fault's summary entry from its island's events (``island_events``: all its worker processes').

    Detected by the island's first ``device_quarantined`` of the fault's device at or after its start step
    (the probe that found it, ``detection_steps`` = the evidence's step - the start step, ``detection_s`` from
    the time the island began the chunk that holds the start step, where its events say:
    :func:`_step_reached_t`); the action from the island's next ``remeshed`` (or ``drained``);
    ``false_positives``: the island's quarantines that found none of its device faults (``device_faults``:
    every device fault of the run). Returns the entry."""
    fault = spec.device_fault
    assert fault is not None, spec
    quarantines = [e for e in island_events if e.get("event") == "device_quarantined"]
    seen = next((e for e in quarantines if _quarantine_fault(spec.target, e, [spec]) is not None), None)
    false_positives = [{"device": e.get("device"), "probe": e.get("probe"), "step": e.get("step"), "t": e["t"],
                        "detail": e.get("detail")}
                       for e in quarantines if _quarantine_fault(spec.target, e, device_faults) is None]
    onset_t = _step_reached_t(island_events, spec)
    entry: dict[str, Any] = {
        "fault": spec.text, "kind": spec.kind, "target": spec.target, "device": fault.device,
        "start_step": fault.start, "injected_t": onset_t, "recovered_t": None, "recovery": None,
        "detected_t": None, "detection_s": None, "detection_steps": None, "detected_by": None, "probe": None,
        "action": "none: not detected", "false_positives": false_positives}
    if seen is None:
        return entry
    step = int(seen["step"])
    entry.update(detected_t=seen["t"], detected_by="device_quarantined", probe=seen.get("probe"),
                 detection_steps=step - fault.start,
                 evidence={k: v for k, v in seen.items() if k not in ("t", "elapsed_s", "event")},
                 detection_s=round(seen["t"] - onset_t, 3) if onset_t is not None else None)
    action = f"quarantined device {fault.device} ({seen.get('probe')})"
    after = next((e for e in island_events if e.get("event") in ("remeshed", "drained") and e["t"] >= seen["t"]),
                 None)
    if after is None:
        entry["action"] = action
    elif after["event"] == "remeshed":
        entry.update(action=f"{action}; remeshed on {after.get('devices')} devices", recovered_t=after["t"],
                     recovery=f"remeshed on devices {after.get('device_ids')} from {after.get('from_devices')}, "
                              f"the same global batch")
    else:
        entry["action"] = f"{action}; drained ({after.get('reason')})"
    return entry


def _step_reached_t(island_events: Events, spec: FaultSpec) -> float | None:
    """When the island's first worker process began the chunk of inner steps that holds device fault ``spec``'s
    start step: the end of its chunk before it (a ``trained`` event; ``island_started`` for the first chunk). That
    chunk is known by the first event that shows it ran: a ``trained`` event whose ``executed`` (the process's
    steps so far) passes the start step, a ``chunk_failed`` whose steps reach past it, or the fault's
    ``device_quarantined``. None where the first process's events show none (it never ran that step, or a
    restarted process did, whose step counter was restored from a checkpoint)."""
    assert spec.device_fault is not None, spec
    start = spec.device_fault.start
    last_t: float | None = None
    executed = 0
    for e in island_events:
        event = e.get("event")
        if event == "island_started" and last_t is None:
            last_t = float(e["t"])
        elif event == "trained":
            if int(e["executed"]) < executed:
                return None  # a restarted process: it counts from 0 again
            executed = int(e["executed"])
            if executed > start:
                return last_t
            last_t = float(e["t"])
        elif event == "chunk_failed" and int(e["step"]) + int(e["steps"]) > start or \
                event == "device_quarantined" and _quarantine_fault(spec.target, e, [spec]) is not None:
            return last_t
    return None
