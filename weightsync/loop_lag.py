"""LoopLagMonitor: a server's own event-loop lag, measured all the time and exported.

The seed bug (a blocking call inside ``async def``) hides anywhere a handler or a
background task calls something slow. Each server (coordinator, agent) runs this
monitor: it sleeps ``interval_s`` in a loop and records how late each wake-up came,
then exports ``weightsync_loop_lag_ms{process, window}`` -- the largest lag since
start (``window="all"``), over the last ``window_s`` (``window="recent"``), and since
the server's last round began (``window="round"``: its owner calls ``round_started``).
Operators alert on it; tests read it to prove nothing blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from weightsync import metrics

DEFAULT_INTERVAL_S = 0.01
DEFAULT_WINDOW_S = 10.0


class LoopLagMonitor:
    """Samples the running loop's lag until cancelled (see the module docstring)."""

    def __init__(self, process: str, *, interval_s: float = DEFAULT_INTERVAL_S,
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        if interval_s <= 0 or window_s <= 0:
            raise ValueError("interval_s and window_s must be positive")
        self.process = process
        self.interval_s = interval_s
        self.window_s = window_s
        self.max_ms = 0.0
        self.round_max_ms = 0.0
        # The window's maximum, kept without a scan per sample (a scan of the 1000
        # samples of a 10 s window every 10 ms was 2-3 % of a core in every server):
        # samples that a later, larger one outlives can never be the maximum again,
        # so the deque holds decreasing lags, the window's maximum first.
        self._recent: deque[tuple[float, float]] = deque()  # (when, lag ms)
        # The gauges, looked up once and set only when their value changes: a lookup
        # and three sets per sample were most of the monitor's cost, 100 times a second
        # in every server, also while a round's copy wants every core.
        self._gauges = {window: metrics.LOOP_LAG_MS.labels(process, window) for window in ("all", "recent", "round")}
        self._exported = {window: None for window in self._gauges}

    @property
    def recent_max_ms(self) -> float:
        return self._recent[0][1] if self._recent else 0.0

    def round_started(self) -> None:
        """A round begins: the ``round`` window starts again from nothing."""
        self.round_max_ms = 0.0
        self._export("round", 0.0)

    def _export(self, window: str, value: float) -> None:
        if self._exported[window] != value:
            self._exported[window] = value
            self._gauges[window].set(value)

    def record(self, lag_ms: float, now: float) -> None:
        """Adds one sample and updates the exported gauges."""
        self.max_ms = max(self.max_ms, lag_ms)
        self.round_max_ms = max(self.round_max_ms, lag_ms)
        while self._recent and self._recent[-1][1] <= lag_ms:
            self._recent.pop()
        self._recent.append((now, lag_ms))
        while self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        self._export("all", self.max_ms)
        self._export("recent", self.recent_max_ms)
        self._export("round", self.round_max_ms)

    async def run(self) -> None:
        """Samples until cancelled."""
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            after = time.perf_counter()
            self.record(max(0.0, after - before - self.interval_s) * 1000, after)


__all__ = ["LoopLagMonitor"]
