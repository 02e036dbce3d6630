"""The group transport's "flattened" layout: SGLang's ``load_format="flattened_bucket"``.

With SGLang's default protocol every tensor is a broadcast of its own, and a broadcast
costs a quarter of a millisecond or more whatever its size (the time to copy a few
megabytes on the project's machine): at 20k tensors that is most of a round (8-11x the
time per byte of 89 tensors in ``docs/benchmarks.md``). SGLang also receives a run of tensors as one
broadcast (its ``FlattenedTensorBucket``): each tensor's bytes end to end, no padding,
as one ``uint8`` tensor, cut back into the named tensors by byte offsets (each viewed
as its dtype, so each must start at a multiple of its element size).

``flattened_calls`` cuts a plan into such runs ("calls": one
``/update_weights_from_distributed`` each on SGLang's side) from the plan alone, so the
trainer, weightsync's receivers and the SGLang agent cut alike: consecutive tensors in
plan order, at most the plan's bucket size of bytes per call (a larger tensor is a call
of its own), and a new call wherever a tensor would start at an offset that is not a
multiple of its element size. A call of one tensor goes straight from and into the
tensor where it can; a call of several is packed into, and unpacked from, one of two
staging buffers, used alternately (``Staging``), except on a side whose tensors lie
end to end in memory as the call carries them (``FlatCalls.memory_run``: the
reference engine's arena, a trainer's flat buffer): the call goes from, or lands in,
that memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.dtypes import ITEMSIZE
from weightsync.plan import BucketPlan, same_distances
from weightsync.serial_copy import serial_copies
from weightsync.transport import FLATTENED, LAYOUTS, TENSORS


@dataclass(frozen=True)
class FlatCalls:
    """A plan cut into flattened calls: call ``c`` is tensors ``bounds[c][0]`` up to
    ``bounds[c][1]`` (exclusive); tensor ``i`` starts ``starts[i] - starts[first]`` bytes
    into its call's buffer."""

    bounds: tuple[tuple[int, int], ...]
    starts: np.ndarray  # int64, one per tensor and one past the last: bytes end to end, no padding
    sizes: tuple[int, ...]  # the plan's (the same tuple: addresses taken for it stand for these calls)

    def nbytes(self, call: int) -> int:
        first, end = self.bounds[call]
        return int(self.starts[end] - self.starts[first])

    def memory_run(self, call: int, addresses: np.ndarray) -> tuple[int, int] | None:
        """Whether call ``call``'s tensors sit at ``addresses`` (each tensor's first
        byte) end to end as the call carries them: ``(index, address)``, a tensor of
        the call with bytes (whose memory the run lies in) and the address of the
        call's first byte; None otherwise. Then the call goes on the wire from that
        memory, or lands in it, with no staging copy (``memory_runs.call_view``)."""
        first, end = self.bounds[call]
        if len(addresses) != len(self.starts) - 1:
            return None
        starts = self.starts[first:end]
        found = same_distances(addresses[first:end], starts, self.starts[first + 1:end + 1] - starts)
        return None if found is None else (first + found[0], found[1] + int(self.starts[first]))

    def views(self, buffer: torch.Tensor, call: int, plan: BucketPlan) -> list[torch.Tensor]:
        """The call's tensors as views of ``buffer`` (uint8, the call's bytes), each in
        the plan's dtype and shape."""
        first, end = self.bounds[call]
        base, starts = int(self.starts[first]), self.starts[first:end + 1].tolist()
        return [buffer[starts[k] - base:starts[k + 1] - base].view(plan.dtypes[i]).view(plan.shapes[i])
                for k, i in enumerate(range(first, end))]


@functools.lru_cache(maxsize=8)
def flattened_calls(plan: BucketPlan) -> FlatCalls:
    """``plan`` cut into flattened calls (see the module docstring); cached per plan."""
    sizes = plan._nbytes.astype(np.int64)
    itemsizes = [ITEMSIZE[d] for d in plan.dtypes]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    limit = plan.bucket_bytes
    bounds: list[tuple[int, int]] = []
    first, used = 0, 0
    for i, (size, itemsize) in enumerate(zip(sizes.tolist(), itemsizes, strict=True)):
        if i > first and (used + size > limit or used % itemsize):
            bounds.append((first, i))
            first, used = i, 0
        used += size
    if len(sizes):
        bounds.append((first, len(sizes)))
    return FlatCalls(tuple(bounds), starts, plan.sizes)


def byte_flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """One call for a run's tensors (casting where dtypes differ), without OpenMP regions
    per small copy (``weightsync.serial_copy``)."""
    with torch.no_grad(), serial_copies():
        torch._foreach_copy_(list(dsts), list(srcs))


class Staging:
    """Two byte buffers of the plan's bucket size on the wire's device, handed out in
    turn to calls of several tensors. A buffer is handed out again only after the call
    that used it last has been finished by ``finish_through`` (its broadcast completed
    and, on a receiver, its bytes copied into the targets).

    The n-th staged call of every round of a plan takes the same buffer, so each call's
    tensor views are made once and replayed every step (as ``BucketPlan.bucket_views``
    does for the bucket buffers): at 20k tensors, making them anew cost each side tens
    of milliseconds per round."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._last_use = [0, 0]
        self._next = 0
        self._views: tuple[str, dict[int, list[torch.Tensor]]] = ("", {})  # plan id, views by call

    def fit(self, plan: BucketPlan, device: torch.device) -> None:
        """Starts a round of ``plan``; reallocates only when the bucket size or the device
        changed."""
        nbytes = plan.bucket_bytes
        if not self._buffers or self._buffers[0].numel() != nbytes or self._buffers[0].device != device:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
            self._views = ("", {})
        if self._views[0] != plan.plan_id:
            self._views = (plan.plan_id, {})
        self._last_use = [0, 0]
        self._next = 0

    def take(self, calls: FlatCalls, call: int, plan: BucketPlan, finish_through) -> tuple[int, list[torch.Tensor]]:
        """The next buffer, once its previous call is finished: its slot and the call's
        tensors as views of it."""
        slot, self._next = self._next, self._next ^ 1
        finish_through(self._last_use[slot])
        views = self._views[1].get(call)
        if views is None or views[0].untyped_storage().data_ptr() != self._buffers[slot].data_ptr():
            views = self._views[1][call] = calls.views(self._buffers[slot][:calls.nbytes(call)], call, plan)
        return slot, views

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Buffer ``slot``'s first ``nbytes``: what goes on the wire."""
        return self._buffers[slot][:nbytes]

    def used(self, slot: int, number: int) -> None:
        """Buffer ``slot`` carries in-flight call ``number`` (``InFlight.add``'s answer)."""
        self._last_use[slot] = number

    def release(self) -> None:
        """Drops the buffers (and their views): the next round allocates new ones."""
        self._buffers = []
        self._views = ("", {})


__all__ = ["LAYOUTS", "TENSORS", "FLATTENED", "FlatCalls", "flattened_calls", "byte_flat", "copy_all", "Staging"]
