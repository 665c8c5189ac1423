"""Waiting costs no thread (issue 36, item 3), through a real server on 127.0.0.1:0: with far more long-polling pulls
and idle push streams parked than the server has data threads, a Join, heartbeats and a real push round complete,
the parked pulls all wake on the new version, and the process's thread count does not grow with the parked calls."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from coordinator.handlers import control_threads, server_threads, work_threads
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import chunk_message, method_path, serialize
from dtrain.runlog import read_events
from service_helpers import IdlePushes, Running, delta_frame, join_island, push_header, wait_for
from workers.client import CoordinatorClient

PARKED = 48  # of each kind: pulls, push streams


class Parked:
    """Long polls and idle push streams from one grpc.aio channel on an event loop of its own (one thread for all
    of them: the client side does not add threads either)."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.release = asyncio.Event()
        self.channel = self._run(self._open(address))
        self.pulls: list[asyncio.Future] = []
        self.pushes: list[asyncio.Future] = []

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _open(self, address: str) -> grpc.aio.Channel:
        self.release = asyncio.Event()
        return grpc.aio.insecure_channel(address)

    async def _pull(self, island: str) -> list[pb.PullMessage]:
        call = self.channel.unary_stream(method_path("PullGlobal"), request_serializer=serialize,
                                         response_deserializer=pb.PullMessage.FromString)
        return [m async for m in call(pb.PullRequest(island_id=island, have_version=0, wait_s=30), timeout=60)]

    async def _idle(self) -> AsyncIterator[bytes]:
        await self.release.wait()  # no message, no half-close
        return
        yield b""  # an async generator

    async def _push(self) -> None:
        call = self.channel.stream_unary(method_path("PushDelta"), request_serializer=serialize,
                                         response_deserializer=pb.PushDeltaResponse.FromString)
        try:
            await call(self._idle(), timeout=60)
        except grpc.aio.AioRpcError:
            pass

    def park(self, island: str, n: int) -> None:
        async def start() -> None:
            self.pulls = [asyncio.ensure_future(self._pull(island)) for _ in range(n)]
            self.pushes = [asyncio.ensure_future(self._push()) for _ in range(n)]
        self._run(start())

    def pulled(self) -> list[list[pb.PullMessage]]:
        async def results() -> list[list[pb.PullMessage]]:
            return list(await asyncio.gather(*self.pulls))
        return self._run(results())

    def close(self) -> None:
        async def end() -> None:
            self.release.set()
            for f in self.pulls + self.pushes:
                f.cancel()
            await self.channel.close()
        self._run(end())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_parked_pulls_and_idle_pushes_hold_no_thread_and_the_round_goes_on(net_cfg, tmp_path):
    cfg = replace(net_cfg, coordinator={"workers": 4, "max_pulls_per_peer": 4 * PARKED,
                                        "max_pulls_per_island": 2 * PARKED, "max_streams_per_peer": 4 * PARKED,
                                        "stream_idle_s": 60.0, "checkpoint": False})
    assert work_threads(cfg) == 4 and 2 * PARKED > server_threads(cfg) + control_threads(cfg)
    running = Running(cfg, tmp_path / "coord")
    a, b = CoordinatorClient(running.address, cfg), CoordinatorClient(running.address, cfg)
    parked = Parked(running.address)
    try:
        ja = join_island(a, "a")
        a.heartbeat(0, island_id=ja.island_id, version=0)
        before = threading.active_count()
        parked.park(ja.island_id, PARKED)
        wait_for(lambda: running.service.pulls.counts()[1].get(ja.island_id) == PARKED
                 and running.service.push_streams.counts()[0] == PARKED, f"{PARKED} pulls and {PARKED} pushes parked")
        # At most the data executor's threads started for their work: none per parked call.
        assert threading.active_count() <= before + server_threads(cfg), (before, threading.active_count())
        # With every one of them parked, the control plane and a real round go on.
        jb = join_island(b, "b")
        for client, join in ((a, ja), (b, jb)):
            assert client.heartbeat(0, island_id=join.island_id, version=0).action == pb.ACTION_CONTINUE
        n = ja.tree_size
        assert a.push(push_header(ja, "pa"), delta_frame(n, 1)[1]).status == pb.PUSH_STATUS_PENDING
        merged = b.push(push_header(jb, "pb"), delta_frame(n, 2)[1])
        assert merged.status == pb.PUSH_STATUS_MERGED and merged.version == 1
        # Every parked pull woke on the new version and got its update, not a timeout's "current".
        for messages in parked.pulled():
            assert messages[0].header.kind == pb.PULL_KIND_UPDATE and messages[0].header.version == 1
        assert running.service.push_streams.counts()[0] == PARKED  # the idle streams are still open
        assert threading.active_count() <= before + server_threads(cfg) + control_threads(cfg)
    finally:
        parked.close()
        a.close()
        b.close()
        running.stop()


def test_a_server_stopped_mid_upload_closes_the_push_and_removes_its_spool(net_cfg, tmp_path):
    """A push stream that has sent its header and one chunk when the server stops: its cleanup runs before the
    loop goes (the record closed: its upload uncounted, its stream's place free, its push_aborted event written,
    its spool file gone once the service closes), and no coroutine is left un-awaited (the warning CI printed)."""
    cfg = replace(net_cfg, coordinator={"checkpoint": False})
    run_dir = tmp_path / "coord"
    running = Running(cfg, run_dir)
    client = CoordinatorClient(running.address, cfg)
    idle = IdlePushes(running.address, None)
    stopped = False
    try:
        join = join_island(client, "a")
        frame = delta_frame(join.tree_size, 1)[1]
        header = push_header(join, "mid-upload")
        chunks = client._chunked(header, frame)  # fills in the header's size, CRC and chunk count
        assert len(chunks) > 1
        idle.open(1, header, (chunk_message(0, *chunks[0]),))
        svc = running.service
        wait_for(lambda: svc.streams.active == 1, "the upload's first chunk spooled")
        assert list((run_dir / "spool").glob("push-*.body"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            running.server.stop(grace=None).wait()
            gc.collect()  # a coroutine dropped un-awaited warns here, at the latest
            assert svc.streams.active == 0  # the upload was closed before the stop returned
            assert svc.push_streams.counts()[0] == 0
            running.service.close()
            stopped = True
            gc.collect()
        unawaited = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert not unawaited, unawaited
        assert not list((run_dir / "spool").glob("push-*.body"))
        aborted = [e for e in read_events(run_dir) if e["event"] == "push_aborted"]
        assert [e["push_id"] for e in aborted] == ["mid-upload"]
    finally:
        idle.close()
        client.close()
        if not stopped:
            running.stop()
