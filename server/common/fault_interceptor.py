"""A server interceptor that injects control-plane faults (tests only; see weightsync.faults).

It is installed only when fault injection was explicitly enabled for the process.
Faults act after or around the real handler, so they reproduce what a network does
to a call: the server executed, but the answer never arrived (``drop_response``);
the same request arrived twice (``duplicate``); the hop was slow (``delay``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from weightsync.faults import FaultInjector

log = logging.getLogger("weightsync.faults")


class FaultInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers with the injector's ``rpc`` rules."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):
            return handler  # health and reflection are never faulted
        method = handler_call_details.method.rsplit("/", 1)[-1]
        injector = self.injector
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                rule = injector.take("rpc", method=method)
                if rule is None:
                    return await inner(request, context)
                log.warning("injecting %s into %s", rule.action, method)
                if rule.action == "delay":
                    await asyncio.sleep(rule.seconds)
                    return await inner(request, context)
                if rule.action == "duplicate":
                    first, _second = await asyncio.gather(inner(request, context), inner(request, context))
                    return first
                if rule.action == "cancel":  # what a server that is stopping does to a call in flight
                    await context.abort(grpc.StatusCode.CANCELLED, f"injected: {method} cancelled")
                await inner(request, context)  # drop_response: executed, answer lost
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected: response of {method} dropped")

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                rule = injector.take("rpc", method=method)
                if rule is not None and rule.action == "delay":
                    await asyncio.sleep(rule.seconds)
                    rule = None
                async for message in inner_stream(request, context):
                    if rule is not None and rule.action == "drop_stream":
                        # The stream breaks before its first message reaches the caller;
                        # the operation it started goes on.
                        log.warning("injecting drop_stream into %s", method)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected: stream of {method} broken")
                    if rule is not None and rule.action == "drop_response" and _is_final(message):
                        log.warning("injecting drop_response into %s", method)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected: result of {method} dropped")
                    yield message

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


def _is_final(message) -> bool:
    which = getattr(message, "WhichOneof", None)
    return which is not None and message.DESCRIPTOR.oneofs and message.WhichOneof(
        message.DESCRIPTOR.oneofs[0].name) == "result"


__all__ = ["FaultInterceptor"]
