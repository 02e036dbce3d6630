"""weightsync.heap in this process: the start-up heap leaves the collector's walk, and
full collections are timed. (The servers' own use: test_observability.py.)"""

from __future__ import annotations

import gc
import logging

from prometheus_client import REGISTRY

from weightsync.heap import GcPauseMonitor, freeze_startup_heap


def test_the_startup_heap_is_frozen_and_what_comes_after_is_not():
    before = [[]]  # a tracked container, alive when the heap is frozen
    try:
        freeze_startup_heap(logging.getLogger("test"))
        after = [[]]
        walked = gc.get_objects()  # what a full collection walks: the frozen heap is not in it
        assert not any(o is before for o in walked)
        assert any(o is after for o in walked)
        assert gc.get_freeze_count() > 10_000  # pytest, torch, grpc: the whole heap went
    finally:
        gc.unfreeze()


def test_full_collections_are_timed_and_exported():
    monitor = GcPauseMonitor("test-heap").install()
    gc.disable()  # only the collections this test asks for (the callbacks still run for them)
    try:
        gc.collect(0)
        assert monitor.full_count == 0  # a young collection is not a full one
        gc.collect()
        gc.collect()
        assert monitor.full_count == 2 and monitor.full_max_ms > 0
        assert REGISTRY.get_sample_value("weightsync_gc_full_pause_ms", {"process": "test-heap"}) == monitor.full_max_ms
    finally:
        gc.enable()
        monitor.close()
    assert monitor._on_gc not in gc.callbacks
    gc.collect()
    assert monitor.full_count == 2
