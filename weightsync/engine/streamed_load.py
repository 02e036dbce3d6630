"""Receive and load at once, bucket by bucket: an engine's extra memory stays bounded.

An engine that loads weights through its own loader (vLLM's ``load_weights``) takes
checkpoint-shaped tensors. Receiving the whole plan into such tensors first and then
loading them costs a second copy of the model inside the engine: an out-of-memory
on a GPU that holds the model once. Here the receive runs on a thread of its own into
``StreamedTargets`` (a tensor is made when its first byte arrives), every tensor whose
last byte has arrived goes to the loader at once (an iterator the loader consumes as
it goes), and is let go after. The receive waits while more than ``max_ready_bytes``
of complete tensors are waiting for the loader, so the received tensors alive at
once are at most ``max_ready_bytes`` plus one complete tensor (the one that went
over) plus the tensors the two buckets in flight are filling: ``max_ready_bytes`` +
2 buckets + 2 x the largest tensor at worst (plus the transport's own buffers),
whatever the model's size. The group transport posts tensors ahead of their arrival
within its own window (``IN_FLIGHT_BYTES``): there the bound is that window.

The digest of what was received is built as tensors pass (``WeightsDigest``), so the
engine can still prove which bytes it loaded without keeping them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.packing import WeightsDigest
from weightsync.plan import BucketPlan
from weightsync.transport.base import Receiver
from weightsync.v1 import common_pb2

DEFAULT_MAX_READY_BYTES = 256 * 1024 * 1024
_DONE = object()


class StreamedTargets(Sequence[torch.Tensor]):
    """A plan's target tensors, each made on first use and given up by ``take``."""

    def __init__(self, plan: BucketPlan, device: torch.device) -> None:
        self._plan, self._device = plan, device
        self._made: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.peak_bytes = 0   # the most bytes of targets alive at once
        self._alive_bytes = 0

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("StreamedTargets takes one index at a time")
        with self._lock:
            tensor = self._made.get(index)
            if tensor is None:
                tensor = torch.empty(self._plan.shapes[index], dtype=self._plan.dtypes[index], device=self._device)
                self._made[index] = tensor
                self._alive_bytes += self._plan.sizes[index]
                self.peak_bytes = max(self.peak_bytes, self._alive_bytes)
            return tensor

    def take(self, index: int) -> torch.Tensor:
        """The finished tensor, no longer held here (made now if it has no bytes)."""
        tensor = self[index]
        with self._lock:
            del self._made[index]
            self._alive_bytes -= self._plan.sizes[index]
        return tensor


def _completed_by_bucket(plan: BucketPlan) -> list[list[int]]:
    """For each bucket, the tensors whose last byte it carries (an empty tensor: the
    bucket of its offset)."""
    done: list[list[int]] = [[] for _ in range(plan.num_buckets)]
    last = plan.num_buckets - 1
    for i, (offset, size) in enumerate(zip(plan.offsets, plan.sizes, strict=True)):
        done[min(last, (offset + max(size, 1) - 1) // plan.bucket_bytes)].append(i)
    return done


def receive_and_load(receiver: Receiver, rendezvous: common_pb2.Rendezvous, rank: int, plan: BucketPlan, *,
                     device: torch.device, deadline_at: float, abort: threading.Event,
                     load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                     max_ready_bytes: int = DEFAULT_MAX_READY_BYTES) -> tuple[str, int]:
    """Receives ``plan`` and has ``load`` consume each tensor as soon as it is complete.
    Returns (the digest of what was received, the peak bytes of target tensors alive
    at once). Raises the receive's error, or the loader's; a loader that stops before
    the last tensor is a TransferError."""
    targets = StreamedTargets(plan, device)
    completes = _completed_by_bucket(plan)
    ready: queue.Queue = queue.Queue()
    waiting = threading.Condition()
    state = {"ready_bytes": 0}
    stop = threading.Event()  # the loader side gave up: the receive must stop too

    def on_bucket(bucket: int) -> None:
        finished = completes[bucket]
        with waiting:
            for i in finished:
                ready.put(i)
                state["ready_bytes"] += plan.sizes[i]
            # Back-pressure: the loader is behind; wait (bounded) before taking more bytes.
            while state["ready_bytes"] > max_ready_bytes:
                if abort.is_set() or stop.is_set():
                    raise TransferError("receive stopped: the loader gave up")
                if time.monotonic() >= deadline_at:
                    raise StepTimeoutError("deadline exceeded while the engine was loading", operation="receive")
                waiting.wait(0.05)

    def run() -> None:
        try:
            if device.type == "cuda" and device.index is not None:
                # A new thread's current CUDA device is the first GPU, whatever its
                # process chose; the GPU receivers build their communicator, map the
                # trainer's memory and queue their copies on the current device, so
                # this thread takes the engine's (a vLLM worker on GPU k of a host).
                torch.cuda.set_device(device)
            receiver.receive(rendezvous, rank, plan, targets, deadline_at=deadline_at, abort=_Either(abort, stop),
                             on_bucket=on_bucket)
            ready.put(_DONE)
        except BaseException as exc:
            ready.put(exc)

    digest = WeightsDigest()
    remaining = len(plan)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal remaining
        while True:
            left = deadline_at - time.monotonic()
            try:
                item = ready.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise StepTimeoutError("deadline exceeded during the receive", operation="receive") from None
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            tensor = targets.take(item)
            if tensor.is_cuda:
                # Made and filled on the receiver's CUDA stream, used here on the loader's:
                # without this, once the loader lets it go, the caching allocator could
                # give its memory to the next target on the receiver's stream while the
                # loader's copies from it are still queued on its own.
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
            with waiting:
                state["ready_bytes"] -= plan.sizes[item]
                waiting.notify_all()
            name = plan.names[item]
            digest.add(name, tensor)
            remaining -= 1
            yield name, tensor

    thread = threading.Thread(target=run, name="weightsync-streamed-receive", daemon=True)
    thread.start()
    try:
        load(stream())
    finally:
        stop.set()
        with waiting:
            waiting.notify_all()
        thread.join(max(deadline_at - time.monotonic(), 0) + 5)
    if remaining:
        raise TransferError(f"the engine's loader stopped with {remaining} of {len(plan)} tensors not loaded")
    return digest.hexdigest(), targets.peak_bytes


class _Either:
    """An ``abort`` flag that is set when either of two events is (what receivers poll)."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self._a, self._b = a, b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()


__all__ = ["receive_and_load", "StreamedTargets", "DEFAULT_MAX_READY_BYTES"]
