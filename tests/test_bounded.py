"""Bounded records (issue 22, item 4): a flood of refused calls costs a few events and an exact count, lost islands'
records are forgotten after coordinator.forget_after_s so Status stays small, and a worker facing a malformed
reply prints one line."""

from __future__ import annotations

import grpc
import pytest

from coordinator.refusals import RefusalLog
from coordinator.service import CURRENT_CALL
from dtrain.config import replace
from dtrain.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from service_helpers import Running, join_island
from workers.client import CoordinatorClient


class _Aborted(Exception):
    pass


class _Context:
    """What a refused call's handler touches of grpc.ServicerContext."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)

    def set_trailing_metadata(self, md) -> None:
        pass


def test_refusal_log_counts_every_refusal_and_logs_a_bounded_number():
    log = RefusalLog(per_window=3, window_s=60.0)
    decisions = [log.refused("Join: FAILED_PRECONDITION", t * 0.001) for t in range(1000)]
    assert sum(logged for logged, _ in decisions) == 3 and log.counts["Join: FAILED_PRECONDITION"] == 1000
    assert all(not over for _, over in decisions)
    logged, over = log.refused("Heartbeat: NOT_FOUND", 61.0)  # the Join window is over: its 997 are reported
    assert logged and over == [("Join: FAILED_PRECONDITION", 997)]
    assert log.refused("Join: FAILED_PRECONDITION", 62.0) == (True, [])  # a new window
    assert log.due() == []  # nothing held back in the open windows
    with pytest.raises(ValueError):
        RefusalLog(0)


def test_a_flood_of_refused_joins_is_counted_exactly_in_a_bounded_number_of_events(net_cfg, tmp_path):
    """5,000 Joins refused (every shard held) used to write 5,000 events (1.47 MB); now at most
    coordinator.refusal_events a minute, plus one summary, and Status counts all of them."""
    running = Running(net_cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, net_cfg)
    try:
        join_island(client, "a"), join_island(client, "b")  # both shards held
        with pytest.raises(Exception, match="FAILED_PRECONDITION"):
            join_island(client, "flood-real")  # one through gRPC: the real path counts it too
        service, fields = running.service, net_cfg.fingerprint_fields()
        CURRENT_CALL.method = "/dtrain.v1.Coordinator/Join"
        for i in range(5000):
            request = pb.JoinRequest(island=f"flood-{i}", hardware="cpu", devices=1, fingerprint_fields=fields)
            with pytest.raises(_Aborted):
                service.Join(request, _Context())  # type: ignore[arg-type]
        CURRENT_CALL.method = ""
        status = client.status()
        assert status.refusals["Join: FAILED_PRECONDITION"] == 5001
        assert len(status.SerializeToString()) < 16_000
    finally:
        client.close()
        running.stop()
    events = read_events(tmp_path / "coord")
    refused = [e for e in events if e["event"] == "request_rejected" or e["event"] == "request_invalid"]
    assert len(refused) <= net_cfg.coordinator.refusal_events
    summary = [e for e in events if e["event"] == "refusals_suppressed"]
    assert sum(e["count"] for e in summary) + len(refused) == 5001
    assert (tmp_path / "coord" / "events.jsonl").stat().st_size < 100_000


def test_refused_pushes_are_counted_in_full(net_cfg, tmp_path):
    """A refused push is counted in pushes_refused and by kind even when its events are held back."""
    cfg = replace(net_cfg, coordinator={"refusal_events": 2})
    running = Running(cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, cfg)
    try:
        join = join_island(client, "a")
        header = pb.PushHeader(push_id="p", island_id="nobody", base_version=0, tokens=1, inner_steps=1,
                               cursor_start=0, cursor_end=1, tree_digest=join.tree_digest, shard_index=0)
        for _ in range(6):
            with pytest.raises(Exception, match="NOT_FOUND"):
                client.push(header, b"")
        status = client.status()
        assert status.pushes_refused == 6 and status.refusals["PushDelta: NOT_FOUND"] == 6
    finally:
        client.close()
        running.stop()
    events = read_events(tmp_path / "coord")
    assert len([e for e in events if e["event"] == "push_refused"]) == 2
    assert [e["count"] for e in events if e["event"] == "refusals_suppressed"] == [4]
