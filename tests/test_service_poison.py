"""Deltas cannot poison θ, over the wire: a real coordinator on 127.0.0.1:0 refuses, quarantines, throttles or
screens out bad pushes (inflated tokens, huge or reversed deltas, non-finite values) and its run goes on."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from coordinator import admission
from coordinator.records import PushInfo
from dtrain import codec
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from service_helpers import (
    Running,
    assert_unchanged,
    delta_frame,
    frame_messages,
    join_island,
    push_header,
    raw_push,
    snapshot,
)
from workers.client import CoordinatorClient, CoordinatorError

# -- deltas cannot poison θ, over the wire ---------------------------------------------------------------------


def _poison_frame(n: int) -> bytes:
    """The issue's poisoned delta: an int8 frame of 3e38 values (valid: every scale and code is in range)."""
    return codec.encode(codec.quantize(np.full(n, 3e38, np.float32), 8, 1024))


def test_a_poisoned_push_with_inflated_tokens_is_refused_and_theta_stays_finite(coordinator, net_cfg, tmp_path,
                                                                                two_islands):
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    before = snapshot(coordinator.service)
    with pytest.raises(grpc.RpcError) as e:  # cursor range [0, 80) holds 80 x seq_len 32 = 2560 tokens
        raw_push(coordinator.address, frame_messages(j0, _poison_frame(n), "poison", tokens=10 ** 9))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens=1000000000 exceed its cursor range [0, 80) = 80 sequences x seq_len 32 = 2560 tokens" in \
        e.value.details()
    assert_unchanged(before, coordinator.service)
    assert coordinator.service.counters.pushes_refused == 1
    # The round goes on with honest pushes: θ moves by them alone and stays finite.
    d0, f0 = delta_frame(n, 40)
    d1, f1 = delta_frame(n, 41)
    assert c0.push(push_header(j0, "a1"), f0).status == pb.PUSH_STATUS_PENDING
    assert c1.push(push_header(j1, "b1"), f1).status == pb.PUSH_STATUS_MERGED
    theta = coordinator.service.merger.theta
    assert np.isfinite(theta).all() and np.abs(theta - coordinator.theta).max() < 0.01
    events = read_events(tmp_path / "coord")
    refused = [ev for ev in events if ev["event"] == "push_refused"]
    assert len(refused) == 1 and refused[0]["push_id"] == "poison" and "tokens=1000000000" in refused[0]["reason"]


def test_a_poisoned_push_with_honest_tokens_is_quarantined_and_the_round_goes_on(coordinator, net_cfg, tmp_path,
                                                                                 two_islands):
    """Its norm is far over coordinator.norm_max_ratio x ||θ||: rejected in the first round already; the island is
    told in the push reply and its heartbeats; the round does not wait for it."""
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    r = c0.push(push_header(j0, "poison"), _poison_frame(n))
    assert r.status == pb.PUSH_STATUS_REJECTED and r.reason.startswith("quarantined: push poison has L2 norm")
    assert "more than norm_max_ratio 10 x the L2 norm of θ" in r.reason
    hb = c0.heartbeat(island_id=j0.island_id, version=0)
    assert "your push poison was rejected: quarantined" in hb.reason
    assert c1.push(push_header(j1, "b1"), delta_frame(n, 42)[1]).status == pb.PUSH_STATUS_MERGED
    service = coordinator.service
    assert service.state.version == 1 and service.state.deltas_rejected == 1 and service.state.tokens_merged == 640
    assert np.isfinite(service.merger.theta).all() and np.abs(service.merger.theta - coordinator.theta).max() < 0.01
    assert [ev["push_id"] for ev in read_events(tmp_path / "coord") if ev["event"] == "push_quarantined"] == \
        ["poison"]


def test_a_lone_first_push_of_9_5_theta_moves_theta_no_further_than_an_honest_one_could(net_cfg, tmp_path):
    """The issue's attack: the first island to join pushes 9.5 x ||θ|| (under norm_max_ratio's 10 x) before any
    other has pushed (async: merged on its own, no merged norm to check it against). It is clipped to the honest
    ceiling, so the real merger's outer step moves θ at most outer.lr x (1 + momentum) x that ceiling (Nesterov's
    first step), not to ||θ|| 10.3 -> 131 as before."""
    cfg = replace(net_cfg, coordinator={"mode": "async"}, outer={"islands": 4})
    running = Running(cfg, tmp_path / "coord")
    try:
        client = CoordinatorClient(running.address, cfg)
        join = join_island(client, "first")
        theta0 = running.theta.astype(np.float64)
        delta = (9.5 * np.linalg.norm(theta0) / np.sqrt(theta0.size)) * np.where(
            np.random.default_rng(3).random(theta0.size) < 0.5, -1.0, 1.0).astype(np.float32)
        r = client.push(push_header(join, "lone"), codec.encode(codec.quantize(delta, 8, cfg.codec.block)))
        assert r.status == pb.PUSH_STATUS_MERGED and "clipped to the honest ceiling" in r.reason
        service = running.service
        ceiling = admission.honest_ceiling(service.opts, PushInfo(
            "lone", join.island_id, 0, 640, 10, 0, 80, join.shard_index), float(np.linalg.norm(theta0)))
        moved = np.linalg.norm(service.merger.theta.astype(np.float64) - theta0)
        assert 0 < moved <= cfg.outer.lr * (1 + cfg.outer.momentum) * ceiling * 1.001
        assert np.linalg.norm(service.merger.theta) < 4 * np.linalg.norm(theta0)  # was 12.7 x
        (received,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "push_received"]
        assert "unchecked" in received["reason"]
        client.close()
    finally:
        running.stop()


def test_a_throttled_push_says_how_long_and_the_island_sends_it_again_once_the_backoff_is_over(net_cfg, tmp_path,
                                                                                                two_islands):
    """After a rejected push its island's next push is refused before its payload streams in, with the seconds
    of backoff left in the refusal's trailing metadata (the client's CoordinatorError.retry_after_s, not the
    message's words). The island's exchange waits them out and sends the same push once more, which the
    coordinator then judges and merges: one refusal per push, every token merged once. The coordinator's clock
    is the test's, and the exchange's waits move it: what is counted is pushes and events, not time."""
    from workers.exchange import Exchange, GlobalParams, Puller

    now = [1000.0]
    running = Running(net_cfg, tmp_path / "coord", clock=lambda: now[0])
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, net_cfg)
        n = j0.tree_size
        assert c0.push(push_header(j0, "poison"), _poison_frame(n)).status == pb.PUSH_STATUS_REJECTED
        now[0] += 0.25  # of coordinator.reject_backoff_s 1
        with pytest.raises(CoordinatorError) as refused:
            c0.push(push_header(j0, "a0"), delta_frame(n, 40)[1])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and refused.value.retry_after_s == 0.75

        waits: list[float | None] = []

        class CoordinatorTime(threading.Event):  # the exchange's stop event: its waits pass the coordinator's time
            def wait(self, timeout: float | None = None) -> bool:
                waits.append(timeout)
                now[0] += timeout or 0.0
                return False

        island_events: list[tuple[str, dict]] = []
        ex = Exchange(c0, Puller(c0, n, 1 << 24, lambda kind, **f: island_events.append((kind, f))), delta_frame(
                          n, 41)[1], push_header(j0, "a1"), GlobalParams(running.theta.copy(), 0), 0,
                      CoordinatorTime(), lambda kind, **f: island_events.append((kind, f)))
        future = ex.start()
        for _ in range(300):  # the resent push is pending in the round: the other island's push completes it
            if ex.response is not None:
                break
            time.sleep(0.1)
        assert ex.response is not None and ex.response.status == pb.PUSH_STATUS_PENDING
        assert c1.push(push_header(j1, "b1"), delta_frame(n, 42)[1]).status == pb.PUSH_STATUS_MERGED
        assert future.result(timeout=30).version == 1
        assert waits == [0.75]  # sent again only once the backoff was over, and judged then
        assert [k for k, _ in island_events] == ["push_throttled", "push_sent"]
        assert island_events[0][1]["wait_s"] == 0.75 and island_events[0][1]["push_id"] == "a1"
        service = running.service
        assert service.state.version == 1 and service.state.tokens_merged == 1280
        assert service.state.deltas_rejected == 1 and service.counters.pushes_refused == 2
        events = read_events(tmp_path / "coord")
        assert [(e["push_id"], e.get("retry_after_s")) for e in events if e["event"] == "push_refused"] == \
            [("a0", 0.75), ("a1", 0.75)]
        assert [e["status"] for e in events if e["event"] == "push_received" and e["push_id"] == "a1"] == ["accept"]
    finally:
        running.stop()


def test_a_reversed_push_in_a_round_of_four_is_rejected_by_the_direction_screen(net_cfg, tmp_path):
    """The default merge (auto: screened_mean) over the wire: three islands push correlated honest deltas, the
    fourth −1 x one (within every norm bound). When the round closes its cosine with the round's coordinate median
    is negative: rejected (push_quarantined by the round screen, its island told why), and θ moves by the mean of
    the honest three; the merged pushes' cosines are in round_merged."""
    cfg = replace(net_cfg, outer={"islands": 4, "lr": 1.0, "momentum": 0.0}, codec={"down": "fp32"})
    running = Running(cfg, tmp_path / "coord")
    clients = [CoordinatorClient(running.address, cfg) for _ in range(4)]
    try:
        joins = [join_island(c, name) for c, name in zip(clients, "abcd", strict=True)]
        n = joins[0].tree_size
        rng = np.random.default_rng(60)
        common = rng.normal(size=n).astype(np.float32) * 1e-3
        deltas = [common + rng.normal(size=n).astype(np.float32) * 5e-4 for _ in range(3)]
        deltas.append(-1.0 * deltas[0])
        for i, (c, j, d) in enumerate(zip(clients, joins, deltas, strict=True)):
            c.push(push_header(j, f"p{i}"), codec.encode(codec.quantize(d, 8, 1024)))
        service = running.service
        assert service.state.version == 1 and service.state.deltas_rejected == 1
        events = read_events(tmp_path / "coord")
        (quarantined,) = [e for e in events if e["event"] == "push_quarantined"]
        assert quarantined["push_id"] == "p3" and quarantined["by"] == "round_screen"
        assert "points away from the others: cosine -" in quarantined["reason"]
        assert "with the coordinate median of the 4 pushes of its round" in quarantined["reason"]
        assert "your push p3 was rejected: quarantined" in clients[3].heartbeat(island_id=joins[3].island_id,
                                                                                version=1).reason
        (merged,) = [e for e in events if e["event"] == "round_merged"]
        assert sorted(p["push_id"] for p in merged["pushes"]) == ["p0", "p1", "p2"]
        assert all(p["cosine"] > 0.5 for p in merged["pushes"])
        honest = np.mean([codec.dequantize(codec.quantize(d, 8, 1024)) for d in deltas[:3]], axis=0)
        np.testing.assert_allclose(running.theta - service.merger.theta, honest, atol=1e-6)
    finally:
        for c in clients:
            c.close()
        running.stop()


def test_a_merge_that_would_be_non_finite_is_not_committed_and_the_run_goes_on(net_cfg, tmp_path, two_islands):
    """With the norm screens off and the mean merge (the last guard is the one under test), the poisoned push is
    accepted (with the most tokens its range allows: 2560); the outer step (lr 1) finds its update non-finite
    (-(Δ + 0.9·m) = -1.9 x 0.8 x 3e38), commits nothing, rejects the push (the largest) and merges the round
    without it. Not fatal."""
    cfg = replace(net_cfg, coordinator={"norm_max_ratio": 0.0, "norm_z_max": 0.0, "round_norm_ratio": 0.0,
                                        "merge_rule": "mean"}, outer={"lr": 1.0})
    running = Running(cfg, tmp_path / "coord")
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, cfg)
        n = j0.tree_size
        d1, f1 = delta_frame(n, 43)
        assert c1.push(push_header(j1, "b1"), f1).status == pb.PUSH_STATUS_PENDING
        r = c0.push(push_header(j0, "poison", tokens=2560), _poison_frame(n))  # completes the round: rejected
        assert r.status == pb.PUSH_STATUS_REJECTED and "the outer step for version 1 makes update[" in r.reason
        assert "blamed: push poison" in r.reason and r.version == 1
        service = running.service
        assert service.loop.fatal is None and service.state.version == 1 and service.state.deltas_rejected == 1
        assert service.state.tokens_merged == 640 and np.isfinite(service.merger.theta).all()
        assert "your push poison was rejected" in c0.heartbeat(island_id=j0.island_id, version=1).reason
        assert list((tmp_path / "coord" / "spool" / "state").glob("*.tmp")) == []
        events = read_events(tmp_path / "coord")
        assert [ev["push_id"] for ev in events if ev["event"] == "merge_rejected"] == ["poison"]
        merged = [ev for ev in events if ev["event"] == "round_merged"]
        assert len(merged) == 1 and [p["push_id"] for p in merged[0]["pushes"]] == ["b1"]
    finally:
        running.stop()


@pytest.mark.parametrize("up,bad", [("fp32", np.nan), ("fp32", np.inf), ("int8", np.nan), ("int4", np.inf),
                                    ("e3m0", np.nan)])
def test_a_nan_or_inf_delta_is_refused_at_validation_in_every_codec(net_cfg, tmp_path, up, bad):
    cfg = replace(net_cfg, codec={"up": up})
    running = Running(cfg, tmp_path / "coord")
    try:
        client = CoordinatorClient(running.address, cfg)
        join = join_island(client, "a")
        n, bits = join.tree_size, codec.CODEC_BITS[up]
        q = codec.quantize(np.ones(n, np.float32), bits, 1024)
        if bits == 32:  # the value itself
            payload = q.payload.copy().view("<f4")
            payload[5] = bad
            q = codec.QuantizedVec(bits, q.block, n, q.scales, payload.view(np.uint8))
        else:  # a block's scale (quantized codes are always finite)
            scales = q.scales.copy()
            scales[1] = bad
            q = codec.QuantizedVec(bits, q.block, n, scales, q.payload)
        before = snapshot(running.service)
        with pytest.raises(grpc.RpcError) as e:
            raw_push(running.address, frame_messages(join, codec.encode(q), "nan"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        want = "non-finite value at index 5" if bits == 32 else f"invalid scale {np.float32(bad)!r} for block 1"
        assert "push nan: bad frame" in e.value.details() and want in e.value.details(), e.value.details()
        assert_unchanged(before, running.service)
        client.close()
    finally:
        running.stop()
