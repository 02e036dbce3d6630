"""A server interceptor that decodes requests: large ones off the event loop, and
undecodable ones answered with INVALID_ARGUMENT.

grpc calls a method's request deserializer before any servicer code runs; a request
whose bytes are not a valid message (garbage, a truncated field, invalid UTF-8 in a
string) made it raise, and grpc answered ``UNKNOWN`` after logging an unexpected
error. grpc also decodes on the server's event loop, where a plan of a million tensors
(tens of megabytes) stalled heartbeats for seconds. Here grpc hands over the raw
bytes; the wrapped handler decodes them (on a worker thread above 64 KiB), and a
request that cannot be decoded is answered ``INVALID_ARGUMENT`` (reason
``MALFORMED_REQUEST``) without running. Installed on both servers, after
authentication, so a caller that is refused learns nothing about its payload.

Under mutual TLS the guard also applies the role policy (``weightsync.roles``) to the
decoded request: some calls are allowed only for one engine's agent, and which engine
a call speaks for is in the request. A refused call is answered ``PERMISSION_DENIED``
before the servicer runs.
"""

from __future__ import annotations

import asyncio
import inspect

import grpc

from weightsync.errors import InvalidArgument, PermissionDenied, abort_with
from weightsync.roles import peer_identity, refusal

_DETAIL_CHARS = 200  # the decoder's complaint is echoed, bounded
OFF_LOOP_BYTES = 64 * 1024


class _Undecodable:
    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _decode(deserialize, data: bytes):
    try:
        return deserialize(data)
    except Exception as exc:  # any decoder failure is the caller's malformed request
        return _Undecodable(f"{type(exc).__name__}: {str(exc)[:_DETAIL_CHARS]}")


async def _request(deserialize, data: bytes):
    """The decoded request; a large one is decoded on a worker thread, not the loop (a
    Broadcast naming a million tensors is tens of megabytes)."""
    if len(data) < OFF_LOOP_BYTES:
        return _decode(deserialize, data)
    return await asyncio.to_thread(_decode, deserialize, data)


def _raw(data: bytes) -> bytes:
    return data


def _refusal(method: str, request: _Undecodable) -> InvalidArgument:
    return InvalidArgument(f"{method}: the request is not a valid message ({request.why})",
                           reason="MALFORMED_REQUEST")


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers (all weightsync RPCs are one of those).

    Args:
        enforce_roles: apply ``weightsync.roles``' policy (servers with mutual TLS).
    """

    def __init__(self, *, enforce_roles: bool = False) -> None:
        self.enforce_roles = enforce_roles

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        full_method = handler_call_details.method
        method = full_method.rsplit("/", 1)[-1]
        deserialize = handler.request_deserializer
        enforce_roles = self.enforce_roles

        async def decoded(data, context):
            """The request, or (never returning) INVALID_ARGUMENT for bytes that are not
            one, or PERMISSION_DENIED for a caller whose role may not make this call."""
            request = await _request(deserialize, data)
            if isinstance(request, _Undecodable):
                await abort_with(context, _refusal(method, request))
            if enforce_roles:
                why = refusal(full_method, request, peer_identity(context.auth_context()))
                if why:
                    await abort_with(context, PermissionDenied(why))
            return request

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(data, context):
                return await inner(await decoded(data, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, _raw, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream
            if inspect.isasyncgenfunction(inner_stream):
                async def stream(data, context):
                    async for message in inner_stream(await decoded(data, context), context):
                        yield message
            else:  # a coroutine that writes its messages (grpc's own health Watch)
                async def stream(data, context):
                    return await inner_stream(await decoded(data, context), context)

            return grpc.unary_stream_rpc_method_handler(stream, _raw, handler.response_serializer)
        return handler


__all__ = ["DecodeGuard"]
