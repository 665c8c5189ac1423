"""A pull flood and a push trickle cannot stall the rounds (issue 36, item 4), against a real coordinator on
127.0.0.1:0 with real gRPC clients and real merges: two honest islands push and pull round after round while a
third party holding an island's identity attacks, and the rounds merged in a fixed window with the attack are at
least half those merged in the same window without it, in the same test; heartbeats never fail.

- the flood: 100 concurrent long-poll PullGlobal(wait_s=30) under the attacker's own island id. Before, each
  parked pull held a data thread until the next version, which could not come while the islands' pushes queued
  behind them: rounds fell from 10 a minute to 1. Now the island holds coordinator.max_pulls_per_island pulls at
  once; the others are refused RESOURCE_EXHAUSTED (busy).
- the trickle: push streams that send their header, then a 1-byte chunk every 2.5 s (under stream_idle_s = 3 s:
  the measured attack, 1 byte every 25 s under 30 s, scaled down), under the honest island's id (the attacker
  holds its token) and 4 more under the attacker's. Before, the idle clock reset on every byte and the island's
  stream slots were claimed at the header: the honest island's pushes were refused, 0 versions in 80 s. Now no slot
  is taken before data, and the streams are cancelled once below coordinator.stream_min_bytes_per_s past
  stream_rate_grace_s.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator

import grpc

from coordinator.streams import pulls_per_peer
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import chunk_message, method_path, serialize
from service_helpers import Running, delta_frame, join_island, push_header
from workers.client import CoordinatorClient, CoordinatorError

WINDOW_S = 4.0  # each measured window


def _cfg(net_cfg, **coordinator):
    """Three islands (two honest, one attacker that never pushes): a round closes on the two honest pushes."""
    return replace(net_cfg, outer={"islands": 3}, train={"steps": 100_000},
                   coordinator={"checkpoint": False, "min_quorum": 2, "grace_s": 0.01, "norm_z_max": 1000.0,
                                **coordinator},
                   worker={"retry_total_s": 2.0, "retry_initial_s": 0.05, "retry_max_s": 0.2})


class HonestRounds:
    """Islands a and b push a delta each round (the second completes it) and pull the new version, on one thread;
    every island's heartbeat, one try each, every 0.25 s on another. ``merged``: the versions they pulled."""

    def __init__(self, running: Running, cfg, islands: dict[str, pb.JoinResponse]):
        self.running, self.cfg, self.islands = running, cfg, islands
        self.clients = {name: CoordinatorClient(running.address, cfg) for name in islands}
        self.frames = [delta_frame(running.service.merger.n, seed)[1] for seed in range(8)]
        self.merged = 0
        self.push_failures: list[str] = []
        self.heartbeat_failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._rounds, daemon=True),
                        threading.Thread(target=self._heartbeats, daemon=True)]
        for t in self.threads:
            t.start()

    def _rounds(self) -> None:
        version, start = 0, 0
        while not self.stop.is_set():
            try:
                for k, name in enumerate(("a", "b")):
                    header = push_header(self.islands[name], f"{name}-{start}", base=version, start=start)
                    reply = self.clients[name].push(header, self.frames[(start // 80 + k) % len(self.frames)])
                    assert reply.status in (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED), reply
                for name in ("a", "b"):
                    frames = self.clients[name].pull(self.islands[name].island_id, version, wait_s=5)
                    assert frames and frames[-1].header.version == version + 1, frames
            except CoordinatorError as e:  # a refused push: the round is tried again
                self.push_failures.append(str(e))
                continue
            version, start = version + 1, start + 80
            self.merged += 1

    def _heartbeats(self) -> None:
        while not self.stop.wait(0.25):
            for name, join in self.islands.items():
                try:
                    self.clients[name].heartbeat(0, island_id=join.island_id, version=0)
                except CoordinatorError as e:
                    self.heartbeat_failures.append(f"{name}: {e}")

    def rounds_in(self, seconds: float) -> int:
        before = self.merged
        time.sleep(seconds)
        return self.merged - before

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        for client in self.clients.values():
            client.close()


class Attack:
    """``count`` threads, each making ``call()`` (a grpc future) again as soon as the last one ends (after
    ``pause_s`` if it failed), until :meth:`close`, which cancels the calls in flight."""

    def __init__(self, count: int, call: Callable[[], grpc.Future], pause_s: float):
        self.call, self.pause_s = call, pause_s
        self.stop = threading.Event()
        self.calls: list[grpc.Future | None] = [None] * count
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        while not self.stop.is_set():
            call = self.calls[k] = self.call()
            try:
                call.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                self.stop.wait(self.pause_s)

    def close(self) -> None:
        self.stop.set()
        for call in self.calls:
            if call is not None:
                call.cancel()
        for t in self.threads:
            t.join(30)


def _run_attack(net_cfg, tmp_path, cfg, attack: Callable[[Running, dict[str, pb.JoinResponse], threading.Event],
                                                           Attack], ready: Callable[[Running, str], bool]):
    """Rounds in a window without the attack, then in one with it (once ``ready``): (baseline, attacked, status,
    the honest rounds' record)."""
    running = Running(cfg, tmp_path / "coord")
    setup = CoordinatorClient(running.address, cfg)
    islands = {name: join_island(setup, name) for name in ("a", "b", "mallory")}
    honest = HonestRounds(running, cfg, islands)
    released = threading.Event()
    attacker: Attack | None = None
    try:
        baseline = honest.rounds_in(WINDOW_S)
        attacker = attack(running, islands, released)
        deadline = time.monotonic() + 10
        while not ready(running, islands["mallory"].island_id):
            assert time.monotonic() < deadline, "the attack did not get going"
            time.sleep(0.05)
        attacked = honest.rounds_in(WINDOW_S)
        status = setup.status()
    finally:
        released.set()
        if attacker is not None:
            attacker.close()
        honest.close()
        setup.close()
        running.stop()
    return baseline, attacked, status, honest


def test_a_flood_of_long_poll_pulls_leaves_the_rounds_going(net_cfg, tmp_path):
    cfg = _cfg(net_cfg)
    channels: list[grpc.Channel] = []

    def flood(running: Running, islands: dict[str, pb.JoinResponse], released: threading.Event) -> Attack:
        channel = grpc.insecure_channel(running.address)
        channels.append(channel)
        pull = channel.unary_stream(method_path("PullGlobal"), request_serializer=pb.PullRequest.SerializeToString,
                                    response_deserializer=lambda raw: raw)
        mallory = islands["mallory"].island_id

        def parked() -> grpc.Future:
            with running.service.lock:  # the version now: the pull parks until the next one (30 s at most)
                version = running.service.state.version
            call = pull(pb.PullRequest(island_id=mallory, have_version=version, wait_s=30), timeout=60)
            future: grpc.Future = _Drained(call)
            return future

        return Attack(100, parked, pause_s=2.0)  # refused ones come back (a pause: CPU is not what is measured)

    def parked_at_quota(running: Running, mallory: str) -> bool:
        return running.service.pulls.counts()[1].get(mallory, 0) == cfg.coordinator.max_pulls_per_island

    try:
        baseline, attacked, status, honest = _run_attack(net_cfg, tmp_path, cfg, flood, parked_at_quota)
    finally:
        for channel in channels:
            channel.close()
    assert baseline >= 4, f"the honest run merged {baseline} rounds in {WINDOW_S:g}s without the attack"
    assert attacked >= baseline / 2, (baseline, attacked, honest.push_failures)
    assert status.refusals["PullGlobal: RESOURCE_EXHAUSTED"] > 0  # the flood beyond the island's quota, counted
    assert not honest.heartbeat_failures, honest.heartbeat_failures[:3]
    assert pulls_per_peer(cfg) == cfg.outer.islands + 8  # the default, which the flood from one host stayed under


class _Drained:
    """A unary-stream call read to its end on a thread of its own, as a future: ``result()`` waits for the end."""

    def __init__(self, call):
        self.call, self.error = call, None
        self.done = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.done.set()

    def result(self):
        self.done.wait()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.call.cancel()


def test_a_trickle_of_pushes_leaves_the_rounds_going(net_cfg, tmp_path):
    cfg = _cfg(net_cfg, stream_idle_s=3.0, stream_rate_grace_s=1.0)
    channels: list[grpc.Channel] = []

    def trickle(running: Running, islands: dict[str, pb.JoinResponse], released: threading.Event) -> Attack:
        channel = grpc.insecure_channel(running.address)
        channels.append(channel)
        push = channel.stream_unary(method_path("PushDelta"), request_serializer=serialize,
                                    response_deserializer=pb.PushDeltaResponse.FromString)
        frame = delta_frame(running.service.merger.n, 99)[1]
        opened = [0]

        def messages(join: pb.JoinResponse) -> Iterator[pb.PushMessage | bytes]:
            header = push_header(join, f"trickle-{opened[0]}", base=0)
            header.total_bytes, header.frame_crc32 = len(frame), zlib.crc32(frame)
            header.chunks = max(64, -(-len(frame) // cfg.codec.chunk_bytes))  # a count the header check allows
            opened[0] += 1
            yield pb.PushMessage(header=header)
            for index in range(64):  # 1 byte every 2.5 s: under stream_idle_s = 3 s
                if released.wait(2.5):
                    return
                yield chunk_message(index, memoryview(frame[index:index + 1]), zlib.crc32(frame[index:index + 1]))

        def stream(join: pb.JoinResponse) -> Callable[[], grpc.Future]:
            return lambda: push.future(messages(join), timeout=60)

        # 2 under the honest island a's id (the attacker holds its token), 4 under its own
        return Attack(6, _alternating([stream(islands["a"])] * 2 + [stream(islands["mallory"])] * 4), pause_s=0.05)

    def trickling(running: Running, mallory: str) -> bool:
        return running.service.push_streams.counts()[0] >= 4  # they come and go: cancelled, opened again

    try:
        baseline, attacked, status, honest = _run_attack(net_cfg, tmp_path, cfg, trickle, trickling)
    finally:
        for channel in channels:
            channel.close()
    assert baseline >= 4, f"the honest run merged {baseline} rounds in {WINDOW_S:g}s without the attack"
    assert attacked >= baseline / 2, (baseline, attacked, honest.push_failures)
    assert status.refusals["PushDelta: CANCELLED"] >= 6  # every trickle cancelled once at least, counted
    assert not honest.heartbeat_failures, honest.heartbeat_failures[:3]


def _alternating(makers: list[Callable[[], grpc.Future]]) -> Callable[[], grpc.Future]:
    """A call maker that hands each thread of an :class:`Attack` its own maker, in turn, and keeps it."""
    mine = threading.local()
    turn = iter(makers)
    lock = threading.Lock()

    def call() -> grpc.Future:
        if not hasattr(mine, "maker"):
            with lock:
                mine.maker = next(turn)
        return mine.maker()

    return call
