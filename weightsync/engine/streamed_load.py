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

A sharded trainer's round (``receive_and_load_from_senders``) does the same over every
sender's lane at once: each lane fills row ranges of the same full tensors, and a
tensor goes to the loader once its last part, from whichever lane, is in.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.packing import WeightsDigest
from weightsync.parts_digest import PartsDigest
from weightsync.plan import BucketPlan
from weightsync.sharding import Owners
from weightsync.transport.base import Receiver
from weightsync.transport.from_senders import SenderLane, receive_from_senders
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

    @property
    def alive_bytes(self) -> int:
        """Bytes of target tensors made and not yet taken."""
        return self._alive_bytes

    def take(self, index: int) -> torch.Tensor:
        """The finished tensor, no longer held here (made now if it has no bytes)."""
        tensor = self[index]
        with self._lock:
            del self._made[index]
            self._alive_bytes -= self._plan.sizes[index]
        return tensor


class _Loading:
    """Complete tensors on their way from the receive (its threads) to the loader (the
    caller's thread), with the back-pressure and the digest described above."""

    def __init__(self, plan: BucketPlan, targets: StreamedTargets, *, max_ready_bytes: int, deadline_at: float,
                 abort: threading.Event) -> None:
        self.plan, self.targets = plan, targets
        self.max_ready_bytes, self.deadline_at, self.abort = max_ready_bytes, deadline_at, abort
        self.ready: queue.Queue = queue.Queue()
        self.waiting = threading.Condition()
        self.ready_bytes = 0
        self.stop = threading.Event()  # the loader side gave up: the receive must stop too
        self.digest = WeightsDigest()
        self.parts: PartsDigest | None = None  # a sharded round's: its parts hashed as they load
        self.remaining = len(plan)

    def completed(self, indices: Iterable[int]) -> None:
        """Receive side: these tensors have every byte; waits (bounded) while the loader
        is more than ``max_ready_bytes`` behind."""
        with self.waiting:
            for i in indices:
                self.ready.put(i)
                self.ready_bytes += self.plan.sizes[i]
            while self.ready_bytes > self.max_ready_bytes:
                if self.abort.is_set() or self.stop.is_set():
                    raise TransferError("receive stopped: the loader gave up")
                if time.monotonic() >= self.deadline_at:
                    raise StepTimeoutError("deadline exceeded while the engine was loading", operation="receive")
                self.waiting.wait(0.05)

    def run(self, receive: Callable[[], object], device: torch.device) -> None:
        """The receive's thread: ``receive()``, then the end of the stream (or its error)."""
        try:
            if device.type == "cuda" and device.index is not None:
                # A new thread's current CUDA device is the first GPU, whatever its
                # process chose; the GPU receivers build their communicator, map the
                # trainer's memory and queue their copies on the current device, so
                # this thread takes the engine's (a vLLM worker on GPU k of a host).
                torch.cuda.set_device(device)
            receive()
            self.ready.put(_DONE)
        except BaseException as exc:
            self.ready.put(exc)

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Loader side: each complete tensor, once, as it arrives."""
        while True:
            left = self.deadline_at - time.monotonic()
            try:
                item = self.ready.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise StepTimeoutError("deadline exceeded during the receive", operation="receive") from None
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            tensor = self.targets.take(item)
            if tensor.is_cuda:
                # Made and filled on the receiver's CUDA stream, used here on the loader's:
                # without this, once the loader lets it go, the caching allocator could
                # give its memory to the next target on the receiver's stream while the
                # loader's copies from it are still queued on its own.
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
            with self.waiting:
                before = self.ready_bytes
                self.ready_bytes -= self.plan.sizes[item]
                # Only as the backlog falls to the limit can a waiting receive go on: a
                # wake-up per tensor (20k a round) woke every lane's thread to find it
                # still over, each time taking the GIL from this loader, the round's
                # slowest part. (The waits also look again every 50 ms.)
                if before > self.max_ready_bytes >= self.ready_bytes:
                    self.waiting.notify_all()
            name = self.plan.names[item]
            self.digest.add(name, tensor)
            if self.parts is not None:
                self.parts.add(name, tensor)
            self.remaining -= 1
            yield name, tensor

    def load_while(self, receive: Callable[[], object], device: torch.device,
                   load: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> tuple[str, int]:
        """Runs ``receive`` on a thread of its own and ``load`` on this one; returns (the
        digest of what was loaded, the peak bytes of target tensors alive at once)."""
        thread = threading.Thread(target=self.run, args=(receive, device), name="weightsync-streamed-receive",
                                  daemon=True)
        thread.start()
        try:
            load(self.stream())
        finally:
            self.stop.set()
            with self.waiting:
                self.waiting.notify_all()
            thread.join(max(self.deadline_at - time.monotonic(), 0) + 5)
        if self.remaining:
            raise TransferError(f"the engine's loader stopped with {self.remaining} of {len(self.plan)} tensors "
                                "not loaded")
        return self.digest.hexdigest(), self.targets.peak_bytes


def receive_and_load(receiver: Receiver, rendezvous: common_pb2.Rendezvous, rank: int, plan: BucketPlan, *,
                     device: torch.device, deadline_at: float, abort: threading.Event,
                     load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                     max_ready_bytes: int = DEFAULT_MAX_READY_BYTES) -> tuple[str, int]:
    """Receives ``plan`` and has ``load`` consume each tensor as soon as it is complete.
    Returns (the digest of what was received, the peak bytes of target tensors alive
    at once). Raises the receive's error, or the loader's; a loader that stops before
    the last tensor is a TransferError."""
    targets = StreamedTargets(plan, device)
    completes = plan.completed_by_bucket()
    loading = _Loading(plan, targets, max_ready_bytes=max_ready_bytes, deadline_at=deadline_at, abort=abort)

    def receive() -> None:
        receiver.receive(rendezvous, rank, plan, targets, deadline_at=deadline_at, abort=_Either(abort, loading.stop),
                         on_bucket=lambda bucket: loading.completed(completes[bucket]))

    return loading.load_while(receive, device, load)


def receive_and_load_from_senders(lanes: Sequence[SenderLane], rank: int, plan: BucketPlan, owners: Owners, *,
                                  device: torch.device, deadline_at: float, abort: threading.Event,
                                  load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                                  max_ready_bytes: int = DEFAULT_MAX_READY_BYTES,
                                  parts_digest: bool = True) -> tuple[str, int, str]:
    """``receive_and_load`` for a sharded trainer's round: every sender's lane at once
    (``receive_from_senders``), each into row ranges of the same full tensors, which go
    to ``load`` once the last of their parts, from whichever lane, is in. Returns what
    ``receive_and_load`` does and the parts' digest of what was loaded
    (``weightsync/parts_digest.py``: what a trainer that asked to verify the round
    hashed; "" with ``parts_digest=False``, for a round that does not ask).

    Tensors whose parts have come in on some lanes and not yet on others are held
    too, however far one lane runs ahead of another (a rank on a faster link, or
    scheduled first): so once more than ``max_ready_bytes`` of tensors are alive, a
    lane that is ahead (its last finished part is of a later tensor than the slowest
    lane's) waits, bounded, for the others. The slowest lane never waits for that, so
    the lanes cannot all wait on each other."""
    targets = StreamedTargets(plan, device)
    loading = _Loading(plan, targets, max_ready_bytes=max_ready_bytes, deadline_at=deadline_at, abort=abort)
    loading.parts = PartsDigest(plan, owners) if parts_digest else None
    parts_left = np.bincount(np.concatenate([owners.parts_of(lane.sender).tensors for lane in lanes]),
                             minlength=len(plan))
    if len(lanes) != len(owners.senders) or (parts_left == 0).any():
        raise TransferError("the lanes given do not carry every part of the plan")
    lanes_moved = threading.Condition()
    views = {lane.sender: owners.part_views(lane.sender, targets) for lane in lanes}
    of_tensor = {lane.sender: owners.parts_of(lane.sender).tensors.tolist() for lane in lanes}
    # Each lane's place: the plan index of the tensor its last finished part belongs
    # to (senders stream their parts in plan order); a lane with every part in is out.
    place = {lane.sender: -1 for lane in lanes}
    last_bucket = {lane.sender: lane.plan.num_buckets - 1 for lane in lanes}
    lanes_stop = threading.Event()  # set by receive_from_senders once any lane failed

    def lane_bucket(lane: SenderLane, bucket: int, finished: list[int]) -> None:
        sender, whole = lane.sender, []
        with lanes_moved:
            for part in finished:  # receive_from_senders called views.done on each
                tensor = of_tensor[sender][part]
                parts_left[tensor] -= 1
                if parts_left[tensor] == 0:
                    whole.append(tensor)
                place[sender] = max(place[sender], tensor)
            if bucket == last_bucket[sender]:
                del place[sender]
            lanes_moved.notify_all()
        loading.completed(whole)
        with lanes_moved:
            while sender in place and targets.alive_bytes > max_ready_bytes and place[sender] > min(place.values()):
                if abort.is_set() or loading.stop.is_set() or lanes_stop.is_set():
                    raise TransferError("receive stopped while a lane waited for the others")
                if time.monotonic() >= deadline_at:
                    raise StepTimeoutError("deadline exceeded while a lane waited for the others", operation="receive")
                lanes_moved.wait(0.05)

    def receive() -> None:
        receive_from_senders(lanes, rank, lambda lane: views[lane.sender], deadline_at=deadline_at,
                             abort=_Either(abort, loading.stop), on_lane_bucket=lane_bucket, stop=lanes_stop)

    digest, peak = loading.load_while(receive, device, load)
    return digest, peak, loading.parts.hexdigest() if loading.parts is not None else ""


class _Either:
    """An ``abort`` flag that is set when either of two events is (what receivers poll)."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self._a, self._b = a, b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()


__all__ = ["receive_and_load", "receive_and_load_from_senders", "StreamedTargets", "DEFAULT_MAX_READY_BYTES"]
