"""Counting the garbage collector's collections while a block runs (tests only)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collections_during() -> Iterator[list[int]]:
    """Yields a list that receives the generation of every collection started inside
    the block (after a full collection beforehand, so earlier garbage does not count)."""
    started: list[int] = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])
    gc.collect()
    gc.callbacks.append(count)
    try:
        yield started
    finally:
        gc.callbacks.remove(count)
