"""One Receive on an engine: what it was asked and what its steps left, and the
answer it settles into (an outcome, or the typed error, a cancellation first)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weightsync.attest import Probe
from weightsync.cancellation import wait_through_cancellation
from weightsync.errors import (
    AFTER_TRANSFER,
    MAX_MESSAGE_BYTES,
    TransferError,
    WeightSyncError,
    bounded,
)
from weightsync.plan import BucketPlan
from weightsync.server.agent.receive_checks import Forward
from weightsync.sharding import Owners
from weightsync.transport.base import Receiver
from weightsync.transport.from_senders import SenderLane
from weightsync.v1 import agent_pb2, common_pb2


@dataclass
class ReceiveJob:
    """One Receive on this engine: what it was asked, and what its steps left."""

    request: agent_pb2.ReceiveRequest
    plan: BucketPlan
    receiver: Receiver
    probe: Probe | None
    senders: tuple[SenderLane, ...]     # a sharded trainer's lanes (empty: one sender)
    owners: Owners | None
    relays: tuple[Forward, ...]        # the lanes this agent forwards as its host's relay
    deadline_at: float
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None       # when the steps ended (settling takes longer)
    error: BaseException | None = None
    cancelled: bool = False             # a cancellation arrived: re-raised once settled
    attest_max_diff: float | None = None
    bytes_in: bool = False              # the transfer itself ended well (later checks may still fail)

    async def wait(self, step: asyncio.Future):
        """The step's result; a step that failed sets ``error`` (and returns None). A
        cancellation meanwhile is remembered, never abandons the step."""
        self.cancelled |= await wait_through_cancellation(step)
        if step.exception() is not None:
            if self.error is None:
                self.error = step.exception()
            return None
        return step.result()

    def seconds(self) -> float:
        """How long the steps took."""
        return (self.finished or time.monotonic()) - self.started

    def outcome(self, make_outcome: Callable[..., common_pb2.EngineOutcome]) -> common_pb2.EngineOutcome:
        """The settled receive's answer: its outcome, or its error (a cancellation
        first, chained to what failed)."""
        if self.cancelled:
            raise asyncio.CancelledError() from self.error
        if self.error is not None:
            error = self.error
            if not isinstance(error, WeightSyncError):
                error = TransferError(f"receive failed: {error!r}")
                error.__cause__ = self.error
            if self.bytes_in:
                # The data plane is done with this engine: the sender need not stop for it
                # (it would tear the engines still reading the same lane).
                error.metadata[AFTER_TRANSFER] = "true"
            raise error
        attested = {} if self.attest_max_diff is None else {"attested": True, "attest_max_diff": self.attest_max_diff}
        return make_outcome(bytes=self.plan.total_bytes, seconds=self.seconds(), rank=self.request.rank, **attested)




def never_started(error: BaseException) -> WeightSyncError:
    """``error`` (of a rendezvous that wrote nothing), saying so; typed as before."""
    prefix = "the transfer never started; nothing was written and the engine keeps its weights: "
    if isinstance(error, WeightSyncError):
        error.message = bounded(prefix + error.message, MAX_MESSAGE_BYTES)
        error.args = (error.message,)
        return error
    return TransferError(prefix + repr(error), reason="TRANSFER_NEVER_STARTED")
