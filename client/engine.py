"""EngineClient: talks to one agent directly (generation requests, state, event log).

The demo and the tests use it to keep engines generating during syncs and to read
what an agent did, in order.
"""

from __future__ import annotations

import grpc

from weightsync.client.channel import LoopChannel
from weightsync.client.retry import new_key
from weightsync.errors import from_rpc_error
from weightsync.grpc_options import CHANNEL_OPTIONS
from weightsync.security import Security
from weightsync.v1 import agent_pb2, agent_pb2_grpc, common_pb2


class EngineClient:
    """Async client of one engine agent (``EngineAgentService``). ``async with EngineClient(addr) as e: ...``"""

    def __init__(self, address: str, *, security: Security | None = None) -> None:
        self.address = address
        security = security or Security()
        self._control = LoopChannel(lambda: security.channel(address, options=CHANNEL_OPTIONS),
                                    agent_pb2_grpc.EngineAgentServiceStub, owner="EngineClient")

    @property
    def stub(self) -> agent_pb2_grpc.EngineAgentServiceStub:
        """The agent's stub on the running event loop (opened there on first use)."""
        return self._control.stub()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the channel. Idempotent."""
        await self._control.aclose()

    async def _call(self, method, request, *, timeout_s: float, operation: str):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, operation=operation) from exc

    async def generate(self, prompt: list[int], max_tokens: int, *, timeout_s: float = 10.0) -> str:
        """Submits a generation request; returns its id."""
        response = await self._call(self.stub.Generate, agent_pb2.GenerateRequest(
            idempotency_key=new_key("generate"), prompt=prompt, max_tokens=max_tokens),
            timeout_s=timeout_s, operation="generate")
        return response.request_id

    async def get(self, request_id: str, *, wait_s: float = 0.0) -> agent_pb2.Generation:
        """The request's tokens and the weight version of each; waits up to ``wait_s`` for it to end."""
        response = await self._call(self.stub.GetGeneration, agent_pb2.GetGenerationRequest(
            request_id=request_id, wait_s=wait_s), timeout_s=wait_s + 10.0, operation="get_generation")
        return response.generation

    async def state(self, *, include_digest: bool = False) -> common_pb2.EngineState:
        """The agent's own view of its engine (version, paused, torn, digest if asked)."""
        response = await self._call(self.stub.GetEngineState,
                                    agent_pb2.GetEngineStateRequest(include_digest=include_digest),
                                    timeout_s=30.0, operation="get_state")
        return response.state

    async def events(self, after_seq: int = 0) -> list[common_pb2.Event]:
        """The agent's event log (pause, transfer, KV, resume ... in order)."""
        response = await self._call(self.stub.GetEvents, agent_pb2.GetEventsRequest(after_seq=after_seq),
                                    timeout_s=10.0, operation="get_events")
        return list(response.events)


__all__ = ["EngineClient"]
