"""EngineLauncher: starts the engine an agent owns, watches it, and stops its whole tree.

The command runs under ``weightsync.reaper`` (see there for why), in a process group
of its own, with a parent-death signal: if the agent is SIGKILLed, the reaper still
takes the engine's entire tree down. Readiness and liveness come from the engine's
HTTP health URL when one is given (vLLM: ``/health``), else from the process being
alive. A fault (exit, health failing for ``unhealthy_after_s`` -- cleared when it
answers again and is not relaunched --, or the adapter's
``restart_needed``: an engine alive and healthy that can only be trusted again after
a restart) is reported in the agent's heartbeats, so the coordinator marks the
engine unavailable.

With ``restart="on-failure"`` a faulted engine is relaunched, up to ``max_restarts``
times, with a back-off that doubles from ``backoff_s`` (capped at ``MAX_BACKOFF_S``):
its old tree is reaped first, the fault is reported until the new engine is healthy,
and ``on_relaunch`` then lets the agent fence it (a relaunched engine holds its boot
weights, older than the fleet's) before the fault clears.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence

from weightsync.errors import EngineUnavailable, StepTimeoutError
from weightsync.lifecycle import spawn, terminate_tree

log = logging.getLogger("weightsync.launcher")
RESTART_POLICIES = ("no", "on-failure")
MAX_BACKOFF_S = 30.0


class EngineLauncher:
    """Owns one launched engine process tree."""

    def __init__(self, command: Sequence[str], *, health_url: str = "", ready_timeout_s: float = 120.0,
                 grace_s: float = 10.0, check_interval_s: float = 1.0, unhealthy_after_s: float = 5.0,
                 log_path: str = "", restart: str = "no", max_restarts: int = 0, backoff_s: float = 1.0,
                 on_relaunch: Callable[[], Awaitable[None]] | None = None,
                 restart_needed: Callable[[], str] | None = None) -> None:
        if not command:
            raise ValueError("--launch needs a command")
        if restart not in RESTART_POLICIES:
            raise ValueError(f"--restart must be one of {', '.join(RESTART_POLICIES)}, got {restart!r}")
        if max_restarts < 0 or backoff_s < 0:
            raise ValueError("--max-restarts and the back-off must not be negative")
        self.restart = restart
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.on_relaunch = on_relaunch
        # Asks the engine's adapter whether the engine, alive and healthy, can only be
        # trusted again after a restart (e.g. vLLM after a call to its workers timed
        # out); called on the loop, so it must answer from memory.
        self.restart_needed = restart_needed
        self.restarts = 0
        self._relaunching = ""
        self.command = list(command)
        self.health_url = health_url
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.check_interval_s = check_interval_s
        self.unhealthy_after_s = unhealthy_after_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._last_healthy = time.monotonic()
        self._fault: str | None = None

    def start(self) -> None:
        """Starts the reaper and, under it, the engine command."""
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - owned by the child
        try:
            self.proc = spawn([sys.executable, "-m", "weightsync.reaper", "--parent", str(os.getpid()),
                               "--grace", str(self.grace_s), "--", *self.command],
                              stdout=out, stderr=out, death_signal=signal.SIGTERM)
        finally:
            if out is not None:
                out.close()
        log.info("launched engine (reaper pid %d): %s", self.proc.pid, " ".join(self.command))

    def _healthy_once(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=min(2.0, self.check_interval_s * 2)) as r:
                return 200 <= r.status < 300
        except (urllib.error.URLError, OSError, ValueError):
            return False

    async def wait_ready(self) -> None:
        """Waits until the engine answers its health check (or, without one, is still alive
        after a moment). Raises EngineUnavailable if it exits, StepTimeoutError on the deadline."""
        end = time.monotonic() + self.ready_timeout_s
        while True:
            code = self.proc.poll() if self.proc else -1
            if code is not None:
                raise EngineUnavailable(f"engine exited with code {code} before it was ready")
            if not self.health_url:
                await asyncio.sleep(min(0.5, self.ready_timeout_s))
                if self.proc.poll() is None:
                    break
                continue
            if await asyncio.to_thread(self._healthy_once):
                break
            if time.monotonic() > end:
                raise StepTimeoutError(f"engine not healthy at {self.health_url} within {self.ready_timeout_s}s",
                                       operation="launch")
            await asyncio.sleep(0.2)
        self._last_healthy = time.monotonic()

    async def monitor(self) -> None:
        """Runs until cancelled, keeping ``fault()`` current and relaunching a faulted
        engine where the restart policy allows."""
        while True:
            code = self.proc.poll() if self.proc else None
            if code is not None:
                self._fault = f"engine process exited with code {code}"
            elif self.health_url:
                if await asyncio.to_thread(self._healthy_once):
                    self._last_healthy = time.monotonic()
                    if self._fault == self._unanswered():
                        # Answering again, and not relaunched (no restart left, or none
                        # allowed): it can serve again; the agent puts its pause state back.
                        self._fault = None
                elif time.monotonic() - self._last_healthy > self.unhealthy_after_s:
                    self._fault = self._unanswered()
            if code is None and self.restart_needed is not None and (why := self.restart_needed()):
                self._fault = why
            if self._fault and self.restart == "on-failure" and self.restarts < self.max_restarts:
                await self._relaunch(self._fault)
            await asyncio.sleep(self.check_interval_s)

    def _unanswered(self) -> str:
        return f"engine stopped answering {self.health_url}"

    async def _relaunch(self, why: str) -> None:
        """Reaps the faulted engine's tree, waits out the back-off, starts it again and
        waits until it is healthy; then ``on_relaunch`` (the agent fences it) and only
        then is the fault cleared. A relaunch that fails leaves the fault for the next
        attempt (or for good, once the restarts are spent)."""
        self.restarts += 1
        backoff = min(self.backoff_s * 2 ** (self.restarts - 1), MAX_BACKOFF_S)
        self._relaunching = (f"relaunching the engine ({self.restarts} of {self.max_restarts}) after: {why}")
        log.warning("%s; back-off %.1fs", self._relaunching, backoff)
        try:
            await asyncio.to_thread(self.stop)
            await asyncio.sleep(backoff)
            self.start()  # on the loop thread, not to_thread: the death signal follows the starting thread (spawn)
            await self.wait_ready()
            if self.on_relaunch is not None:
                await self.on_relaunch()
        except Exception as exc:  # not healthy in time, exited again, or could not be fenced
            self._fault = f"relaunch {self.restarts} of {self.max_restarts} failed: {exc}"
            log.error("%s", self._fault)
            return
        finally:
            self._relaunching = ""
        self._fault = None
        log.info("engine relaunched (%d of %d)", self.restarts, self.max_restarts)

    def fault(self) -> str | None:
        """Why the launched engine is unusable, or None."""
        if self._relaunching:
            return self._relaunching
        if self.proc is not None and self.proc.poll() is not None:
            return f"engine process exited with code {self.proc.returncode}"
        return self._fault

    def stop(self) -> None:
        """Stops the engine tree: the reaper TERMs, waits ``grace_s``, KILLs; a backstop
        kills whatever is left. Blocking and bounded (about 3 x grace_s at most)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=2 * self.grace_s + 5)
            except subprocess.TimeoutExpired:
                log.error("reaper did not finish in time; killing the tree directly")
        terminate_tree(proc.pid, grace_s=min(self.grace_s, 5.0))
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        # A reaper that was itself killed (SIGKILL) left its engine tree running,
        # re-parented away from it; they are still in its process group.
        _stop_process_group(proc.pid, grace_s=min(self.grace_s, 5.0))


def _stop_process_group(pgid: int, *, grace_s: float) -> None:
    """SIGTERM every process left in group ``pgid``, SIGKILL what is left after
    ``grace_s``. Bounded; a group that is already empty costs one failed signal."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


__all__ = ["EngineLauncher"]
