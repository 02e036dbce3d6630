"""Progress events of a running Broadcast, for the caller that drives it.

A Broadcast's progress (the ``Rendezvous``, then any ``engine_failed``) tells one
trainer to send, and to stop. Exactly one caller may drive a round: a concurrent
duplicate of a live call gets just the result, or two senders would feed one group.
But a trainer whose stream breaks retries with the same key and attaches to the
running operation; it must still get the rendezvous (else it never sends and the
round waits out its deadline). So the events of one key go through a channel that
keeps its history and has one driver at a time: when the driver's stream ends
before the round does, the next caller waiting on the key becomes the driver and
first gets everything published so far.
"""

from __future__ import annotations

import asyncio

from weightsync.v1 import coordinator_pb2


class BroadcastProgress:
    """One running Broadcast's events, delivered in order to its current driver."""

    def __init__(self) -> None:
        self.history: list[coordinator_pb2.BroadcastResponse] = []
        self.driver: asyncio.Queue | None = None
        self.waiting: list[asyncio.Queue] = []  # attached callers, next drivers in order
        self.finished = False  # the round ended: nobody is promoted to drive it any more

    @property
    def subscribers(self) -> int:
        return (self.driver is not None) + len(self.waiting)

    def publish(self, event: coordinator_pb2.BroadcastResponse) -> None:
        self.history.append(event)
        if self.driver is not None:
            self.driver.put_nowait(event)

    def subscribe(self, queue: asyncio.Queue) -> None:
        """``queue`` drives the round if no live caller does, else waits its turn."""
        if self.driver is None:
            self._drive(queue)
        else:
            self.waiting.append(queue)

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        if queue in self.waiting:
            self.waiting.remove(queue)
        elif queue is self.driver:
            self.driver = None
            if self.waiting and not self.finished:
                self._drive(self.waiting.pop(0))

    def finish(self) -> None:
        """The round ended; callers still attached get just its result."""
        self.finished = True

    def _drive(self, queue: asyncio.Queue) -> None:
        if self.finished:
            self.waiting.append(queue)
            return
        self.driver = queue
        for event in self.history:
            queue.put_nowait(event)


__all__ = ["BroadcastProgress"]
