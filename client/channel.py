"""LoopChannel: a client's gRPC channel, on whichever event loop its caller runs.

A ``grpc.aio`` channel belongs to the event loop it was opened on. Trainers written
as plain synchronous loops drive an async client with ``asyncio.run(...)`` once per
step, each time on a new event loop; a channel opened on the first of them then fails
every later call with a bare ``RuntimeError: Event loop is closed`` (and a coroutine
that was never awaited). So the client asks this object for its stub at every call:
on the loop the channel belongs to it is that channel's; on another loop, once the
old one is closed or stopped, a fresh channel is opened there (nothing else a
weightsync client holds belongs to a loop: its rendezvous store, senders and worker
threads are threads). A loop still running in another thread may be in the middle of
a call on the old channel, so that is refused with a typed error rather than
guessed at.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from weightsync.errors import FailedPrecondition

Stub = TypeVar("Stub")


class LoopChannel(Generic[Stub]):
    """Opens ``open_channel()`` on the running loop when first asked, and again whenever
    the caller's loop changes; ``make_stub(channel)`` builds the stub the caller uses."""

    def __init__(self, open_channel: Callable[[], grpc.aio.Channel], make_stub: Callable[[grpc.aio.Channel], Stub],
                 *, owner: str) -> None:
        self._open_channel = open_channel
        self._make_stub = make_stub
        self._owner = owner  # named in the error
        self._channel: grpc.aio.Channel | None = None
        self._stub: Stub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.opened = 0  # channels opened so far (tests, logs)

    def stub(self) -> Stub:
        """The stub for the running loop. FailedPrecondition while the channel's own loop
        still runs in another thread."""
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._stub is not None:
            return self._stub
        if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
            raise FailedPrecondition(
                f"{self._owner} is in use by an event loop running in another thread; "
                "use one client per event loop, or call it from one loop at a time")
        self._abandon()
        self._channel = self._open_channel()
        self._stub = self._make_stub(self._channel)
        self._loop = loop
        self.opened += 1
        return self._stub

    async def connect(self, *, keep_trying_s: float, attempt_timeout_s: float) -> bool:
        """Whether the channel (of the running loop) gets connected: False once an
        attempt has failed and ``keep_trying_s`` has passed, or when nothing at all has
        happened within ``max(keep_trying_s, attempt_timeout_s)`` (an address that
        never answers, not even with a refusal)."""
        self.stub()
        channel = self._channel
        assert channel is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        end = started + max(keep_trying_s, attempt_timeout_s)
        state = channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and loop.time() - started >= keep_trying_s:
                return False
            now = loop.time()
            if now >= end:
                return False
            # After a failed attempt, look again once keep_trying_s is up: the channel
            # may wait out its reconnect back-off in TRANSIENT_FAILURE until then.
            left = end - now
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                left = min(left, started + keep_trying_s - now)
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                pass  # the loop decides by the time and the state
            state = channel.get_state(try_to_connect=True)
        return True

    def _abandon(self) -> None:
        """Lets go of a channel whose loop is closed or stopped: it cannot be awaited from
        here, and grpc closes a channel it no longer has a reference to (its ``__del__``)."""
        self._channel = self._stub = self._loop = None

    async def aclose(self) -> None:
        """Closes the channel: awaited on its own loop, let go of from any other."""
        channel, loop = self._channel, self._loop
        if channel is None:
            return
        try:
            if loop is asyncio.get_running_loop():
                await channel.close(grace=None)
        finally:
            self._abandon()


__all__ = ["LoopChannel"]
