"""A coordinator that idle streams cannot starve (issue 22, item 1), through a real server on 127.0.0.1:0: with
every data thread held by PushDelta streams that send nothing, heartbeats and Status are still answered and no
island is lost; an idle push is cancelled after coordinator.stream_idle_s; a peer or an island over its stream
limit is refused RESOURCE_EXHAUSTED (marked busy), and a worker's client retries that."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from coordinator.handlers import server_threads
from coordinator.streams import PushStreams, Stream
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import BUSY_METADATA_KEY, chunk_message
from dtrain.runlog import read_events
from service_helpers import IdlePushes, Running, call_failure, delta_frame, join_island, push_header, wait_for
from workers.client import CoordinatorClient, CoordinatorError

TOKEN = "a-valid-token-0123456789abcdef"


def _header(client: CoordinatorClient, join: pb.JoinResponse, push_id: str) -> pb.PushHeader:
    """A push header for a real frame of the model (its size, CRC and chunk count filled in)."""
    header = push_header(join, push_id)
    client._chunked(header, delta_frame(join.tree_size, 1)[1])
    return header


def _first_chunk(client: CoordinatorClient, join: pb.JoinResponse, header: pb.PushHeader) -> tuple[bytes, ...]:
    """The first chunk message of the frame ``header`` was made for (:func:`_header`)."""
    chunks = client._chunked(pb.PushHeader(), delta_frame(join.tree_size, 1)[1])
    return (chunk_message(0, *chunks[0]),)


def test_200_idle_pushes_with_a_valid_token_do_not_starve_heartbeats_or_status(net_cfg, tmp_path, monkeypatch):
    """On the old server (one thread pool, maximum_concurrent_rpcs = 4 x threads) these heartbeats waited 10 s
    or were refused RESOURCE_EXHAUSTED, and the island was declared lost. Here all 200 streams are let in (the
    per-peer limit raised), far more than the data threads (server_threads): each waits on its client as a
    coroutine of the server's event loop, holding none (coordinator/data_plane.py)."""
    monkeypatch.setenv("DTRAIN_TOKEN", TOKEN)
    cfg = replace(net_cfg, coordinator={"lease_s": 2.0, "max_streams_per_peer": 1000, "stream_idle_s": 60.0,
                                        "checkpoint": False},
                  worker={"heartbeat_s": 0.5})
    running = Running(cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, cfg)
    idle = IdlePushes(running.address, token=TOKEN)
    try:
        island = join_island(client, "real").island_id
        idle.open(200)
        held = 200
        assert held > server_threads(cfg)
        wait_for(lambda: running.service.push_streams.counts()[0] == held, f"{held} idle streams open at once")
        beats, end = 0, time.monotonic() + 2 * cfg.coordinator.lease_s  # two leases' worth, one try each
        while time.monotonic() < end:
            reply = client.heartbeat(0, island_id=island, version=0)  # one try, HEARTBEAT_DEADLINE_S
            assert reply.action == pb.ACTION_CONTINUE
            beats += 1
            time.sleep(cfg.worker.heartbeat_s)
        status = client.status(0)
        assert [i.state for i in status.islands if i.island_id == island] == ["live"]
        assert running.service.push_streams.counts()[0] == held  # the streams were open all along
        assert not any(c.done() for c in idle.calls)
        assert beats >= 6
    finally:
        idle.close()
        client.close()
        running.stop()
    assert not [e for e in read_events(tmp_path / "coord") if e["event"] == "island_lost"]


def test_an_idle_push_is_cancelled_after_stream_idle_s_and_a_slow_one_is_not(net_cfg, tmp_path):
    cfg = replace(net_cfg, coordinator={"stream_idle_s": 0.5, "checkpoint": False})
    running = Running(cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, cfg)
    idle = IdlePushes(running.address, token=None)
    try:
        join = join_island(client, "a")
        no_header = idle.open()[0]
        after_header = idle.open(header=_header(client, join, "idle-after-header"))[0]
        for call in (no_header, after_header):
            assert call_failure(call).code() == grpc.StatusCode.CANCELLED
        wait_for(lambda: running.service.push_streams.counts()[0] == 0, "the cancelled streams to end")
        # A push whose messages come 0.3 s apart is never idle for 0.5 s, though it lasts longer than that.
        _, frame = delta_frame(running.service.merger.n, 1)
        header = push_header(join, "slow")
        chunks = client._chunked(header, frame)

        def slow() -> Iterator[pb.PushMessage | bytes]:
            for i, message in enumerate(client._messages(header, chunks)):
                if i < 3:
                    time.sleep(0.3)
                yield message

        reply = client._push_delta(slow(), timeout=30)
        assert reply.status in (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED)
        status = client.status()
        assert status.refusals["PushDelta: CANCELLED"] == 2
    finally:
        idle.close()
        client.close()
        running.stop()
    cancelled = [e for e in read_events(tmp_path / "coord") if e["event"] == "request_rejected"]
    assert [e["code"] for e in cancelled] == ["CANCELLED", "CANCELLED"]
    assert sorted(e["island"] for e in cancelled) == ["", "a"]  # the island's name (its id in island_id)
    assert [e.get("island_id") for e in cancelled if e["island"]] == [join.island_id]
    assert all("coordinator.stream_idle_s=0.5" in e["error"] for e in cancelled)


def test_a_peer_or_an_island_over_its_stream_limit_is_refused_resource_exhausted(net_cfg, tmp_path):
    cfg = replace(net_cfg, coordinator={"max_streams_per_peer": 3, "max_streams_per_island": 1, "checkpoint": False})
    running = Running(cfg, tmp_path / "coord")
    client = CoordinatorClient(running.address, cfg)
    idle = IdlePushes(running.address, token=None)
    try:
        join = join_island(client, "a")
        # An island's stream is counted for it once its data arrives: a header alone holds no slot.
        idle.open(header=_header(client, join, "header-only"))
        idle.open(header=(held := _header(client, join, "held")), first=_first_chunk(client, join, held))
        wait_for(lambda: running.service.push_streams.counts()[2] == {join.island_id: 1}, "the island's stream")
        second = _header(client, join, "second")
        island_over = call_failure(idle.open(header=second, first=_first_chunk(client, join, second))[0])
        assert island_over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "coordinator.max_streams_per_island=1" in island_over.details()
        assert (BUSY_METADATA_KEY, "1") in tuple(island_over.trailing_metadata())
        idle.open(1)
        wait_for(lambda: running.service.push_streams.counts()[0] == 3, "three streams from this peer")
        peer_over = call_failure(idle.open()[0])
        assert peer_over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "127.0.0.1 already holds 3 push streams" in peer_over.details()
        assert "coordinator.max_streams_per_peer=3" in peer_over.details()
        assert client.heartbeat(0, island_id=join.island_id, version=0).action == pb.ACTION_CONTINUE
        assert client.status().refusals["PushDelta: RESOURCE_EXHAUSTED"] == 2
    finally:
        idle.close()
        client.close()
        running.stop()


def test_a_worker_retries_a_busy_refusal_until_the_stream_is_free(net_cfg, tmp_path):
    """The peer's one stream is held by an idle push; the worker's push is refused busy, says what it waits for,
    retries with backoff and goes through once the idle stream is cancelled (stream_idle_s)."""
    cfg = replace(net_cfg, coordinator={"max_streams_per_peer": 1, "stream_idle_s": 1.0, "checkpoint": False},
                  worker={"retry_total_s": 30.0, "retry_initial_s": 0.1, "retry_max_s": 0.5})
    running = Running(cfg, tmp_path / "coord")
    said: list[str] = []
    client = CoordinatorClient(running.address, cfg, on_retry=lambda what, pause, left: said.append(what))
    idle = IdlePushes(running.address, token=None)
    try:
        join = join_island(client, "a")
        held = idle.open()[0]
        wait_for(lambda: running.service.push_streams.counts()[0] == 1, "the idle stream")
        _, frame = delta_frame(running.service.merger.n, 1)
        reply = client.push(push_header(join, "p1"), frame)
        assert reply.status in (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED)
        assert call_failure(held).code() == grpc.StatusCode.CANCELLED
        assert said and all("is busy (RESOURCE_EXHAUSTED" in w and "waiting for it to take the call" in w
                            for w in said)
        # A RESOURCE_EXHAUSTED for what the call asked (a frame over the bound) is not retried.
        retries = client.retries
        huge = push_header(join, "huge")
        huge.total_bytes, huge.chunks = 1 << 40, 1
        with pytest.raises(CoordinatorError, match="RESOURCE_EXHAUSTED"):
            client._retry("push", lambda: client._push_delta(iter([pb.PushMessage(header=huge)]), timeout=10))
        assert client.retries == retries
    finally:
        idle.close()
        client.close()
        running.stop()


class _Cancellable:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_push_streams_count_peers_and_islands_and_reap_only_streams_waiting_on_their_client(net_cfg):
    """coordinator/streams.py on its own, with an injected clock: limits, uncounting, idle time."""
    now = [100.0]
    cfg = replace(net_cfg, coordinator={"max_streams_per_peer": 2, "max_streams_per_island": 1, "stream_idle_s": 5.0})
    table = PushStreams(cfg, on_cancel=lambda stream, why: None, clock=lambda: now[0])
    a, b = _Cancellable(), _Cancellable()
    first, second = table.open("10.0.0.1", a.cancel), table.open("10.0.0.1", b.cancel)
    assert isinstance(first, Stream) and isinstance(second, Stream)
    assert "max_streams_per_peer=2" in str(table.open("10.0.0.1", _Cancellable().cancel))
    assert isinstance(table.open("10.0.0.2", _Cancellable().cancel), Stream)  # another host
    assert table.claim(first, "a-0") == "" and "max_streams_per_island=1" in table.claim(second, "a-0")
    waiting = table.watched(first, iter([1]), size=lambda _: 0)
    assert next(waiting) == 1  # a message came at once: not waiting now
    now[0] += 60
    assert table.reap() == []  # second never waited on its client; first is between messages (the server's time)
    blocked = threading.Event()

    def block() -> Iterator[int]:
        blocked.wait(10)
        yield 2

    reader = threading.Thread(target=lambda: list(table.watched(second, block(), size=lambda _: 0)))
    reader.start()
    wait_for(lambda: second.waiting_since is not None, "the wait to be marked")
    now[0] += 5.0
    assert table.reap() == []  # exactly stream_idle_s: not over it
    now[0] += 0.1
    ((reaped, why),) = table.reap()
    assert reaped is second and "5.1s waiting for its header" in why and b.cancelled and not a.cancelled
    assert table.reap() == []  # cancelled once
    blocked.set()
    reader.join()
    table.close(first), table.close(second), table.close(second)  # a second close changes nothing
    assert table.counts() == (1, {"10.0.0.2": 1}, {})


def test_push_streams_cancel_a_trickle_below_the_minimum_rate_and_a_stream_past_its_deadline(net_cfg):
    """With an injected clock: after its header a stream must keep coordinator.stream_min_bytes_per_s on average
    once it has waited stream_rate_grace_s on its client; a 1-byte message does not reset the idle clock, a chunk
    at the rate does; time between messages (the coordinator's) counts for neither; stream_deadline_s bounds a
    stream however fast it is."""
    now = [0.0]
    cfg = replace(net_cfg, coordinator={"stream_idle_s": 30.0, "stream_min_bytes_per_s": 1000.0,
                                        "stream_rate_grace_s": 5.0, "stream_deadline_s": 100.0})
    table = PushStreams(cfg, on_cancel=lambda stream, why: None, clock=lambda: now[0])
    gaps: dict[int, list[tuple[float, int]]] = {}  # per stream: (client's wait before the message, its bytes)

    def fed(stream: Stream, key: int) -> Iterator[int]:
        for wait, n in gaps[key]:
            now[0] += wait
            yield n

    def feed(stream: Stream, key: int, plan: list[tuple[float, int]], to_the_end: bool = False) -> None:
        gaps[key] = plan
        messages = table.watched(stream, fed(stream, key), size=lambda n: n)
        for _ in plan:  # each message, and no further: the stream stays open, between messages
            next(messages)
        if to_the_end:
            assert next(messages, None) is None  # the client half-closed

    trickle, fast, slow_start = (table.open("10.0.0.1", _Cancellable().cancel) for _ in range(3))
    assert isinstance(trickle, Stream) and isinstance(fast, Stream) and isinstance(slow_start, Stream)
    feed(trickle, 0, [(0.0, 0), (4.0, 1), (4.0, 1)])  # header, then 1 byte every 4 s: 2 bytes in 8 s
    assert trickle.quiet_s == 8.0 and trickle.quiet_bytes == 2  # neither byte reset the idle clock
    feed(fast, 1, [(0.0, 0), (1.0, 4096), (1.0, 4096)])  # header, then 4 KiB a second
    assert fast.quiet_s == 0.0 and fast.received == 8192  # each chunk kept the rate: reset
    feed(slow_start, 2, [(0.0, 0), (3.0, 100)])  # 100 bytes in 3 s: below the rate, within the grace
    now[0] += 50.0  # the coordinator's time (decoding, a merge): the client's record does not move
    reaped = dict(table.reap())
    assert set(reaped) == {trickle}, reaped  # 2 bytes in 8 s of the client's: 0 bytes/s, after the 5 s grace
    assert "below coordinator.stream_min_bytes_per_s=1000" in reaped[trickle]
    assert "after stream_rate_grace_s=5" in reaped[trickle]
    now[0] += 50.0  # 101 s after they opened: still receiving, past stream_deadline_s
    reaped = dict(table.reap())
    assert set(reaped) == {fast, slow_start} and "stream_deadline_s=100" in reaped[fast]
    done = table.open("10.0.0.1", _Cancellable().cancel)
    assert isinstance(done, Stream)
    feed(done, 3, [(0.0, 0), (0.1, 10 ** 6)], to_the_end=True)
    assert done.done  # half-closed: what is left is the coordinator's, never cancelled
    now[0] += 1000.0
    assert table.reap() == []
