"""Weights end to end in one block of memory (an arena), in model order.

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

A trainer can keep its own weights the same way (``place_on_huge_pages``): shm's
engines then read them from huge pages (the kernel pins every page it reads, so 4 KiB
pages cost about twice as much), and a bucket of small tensors goes to the network
as one run, with no packing.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import threading
import weakref
from collections.abc import Iterable

import numpy as np
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
    arena = torch.frombuffer(memory, dtype=torch.uint8)  # the tensor holds the mapping
    start = arena.data_ptr()
    with _arenas_lock:
        bisect.insort(_arenas, (start, start + nbytes))
    weakref.finalize(memory, _forget_arena, start)  # unmapped: the range may be anyone's again
    return arena


# The address ranges of this process's live arenas, sorted (start, end): shm asks
# ``in_arenas`` whether tensors lie on huge pages: an engine's targets (then the
# trainer writes into them, ``transport.shm_push``), a trainer's placed weights (then
# engines read them, and no advice is logged).
_arenas: list[tuple[int, int]] = []
_arenas_lock = threading.Lock()


def _forget_arena(start: int) -> None:
    with _arenas_lock:
        _arenas[:] = [r for r in _arenas if r[0] != start]


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


@torch.no_grad()
def place_on_huge_pages(weights: torch.nn.Module | Iterable[torch.Tensor]) -> int:
    """Moves a trainer's CPU weights end to end into one arena on transparent huge
    pages, in the order given (a module: ``module.parameters()``, each shared
    parameter once), values kept. Each tensor stays the same object (its ``.data``
    becomes its view of the arena), so a model, and an optimizer made later, hold them
    as before. Call once, after building the model and before wrapping it (DDP, FSDP)
    or making the optimizer: anything that took a view of a weight's memory before
    keeps the old memory.

    Why: the shm transport's engines read a trainer's tensors straight from its
    memory, and the kernel pins every page it reads; on huge pages they read 1 GiB at
    about the cost of a memcpy, on 4 KiB pages at about twice that (engines that keep
    their weights in arenas are written into by the trainer instead, as fast, see
    ``transport.shm_push``; a vLLM worker is not). And over gloo a bucket that lies as
    one run at both ends is one broadcast. Without this,
    ``THP_MEM_ALLOC_ENABLE=1`` (torch's tensors of 2 MiB or more) and glibc's
    ``glibc.malloc.hugetlb=1`` tunable (smaller ones) do it for every allocation, set
    before the trainer starts.

    Returns the bytes placed (0 where no weight is on the CPU; GPU weights are left
    where they are).

    Raises:
        ValueError: two of the weights share memory (tied through views of one
            storage, not through one shared tensor): moving one would untie them.
            Nothing is moved.
    """
    tensors = list(weights.parameters()) if isinstance(weights, torch.nn.Module) else list(weights)
    placed = [t for t in tensors if t.device.type == "cpu" and t.numel() > 0]
    seen: dict[int, int] = {}
    for i, t in enumerate(placed):
        storage = t.untyped_storage().data_ptr()
        if storage in seen:
            raise ValueError(f"weights {seen[storage]} and {i} share memory: they cannot be moved apart "
                             "(tie them as one shared parameter, or leave them where they are)")
        seen[storage] = i
    if not placed:
        return 0
    arena = place_in_arena(placed, [(t.dtype, tuple(t.shape)) for t in placed], keep_values=True)
    return arena.numel()


def in_arenas(addresses: np.ndarray) -> bool:
    """Whether every address (uint64 array, at least one) lies in a live arena of
    this process (``new_arena``: memory that asked for huge pages). Whole-array work:
    20k addresses in well under a millisecond, so a round may ask."""
    with _arenas_lock:
        ranges = list(_arenas)
    if len(addresses) == 0 or not ranges:
        return False
    bounds = np.array(ranges, dtype=np.uint64)
    at = np.searchsorted(bounds[:, 0], addresses, side="right").astype(np.int64) - 1
    if (at < 0).any():
        return False
    return bool((addresses < bounds[at, 1]).all())


__all__ = ["arena_layout", "in_arenas", "new_arena", "place_in_arena", "place_on_huge_pages"]
