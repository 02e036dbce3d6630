"""The coordinator's calls to agents, and what their failures mean for the caller.

A grpc.aio channel that gets closed under a call (its engine deregistered, or
re-registered at a new address) does not end the call with an ``AioRpcError``: a call
in flight raises ``CancelledError`` and a call started after the close raises
``UsageError("Channel is closed")``. Both are that engine's failure, never the caller's
own cancellation or a bug: a handler that let the ``CancelledError`` through ended
without answering, and its caller waited out its own deadline (a trainer's GetState
right after an engine deregistered waited 60 s). ``call_agent`` turns both into
``EngineUnavailable`` for that engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from weightsync.errors import EngineUnavailable, WeightSyncError, from_rpc_error
from weightsync.server.coordinator.registry import EngineRecord, EngineRegistry
from weightsync.v1 import agent_pb2, common_pb2

T = TypeVar("T")
STATE_PROBE_S = 2.0  # asking a failed engine for its state at the end of a round


def engine_error(record: EngineRecord, exc: grpc.aio.AioRpcError, operation: str) -> WeightSyncError:
    """The typed error of a failed agent call; an unreachable agent is ENGINE_UNAVAILABLE."""
    error = from_rpc_error(exc, operation=operation)
    if exc.code() == grpc.StatusCode.UNAVAILABLE and error.reason == "UNAVAILABLE":
        error = EngineUnavailable(f"engine {record.engine_id} unreachable during {operation}: {exc.details()}")
    error.metadata["engine_id"] = record.engine_id
    return error


def channel_closed(record: EngineRecord, operation: str) -> EngineUnavailable | None:
    """The engine's failure when its channel closed under (or before) a call; None when
    the running task itself is being cancelled (that cancellation must go on)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    error = EngineUnavailable(f"engine {record.engine_id} went away during {operation} (its channel closed: "
                              "it deregistered or re-registered)")
    error.metadata["engine_id"] = record.engine_id
    return error


async def call_agent(record: EngineRecord, call: Callable[[], Awaitable[T]], operation: str) -> T:
    """Awaits ``call()`` (one or more calls on ``record``'s channel). A closed channel
    raises EngineUnavailable for the engine; an ``AioRpcError`` is left to the caller,
    which knows what each status means for its operation."""
    try:
        return await call()
    except (grpc.aio.UsageError, asyncio.CancelledError):
        closed = channel_closed(record, operation)
        if closed is None:
            raise
        raise closed from None




async def fill_real_state(registry: EngineRegistry, outcomes: list[common_pb2.EngineOutcome]) -> None:
    """Fills each failed outcome with its engine's state now (version served, torn,
    paused): an outcome made from an error knows none of it, and an engine a
    sharded rank's death stopped may have committed, torn, or kept its weights.
    Asked of each agent (briefly, concurrently); its last heartbeat's otherwise."""
    async def fill(outcome: common_pb2.EngineOutcome) -> None:
        record = registry.get(outcome.engine_id)
        if record is None:
            return
        state = record.state
        if registry.is_available(record):
            try:
                reply = await call_agent(record, lambda: record.stub.GetEngineState(
                    agent_pb2.GetEngineStateRequest(), timeout=STATE_PROBE_S), "get_state")
                state = reply.state
            except (grpc.aio.AioRpcError, WeightSyncError):
                pass
        outcome.weight_version, outcome.torn, outcome.paused = state.weight_version, state.torn, state.paused

    await asyncio.gather(*(fill(o) for o in outcomes if not o.ok))


__all__ = ["call_agent", "channel_closed", "engine_error", "fill_real_state", "STATE_PROBE_S"]
