"""gRPC server reflection on the public port, in both versions clients ask for.

grpcio-reflection (1.85) serves ``grpc.reflection.v1alpha`` only, while current grpcurl,
Postman and evans ask for ``grpc.reflection.v1`` first. The two versions' messages are the
same fields under another package, so both are served here by the library's own servicer:
each v1 request (decoded with tpserve/reflection_v1's stubs, generated from the v1 proto) is
re-read as its v1alpha twin and each answer re-read as a v1 message. Both versions list the
same services and resolve file descriptors from the same (default) descriptor pool.

One addition to the library's answers, in both versions: a method's full name
(``tpserve.v1.Generation.GenerateStream``, which the reflection proto allows as a symbol and
``grpcurl describe`` sends) resolves to its service's file; the library's descriptor pool
finds services and messages only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

from tpserve.reflection_v1 import reflection_pb2 as v1_pb2
from tpserve.reflection_v1 import reflection_pb2_grpc as v1_pb2_grpc

#: ``grpc.reflection.v1.ServerReflection``.
SERVICE_NAME_V1 = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
#: ``grpc.reflection.v1alpha.ServerReflection``.
SERVICE_NAME_V1ALPHA = reflection_v1alpha.SERVICE_NAME


def _service_of_method(symbol: str) -> str | None:
    """The service's full name when ``symbol`` is ``<service>.<method>`` of a known service, else None."""
    service, _, method = symbol.rpartition(".")
    try:
        found = descriptor_pool.Default().FindServiceByName(service)
    except KeyError:
        return None
    return service if method in found.methods_by_name else None


class ReflectionServicer:
    """``ServerReflectionInfo`` of one reflection version (``pb2``: its messages), answered by
    grpcio-reflection's v1alpha servicer.

    Args:
        service_names: the fully-qualified services the server lists (reflection's own included).
        pb2: the version's generated messages (v1 or v1alpha).
    """

    def __init__(self, service_names: Iterable[str], pb2: ModuleType) -> None:
        self._library = reflection_v1alpha.aio.ReflectionServicer(tuple(service_names))
        self._pb2 = pb2

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[Any],
                                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        originals: deque[Any] = deque()  # the library answers each request once, in order

        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                originals.append(request)
                twin = v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())
                if twin.HasField("file_containing_symbol"):
                    twin.file_containing_symbol = (_service_of_method(twin.file_containing_symbol)
                                                   or twin.file_containing_symbol)
                yield twin

        async for response in self._library.ServerReflectionInfo(as_v1alpha(), context):
            answer = self._pb2.ServerReflectionResponse.FromString(response.SerializeToString())
            answer.original_request.CopyFrom(originals.popleft())
            yield answer


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection v1 and v1alpha on ``server``; both list ``service_names`` and themselves."""
    names = (*service_names, SERVICE_NAME_V1, SERVICE_NAME_V1ALPHA)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(names, v1alpha_pb2), server)
    v1_pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(names, v1_pb2), server)
