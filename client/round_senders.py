"""Who sends a round's lanes: the seam between ``TrainerClient`` and a sharded trainer.

``TrainerClient`` runs every round the same way (its store, the Broadcast, one send per
lane, the result); what differs between one trainer process and rank 0 of a sharded
trainer is this narrow interface, passed in (``round_senders=``) rather than
overridden: how the step's weights are prepared (the plan, the sources rank 0 sends,
the digest), which hosts the senders run on (for ``auto``'s lane layout), who sends a
lane of another rank, and which store the round meets at.

``OneProcess`` is a single trainer's: it prepares through ``WeightsPreparer``, runs on
this host, and has no other rank. A sharded trainer's is
``client/sharded_senders.py``'s ``ShardedSenders``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from weightsync.client.lane_sends import Lane
from weightsync.client.prepared_weights import AttestArg, Prepared, WeightsPreparer
from weightsync.errors import TransferError
from weightsync.host_identity import host_id
from weightsync.transport.secure_store import StoreHost
from weightsync.v1 import common_pb2


class RoundSenders(Protocol):
    """What ``TrainerClient`` asks of the side that sends its rounds (see the module)."""

    def prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]], with_digest: bool,
                attest: AttestArg, *, addresses: bool, bucket_bytes: int,
                wire_dtype: torch.dtype | None) -> Prepared:
        """Worker thread: this step's plan, the sources rank 0 sends, digest and probe."""

    def trainer_host_id(self) -> str:
        """The host id ``auto`` compares engines' with (shm for engines on that host)."""

    def sender_host_ids(self) -> list[str]:
        """Each sending rank's host id, by rank, when they differ; else none."""

    def remote_send(self, rendezvous: common_pb2.Rendezvous, prepared: Prepared) -> Lane:
        """A lane another rank sends (``rendezvous.sender`` > 0), followed from here."""

    def store_host(self) -> StoreHost | None:
        """The store the round meets at, when these senders bring one; None: the client
        hosts its own on first use."""


class OneProcess:
    """One trainer process: it sends every lane itself."""

    def __init__(self) -> None:
        # Each step's weights made ready, the last step's plan replayed: a trainer syncs
        # the same tensors every step.
        self.preparer = WeightsPreparer()

    def prepare(self, named_tensors, with_digest: bool, attest: AttestArg, *, addresses: bool,
                bucket_bytes: int, wire_dtype: torch.dtype | None) -> Prepared:
        return self.preparer.prepare(named_tensors, with_digest, attest, addresses=addresses,
                                     bucket_bytes=bucket_bytes, wire_dtype=wire_dtype)

    def trainer_host_id(self) -> str:
        return host_id()

    def sender_host_ids(self) -> list[str]:
        return []

    def remote_send(self, rendezvous: common_pb2.Rendezvous, prepared: Prepared) -> Lane:
        raise TransferError(f"the round has a lane for trainer rank {rendezvous.sender}; this client is one "
                            "process (use DistributedTrainerClient)")

    def store_host(self) -> StoreHost | None:
        return None


__all__ = ["OneProcess", "RoundSenders"]
