"""Running a function on a chosen thread pool with the caller's context.

``asyncio.to_thread`` carries the caller's ``contextvars`` (the operation's deadline,
its idempotency key) into the default pool. Work that must run on a particular
thread -- an engine's control thread, the transfer thread, the SQLite thread, the
trainer's sender -- needs the same, and this is the one place that does it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


def run_in(executor: Executor | None, fn: Callable[..., T], /, *args, **kwargs) -> asyncio.Future[T]:
    """Schedules ``fn(*args, **kwargs)`` on ``executor`` (None: the loop's default pool)
    in a copy of the caller's context; returns the future to await. Call it from a
    coroutine or a callback running on the event loop."""
    ctx = contextvars.copy_context()
    return asyncio.get_running_loop().run_in_executor(executor, functools.partial(ctx.run, fn, *args, **kwargs))


__all__ = ["run_in"]
