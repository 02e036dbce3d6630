"""The trainer client's retries: transient failures only, bounded by the operation's
deadline, with exponential back-off and jitter (the loop is ``weightsync.retry``).

The idempotency key is made once per logical operation, before the first attempt,
and reused on every attempt: that is what makes a retry safe. Errors that a retry
cannot fix (INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION, ...) are never
retried.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from weightsync import deadline
from weightsync.errors import coordinator_error
from weightsync.retry import RetryPolicy, retry

T = TypeVar("T")

TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE})


def is_transient(error: grpc.RpcError) -> bool:
    """UNAVAILABLE (connection refused or reset, server restarting) and nothing else."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in TRANSIENT


def new_key(operation: str) -> str:
    """A fresh idempotency key for one logical operation."""
    return f"{operation}-{uuid.uuid4().hex}"


async def call_with_retry(policy: RetryPolicy, attempt_fn: Callable[[float | None], Awaitable[T]], *,
                          operation: str, coordinator: str | None = None) -> T:
    """Calls ``attempt_fn(timeout_s)`` until it succeeds, fails for good, or time runs out.

    The timeout passed in is what is left of the current deadline (None without one).
    gRPC errors come out as typed ``WeightSyncError``s naming ``operation`` (a
    ``CoordinatorUnavailable`` naming ``coordinator`` when the calls never reached it).
    """
    def attempt() -> Awaitable[T]:
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise deadline.expired()
        return attempt_fn(left)

    try:
        return await retry(attempt, policy=policy, retryable=is_transient, time_left=deadline.remaining)
    except grpc.aio.AioRpcError as exc:
        raise coordinator_error(exc, coordinator=coordinator, operation=operation) from exc


__all__ = ["RetryPolicy", "call_with_retry", "is_transient", "new_key", "TRANSIENT"]
