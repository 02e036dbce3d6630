"""An engine's weights end to end in one block of memory (an arena), in model order.

The reference engine keeps its parameters this way, as engines that manage their own
weight memory do (one allocation to free on sleep and make again on wake, no
allocator fragmentation). The layout is the bucket plan's: each tensor starts at the
next multiple of ``plan.ALIGN`` bytes after the one before it. So where the trainer's
plan lists the same tensors in the same order (the same model class on both sides),
every bucket's small tensors lie in the arena exactly as they lie in the bucket, and
a network transport lands them with no copy (``transport.memory_runs``). Where the
orders differ nothing breaks: those buckets are unpacked as before.

The arena asks the kernel for transparent huge pages (where its setting is
``madvise``, a process gets them only where it asks): a transfer writes every byte of
it, and with 2 MiB pages instead of 4 KiB ones a round of 1 GiB in 509 tensors over
shm's direct reads took 0.49-0.50 CPU seconds (every process) against 0.60-0.70
(docs/benchmarks.md, "Small tensors landed in the engine's arena").
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterable

import torch

from weightsync.plan import ALIGN


def arena_layout(tensors: Iterable[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the arena, and the arena's size."""
    offsets, at = [], 0
    for dtype, shape in tensors:
        offsets.append(at)
        at += (math.prod(shape) * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN
    return offsets, at


def new_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8), a private anonymous mapping of its own that
    asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``; the kernel grants
    them where its setting allows). A mapping of its own, not the allocator's: memory
    the allocator hands out again may be touched already, on small pages, and then
    stays so. Unmapped when the last tensor over it goes."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no madvise here, or the kernel says no
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor holds the mapping


@torch.no_grad()
def place_in_arena(parameters: list[torch.nn.Parameter], specs: list[tuple[torch.dtype, tuple[int, ...]]], *,
                   keep_values: bool) -> torch.Tensor:
    """Moves ``parameters`` (in this order) into a new arena, laid out by ``specs``
    (each one's dtype and shape): each one's ``.data`` becomes its view of the arena,
    its values copied there when ``keep_values``, else zeros (weights woken from
    sleep, to be loaded before serving). The Parameters stay the same objects.
    Returns the arena (uint8); the views keep it alive."""
    offsets, total = arena_layout(specs)
    arena = new_arena(total)
    for p, (dtype, shape), at in zip(parameters, specs, offsets, strict=True):
        view = arena[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        if keep_values:
            view.copy_(p.data)
        p.data = view
    return arena


__all__ = ["arena_layout", "new_arena", "place_in_arena"]
