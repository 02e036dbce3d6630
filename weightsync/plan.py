"""The bucket plan: where every tensor's bytes sit in the transfer stream.

All tensors are laid end to end (each start aligned to 8 bytes) in one logical byte
stream; bucket ``b`` is the fixed window ``[b * bucket_bytes, (b + 1) * bucket_bytes)``.
A tensor larger than a bucket simply spans several buckets, so buffers never grow with
the model and a 1 GiB tensor streams through 2 x bucket_bytes of memory. The plan is
built once from names, dtypes and shapes and replayed every step (``plan_id`` says
whether two plans are the same); the per-bucket piece lists are computed once here.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from weightsync.errors import InvalidArgument, PlanUnknown
from weightsync.serial_copy import serial_copies
from weightsync.v1 import common_pb2

ALIGN = 8
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
MAX_BUCKET_BYTES = 1 << 32  # receivers allocate two buckets: never let a request ask for more
MAX_TENSORS = 1_000_000
MAX_NAME_LEN = 512
_PLANS: OrderedDict[bytes, BucketPlan] = OrderedDict()  # validated plans by wire hash (from_proto)
_PLANS_BY_ID: OrderedDict[str, BucketPlan] = OrderedDict()  # the same plans by plan_id (plan references)
_PLANS_LOCK = threading.Lock()
_PLANS_KEPT = 8
SERIAL_COPY_BYTES = 1 << 20  # whole tensors smaller than this are copied without OpenMP regions
_VIEW_BUFFERS = 4  # bucket buffers whose views a plan remembers: a sender's or receiver's two, and the
# two they replaced (a new group or segment); older ones are let go, so their memory can be freed

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Bytes per element, looked up per tensor (making a tensor to ask took 6 us a slot).
ITEMSIZE: dict[torch.dtype, int] = {d: d.itemsize for d in DTYPES.values()}


def dtype_from_name(name: str) -> torch.dtype:
    """Returns the torch dtype called ``name``; InvalidArgument if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Returns the wire name of a torch dtype; InvalidArgument if unsupported."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {dtype}") from None


class TensorSlot(NamedTuple):
    """One tensor's place in the stream (a named tuple: a plan holds up to a million,
    and a frozen dataclass cost microseconds each to make)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that lies in one bucket (all offsets in bytes)."""

    tensor_index: int
    tensor_start: int   # byte offset inside the tensor
    bucket_start: int   # byte offset inside the bucket
    length: int


@dataclass(frozen=True)
class BucketPlan:
    """Immutable transfer plan; see the module docstring."""

    slots: tuple[TensorSlot, ...]
    bucket_bytes: int
    total_bytes: int
    plan_id: str = field(default="")

    @classmethod
    def build(cls, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], *,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
        """Lays out ``(name, dtype, shape)`` specs in order.

        Raises:
            InvalidArgument: duplicate or empty names, a bad shape or dtype, or a
                bucket size that is not a positive multiple of 8.
        """
        if bucket_bytes <= 0 or bucket_bytes % ALIGN or bucket_bytes > MAX_BUCKET_BYTES:
            raise InvalidArgument(f"bucket_bytes must be a positive multiple of {ALIGN} up to {MAX_BUCKET_BYTES}, "
                                  f"got {bucket_bytes}")
        slots: list[TensorSlot] = []
        seen: set[str] = set()
        offset = 0
        for name, dtype, shape in specs:
            _check_name(name, seen)
            shape = tuple(map(int, shape))
            if shape and min(shape) < 0:
                raise InvalidArgument(f"tensor {name!r}: negative dimension in shape {shape}")
            itemsize = ITEMSIZE.get(dtype)
            if itemsize is None:
                dtype_name(dtype)  # raises: unsupported dtype
            nbytes = math.prod(shape) * itemsize
            slots.append(TensorSlot(name, dtype, shape, offset, nbytes))
            offset = _align(offset + nbytes)
            if len(slots) > MAX_TENSORS:
                raise InvalidArgument(f"more than {MAX_TENSORS} tensors")
        plan = cls(tuple(slots), bucket_bytes, offset)
        return cls(plan.slots, bucket_bytes, offset, plan._fingerprint())

    @classmethod
    def from_tensors(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     wire_dtype: torch.dtype | None = None) -> BucketPlan:
        """Plans ``named_tensors``; ``wire_dtype`` casts floating tensors on the way."""
        def spec(t: torch.Tensor) -> torch.dtype:
            if wire_dtype is not None and t.dtype.is_floating_point:
                return wire_dtype
            return t.dtype
        return cls.build(((n, spec(t), tuple(t.shape)) for n, t in named_tensors),
                         bucket_bytes=bucket_bytes)

    @classmethod
    def from_proto(cls, msg: common_pb2.WeightPlan) -> BucketPlan:
        """Rebuilds and validates a plan received over the wire.

        Plans are replayed every step, so the validated plan is remembered by the hash
        of its wire bytes: a repeat costs one serialisation and one hash, not a rebuild
        of every tensor's slot (0.55 s at 20k tensors).

        A *reference* (``plan_id``, ``bucket_bytes`` and ``total_bytes`` with no tensors;
        see ``reference_proto``) stands for a plan this process validated before.

        Raises:
            InvalidArgument: any inconsistency (layout, fingerprint, dtype, ...).
            PlanUnknown: a reference to a plan this process does not hold.
        """
        if is_reference(msg):
            return cls.known(msg)
        key = hashlib.blake2b(msg.SerializeToString(deterministic=True), digest_size=16).digest()
        with _PLANS_LOCK:
            plan = _PLANS.get(key)
            if plan is not None:
                _PLANS.move_to_end(key)
                _PLANS_BY_ID.move_to_end(plan.plan_id)
                return plan
        plan = cls._from_proto(msg)
        with _PLANS_LOCK:
            _PLANS[key] = plan
            _PLANS_BY_ID[plan.plan_id] = plan
            while len(_PLANS) > _PLANS_KEPT:
                _PLANS.popitem(last=False)
            while len(_PLANS_BY_ID) > _PLANS_KEPT:
                _PLANS_BY_ID.popitem(last=False)
        return plan

    @classmethod
    def known(cls, reference: common_pb2.WeightPlan) -> BucketPlan:
        """The validated plan a reference names.

        Raises:
            PlanUnknown: this process holds no plan with that id (it restarted, or
                forgot it after newer ones): the sender sends the whole plan again.
            InvalidArgument: the reference's sizes contradict the plan it names.
        """
        with _PLANS_LOCK:
            plan = _PLANS_BY_ID.get(reference.plan_id)
            if plan is not None:
                _PLANS_BY_ID.move_to_end(reference.plan_id)
        if plan is None:
            raise PlanUnknown(f"plan {reference.plan_id[:12]} is not known here: send the whole plan",
                              metadata={"plan_id": reference.plan_id})
        if reference.bucket_bytes != plan.bucket_bytes or reference.total_bytes != plan.total_bytes:
            raise InvalidArgument(f"plan reference {reference.plan_id[:12]}: bucket_bytes/total_bytes do not "
                                  "match the plan it names")
        return plan

    def reference_proto(self) -> common_pb2.WeightPlan:
        """The plan named by id alone, for a receiver that already holds it: a sync of a
        20k-tensor model then carries a few bytes of plan per step instead of a megabyte
        (to the coordinator, and from it to every engine), and nobody re-hashes it."""
        return common_pb2.WeightPlan(plan_id=self.plan_id, bucket_bytes=self.bucket_bytes,
                                     total_bytes=self.total_bytes)

    @classmethod
    def _from_proto(cls, msg: common_pb2.WeightPlan) -> BucketPlan:
        if len(msg.tensors) == 0:
            raise InvalidArgument("plan has no tensors")
        plan = cls.build(((t.name, dtype_from_name(t.dtype), tuple(t.shape)) for t in msg.tensors),
                         bucket_bytes=int(msg.bucket_bytes))
        for mine, theirs in zip(plan.slots, msg.tensors, strict=True):
            if mine.offset != theirs.offset or mine.nbytes != theirs.nbytes:
                raise InvalidArgument(f"tensor {mine.name!r}: offset/nbytes do not match its dtype and shape")
        if plan.total_bytes != msg.total_bytes:
            raise InvalidArgument(f"plan total_bytes {msg.total_bytes} != laid out {plan.total_bytes}")
        if msg.plan_id and msg.plan_id != plan.plan_id:
            raise InvalidArgument("plan_id does not match the plan's contents")
        return plan

    def to_proto(self) -> common_pb2.WeightPlan:
        """The wire form (protobuf; never pickle). A fresh copy of a message built once."""
        msg = common_pb2.WeightPlan()
        msg.CopyFrom(self._proto)
        return msg

    @cached_property
    def _proto(self) -> common_pb2.WeightPlan:
        return common_pb2.WeightPlan(
            tensors=[common_pb2.TensorSpec(name=s.name, dtype=dtype_name(s.dtype), shape=list(s.shape),
                                           offset=s.offset, nbytes=s.nbytes) for s in self.slots],
            bucket_bytes=self.bucket_bytes, total_bytes=self.total_bytes, plan_id=self.plan_id)

    @property
    def num_buckets(self) -> int:
        return max(1, -(-self.total_bytes // self.bucket_bytes))

    def bucket_size(self, bucket: int) -> int:
        """Used bytes of ``bucket`` (the last one may be short)."""
        start = bucket * self.bucket_bytes
        return max(0, min(self.bucket_bytes, self.total_bytes - start))

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (the stream without alignment padding)."""
        return sum(s.nbytes for s in self.slots)

    @cached_property
    def pieces(self) -> tuple[tuple[Piece, ...], ...]:
        """For each bucket, the tensor pieces it carries, in stream order."""
        out: list[list[Piece]] = [[] for _ in range(self.num_buckets)]
        for index, slot in enumerate(self.slots):
            done = 0
            while done < slot.nbytes:
                pos = slot.offset + done
                bucket, in_bucket = divmod(pos, self.bucket_bytes)
                length = min(slot.nbytes - done, self.bucket_bytes - in_bucket)
                out[bucket].append(Piece(index, done, in_bucket, length))
                done += length
        return tuple(tuple(p) for p in out)

    @cached_property
    def _whole_and_split(self) -> tuple[tuple[tuple[int, ...], int, tuple[Piece, ...]], ...]:
        """Per bucket: the indices of tensors that lie whole inside it, small ones first
        (copied together in one ``torch._foreach_copy_`` per group), how many of them are
        small, and the pieces of tensors that span buckets."""
        out = []
        for pieces in self.pieces:
            whole = [p.tensor_index for p in pieces if p.length == self.slots[p.tensor_index].nbytes]
            small = tuple(i for i in whole if self.slots[i].nbytes < SERIAL_COPY_BYTES)
            large = tuple(i for i in whole if self.slots[i].nbytes >= SERIAL_COPY_BYTES)
            split = tuple(p for p in pieces if p.length != self.slots[p.tensor_index].nbytes)
            out.append((small + large, len(small), split))
        return tuple(out)

    @cached_property
    def _small_splits(self) -> tuple[bool, ...]:
        """Per bucket: whether its pieces of bucket-spanning tensors are all small (copied
        without OpenMP regions too: in a bucket of small tensors, one parallel region
        left is enough to keep every OpenMP thread spinning through the bucket)."""
        return tuple(all(p.length < SERIAL_COPY_BYTES for p in split) for _, _, split in self._whole_and_split)

    @cached_property
    def _views(self) -> tuple[threading.Lock, OrderedDict]:
        return threading.Lock(), OrderedDict()

    def bucket_views(self, buffer: torch.Tensor, bucket: int) -> list[torch.Tensor]:
        """Typed views (the tensors' dtypes and shapes) of ``buffer`` -- a bucket buffer,
        uint8, starting at the bucket's first byte -- for the whole tensors of ``bucket``,
        in ``_whole_and_split`` order.

        Built once per buffer and bucket, then reused every step: buffers are
        long-lived (double buffers, a shared-memory segment), so a step with 20k
        tensors makes no per-tensor view. At most ``_VIEW_BUFFERS`` buffers are
        remembered; the views keep their buffer's memory alive until then.
        """
        lock, cache = self._views
        key = (str(buffer.device), buffer.data_ptr())
        with lock:
            per_buffer = cache.get(key)
            if per_buffer is None:
                per_buffer = cache[key] = {}
                while len(cache) > _VIEW_BUFFERS:
                    cache.popitem(last=False)
            cache.move_to_end(key)
            views = per_buffer.get(bucket)
            if views is None:
                starts = {p.tensor_index: p.bucket_start for p in self.pieces[bucket]}
                views = []
                for index in self._whole_and_split[bucket][0]:
                    slot, start = self.slots[index], starts[index]
                    views.append(buffer[start:start + slot.nbytes].view(slot.dtype).view(slot.shape))
                per_buffer[bucket] = views
            return views

    def _fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.bucket_bytes}|{self.total_bytes}".encode())
        for s in self.slots:
            h.update(f"|{s.name}|{dtype_name(s.dtype)}|{s.shape}|{s.offset}".encode())
        return h.hexdigest()


def is_reference(msg: common_pb2.WeightPlan) -> bool:
    """Whether a wire plan names a known plan by id instead of listing its tensors."""
    return len(msg.tensors) == 0 and bool(msg.plan_id)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_name(name: str, seen: set[str]) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not name.isprintable():
        raise InvalidArgument(f"bad tensor name {name!r}: 1-{MAX_NAME_LEN} printable characters")
    if name in seen:
        raise InvalidArgument(f"duplicate tensor name {name!r}")
    seen.add(name)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor must be contiguous")
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _copy_whole(small: int, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copies whole tensors, the first ``small`` of them with no OpenMP parallel region
    (see ``weightsync.serial_copy``): a region per small tensor costs more than it
    saves, and much more when processes share cores. Large ones keep torch's threads."""
    if small:
        with serial_copies():
            torch._foreach_copy_(dsts[:small] if small < len(dsts) else dsts,
                                 srcs[:small] if small < len(srcs) else srcs)
    if small < len(dsts):
        torch._foreach_copy_(dsts[small:], srcs[small:])


@torch.no_grad()
def pack_bucket(plan: BucketPlan, bucket: int, sources: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copies (casting where the plan's dtype differs) bucket ``bucket`` into ``out`` (uint8).

    Tensors that lie whole in the bucket go in one ``torch._foreach_copy_`` call per
    size group (one Python call for thousands of small tensors); pieces of larger ones
    one by one."""
    whole, small, split = plan._whole_and_split[bucket]
    if whole:
        _copy_whole(small, plan.bucket_views(out, bucket), [sources[i] for i in whole])
    with serial_copies() if plan._small_splits[bucket] else contextlib.nullcontext():
        _pack_split(plan, split, sources, out)


def _pack_split(plan: BucketPlan, split: Sequence[Piece], sources: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    for p in split:
        slot = plan.slots[p.tensor_index]
        src = sources[p.tensor_index].reshape(-1)
        dst = out[p.bucket_start:p.bucket_start + p.length]
        if src.dtype == slot.dtype:
            dst.copy_(byte_view(src)[p.tensor_start:p.tensor_start + p.length])
        else:
            first = p.tensor_start // slot.itemsize
            count = p.length // slot.itemsize
            dst.view(slot.dtype).copy_(src[first:first + count])


@torch.no_grad()
def unpack_bucket(plan: BucketPlan, bucket: int, data: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copies bucket ``bucket`` from ``data`` (uint8) into ``targets`` (same dtypes as the plan);
    whole tensors grouped as in ``pack_bucket``."""
    whole, small, split = plan._whole_and_split[bucket]
    if whole:
        _copy_whole(small, [targets[i] for i in whole], plan.bucket_views(data, bucket))
    with serial_copies() if plan._small_splits[bucket] else contextlib.nullcontext():
        for p in split:
            dst = byte_view(targets[p.tensor_index])
            dst[p.tensor_start:p.tensor_start + p.length].copy_(data[p.bucket_start:p.bucket_start + p.length])


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of names, dtypes, shapes and exact bytes; equal iff bitwise equal."""
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in sorted(named_tensors, key=lambda nt: nt[0]):
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()  # GPU weights are hashed from a host copy
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(byte_view(t).numpy())  # hashes the tensor's memory in place, no copy
    return h.hexdigest()


__all__ = ["BucketPlan", "TensorSlot", "Piece", "is_reference", "DTYPES", "DEFAULT_BUCKET_BYTES", "dtype_from_name",
           "dtype_name", "byte_view", "pack_bucket", "unpack_bucket", "weights_digest"]
