"""Retrying a gRPC call: the one loop every caller uses -- the trainer's client, an
agent's registration, the coordinator's calls to agents.

What may be retried, how often and how patiently differ by caller and are passed in.
Every retried call carries one idempotency key for all its attempts (made before the
first), which is what makes a retry safe: a retry attaches to, or replays, the first.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry."""

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
        return base * (1 + random.uniform(-self.jitter, self.jitter)) if self.jitter else base


def unavailable(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE: connection refused or reset, a server restarting."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE


async def retry(attempt: Callable[[], Awaitable[T]], *, policy: RetryPolicy,
                retryable: Callable[[grpc.aio.AioRpcError], bool] = unavailable,
                time_left: Callable[[], float | None] = lambda: None) -> T:
    """``await attempt()`` until it succeeds, fails with an error ``retryable`` refuses,
    has run ``policy.max_attempts`` times, or the next back-off would outlast
    ``time_left()`` (seconds, None for no deadline); then the last error is raised as
    it came. Only gRPC errors are retried; anything else propagates at once."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt()
        except grpc.aio.AioRpcError as exc:
            delay = policy.backoff(attempts)
            left = time_left()
            if not retryable(exc) or attempts >= policy.max_attempts or (left is not None and left <= delay):
                raise
            await asyncio.sleep(delay)


__all__ = ["RetryPolicy", "retry", "unavailable"]
