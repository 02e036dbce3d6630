"""One step's weights made ready to send, in one cheap pass over the tensors.

A trainer syncs the same tensors every step: the first step plans them
(``BucketPlan.build``); every later step replays that plan (``PlanCache``) while the
tensors keep their names, dtypes and shapes, checking them in the same pass that takes
each tensor's contiguous form and, for shm and the network transports, its address.
Runs on the trainer client's worker thread, never on its event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.attest import Probe
from weightsync.dtypes import on_wire
from weightsync.errors import InvalidArgument
from weightsync.gil import HAND_OVER_EVERY, hand_over_gil
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan
from weightsync.sharding import Owners
from weightsync.transport.cross_memory import AddressedTensors
from weightsync.v1 import common_pb2

AttestArg = Probe | Callable[[], Probe] | None

# Tensor types whose data_ptr is their bytes' address (a subclass such as DTensor may
# hold no storage of its own).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Prepared:
    """One step's weights, made ready to send: the plan, the source tensors in its
    order, their digest and the attestation probe, if asked for."""

    plan: BucketPlan
    sources: list[torch.Tensor]
    digest: str
    probe: Probe | None = None
    owners: Owners | None = None  # a sharded trainer: who sends what; ``sources`` are this rank's parts

    def group_backend(self, kind) -> str:
        """For the group transport: nccl when the weights are on a GPU, else gloo."""
        if kind != common_pb2.TRANSPORT_KIND_GROUP:
            return ""
        return "nccl" if any(t.is_cuda for t in self.sources) else "gloo"


@dataclass(frozen=True)
class PlanCache:
    """The last step's plan and what it was made from (``WeightsPreparer`` replays it while
    the tensors keep their names, dtypes and shapes). ``native``: the plan's dtypes are
    the tensors' own (no wire cast), so their bytes can be read where they lie."""

    bucket_bytes: int
    wire_dtype: torch.dtype | None
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    plan: BucketPlan
    native: bool


class WeightsPreparer:
    """Makes each step's ``Prepared`` and keeps the plan it replays (``cache``)."""

    def __init__(self) -> None:
        self.cache: PlanCache | None = None

    def prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]], with_digest: bool,
                attest: AttestArg = None, *, addresses: bool = False, bucket_bytes: int,
                wire_dtype: torch.dtype | None) -> Prepared:
        """Worker thread: the tensors to send, the plan (cached), optional digest and probe.

        Runs every step, so it stays one cheap pass over the tensors (20k of them in a
        mixture-of-experts model): no ``detach`` (the senders read under ``no_grad``), no
        copy of a tensor that is already contiguous, and the cached plan is checked
        against the names, dtypes and shapes, not rebuilt. ``addresses``: also take each
        tensor's address in that pass (shm's direct reads, the network transports' runs
        of memory).
        """
        try:
            replayed = self._replay(iter(named_tensors), addresses, bucket_bytes, wire_dtype)
            if isinstance(replayed, tuple):
                plan, sources = replayed
            else:  # plan once, replay every step
                pairs = replayed
                if not pairs:
                    raise InvalidArgument("no tensors to send")
                names = [n for n, _ in pairs]
                dtypes = [t.dtype for _, t in pairs]
                # Plain tuples, not torch.Size: the collector stops tracking tuples of ints,
                # so 20k cached shapes add nothing to every full collection of the heap.
                shapes = [tuple(t.shape) for _, t in pairs]
                wire = wire_dtype
                wire_dtypes = [on_wire(d, wire) for d in dtypes]
                plan = BucketPlan.build(zip(names, wire_dtypes, shapes, strict=True), bucket_bytes=bucket_bytes)
                self.cache = PlanCache(bucket_bytes=bucket_bytes, wire_dtype=wire, names=names,
                                          dtypes=dtypes, shapes=shapes, plan=plan,
                                          native=list(plan.dtypes) == dtypes)
                sources = [t.contiguous() for _, t in pairs]  # the tensor itself when already contiguous
        except (TypeError, ValueError, AttributeError):
            raise InvalidArgument("named_tensors must be (name, torch.Tensor) pairs") from None
        digest = ""
        if with_digest:
            digest = weights_digest((name, t.to(dtype) if t.dtype != dtype else t)
                                    for name, dtype, t in zip(plan.names, plan.dtypes, sources, strict=True))
        probe = attest() if callable(attest) else attest
        if probe is not None and not isinstance(probe, Probe):
            raise InvalidArgument(f"attest must be a Probe or a function returning one, got {type(probe).__name__}")
        return Prepared(plan, sources, digest, probe)

    def _replay(self, items: Iterator, addresses: bool, bucket_bytes: int,
                wire_dtype: torch.dtype | None) -> tuple[BucketPlan, list[torch.Tensor]] | list:
        """The last step's plan and this step's sources, if the (name, tensor) pairs of
        ``items`` still have the plan's names, dtypes and shapes; else every pair, as a
        list, for the caller to plan again.

        One pass does every per-tensor step (check, ``contiguous``, address): most of
        its cost is fetching each tensor's objects from memory, paid once. It reads
        ``items`` as it goes, so the pairs a generator makes (``model.named_parameters()``,
        a new tuple per tensor) die one by one, and it keeps no per-tensor object alive but
        the sources: 20k objects kept through every step are promoted by the garbage
        collector and soon trigger a full collection of the trainer's whole heap (117 ms
        with a 20k-tensor model passed as ``model.named_parameters()``, holding the GIL:
        the trainer's event loop stalled throughout). Addresses are plain ints, which the
        collector does not track.
        """
        cached = self.cache
        if cached is None or cached.bucket_bytes != bucket_bytes or cached.wire_dtype != wire_dtype:
            return list(items)
        names, dtypes, shapes, plan, native = cached.names, cached.dtypes, cached.shapes, cached.plan, cached.native
        count = len(names)
        # Addresses only where the bytes on the wire are the tensors' own (no wire dtype
        # cast) and every tensor is a plain CPU tensor (a subclass may hold no storage).
        addresses = addresses and native
        sources, where = [], []
        for i, pair in enumerate(items):
            if i and not i % HAND_OVER_EVERY:
                hand_over_gil()  # ~20 ms of Python at 20k tensors: the event loop gets in
            name, tensor = pair
            if i >= count or name != names[i] or tensor.dtype != dtypes[i] or tensor.shape != shapes[i]:
                # Changed: every pair, those read so far included (each source is its
                # tensor, or a contiguous copy of it with the same name, dtype and shape).
                return [*zip(names[:i], sources, strict=True), pair, *items]
            source = tensor.contiguous()  # the tensor itself when already contiguous
            sources.append(source)
            if addresses:
                if source.is_cpu and type(source) in _PLAIN_TENSORS:
                    where.append(source.data_ptr())
                else:
                    addresses = False
        if len(sources) != count:  # fewer tensors than the plan
            return list(zip(names[:len(sources)], sources, strict=True))
        if not addresses:
            return plan, sources
        return plan, AddressedTensors(sources, np.array(where, dtype=np.uint64), plan.sizes)
