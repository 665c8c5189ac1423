"""The island's chip health (workers/chip_health.py) on the 8 fake CPU devices: each quarantine rule finds its injected
device fault, with evidence, and a clean run quarantines nothing."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from dtrain.config.ops import HealthConfig
from dtrain.health.faults import DeadDeviceError, DeviceFault
from fake_island import CHUNKS, Island, K
from workers.chip_health import ChipHealth


def health(island: Island, fault: DeviceFault | None = None, **cfg: object) -> ChipHealth:
    """The island's chip health, ``[health] enabled`` with ``cfg`` overriding its defaults."""
    return ChipHealth(dataclasses.replace(HealthConfig(enabled=True), **cfg), island.model.apply, island.mesh,
                      fault=fault)


def train(island: Island, chips: ChipHealth, fault: DeviceFault | None = None) -> list[dict]:
    """The island's CHUNKS chunks of the per-device step with ``chips`` checking after each; every quarantine's
    evidence."""
    loop = island.loop(True, fault)
    state = loop.init_state(island.params)
    found = []
    for batches in island.batches:
        first = int(state.step)
        state, metrics = loop.run(state, batches)
        found += chips.check(first, jax.device_get(metrics), state.params, batches)
    return found


def clean_metrics(steps: int = 1) -> dict[str, np.ndarray]:
    """The per-device metrics of ``steps`` steps on which every device was finite, with equal gradient norms."""
    return {"device_finite": np.ones((steps, 8), bool), "device_grad_norm": np.ones((steps, 8))}


def test_clean_run_quarantines_nothing(island: Island) -> None:
    chips = health(island, known_answer_every=K, replay_every=K * CHUNKS)  # one replay: each costs compilations
    assert chips.start() == []
    assert train(island, chips) == []
    assert chips.bad_devices == [] and chips.healthy_ids == island.ids and not chips.too_few()
    # every probe ran: the known answer at start and after each chunk, a replay after each chunk
    assert chips.probe_calls == {"known_answer": 1 + CHUNKS, "replay": 1}


def test_failed_known_answer_quarantines_at_start(island: Island) -> None:
    bad = island.ids[5]
    chips = health(island, DeviceFault("bitflip", bad, bit=3, rate=0.01))  # silent: a few low mantissa bits
    (ev,) = chips.start()
    assert (ev["device"], ev["index"], ev["probe"], ev["step"]) == (bad, 5, "known_answer", 0)
    assert ev["value"] != ev["expected"] or ev["mismatches"] > 0
    assert chips.bad_devices == [bad] and bad not in chips.healthy_ids
    json.dumps(ev, allow_nan=False)  # evidence is strict JSON for the events and the heartbeat


# Slow (its own compile of the faulty loop, ~6 s quiet): the default run keeps the statistics rule on real training in
# test_island_health.py's scaled device (probe "stats", within 2 steps of the onset) and test_chip_probes.py's
# test_grad_stats_flag_the_faulty_device; the two-consecutive-steps rule and its evidence in
# test_one_outlier_step_is_forgiven_and_quarantined_devices_leave_the_statistics below.
@pytest.mark.slow
def test_statistics_outlier_on_two_consecutive_steps(island: Island) -> None:
    bad = island.ids[2]
    fault = DeviceFault("scale", bad, factor=10.0)
    chips = health(island, fault, known_answer_every=0, replay_every=0)  # only the statistics can find it
    (ev,) = train(island, chips, fault)
    assert (ev["device"], ev["probe"], ev["step"]) == (bad, "stats", 1)  # flagged at step 0, quarantined at 1
    assert ev["z"] > chips.cfg.z_max and ev["value"] > 5 * ev["median"]
    assert chips.bad_devices == [bad]


def test_non_finite_device(island: Island) -> None:
    bad = island.ids[7]
    fault = DeviceFault("scale", bad, factor=1e30)  # its gradient norm overflows float32
    chips = health(island, fault, known_answer_every=0, replay_every=0, stats=False)
    (ev,) = train(island, chips, fault)
    assert (ev["device"], ev["probe"], ev["step"]) == (bad, "finite", 0)
    json.dumps(ev, allow_nan=False)


def test_replay_quarantines_the_device_outside_the_majority(island: Island) -> None:
    bad = island.ids[3]
    fault = DeviceFault("bitflip", bad, bit=22, start=4)  # silent: the statistics do not see it; from step 4 on
    chips = health(island, fault, known_answer_every=0, replay_every=2)
    batches = island.batches[0]
    assert chips.check(0, clean_metrics(1), island.params, batches) == []  # no replay before step 2
    assert chips.check(1, clean_metrics(1), island.params, batches) == []  # step 2: all agree
    assert chips.probe_calls["replay"] == 1
    assert chips.check(2, clean_metrics(1), island.params, batches) == []  # not yet (next at step 4)
    (ev,) = chips.check(3, clean_metrics(), island.params, batches)  # step 4: device 3 differs
    assert (ev["device"], ev["index"], ev["probe"], ev["step"], ev["mismatches"]) == (bad, 3, "replay", 4, 1)
    assert isinstance(ev["value"], int) and isinstance(ev["expected"], int) and ev["value"] != ev["expected"]
    # the second replay recomputed a row of the next device's micro-batch (the first replay's was device 0's)
    assert f"rows 0..0 of device {island.ids[1]}'s micro-batch on 8 devices" in ev["detail"]
    assert f"digest {ev['value']:#010x}" in ev["detail"] and f"{ev['expected']:#010x}" in ev["detail"]
    assert chips.probe_calls["replay"] == 2 and chips.bad_devices == [bad]
    json.dumps(ev, allow_nan=False)
    # the quarantined device leaves the replay: the 7 others agree; with fewer than 3 healthy no replay runs
    assert chips.check(4, clean_metrics(2), island.params, batches) == []
    assert chips.probe_calls["replay"] == 3


def test_overlapped_checks_find_what_check_finds_one_chunk_later(island: Island) -> None:
    """overlap() reads a chunk's check only at the next chunk (or at flush()): the same evidence as check(), the
    same probes run, one call later; nothing is left unread after flush(), and drop() forgets the pending one."""
    bad = island.ids[3]
    fault = DeviceFault("bitflip", bad, bit=22, start=4)  # silent: the replay at step 4 finds it
    sync, over = (health(island, fault, known_answer_every=3, replay_every=2) for _ in range(2))
    batches = island.batches[0]
    found_sync, found_over = [], []
    for first in range(6):
        found_sync.append(sync.check(first, clean_metrics(1), island.params, batches))
        found_over.append(over.overlap(first, clean_metrics(1), island.params, batches))
        assert over.next_step == first + 1  # the next chunk's first step, with no read of the state
    found_over.append(over.flush(island.params))
    assert over.next_step is None and over.flush(island.params) == []
    assert found_over == [[], *found_sync]
    (ev,) = [ev for found in found_sync for ev in found]
    assert (ev["device"], ev["probe"], ev["step"]) == (bad, "replay", 4)
    assert sync.probe_calls == over.probe_calls == {"known_answer": 2, "replay": 3}
    assert sync.bad_devices == over.bad_devices == [bad]
    # a pending check whose chunk was discarded is forgotten, unread
    assert over.overlap(6, clean_metrics(1), island.params, batches) == [] and over.next_step == 7
    over.drop()
    assert over.next_step is None and over.flush(island.params) == []


@pytest.mark.parametrize("steps_per_call", [10, pytest.param(25, marks=pytest.mark.slow)],  # 25: compiles ~20 s
                         ids=["tiny-chunks", "small-chunks"])
def test_silent_flip_quarantined_within_50_steps_by_default(island: Island, steps_per_call: int) -> None:
    """A bit-22 mantissa flip of every gradient entry on one device, starting on the step right after a replay
    (the worst case), with the default replay interval and the chunk lengths of configs/tiny.toml (10) and
    configs/small.toml (25): the replay quarantines it within 50 inner steps, and nothing else is flagged. The
    known answer (every 100 steps by default, which also sees this flip) is off so that the replay alone finds it."""
    defaults = HealthConfig()
    onset = defaults.replay_every + 1  # the first replay runs at step 50 (the end of the chunk it falls in)
    bad = island.ids[6]
    fault = DeviceFault("bitflip", bad, bit=22, start=onset)
    chips = health(island, fault, known_answer_every=0)
    assert chips.start() == []
    loop = island.loop(True, fault)
    state = loop.init_state(island.params)
    rng = np.random.default_rng(6)
    found: list[dict] = []
    while not found and int(state.step) < onset + 2 * defaults.replay_every:
        batches = island.batch(rng, steps_per_call)
        first = int(state.step)
        state, metrics = loop.run(state, batches)
        found = chips.check(first, jax.device_get(metrics), state.params, batches)
    (ev,) = found
    assert (ev["device"], ev["probe"]) == (bad, "replay")
    assert onset <= ev["step"] <= onset + 50
    assert chips.bad_devices == [bad]


def test_dead_device_diagnosed_after_the_chunk_raises(island: Island) -> None:
    bad = island.ids[3]
    fault = DeviceFault("dead", bad)
    chips = health(island, fault)
    loop = island.loop(True, fault)
    with pytest.raises(DeadDeviceError):
        loop.run(loop.init_state(island.params), island.batches[0])
    (ev,) = chips.diagnose(0)
    assert (ev["device"], ev["probe"], ev["value"]) == (bad, "known_answer", None)
    assert "DeadDeviceError" in ev["detail"]


def test_a_statistics_suspect_the_replay_clears_is_not_quarantined(island: Island) -> None:
    """A healthy device whose micro-batch gradient is an outlier twice in a row (an odd row of data) computes its
    micro-batch as every other device does: the confirming replay clears it."""
    chips = health(island, known_answer_every=0, replay_every=0)
    m = clean_metrics(2)
    m["device_grad_norm"][:, 6] = 100.0
    assert chips.check(0, m, island.params, island.batches[0]) == []
    assert chips.bad_devices == [] and chips.probe_calls["replay"] == 1
    (cleared,) = chips.cleared
    assert (cleared["device"], cleared["probe"], cleared["step"]) == (island.ids[6], "stats", 1)
    assert cleared["value"] == 100.0
    assert "cleared" in cleared["detail"]
    json.dumps(cleared, allow_nan=False)


def test_one_outlier_step_is_forgiven_and_quarantined_devices_leave_the_statistics(island: Island) -> None:
    # device 4 is faulty (the confirming replay sees it), and its norms below are the statistics' view of it
    chips = health(island, DeviceFault("scale", island.ids[4], factor=10.0), known_answer_every=0, replay_every=0,
                          min_devices=8)
    m = clean_metrics(3)
    m["device_grad_norm"][0, 4] = 100.0  # an outlier once, then normal: forgiven
    assert chips.check(0, m, island.params, island.batches[0]) == []
    assert chips.bad_devices == [] and not chips.too_few()
    m = clean_metrics(2)
    m["device_grad_norm"][:, 4] = 100.0
    (ev,) = chips.check(3, m, island.params, island.batches[0])
    assert (ev["device"], ev["step"], ev["probe"]) == (island.ids[4], 4, "stats")
    assert ev["z"] > chips.cfg.z_max and ev["value"] > 5 * ev["median"]
    assert "confirmed by a replay" in ev["detail"] and chips.cleared == []
    # the quarantined device's numbers no longer count: a garbage value there flags nothing
    m = clean_metrics(2)
    m["device_grad_norm"][:, 4] = np.nan
    m["device_finite"][:, 4] = False
    assert chips.check(5, m, island.params, island.batches[0]) == []
    assert chips.healthy_ids == [d for d in island.ids if d != island.ids[4]]
    assert chips.too_few()  # 7 healthy devices, min_devices 8


def test_divergence_is_no_chips_fault(island: Island) -> None:
    chips = health(island, known_answer_every=0, replay_every=0)
    m = clean_metrics(2)
    m["device_finite"][:, :5] = False  # most devices non-finite: the training diverged
    m["device_grad_norm"][:, :5] = np.inf
    assert chips.check(0, m, island.params, island.batches[0]) == []
    assert chips.bad_devices == []


def test_check_names_wrong_metrics(island: Island) -> None:
    chips = health(island)
    with pytest.raises(ValueError, match=r"per-device metrics.*InnerLoop\(per_device=True\)"):
        chips.check(0, {"device_finite": np.ones((2, 7), bool), "device_grad_norm": np.ones((2, 7))},
                    island.params, island.batches[0])
