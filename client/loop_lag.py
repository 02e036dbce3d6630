"""LoopLagProbe: measures how late the event loop runs a timer, beside your own code.

A sync must never stall the trainer's loop (the seed bug: 40 s freezes). Run the probe
around anything you suspect; ``max_ms`` and ``p99_ms`` tell how long the loop was
unable to run other coroutines.
"""

from __future__ import annotations

import asyncio
import time


class LoopLagProbe:
    """Sleeps ``interval_s`` in a loop and records how late each wake-up was."""

    def __init__(self, interval_s: float = 0.005) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, time.perf_counter() - before - self.interval_s))

    def start(self) -> LoopLagProbe:
        """Starts sampling on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="weightsync-loop-lag")
        return self

    async def stop(self) -> None:
        """Stops sampling. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)

    async def __aenter__(self) -> LoopLagProbe:
        return self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def max_ms(self) -> float:
        return 1000 * max(self.lags_s, default=0.0)

    @property
    def p99_ms(self) -> float:
        if not self.lags_s:
            return 0.0
        ordered = sorted(self.lags_s)
        return 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


__all__ = ["LoopLagProbe"]
