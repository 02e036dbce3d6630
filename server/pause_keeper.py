"""PauseKeeper: the engine's pause state follows the agent's, whatever reached the engine.

The agent decides whether its engine runs: it holds it paused during a round, while
fenced and while torn, and lets it run otherwise. Its calls can land without its
knowing: a Pause that timed out on the agent's side (vLLM's API server stalled for
longer than the round's deadline) still paused vLLM seconds after the round had
failed, and vLLM then served nothing while the agent, and so readiness, said it was
ready. A person or another client may also pause or resume the engine directly.

So, where the engine can say whether it is paused (``EngineAdapter.paused_now``, read
by the watch's poller off the loop), the keeper compares it with the agent's own
state at every poll, and puts a differing engine back, under the fence's lock (which
Pause, Resume and the fence take too): paused again (KEEP) while the agent holds it,
resumed with all of its memory woken first while the agent lets it run
(``EngineAdapter.resume_awake``: a sleep that landed late pauses vLLM as well, and
leaves the ledger of what sleeps wrong; Invariant 1). Until then readiness says the
engine is not serving (``mismatch``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    from weightsync.server.agent import AgentCore

log = logging.getLogger("weightsync.agent")

REPAUSE_TIMEOUT_S = 10.0


class PauseKeeper:
    """See the module docstring."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core
        self._commanded_at = 0.0  # when the agent last finished pausing or resuming the engine

    def commanded(self) -> None:
        """The agent itself just paused or resumed the engine: a poll begun before now
        may show the state before, and says nothing against the agent's."""
        self._commanded_at = time.monotonic()

    def wanted_paused(self) -> bool:
        core = self.core
        return core.paused or core.fence.fenced

    def mismatch(self) -> str:
        """Why the engine's own pause state differs from the agent's ("" when it does not,
        or when the engine cannot say)."""
        engine = self.core.watch.current()
        if engine.paused is None or engine.asked_at <= self._commanded_at or engine.paused == self.wanted_paused():
            return ""
        return ("the engine is paused while the agent lets it run" if engine.paused
                else "the engine runs while the agent holds it paused")

    async def run(self) -> None:
        """Checks after every poll of the engine, until cancelled."""
        while True:
            await asyncio.sleep(self.core.watch.interval_s)
            try:
                await self.check()
            except Exception as exc:  # the engine is slow or gone: the next poll looks again
                log.warning("could not bring engine %s back to the agent's pause state: %r",
                            self.core.engine_id, exc)

    async def check(self) -> None:
        core = self.core
        if not self.mismatch() or core.fault():
            return
        async with core.fence.lock:
            # Asked again under the lock: the snapshot may predate a Pause or Resume that
            # held the lock meanwhile.
            engine = await core.watch.refresh()
            wanted = self.wanted_paused()
            if engine.paused is None or engine.paused == wanted or core.fault():
                return
            if wanted:
                await core.pause_engine(common_pb2.PAUSE_MODE_KEEP, timeout_s=REPAUSE_TIMEOUT_S)
                core.record("engine_paused_again", why="found running while the agent holds it paused")
            else:
                # Not release_engine: the ledger of what sleeps may be wrong here (a
                # sleep that landed late pauses vLLM too), so all of it is woken first.
                try:
                    await core.run_on_engine(core.adapter.resume_awake)
                finally:
                    self.commanded()
                core.record("engine_resumed_again", why="found paused while the agent lets it run")
            await core.watch.refresh()


__all__ = ["PauseKeeper"]
