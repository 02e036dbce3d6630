"""The event log both servers keep (``weightsync/event_log.py``), in process; the
streams built on it (WatchEvents, GetEvents) are tested against real servers in
test_observability.py and test_idempotency.py."""

from __future__ import annotations

import asyncio
import logging

from weightsync.event_log import EventLog


def test_readers_get_what_came_after_their_last_event_and_may_wait_for_more():
    async def go():
        events = EventLog(logging.getLogger("test"), engine_id="e0", max_events=3)
        waiting = asyncio.create_task(events.wait_after(0, timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing yet: the reader waits
        events.append("paused", key="k1", mode="ABORT")
        woken = await waiting
        for kind in ("b", "c", "d"):
            events.append(kind, engine_id="e1")
        return woken, events.after(0), events.after(3), await events.wait_after(4, timeout_s=0.05)

    woken, kept, after_three, nothing = asyncio.run(go())
    assert [(e.seq, e.kind, e.engine_id, e.idempotency_key, dict(e.fields)) for e in woken] == [
        (1, "paused", "e0", "k1", {"mode": "ABORT"})]
    assert [(e.seq, e.kind, e.engine_id) for e in kept] == [(2, "b", "e1"), (3, "c", "e1"), (4, "d", "e1")]  # bounded
    assert [e.seq for e in after_three] == [4]
    assert nothing == []  # the wait is bounded
