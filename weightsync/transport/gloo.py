"""gloo transport: torch.distributed gloo broadcast over TCP, CPU, works across hosts.

The group is a ``ProcessGroupGloo`` built directly on the trainer's authenticated
store (keys under ``ws/<group_id>/gloo``), never ``init_process_group``: the trainer's
own default world is left alone. Two bucket buffers alternate so the sender packs bucket k+1 while k is on
the wire and each receiver unpacks bucket k while k+1 arrives (gloo runs queued ops
in order, so posting k+1 before waiting on k is safe).

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
from weightsync.plan import BucketPlan, byte_view, pack_bucket, unpack_bucket
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.collective import (
    broadcast_from_root,
    join_in_background,
    retire,
    wait_polling,
)
from weightsync.transport.store import connect_store, prefixed, session_key
from weightsync.v1 import common_pb2


class GlooGroup:
    """A gloo group plus its two bucket buffers, reused while the group id stays
    (the sender, the receiver and the host relay's upstream end each hold one)."""

    def __init__(self, rendezvous: common_pb2.Rendezvous, rank: int, bucket_bytes: int, *, bind_host: str,
                 deadline_at: float, abort: threading.Event, watch: dist.Store, stop_keys: Sequence[str]) -> None:
        self.group_id = rendezvous.group_id
        self.bucket_bytes = bucket_bytes
        self.timeout_s = max(deadline_at - time.monotonic(), 0.001)  # every op's; retire() waits it out
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=self.timeout_s)
        options._devices = [data_device(bind_host)]
        self.pg = join_in_background(
            lambda store: dist.ProcessGroupGloo(prefixed(store, f"ws/{rendezvous.group_id}/gloo"), rank,
                                                rendezvous.world_size, options),
            rendezvous, operation="gloo group setup", deadline_at=deadline_at, abort=abort, watch=watch,
            stop_keys=stop_keys)
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8) for _ in range(2)]

    def fit(self, bucket_bytes: int) -> None:
        """Reallocates the buffers only when the plan's bucket size changed."""
        if bucket_bytes != self.bucket_bytes:
            self.bucket_bytes = bucket_bytes
            self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8) for _ in range(2)]


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


def _retire(group: GlooGroup | None, pending: Sequence[dist.Work | None] = ()) -> None:
    if group is not None:
        group.buffers = []  # free the memory now; the group object goes later
        retire(group, pending=pending)


def _direct(plan: BucketPlan, bucket: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of ``bucket`` as a view of one tensor, when the bucket lies wholly inside
    a tensor whose dtype is the wire dtype: then it goes on the wire from (or lands in)
    that tensor directly, with no copy through a bucket buffer. Large tensors span many
    such buckets. The bytes on the wire are the same either way, so each side decides
    for itself."""
    piece = plan.sole_piece(bucket)
    if piece is None:
        return None
    tensor = tensors[piece.tensor_index]
    if tensor.dtype != plan.dtypes[piece.tensor_index] or not tensor.is_contiguous():
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
        works: list[dist.Work | None] = [None, None]  # the two buckets in flight
        try:
            group = self._ensure_group(rendezvous, plan, deadline_at, abort, stop)
            for bucket in range(plan.num_buckets):
                if abort.is_set():
                    raise TransferError("send aborted")
                slot = bucket % 2
                if works[slot] is not None:
                    wait_polling(works[slot], deadline_at, "broadcast", abort=abort, store=self._store, stop_keys=stop)
                buf = _direct(plan, bucket, sources)
                if buf is None:
                    buf = group.buffers[slot][:plan.bucket_size(bucket)]
                    pack_bucket(plan, bucket, sources, buf)
                works[slot] = broadcast_from_root(group.pg, buf)
            for work in works:
                if work is not None:
                    wait_polling(work, deadline_at, "broadcast", abort=abort, store=self._store, stop_keys=stop)
        except BaseException as exc:
            try:  # receivers stop waiting for buckets that will never come
                self._store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            _retire(self._group, works)  # a failed group is never reused: peers may be mid-op
            self._group = None
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, plan: BucketPlan, deadline_at: float, abort: threading.Event,
                      stop: Sequence[str]) -> GlooGroup:
        g = self._group
        if g is None or g.group_id != rendezvous.group_id:
            self.close()
            self._group = GlooGroup(rendezvous, 0, plan.bucket_bytes, bind_host=self._bind_host,
                                 deadline_at=deadline_at, abort=abort, watch=self._store, stop_keys=stop)
        self._group.fit(plan.bucket_bytes)
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
        works: list[dist.Work | None] = [None, None]  # the two buckets in flight
        try:
            stop = [session_key(rendezvous, "abort")]
            with nothing_written():
                group = self._ensure_group(rendezvous, rank, plan, deadline_at, abort, stop)
            store = self._store[1]
            n = plan.num_buckets
            # Found when the bucket is posted, not all up front: a receiver whose targets
            # are made as their first byte arrives (streamed loading) must not have
            # every target made at the start.
            direct: dict[int, torch.Tensor | None] = {}

            def post(bucket: int) -> dist.Work:
                into = direct[bucket] = _direct(plan, bucket, targets)
                if into is None:
                    into = group.buffers[bucket % 2][:plan.bucket_size(bucket)]
                return broadcast_from_root(group.pg, into)

            works[0] = post(0)
            for bucket in range(n):
                if abort.is_set():
                    raise TransferError("receive aborted")
                if bucket + 1 < n:
                    works[(bucket + 1) % 2] = post(bucket + 1)
                slot = bucket % 2
                wait_polling(works[slot], deadline_at, "receive", abort=abort, store=store, stop_keys=stop)
                if direct.pop(bucket) is None:
                    unpack_bucket(plan, bucket, group.buffers[slot], targets)
                if on_bucket is not None:
                    on_bucket(bucket)
        except BaseException as exc:
            if self._store is not None:
                try:  # the sender stops at once instead of waiting out its deadline
                    self._store[1].set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
                except Exception:
                    pass
            _retire(self._group, works)
            self._group = None
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _ensure_group(self, rendezvous, rank: int, plan: BucketPlan, deadline_at: float, abort: threading.Event,
                      stop: Sequence[str]) -> GlooGroup:
        g = self._group
        if g is not None and g.group_id == rendezvous.group_id:
            g.fit(plan.bucket_bytes)
            return g
        self._group = None
        where = (rendezvous.store_host, rendezvous.store_port)
        if self._store is None or self._store[0] != where:
            self._store = (where, connect_store(*where, deadline_at=deadline_at, secret=rendezvous.store_secret))
        self._group = GlooGroup(rendezvous, rank, plan.bucket_bytes, bind_host=self._bind_host,
                             deadline_at=deadline_at, abort=abort, watch=self._store[1], stop_keys=stop)
        return self._group

    def close(self) -> None:
        self._group = None  # idle group: destroying it is immediate
        self._store = None


__all__ = ["GlooSender", "GlooReceiver", "data_device"]
