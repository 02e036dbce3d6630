"""shm transport: a two-slot shared-memory ring on one host, CPU (the analogue of CUDA IPC).

The trainer creates one file in /dev/shm holding two bucket slots and publishes its
name in the rendezvous store. For bucket b it waits until every receiver has
acknowledged bucket b-2 (the previous user of slot b % 2), packs b straight into the
slot and sets ``ready/b``; each receiver waits for ``ready/b``, copies the slot into
its engine's tensors and sets ``ack/b/<rank>``. So the sender packs b+1 while the
receivers load b, and the bytes are copied exactly twice (into the slot, out of it).

A plain file + mmap is used rather than ``multiprocessing.shared_memory``: on Python
3.11 attaching registers the segment with the resource tracker of every receiver,
which unlinks it when that receiver exits. Signalling rides the TCP store because it
is already there and carries failures too: a receiver that fails sets ``err/<rank>``
and the sender stops waiting at once.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from weightsync.errors import TransferError
from weightsync.plan import pack_bucket, unpack_bucket
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.store import connect_store, session_key, wait_for_keys
from weightsync.v1 import common_pb2

SHM_DIR = os.environ.get("WEIGHTSYNC_SHM_DIR", "/dev/shm")


class _Segment:
    """A mapped shared-memory file with two bucket slots.

    Never unmapped under a reader: a transfer holds the segment (``acquire`` /
    ``release``) while it packs or unpacks, and ``close`` during a transfer (an agent
    shutting down while an abandoned receive is still copying) only marks it; the
    last ``release`` unmaps. ``torch.frombuffer`` views do not pin the mapping, so an
    unmap under them is a SIGSEGV, not an exception.
    """

    def __init__(self, path: str, bucket_bytes: int, *, create: bool) -> None:
        self.path = path
        self.bucket_bytes = bucket_bytes
        self.owner = create
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False
        size = 2 * bucket_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise TransferError(f"shared memory segment {path} is smaller than the plan needs")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots = [whole[:bucket_bytes], whole[bucket_bytes:2 * bucket_bytes]]
        del whole

    def acquire(self) -> None:
        """A transfer starts using the slots."""
        with self._lock:
            if self._closing:
                raise TransferError("the shared memory segment is closed")
            self._users += 1

    def release(self) -> None:
        """A transfer stopped using the slots; unmaps if a close was waiting for it."""
        with self._lock:
            self._users -= 1
            if self._closing and self._users == 0:
                self._unmap()

    def close(self) -> None:
        """Unmaps now, or when the running transfer releases the segment."""
        with self._lock:
            self._closing = True
            if self._users == 0:
                self._unmap()

    def _unmap(self) -> None:
        self.slots = []
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the GC will close it
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ShmSender(Sender):
    """Owns the segment; rank 0."""

    kind = common_pb2.TRANSPORT_KIND_SHM

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._segment: _Segment | None = None

    def send(self, rendezvous, plan, sources, *, deadline_at, abort,
             fill: Callable[[int, torch.Tensor], None] | None = None):
        """Sends ``sources``; or, with ``fill``, whatever ``fill(bucket, slot)`` writes into
        the bucket's slot (a host relay receiving it from the network), same pipeline."""
        if fill is None:
            def fill(bucket: int, slot: torch.Tensor) -> None:
                pack_bucket(plan, bucket, sources, slot)
        start = time.monotonic()
        store = self._store
        ranks = range(1, rendezvous.world_size)
        errors = [session_key(rendezvous, "err", r) for r in ranks]
        try:
            seg = self._ensure_segment(plan.bucket_bytes)
            store.set(session_key(rendezvous, "segment"), f"{seg.path}|{seg.bucket_bytes}")
            n = plan.num_buckets
            seg.acquire()
            try:
                for bucket in range(n):
                    if bucket >= 2:
                        wait_for_keys(store, [session_key(rendezvous, "ack", bucket - 2, r) for r in ranks],
                                      deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=errors)
                    fill(bucket, seg.slots[bucket % 2])
                    store.set(session_key(rendezvous, "ready", bucket), b"1")
            finally:
                seg.release()
            for bucket in range(max(0, n - 2), n):
                wait_for_keys(store, [session_key(rendezvous, "ack", bucket, r) for r in ranks],
                              deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=errors)
        except BaseException as exc:
            try:  # tell receivers to stop waiting for buckets that will never come
                store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            raise
        finally:
            self._forget_keys(rendezvous, plan.num_buckets)
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _forget_keys(self, rendezvous, n: int) -> None:
        # Bounded store growth across thousands of steps; a missing key is fine.
        for bucket in range(n):
            for key in [session_key(rendezvous, "ready", bucket)] + [
                    session_key(rendezvous, "ack", bucket, r) for r in range(1, rendezvous.world_size)]:
                try:
                    self._store.delete_key(key)
                except Exception:
                    return

    def _ensure_segment(self, bucket_bytes: int) -> _Segment:
        if self._segment is None or self._segment.bucket_bytes != bucket_bytes:
            self.close()
            path = os.path.join(SHM_DIR, f"weightsync-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._segment = _Segment(path, bucket_bytes, create=True)
        return self._segment

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


class ShmReceiver(Receiver):
    """Maps the trainer's segment; rank >= 1."""

    kind = common_pb2.TRANSPORT_KIND_SHM

    def __init__(self) -> None:
        self._store: tuple[tuple[str, int], dist.Store] | None = None
        self._segment: _Segment | None = None

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        where = (rendezvous.store_host, rendezvous.store_port)
        with nothing_written():
            if self._store is None or self._store[0] != where:
                self._store = (where, connect_store(*where, deadline_at=deadline_at, secret=rendezvous.store_secret))
        store = self._store[1]
        stop = [session_key(rendezvous, "abort")]
        try:
            with nothing_written():
                wait_for_keys(store, [session_key(rendezvous, "segment")], deadline_at=deadline_at,
                              operation="receive", abort=abort, fail_keys=stop)
                path, size = store.get(session_key(rendezvous, "segment")).decode().rsplit("|", 1)
                if int(size) != plan.bucket_bytes:
                    raise TransferError(f"segment bucket size {size} != plan bucket size {plan.bucket_bytes}")
                seg = self._ensure_segment(path, plan.bucket_bytes)
            seg.acquire()
            try:
                for bucket in range(plan.num_buckets):
                    wait_for_keys(store, [session_key(rendezvous, "ready", bucket)], deadline_at=deadline_at,
                                  operation="receive", abort=abort, fail_keys=stop)
                    unpack_bucket(plan, bucket, seg.slots[bucket % 2], targets)
                    if on_bucket is not None:
                        on_bucket(bucket)
                    store.set(session_key(rendezvous, "ack", bucket, rank), b"1")
            finally:
                seg.release()
        except BaseException as exc:
            try:
                store.set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
            except Exception:
                pass
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_segment(self, path: str, bucket_bytes: int) -> _Segment:
        if self._segment is None or self._segment.path != path:
            if self._segment is not None:
                self._segment.close()
            try:
                self._segment = _Segment(path, bucket_bytes, create=False)
            except FileNotFoundError as exc:
                raise TransferError(f"shared memory segment {path} not found (is the trainer on this host?)") from exc
        return self._segment

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._store = None


__all__ = ["ShmSender", "ShmReceiver", "SHM_DIR"]
