"""A Broadcast's sends, one per lane: each lane a rendezvous with its own group and
transport (shm on the trainer's host, a gloo group per remote host), sent at once. An
engine's failure stops only its own lane, so one host's failure never tears another's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from weightsync.cancellation import wait_through_cancellation
from weightsync.v1 import common_pb2

MAX_CONCURRENT_LANES = 64  # lanes of one round sent at once (a lane per remote host)


@dataclass
class Lane:
    """One lane's send: its future and the flag that stops it."""

    rendezvous: common_pb2.Rendezvous
    transfer: asyncio.Future
    abort: threading.Event


# The transports that use the tensors' addresses (``WeightsPreparer.prepare``): not nccl or cuda-ipc,
# whose tensors are on a GPU.
ADDRESSED_KINDS = (common_pb2.TRANSPORT_KIND_SHM, common_pb2.TRANSPORT_KIND_AUTO, common_pb2.TRANSPORT_KIND_GLOO,
                    common_pb2.TRANSPORT_KIND_GROUP)


class LaneSends:
    """The sends a Broadcast started, one per lane (a rendezvous: its own group and
    transport), shared by the call's attempts. An engine's failure stops its own lane;
    the others go on, so one host's failure never tears another host's engines."""

    def __init__(self, tell_relayed: Callable[[common_pb2.Rendezvous, str], None] | None = None) -> None:
        self.lanes: dict[str, Lane] = {}  # by session id: a retry replays the same rendezvous
        # A host's shm lane fed by its relay, by relay: sent by the relay, not by us.
        self.relayed: dict[str, list[common_pb2.Rendezvous]] = {}
        self._tell_relayed = tell_relayed

    def stop(self, engine_id: str | None = None) -> None:
        """Stops the lane sending to ``engine_id``, or every lane. A stopped lane to a
        host's relay also tells that host's engines to stop waiting (their abort key):
        the relay, if it died, never will."""
        for lane in self.lanes.values():
            if engine_id is None or engine_id in lane.rendezvous.engine_ids:
                lane.abort.set()
                for relayed in self.relayed.get(lane.rendezvous.relayed_by, ()):
                    if self._tell_relayed is not None:
                        self._tell_relayed(relayed, f"the trainer stopped sending to relay "
                                                    f"{lane.rendezvous.relayed_by}")

    async def finish(self) -> None:
        """Waits for every lane's send to end (each is bounded by the round's deadline)."""
        for lane in list(self.lanes.values()):
            await wait_through_cancellation(lane.transfer)

    def error(self) -> BaseException | None:
        """The first lane's failure, or None. Retrieves every lane's, so an aborted lane's
        error is not logged as unhandled when its future is collected."""
        errors = [lane.transfer.exception() for lane in self.lanes.values()
                  if lane.transfer.done() and not lane.transfer.cancelled()]
        return next((e for e in errors if e is not None), None)

    def seconds(self) -> float:
        """Trainer-side transfer time: the slowest lane."""
        return max((lane.transfer.result().seconds for lane in self.lanes.values()), default=0.0)
