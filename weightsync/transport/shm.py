"""shm transport: a two-slot shared-memory ring on one host, CPU (the analogue of CUDA IPC).

The trainer creates one file in /dev/shm holding two bucket slots and publishes its
name in the rendezvous store. For bucket b it waits until every receiver has
acknowledged bucket b-2 (the previous user of slot b % 2), packs b straight into the
slot and sets ``ready/b``; each receiver waits for ``ready/b``, copies the slot into
its engine's tensors and sets ``ack/b/<rank>``. So the sender packs b+1 while the
receivers load b, and the bytes are copied exactly twice (into the slot, out of it);
a bucket that lies as one run of memory on a side (``whole_buckets``) is one copy
there, not one per tensor.

Direct mode: where the kernel lets an engine read the trainer's memory
(``cross_memory``), the trainer also offers its tensors' addresses; each engine says
``mode/<rank>`` = ``direct`` or ``ring``. A direct engine reads every bucket's bytes
straight from the trainer's tensors into its own (one copy, none by the trainer) and
sets ``done/<rank>``; the ring runs only if some engine needs it. The trainer returns
only when every engine is done, so its tensors are not changed under a reader.

Push mode (``shm_push``): where the trainer's tensors are on 4 KiB pages and an
engine's weights lie in arenas (huge pages), the engine answers ``push`` and the
trainer writes into it instead (the kernel pins the other process's pages; small ones
cost about as much as the copy). Still one copy, by the trainer's threads.

A plain file + mmap is used rather than ``multiprocessing.shared_memory``: on Python
3.11 attaching registers the segment with the resource tracker of every receiver,
which unlinks it when that receiver exits. Signalling rides the TCP store because it
is already there and carries failures too: a receiver that fails sets ``err/<rank>``
and the sender stops waiting at once.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import psutil
import torch
import torch.distributed as dist

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.packing import byte_view, pack_bucket, unpack_bucket
from weightsync.transport import SHM_DIR, shm_push
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.cross_memory import (
    Beacon,
    RemoteMemory,
    addresses_for,
    advise_hugepages_once,
    carries_addresses,
    direct_enabled,
)
from weightsync.transport.store import StoreLink, delete_keys, session_key, wait_for_keys
from weightsync.transport.whole_buckets import whole_bucket_views
from weightsync.v1 import common_pb2

log = logging.getLogger(__name__)

ABORT_CHECK_S = 0.05  # how often a direct reader looks at the trainer's abort key


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
        self._owner_fd = -1
        try:
            if create:
                # Held for the segment's life; the kernel drops it when this process dies,
                # however it dies, which is how a later sender tells a leftover segment
                # from a live one (``remove_stale_segments``).
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise TransferError(f"shared memory segment {path} is smaller than the plan needs")
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if create:
            self._owner_fd = fd
        else:
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
            if self._owner_fd >= 0:
                os.close(self._owner_fd)
                self._owner_fd = -1


# weightsync-<pid of the sender>-<12 hex>: the segments ShmSender makes, nothing else.
_SEGMENT_NAME = re.compile(r"weightsync-(\d+)-[0-9a-f]{12}")
STALE_AGE_S = 10.0  # younger segments are left alone: their owner may not hold its lock yet


def remove_stale_segments(directory: str = SHM_DIR, *, min_age_s: float = STALE_AGE_S) -> list[str]:
    """Unlinks the segments in ``directory`` whose sender is gone; returns their paths.

    A sender that is killed (SIGKILL, a crash, the OOM killer) cannot unlink its segment,
    and /dev/shm is memory: each one left keeps two buckets (64 MiB by default) until
    the machine restarts. A segment is gone only if no process holds its lock (the
    owner's ``flock``, released by the kernel when the owner dies), the pid in its name
    is not a live process here (a sender of a release without the lock), and it is at
    least ``min_age_s`` old (a new one may be between creation and lock). Files of other
    users, or that vanish meanwhile, are skipped.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if now - info.st_mtime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a live owner holds it
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class ShmSender(Sender):
    """Owns the segment; rank 0."""

    kind = common_pb2.TRANSPORT_KIND_SHM

    def __init__(self, store: dist.Store, *, push: bool | None = None) -> None:
        """``push``: whether to offer engines to write into them (``shm_push``); default:
        where the trainer's tensors are on small pages, unless ``WEIGHTSYNC_SHM_PUSH=0``."""
        self._store = store
        self._segment: _Segment | None = None
        self._beacon: Beacon | None = None
        self._push = push
        self.last_direct_ranks: tuple[int, ...] = ()  # the engines that read directly last round
        self.last_pushed_ranks: tuple[int, ...] = ()  # the engines this process wrote into last round

    def send(self, rendezvous, plan, sources, *, deadline_at, abort,
             fill: Callable[[int, torch.Tensor], None] | None = None):
        """Sends ``sources``; or, with ``fill``, whatever ``fill(bucket, slot)`` writes into
        the bucket's slot (a host relay receiving it from the network), same pipeline."""
        if fill is None:
            whole: list = []  # made on the ring's first bucket: a round of direct reads never needs them

            def fill(bucket: int, slot: torch.Tensor) -> None:
                if not whole:
                    whole.extend(whole_bucket_views(plan, sources))
                if whole[bucket] is not None:  # the bucket lies as one run in the trainer: one copy
                    slot[:whole[bucket].numel()].copy_(whole[bucket])
                else:
                    pack_bucket(plan, bucket, sources, slot)
            addresses = addresses_for(sources, plan.dtypes, plan.sizes) if direct_enabled() else None
        else:
            addresses = None  # the bytes arrive bucket by bucket: there is nothing to read directly
        start = time.monotonic()
        store = self._store
        ranks = range(1, rendezvous.world_size)
        errors = [session_key(rendezvous, "err", r) for r in ranks]
        self.last_direct_ranks = self.last_pushed_ranks = ()
        ring_ranks: list[int] = []
        pushes: shm_push.Pushes | None = None
        nonce, asked = None, []
        try:
            seg = self._ensure_segment(plan.bucket_bytes)
            if addresses is not None:
                advise_hugepages_once(addresses)
                if self._beacon is None:
                    self._beacon = Beacon()
                nonce = shm_push.offer(store, rendezvous, addresses, self._push)
                store.set(session_key(rendezvous, "direct"), self._beacon.describe())
                store.set(session_key(rendezvous, "addresses"), addresses.tobytes())
            store.set(session_key(rendezvous, "segment"), f"{seg.path}|{seg.bucket_bytes}")
            if addresses is not None:
                modes = [session_key(rendezvous, "mode", r) for r in ranks]
                wait_for_keys(store, modes, deadline_at=deadline_at, operation="broadcast", abort=abort,
                              fail_keys=errors)
                answers = [store.get(key) for key in modes]
                direct = [r for r, answer in zip(ranks, answers, strict=True) if answer == b"direct"]
                asked = [r for r, answer in zip(ranks, answers, strict=True) if answer == b"push"]
                if asked:
                    if nonce is None:
                        raise TransferError(f"engine ranks {asked} asked to be written into; nothing was offered")
                    pushes = shm_push.Pushes(store, rendezvous, nonce, addresses, plan._nbytes.astype(np.uint64),
                                             deadline_at)
                    direct += pushes.start(asked)  # those refused read directly
                    self.last_pushed_ranks = pushes.ranks
                self.last_direct_ranks = tuple(sorted(direct))
            ring_ranks = [r for r in ranks if r not in self.last_direct_ranks and r not in self.last_pushed_ranks]
            if ring_ranks:
                self._run_ring(rendezvous, plan, seg, fill, ring_ranks, errors, deadline_at, abort)
            if pushes is not None:
                pushes.wait(errors, abort)
            if self.last_direct_ranks or self.last_pushed_ranks:
                done = sorted(self.last_direct_ranks + self.last_pushed_ranks)
                wait_for_keys(store, [session_key(rendezvous, "done", r) for r in done],
                              deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=errors)
        except BaseException as exc:
            try:  # tell receivers to stop waiting for buckets that will never come
                store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            if pushes is not None:  # no byte more into any engine; then tell them so
                pushes.stop()
            elif nonce is not None:  # engines may have asked: none will be written into
                shm_push.say_stopped(store, rendezvous)
            # The keys stay: a receiver may be between checking a key and reading it, and
            # a store read of a deleted key blocks until the store's timeout (seen: an
            # engine waited out a 60 s round for "addresses"). A failed round's few keys
            # are all it leaves.
            raise
        if pushes is not None:
            pushes.close()
        # Every receiver has said it is done (or acknowledged every ring bucket): none
        # reads a key of this round again.
        self._forget_keys(rendezvous, plan.num_buckets, offered=addresses is not None, ring_ranks=ring_ranks,
                          push_asked=asked if nonce is not None else None)
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _run_ring(self, rendezvous, plan, seg: _Segment, fill, ring_ranks, errors, deadline_at, abort) -> None:
        store = self._store
        n = plan.num_buckets
        seg.acquire()
        try:
            for bucket in range(n):
                if bucket >= 2:
                    wait_for_keys(store, [session_key(rendezvous, "ack", bucket - 2, r) for r in ring_ranks],
                                  deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=errors)
                fill(bucket, seg.slots[bucket % 2])
                store.set(session_key(rendezvous, "ready", bucket), b"1")
        finally:
            seg.release()
        for bucket in range(max(0, n - 2), n):
            wait_for_keys(store, [session_key(rendezvous, "ack", bucket, r) for r in ring_ranks],
                          deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=errors)

    def _forget_keys(self, rendezvous, n: int, *, offered: bool, ring_ranks: list[int],
                     push_asked: list[int] | None) -> None:
        """Deletes the round's keys (bounded store growth across thousands of steps), in
        one request: only those this round can have set (``push_asked``: the engines
        that asked to be written into, None where that was not offered)."""
        keys = [session_key(rendezvous, "segment")]
        if offered:
            keys += [session_key(rendezvous, name) for name in ("direct", "addresses")]
            keys += [session_key(rendezvous, name, r) for r in range(1, rendezvous.world_size)
                     for name in ("mode", "done")]
            if push_asked is not None:  # push was offered; these engines asked
                keys += shm_push.Pushes.keys(rendezvous, push_asked)
        if ring_ranks:
            for bucket in range(n):
                keys.append(session_key(rendezvous, "ready", bucket))
                keys += [session_key(rendezvous, "ack", bucket, r) for r in ring_ranks]
        delete_keys(self._store, keys)

    def _ensure_segment(self, bucket_bytes: int) -> _Segment:
        if self._segment is None or self._segment.bucket_bytes != bucket_bytes:
            self.close()
            removed = remove_stale_segments()
            if removed:
                log.info("shm: removed %d segment(s) left by senders that died: %s", len(removed), ", ".join(removed))
            path = os.path.join(SHM_DIR, f"weightsync-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._segment = _Segment(path, bucket_bytes, create=True)
        return self._segment

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


class _RoundWatch:
    """A receiver's look, between buckets, at whether its round still stands: its own
    abort flag, the deadline, and the trainer's abort key every ``ABORT_CHECK_S`` (not
    every bucket: each look is a round trip that the trainer's store serves on the
    trainer's cores)."""

    def __init__(self, store, abort_key: str, abort, deadline_at: float) -> None:
        self._store = store
        self._abort_key = abort_key
        self._abort = abort
        self._deadline_at = deadline_at
        self._next_look = 0.0

    def check(self) -> None:
        """Raises TransferError (aborted here or by the trainer) or StepTimeoutError."""
        if self._abort.is_set():
            raise TransferError("receive aborted")
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + ABORT_CHECK_S
            if self._store.check([self._abort_key]):
                reason = self._store.get(self._abort_key).decode(errors="replace")
                raise TransferError(f"peer reported failure: {reason}")
        if now >= self._deadline_at:
            raise StepTimeoutError("deadline exceeded during receive", operation="receive")


class ShmReceiver(Receiver):
    """Maps the trainer's segment; rank >= 1."""

    kind = common_pb2.TRANSPORT_KIND_SHM

    def __init__(self, *, direct: bool | None = None, push: bool | None = None) -> None:
        """``direct``: whether to read the trainer's memory when offered (default: unless
        ``WEIGHTSYNC_SHM_DIRECT=0``). ``push``: whether to ask the trainer to write into
        this engine's targets when offered (``shm_push``; default: where every target
        lies in an arena of this process, unless ``WEIGHTSYNC_SHM_PUSH=0``)."""
        self._store = StoreLink()
        self._segment: _Segment | None = None
        self._remote: RemoteMemory | None = None
        self._direct = direct
        self._push = push
        self.last_mode = ""  # "direct", "push" or "ring": how the last receive got its bytes

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        with nothing_written():
            store = self._store.connect(rendezvous, deadline_at=deadline_at)
        stop = [session_key(rendezvous, "abort")]
        beacon = None  # held while the trainer may write into this engine
        written = False  # the trainer said it wrote every byte (its writes are over)
        try:
            with nothing_written():
                wait_for_keys(store, [session_key(rendezvous, "segment")], deadline_at=deadline_at,
                              operation="receive", abort=abort, fail_keys=stop)
                direct = self._trainer_memory(store, rendezvous, plan)
                writable = None
                if direct is None:
                    path, size = store.get(session_key(rendezvous, "segment")).decode().rsplit("|", 1)
                    if int(size) != plan.bucket_bytes:
                        raise TransferError(f"segment bucket size {size} != plan bucket size {plan.bucket_bytes}")
                    seg = self._ensure_segment(path, plan.bucket_bytes)
                else:
                    writable = self._writable(plan, targets)
                    beacon = shm_push.propose(store, rendezvous, rank, writable, self._push)
                    trainer_pid = self._remote.pid
                if store.check([session_key(rendezvous, "direct")]):  # the trainer waits for every answer
                    mode = b"ring" if direct is None else b"direct" if beacon is None else b"push"
                    store.set(session_key(rendezvous, "mode", rank), mode)
            self.last_mode = "ring" if direct is None else "direct"
            if beacon is not None and shm_push.accepted(store, rendezvous, rank, deadline_at=deadline_at,
                                                        abort=abort, stop_keys=stop):
                shm_push.await_written(store, rendezvous, rank, deadline_at=deadline_at, abort=abort,
                                       stop_keys=stop)
                written = True
                self.last_mode = "push"
                if on_bucket is not None:  # every bucket has landed; a round that fails meanwhile still fails here
                    watch = _RoundWatch(store, stop[0], abort, deadline_at)
                    for bucket in range(plan.num_buckets):
                        watch.check()
                        on_bucket(bucket)
                store.set(session_key(rendezvous, "done", rank), b"1")
            elif direct is not None:
                self._read_direct(store, plan, targets, direct, writable, stop[0], deadline_at, abort, on_bucket)
                store.set(session_key(rendezvous, "done", rank), b"1")
            else:
                self._read_ring(store, rendezvous, rank, plan, seg, targets, stop, deadline_at, abort, on_bucket)
        except BaseException as exc:
            try:
                store.set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
            except Exception:
                pass
            if beacon is not None and not written:  # the trainer may be writing into the targets: wait until it stopped
                shm_push.settle_after_failure(store, rendezvous, trainer_pid, targets)
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    @staticmethod
    def _writable(plan, targets) -> np.ndarray | None:
        """Every target's address, where the targets are a list the kernel can write
        into as runs of bytes (the reference engine's parameters: addresses kept by the
        engine, or taken here in one pass); None for a streamed load (targets made
        bucket by bucket) or where some target is not such a run."""
        if isinstance(targets, (list, tuple)) or carries_addresses(targets, plan.sizes):
            return addresses_for(targets, plan.dtypes, plan.sizes)
        return None

    def _trainer_memory(self, store, rendezvous, plan) -> np.ndarray | None:
        """The trainer's source addresses (plan order) where this receive can read the
        trainer's memory directly; None for the ring."""
        offer = session_key(rendezvous, "direct")
        enabled = direct_enabled() if self._direct is None else self._direct
        if not enabled or not store.check([offer]):
            return None
        description = store.get(offer)
        if self._remote is None or not self._remote.describes(description):
            self._remote = RemoteMemory.attach(description)
        elif not self._remote.beacon_matches():
            self._remote = None
        if self._remote is None:
            return None
        remote = np.frombuffer(store.get(session_key(rendezvous, "addresses")), dtype=np.uint64)
        if len(remote) != len(plan):
            raise TransferError(f"the trainer offered {len(remote)} tensor addresses for a plan of {len(plan)}")
        return remote

    def _read_direct(self, store, plan, targets, remote: np.ndarray, writable: np.ndarray | None, abort_key,
                     deadline_at, abort, on_bucket) -> None:
        """Every bucket's pieces, read from the trainer's tensors into the targets (kernel
        calls of at most 4 MiB, see ``cross_memory``). Targets are asked for bucket by bucket,
        as the ring does (a streamed load makes each tensor when its bytes arrive). A
        target the kernel cannot write into as one run of bytes (not a contiguous CPU
        tensor of the plan's dtype) is read into a bounce buffer and copied."""
        memory = self._remote
        sizes, dtypes, shapes = plan.sizes, plan.dtypes, plan.shapes
        # ``writable``: every target's address (``_writable``), then whole-array work per
        # bucket; a streamed load or a bounced target: per tensor.
        nbytes = plan._nbytes.astype(np.uint64)
        watch = _RoundWatch(store, abort_key, abort, deadline_at)
        for bucket in range(plan.num_buckets):
            watch.check()
            whole, _, split = plan._whole_and_split[bucket]
            bounced = []
            if writable is not None:
                at = np.array(whole, np.int64)
                local, source, lengths = [writable[at]], [remote[at]], [nbytes[at]]
            else:
                local, source, lengths = self._whole_targets(whole, targets, remote, sizes, dtypes, shapes,
                                                             bounced)
            for p in split:
                target = byte_view(targets[p.tensor_index])[p.tensor_start:p.tensor_start + p.length]
                if not target.is_cpu:
                    buffer = torch.empty(p.length, dtype=torch.uint8)
                    bounced.append((target, buffer))
                    target = buffer
                local.append(np.array([target.data_ptr()], np.uint64))
                source.append(remote[p.tensor_index:p.tensor_index + 1] + np.uint64(p.tensor_start))
                lengths.append(np.array([p.length], np.uint64))
            memory.read(np.concatenate(local), np.concatenate(source), np.concatenate(lengths))
            for target, buffer in bounced:
                target.copy_(buffer)
            if on_bucket is not None:
                on_bucket(bucket)
        if not memory.beacon_matches():  # the pid was the trainer's for the whole read
            self._remote = None
            raise TransferError(f"the trainer (pid {memory.pid}) went away during the read")

    @staticmethod
    def _whole_targets(whole, targets, remote: np.ndarray, sizes, dtypes, shapes, bounced: list):
        """Addresses for the tensors that lie whole in a bucket, one target at a time (a
        target made on demand is made here); one the kernel cannot write into as one run
        of bytes (not a contiguous CPU tensor of the plan's dtype) gets a bounce buffer,
        recorded in ``bounced`` to be copied after the read."""
        local, lengths = [], []
        for i in whole:
            target = targets[i]
            if not (target.is_cpu and target.dtype is dtypes[i] and target.is_contiguous()
                    and target.nbytes == sizes[i]):
                buffer = torch.empty(sizes[i], dtype=torch.uint8)
                bounced.append((target, buffer.view(dtypes[i]).view(shapes[i])))
                target = buffer
            local.append(target.data_ptr())
            lengths.append(sizes[i])
        at = np.array(whole, np.int64)
        return [np.array(local, np.uint64)], [remote[at]], [np.array(lengths, np.uint64)]

    def _read_ring(self, store, rendezvous, rank, plan, seg, targets, stop, deadline_at, abort, on_bucket) -> None:
        whole = whole_bucket_views(plan, targets)  # buckets that lie as one run in the targets: one copy each
        seg.acquire()
        try:
            for bucket in range(plan.num_buckets):
                wait_for_keys(store, [session_key(rendezvous, "ready", bucket)], deadline_at=deadline_at,
                              operation="receive", abort=abort, fail_keys=stop)
                if whole[bucket] is not None:
                    whole[bucket].copy_(seg.slots[bucket % 2][:whole[bucket].numel()])
                else:
                    unpack_bucket(plan, bucket, seg.slots[bucket % 2], targets)
                if on_bucket is not None:
                    on_bucket(bucket)
                store.set(session_key(rendezvous, "ack", bucket, rank), b"1")
        finally:
            seg.release()

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
        self._store.forget()
        self._remote = None


__all__ = ["ShmSender", "ShmReceiver", "SHM_DIR", "remove_stale_segments"]
