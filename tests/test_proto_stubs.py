"""The committed stubs in tpserve/v1 are what proto/compile.py makes from proto/ today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.paths import REPO_ROOT


def _load_compile_module():
    spec = importlib.util.spec_from_file_location("proto_compile", REPO_ROOT / "proto" / "compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generated = _load_compile_module().compile_protos(tmp_path)
    assert {p.name for p in generated} == {
        "cluster_pb2.py", "cluster_pb2.pyi", "cluster_pb2_grpc.py",
        "generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py",
        "worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py",
    }
    stale = [p.name for p in generated if p.read_bytes() != (REPO_ROOT / "tpserve" / "v1" / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python proto/compile.py` and commit tpserve/v1"


def test_optional_fields_distinguish_unset_from_zero() -> None:
    from tpserve.v1 import generate_pb2 as pb

    params = pb.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0
    assert params.HasField("temperature") and params.temperature == 0.0
