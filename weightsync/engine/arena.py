"""An engine's weights end to end in one block of memory (an arena), in model order.

The reference engine keeps its parameters this way, as engines that manage their own
weight memory do (one allocation to free on sleep and make again on wake, no
allocator fragmentation). The layout is the bucket plan's: each tensor starts at the
next multiple of ``plan.ALIGN`` bytes after the one before it. So where the trainer's
plan lists the same tensors in the same order (the same model class on both sides),
every bucket's small tensors lie in the arena exactly as they lie in the bucket, and
a network transport lands them with no copy (``transport.memory_runs``). Where the
orders differ nothing breaks: those buckets are unpacked as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightsync.plan import ALIGN


def arena_layout(tensors: Iterable[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the arena, and the arena's size."""
    offsets, at = [], 0
    for dtype, shape in tensors:
        offsets.append(at)
        count = 1
        for dim in shape:
            count *= dim
        at += (count * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN
    return offsets, at


@torch.no_grad()
def place_in_arena(parameters: list[torch.nn.Parameter], specs: list[tuple[torch.dtype, tuple[int, ...]]], *,
                   keep_values: bool) -> torch.Tensor:
    """Moves ``parameters`` (in this order) into a new arena, laid out by ``specs``
    (each one's dtype and shape): each one's ``.data`` becomes its view of the arena,
    its values copied there when ``keep_values``, else zeros (weights woken from
    sleep, to be loaded before serving). The Parameters stay the same objects.
    Returns the arena (uint8); the views keep it alive."""
    offsets, total = arena_layout(specs)
    arena = torch.zeros(total, dtype=torch.uint8)
    for p, (dtype, shape), at in zip(parameters, specs, offsets, strict=True):
        count = 1
        for dim in shape:
            count *= dim
        view = arena[at:at + count * dtype.itemsize].view(dtype).view(shape)
        if keep_values:
            view.copy_(p.data)
        p.data = view
    return arena


__all__ = ["arena_layout", "place_in_arena"]
