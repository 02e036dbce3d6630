"""The transport interface: a sender on the trainer, a receiver in each agent.

A transport moves one ``BucketPlan``'s byte stream from rank 0 (the trainer) to
ranks 1..N (the engines). Implementations keep their group and buffers between calls
while the rendezvous ``group_id`` and the plan stay the same ("plan once, replay
every step"), and drop them after any failure so the next round starts clean.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from weightsync.plan import BucketPlan
from weightsync.v1 import common_pb2


@dataclass(frozen=True)
class TransferStats:
    """What one transfer moved."""

    bytes: int
    seconds: float
    buckets: int


class Sender(abc.ABC):
    """Trainer side of a transport (rank 0). Runs on the client's transfer thread."""

    kind: common_pb2.TransportKind.ValueType

    @abc.abstractmethod
    def send(self, rendezvous: common_pb2.Rendezvous, plan: BucketPlan, sources: Sequence[torch.Tensor],
             *, deadline_at: float, abort: threading.Event) -> TransferStats:
        """Streams ``sources`` (in plan order) to every receiver; blocks until all have it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the group and buffers. Idempotent."""


class Receiver(abc.ABC):
    """Engine side of a transport (rank >= 1). Runs on the agent's transfer thread."""

    kind: common_pb2.TransportKind.ValueType

    @abc.abstractmethod
    def receive(self, rendezvous: common_pb2.Rendezvous, rank: int, plan: BucketPlan,
                targets: Sequence[torch.Tensor], *, deadline_at: float,
                abort: threading.Event, on_bucket: Callable[[int], None] | None = None) -> TransferStats:
        """Receives the stream and writes it into ``targets`` (in plan order).

        ``on_bucket(b)`` runs after bucket ``b`` is loaded (progress, fault injection).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the group and buffers. Idempotent."""


@contextlib.contextmanager
def nothing_written() -> Iterator[None]:
    """Wraps a receiver's rendezvous (store connection, group join, segment lookup): an
    exception raised inside is marked ``wrote_nothing``, because no byte has reached the
    engine's tensors yet. The agent then keeps the engine's weights trusted (not torn)
    and says the transfer never started."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
            exc.wrote_nothing = True
        raise


__all__ = ["Sender", "Receiver", "TransferStats", "nothing_written"]
