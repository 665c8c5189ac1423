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
