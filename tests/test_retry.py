"""Client retry policy: transient failures only, bounded, one key for every attempt."""

from __future__ import annotations

import grpc
import pytest

from weightsync.client.retry import RetryPolicy, call_with_retry
from weightsync.errors import (
    EngineUnavailable,
    FailedPrecondition,
    IdempotencyConflict,
    InvalidArgument,
)

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002)


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


@pytest.mark.parametrize("code,expected", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.ALREADY_EXISTS, IdempotencyConflict),
    (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
])
async def test_permanent_errors_are_never_retried(code, expected):
    attempts = []

    async def attempt(_left):
        attempts.append(1)
        raise rpc_error(code)

    with pytest.raises(expected):
        await call_with_retry(FAST, attempt, operation="pause")
    assert len(attempts) == 1


async def test_unavailable_is_retried_then_succeeds():
    attempts = []

    async def attempt(_left):
        attempts.append(1)
        if len(attempts) < 3:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    assert await call_with_retry(FAST, attempt, operation="pause") == "ok"
    assert len(attempts) == 3


async def test_retries_are_bounded():
    attempts = []

    async def attempt(_left):
        attempts.append(1)
        raise rpc_error(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(EngineUnavailable):
        await call_with_retry(FAST, attempt, operation="pause")
    assert len(attempts) == FAST.max_attempts


def test_backoff_grows_with_jitter_and_is_capped():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.2)
    for attempt, base in ((1, 0.1), (2, 0.2), (3, 0.4), (10, 1.0)):
        delay = policy.backoff(attempt)
        assert base * 0.8 <= delay <= base * 1.2
    for bad in (dict(max_attempts=0), dict(jitter=1.0), dict(initial_backoff_s=2.0, max_backoff_s=1.0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
