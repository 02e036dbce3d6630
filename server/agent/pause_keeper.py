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
leaves the ledger of what sleeps wrong; invariant kv-awake). Until then readiness says the
engine is not serving (``mismatch``).

An engine that cannot say (SGLang) is put back on doubt instead: a pause or resume
whose outcome is unknown (unreachable, timed out: it may land later, or never did)
and an engine that answers again after it could not be reached (it may have been
restarted, or taken a queued call meanwhile) leave the keeper in doubt. From the
next check with the engine healthy, for ``SETTLE_S``, every check sends it the
agent's state again: a pause while the agent holds it paused, a resume (through
``release_engine``, which wakes what the ledger says sleeps) while it lets it run.
A window, not one call: a stalled server that goes on handles the requests it had
queued in any order, and a late pause landed after the first resume sent again.
Found with an SGLang that came up after its agent, with the fleet at version 1: the
agent's fence had tried to pause it while it could not be reached, then reported it
paused and fenced while SGLang, never asked again, served its boot weights to
whoever called it.

An engine seen booted again (``EngineWatch.reboot_pending``) is left alone until the
agent's reboot handler has fenced it: it holds its boot weights, and a vLLM booted
paused (``weightsync/engine/vllm_boot_paused.py``) would otherwise be found "paused
while the agent lets it run" by the very poll that told the restart, and resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    from weightsync.server.agent.engine_ledger import EngineCommands, EngineLedger
    from weightsync.server.agent.fence import VersionFence

log = logging.getLogger("weightsync.agent")

REPAUSE_TIMEOUT_S = 10.0
SETTLE_S = 5.0  # how long the state is sent again after doubt, from the engine's first healthy check


class PauseKeeper:
    """See the module docstring."""

    def __init__(self, ledger: EngineLedger, control: EngineCommands, fence: VersionFence) -> None:
        self.ledger = ledger
        self.control = control
        self.fence = fence
        self._commanded_at = 0.0  # when the agent last finished pausing or resuming the engine
        # An engine that cannot say: since when its state is in doubt (0: it is not), and
        # until when the agent's state is sent again.
        self._doubt_at = 0.0
        self._send_until = 0.0
        self._was_faulted = False

    def commanded(self, *, landed: bool = True) -> None:
        """The agent itself just paused or resumed the engine: a poll begun before now
        may show the state before, and says nothing against the agent's. ``landed``:
        False when the call failed, so whether it reached the engine is unknown (a
        call that landed settles nothing: an earlier one may land after it)."""
        self._commanded_at = time.monotonic()
        if not landed:
            self._doubt_at = self._commanded_at

    @property
    def in_doubt(self) -> bool:
        """Whether the engine's pause state is in doubt and not yet acted on."""
        return self._doubt_at > 0

    def wanted_paused(self) -> bool:
        return self.ledger.paused or self.fence.fenced

    def mismatch(self) -> str:
        """Why the engine's own pause state differs from the agent's, or (an engine that
        cannot say) may differ; "" when it does not."""
        engine = self.control.watch.current()
        if engine.paused is None:  # it cannot say: what the agent does not know is in doubt
            if self.in_doubt or time.monotonic() < self._send_until:
                return "the engine's pause state is in doubt (a pause or resume of unknown outcome); sending it again"
            return ""
        if engine.asked_at <= self._commanded_at or engine.paused == self.wanted_paused():
            return ""
        return ("the engine is paused while the agent lets it run" if engine.paused
                else "the engine runs while the agent holds it paused")

    async def run(self) -> None:
        """Checks after every poll of the engine, until cancelled."""
        while True:
            await asyncio.sleep(self.control.watch.interval_s)
            try:
                await self.check()
            except Exception as exc:  # the engine is slow or gone: the next poll looks again
                log.warning("could not bring engine %s back to the agent's pause state: %r",
                            self.control.engine_id, exc)

    async def check(self) -> None:
        control = self.control
        faulted = bool(control.fault())
        now = time.monotonic()
        if self._was_faulted and not faulted:
            self._doubt_at = now  # back after it could not be reached: whatever it holds now is unknown
        self._was_faulted = faulted
        if control.watch.reboot_pending:
            # An engine seen booted again is the reboot handler's to fence, not this
            # keeper's to resume: a vLLM booted paused holds its boot weights.
            return
        engine = control.watch.current()
        if engine.paused is None:
            if faulted or self.ledger.receiving():
                return
            if self.in_doubt:
                # Only once a poll begun after the doubt found the engine answering: a
                # stalled engine's last snapshot still looks healthy.
                if engine.asked_at <= self._doubt_at:
                    return
                self._doubt_at, self._send_until = 0.0, now + SETTLE_S
                await self._send_again(first=True)
            elif now < self._send_until:
                await self._send_again(first=False)
            return
        if not self.mismatch() or faulted:
            return
        async with self.fence.lock:
            # Asked again under the lock: the snapshot may predate a Pause or Resume that
            # held the lock meanwhile.
            engine = await control.watch.refresh()
            wanted = self.wanted_paused()
            if engine.paused is None or engine.paused == wanted or control.fault() or control.watch.reboot_pending:
                return
            if wanted:
                await control.pause_engine(common_pb2.PAUSE_MODE_KEEP, timeout_s=REPAUSE_TIMEOUT_S)
                control.record("engine_paused_again", why="found running while the agent holds it paused")
            else:
                # Not release_engine: the ledger of what sleeps may be wrong here (a
                # sleep that landed late pauses vLLM too), so all of it is woken first.
                try:
                    await control.run_on_engine(control.adapter.resume_awake)
                finally:
                    self.commanded()
                control.record("engine_resumed_again", why="found paused while the agent lets it run")
            await control.watch.refresh()

    async def _send_again(self, *, first: bool) -> None:
        """The agent's pause state, sent again to an engine that cannot say its own."""
        control = self.control
        async with self.fence.lock:
            if control.fault() or self.ledger.receiving() or control.watch.reboot_pending:
                return
            if self.wanted_paused():
                await control.pause_engine(common_pb2.PAUSE_MODE_KEEP, timeout_s=REPAUSE_TIMEOUT_S)
            else:
                await control.release_engine()
            if first:
                control.record("engine_pause_state_sent_again", paused=self.wanted_paused())


__all__ = ["PauseKeeper"]
