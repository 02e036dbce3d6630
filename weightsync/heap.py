"""The servers' Python heap: keep the garbage collector's full passes short.

A full collection walks every tracked object in the process while holding the GIL, so
it stops the server's event loop (heartbeats, RPCs) for as long as it takes. Right
after start-up an agent holds about 400k such objects (torch, gRPC, the reference
engine's model), and the per-tensor views that the first round of a 20k-tensor model
caches tipped a full collection that stopped each agent's loop for 125-135 ms.

Almost all of that start-up heap lives as long as the process, so a server moves it
out of the collector's sight once it is built (``gc.freeze``, as vLLM's engine core
does with its own start-up heap): later full collections walk only what was made
after. Reference counting still frees any of it that is dropped; only a reference
cycle among frozen objects would stay until exit, and the start-up heap is modules,
classes and the engine, which stay anyway.

``GcPauseMonitor`` times the collector's passes and exports them beside the loop lag
(``weightsync_gc_full_pause_ms``, ``weightsync_gc_frozen_objects``), so a loop that
stalled can be told apart from one the collector stopped.
"""

from __future__ import annotations

import gc
import logging
import time

from weightsync import metrics


def freeze_startup_heap(log: logging.Logger) -> None:
    """Collects what start-up left behind, then freezes the rest (see the module
    docstring). Call once, when the server's long-lived objects exist and before it
    serves: the collection itself takes as long as the pauses it prevents."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects, %.0f ms", gc.get_freeze_count(),
             (time.perf_counter() - started) * 1000)


class GcPauseMonitor:
    """Times this process's full collections (generation 2) from ``gc.callbacks``.

    The callback runs inside the collector, wherever the interrupted thread was, so it
    only does arithmetic on plain attributes: taking a lock there (a metric's, say)
    could wait on a lock that same thread holds. The metrics read the attributes when
    scraped instead.
    """

    def __init__(self, process: str) -> None:
        self.process = process
        self.full_max_ms = 0.0
        self.full_count = 0
        self._started = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif info.get("generation") == 2:
            self.full_count += 1
            self.full_max_ms = max(self.full_max_ms, (time.perf_counter() - self._started) * 1000)

    def install(self) -> GcPauseMonitor:
        """Starts timing and exports the gauges for ``process``; returns self."""
        gc.callbacks.append(self._on_gc)
        metrics.GC_FULL_PAUSE_MS.labels(self.process).set_function(lambda: self.full_max_ms)
        metrics.GC_FROZEN_OBJECTS.labels(self.process).set_function(gc.get_freeze_count)
        return self

    def close(self) -> None:
        """Stops timing (the gauges keep their last values)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

__all__ = ["GcPauseMonitor", "freeze_startup_heap"]
