"""A server interceptor that answers undecodable requests with INVALID_ARGUMENT.

grpc calls a method's request deserializer before any servicer code runs; a request
whose bytes are not a valid message (garbage, a truncated field, invalid UTF-8 in a
string) made it raise, and grpc answered ``UNKNOWN`` after logging an unexpected
error. Here the deserializer is wrapped: a request that cannot be decoded becomes a
marker, and the handler answers ``INVALID_ARGUMENT`` (reason ``MALFORMED_REQUEST``)
without running. Installed on both servers, after authentication, so a caller that
is refused learns nothing about its payload.
"""

from __future__ import annotations

import inspect

import grpc

from weightsync.errors import InvalidArgument, abort_with

_DETAIL_CHARS = 200  # the decoder's complaint is echoed, bounded


class _Undecodable:
    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _guarded(deserialize):
    def safe(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # any decoder failure is the caller's malformed request
            return _Undecodable(f"{type(exc).__name__}: {str(exc)[:_DETAIL_CHARS]}")
    return safe


def _refusal(method: str, request: _Undecodable) -> InvalidArgument:
    return InvalidArgument(f"{method}: the request is not a valid message ({request.why})",
                           reason="MALFORMED_REQUEST")


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers (all weightsync RPCs are one of those)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    await abort_with(context, _refusal(method, request))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, _guarded(handler.request_deserializer),
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream
            if inspect.isasyncgenfunction(inner_stream):
                async def stream(request, context):
                    if isinstance(request, _Undecodable):
                        await abort_with(context, _refusal(method, request))
                    async for message in inner_stream(request, context):
                        yield message
            else:  # a coroutine that writes its messages (grpc's own health Watch)
                async def stream(request, context):
                    if isinstance(request, _Undecodable):
                        await abort_with(context, _refusal(method, request))
                    return await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(stream, _guarded(handler.request_deserializer),
                                                        handler.response_serializer)
        return handler


__all__ = ["DecodeGuard"]
