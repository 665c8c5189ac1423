"""What the tests of a real in-process coordinator share: the coordinator on 127.0.0.1:0 (:class:`Running`), an
island's Join, a pushed delta's frame and header, a TLS config, a raw push and the service's state before and after
one (test_service*, test_dashboard, test_status, test_progress, test_deploy). Their fixtures (``net_cfg``,
``certs``, ``coordinator``, ``two_islands``) are in conftest.py."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np

from conftest import initial_parameters, initial_spec
from coordinator.app import serve
from dtrain import codec
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata, frame_chunks, method_path, serialize
from workers.client import CoordinatorClient

# two_islands(address, cfg, names=("a", "b")) -> ((client, client), (join, join)): conftest.py's fixture
JoinTwo = Callable[..., tuple[tuple[CoordinatorClient, CoordinatorClient], tuple[pb.JoinResponse, pb.JoinResponse]]]


class Running:
    """A coordinator on 127.0.0.1:0 in this process, started from the session's shared θ_0 (conftest.py)."""

    def __init__(self, cfg, run_dir: Path, resume: bool = False, clock=time.time):
        if resume:  # as `dtrain coordinator --resume` starts: the tree's spec only, θ from the checkpoint
            self.theta, self.spec = None, initial_spec(cfg)
        else:
            self.theta, self.spec = initial_parameters(cfg)
        self.server, self.service, self.port = serve(cfg, run_dir, self.theta, self.spec, port=0, resume=resume,
                                                     quiet=True, clock=clock)
        self.address = f"127.0.0.1:{self.port}"
        self.run_dir = run_dir

    def stop(self):
        self.server.stop(grace=None).wait()
        self.service.close()


def join_island(client: CoordinatorClient, name: str) -> pb.JoinResponse:
    """Joins ``client`` as island ``name`` with one CPU device."""
    return client.join(name, "cpu", 1)


def delta_frame(n: int, seed: int, bits=8, block=1024) -> tuple[np.ndarray, bytes]:
    delta = np.random.default_rng(seed).normal(size=n).astype(np.float32) * 1e-3
    return delta, codec.encode(codec.quantize(delta, bits, block))


def push_header(join: pb.JoinResponse, push_id: str, base: int = 0, tokens: int = 640, start: int = 0) -> pb.PushHeader:
    """A push of 10 steps x batch 8 = 80 sequences from cursor ``start`` (the coordinator bounds its tokens by
    that range and drops one that does not start at the shard's cursor), on the island's shard."""
    return pb.PushHeader(island_id=join.island_id, base_version=base, push_id=push_id, tokens=tokens,
                         inner_steps=10, cursor_start=start, cursor_end=start + 80, tree_digest=join.tree_digest,
                         shard_index=join.shard_index)


def tls_config(cfg, d: Path, client_auth: bool, client: str | None):
    sec = {"ca": str(d / "ca.pem"), "server_cert": str(d / "server.pem"), "server_key": str(d / "server.key"),
           "client_auth": client_auth, "server_name": "localhost"}
    if client == "client":
        sec.update(client_cert=str(d / "client.pem"), client_key=str(d / "client.key"))
    elif client == "rogue":
        sec.update(client_cert=str(d / "rogue.pem"), client_key=str(d / "rogue.key"))
    return replace(cfg, security=sec)


class IdlePushes:
    """PushDelta streams opened on one channel that send nothing (or only ``header``, and then the messages of
    ``first``: pre-encoded chunks) until :meth:`close`."""

    def __init__(self, address: str, token: str | None):
        self.channel = grpc.insecure_channel(address)
        self.push = self.channel.stream_unary(method_path("PushDelta"), request_serializer=serialize,
                                              response_deserializer=pb.PushDeltaResponse.FromString)
        self.metadata = auth_metadata(token)
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []

    def _messages(self, header: pb.PushHeader | None, first: tuple[bytes, ...]) -> Iterator[pb.PushMessage | bytes]:
        if header is not None:
            yield pb.PushMessage(header=header)
        yield from first
        self.release.wait(120)  # no message, no half-close: the stream stays open and idle

    def open(self, count: int = 1, header: pb.PushHeader | None = None,
             first: tuple[bytes, ...] = ()) -> list[grpc.Future]:
        calls = [self.push.future(self._messages(header, first), timeout=120, metadata=self.metadata)
                 for _ in range(count)]
        self.calls += calls
        return calls

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def call_failure(call: grpc.Future) -> grpc.RpcError:
    error = call.exception(timeout=20)
    assert isinstance(error, grpc.RpcError), f"the call did not fail: {call.result()}"
    return error


def snapshot(service) -> dict:
    with service.lock:
        return {"state": service.state.to_json(), "pending_sum": service.merger.pending_sum(),
                "w": service.merger.total_weight, "version": service.merger.version}


def assert_unchanged(before: dict, service) -> None:
    after = snapshot(service)
    assert after["state"] == before["state"]
    assert after["version"] == before["version"] and after["w"] == before["w"]
    assert np.array_equal(after["pending_sum"], before["pending_sum"])



def raw_push(address: str, messages: list[pb.PushMessage], token: str | None = None):
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(address))
    return stub.PushDelta(iter(messages), timeout=10, metadata=auth_metadata(token))


def frame_messages(join, frame: bytes, push_id: str, chunk: int = 4096, **overrides) -> list[pb.PushMessage]:
    _, chunks = frame_chunks(frame, chunk)
    h = push_header(join, push_id)
    h.total_bytes, h.frame_crc32, h.chunks = len(frame), zlib.crc32(frame), len(chunks)
    for k, v in overrides.items():
        setattr(h, k, v)
    return [pb.PushMessage(header=h)] + [pb.PushMessage(chunk=pb.Chunk(index=i, data=bytes(d), crc32=c))
                                         for i, (d, c) in enumerate(chunks)]
