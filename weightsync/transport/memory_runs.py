"""A bucket's small tensors moved straight from or into their own memory, where it
lies as one run.

A network transport packs the small tensors of a bucket into a buffer and sends
the buffer; the receiver copies them out again. Where a side's tensors lie end to
end in memory as the plan lays them out (an engine that keeps its weights in one
arena, ``weightsync.arena``; a trainer that keeps its parameters in one flat
buffer), those two copies are not needed: the range goes on the wire from that
memory, or lands in it. At 20k tensors of 1 GiB the two copies were a third of a
gloo round's CPU on a 2-core machine (docs/benchmarks.md, "Small tensors landed in
the engine's arena").

The bytes on the wire are the same either way, so each side decides for itself, per
bucket, from the addresses it already has (``cross_memory.AddressedTensors``: the
trainer's per-step pass, the reference engine's targets). Tensors without them
(a vLLM worker's, made as their bytes arrive) are never asked for an address here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weightsync.packing import byte_view
from weightsync.plan import BucketPlan
from weightsync.transport.cross_memory import carries_addresses

if TYPE_CHECKING:
    from weightsync.transport.flattened import FlatCalls


def bucket_runs(plan: BucketPlan, bucket: int, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Views of ``tensors``' memory for every range of ``bucket`` that a network
    transport packs (``wire_ops(bucket).ops`` with no piece), keyed by the range's
    start, when each of them lies as one run (``BucketPlan.memory_run``). None when
    ``tensors`` carries no addresses for this plan, when the bucket's small ranges are
    gathered into one operation, or when any range is not one run: the bucket is then
    packed as before (never half and half, so the copies stay all or nothing)."""
    if not carries_addresses(tensors, plan.sizes) or tensors.addresses is None:
        return None
    wire = plan.wire_ops(bucket)
    if wire.gathered:
        return None
    views: dict[int, torch.Tensor] = {}
    for start, end, piece in wire.ops:
        if piece is not None:
            continue
        view = run_view(plan, bucket, start, end, tensors)
        if view is None:
            return None
        views[start] = view
    return views or None


def run_view(plan: BucketPlan, bucket: int, start: int, end: int,
             tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A uint8 view of the memory that bytes ``[start, end)`` of ``bucket`` lie in, or
    None unless they lie as one run (``BucketPlan.memory_run``) inside one tensor's
    storage. ``tensors`` carries its addresses."""
    found = plan.memory_run(bucket, start, end, tensors.addresses)
    return None if found is None else view_at(tensors, *found, end - start)


def call_view(calls: FlatCalls, call: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The flattened layout's counterpart of ``run_view``: a uint8 view of the memory
    that call ``call``'s tensors lie in, end to end as the call carries them
    (``FlatCalls.memory_run``); None where ``tensors`` carries no addresses for
    ``sizes`` or they do not lie so."""
    if not carries_addresses(tensors, calls.sizes) or tensors.addresses is None:
        return None
    found = calls.memory_run(call, tensors.addresses)
    return None if found is None else view_at(tensors, *found, calls.nbytes(call))


def view_at(tensors: Sequence[torch.Tensor], index: int, address: int, length: int) -> torch.Tensor | None:
    """``length`` bytes at ``address``, as a uint8 view of the storage of
    ``tensors[index]``, or None unless they lie inside that one storage. The tensor is
    checked to still be at its recorded address (addresses are taken once a step; the
    tensors could have moved since)."""
    tensor = tensors[index].detach()
    if not tensor.is_cpu or tensor.data_ptr() != int(tensors.addresses[index]):
        return None
    storage = tensor.untyped_storage()
    at = address - storage.data_ptr()
    if at < 0 or at + length > storage.nbytes():  # one storage: never into a neighbour's memory
        return None
    return byte_view(tensor).as_strided((length,), (1,), at)


__all__ = ["bucket_runs", "call_view", "run_view", "view_at"]
