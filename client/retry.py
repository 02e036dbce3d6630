"""Client retry policy: transient failures only, bounded, with exponential back-off and jitter.

The idempotency key is made once per logical operation, before the first attempt,
and reused on every attempt: that is what makes a retry safe. Errors that a retry
cannot fix (INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION, ...) are never
retried.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from weightsync import deadline
from weightsync.errors import from_rpc_error

T = TypeVar("T")

TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2          # +-20% random spread, so clients do not retry in lockstep

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s or self.multiplier < 1:
            raise ValueError("backoff must satisfy 0 <= initial <= max and multiplier >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")

    def backoff(self, attempt: int) -> float:
        """Delay before attempt ``attempt + 1`` (attempt counts from 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


def is_transient(error: grpc.RpcError) -> bool:
    """UNAVAILABLE (connection refused or reset, server restarting) and nothing else."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in TRANSIENT


def new_key(operation: str) -> str:
    """A fresh idempotency key for one logical operation."""
    return f"{operation}-{uuid.uuid4().hex}"


async def call_with_retry(policy: RetryPolicy, attempt_fn: Callable[[float | None], Awaitable[T]], *,
                          operation: str) -> T:
    """Calls ``attempt_fn(timeout_s)`` until it succeeds, fails for good, or time runs out.

    The timeout passed in is what is left of the current deadline (None without one).
    gRPC errors come out as typed ``WeightSyncError``s naming ``operation``.
    """
    attempt = 0
    while True:
        attempt += 1
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise deadline.expired()
        try:
            return await attempt_fn(left)
        except grpc.aio.AioRpcError as exc:
            delay = policy.backoff(attempt)
            left = deadline.remaining()
            if not is_transient(exc) or attempt >= policy.max_attempts or (left is not None and left <= delay):
                raise from_rpc_error(exc, operation=operation) from exc
            await asyncio.sleep(delay)


__all__ = ["RetryPolicy", "call_with_retry", "is_transient", "new_key", "TRANSIENT"]
