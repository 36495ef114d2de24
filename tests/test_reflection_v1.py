"""gRPC server reflection v1 beside v1alpha (launch/reflection.py), in process, and the freshness of
the v1 stubs (tpserve/reflection_v1). The live server's answers: tests/e2e/test_grpc_conventions.py."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

from launch.reflection import SERVICE_NAME_V1, SERVICE_NAME_V1ALPHA, enable_server_reflection
from tests.paths import REPO_ROOT
from tpserve.reflection_v1 import reflection_pb2 as v1_pb2
from tpserve.reflection_v1 import reflection_pb2_grpc as v1_pb2_grpc
from tpserve.v1 import generate_pb2

GENERATION = "tpserve.v1.Generation"


def test_committed_reflection_v1_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("reflection_compile", REPO_ROOT / "tpserve/reflection_v1/compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.compile_reflection_v1(tmp_path)
    assert {p.name for p in generated} == {"reflection_pb2.py", "reflection_pb2.pyi", "reflection_pb2_grpc.py"}
    stale = [p.name for p in generated
             if p.read_bytes() != (REPO_ROOT / "tpserve" / "reflection_v1" / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python tpserve/reflection_v1/compile.py` and commit them"


def test_v1_has_the_canonical_package_and_v1alpha_wire_format() -> None:
    assert SERVICE_NAME_V1 == "grpc.reflection.v1.ServerReflection"
    request = v1_pb2.ServerReflectionRequest(host="h", file_containing_symbol="a.B")
    twin = v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())
    assert (twin.host, twin.file_containing_symbol) == ("h", "a.B")


def _ask(stub_class, pb2, target: str, requests: list) -> list:
    with grpc.insecure_channel(target) as channel:
        return list(stub_class(channel).ServerReflectionInfo(iter(requests), timeout=10))


def _files(response) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    files = {}
    for raw in response.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[proto.name] = proto
    return files


def test_both_versions_list_the_services_and_resolve_symbols() -> None:
    async def main() -> None:
        server = grpc.aio.server()
        enable_server_reflection((GENERATION,), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            for stub_class, pb2 in ((v1_pb2_grpc.ServerReflectionStub, v1_pb2),
                                    (v1alpha_pb2_grpc.ServerReflectionStub, v1alpha_pb2)):
                listed, generation, own, missing = await asyncio.to_thread(_ask, stub_class, pb2, f"127.0.0.1:{port}", [
                    pb2.ServerReflectionRequest(list_services=""),
                    pb2.ServerReflectionRequest(file_containing_symbol=GENERATION + ".GenerateStream"),
                    pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME_V1),
                    pb2.ServerReflectionRequest(file_containing_symbol="tpserve.v1.NoSuchService")])
                assert isinstance(listed, pb2.ServerReflectionResponse)
                assert sorted(s.name for s in listed.list_services_response.service) == sorted(
                    [GENERATION, SERVICE_NAME_V1, SERVICE_NAME_V1ALPHA])
                files = _files(generation)
                assert generate_pb2.DESCRIPTOR.name in files  # a method's name finds its service's file
                assert generation.original_request.file_containing_symbol == GENERATION + ".GenerateStream"
                (service,) = [s for s in files[generate_pb2.DESCRIPTOR.name].service if s.name == "Generation"]
                assert {"Generate", "GenerateStream"} <= {m.name for m in service.method}
                (v1_file,) = _files(own).values()
                assert v1_file.package == "grpc.reflection.v1"
                assert [s.name for s in v1_file.service] == ["ServerReflection"]
                assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
                assert missing.original_request.file_containing_symbol == "tpserve.v1.NoSuchService"
        finally:
            await server.stop(None)

    asyncio.run(main())
