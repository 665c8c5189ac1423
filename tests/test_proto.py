"""The committed stubs are exactly what grpc_tools generates from dtrain/net/proto/dtrain.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["dtrain_pb2.py", "dtrain_pb2.pyi", "dtrain_pb2_grpc.py"]


def test_generated_stubs_match_the_proto(tmp_path):
    (tmp_path / "dtrain" / "net" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / "dtrain" / "net" / "proto" / "dtrain.proto", tmp_path / "dtrain" / "net" / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "dtrain/net/proto/dtrain.proto"], cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "dtrain" / "net" / "proto" / name).read_text()
        committed = (ROOT / "dtrain" / "net" / "proto" / name).read_text()
        assert fresh == committed, (f"dtrain/net/proto/{name} is stale: regenerate with `python -m grpc_tools.protoc "
                                    "-I. --python_out=. --grpc_python_out=. --pyi_out=. dtrain/net/proto/dtrain.proto`")


def test_stubs_import_and_define_the_service():
    from dtrain.net.proto import dtrain_pb2, dtrain_pb2_grpc

    methods = {m.name for m in dtrain_pb2.DESCRIPTOR.services_by_name["Coordinator"].methods}
    assert methods == {"Join", "Heartbeat", "PushDelta", "PullGlobal", "Status"}
    assert hasattr(dtrain_pb2_grpc, "CoordinatorServicer")


def test_hand_encoded_chunk_messages_parse_as_the_generated_ones():
    """wire.chunk_message builds PushMessage/PullMessage chunks without the generated classes (one copy of the
    data instead of three); both message types must parse them to exactly the message the classes build."""
    import zlib

    from dtrain.net.proto import dtrain_pb2 as pb
    from dtrain.net.wire import chunk_message, frame_chunks

    for index in (0, 1, 127, 128, 300, 1 << 20):
        for data in (b"", b"x", bytes(range(256)) * 4097):
            for crc in (0, 1, zlib.crc32(data), 0xFFFFFFFF):
                encoded = chunk_message(index, memoryview(data), crc)
                chunk = pb.Chunk(index=index, data=data, crc32=crc)
                assert pb.PushMessage.FromString(encoded) == pb.PushMessage(chunk=chunk)
                assert pb.PullMessage.FromString(encoded) == pb.PullMessage(chunk=chunk)
                assert len(encoded) == len(pb.PushMessage(chunk=chunk).SerializeToString())

    frame = bytes(range(256)) * 1000
    crc, chunks = frame_chunks(frame, 1000)
    assert crc == zlib.crc32(frame) and b"".join(bytes(d) for d, _ in chunks) == frame
    assert all(c == zlib.crc32(d) for d, c in chunks) and len(chunks) == 256


def test_the_server_registers_every_method_of_the_proto_service():
    import grpc

    from coordinator.handlers import abort_invalid, aio_service_handler
    from dtrain.net.proto import dtrain_pb2 as pb

    class Details:
        def __init__(self, method):
            self.method = method

    class Service:
        def __getattr__(self, name):
            return lambda *a: name

    async def refuse(context, why):
        raise AssertionError(why)

    handler = aio_service_handler(Service(), abort_invalid, refuse)
    for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        h = handler.service(Details(f"/dtrain.v1.Coordinator/{m.name}"))
        assert isinstance(h, grpc.RpcMethodHandler)
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming, m.server_streaming)
        request_class = getattr(pb, m.input_type.name)
        assert h.request_deserializer(request_class().SerializeToString()) == request_class()


def _fields(index, data, crc, order, extra):
    """A Chunk's fields in protobuf wire format, in the given order, plus extra raw fields."""
    from dtrain.net.wire import _varint

    parts = {"index": b"\x08" + _varint(index), "crc": b"\x18" + _varint(crc),
             "data": b"\x12" + _varint(len(data)) + data}
    return b"".join(parts[k] for k in order) + extra


def test_chunks_parsed_without_copies_match_protobuf():
    """wire.chunk_deserializer's fast path must give what protobuf gives, or step aside for protobuf."""
    import itertools

    from google.protobuf.message import DecodeError

    from dtrain.net.proto import dtrain_pb2 as pb
    from dtrain.net.wire import RawChunk, _varint, chunk_deserializer

    parse = chunk_deserializer(pb.PushMessage)
    cases = []
    for index, data, crc in [(0, b"", 0), (3, b"abc", 7), (1 << 20, bytes(300), 0xFFFFFFFF), (5, b"x" * 200, 0)]:
        for order in itertools.permutations(["index", "data", "crc"]):
            for extra in (b"", b"\x08\x09", b"\x20\x01", b"\x12\x01z"):  # a repeat, an unknown field, a 2nd data
                cases.append(_fields(index, data, crc, order, extra))
    cases += [b"\x08" + _varint(1 << 40) + b"\x12\x01a", b"\x88\x00\x01"]  # a 64-bit index; a long tag
    fast = 0
    for inner in cases:
        raw = b"\x12" + _varint(len(inner)) + inner
        want = pb.PushMessage.FromString(raw)
        got = parse(raw)
        fast += isinstance(got, RawChunk)
        assert got.WhichOneof("kind") == want.WhichOneof("kind") == "chunk"
        assert (got.chunk.index, bytes(got.chunk.data), got.chunk.crc32) == (
            want.chunk.index, want.chunk.data, want.chunk.crc32)
    assert fast >= 24  # every plain layout took the fast path
    header = pb.PushMessage(header=pb.PushHeader(push_id="p", tokens=3)).SerializeToString()
    assert parse(header) == pb.PushMessage.FromString(header)
    for broken in (b"\x12\x05\x08\x01", b"\x12\x03\x12\x09a", b"\x12"):  # truncated: protobuf's error, as before
        with pytest.raises(DecodeError):
            parse(broken)
