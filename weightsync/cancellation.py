"""Waiting for work that must finish even when the waiter is cancelled (invariant 6).

A transfer, or a step on an engine, cannot be abandoned half-way; the caller's
cancellation is remembered and re-raised once the work has ended.
"""

from __future__ import annotations

import asyncio


async def wait_through_cancellation(future: asyncio.Future) -> bool:
    """Waits until ``future`` is done even if cancelled meanwhile; True if a cancel arrived."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


__all__ = ["wait_through_cancellation"]
