"""gloo transport: torch.distributed gloo broadcast over TCP, CPU, works across hosts.

The group is a ``ProcessGroupGloo`` built directly on the trainer's authenticated
store (keys under ``ws/<group_id>/gloo``), never ``init_process_group``: the trainer's
own default world is left alone. Two bucket buffers alternate so the sender packs bucket k+1 while k is on
the wire and each receiver unpacks bucket k while k+1 arrives (gloo runs queued ops
in order, so posting k+1 before waiting on k is safe).

What goes through the buffers is only what must: each bucket is cut into ranges
(``BucketPlan.bucket_ops``), and every piece of 1 MiB or more is a broadcast of its
own, sent straight from the trainer's tensor and landing straight in the engine's
(where the dtype matches and the tensor is a contiguous CPU tensor; else that range is
staged in the buffer). Only the small tensors between them are packed and unpacked,
and not even those on a side whose tensors lie end to end in memory as the plan lays
them out (``memory_runs``: the reference engine's arena). Where both ends' tensors lie
so, a whole bucket is one broadcast (``whole_buckets``, agreed per round).
On a machine where the network is loopback, those two copies cost as much CPU as the
wire itself (1 GiB in 509 tensors, 2 engines: 1.59 s with every byte packed). Where a
bucket has two or more runs of small tensors between its large pieces, the runs go as
one broadcast of their bytes end to end (``BucketPlan.wire_ops``; gathered from the
packed buffer and scattered back, copies of the small bytes only): a broadcast costs
a round trip to every receiver, and a dense model's norms and biases between its
matrices made hundreds of them per sync.

Failure handling. A posted gloo op cannot be cancelled, and destroying a group with
an op still pending blocks until the op's timeout. So waits poll ``is_completed``
and, every ``PEER_CHECK_S``, the store: a side that fails sets ``abort`` (sender)
or ``err/<rank>`` (receiver) under the session, and its peers stop waiting at once.
A failed group is retired, never destroyed on the transfer thread: a daemon thread
drops it, which takes until its pending ops have timed out. An idle group (the
orderly close) is destroyed at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from weightsync.errors import TransferError
from weightsync.packing import (
    byte_view,
    gather_ranges,
    pack_bucket,
    pack_piece,
    scatter_ranges,
    unpack_bucket,
    unpack_piece,
)
from weightsync.plan import BucketPlan, Piece
from weightsync.transport import whole_buckets
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.collective import (
    broadcast_from_root,
    join_in_background,
    retire,
    wait_polling,
)
from weightsync.transport.memory_runs import bucket_runs
from weightsync.transport.store import connect_store, prefixed, session_key, wait_for_keys
from weightsync.transport.whole_buckets import whole_bucket_views
from weightsync.v1 import common_pb2


class GlooGroup:
    """A gloo group plus its two bucket buffers and two staging buffers for gathered
    small ranges (``BucketPlan.wire_ops``), reused while the group id stays (the
    sender, the receiver and the host relay's upstream end each hold one)."""

    def __init__(self, rendezvous: common_pb2.Rendezvous, rank: int, bucket_bytes: int, *, bind_host: str,
                 deadline_at: float, abort: threading.Event, watch: dist.Store, stop_keys: Sequence[str],
                 gathered_bytes: int = 0, slots: int = 2) -> None:
        self.group_id = rendezvous.group_id
        self.bucket_bytes = bucket_bytes
        self.gathered_bytes = gathered_bytes
        self.slots = slots
        self.timeout_s = max(deadline_at - time.monotonic(), 0.001)  # every op's; retire() waits it out
        options = gloo_options(bind_host, timedelta(seconds=self.timeout_s))
        self.pg = join_in_background(
            lambda store: dist.ProcessGroupGloo(prefixed(store, f"ws/{rendezvous.group_id}/gloo"), rank,
                                                rendezvous.world_size, options),
            rendezvous, operation="gloo group setup", deadline_at=deadline_at, abort=abort, watch=watch,
            stop_keys=stop_keys)
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8) for _ in range(slots)]
        self.gathered = [torch.empty(gathered_bytes, dtype=torch.uint8) for _ in range(slots)]

    def fit(self, plan: BucketPlan) -> None:
        """Reallocates the buffers only when the plan's bucket size, or the staging its
        gathered ranges need, changed."""
        if plan.bucket_bytes != self.bucket_bytes and self.bucket_bytes:  # 0: buckets land elsewhere (relay)
            self.bucket_bytes = plan.bucket_bytes
            self.buffers = [torch.empty(plan.bucket_bytes, dtype=torch.uint8) for _ in range(self.slots)]
        if plan.gathered_bytes != self.gathered_bytes:
            self.gathered_bytes = plan.gathered_bytes
            self.gathered = [torch.empty(plan.gathered_bytes, dtype=torch.uint8) for _ in range(self.slots)]


# Worker threads of each side's gloo group. gloo runs a queued op on one of its
# worker threads from start to end (the root's thread until every receiver has the
# bytes), so their number is how many broadcasts are in flight at once. A plan has
# hundreds of broadcasts where a model has hundreds of tensors of 1 MiB or more
# (``BucketPlan.wire_ops``); with gloo's default of two they went two at a time, each
# paced by its round trip and by thread wake-ups on a busy host. Measured in
# docs/benchmarks.md, "gloo: worker threads and small copies".
GLOO_THREADS = 8


def gloo_options(bind_host: str, timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """Options of a gloo group this side joins: listening on ``bind_host``
    (``data_device``), ``GLOO_THREADS`` worker threads, every op bounded by ``timeout``."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [data_device(bind_host)]
    options._threads = GLOO_THREADS
    return options


def data_device(bind_host: str):
    """gloo's endpoint on ``bind_host``: the address this side's peers reach it at.

    Never gloo's default, which binds to whatever this machine's hostname resolves to
    (often 127.0.1.1 or 127.0.0.1: peers on other hosts are then refused). A host that
    is not an address of this machine fails here, at once, saying which.
    """
    try:
        return dist.ProcessGroupGloo.create_device(hostname=bind_host)
    except RuntimeError as exc:
        raise TransferError(f"gloo cannot listen on {bind_host!r} (the data-plane address of this side): {exc}",
                            metadata={"address": bind_host}) from exc


def retire_group(group: GlooGroup | None, pending: Sequence[dist.Work | None] = ()) -> None:
    """Frees a failed group's buffers now and retires the group (``collective.retire``)."""
    if group is not None:
        group.buffers = group.gathered = []  # free the memory now; the group object goes later
        retire(group, pending=pending)


# How a bucket is cut into broadcasts (``BucketPlan.wire_ops``). Both ends must cut
# alike: gloo pairs the n-th broadcast of each side whatever their lengths, so two
# different cuts would move wrong bytes without an error. The trainer names its cut in
# the round's store; each receiver checks it before its first broadcast.
# v1: every range of bucket_ops a broadcast; v2: a bucket's small ranges gathered into one.
# v3: and buckets that both ends hold as one run of memory go whole, as agreed per
# round (``whole_buckets``).
WIRE_FORMAT = b"ranges-v3:1MiB:gathered:whole"


def announce_wire_format(store: dist.Store, rendezvous) -> None:
    """The sender's side: names its cut for this round."""
    store.set(session_key(rendezvous, "gloo-wire"), WIRE_FORMAT)


def check_wire_format(store: dist.Store, rendezvous, *, deadline_at: float, abort: threading.Event,
                      stop_keys: Sequence[str]) -> None:
    """A receiver's side: TransferError unless the trainer cuts as this side does."""
    key = session_key(rendezvous, "gloo-wire")
    wait_for_keys(store, [key], deadline_at=deadline_at, operation="receive", abort=abort, fail_keys=stop_keys)
    theirs = store.get(key)
    if theirs != WIRE_FORMAT:
        raise TransferError(f"the trainer's gloo wire format is {theirs.decode(errors='replace')!r}, this side's "
                            f"{WIRE_FORMAT.decode()!r}: run the same weightsync release on both sides",
                            metadata={"theirs": theirs.decode(errors="replace"), "ours": WIRE_FORMAT.decode()})


def _wire_bytes(tensor: torch.Tensor, dtype: torch.dtype, piece: Piece) -> torch.Tensor | None:
    """``piece``'s bytes as a view of ``tensor``, when they can go on (or come off) the
    wire there: a contiguous CPU tensor of the plan's dtype. The bytes on the wire are
    the same either way, so each side decides for itself."""
    if not tensor.is_cpu or tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    return byte_view(tensor)[piece.tensor_start:piece.tensor_start + piece.length]


class GlooSender(Sender):
    """Rank 0 of a gloo group on the trainer's store; gloo listens on ``bind_host``
    (the address the engines reach this trainer at)."""

    kind = common_pb2.TRANSPORT_KIND_GLOO

    def __init__(self, store: dist.Store, bind_host: str) -> None:
        self._store = store
        self._bind_host = bind_host
        self._group: GlooGroup | None = None

    def send(self, rendezvous, plan, sources, *, deadline_at, abort):
        start = time.monotonic()
        stop = [session_key(rendezvous, "err", r) for r in range(1, rendezvous.world_size)]
        works: list[list[dist.Work]] = [[], []]  # the two buckets in flight, one work per range

        def wait(slot: int) -> None:
            while works[slot]:
                wait_polling(works[slot][0], deadline_at, "broadcast", abort=abort, store=self._store,
                             stop_keys=stop)
                works[slot].pop(0)

        try:
            announce_wire_format(self._store, rendezvous)
            group = self._ensure_group(rendezvous, plan, deadline_at, abort, stop)
            views = whole_bucket_views(plan, sources)
            whole = whole_buckets.choose(self._store, rendezvous, [v is not None for v in views],
                                         deadline_at=deadline_at, abort=abort, stop_keys=stop)
            for bucket in range(plan.num_buckets):
                if abort.is_set():
                    raise TransferError("send aborted")
                slot = bucket % 2
                wait(slot)
                if whole[bucket]:  # one run of memory here and at every receiver: one broadcast
                    works[slot].append(broadcast_from_root(group.pg, views[bucket]))
                    continue
                buf = group.buffers[slot]
                wire = plan.wire_ops(bucket)
                runs = bucket_runs(plan, bucket, sources)  # small tensors end to end in memory: sent from there
                if wire.packs and runs is None:
                    pack_bucket(plan, bucket, sources, buf, small_only=True)
                if wire.gathered:
                    gathered = group.gathered[slot][:wire.gathered_bytes]
                    gather_ranges(buf, wire.gathered, gathered)
                    works[slot].append(broadcast_from_root(group.pg, gathered))
                for lo, hi, piece in wire.ops:  # not ``start``: that is the transfer's clock
                    data = None
                    if piece is not None:
                        index = piece.tensor_index
                        data = _wire_bytes(sources[index], plan.dtypes[index], piece)
                        if data is None:
                            pack_piece(plan, piece, sources, buf)
                    elif runs is not None:
                        data = runs[lo]
                    works[slot].append(broadcast_from_root(group.pg, buf[lo:hi] if data is None else data))
            wait(0)
            wait(1)
            # Every receiver read the format and the whole-bucket choice before its first
            # broadcast completed.
            self._store.delete_key(session_key(rendezvous, "gloo-wire"))
            whole_buckets.forget(self._store, rendezvous)
        except BaseException as exc:
            try:  # receivers stop waiting for buckets that will never come
                self._store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            retire_group(self._group, works[0] + works[1])  # a failed group is never reused: peers may be mid-op
            self._group = None
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, plan: BucketPlan, deadline_at: float, abort: threading.Event,
                      stop: Sequence[str]) -> GlooGroup:
        g = self._group
        if g is None or g.group_id != rendezvous.group_id:
            self.close()
            self._group = GlooGroup(rendezvous, 0, plan.bucket_bytes, bind_host=self._bind_host,
                                 deadline_at=deadline_at, abort=abort, watch=self._store, stop_keys=stop,
                                 gathered_bytes=plan.gathered_bytes)
        self._group.fit(plan)
        return self._group

    def close(self) -> None:
        self._group = None  # idle group: destroying it is immediate


class GlooReceiver(Receiver):
    """Rank >= 1 of a gloo group; connects to the trainer's store; gloo listens on
    ``bind_host`` (the address this engine's agent advertises)."""

    kind = common_pb2.TRANSPORT_KIND_GLOO

    def __init__(self, bind_host: str) -> None:
        self._bind_host = bind_host
        self._store: tuple[tuple[str, int], dist.Store] | None = None
        self._group: GlooGroup | None = None

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        works: list[list[dist.Work]] = [[], []]  # the two buckets in flight, one work per range
        try:
            stop = [session_key(rendezvous, "abort")]
            with nothing_written():
                group = self._ensure_group(rendezvous, rank, plan, deadline_at, abort, stop)
                store = self._store[1]
                check_wire_format(store, rendezvous, deadline_at=deadline_at, abort=abort, stop_keys=stop)
                views = whole_bucket_views(plan, targets)
                whole = whole_buckets.offer(store, rendezvous, rank, [v is not None for v in views],
                                            deadline_at=deadline_at, abort=abort, stop_keys=stop)
            n = plan.num_buckets
            # Ranges of bucket k staged in the buffer (copied out once k has arrived).
            # Targets are asked for when their bucket is posted, not all up front: a
            # receiver whose targets are made as their first byte arrives (streamed
            # loading) must not have every target made at the start.
            staged: dict[int, list[Piece]] = {}

            # Buckets whose small tensors landed straight in the targets' memory (it lies
            # as one run: ``memory_runs``): nothing of them to unpack.
            landed: set[int] = set()

            def post(bucket: int) -> None:
                buf, slot = group.buffers[bucket % 2], bucket % 2
                staged[bucket] = []
                if whole[bucket]:  # lands in the targets' memory as it lies: one broadcast
                    works[slot].append(broadcast_from_root(group.pg, views[bucket]))
                    return
                wire = plan.wire_ops(bucket)
                runs = bucket_runs(plan, bucket, targets)
                if runs is not None:
                    landed.add(bucket)
                if wire.gathered:
                    works[slot].append(broadcast_from_root(group.pg, group.gathered[slot][:wire.gathered_bytes]))
                for lo, hi, piece in wire.ops:  # not ``start``: that is the transfer's clock
                    into = None
                    if piece is not None:
                        index = piece.tensor_index
                        into = _wire_bytes(targets[index], plan.dtypes[index], piece)
                        if into is None:
                            staged[bucket].append(piece)
                    elif runs is not None:
                        into = runs[lo]
                    works[slot].append(broadcast_from_root(group.pg, buf[lo:hi] if into is None else into))

            post(0)
            for bucket in range(n):
                if abort.is_set():
                    raise TransferError("receive aborted")
                if bucket + 1 < n:
                    post(bucket + 1)
                slot = bucket % 2
                while works[slot]:
                    wait_polling(works[slot][0], deadline_at, "receive", abort=abort, store=store, stop_keys=stop)
                    works[slot].pop(0)
                buf = group.buffers[slot]
                wire = plan.wire_ops(bucket)
                if whole[bucket]:
                    staged.pop(bucket)
                    if on_bucket is not None:
                        on_bucket(bucket)
                    continue
                if wire.gathered:
                    scatter_ranges(group.gathered[slot], wire.gathered, buf)
                if wire.packs and bucket not in landed:
                    unpack_bucket(plan, bucket, buf, targets, small_only=True)
                landed.discard(bucket)
                for piece in staged.pop(bucket):
                    unpack_piece(plan, piece, buf, targets)
                if on_bucket is not None:
                    on_bucket(bucket)
        except BaseException as exc:
            if self._store is not None:
                try:  # the sender stops at once instead of waiting out its deadline
                    self._store[1].set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
                except Exception:
                    pass
            retire_group(self._group, works[0] + works[1])
            self._group = None
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, rank: int, plan: BucketPlan, deadline_at: float, abort: threading.Event,
                      stop: Sequence[str]) -> GlooGroup:
        g = self._group
        if g is not None and g.group_id == rendezvous.group_id:
            g.fit(plan)
            return g
        self._group = None
        where = (rendezvous.store_host, rendezvous.store_port)
        if self._store is None or self._store[0] != where:
            self._store = (where, connect_store(*where, deadline_at=deadline_at, secret=rendezvous.store_secret))
        self._group = GlooGroup(rendezvous, rank, plan.bucket_bytes, bind_host=self._bind_host,
                             deadline_at=deadline_at, abort=abort, watch=self._store[1], stop_keys=stop,
                             gathered_bytes=plan.gathered_bytes)
        return self._group

    def close(self) -> None:
        self._group = None  # idle group: destroying it is immediate
        self._store = None


__all__ = ["GlooSender", "GlooReceiver", "GlooGroup", "data_device", "gloo_options", "retire_group"]
