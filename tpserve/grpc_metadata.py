"""Client interceptors that add fixed metadata to every call of an asyncio channel.

Used for the cluster secret (tpserve/cluster_secret.py) and for a client's API key on
channels whose calls are not made by us (the load generator's stubs). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc


class _FixedMetadata:
    """Appends ``pairs`` to a call's metadata."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._pairs = tuple(pairs)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._pairs)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# One class per call kind: a channel files each interceptor under the first kind it
# is an instance of, so one class deriving from all four would see unary calls only.
class _UnaryUnary(_FixedMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_FixedMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_FixedMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_FixedMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def metadata_interceptors(pairs: Sequence[tuple[str, str]]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.*_channel(..., interceptors=...)`` adding ``pairs`` to every call."""
    return [kind(pairs) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
