"""Waiting for work that must finish even when the waiter is cancelled
(invariant cancel-waits-for-transfer, docs/invariants.md).

A transfer, or a step on an engine, cannot be abandoned half-way; the caller's
cancellation is remembered and re-raised once the work has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_through_cancellation(future: asyncio.Future, on_cancel: Callable[[], None] | None = None) -> bool:
    """Waits until ``future`` is done even if cancelled meanwhile; True if a cancel arrived.
    ``on_cancel`` runs at each cancellation (to ask the work to stop early)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
            if on_cancel is not None:
                on_cancel()
    return cancelled


__all__ = ["wait_through_cancellation"]
