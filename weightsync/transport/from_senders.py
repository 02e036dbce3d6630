"""Receiving a sharded trainer's round: every sender's lane at once, into one set of tensors.

Each trainer rank streams its own parts (``weightsync.sharding``) on its own lane; the
engine runs one receive per lane, concurrently, each into row-range views of the same
full target tensors. The lanes fail together: the first failure (or the caller's
abort) stops every other lane, each of which then tells its own sender (its ``err``
key), so no trainer rank waits out its deadline for an engine that stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from weightsync.plan import BucketPlan
from weightsync.transport.base import Receiver, TransferStats
from weightsync.v1 import common_pb2

_POLL_S = 0.02  # how often the caller's abort is looked at while lanes run


@dataclass(frozen=True)
class SenderLane:
    """One sender's lane, as an engine receives it: where it meets, the layout of that
    sender's stream, the receiver (its own group and buffers) and where its parts go."""

    rendezvous: common_pb2.Rendezvous
    plan: BucketPlan
    receiver: Receiver
    sender: int


def receive_from_senders(lanes: Sequence[SenderLane], rank: int, targets_of: Callable[[SenderLane], list],
                         *, deadline_at: float, abort, on_bucket: Callable[[int], None] | None = None,
                         on_lane_bucket: Callable[[SenderLane, int, list[int]], None] | None = None,
                         stop: threading.Event | None = None) -> TransferStats:
    """Receives every lane at ``rank`` into ``targets_of(lane)`` (views of the full
    tensors). Blocks until all lanes are in, or raises the first lane's error after
    stopping and joining the others (each bounded by ``deadline_at``).

    ``on_bucket(n)``: the n-th bucket of all lanes is in (progress);
    ``on_lane_bucket(lane, b, parts)``: bucket ``b`` of that lane is in, and with it the
    last bytes of ``parts`` (indices into the lane's plan), now in place (each
    ``done`` where the targets are ``PartViews``). Either may raise to stop the receive. ``abort``: anything with
    ``is_set()``. ``stop``: set here once a lane failed or ``abort`` was seen (the
    others stop); a caller that waits inside a callback watches it too. The error
    carries ``wrote_nothing`` only when no lane wrote a byte."""
    stop = stop if stop is not None else threading.Event()
    done_buckets, lock = [0], threading.Lock()
    views = {id(lane): targets_of(lane) for lane in lanes}
    # Parts received into tensors of their own (slices along a dimension other than 0)
    # are copied into place as their last bucket comes in (``PartViews.done``).
    finishing = {id(lane): lane.plan.completed_by_bucket() for lane in lanes
                 if getattr(views[id(lane)], "staged", False) or on_lane_bucket is not None}

    def count(lane: SenderLane, bucket: int) -> None:
        finished = finishing[id(lane)][bucket] if id(lane) in finishing else []
        done = getattr(views[id(lane)], "done", None)
        if done is not None:
            for part in finished:
                done(part)
        if on_lane_bucket is not None:
            on_lane_bucket(lane, bucket, finished)
        with lock:  # progress over all lanes: buckets done of the sum of their buckets
            done_buckets[0] += 1
            n = done_buckets[0]
        if on_bucket is not None:
            on_bucket(n - 1)

    def one(lane: SenderLane) -> TransferStats:
        return lane.receiver.receive(lane.rendezvous, rank, lane.plan, views[id(lane)], deadline_at=deadline_at,
                                     abort=stop, on_bucket=lambda bucket: count(lane, bucket))

    with ThreadPoolExecutor(len(lanes), thread_name_prefix="weightsync-lane") as pool:
        futures: list[Future] = [pool.submit(one, lane) for lane in lanes]
        first: BaseException | None = None
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=_POLL_S, return_when="FIRST_COMPLETED")
            for future in finished:
                if future.exception() is not None and first is None:
                    first = future.exception()
                    stop.set()  # the other lanes stop and tell their senders
            if abort.is_set():
                stop.set()
    if first is not None:
        errors = [f.exception() for f in futures]
        if not all(e is not None and getattr(e, "wrote_nothing", False) for e in errors):
            try:
                first.wrote_nothing = False
            except (AttributeError, TypeError):
                pass
        raise first
    stats = [f.result() for f in futures]
    return TransferStats(sum(s.bytes for s in stats), max(s.seconds for s in stats), sum(s.buckets for s in stats))


def part_targets(owners, targets: Sequence[torch.Tensor]) -> Callable[[SenderLane], list]:
    """``targets_of`` for ``receive_from_senders``: each lane's row-range views."""
    return lambda lane: owners.part_views(lane.sender, targets)


__all__ = ["SenderLane", "receive_from_senders", "part_targets"]
