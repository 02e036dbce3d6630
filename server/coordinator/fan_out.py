"""Calling every engine of a round at once: each engine's failure becomes its own
outcome (never the whole call's), and UNAVAILABLE gets a few quick keyed retries."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from weightsync.errors import WeightSyncError
from weightsync.retry import RetryPolicy, retry
from weightsync.server.coordinator.agent_calls import call_agent, engine_error
from weightsync.server.coordinator.registry import EngineRecord
from weightsync.v1 import common_pb2

AGENT_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0, jitter=0.0)  # -> agents


def failed_outcome(engine_id: str, error: WeightSyncError) -> common_pb2.EngineOutcome:
    """An engine's outcome for ``error``."""
    outcome = common_pb2.EngineOutcome(engine_id=engine_id, ok=False, error_reason=error.reason,
                                       error_message=error.message, error_code=error.code.value[0])
    if "max_diff" in error.metadata:  # an attestation that ran and failed: report how far off
        try:
            outcome.attested, outcome.attest_max_diff = True, float(error.metadata["max_diff"])
        except ValueError:
            pass
    return outcome


async def fan_out(records: list[EngineRecord], call: Callable[[EngineRecord], Awaitable], *, operation: str,
                  retry: bool = True) -> list[common_pb2.EngineOutcome]:
    """Calls every engine concurrently; each failure becomes that engine's outcome."""
    async def one(record: EngineRecord) -> common_pb2.EngineOutcome:
        try:
            outcome = await call_agent(record, lambda: call_with_retry(record, call) if retry else call(record),
                                       operation)
            outcome.engine_id = record.engine_id
            return outcome
        except grpc.aio.AioRpcError as exc:
            return failed_outcome(record.engine_id, engine_error(record, exc, operation))
        except WeightSyncError as exc:
            return failed_outcome(record.engine_id, exc)
    return list(await asyncio.gather(*(one(r) for r in records)))


async def call_with_retry(record: EngineRecord, call: Callable[[EngineRecord], Awaitable]):
    """A few quick retries of UNAVAILABLE. Safe because every agent call carries a key
    derived from the trainer's: a retry attaches to, or replays, the first."""
    return await retry(lambda: call(record), policy=AGENT_RETRY)
