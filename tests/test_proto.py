"""The committed stubs are exactly what grpc_tools generates from dtrain.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["dtrain_pb2.py", "dtrain_pb2.pyi", "dtrain_pb2_grpc.py"]


def test_generated_stubs_match_the_proto(tmp_path):
    (tmp_path / "dtrain" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / "dtrain" / "proto" / "dtrain.proto", tmp_path / "dtrain" / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "dtrain/proto/dtrain.proto"], cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "dtrain" / "proto" / name).read_text()
        committed = (ROOT / "dtrain" / "proto" / name).read_text()
        assert fresh == committed, (f"dtrain/proto/{name} is stale: regenerate with `python -m grpc_tools.protoc "
                                    "-I. --python_out=. --grpc_python_out=. --pyi_out=. dtrain/proto/dtrain.proto`")


def test_stubs_import_and_define_the_service():
    from dtrain.proto import dtrain_pb2, dtrain_pb2_grpc

    methods = {m.name for m in dtrain_pb2.DESCRIPTOR.services_by_name["Coordinator"].methods}
    assert methods == {"Join", "Heartbeat", "PushDelta", "PullGlobal", "Status"}
    assert hasattr(dtrain_pb2_grpc, "CoordinatorServicer")


def test_hand_encoded_chunk_messages_parse_as_the_generated_ones():
    """wire.chunk_message builds PushMessage/PullMessage chunks without the generated classes (one copy of the
    data instead of three); both message types must parse them to exactly the message the classes build."""
    import zlib

    from dtrain.proto import dtrain_pb2 as pb
    from dtrain.wire import chunk_message, frame_chunks

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

    from coordinator.server import service_handler
    from dtrain.proto import dtrain_pb2 as pb

    class Details:
        def __init__(self, method):
            self.method = method

    class Service:
        def __getattr__(self, name):
            return lambda *a: name

    handler = service_handler(Service())
    for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        h = handler.service(Details(f"/dtrain.v1.Coordinator/{m.name}"))
        assert isinstance(h, grpc.RpcMethodHandler)
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming, m.server_streaming)
        assert h.request_deserializer == getattr(pb, m.input_type.name).FromString
