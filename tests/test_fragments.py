"""Fragments (Streaming DiLoCo, ``outer.fragments``): the plan, the schedule, the merge of one fragment per
version, the island's side (its update applied to one fragment, its fold-in), and a real coordinator refusing
hostile fragment pushes with nothing changed."""

from __future__ import annotations

import dataclasses
import tempfile

import grpc
import numpy as np
import pytest

from conftest import initial_parameters
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.codec import params_digest
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.steps.outer import OuterHParams
from dtrain.train import fragments
from service_helpers import Running, delta_frame, join_island, push_header
from simulate_helpers import NO_FAKE_DEVICES
from workers.client import CoordinatorClient, CoordinatorError
from workers.exchange import GlobalParams, Puller
from workers.rounds import Schedule

# -- the plan ---------------------------------------------------------------------------------------------------


def _check_plan(sizes: list[int], parts: int) -> tuple[fragments.Range, ...]:
    """The invariants of every plan: contiguous whole tensors covering the tree, each range at least one tensor,
    none longer than an equal share plus one tensor."""
    ranges = fragments.plan(sizes, parts)
    cum = np.concatenate([[0], np.cumsum(sizes)])
    assert len(ranges) == parts and [r.index for r in ranges] == list(range(parts))
    assert ranges[0].start == 0 and ranges[-1].end == cum[-1] and ranges[0].first_leaf == 0
    assert ranges[-1].end_leaf == len(sizes)
    for a, b in zip(ranges[:-1], ranges[1:], strict=True):
        assert a.end == b.start and a.end_leaf == b.first_leaf
    for r in ranges:
        assert r.end_leaf > r.first_leaf and (r.start, r.end) == (cum[r.first_leaf], cum[r.end_leaf])
        assert r.size <= cum[-1] / parts + max(sizes)
    return ranges


def test_plan_cuts_whole_tensors_into_about_equal_ranges():
    assert [(r.start, r.end) for r in _check_plan([10, 10, 10, 10], 2)] == [(0, 20), (20, 40)]
    assert [(r.start, r.end) for r in _check_plan([10, 10, 10, 10], 4)] == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert [(r.start, r.end) for r in _check_plan([100, 1, 1, 1], 2)] == [(0, 100), (100, 103)]
    assert [(r.start, r.end) for r in _check_plan([1, 1, 1, 100], 3)] == [(0, 2), (2, 3), (3, 103)]
    assert _check_plan([7, 3], 1) == (fragments.Range(0, 0, 10, 0, 2),)
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(s) for s in rng.integers(1, 1000, size=int(rng.integers(1, 30)))]
        _check_plan(sizes, int(rng.integers(1, len(sizes) + 1)))


def test_plan_refuses_impossible_counts():
    with pytest.raises(ValueError, match="need at least 3 tensors"):
        fragments.plan([5, 5], 3)
    with pytest.raises(ValueError, match="must be in 1..64"):
        fragments.plan([5, 5], 0)
    with pytest.raises(ConfigError, match=r"\[outer\] fragments: 3 fragments need at least 3 tensors"):
        fragments.plan_spec([["a", [4], "float32"], ["b", [2, 2], "float32"]], 3)


def test_plan_of_the_tiny_model_and_the_round_robin():
    _, spec = initial_parameters(load_config("tiny"))
    n = codec.spec_size(spec)
    for parts in (1, 2, 4):
        ranges = fragments.plan_spec(spec, parts)
        assert sum(r.size for r in ranges) == n and ranges[-1].end == n
        if parts > 1:  # about equal: no range over twice an equal share (the embedding is the largest tensor)
            assert max(r.size for r in ranges) < 2 * n / parts + max(fragments.leaf_sizes(spec))
    # version v + 1 merges fragment v mod F; a push from version b carries fragment b mod F
    assert [fragments.fragment_of_round(v, 3) for v in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert [fragments.fragment_of_base(b, 3) for b in range(0, 7)] == [0, 1, 2, 0, 1, 2, 0]
    assert fragments.check_push(1, 3, 2) == ""
    assert "must be below outer.fragments=2" in fragments.check_push(2, 2, 2)
    assert "carries fragment 1" in fragments.check_push(0, 3, 2)
    assert fragments.check_push(0, 7, 1) == ""  # without fragments: always fragment 0


def test_apply_update_and_at_push_touch_one_fragment():
    ranges = fragments.plan([4, 4, 4], 3)
    vec = np.arange(12, dtype=np.float32)
    out = fragments.apply_update(vec, np.ones(4, np.float32), 5, ranges)  # v5 merged fragment (5 - 1) mod 3 = 1
    assert np.array_equal(out, vec + np.r_[np.zeros(4), np.ones(4), np.zeros(4)].astype(np.float32))
    assert np.array_equal(vec, np.arange(12, dtype=np.float32))  # a new array
    with pytest.raises(ValueError, match="holds 5 values, fragment 1 holds 4"):
        fragments.apply_update(vec, np.ones(5, np.float32), 5, ranges)
    assert np.array_equal(fragments.apply_update(vec, vec, 9, fragments.whole(12)), 2 * vec)
    anchor, local = np.zeros(12, np.float32), np.ones(12, np.float32)
    mixed = fragments.at_push(anchor, local, ranges[2])
    assert np.array_equal(mixed, np.r_[np.zeros(8), np.ones(4)].astype(np.float32))
    # The fold-in θ' + (θ_local − θ_at_push) then keeps the other fragments' local progress, and takes θ' on the
    # pushed one plus the progress since the push
    new_global = anchor.copy()
    new_global[8:] = 5.0
    later = local + 0.5  # trained on after the push
    folded = new_global + (later - mixed)
    assert np.array_equal(folded[:8], later[:8]) and np.array_equal(folded[8:], np.full(4, 5.5, np.float32))
    # What a push leaves unsent (every other fragment's progress), which a rewind to its end puts on the newest θ
    left = fragments.unsent(anchor, later, ranges[1])
    assert np.array_equal(left, np.r_[np.full(4, 1.5), np.zeros(4), np.full(4, 1.5)].astype(np.float32))


# -- the config and the schedule ------------------------------------------------------------------------------


def test_config_fragments_rules_and_fingerprint():
    tiny = load_config("tiny")  # H = 20, 60 steps
    two = replace(tiny, outer={"fragments": 2})
    assert "outer.fragments" not in tiny.fingerprint_fields()
    assert two.fingerprint_fields()["outer.fragments"] == "2" and two.fingerprint() != tiny.fingerprint()
    assert tiny.rounds == 3 and two.rounds == 6  # a push, and a version, every H / F steps
    assert Schedule.from_config(two).inner_steps == 10 and Schedule.from_config(tiny).inner_steps == 20
    with pytest.raises(ConfigError, match=r"\[outer\] fragments: must divide outer.inner_steps \(20\), got 3"):
        replace(tiny, outer={"fragments": 3})
    with pytest.raises(ConfigError, match="needs coordinator.mode = 'sync'"):
        replace(tiny, outer={"fragments": 2}, coordinator={"mode": "async"})
    with pytest.raises(ConfigError, match="needs step rounds"):
        replace(tiny, outer={"fragments": 2}, worker={"round_seconds": 5.0})
    with pytest.raises(ConfigError, match="must be in 1..64"):
        replace(tiny, outer={"fragments": 0})


# -- the merge of one fragment per version ---------------------------------------------------------------------

SIZES = [300, 700, 1000, 500]  # four tensors; F = 2 cuts them [300, 700 | 1000, 500]


def _merger(tmp_path, parts: int, up: str = "fp32", down: str = "fp32") -> Merger:
    cfg = replace(Config(), codec={"up": up, "down": down, "block": 64, "sparse_chunk": 256},
                  outer={"momentum": 0.5, "fragments": 1}, coordinator={"merge_rule": "mean"})
    opts = dataclasses.replace(MergeOptions.from_config(cfg), ranges=fragments.plan(SIZES, parts))
    theta = np.random.default_rng(1).normal(size=sum(SIZES)).astype(np.float32)
    return Merger(theta, opts, spool_dir=tempfile.mkdtemp(dir=tmp_path))


def _push(m: Merger, fragment: int, vec: np.ndarray, weight: float) -> None:
    with m.spool(fragment) as sp:
        sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, 64)))
        m.validate(sp)
        m.add_pending(sp, weight)


def test_each_version_merges_its_fragment_only(tmp_path):
    m = _merger(tmp_path, 2)
    assert m.fragments == 2 and [m.fragment(i).size for i in (0, 1)] == [1000, 1500]
    theta0 = m.theta.copy()
    assert m.opts.outer == OuterHParams(lr=0.7, momentum=0.5, nesterov=True)  # the hand computation's below
    rng = np.random.default_rng(2)
    d0 = [rng.normal(size=1000).astype(np.float32) for _ in range(2)]
    _push(m, 0, d0[0], 1.0)
    _push(m, 0, d0[1], 3.0)
    u1 = m.outer_step()
    delta = ((d0[0] * np.float32(1.0) + d0[1] * np.float32(3.0)) * np.float32(1 / 4.0)).astype(np.float32)
    step, mom = delta * np.float32(-0.7 * 1.5), delta  # m' = μ·0 + Δ; u = −lr(Δ + μ m') = −lr (1 + μ) Δ
    theta1 = m.theta
    np.testing.assert_allclose(theta1[:1000], theta0[:1000] + step, rtol=1e-6, atol=1e-7)
    assert np.array_equal(theta1[1000:], theta0[1000:])  # the other fragment: bit for bit as it was
    np.testing.assert_allclose(m.momentum[:1000], mom, rtol=1e-6)
    assert not m.momentum[1000:].any()
    mom1 = m.momentum.copy()
    # The update holds fragment 0's values only; an island applies it there and lands bit-identical
    upd = codec.dequantize(codec.decode(u1.frame))
    assert upd.size == 1000
    island = fragments.apply_update(theta0, upd, 1, m.opts.ranges)
    assert params_digest(island) == m.digest == u1.params_digest
    # Version 2 merges fragment 1: fragment 0's θ and momentum stay
    d1 = rng.normal(size=1500).astype(np.float32)
    _push(m, 1, d1, 2.0)
    u2 = m.outer_step()
    assert np.array_equal(m.theta[:1000], theta1[:1000]) and np.array_equal(m.momentum[:1000], mom1[:1000])
    np.testing.assert_allclose(m.theta[1000:], theta0[1000:] + d1 * np.float32(-0.7 * 1.5), rtol=1e-5, atol=1e-7)
    island = fragments.apply_update(island, codec.dequantize(codec.decode(u2.frame)), 2, m.opts.ranges)
    assert params_digest(island) == m.digest and m.updates_since(0) == [u1, u2]


@pytest.mark.parametrize("up,down", [("int8", "int4"), ("sparse", "sparse")])
def test_quantized_fragments_stay_bit_identical_over_many_versions(tmp_path, up, down):
    m = _merger(tmp_path, 4, up=up, down=down)
    island = m.theta.copy()
    rng = np.random.default_rng(3)
    for v in range(1, 9):
        part = m.next_fragment()
        assert part.index == (v - 1) % 4
        vec = rng.normal(size=part.size).astype(np.float32) * 1e-2
        with m.spool(part.index) as sp:
            sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, m.opts.up_block or 64, 0.02)))
            m.validate(sp)
            m.add_pending(sp, 1.0)
        u = m.outer_step()
        island = fragments.apply_update(island, codec.dequantize(codec.decode(u.frame)), v, m.opts.ranges)
        assert params_digest(island) == m.digest


def test_a_push_of_the_wrong_size_is_refused_by_its_spool(tmp_path):
    m = _merger(tmp_path, 2)
    with m.spool(1) as sp, pytest.raises(codec.CodecError, match="expected n=1500"):
        sp.write(codec.encode(codec.quantize(np.zeros(1000, np.float32), 32, 64)))
        m.validate(sp)
    with pytest.raises(IndexError):
        m.spool(2)
    with m.spool(1) as sp:  # a well-formed push of fragment 1 cannot join the merge of fragment 0
        sp.write(codec.encode(codec.quantize(np.zeros(1500, np.float32), 32, 64)))
        m.validate(sp)
        with pytest.raises(ValueError, match="cannot join the merge of fragment 0"):
            m.add_pending(sp, 1.0)
    assert m.pending_count == 0


def test_without_fragments_the_merger_is_the_whole_theta(tmp_path):
    cfg = replace(Config(), codec={"block": 64})
    assert MergeOptions.from_config(cfg).ranges == ()
    with pytest.raises(ValueError, match="needs the parameter tree's spec"):
        MergeOptions.from_config(replace(cfg, outer={"fragments": 2, "inner_steps": 50}))


# -- a real coordinator ----------------------------------------------------------------------------------------


@pytest.fixture
def frag_coordinator(net_cfg, tmp_path):
    cfg = replace(net_cfg, outer={"fragments": 2})
    running = Running(cfg, tmp_path / "coord")
    clients = [CoordinatorClient(running.address, cfg) for _ in range(2)]
    joins = [join_island(c, name) for c, name in zip(clients, ("a", "b"), strict=True)]
    yield cfg, running, clients, joins
    for c in clients:
        c.close()
    running.stop()


def _state(service) -> dict:
    with service.lock:
        return {"state": service.state.to_json(), "version": service.merger.version,
                "pending": service.merger.pending_count, "digest": service.merger.digest}


def _header(join: pb.JoinResponse, push_id: str, fragment: int, base: int = 0, start: int = 0) -> pb.PushHeader:
    h = push_header(join, push_id, base=base, tokens=320, start=start)
    h.fragment, h.cursor_end, h.inner_steps = fragment, start + 40, 5  # H / F = 5 steps of 8 sequences
    return h


def test_fragment_pushes_merge_in_turn_and_hostile_ones_change_nothing(frag_coordinator):
    cfg, running, (c0, c1), (j0, j1) = frag_coordinator
    service = running.service
    ranges = service.merger.opts.ranges
    n = j0.tree_size
    assert len(ranges) == 2 and ranges[-1].end == n
    before = _state(service)
    other = CoordinatorClient(running.address, replace(cfg, outer={"fragments": 1}))
    with pytest.raises(CoordinatorError) as e:  # an island without fragments: refused at Join, naming the field
        other.join("c", "cpu", 1)
    other.close()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "outer.fragments" in e.value.message
    assert _state(service) == before
    hostile = [(_header(j0, "out-of-range", 2), delta_frame(ranges[0].size, 1)[1], "fragment=2: must be below"),
               (_header(j0, "not-base-mod-F", 1), delta_frame(ranges[1].size, 1)[1], "carries fragment 0"),
               (_header(j0, "whole-theta", 0), delta_frame(n, 1)[1], f"expected n={ranges[0].size}"),
               (_header(j0, "other-size", 0), delta_frame(ranges[1].size, 1)[1], f"expected n={ranges[0].size}")]
    for header, frame, why in hostile:
        with pytest.raises(CoordinatorError) as e:
            c0.push(header, frame)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.message
        assert _state(service) == before
    # Version 1 merges fragment 0 of both islands; an island holding θ_0 applies its update to fragment 0
    assert c0.push(_header(j0, "a1", 0), delta_frame(ranges[0].size, 2)[1]).status == pb.PUSH_STATUS_PENDING
    assert c1.push(_header(j1, "b1", 0), delta_frame(ranges[0].size, 3)[1]).status == pb.PUSH_STATUS_MERGED
    have = GlobalParams(running.theta.copy(), 0)
    g = Puller(c0, n, 1 << 24, lambda *a, **k: None, ranges).pull(j0.island_id, have)
    assert g.version == 1 and g.digest == service.merger.digest
    assert np.array_equal(g.vec[ranges[1].start:], running.theta[ranges[1].start:])
    assert not np.array_equal(g.vec[:ranges[0].end], running.theta[:ranges[0].end])
    # A stale push from version 0 (fragment 0) cannot join the round of fragment 1: dropped, its range trained again
    late = c0.push(_header(j0, "a-late", 0, start=40), delta_frame(ranges[0].size, 4)[1])
    assert late.status == pb.PUSH_STATUS_DROPPED and "merges fragment 1" in late.reason and late.cursor == 40
    # Version 2 merges fragment 1
    assert c0.push(_header(j0, "a2", 1, base=1, start=40), delta_frame(ranges[1].size, 5)[1]).status == \
        pb.PUSH_STATUS_PENDING
    assert c1.push(_header(j1, "b2", 1, base=1, start=40), delta_frame(ranges[1].size, 6)[1]).status == \
        pb.PUSH_STATUS_MERGED
    g2 = Puller(c0, n, 1 << 24, lambda *a, **k: None, ranges).pull(j0.island_id, g)
    assert g2.version == 2 and g2.digest == service.merger.digest
    assert np.array_equal(g2.vec[:ranges[0].end], g.vec[:ranges[0].end])
    st = c0.status()
    assert st.version == 2 and st.tokens_merged == 4 * 320 and list(st.shard_cursors) == [80, 80]


# -- real processes ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~24 s of worker processes; in process: test_each_version_merges_its_fragment_only,
# test_fragment_pushes_merge_in_turn_and_hostile_ones_change_nothing, test_quantized_fragments_stay_bit_identical_...
def test_simulate_with_two_fragments_runs_to_the_end_with_an_exact_audit(tmp_path, compile_cache):
    """`dtrain simulate --set outer.fragments=2`: a coordinator and two worker processes; every version merges one
    fragment in turn, the islands end bit-identical with the coordinator, every token is merged exactly once."""
    from dtrain.runlog import read_events
    from dtrain_cli.simulate import run_simulation

    cfg = load_config("tiny", [f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40",
                               "outer.inner_steps=10", "outer.fragments=2", "worker.heartbeat_s=0.5",
                               "coordinator.grace_s=60", compile_cache])
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    assert s["rounds"] == cfg.rounds == 8  # a push of one fragment every 5 steps, 40 steps
    assert s["bit_identical_final_params"]
    audit = s["audit"]
    assert audit["lost_tokens"] == audit["doubled_tokens"] == 0 and audit["gaps"] == audit["overlaps"] == []
    assert audit["merged_ranges"] == 2 * 8 and audit["coverage"] == {"0": [[0, 320]], "1": [[0, 320]]}
    assert s["final_eval_loss"] < 4.5 and s["goodput"] == 1.0
    merged = [e for e in read_events(tmp_path / "tiny") if e.get("event") == "round_merged"]
    assert [e["fragment"] for e in merged] == [0, 1] * 4
    sizes = {e["fragment"]: e["values"] for e in merged}
    assert sum(sizes.values()) == codec.spec_size(initial_parameters(cfg)[1])
    assert all(p["steps"] == 5 for e in merged for p in e["pushes"])


@pytest.mark.slow
def test_sparse_fragments_whose_norms_grow_are_merged_and_no_island_is_quarantined(tmp_path):
    """Four islands, codec sparse, outer.fragments = 2, the learning-rate warm-up as long as a round: fragment 0's
    first push covers H/F steps early in the warm-up and is a top-k of that delta alone, its next one covers H
    steps and carries the accumulator, 5 x the first's norm (measured: 0.12 -> 0.59-0.61). Judged on arrival
    against the merged norms alone, every push of that round was rejected and all four islands quarantined (the
    code before the norm screen moved to the round's close); beside the round's own norms, all are merged and
    the run ends with every token merged once."""
    from dtrain.runlog import read_events
    from dtrain_cli.simulate import run_simulation

    cfg = load_config("tiny", [f"run.out_dir={tmp_path}", "codec.up=sparse", "codec.down=sparse",
                               "outer.fragments=2", "train.warmup_steps=20", "train.steps=40",
                               "worker.heartbeat_s=0.5", "coordinator.grace_s=60"])
    s = run_simulation(cfg, 4, quiet=True, env=NO_FAKE_DEVICES, timeout_s=600)
    assert s["quarantined_islands"] == [] and s["unfinished_islands"] == [] and len(s["islands"]) == 4
    assert s["rounds"] == 4 and s["bit_identical_final_params"]
    audit = s["audit"]
    assert audit["lost_tokens"] == audit["doubled_tokens"] == 0 and audit["gaps"] == audit["overlaps"] == []
    events = read_events(tmp_path / "tiny")
    assert not [e for e in events if e["event"] in ("push_quarantined", "island_quarantined")]
    merged = {e["version"]: [p["norm"] for p in e["pushes"]] for e in events if e["event"] == "round_merged"}
    assert len(merged[1]) == len(merged[3]) == 4 and min(merged[3]) > 4 * max(merged[1])  # fragment 0 grew


@pytest.mark.slow
def test_a_resumed_coordinator_goes_on_with_the_next_fragment(frag_coordinator, tmp_path):
    cfg, running, (c0, c1), (j0, j1) = frag_coordinator
    ranges = running.service.merger.opts.ranges
    c0.push(_header(j0, "a1", 0), delta_frame(ranges[0].size, 2)[1])
    assert c1.push(_header(j1, "b1", 0), delta_frame(ranges[0].size, 3)[1]).status == pb.PUSH_STATUS_MERGED
    digest = running.service.merger.digest
    running.stop()
    again = Running(cfg, tmp_path / "coord", resume=True)
    try:
        m = again.service.merger
        assert m.version == 1 and m.digest == digest and m.opts.ranges == ranges
        assert m.next_fragment().index == 1  # version 2 merges fragment 1
    finally:
        again.stop()
    running.stop = lambda: None  # stopped above


@pytest.mark.slow
def test_refused_and_rejected_fragment_pushes_are_trained_again_and_counted_once(tmp_path):
    """With outer.fragments = 2, a NaN push (refused as it decodes) and a poisoned one (rejected by the norm
    screen): each island trains its range again from the cursor and the run ends with every token merged once.
    The poisoned island's next push is refused while it is throttled: it waits the backoff out (no rewind for
    that refusal) and sends the same push again.

    With the default direction screen: this run's honest pushes late in the run are all but orthogonal to the
    outer momentum (cosines of -0.007 and -0.025 seen), which a floor of 0 for an island on probation rejected
    (quarantining the poisoned island, depending on timing); coordinator.probation_min_cosine (-0.15) lets them
    through."""
    from dtrain.runlog import read_events
    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate import run_simulation

    cfg = load_config("tiny", [f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40",
                               "outer.inner_steps=10", "outer.fragments=2", "worker.heartbeat_s=0.5",
                               "coordinator.grace_s=60"])
    faults = [parse_fault("nan:island-1@v3", 2), parse_fault("poison:island-0@v5", 2)]
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=600,
                       faults=faults)
    assert s["bit_identical_final_params"]
    audit = s["audit"]
    assert audit["lost_tokens"] == audit["doubled_tokens"] == 0 and audit["gaps"] == audit["overlaps"] == []
    assert audit["coverage"] == {"0": [[0, 320]], "1": [[0, 320]]}
    by_kind = {f["kind"]: f for f in s["faults"]}
    assert by_kind["nan"]["detected_by"] == "push_refused" and not by_kind["nan"]["merged"]
    assert by_kind["poison"]["detected_by"] == "push_quarantined" and not by_kind["poison"]["merged"]
    assert all("rewound" in f["recovery"] for f in s["faults"])
    # each rewind went back to the end of an accepted push and kept the progress no push had carried yet
    rewinds = [e for n in ("island-0", "island-1") for e in read_events(tmp_path / "tiny" / "islands" / n)
               if e["event"] == "rewound"]
    assert rewinds and all(e.get("kept_unsent") for e in rewinds)
    # a throttled push is waited for, not rewound: each rewind answers a push the coordinator judged or refused
    # for good, and each throttled wait is one refusal on the coordinator's side, not a stream of them
    assert not [e for e in rewinds if "throttled" in e["reason"]]
    waits = [e for n in ("island-0", "island-1") for e in read_events(tmp_path / "tiny" / "islands" / n)
             if e["event"] == "push_throttled"]
    throttled = [e for e in read_events(tmp_path / "tiny") if e["event"] == "push_refused" and "retry_after_s" in e]
    assert len(throttled) == len(waits) <= 2 and all(e["wait_s"] > 0 for e in waits)


def test_the_norm_screen_compares_a_push_with_its_own_fragments_norms():
    """Fragments' pseudo-gradients differ in norm (their sizes and what they hold): each fragment has its own
    window of merged norms, so a push is not screened against another fragment's."""
    from coordinator.ledger import PushLedger
    from coordinator.records import Admission, PendingPush, PushInfo, StateOptions

    opts = StateOptions.from_config(load_config("tiny", ["outer.islands=2", "outer.fragments=2"]))
    ledger = PushLedger(opts)
    for version, norm in ((1, 10.0), (2, 0.1), (3, 12.0), (4, 0.2)):
        ledger.pending.add(PendingPush(PushInfo(f"p{version}", "a", version - 1, 320, 5, 0, 40, 0),
                                       Admission("accept", 320.0, 0, version, "", norm=norm), 0.0))
        ledger.merge_round(version)
    assert list(ledger.norms) == [10.0, 0.1, 12.0, 0.2]  # the checkpointed window: all of them
    assert list(ledger.norm_window(5)) == [10.0, 12.0] and list(ledger.norm_window(6)) == [0.1, 0.2]
    one = PushLedger(StateOptions.from_config(load_config("tiny", ["outer.islands=2"])))
    assert one.norm_window(5) is one.norms and one.fragment_norms[0] is not one.norms
