"""Buckets that go on the wire as one broadcast each, where both ends' memory allows.

gloo cuts each bucket into broadcasts (``BucketPlan.wire_ops``): a broadcast per piece
of 1 MiB or more, sent from and landing in the tensors themselves, and the small
tensors between them packed. Each broadcast costs a round trip to every receiver, and
a dense model of 509 tensors makes about 217 of them per GiB. Where the trainer's
weights lie end to end in memory as the plan lays them out (a trainer that placed
them so, ``weightsync.arena.place_on_huge_pages``) and so do an engine's (the
reference engine's arena), a whole bucket is one run of memory on both sides: it goes
as one broadcast, straight from the trainer's memory into the engine's, with nothing
packed or unpacked.

gloo pairs the n-th broadcast of each side whatever their lengths, so both ends must
cut each bucket alike. The ends agree once per round, before the first broadcast:
each receiver publishes which buckets it can land whole (``whole/<rank>``, one bit per
bucket); the trainer keeps the buckets that every receiver and it itself can move
whole, and publishes that (``whole``). A receiver whose tensors carry no addresses
(a vLLM worker's, made as their bytes arrive) says none, and its buckets are cut as
before: nothing changes for it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from weightsync.errors import TransferError
from weightsync.plan import BucketPlan
from weightsync.transport.cross_memory import carries_addresses
from weightsync.transport.memory_runs import run_view
from weightsync.transport.store import delete_keys, session_key, wait_for_keys


def whole_bucket_views(plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per bucket, a uint8 view of the memory that all its bytes lie in as one run
    (``memory_runs.run_view`` over the whole bucket), or None. All None where
    ``tensors`` carries no addresses for this plan (no tensor is asked for one)."""
    if not carries_addresses(tensors, plan.sizes) or tensors.addresses is None:
        return [None] * plan.num_buckets
    return [run_view(plan, b, 0, plan.bucket_size(b), tensors) if plan.bucket_size(b) else None
            for b in range(plan.num_buckets)]


def _bits(mask: np.ndarray) -> bytes:
    return np.packbits(mask.astype(bool)).tobytes()


def _mask(data: bytes, n: int, what: str) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(data, np.uint8))
    if len(bits) < n or len(bits) > n + 7:
        raise TransferError(f"{what}: {len(data)} bytes for a plan of {n} buckets: run the same weightsync "
                            "release on both sides")
    return bits[:n].astype(bool)


def offer(store: dist.Store, rendezvous, rank: int, can_land: Sequence[bool], *, deadline_at: float,
          abort: threading.Event, stop_keys: Sequence[str]) -> np.ndarray:
    """A receiver's side: says which buckets it can land whole, then waits for the
    trainer's choice. Returns, per bucket, whether it goes as one broadcast."""
    n = len(can_land)
    store.set(session_key(rendezvous, "whole", rank), _bits(np.asarray(can_land, bool)))
    key = session_key(rendezvous, "whole")
    wait_for_keys(store, [key], deadline_at=deadline_at, operation="receive", abort=abort, fail_keys=stop_keys)
    return _mask(store.get(key), n, "the trainer's whole-bucket choice")


def choose(store: dist.Store, rendezvous, can_send: Sequence[bool], *, deadline_at: float,
           abort: threading.Event, stop_keys: Sequence[str]) -> np.ndarray:
    """The trainer's side: the buckets that every receiver can land whole and this side
    can send whole, published for the receivers and returned (one bool per bucket)."""
    n = len(can_send)
    chosen = np.asarray(can_send, bool).copy()
    offers = [session_key(rendezvous, "whole", r) for r in range(1, rendezvous.world_size)]
    wait_for_keys(store, offers, deadline_at=deadline_at, operation="broadcast", abort=abort, fail_keys=stop_keys)
    for key in offers:
        chosen &= _mask(store.get(key), n, "a receiver's whole-bucket offer")
    store.set(session_key(rendezvous, "whole"), _bits(chosen))
    return chosen


def forget(store: dist.Store, rendezvous) -> None:
    """The trainer's side, once every receiver has its bytes: the round's keys go."""
    delete_keys(store, [session_key(rendezvous, "whole")] + [session_key(rendezvous, "whole", r)
                                                              for r in range(1, rendezvous.world_size)])


__all__ = ["choose", "forget", "offer", "whole_bucket_views"]
