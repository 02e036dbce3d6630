"""nccl transport: NCCL broadcasts between GPUs, buckets packed and unpacked on the
device. NCCL is called through ``nccl_lib`` (ctypes, GIL released), not cupy's
communicator, whose constructor blocks with the GIL held (see ``nccl_lib``).

Group. One communicator per group id, reused from round to round and ended
(``ncclCommAbort``, see ``NcclGroup.close``) when the group id changes or after any
failure. Rank 0 (the trainer) draws NCCL's unique id and publishes it under the
round's session key (``nccl-id``, 128 bytes); every rank builds the communicator on
its transfer device. Reading the id from the store blocks, so that part runs on a
side thread (``collective.join_in_background``); the communicator is non-blocking
(``nccl_lib``), and the caller polls it ready with the deadline, the abort flag and
the peers' failure keys (``join_communicator``). A build that does not get there is
ended with ``ncclCommAbort``, also when the side thread hands it over only after
the caller gave up: nothing is left joining peers that will not come.

Data. Two device buffers per side alternate: the sender packs bucket k+1 (on a copy
stream) while bucket k is broadcast (on a communication stream); each receiver
unpacks bucket k while k+1 arrives. The streams are ordered by CUDA events, never by
the host; the host keeps at most two buckets in flight and waits only by polling an
event (``cuda.EventDone``), with the round's deadline, the abort flag, NCCL's
asynchronous error check and the peers' failure keys. A broadcast NCCL is still
queueing is polled the same way until it is on its stream, before any event is
recorded after it. A side that fails sets ``abort`` (sender) or ``err/<rank>``
(receiver) in the store and aborts its communicator (``ncclCommAbort``): a broadcast
that can no longer finish is never left to hang, and the others stop at their next
poll.

NCCL refuses two ranks on one GPU: every engine needs a GPU of its own, and so does
the trainer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from weightsync.errors import TransferError
from weightsync.packing import pack_bucket, unpack_bucket
from weightsync.plan import BucketPlan
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.collective import join_in_background, wait_polling
from weightsync.transport.cuda import EventDone, tensors_device
from weightsync.transport.nccl_lib import Communicator, new_unique_id
from weightsync.transport.store import StoreLink, session_key
from weightsync.v1 import common_pb2

log = logging.getLogger("weightsync.transport.nccl")

class _Ready:
    """A communicator's last call (its build, or queueing a broadcast) as a piece of
    work for ``collective.wait_polling``."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm

    def is_completed(self) -> bool:
        return self._comm.ready()

    def wait(self) -> None:
        """Completed: nothing left to wait for."""


def join_communicator(build: Callable[[dist.Store], Communicator], rendezvous: common_pb2.Rendezvous, *,
                      deadline_at: float, abort: threading.Event, watch: dist.Store,
                      stop_keys: Sequence[str]) -> Communicator:
    """A ready communicator from ``build`` (run on a side thread with a store
    connection of its own): waited for with the deadline, ``abort`` and the peers'
    failure keys, and aborted when it does not get ready."""
    comm = join_in_background(build, rendezvous, operation="nccl group setup", deadline_at=deadline_at, abort=abort,
                              watch=watch, stop_keys=stop_keys, discard=Communicator.abort)
    try:
        wait_polling(_Ready(comm), deadline_at, "nccl group setup", abort=abort, store=watch, stop_keys=stop_keys)
    except BaseException:
        try:
            comm.abort()
        except Exception as exc:
            log.warning("ending an NCCL communicator that never got ready failed: %s", exc)
        raise
    return comm


class NcclGroup:
    """A communicator on one device, its two bucket buffers, streams and events."""

    def __init__(self, rendezvous: common_pb2.Rendezvous, rank: int, device: torch.device, bucket_bytes: int, *,
                 deadline_at: float, abort: threading.Event, watch: dist.Store, stop_keys: Sequence[str]) -> None:
        self.group_id = rendezvous.group_id
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.buffers: list[torch.Tensor] = []
        self.comm = join_communicator(lambda store: _communicator(store, rendezvous, rank, device), rendezvous,
                                      deadline_at=deadline_at, abort=abort, watch=watch, stop_keys=stop_keys)
        try:  # the buffers may not fit on the GPU: the communicator is not left behind
            with torch.cuda.device(device):
                self.copy_stream = torch.cuda.Stream(device)
                self.comm_stream = torch.cuda.Stream(device)
            self.buffers = self._new_buffers(bucket_bytes)
            self.on_wire = [torch.cuda.Event(), torch.cuda.Event()]  # each slot's last broadcast
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]   # each slot's last pack or unpack
        except BaseException:
            self.close()
            raise

    def fit(self, bucket_bytes: int) -> None:
        """Reallocates the buffers only when the plan's bucket size changed (the
        streams are idle between rounds)."""
        if bucket_bytes != self.bucket_bytes:
            self.bucket_bytes = bucket_bytes
            self.buffers = self._new_buffers(bucket_bytes)

    def _new_buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        """Two bucket buffers, marked as used by both side streams: dropped after a
        failure while a kernel may still touch them, their memory is not handed to
        another tensor until the work queued on those streams has ended."""
        buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        for buffer in buffers:
            buffer.record_stream(self.copy_stream)
            buffer.record_stream(self.comm_stream)
        return buffers

    def broadcast(self, slot: int, nbytes: int, operation: str, *, deadline_at: float, abort: threading.Event,
                  store: dist.Store, stop_keys: Sequence[str]) -> None:
        """Posts the broadcast of the first ``nbytes`` of buffer ``slot`` from rank 0,
        after that slot's last pack or unpack, on the communication stream; returns
        once it is queued there (a wait bounded like every other)."""
        def settle() -> None:
            wait_polling(_Ready(self.comm), deadline_at, operation, abort=abort, store=store, stop_keys=stop_keys)

        self.comm_stream.wait_event(self.copied[slot])
        self.comm.broadcast(self.buffers[slot].data_ptr(), nbytes, self.comm_stream.cuda_stream, settle=settle)
        self.on_wire[slot].record(self.comm_stream)

    def check(self) -> None:
        """TransferError when NCCL reports an asynchronous error (a peer went away)."""
        self.comm.check()

    def wait(self, event: torch.cuda.Event, operation: str, *, deadline_at: float, abort: threading.Event,
             store: dist.Store, stop_keys: Sequence[str]) -> None:
        wait_polling(EventDone(event, self.check), deadline_at, operation, abort=abort, store=store,
                     stop_keys=stop_keys)

    def close(self) -> None:
        """Ends the communicator with ``ncclCommAbort``, after a failure (whatever is
        still queued ends) and at the orderly end of a group alike. ``ncclCommDestroy``
        finalizes first, which can wait on peers, and a group ends when its membership
        changed, often because a peer went away: that wait would have no deadline. On
        an idle communicator the abort only frees it."""
        comm, self.comm = self.comm, None
        self.buffers = []
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:  # already broken: nothing more to end
                log.warning("ending the NCCL communicator failed: %s", exc)


def _communicator(store: dist.Store, rendezvous: common_pb2.Rendezvous, rank: int,
                  device: torch.device) -> Communicator:
    """Starts this rank's communicator on ``device`` (``join_communicator`` waits for
    it to be ready); rank 0 draws the unique id and publishes it first, the others
    read it from the store (a blocking read: this runs on a side thread)."""
    torch.cuda.set_device(device)  # NCCL takes the rank's GPU from this thread's current device
    key = session_key(rendezvous, "nccl-id")
    if rank == 0:
        unique_id = new_unique_id()
        store.set(key, unique_id)
    else:
        unique_id = store.get(key)
    return Communicator(rendezvous.world_size, unique_id, rank)


class NcclSender(Sender):
    """Rank 0 on the trainer's GPU."""

    kind = common_pb2.TRANSPORT_KIND_NCCL

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._group: NcclGroup | None = None

    def send(self, rendezvous, plan, sources, *, deadline_at, abort):
        start = time.monotonic()
        stop = [session_key(rendezvous, "err", r) for r in range(1, rendezvous.world_size)]
        try:
            device = tensors_device(sources, "trainer's tensors")
            group = self._ensure_group(rendezvous, plan, device, deadline_at, abort, stop)
            waits = {"deadline_at": deadline_at, "abort": abort, "store": self._store, "stop_keys": stop}
            with torch.cuda.device(device):
                group.copy_stream.wait_stream(torch.cuda.current_stream(device))  # the trainer's writes first
                for bucket in range(plan.num_buckets):
                    if abort.is_set():
                        raise TransferError("send aborted")
                    slot = bucket % 2
                    if bucket >= 2:  # at most two buckets in flight; a failed peer stops the send here
                        group.wait(group.on_wire[slot], "broadcast", **waits)
                    with torch.cuda.stream(group.copy_stream):
                        group.copy_stream.wait_event(group.on_wire[slot])
                        pack_bucket(plan, bucket, sources, group.buffers[slot])
                        group.copied[slot].record(group.copy_stream)
                    group.broadcast(slot, plan.bucket_size(bucket), "broadcast", **waits)
                for bucket in range(max(0, plan.num_buckets - 2), plan.num_buckets):
                    group.wait(group.on_wire[bucket % 2], "broadcast", **waits)
        except BaseException as exc:
            try:  # receivers stop waiting for buckets that will never come
                self._store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            self.close()
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, plan: BucketPlan, device: torch.device, deadline_at: float,
                      abort: threading.Event, stop: Sequence[str]) -> NcclGroup:
        g = self._group
        if g is None or g.group_id != rendezvous.group_id or g.device != device:
            self.close()
            self._group = NcclGroup(rendezvous, 0, device, plan.bucket_bytes, deadline_at=deadline_at, abort=abort,
                                    watch=self._store, stop_keys=stop)
        self._group.fit(plan.bucket_bytes)
        return self._group

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()


class NcclReceiver(Receiver):
    """Rank >= 1 on this process's current GPU."""

    kind = common_pb2.TRANSPORT_KIND_NCCL

    def __init__(self) -> None:
        self._store = StoreLink()
        self._group: NcclGroup | None = None

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        stop = [session_key(rendezvous, "abort")]
        try:
            with nothing_written():
                store = self._store.connect(rendezvous, deadline_at=deadline_at)
                device = torch.device("cuda", torch.cuda.current_device())
                group = self._ensure_group(rendezvous, rank, plan, device, deadline_at, abort, stop)
            waits = {"deadline_at": deadline_at, "abort": abort, "store": store, "stop_keys": stop}
            n = plan.num_buckets
            with torch.cuda.device(device):
                group.copy_stream.wait_stream(torch.cuda.current_stream(device))  # the engine's own work first
                group.broadcast(0, plan.bucket_size(0), "receive", **waits)
                for bucket in range(n):
                    if abort.is_set():
                        raise TransferError("receive aborted")
                    if bucket + 1 < n:  # its slot's last bucket was unpacked (waited below)
                        group.broadcast((bucket + 1) % 2, plan.bucket_size(bucket + 1), "receive", **waits)
                    slot = bucket % 2
                    group.wait(group.on_wire[slot], "receive", **waits)
                    with torch.cuda.stream(group.copy_stream):
                        group.copy_stream.wait_event(group.on_wire[slot])
                        unpack_bucket(plan, bucket, group.buffers[slot], targets)
                        group.copied[slot].record(group.copy_stream)
                    group.wait(group.copied[slot], "receive", **waits)
                    if on_bucket is not None:
                        on_bucket(bucket)
        except BaseException as exc:
            if self._store.store is not None:
                try:
                    self._store.store.set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
                except Exception:
                    pass
            self.close()
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, rank: int, plan: BucketPlan, device: torch.device, deadline_at: float,
                      abort: threading.Event, stop: Sequence[str]) -> NcclGroup:
        g = self._group
        if g is None or g.group_id != rendezvous.group_id or g.device != device:
            self.close()
            self._group = NcclGroup(rendezvous, rank, device, plan.bucket_bytes, deadline_at=deadline_at,
                                    abort=abort, watch=self._store.store, stop_keys=stop)
        self._group.fit(plan.bucket_bytes)
        return self._group

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()


__all__ = ["NcclSender", "NcclReceiver", "NcclGroup", "join_communicator"]
