"""EngineWatch: the agent's view of its engine, refreshed off the event loop.

Asking an HTTP engine how it is (``GET /health``, ``GET /weight_info``) takes
seconds when vLLM or SGLang is busy. The agent's loop must keep answering Pause,
Resume, GetState and heartbeats meanwhile, so no RPC handler and no heartbeat asks
the engine: they read the last ``EngineSnapshot``, which a poller refreshes on a
thread of its own, at its own cadence. It is not the control thread either: a
slow health check must not hold up a Pause queued behind it.

A version the engine does not report (unreachable, slow, garbage) is *unknown*:
the snapshot keeps the last known one and says so, so versions never go backwards
in GetState or the metrics. A version the agent just committed is known at once; a
poll that was reading while a commit happened is discarded for the version, as it
may predate the commit.

An engine the agent did not launch can be restarted by whatever runs it (systemd,
Kubernetes, a person) between two polls; it comes back holding its boot weights and
none of the old process's state, and says nothing of it but its version record: the
one it boots with ("default" for vLLM and SGLang) where weightsync had written one
(``EngineAdapter.version_is_boot``). The watch counts those restarts (``reboots``)
and hands each to ``on_reboot`` (the agent treats it as a relaunch). An engine the
agent launched is the launcher's to restart, and is not counted here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from weightsync.engine.adapter import EngineAdapter
from weightsync.server.agent.launcher import EngineLauncher
from weightsync.threads import run_in

log = logging.getLogger("weightsync.agent")

DEFAULT_POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine last said about itself."""

    fault: str = ""              # why it cannot serve; "" when healthy
    weight_version: int = 0      # the last version known
    version_known: bool = False  # False: the last reading failed (or none finished yet)
    running: int = 0
    queued: int = 0
    paused: bool | None = None   # whether the engine itself says it is paused; None: it cannot say
    torn_to: int | None = None   # the engine records a receive to this version that never finished
    polled_at: float = 0.0       # time.monotonic() of the poll; 0 = never
    asked_at: float = 0.0        # time.monotonic() when the poll began (its readings are no older)


class EngineWatch:
    """Polls an adapter on its own thread; ``snapshot`` is always ready to read."""

    def __init__(self, adapter: EngineAdapter, *, launcher: EngineLauncher | None = None,
                 interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        self.adapter = adapter
        self.launcher = launcher
        self.interval_s = interval_s
        self.snapshot = EngineSnapshot()
        self._commits = 0                # bumped by committed(); guards a poll that raced a commit
        self._lock = threading.Lock()
        self.reboots = 0              # restarts of an engine nobody here launched, seen in its record
        self._reboots_handled = 0
        self._reboot_in_hand = False  # on_reboot is running: the engine is not fenced yet
        self._recorded = False        # the engine was last seen holding a version record weightsync wrote
        self.on_reboot: Callable[[], Awaitable[None]] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightsync-health")

    def current(self) -> EngineSnapshot:
        """The snapshot; read live instead when the adapter's state is local memory."""
        if self.adapter.state_is_local:
            return self.poll_once()
        return self.snapshot

    def fault(self) -> str:
        """The engine's fault, or its launched process's (checked now: a poll())."""
        launched = self.launcher.fault() if self.launcher is not None else None
        return self.current().fault or launched or ""

    def committed(self, version: int) -> None:
        """The agent recorded ``version`` in the engine: it is known without asking."""
        with self._lock:
            self._commits += 1
            self._recorded = True
            self.snapshot = dataclasses.replace(self.snapshot, weight_version=version, version_known=True,
                                                torn_to=None)

    @property
    def reboot_pending(self) -> bool:
        """A restart was seen and ``on_reboot`` has not finished with it: the engine holds
        its boot weights and may not be fenced yet, so nothing may resume it meanwhile
        (a vLLM booted paused would otherwise be let run by the pause keeper)."""
        return self.reboots != self._reboots_handled or self._reboot_in_hand

    def poll_once(self) -> EngineSnapshot:
        """Asks the engine (blocking: call on the watch's thread) and stores the answer."""
        asked_at = time.monotonic()
        with self._lock:
            commits = self._commits
        fault = self.adapter.fault() or ""
        version = self.adapter.weight_version
        torn_to = self.adapter.torn_to()
        running, queued = self.adapter.counts()
        paused = self.adapter.paused_now()
        boot = self.adapter.version_is_boot()
        with self._lock:
            last = self.snapshot
            if commits != self._commits:  # a commit landed mid-poll: the reading may predate it
                version, version_known = last.weight_version, last.version_known
            elif version is None:  # not readable now: keep the last known, flagged unknown
                version, version_known = last.weight_version, False
            else:
                version_known = True
                if boot is not None and self.launcher is None:
                    if boot and self._recorded:
                        self.reboots += 1
                    self._recorded = not boot
            self.snapshot = EngineSnapshot(fault=fault, weight_version=version, version_known=version_known,
                                           running=running, queued=queued, paused=paused, torn_to=torn_to,
                                           polled_at=time.monotonic(), asked_at=asked_at)
            return self.snapshot

    async def refresh(self) -> EngineSnapshot:
        """One poll, off the loop."""
        return await run_in(self._executor, self.poll_once)

    async def run(self) -> None:
        """Polls until cancelled; a failing poll is logged and retried next interval."""
        while True:
            try:
                await self.refresh()
                if self.reboots != self._reboots_handled and self.on_reboot is not None:
                    self._reboots_handled, self._reboot_in_hand = self.reboots, True
                    try:
                        await self.on_reboot()
                    finally:
                        self._reboot_in_hand = False
            except Exception as exc:
                log.warning("engine poll failed: %r", exc)
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["EngineSnapshot", "EngineWatch", "DEFAULT_POLL_INTERVAL_S"]
