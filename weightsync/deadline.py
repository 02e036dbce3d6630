"""Deadlines that travel with the work: a ContextVar holding (absolute deadline, operation).

``with deadline.scope(seconds)`` sets a step or sync deadline; ``with
deadline.operation("broadcast")`` names what is running. Both are ContextVars, so
``loop.run_in_executor`` with a copied context carries them into the transfer thread,
and ``remaining()`` there gives the same budget the event loop sees. Whichever side
fires first, the error is a ``StepTimeoutError`` naming the same operation.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass

from weightsync.errors import StepTimeoutError


@dataclass(frozen=True)
class _Deadline:
    at: float          # time.monotonic() value
    operation: str


_current: contextvars.ContextVar[_Deadline | None] = contextvars.ContextVar("weightsync_deadline", default=None)


@contextlib.contextmanager
def scope(seconds: float | None, *, operation: str = "sync") -> Iterator[None]:
    """Sets a deadline ``seconds`` from now (never later than an enclosing one)."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise ValueError(f"deadline seconds must be positive, got {seconds}")
    at = time.monotonic() + seconds
    outer = _current.get()
    if outer is not None and outer.at < at:
        at = outer.at
    token = _current.set(_Deadline(at, operation))
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def fresh(seconds: float, *, operation: str) -> Iterator[None]:
    """A new deadline ``seconds`` from now that replaces (not nests in) the current one.

    For cleanup that must run even after the caller's deadline is spent.
    """
    token = _current.set(None)
    try:
        with scope(seconds, operation=operation):
            yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def operation(name: str) -> Iterator[None]:
    """Names the operation running under the current deadline."""
    outer = _current.get()
    token = _current.set(_Deadline(outer.at if outer else float("inf"), name))
    try:
        yield
    finally:
        _current.reset(token)


def current_operation() -> str:
    """The name of the running operation, or ``"unknown"``."""
    d = _current.get()
    return d.operation if d else "unknown"


def remaining(default: float | None = None) -> float | None:
    """Seconds left (>= 0), or ``default`` when no deadline is set."""
    d = _current.get()
    if d is None or d.at == float("inf"):
        return default
    return max(0.0, d.at - time.monotonic())


def expired() -> StepTimeoutError:
    """The error for the current operation's deadline."""
    return StepTimeoutError(f"deadline exceeded during {current_operation()}", operation=current_operation())


__all__ = ["scope", "fresh", "operation", "current_operation", "remaining", "expired"]
