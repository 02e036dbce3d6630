"""The bucket plan: where every tensor's bytes sit in the transfer stream.

All tensors are laid end to end (each start aligned to 8 bytes) in one logical byte
stream; bucket ``b`` is the fixed window ``[b * bucket_bytes, (b + 1) * bucket_bytes)``.
A tensor larger than a bucket simply spans several buckets, so buffers never grow with
the model and a 1 GiB tensor streams through 2 x bucket_bytes of memory. The plan is
built once from names, dtypes and shapes and replayed every step (``plan_id`` says
whether two plans are the same); the per-bucket piece lists are computed once here.

On the wire and in memory a plan is four columns (names, dtype codes, ranks, dims),
not a record per tensor: a plan may list a million tensors, and one protobuf message
and one Python object per tensor made such a plan cost seconds to build, send, parse
and check, on every process it passed through.

This module does not import torch: the coordinator checks and lays out plans without
it (torch costs a server over a second to import and ~180 MB of memory). The copies
in and out of buckets and the weights digest are in ``weightsync.packing``; the
torch dtypes of the wire's dtype codes in ``weightsync.dtypes``, imported by the
few methods here that take or give torch dtypes (their callers hold tensors).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from weightsync.errors import InvalidArgument, PlanUnknown
from weightsync.v1 import common_pb2
from weightsync.wire_dtypes import WIRE_DTYPES

if TYPE_CHECKING:
    import torch

ALIGN = 8
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
MAX_BUCKET_BYTES = 1 << 32  # receivers allocate two buckets: never let a request ask for more
MAX_TENSORS = 1_000_000
MAX_NAME_LEN = 512
MAX_DIMS = 16  # dimensions of one tensor
MAX_TENSOR_BYTES = 1 << 48  # one tensor's bytes (256 TiB): products and sums stay exact in int64
MAX_PLAN_BYTES = 63 * 1024 * 1024  # a plan's wire form; requests carrying it must fit gRPC's 64 MiB
_PLANS_BY_ID: OrderedDict[str, BucketPlan] = OrderedDict()  # validated plans by plan_id (from_proto, references)
_PLANS_LOCK = threading.Lock()
_PLANS_KEPT = 8
SERIAL_COPY_BYTES = 1 << 20  # whole tensors smaller than this are copied without OpenMP regions
_VIEW_BUFFERS = 4  # bucket buffers whose views a plan remembers: a sender's or receiver's two, and the
# two they replaced (a new group or segment); older ones are let go, so their memory can be freed
_NAME_SEP = "\0"  # between names in the wire column (a name is printable, so never holds one)
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))

_ITEMSIZES = np.array([size for _, size in WIRE_DTYPES], dtype=np.int64)


class TensorSlot(NamedTuple):
    """One tensor's place in the stream."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that lies in one bucket (all offsets in bytes)."""

    tensor_index: int
    tensor_start: int   # byte offset inside the tensor
    bucket_start: int   # byte offset inside the bucket
    length: int


class WireOps(NamedTuple):
    """One bucket as a network transport moves it (``BucketPlan.wire_ops``): first, if
    ``gathered`` is not empty, those bucket ranges of small tensors end to end as one
    operation of ``gathered_bytes``; then each of ``ops`` (``(start, end, piece)`` as in
    ``BucketPlan.bucket_ops``) as one operation, in order."""

    gathered: tuple[tuple[int, int], ...]
    gathered_bytes: int
    ops: tuple[tuple[int, int, Piece | None], ...]

    @property
    def packs(self) -> bool:
        """Whether any small tensors go through the bucket buffer (packed, unpacked)."""
        return bool(self.gathered) or any(piece is None for _, _, piece in self.ops)


class _Columns(NamedTuple):
    """A plan's tensors as four columns, the form they take on the wire."""

    names: tuple[str, ...]
    codes: np.ndarray   # uint8 dtype code per tensor
    ranks: np.ndarray   # uint8 number of dimensions per tensor
    dims: np.ndarray    # int64: every tensor's dimensions, end to end


def same_distances(addresses: np.ndarray, positions: np.ndarray, sizes: np.ndarray) -> tuple[int, int] | None:
    """Whether tensors with bytes (``sizes`` > 0) sit at ``addresses`` the same distance
    apart as at ``positions`` (their places in a stream of bytes): ``(k, delta)``, the
    first such tensor and ``address - position`` for all of them; None otherwise, or
    when none has bytes. Empty tensors are left out: their addresses mean nothing."""
    present = np.flatnonzero(sizes > 0)
    if not len(present):
        return None
    delta = addresses[present].astype(np.int64) - positions[present]
    if np.any(delta != delta[0]):
        return None
    return int(present[0]), int(delta[0])


class BucketPlan:
    """Immutable transfer plan; see the module docstring.

    The tensors are held as columns (numpy arrays, and a tuple of names), not as an
    object per tensor: a plan may list a million tensors, and it is checked and laid
    out with whole-array operations (a 1M-tensor plan in a fraction of a second). The
    per-tensor views (``slots``, ``shapes``, ``pieces``) are made on first use.
    Two plans are equal when their ``plan_id`` (a fingerprint of everything) is.
    """

    def __init__(self, columns: _Columns, nbytes: np.ndarray, wire: common_pb2.WeightPlan,
                 plan_id: str = "") -> None:
        """Use ``build``, ``from_tensors`` or ``from_proto``: they check the columns, work
        out ``nbytes`` (``_sizes``) and make ``wire`` (the columns and bucket_bytes;
        ``total_bytes`` and ``plan_id`` are filled in here, unless ``plan_id`` is given:
        the fingerprint ``from_proto`` already took of the same columns)."""
        self._columns = columns
        self.bucket_bytes = int(wire.bucket_bytes)
        aligned = (nbytes + (ALIGN - 1)) // ALIGN * ALIGN
        ends = np.cumsum(aligned)
        self._nbytes = nbytes
        self._offsets = ends - aligned
        self._ends = ends  # each tensor's end in the stream, alignment padding included
        self.total_bytes = int(ends[-1]) if len(ends) else 0
        self._wire = wire
        self._embedded: dict[int, bytes] = {}  # field number -> the plan encoded as that field
        self._embedded_lock = threading.Lock()  # made once, not per racing thread
        if not plan_id:
            wire.total_bytes = self.total_bytes
            plan_id = _fingerprint(wire)
        self.plan_id = wire.plan_id = plan_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketPlan) and other.plan_id == self.plan_id

    def __hash__(self) -> int:
        return hash(self.plan_id)

    def __len__(self) -> int:
        return len(self._columns.names)

    def __repr__(self) -> str:
        return (f"BucketPlan({len(self)} tensors, {self.total_bytes} bytes, bucket_bytes={self.bucket_bytes}, "
                f"plan_id={self.plan_id[:12]})")

    @classmethod
    def build(cls, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], *,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
        """Lays out ``(name, dtype, shape)`` specs in order.

        Raises:
            InvalidArgument: duplicate or empty names, a bad shape or dtype, or a
                bucket size that is not a positive multiple of 8.
        """
        # The caller holds torch dtypes, so torch is loaded already.
        from weightsync.dtypes import CODE_OF, dtype_name

        _check_bucket_bytes(bucket_bytes)
        names: list[str] = []
        codes: list[int] = []
        ranks: list[int] = []
        dims: list[int] = []
        for name, dtype, shape in specs:
            names.append(name)
            code = CODE_OF.get(dtype)
            if code is None:
                dtype_name(dtype)  # raises: unsupported dtype
            codes.append(code)
            ranks.append(len(shape))
            dims.extend(shape)
            if len(names) > MAX_TENSORS:
                raise InvalidArgument(f"more than {MAX_TENSORS} tensors")
        try:
            blob = _NAME_SEP.join(names).encode()
        except TypeError:  # a name that is not a str
            blob = b""
        _check_names(names, blob)
        if ranks and max(ranks) > MAX_DIMS:
            index = next(i for i, r in enumerate(ranks) if r > MAX_DIMS)
            raise InvalidArgument(f"tensor {names[index]!r}: more than {MAX_DIMS} dimensions")
        try:
            dim_array = np.array(dims, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise InvalidArgument("shapes must be sequences of integers") from None
        columns = _Columns(tuple(names), np.array(codes, dtype=np.uint8), np.array(ranks, dtype=np.uint8), dim_array)
        sizes = _sizes(columns)
        wire = common_pb2.WeightPlan(
            names=blob, dtypes=columns.codes.tobytes(), ranks=columns.ranks.tobytes(),
            dims=dim_array.astype("<i8", copy=False).tobytes(), bucket_bytes=bucket_bytes)
        if wire.ByteSize() > MAX_PLAN_BYTES:  # else every request carrying it would fail in gRPC
            raise InvalidArgument(f"the plan is {wire.ByteSize() / 2**20:.1f} MiB on the wire; at most "
                                  f"{MAX_PLAN_BYTES / 2**20:.0f} MiB ({len(names)} tensors, names of "
                                  f"{len(blob) / max(1, len(names)):.0f} bytes on average)")
        return cls(columns, sizes, wire)

    @classmethod
    def from_tensors(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     wire_dtype: torch.dtype | None = None) -> BucketPlan:
        """Plans ``named_tensors``; ``wire_dtype`` casts floating tensors on the way."""
        from weightsync.dtypes import on_wire  # the caller holds tensors: torch is loaded

        return cls.build(((n, on_wire(t.dtype, wire_dtype), tuple(t.shape)) for n, t in named_tensors),
                         bucket_bytes=bucket_bytes)

    @classmethod
    def from_proto(cls, msg: common_pb2.WeightPlan) -> BucketPlan:
        """Rebuilds and validates a plan received over the wire.

        Plans are replayed every step, so a validated plan is remembered by its id (the
        hash of its columns and layout): a repeat costs one hash.

        A *reference* (``plan_id``, ``bucket_bytes`` and ``total_bytes`` with no tensors;
        see ``reference_proto``) stands for a plan this process validated before.

        Raises:
            InvalidArgument: any inconsistency (columns, layout, fingerprint, dtype, ...).
            PlanUnknown: a reference to a plan this process does not hold.
        """
        if is_reference(msg):
            return cls.known(msg)
        columns = (msg.names, msg.dtypes, msg.ranks, msg.dims)  # read once: each read is a copy
        fingerprint = _fingerprint(msg, columns)  # what plan_id is if the columns check out
        claimed = msg.plan_id or fingerprint
        with _PLANS_LOCK:
            plan = _PLANS_BY_ID.get(fingerprint) if claimed == fingerprint else None
            if plan is not None:
                _PLANS_BY_ID.move_to_end(fingerprint)
                return plan
        plan = cls._from_proto(msg, columns, fingerprint)  # says what is wrong with the columns, if anything
        if claimed != fingerprint:
            raise InvalidArgument("plan_id does not match the plan's contents")
        with _PLANS_LOCK:
            _PLANS_BY_ID[plan.plan_id] = plan
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
    def _from_proto(cls, msg: common_pb2.WeightPlan, columns: tuple[bytes, bytes, bytes, bytes],
                    fingerprint: str) -> BucketPlan:
        """Checks the columns cheapest first: counts and lengths before any per-tensor work."""
        _check_bucket_bytes(msg.bucket_bytes)
        blob, dtypes, rank_bytes, dims = columns
        count = len(dtypes)
        if count == 0:
            raise InvalidArgument("plan has no tensors")
        if count > MAX_TENSORS:
            raise InvalidArgument(f"plan lists {count} tensors; at most {MAX_TENSORS}")
        if len(rank_bytes) != count:
            raise InvalidArgument(f"plan lists {count} dtypes but {len(rank_bytes)} ranks")
        name_count = blob.count(_NAME_SEP.encode()) + 1
        if name_count != count:
            raise InvalidArgument(f"plan lists {count} dtypes but {name_count} names")
        codes = np.frombuffer(dtypes, dtype=np.uint8)
        if int(codes.max()) >= len(WIRE_DTYPES):
            raise InvalidArgument(f"unknown dtype code {int(codes.max())}; known: 0-{len(WIRE_DTYPES) - 1}")
        ranks = np.frombuffer(rank_bytes, dtype=np.uint8)
        if int(ranks.max()) > MAX_DIMS:
            raise InvalidArgument(f"a tensor has {int(ranks.max())} dimensions; at most {MAX_DIMS}")
        dim_count = int(ranks.sum(dtype=np.int64))
        if len(dims) != 8 * dim_count:
            raise InvalidArgument(f"plan dims hold {len(dims)} bytes; the ranks need {8 * dim_count}")
        try:
            names = tuple(blob.decode("utf-8").split(_NAME_SEP))
        except UnicodeDecodeError:
            raise InvalidArgument("plan names are not UTF-8") from None
        _check_names(names, blob)
        checked = _Columns(names, codes, ranks, np.frombuffer(dims, dtype="<i8").astype(np.int64, copy=False))
        sizes = _sizes(checked)
        aligned_total = int(((sizes + (ALIGN - 1)) // ALIGN * ALIGN).sum())
        if aligned_total != msg.total_bytes:
            raise InvalidArgument(f"plan total_bytes {msg.total_bytes} != laid out {aligned_total}")
        wire = common_pb2.WeightPlan()
        wire.CopyFrom(msg)  # the same columns: the fingerprint taken of msg is this plan's id
        return cls(checked, sizes, wire, plan_id=fingerprint)

    def to_proto(self) -> common_pb2.WeightPlan:
        """The wire form (protobuf; never pickle). A fresh copy of a message built once."""
        msg = common_pb2.WeightPlan()
        msg.CopyFrom(self._wire)
        return msg

    def embedded(self, field_number: int) -> bytes:
        """The whole plan encoded as field ``field_number`` of an enclosing message,
        made once per plan. Appended to the enclosing message's other fields it makes
        the full message (protobuf merges concatenated messages), so a plan of tens of
        megabytes is not copied into and re-encoded for every request that carries it."""
        with self._embedded_lock:
            encoded = self._embedded.get(field_number)
            if encoded is None:
                body = self._wire.SerializeToString()
                encoded = self._embedded[field_number] = (_varint(field_number << 3 | 2) + _varint(len(body))
                                                          + body)
            return encoded

    # -- per-tensor views, made on first use -------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in stream order."""
        return self._columns.names

    @cached_property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """Wire dtypes in stream order (torch dtypes: imports torch on first use)."""
        from weightsync.dtypes import DTYPE_CODES
        return tuple(DTYPE_CODES[c] for c in self._columns.codes.tolist())

    @cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes in stream order."""
        dims = self._columns.dims.tolist()
        ends = np.cumsum(self._columns.ranks, dtype=np.int64).tolist()
        starts = [0, *ends[:-1]]
        return tuple(tuple(dims[a:b]) for a, b in zip(starts, ends, strict=True))

    def completed_by_bucket(self) -> list[list[int]]:
        """For each bucket, the tensors whose last byte it carries (an empty tensor: the
        bucket of its offset): what a receiver can use once that bucket is in."""
        done: list[list[int]] = [[] for _ in range(self.num_buckets)]
        if not done:
            return done
        last = np.minimum((self._offsets + np.maximum(self._nbytes, 1) - 1) // self.bucket_bytes, len(done) - 1)
        for i, bucket in enumerate(last.tolist()):
            done[bucket].append(i)
        return done

    @property
    def ndims(self) -> np.ndarray:
        """Each tensor's number of dimensions (uint8 column)."""
        return self._columns.ranks

    def extents(self, tensors: np.ndarray, dims: np.ndarray) -> np.ndarray:
        """The size of tensor ``tensors[i]`` along its dimension ``dims[i]`` (int64; a
        0-dimensional tensor: 1), from the columns with whole-array operations. Each
        dim must be below its tensor's number of dimensions (or 0 for a 0-d tensor)."""
        ranks = self._columns.ranks.astype(np.int64)
        first = np.cumsum(ranks) - ranks  # each tensor's first entry in the dims column
        t, d = np.asarray(tensors, dtype=np.int64), np.asarray(dims, dtype=np.int64)
        scalar = ranks[t] == 0
        flat = self._columns.dims.astype(np.int64)
        if not len(flat):
            return np.ones(len(t), dtype=np.int64)
        return np.where(scalar, 1, flat[np.where(scalar, 0, first[t] + d)])

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each tensor's first byte in the stream."""
        return tuple(self._offsets.tolist())

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Each tensor's length in bytes."""
        return tuple(self._nbytes.tolist())

    @cached_property
    def slots(self) -> tuple[TensorSlot, ...]:
        """One ``TensorSlot`` per tensor (built on first use: a million cost a second)."""
        return tuple(map(TensorSlot, self.names, self.dtypes, self.shapes, self.offsets, self.sizes))

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
        return int(self._nbytes.sum())

    @cached_property
    def pieces(self) -> tuple[tuple[Piece, ...], ...]:
        """For each bucket, the tensor pieces it carries, in stream order."""
        return tuple(self.bucket_pieces(b) for b in range(self.num_buckets))

    def bucket_pieces(self, bucket: int) -> tuple[Piece, ...]:
        """The tensor pieces of ``bucket``, in stream order."""
        whole, _, split = self._whole_and_split[bucket]
        base = bucket * self.bucket_bytes
        pieces = [Piece(i, 0, self.offsets[i] - base, self.sizes[i]) for i in whole]
        pieces.extend(split)
        return tuple(sorted(pieces, key=lambda p: p.bucket_start))

    @cached_property
    def _whole_and_split(self) -> tuple[tuple[tuple[int, ...], int, tuple[Piece, ...]], ...]:
        """Per bucket: the indices of tensors that lie whole inside it, small ones first
        (copied together in one ``torch._foreach_copy_`` per group), how many of them are
        small, and the pieces of tensors that span buckets. Whole-array work: per-tensor
        Python runs only for the tensors that span buckets."""
        size, offset, bucket_bytes = self._nbytes, self._offsets, self.bucket_bytes
        first = offset // bucket_bytes
        last = (offset + np.maximum(size, 1) - 1) // bucket_bytes
        present = size > 0
        whole = np.flatnonzero(present & (first == last))
        bounds = np.searchsorted(first[whole], np.arange(self.num_buckets + 1)).tolist()
        small = size[whole] < SERIAL_COPY_BYTES
        split: list[list[Piece]] = [[] for _ in range(self.num_buckets)]
        for index in np.flatnonzero(present & (first != last)).tolist():
            done, nbytes = 0, self.sizes[index]
            while done < nbytes:
                bucket, in_bucket = divmod(self.offsets[index] + done, bucket_bytes)
                length = min(nbytes - done, bucket_bytes - in_bucket)
                split[bucket].append(Piece(index, done, in_bucket, length))
                done += length
        out = []
        for bucket in range(self.num_buckets):
            a, b = bounds[bucket], bounds[bucket + 1]
            here, here_small = whole[a:b], small[a:b]
            out.append((tuple(here[here_small].tolist() + here[~here_small].tolist()), int(here_small.sum()),
                        tuple(split[bucket])))
        return tuple(out)

    def bucket_ops(self, bucket: int) -> tuple[tuple[int, int, Piece | None], ...]:
        """``bucket`` cut into the byte ranges ``(start, end, piece)`` that a network
        transport moves as one operation each, in order: every piece of at least
        ``SERIAL_COPY_BYTES`` is a range of its own (``piece`` set: it can go from, or
        land in, its tensor with no copy), and the bytes between them (small tensors,
        padding) one range each (``piece`` None: packed through a bucket buffer). Sender
        and receivers derive the same ranges from the plan alone."""
        return self._bucket_ops[bucket]

    @cached_property
    def _bucket_ops(self) -> tuple[tuple[tuple[int, int, Piece | None], ...], ...]:
        out = []
        for bucket, (whole, small, split) in enumerate(self._whole_and_split):
            base = bucket * self.bucket_bytes
            large = [Piece(i, 0, self.offsets[i] - base, self.sizes[i]) for i in whole[small:]]
            large += [p for p in split if p.length >= SERIAL_COPY_BYTES]
            ops: list[tuple[int, int, Piece | None]] = []
            at = 0
            for p in sorted(large, key=lambda p: p.bucket_start):
                if p.bucket_start > at:
                    ops.append((at, p.bucket_start, None))
                ops.append((p.bucket_start, p.bucket_start + p.length, p))
                at = p.bucket_start + p.length
            if at < self.bucket_size(bucket):
                ops.append((at, self.bucket_size(bucket), None))
            out.append(tuple(ops))
        return tuple(out)

    def wire_ops(self, bucket: int) -> WireOps:
        """What a network transport moves for ``bucket``, as few operations as the cut
        allows: where ``bucket_ops`` leaves two or more ranges of small tensors between
        the large pieces (small norms between large matrices, as in most dense models),
        they go as one operation of their bytes end to end (``gathered``), first; then
        the ``ops`` in order. A bucket with one small range or none keeps ``bucket_ops``.
        Each operation costs a collective's round trip to every receiver, which at a
        few hundred per sync costs as much as the bytes."""
        return self._wire_ops[bucket]

    @cached_property
    def _wire_ops(self) -> tuple[WireOps, ...]:
        out = []
        for ops in self._bucket_ops:
            small = tuple((start, end) for start, end, piece in ops if piece is None)
            if len(small) < 2:
                out.append(WireOps((), 0, ops))
            else:
                out.append(WireOps(small, sum(end - start for start, end in small),
                                   tuple(op for op in ops if op[2] is not None)))
        return tuple(out)

    def memory_run(self, bucket: int, start: int, end: int, addresses: np.ndarray) -> tuple[int, int] | None:
        """Where bytes ``[start, end)`` of ``bucket`` lie as one run of memory, if they do.

        ``addresses``: each tensor's first byte (``cross_memory.tensor_addresses``).
        The range is one run when the tensors it covers sit in memory the same distance
        apart as in the stream and none of its bytes is alignment padding (those would
        land between two tensors, in memory that belongs to neither). Returns
        ``(index, address)``: a tensor of the range with bytes in it (whose memory
        the run lies in) and the address of the range's first byte; None otherwise.

        An engine that keeps its weights end to end in one arena, in the plan's order
        (``weightsync.arena``), has every bucket of small tensors as one run: a network
        transport lands it there in one operation, with no copy out of a bucket buffer.
        Whole-array work, a few numpy calls per range whatever its tensor count.
        """
        base = bucket * self.bucket_bytes
        lo, hi = base + start, base + end
        first = int(np.searchsorted(self._ends, lo, side="right"))  # the first tensor ending after lo
        last = int(np.searchsorted(self._offsets, hi, side="left"))  # past the last starting before hi
        if first >= last or len(addresses) != len(self):
            return None
        offsets, sizes, ends = self._offsets[first:last], self._nbytes[first:last], self._ends[first:last]
        padding = offsets + sizes
        if np.any((ends > padding) & (padding < hi) & (ends > lo)):
            return None
        found = same_distances(addresses[first:last], offsets, sizes)
        return None if found is None else (first + found[0], found[1] + lo)

    @cached_property
    def gathered_bytes(self) -> int:
        """The largest ``wire_ops(b).gathered_bytes`` of any bucket: the staging a
        network transport needs beside its bucket buffer."""
        return max((w.gathered_bytes for w in self._wire_ops), default=0)

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
                base = bucket * self.bucket_bytes
                offsets, sizes, dtypes, shapes = self.offsets, self.sizes, self.dtypes, self.shapes
                views = []
                for index in self._whole_and_split[bucket][0]:
                    start = offsets[index] - base
                    views.append(buffer[start:start + sizes[index]].view(dtypes[index]).view(shapes[index]))
                per_buffer[bucket] = views
            return views


def is_reference(msg: common_pb2.WeightPlan) -> bool:
    """Whether a wire plan names a known plan by id instead of listing its tensors."""
    return len(msg.dtypes) == 0 and bool(msg.plan_id)


def _fingerprint(wire: common_pb2.WeightPlan, columns: Sequence[bytes] | None = None) -> str:
    """The plan id: a hash of the columns and the layout's parameters (offsets follow
    from them). ``columns``: the four columns already read from ``wire`` (each read of a
    bytes field is a copy). SHA-256, which CPUs accelerate: twice blake2b's speed here."""
    h = hashlib.sha256(f"{wire.bucket_bytes}|{wire.total_bytes}|".encode())
    for column in columns or (wire.names, wire.dtypes, wire.ranks, wire.dims):
        h.update(len(column).to_bytes(8, "little"))
        h.update(column)
    return h.hexdigest()[:32]


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if bucket_bytes <= 0 or bucket_bytes % ALIGN or bucket_bytes > MAX_BUCKET_BYTES:
        raise InvalidArgument(f"bucket_bytes must be a positive multiple of {ALIGN} up to {MAX_BUCKET_BYTES}, "
                              f"got {bucket_bytes}")


def _check_names(names: Sequence[str], blob: bytes) -> None:
    """Every name 1-MAX_NAME_LEN printable characters, no two alike. ``blob`` is the
    names joined by NUL, UTF-8 (empty if a name is not a str). Whole-column passes in
    C; names are looked at one by one only to say which one is wrong, or when some are
    not ASCII."""
    ok = bool(blob) or len(names) == 1 and names[0] == ""
    if ok and names:
        rest = blob.translate(None, _PRINTABLE_ASCII)  # what is left: separators, or worse
        if rest.count(_NAME_SEP.encode()) == len(rest):  # printable ASCII
            lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
            ok = int(lengths.min()) > 0 and int(lengths.max()) <= MAX_NAME_LEN
        else:  # other characters: ask Python, name by name
            ok = all(n and len(n) <= MAX_NAME_LEN and n.isprintable() for n in names)
    if not ok:
        bad = next(n for n in names if not isinstance(n, str) or not n or len(n) > MAX_NAME_LEN
                   or not n.isprintable())
        raise InvalidArgument(f"bad tensor name {bad!r}: 1-{MAX_NAME_LEN} printable characters")
    # Equal names hash alike: sorted hashes with no two equal mean no two names are
    # (0.15 s at a million names; a set of them took 0.25 s). Equal hashes are looked
    # into with a set.
    hashes = np.fromiter(map(hash, names), dtype=np.int64, count=len(names))
    hashes.sort()
    if (hashes[1:] == hashes[:-1]).any() and len(set(names)) != len(names):
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))
        raise InvalidArgument(f"duplicate tensor name {duplicate!r}")


def _sizes(columns: _Columns) -> np.ndarray:
    """Bytes of each tensor (int64). Raises InvalidArgument for a negative dimension or a
    tensor over MAX_TENSOR_BYTES, checked in floating point first so that the exact
    int64 products cannot overflow."""
    dims, ranks, count = columns.dims, columns.ranks, len(columns.ranks)
    if len(dims) and int(dims.min()) < 0:
        index = int(np.searchsorted(np.cumsum(ranks, dtype=np.int64), int(np.argmax(dims < 0)), side="right"))
        raise InvalidArgument(f"tensor {columns.names[index]!r}: negative dimension in shape")
    itemsizes = _ITEMSIZES[columns.codes]
    numels = np.ones(count, dtype=np.int64)
    shaped = ranks > 0  # scalars hold one element and no dims; every other tensor's dims are a run
    starts = (np.cumsum(ranks, dtype=np.int64) - ranks)[shaped]
    if len(starts):
        bound = np.ones(count, dtype=np.float64)
        bound[shaped] = np.multiply.reduceat(np.maximum(dims, 1).astype(np.float64), starts)
        bound *= itemsizes
        if float(bound.max()) > MAX_TENSOR_BYTES:
            index = int(np.argmax(bound))
            raise InvalidArgument(f"tensor {columns.names[index]!r}: more than {MAX_TENSOR_BYTES} bytes")
        numels[shaped] = np.multiply.reduceat(dims, starts)
    return numels * itemsizes


__all__ = ["BucketPlan", "TensorSlot", "Piece", "WireOps", "is_reference", "same_distances", "WIRE_DTYPES", "DEFAULT_BUCKET_BYTES"]
