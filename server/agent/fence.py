"""Version fencing: an engine never serves weights older than the fleet's.

The coordinator's version ledger is the truth; the agent hears the fleet's version at
registration and in every heartbeat answer. The agent fences its engine (keeps it
paused, so no request makes progress) from start-up until it knows the fleet's version,
and whenever its engine holds an older one: a new replica or a relaunched engine that
booted with the base checkpoint, an engine that missed a round while it could not be
reached. A fenced engine is still *available*: the next round's Pause takes it in, its
Broadcast brings it to the fleet's version, and its Resume releases it. A Resume that
would release an engine still behind is refused (``ENGINE_BEHIND``). A fence the agent
raised and nothing else holds (no round's Pause, no torn weights) is lifted by the agent
itself once the engine is current.

``ready`` is what routers follow: the fleet's version known and held, and the engine
neither paused, fenced, torn, faulted nor receiving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightsync.errors import FailedPrecondition
from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    from weightsync.server.agent.engine_ledger import EngineCommands, EngineLedger

log = logging.getLogger("weightsync.agent")
FENCE_PAUSE_TIMEOUT_S = 30.0
ENGINE_BEHIND = "ENGINE_BEHIND"


class VersionFence:
    """The fence of one agent's engine. All state changes happen on the agent's event
    loop, one at a time; engine calls go through the agent's control thread."""

    def __init__(self, ledger: EngineLedger, control: EngineCommands) -> None:
        self.ledger = ledger
        self.control = control
        # Why the engine's own pause state differs from the agent's (the pause keeper's
        # ``mismatch``, set once both exist): an engine in doubt is not ready.
        self.pause_mismatch: Callable[[], str] = lambda: ""
        self.fleet_version: int | None = None  # None until the coordinator has said
        self.fenced = False
        self.lock = asyncio.Lock()  # held by the agent's Pause and Resume too: no release races a pause
        self._checking: asyncio.Task | None = None

    # ----- what the agent reads -------------------------------------------------------

    def behind(self, engine_version: int) -> bool:
        """Whether ``engine_version`` is older than the fleet's (unknown fleet: not)."""
        return self.fleet_version is not None and engine_version < self.fleet_version

    def not_ready_reason(self) -> str:
        """Why the engine should get no traffic now; "" when it is ready."""
        control = self.control
        engine = control.watch.current()
        fault = control.fault()
        reasons = (
            (fault, f"faulted: {fault}"),
            (self.fleet_version is None, "the fleet's version is not known yet (not registered)"),
            (not engine.version_known, "the engine's version cannot be read"),
            (self.behind(engine.weight_version),
             f"holds version {engine.weight_version}, the fleet's is {self.fleet_version}"),
            (self.ledger.torn, f"torn weights (a failed move to version {self.ledger.torn_version})"),
            (self.ledger.receiving(), "receiving weights"),
            (self.fenced, "fenced"),
            (self.ledger.paused, "paused"),
            (mismatch := self.pause_mismatch(), mismatch),
        )
        return next((why for condition, why in reasons if condition), "")

    def check_resume(self, engine_version: int) -> None:
        """Refuses to release an engine that holds weights older than the fleet's; it
        stays paused (and fenced) until a broadcast brings it up."""
        if self.behind(engine_version):
            raise FailedPrecondition(
                f"engine {self.control.engine_id} holds version {engine_version}, older than the fleet's "
                f"{self.fleet_version}; it stays paused until a broadcast brings it to the fleet's version",
                reason=ENGINE_BEHIND, metadata={"engine_id": self.control.engine_id,
                                                "fleet_version": str(self.fleet_version)})
        if self.fenced:
            self.fenced = False
            self.control.record("unfenced", version=engine_version, fleet_version=self.fleet_version)

    async def stop(self) -> None:
        """Ends a check in flight (shutdown); the engine stays as it is."""
        if self._checking is not None and not self._checking.done():
            self._checking.cancel()
            await asyncio.wait({self._checking}, timeout=FENCE_PAUSE_TIMEOUT_S)

    # ----- raising and lifting --------------------------------------------------------

    async def raise_now(self, *, why: str) -> None:
        """Fences the engine without asking its version: at start-up, before registering
        (the fleet's version is not known yet), and after a relaunch (boot weights).
        KEEP: a request already in flight (an agent restarted beside a running engine)
        waits instead of being dropped. A heartbeat answer lifts it if it is current."""
        async with self.lock:
            try:
                await self.control.pause_engine(common_pb2.PAUSE_MODE_KEEP, timeout_s=FENCE_PAUSE_TIMEOUT_S)
            except Exception as exc:  # a faulted engine is reported as such; it cannot serve anyway
                log.warning("could not pause engine %s to fence it: %r", self.control.engine_id, exc)
            self.fenced = True
            self.control.record("fenced", why=why)

    async def learn(self, fleet_version: int) -> None:
        """The coordinator said the fleet's version (registration): apply it now."""
        self.fleet_version = fleet_version
        await self.check()

    def heard(self, fleet_version: int) -> None:
        """The fleet's version from a heartbeat answer: applied on a task of its own, so
        a slow engine never delays the heartbeats; one check at a time."""
        self.fleet_version = fleet_version
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self.check())

    async def check(self) -> None:
        """Fences an engine found behind (ABORT: its running requests were computed with
        stale weights), or lifts a fence once the engine is current. A receive in
        flight settles the question itself, so nothing is done during one. The engine's
        version is the watched one (polled on the watch's thread, updated at every
        commit): this runs at every heartbeat and must not ask the engine each time."""
        control = self.control
        async with self.lock:
            if self.fleet_version is None or self.ledger.receiving() or control.fault():
                return
            engine = control.watch.current()
            if not engine.version_known:
                return  # cannot tell now; the next heartbeat looks again
            served = engine.weight_version
            try:
                if self.behind(served) and not self.fenced:
                    await control.pause_engine(common_pb2.PAUSE_MODE_ABORT, timeout_s=FENCE_PAUSE_TIMEOUT_S)
                    self.fenced = True
                    control.record("fenced", version=served, fleet_version=self.fleet_version)
                elif not self.behind(served) and self.fenced and not self.ledger.torn:
                    await self._lift(served)  # a torn engine stays held until a good receive
            except Exception as exc:
                log.warning("version fence check of engine %s failed: %r", control.engine_id, exc)

    async def _lift(self, served: int) -> None:
        control = self.control
        self.fenced = False
        control.record("unfenced", version=served, fleet_version=self.fleet_version)
        if self.ledger.paused:
            return  # a round's Pause holds the engine too; its Resume releases it
        await control.release_engine()


__all__ = ["VersionFence", "ENGINE_BEHIND"]
