"""gRPC server reflection on the public port, in both versions clients ask for.

grpcio-reflection (1.85) serves ``grpc.reflection.v1alpha`` only, while current grpcurl,
Postman and evans ask for ``grpc.reflection.v1`` first. The two versions' messages are the
same fields under another package, so v1 is served here by the library's own v1alpha servicer:
each v1 request (decoded with tpserve/reflection_v1's stubs, generated from the v1 proto) is
re-read as its v1alpha twin and each answer re-read as a v1 message. Both versions list the
same services and resolve file descriptors from the same (default) descriptor pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable

import grpc
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from tpserve.reflection_v1 import reflection_pb2 as v1_pb2
from tpserve.reflection_v1 import reflection_pb2_grpc as v1_pb2_grpc

#: ``grpc.reflection.v1.ServerReflection``.
SERVICE_NAME_V1 = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
#: ``grpc.reflection.v1alpha.ServerReflection``.
SERVICE_NAME_V1ALPHA = reflection_v1alpha.SERVICE_NAME


class ReflectionServicerV1(v1_pb2_grpc.ServerReflectionServicer):
    """``grpc.reflection.v1.ServerReflection``, answered by grpcio-reflection's v1alpha servicer.

    Args:
        service_names: the fully-qualified services the server lists (reflection's own included).
    """

    def __init__(self, service_names: Iterable[str]) -> None:
        self._v1alpha = reflection_v1alpha.aio.ReflectionServicer(tuple(service_names))

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[v1_pb2.ServerReflectionRequest],
                                   context: grpc.aio.ServicerContext) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in self._v1alpha.ServerReflectionInfo(as_v1alpha(), context):
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection v1 and v1alpha on ``server``; both list ``service_names`` and themselves."""
    names = (*service_names, SERVICE_NAME_V1, SERVICE_NAME_V1ALPHA)
    reflection_v1alpha.enable_server_reflection(names, server)
    v1_pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionServicerV1(names), server)
