"""Bounded records (issue 22, item 4): a flood of refused calls costs a few events and an exact count, lost islands'
records are forgotten after coordinator.forget_after_s so Status stays small, and a worker facing a malformed
reply prints one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import TINY
from coordinator.handlers import CURRENT_CALL
from coordinator.refusals import RefusalLog
from coordinator.state import CoordinatorState
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import read_events
from service_helpers import Running, join_island
from state_helpers import T0, info, join_all, make, push
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


def _churn(st, count: int, now: float) -> float:
    """``count`` islands join in turn on the one free shard, push and merge a range of it, and are lost, while
    a-0, b-1 and c-2 stay live; the last one is lost with its push still pending. Returns the time."""
    lease = st.opts.coordinator.lease_s
    for i in range(count):
        record, _ = st.join(f"x{i}", "cpu", 1, now)
        assert record.shard_index == 3
        push(st, info(st, record.island_id, base=st.version), now)
        if i < count - 1:
            st.close_round(now)
        now += lease + 1
        for island in ("a-0", "b-1", "c-2"):
            st.heartbeat(island, st.version, 0, 0, 0.0, "", (), now - 1)
        assert [i for i, _ in st.expire(now)] == [record.island_id]
        st.forget(now)
    return now


def test_lost_islands_are_forgotten_after_forget_after_s_and_the_shards_stay_right():
    """1,547 lost islands used to stay in Status (a 674 KB /api/status); now a lost island's record goes
    coordinator.forget_after_s after its lease ended, and the data bookkeeping (cursors, merges) is unchanged."""
    st = make("coordinator.mode=async", "coordinator.forget_after_s=100")
    join_all(st, ("a", "b", "c"))
    now = _churn(st, 3000, T0)
    assert st.shard_cursor(3) == 3000 * 40 and st.version == 2999  # the last push pends
    kept = st.islands.keys() - {"a-0", "b-1", "c-2"}
    assert kept and len(kept) <= 100 // (st.opts.coordinator.lease_s + 1) + 2, sorted(kept)
    assert "x2999-3" in kept  # lost with a push pending: kept until it is merged
    doc = json.dumps(st.status(now))
    assert len(doc) < 20_000, len(doc)
    st.close_round(now)  # the pending push merges into its (lost) island's record
    assert st.islands["x2999-3"].pushes_merged == 1 and st.shard_cursor(3) == 3000 * 40
    now += 1000
    assert st.next_deadline(now) is not None
    gone = st.forget(now)
    assert "x2999-3" in {r.island_id for r in gone} and set(st.islands) == {"a-0", "b-1", "c-2"}
    # A checkpoint of the compacted state loads, and a forgotten name joins again on the free shard at its cursor.
    back = CoordinatorState.from_json(st.opts, json.loads(json.dumps(st.to_json())), now)
    assert back.shard_cursor(3) == 3000 * 40 and back.version == st.version
    record, reason = back.join("x7", "cpu", 1, now)
    assert record.shard_index == 3 and back.shard_cursor(3) == 3000 * 40, reason
    st0 = make("coordinator.mode=async", "coordinator.forget_after_s=0")  # 0: never
    join_all(st0, ("a", "b", "c"))
    _churn(st0, 50, T0)
    assert len(st0.islands) == 53


def test_status_lists_only_live_and_recently_lost_islands(net_cfg, tmp_path):
    """Through the real server: the ticker forgets lost islands' records on time; Status counts them and the
    event names them."""
    cfg = replace(net_cfg, coordinator={"lease_s": 0.3, "forget_after_s": 0.4}, worker={"heartbeat_s": 0.1})
    running = Running(cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, cfg)
    try:
        for name in ("a", "b", "c", "d"):
            join_island(client, name)
            time.sleep(0.35)  # its lease ends: the next one takes a free shard
        deadline = time.monotonic() + 10
        while (status := client.status()).islands and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not status.islands and status.islands_forgotten == 4
    finally:
        client.close()
        running.stop()
    events = read_events(tmp_path / "coord")
    forgotten = [i for e in events if e["event"] == "islands_forgotten" for i in e["islands"]]
    assert sorted(forgotten) == sorted(e["island"] for e in events if e["event"] == "island_joined")


_GARBAGE_CLIENT = """
import logging, sys
from concurrent import futures
import grpc
from dtrain.config.load import load_config
from workers.client import CoordinatorClient, CoordinatorError

logging.basicConfig()  # as in a worker process, where a library's handler reaches the root logger


class Garbage(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method.endswith("PullGlobal"):
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([b"\\xff\\xff\\xff\\xff garbage"]))
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"\\xff\\xff\\xff\\xff garbage")


server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((Garbage(),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
client = CoordinatorClient(f"127.0.0.1:{port}", load_config(sys.argv[1], ["worker.retry_total_s=1"]))
try:
    {call}
except CoordinatorError as e:
    print(f"dtrain worker: error: {e}", file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.parametrize("call", ['client.join("a", "cpu", 1)', 'client.heartbeat(island_id="a-0", version=0)',
                                  'client.pull("a-0", 0)'])
def test_a_malformed_reply_is_one_line_without_a_library_traceback(call, tmp_path):
    """A server whose replies do not parse used to make gRPC log its deserializer's traceback before the worker's
    own "INTERNAL: Exception deserializing response!"; now one line names the method, the address and what."""
    script = tmp_path / "garbage.py"
    script.write_text(_GARBAGE_CLIENT.replace("{call}", call))
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(script), str(TINY)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "malformed reply" in lines[0] and "INTERNAL" in lines[0] and "127.0.0.1:" in lines[0], lines[0]


def test_auth_failures_are_counted_in_status(net_cfg, tmp_path, monkeypatch):
    """A call refused for its token is counted in Status' refusals (its events are limited per peer host)."""
    monkeypatch.setenv("DTRAIN_TOKEN", "the-right-token-0123456789")
    running = Running(net_cfg, tmp_path / "coord")
    good = CoordinatorClient(running.address, net_cfg)
    monkeypatch.setenv("DTRAIN_TOKEN", "a-wrong-token-0123456789")
    bad = CoordinatorClient(running.address, net_cfg)
    try:
        for _ in range(5):
            with pytest.raises(Exception, match="UNAUTHENTICATED"):
                bad.status(budget_s=0)
        assert good.status().refusals["auth"] == 5
    finally:
        good.close(), bad.close()
        running.stop()
    assert len([e for e in read_events(tmp_path / "coord") if e["event"] == "auth_failed"]) == 2  # first + flush


def test_the_status_document_writes_refusals_as_an_object():
    """/api/status and `dtrain status --json` (dtrain.status_doc): the refusals map is a JSON object of counts."""
    from dtrain.status_doc import message_dict

    doc = message_dict(pb.StatusResponse(refusals={"Join: FAILED_PRECONDITION": 5000, "auth": 3},
                                         islands_forgotten=7))
    assert doc["refusals"] == {"Join: FAILED_PRECONDITION": 5000, "auth": 3} and doc["islands_forgotten"] == 7
    assert json.loads(json.dumps(doc)) == doc


def test_dtrain_status_prints_the_refusal_counts_when_there_are_any():
    from dtrain_cli.status import summary_lines

    assert not any(line.startswith("refused calls") for line in summary_lines(pb.StatusResponse()))
    lines = summary_lines(pb.StatusResponse(refusals={"Join: FAILED_PRECONDITION": 5000, "auth": 3},
                                            islands_forgotten=2))
    assert "refused calls: 5003 (Join: FAILED_PRECONDITION 5000, auth 3); 2 lost islands forgotten " \
           "(coordinator.forget_after_s)" in lines
