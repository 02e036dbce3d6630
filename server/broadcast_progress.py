"""Progress events of a running Broadcast, for every caller attached to it.

A trainer whose Broadcast stream breaks retries with the same key and attaches to
the running operation. It must still get the ``Rendezvous`` (else it never sends and
the round waits out its deadline) and any ``engine_failed`` (else it keeps sending
to a round that cannot complete). So events go to a per-key channel that keeps its
history: a caller that subscribes late first gets everything published so far.
"""

from __future__ import annotations

import asyncio

from weightsync.v1 import coordinator_pb2


class BroadcastProgress:
    """One running Broadcast's events; every subscriber gets all of them, in order."""

    def __init__(self) -> None:
        self.history: list[coordinator_pb2.BroadcastEvent] = []
        self.subscribers: set[asyncio.Queue] = set()

    def publish(self, event: coordinator_pb2.BroadcastEvent) -> None:
        self.history.append(event)
        for queue in self.subscribers:
            queue.put_nowait(event)

    def subscribe(self, queue: asyncio.Queue) -> None:
        """From now on ``queue`` gets every event, after those published so far."""
        for event in self.history:
            queue.put_nowait(event)
        self.subscribers.add(queue)

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.subscribers.discard(queue)


__all__ = ["BroadcastProgress"]
