"""The host relay: one network copy per host, re-shared over shared memory.

When several engines share a remote host, the trainer sends the bytes across the
network once, to one agent there (the relay: rank 1 of a two-member gloo lane), and
that agent re-shares them with its host's engines over shm, as rank 0 of the host's
shm lane (the engines, the relay's own included, receive it like any shm lane). It is
pipelined bucket by bucket: the relay receives bucket b from the network straight
into the shm slot of b, publishes it, and receives b+1 into the other slot while the
engines copy b out.

Failures cross both lanes at once. The network failing (the trainer's abort, a cut
link, the deadline) aborts the shm lane, so the host's engines stop waiting; an engine
of the host failing (its ``err`` key in the shm lane) makes the relay report an error
on the network lane, so the trainer stops sending to this host. Other hosts' lanes are
not involved either way.
"""

from __future__ import annotations

import threading
import time

import torch

from weightsync.errors import TransferError
from weightsync.packing import scatter_ranges
from weightsync.plan import BucketPlan
from weightsync.transport import whole_buckets
from weightsync.transport.base import TransferStats
from weightsync.transport.collective import broadcast_from_root, wait_polling
from weightsync.transport.gloo import GlooGroup, check_wire_format, retire_group
from weightsync.transport.shm import ShmSender
from weightsync.transport.store import connect_store, session_key
from weightsync.v1 import common_pb2


class HostRelay:
    """One agent's relay: a gloo endpoint (listening on ``data_host``) and an shm
    sender, both kept while their lanes' group ids stay."""

    def __init__(self, data_host: str) -> None:
        self._data_host = data_host
        self._group: GlooGroup | None = None
        self._store = None  # ((host, port), store): the trainer's store
        self._shm: ShmSender | None = None

    def forward(self, upstream: common_pb2.Rendezvous, downstream: common_pb2.Rendezvous, plan: BucketPlan, *,
                deadline_at: float, abort: threading.Event) -> TransferStats:
        """Receives ``upstream`` (rank 1) and sends it on as rank 0 of ``downstream``."""
        start = time.monotonic()
        upstream_stop = [session_key(upstream, "abort")]
        try:
            store = self._connect(upstream, deadline_at)
            group = self._ensure_group(upstream, plan, deadline_at, abort, store, upstream_stop)
            check_wire_format(store, upstream, deadline_at=deadline_at, abort=abort, stop_keys=upstream_stop)
            # Any bucket can land whole: it lands in an shm slot, a bucket's bytes as they lie.
            whole = whole_buckets.offer(store, upstream, 1, [True] * plan.num_buckets, deadline_at=deadline_at,
                                        abort=abort, stop_keys=upstream_stop)
            if self._shm is None:
                self._shm = ShmSender(store)

            def fill(bucket: int, slot: torch.Tensor) -> None:
                # The trainer's gloo sender cuts each bucket as ``wire_ops`` says (large
                # tensors on their own, several runs of small ones gathered into one):
                # the ranges land in the slot where they lie in the bucket, the gathered
                # runs in staging first, then scattered to their places.
                if whole[bucket]:
                    wait_polling(broadcast_from_root(group.pg, slot[:plan.bucket_size(bucket)]), deadline_at,
                                 "relay receive", abort=abort, store=store, stop_keys=upstream_stop)
                    return
                wire = plan.wire_ops(bucket)
                gathered = group.gathered[0][:wire.gathered_bytes]
                works = [broadcast_from_root(group.pg, gathered)] if wire.gathered else []
                works += [broadcast_from_root(group.pg, slot[start:end]) for start, end, _ in wire.ops]
                for work in works:
                    wait_polling(work, deadline_at, "relay receive", abort=abort, store=store,
                                 stop_keys=upstream_stop)
                if wire.gathered:
                    scatter_ranges(gathered, wire.gathered, slot)

            self._shm.send(downstream, plan, [], deadline_at=deadline_at, abort=abort, fill=fill)
        except BaseException as exc:
            if self._store is not None:
                try:  # the trainer stops sending to this host at once
                    self._store[1].set(session_key(upstream, "err", 1), f"relay: {exc}")
                except Exception:
                    pass
            retire_group(self._group)
            self._group = None
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _connect(self, upstream: common_pb2.Rendezvous, deadline_at: float):
        where = (upstream.store_host, upstream.store_port)
        if self._store is None or self._store[0] != where:
            if self._shm is not None:
                self._shm.close()
                self._shm = None
            self._store = (where, connect_store(*where, deadline_at=deadline_at, secret=upstream.store_secret))
        return self._store[1]

    def _ensure_group(self, upstream, plan: BucketPlan, deadline_at: float, abort: threading.Event, store,
                      stop) -> GlooGroup:
        if upstream.world_size != 2:
            raise TransferError(f"a relay's upstream lane has 2 members, not {upstream.world_size}")
        g = self._group
        if g is None or g.group_id != upstream.group_id:
            self._group = None
            # No bucket buffers of its own: buckets land in the shm slots. One staging
            # buffer for gathered runs: a bucket is scattered before the next is posted.
            g = GlooGroup(upstream, 1, 0, bind_host=self._data_host, deadline_at=deadline_at, abort=abort,
                          watch=store, stop_keys=stop, gathered_bytes=plan.gathered_bytes, slots=1)
            self._group = g
        g.fit(plan)
        return g

    def close(self) -> None:
        """Drops the group and the shm segment."""
        self._group = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._store = None


__all__ = ["HostRelay"]
