"""What happened in one server, in order: the coordinator's ``WatchEvents`` stream and
the agent's ``GetEvents`` read the same kind of log.

Each event gets the next sequence number; a reader asks for what came after the last
one it saw, and may wait (bounded) for more. The log is bounded (the oldest events
go first) and is appended to on the server's event loop only. Every event is also
logged, so the process log and the event stream tell the same story.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from weightsync.v1 import common_pb2

MAX_EVENTS = 10_000


class EventLog:
    """A bounded, ordered event log (see the module docstring).

    Args:
        logger: where each event is also logged.
        engine_id: the engine every event is about, unless an append names another
            (an agent's log is about its engine; the coordinator's about many).
        max_events: how many events are kept.
    """

    def __init__(self, logger: logging.Logger, *, engine_id: str = "", max_events: int = MAX_EVENTS) -> None:
        self._logger = logger
        self._engine_id = engine_id
        self._events: deque[common_pb2.Event] = deque(maxlen=max_events)
        self._seq = 0
        self._appended: asyncio.Event | None = None  # set, then replaced, on every append

    def append(self, kind: str, *, engine_id: str = "", key: str = "", **fields: object) -> common_pb2.Event:
        """Adds an event (``key``: the idempotency key of the operation it belongs to)."""
        self._seq += 1
        event = common_pb2.Event(seq=self._seq, unix_time=time.time(), kind=kind,
                                 engine_id=engine_id or self._engine_id, idempotency_key=key,
                                 fields={k: str(v) for k, v in fields.items()})
        self._events.append(event)
        self._logger.info("%s %s %s", kind, event.engine_id, fields or "")
        if self._appended is not None:
            self._appended.set()
            self._appended = None
        return event

    def after(self, seq: int) -> list[common_pb2.Event]:
        """The events kept with a sequence number above ``seq``, oldest first."""
        return [e for e in self._events if e.seq > seq]

    async def wait_after(self, seq: int, timeout_s: float) -> list[common_pb2.Event]:
        """``after(seq)``, waiting up to ``timeout_s`` for one if there is none yet."""
        pending = self.after(seq)
        if pending:
            return pending
        if self._appended is None:
            self._appended = asyncio.Event()
        try:
            await asyncio.wait_for(self._appended.wait(), timeout=timeout_s)
        except TimeoutError:
            return []
        return self.after(seq)


__all__ = ["EventLog", "MAX_EVENTS"]
