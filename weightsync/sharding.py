"""Plans with owners: which trainer rank sends which part of each tensor.

A sharded trainer (FSDP2, tensor parallel, or any torch.distributed job whose ranks
hold different pieces of the model) sends from every rank at once, each rank what it
holds; nothing is gathered to one rank first. The round's ``BucketPlan`` still
describes the full tensors the engines hold; ``Owners`` adds, per sending rank, its
*parts*: slices ``[start, start + rows)`` along one dimension of a tensor (``dims``;
dimension 0 -- rows -- unless said otherwise; a whole tensor is all its rows; a
0-dimensional tensor is one "row"), and *blocks*: a part sliced along further, later
dimensions too (``extra_*``: FSDP2 over tensor parallel holds a row-wise layer's weight
as a block of rows and columns). A sender's parts, in its order, are laid out as a
plan of their own (``part_plan``): tensors shaped like the parts, with the round's
bucket size. Each sender streams that plan on its own lane, and an engine receives
every lane into views of its full tensors (``part_views``): a row range of a
contiguous tensor is itself contiguous, so every transport's receiver works on it
unchanged. A slice along another dimension, or a block, is not: it is received into
a tensor of its own and copied into place once its last byte is in (``PartViews.done``).

The parts of every tensor, over all senders, must cover it exactly once: checked
with whole-array operations (a plan may list 20k tensors), by the coordinator and by
every engine, before anything changes. The blocks of a tensor must form a grid (each
dimension cut the same way across the others, as a device mesh cuts a DTensor).

What the trainer side can describe (``holding_of``): plain tensors (a full copy) and
DTensors placed ``Shard(d)`` over any mesh dimensions (FSDP2's default is ``Shard(0)``;
tensor parallel's column- and row-wise layers ``Shard(0)`` and ``Shard(1)``: slices as
``torch.chunk`` makes them, and chunks of chunks where two mesh dimensions shard one
tensor dimension), FSDP2 over tensor parallel's ``_StridedShard`` (the tensor-parallel
chunk first, then FSDP's chunk of it) and ``Replicate()`` over the others (HSDP's
replica groups: several ranks hold the same slice, and one of them sends it). A tensor
several ranks hold whole is sent by one of them, chosen to balance the bytes each rank
sends.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import InvalidArgument
from weightsync.gil import HAND_OVER_EVERY, hand_over_gil
from weightsync.plan import BucketPlan
from weightsync.v1 import common_pb2

if TYPE_CHECKING:  # the coordinator checks owners without torch; the ranks hold tensors
    import torch


def _dtensor_types() -> tuple[type, type, type] | None:
    """torch's DTensor, Replicate and Shard, or None where no DTensor can exist yet.

    Not imported here: ``torch.distributed.tensor`` takes half a second to import, and
    every server and trainer process imports this module (a coordinator or an agent
    never holds a DTensor). A DTensor's class lives in that module, so a process that
    holds one has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return None
    return module.DTensor, module.Replicate, module.Shard


MAX_SENDERS = 4096
_OWNERS_BY_KEY: OrderedDict[str, Owners] = OrderedDict()  # checked owners, by plan id and parts (from_proto)
_OWNERS_LOCK = threading.Lock()
_OWNERS_KEPT = 8


@dataclass(frozen=True)
class SenderParts:
    """One sender's parts, in the order it streams them.

    A part that is a block is sliced along further dimensions too: one entry per
    further slice in the ``extra_*`` columns (the part it belongs to, its dimension --
    after the part's own, increasing -- and its range). Most parts have none."""

    sender: int
    tensors: np.ndarray  # int32: index into the plan's tensors
    starts: np.ndarray   # int64: first slice ("row") along the part's dimension
    rows: np.ndarray     # int64: number of slices
    dims: np.ndarray | None = None  # int8: the dimension each part slices; None: all 0
    extra_parts: np.ndarray | None = None   # int32: the part a further slice belongs to
    extra_dims: np.ndarray | None = None    # int8: its dimension
    extra_starts: np.ndarray | None = None  # int64: its first slice
    extra_rows: np.ndarray | None = None    # int64: its number of slices

    def __post_init__(self) -> None:
        if self.dims is None:
            object.__setattr__(self, "dims", np.zeros(len(self.tensors), dtype=np.int8))
        for field, dtype in (("extra_parts", np.int32), ("extra_dims", np.int8), ("extra_starts", np.int64),
                             ("extra_rows", np.int64)):
            if getattr(self, field) is None:
                object.__setattr__(self, field, np.zeros(0, dtype=dtype))

    def extras(self) -> dict[int, tuple[tuple[int, int, int], ...]]:
        """Each block's further slices, (dim, start, rows), by part index; {} for none."""
        known = self.__dict__.get("_extras")
        if known is not None:
            return known
        parts = self.extra_parts.tolist()
        cuts = list(zip(self.extra_dims.tolist(), self.extra_starts.tolist(), self.extra_rows.tolist(), strict=True))
        if len(set(parts)) == len(parts):  # the usual block: one further slice (rows and columns)
            found = {part: (cut,) for part, cut in zip(parts, cuts, strict=True)}
        else:
            grouped: dict[int, list[tuple[int, int, int]]] = {}
            for part, cut in zip(parts, cuts, strict=True):
                grouped.setdefault(part, []).append(cut)
            found = {part: tuple(cut) for part, cut in grouped.items()}
        object.__setattr__(self, "_extras", found)  # made once: the columns never change
        return found

    def to_proto(self) -> common_pb2.SenderParts:
        return common_pb2.SenderParts(sender=self.sender, tensors=self.tensors.astype("<i4").tobytes(),
                                      starts=self.starts.astype("<i8").tobytes(),
                                      rows=self.rows.astype("<i8").tobytes(),
                                      dims=self.dims.astype(np.int8).tobytes() if self.dims.any() else b"",
                                      extra_parts=self.extra_parts.astype("<i4").tobytes(),
                                      extra_dims=self.extra_dims.astype(np.int8).tobytes(),
                                      extra_starts=self.extra_starts.astype("<i8").tobytes(),
                                      extra_rows=self.extra_rows.astype("<i8").tobytes())


def _tiles(shape: Sequence[int], blocks: Sequence[tuple[tuple[int, int], ...]]) -> bool:
    """Whether ``blocks`` (each a (start, rows) per dimension of ``shape``) cover a
    tensor of ``shape`` exactly once as a grid: along each dimension their distinct
    ranges cut it into consecutive pieces, and there is one block per cell."""
    if len(set(blocks)) != len(blocks):
        return False
    cells = 1
    for d, extent in enumerate(shape):
        at = 0
        ranges = sorted({block[d] for block in blocks})
        for start, rows in ranges:
            if start != at:
                return False
            at = start + rows
        if at != extent:
            return False
        cells *= len(ranges)
    return cells == len(blocks)


def _block(shape: Sequence[int], dim: int, start: int, rows: int,
           extra: Sequence[tuple[int, int, int]] = ()) -> tuple[tuple[int, int], ...]:
    """A part as a (start, rows) per dimension of ``shape``."""
    block = [(0, extent) for extent in shape]
    for d, s, r in ((dim, start, rows), *extra):
        block[d] = (s, r)
    return tuple(block)


class Owners:
    """Which sender sends which parts of ``plan``'s tensors; validated on construction.

    Raises (constructor):
        InvalidArgument: a part outside its tensor, a sender listing a tensor twice, a
            tensor covered twice or not at all, duplicate or too many senders.
    """

    def __init__(self, plan: BucketPlan, senders: Sequence[SenderParts]) -> None:
        self.plan = plan
        self.senders = tuple(senders)
        self._check()
        self._part_plans: dict[int, BucketPlan] = {}
        self._layouts: dict[int, tuple[list[int], list[int], list[int], list[bool]]] = {}
        self._addresses: dict[int, tuple[weakref.ref, np.ndarray]] = {}  # per sender: (addressed targets, parts')
        self._lock = threading.Lock()
        self.key = ""  # from_proto's: the plan's id and the parts' fingerprint

    @classmethod
    def from_proto(cls, msg: common_pb2.Owners, plan: BucketPlan) -> Owners:
        """The owners a request carries, checked against its plan.

        Rounds replay the same owners: a checked one is remembered by its plan's id
        and its parts' fingerprint, so the next round gets the same object, with the
        part plans it built (and the bucket views those keep) instead of rebuilding
        20k-part plans every round."""
        digest = hashlib.blake2b(plan.plan_id.encode(), digest_size=16)
        for s in msg.senders:
            columns = (s.tensors, s.starts, s.rows, s.dims, s.extra_parts, s.extra_dims, s.extra_starts, s.extra_rows)
            digest.update(b"%d|" % s.sender + b"|".join(b"%d" % len(c) for c in columns) + b"|")
            for column in columns:
                digest.update(column)
        key = digest.hexdigest()
        with _OWNERS_LOCK:
            known = _OWNERS_BY_KEY.get(key)
            if known is not None:
                _OWNERS_BY_KEY.move_to_end(key)
                return known
        owners = cls._from_proto(msg, plan)
        owners.key = key
        with _OWNERS_LOCK:
            _OWNERS_BY_KEY[key] = owners
            while len(_OWNERS_BY_KEY) > _OWNERS_KEPT:
                _OWNERS_BY_KEY.popitem(last=False)
        return owners

    @classmethod
    def known(cls, key: str) -> Owners | None:
        """The owners ``from_proto`` checked under ``key`` in this process, if it still
        keeps them (the last few): what a round that names its owners by key reuses."""
        with _OWNERS_LOCK:
            owners = _OWNERS_BY_KEY.get(key)
            if owners is not None:
                _OWNERS_BY_KEY.move_to_end(key)
            return owners

    @classmethod
    def _from_proto(cls, msg: common_pb2.Owners, plan: BucketPlan) -> Owners:
        if not msg.senders:
            raise InvalidArgument("owners lists no sender")
        if len(msg.senders) > MAX_SENDERS:
            raise InvalidArgument(f"owners lists {len(msg.senders)} senders; at most {MAX_SENDERS}")
        senders = []
        for s in msg.senders:
            if len(s.tensors) % 4 or len(s.starts) % 8 or len(s.rows) % 8:
                raise InvalidArgument(f"sender {s.sender}: parts columns are not whole int32/int64 values")
            tensors = np.frombuffer(s.tensors, dtype="<i4").astype(np.int32)
            starts = np.frombuffer(s.starts, dtype="<i8").astype(np.int64)
            rows = np.frombuffer(s.rows, dtype="<i8").astype(np.int64)
            dims = np.frombuffer(s.dims, dtype=np.int8).copy() if s.dims else None
            if not len(tensors) == len(starts) == len(rows) or (dims is not None and len(dims) != len(tensors)):
                raise InvalidArgument(f"sender {s.sender}: parts columns differ in length")
            if len(s.extra_parts) % 4 or len(s.extra_starts) % 8 or len(s.extra_rows) % 8:
                raise InvalidArgument(f"sender {s.sender}: block columns are not whole int32/int64 values")
            extra = (np.frombuffer(s.extra_parts, dtype="<i4").astype(np.int32),
                     np.frombuffer(s.extra_dims, dtype=np.int8).copy(),
                     np.frombuffer(s.extra_starts, dtype="<i8").astype(np.int64),
                     np.frombuffer(s.extra_rows, dtype="<i8").astype(np.int64))
            if len({len(column) for column in extra}) != 1:
                raise InvalidArgument(f"sender {s.sender}: block columns differ in length")
            senders.append(SenderParts(s.sender, tensors, starts, rows, dims, *extra))
        return cls(plan, senders)

    def to_proto(self) -> common_pb2.Owners:
        return common_pb2.Owners(senders=[s.to_proto() for s in self.senders])

    @property
    def sender_ranks(self) -> list[int]:
        return [s.sender for s in self.senders]

    def parts_of(self, sender: int) -> SenderParts:
        for s in self.senders:
            if s.sender == sender:
                return s
        raise InvalidArgument(f"trainer rank {sender} sends no part of this plan")

    def _check(self) -> None:
        n = len(self.plan)
        ranks = [s.sender for s in self.senders]
        if not ranks:
            raise InvalidArgument("owners lists no sender")
        if len(set(ranks)) != len(ranks):
            raise InvalidArgument(f"owners lists a sender twice: {sorted(ranks)}")
        ndims = self.plan.ndims.astype(np.int64)
        scalar = ndims == 0
        for s in self.senders:
            if len(s.tensors) == 0:
                raise InvalidArgument(f"sender {s.sender} sends no part")
            if s.tensors.min() < 0 or s.tensors.max() >= n:
                raise InvalidArgument(f"sender {s.sender}: a part names a tensor outside the plan's {n}")
            if len(np.unique(s.tensors)) != len(s.tensors):
                raise InvalidArgument(f"sender {s.sender} lists a tensor twice")
            bad = np.flatnonzero((s.dims < 0) | (s.dims >= np.maximum(ndims[s.tensors], 1)))
            if len(bad):
                i = int(s.tensors[bad[0]])
                raise InvalidArgument(f"sender {s.sender}: its part of {self.plan.names[i]!r} slices dimension "
                                      f"{int(s.dims[bad[0]])} of a {int(ndims[i])}-dimensional tensor",
                                      metadata={"tensor": self.plan.names[i]})
            if (s.rows <= 0).any() or (s.starts < 0).any():
                raise InvalidArgument(f"sender {s.sender}: a part has no rows or starts before row 0")
            ends = s.starts + s.rows
            extents = self.plan.extents(s.tensors, s.dims)
            bad = np.flatnonzero((ends > extents) | (scalar[s.tensors] & (s.rows != 1)))
            if len(bad):
                i = int(s.tensors[bad[0]])
                raise InvalidArgument(f"sender {s.sender}: its part of {self.plan.names[i]!r} (slices "
                                      f"{int(s.starts[bad[0]])}..{int(ends[bad[0]])} of dimension "
                                      f"{int(s.dims[bad[0]])}) lies outside the tensor's {int(extents[bad[0]])}",
                                      metadata={"tensor": self.plan.names[i]})
            self._check_extra(s, ndims)
        blocky = np.zeros(n, dtype=bool)  # tensors some sender sends as blocks: checked as a grid below
        for s in self.senders:
            blocky[s.tensors[s.extra_parts]] = True
        tensors = np.concatenate([s.tensors for s in self.senders]).astype(np.int64)
        starts = np.concatenate([s.starts for s in self.senders])
        ends = starts + np.concatenate([s.rows for s in self.senders])
        dims = np.concatenate([s.dims for s in self.senders])
        covered = np.zeros(n, dtype=bool)
        covered[tensors] = True
        if blocky.any():
            self._check_grids(blocky)
            sliced = ~blocky[tensors]
            tensors, starts, ends, dims = tensors[sliced], starts[sliced], ends[sliced], dims[sliced]
        order = np.lexsort((starts, tensors))
        tensors, starts, ends, dims = tensors[order], starts[order], ends[order], dims[order]
        first = np.ones(len(tensors), dtype=bool)
        first[1:] = tensors[1:] != tensors[:-1]
        last = np.ones(len(tensors), dtype=bool)
        last[:-1] = first[1:]
        # Each tensor: all its parts slice one dimension; its first part starts at 0,
        # each next one where the previous ended, its last one ends at the tensor's
        # extent along that dimension; and every tensor has parts.
        mixed = np.flatnonzero(~first & (dims != np.concatenate(([0], dims[:-1]))))
        if len(mixed):
            name = self.plan.names[int(tensors[mixed[0]])]
            raise InvalidArgument(f"the senders' parts of {name!r} slice different dimensions",
                                  metadata={"tensor": name})
        gap = np.flatnonzero(first & (starts != 0))
        if not len(gap):
            follows = ~first
            gap = np.flatnonzero(follows & (starts != np.concatenate(([0], ends[:-1]))))
        if not len(gap):
            gap = np.flatnonzero(last & (ends != self.plan.extents(tensors, dims)))
        if len(gap):
            name = self.plan.names[int(tensors[gap[0]])]
            raise InvalidArgument(f"the senders' parts of {name!r} overlap or leave rows unsent",
                                  metadata={"tensor": name})
        if not covered.all():
            name = self.plan.names[int(np.flatnonzero(~covered)[0])]
            raise InvalidArgument(f"no sender sends {name!r}", metadata={"tensor": name})

    def _check_extra(self, s: SenderParts, ndims: np.ndarray) -> None:
        """A sender's block columns: each further slice of a real part, along a later
        dimension than the part's own (increasing within a part), inside the tensor."""
        parts = s.extra_parts.astype(np.int64)
        if not len(parts):
            return
        if parts.min() < 0 or parts.max() >= len(s.tensors):
            raise InvalidArgument(f"sender {s.sender}: a block's slice names a part outside its {len(s.tensors)}")
        tensors, dims = s.tensors[parts].astype(np.int64), s.extra_dims.astype(np.int64)
        follows = np.zeros(len(parts), dtype=bool)
        follows[1:] = parts[1:] == parts[:-1]
        after = np.where(follows, np.concatenate(([0], dims[:-1])), s.dims[parts].astype(np.int64))
        bad = np.flatnonzero((dims <= after) | (dims >= ndims[tensors].astype(np.int64))
                             | (np.concatenate(([False], parts[1:] < parts[:-1]))))
        if len(bad):
            name = self.plan.names[int(tensors[bad[0]])]
            raise InvalidArgument(f"sender {s.sender}: its block of {name!r} slices dimension {int(dims[bad[0]])} "
                                  "out of order (each block's dimensions increase, after the part's own) or beyond "
                                  "the tensor's", metadata={"tensor": name})
        ends = s.extra_starts + s.extra_rows
        bad = np.flatnonzero((s.extra_rows <= 0) | (s.extra_starts < 0) | (ends > self.plan.extents(tensors, dims)))
        if len(bad):
            name = self.plan.names[int(tensors[bad[0]])]
            raise InvalidArgument(f"sender {s.sender}: its block of {name!r} (slices {int(s.extra_starts[bad[0]])}.."
                                  f"{int(ends[bad[0]])} of dimension {int(dims[bad[0]])}) is empty or lies outside "
                                  "the tensor", metadata={"tensor": name})

    def _check_grids(self, blocky: np.ndarray) -> None:
        """Every tensor some sender sends as blocks: all its parts, over every sender,
        tile it as a grid (as ``_tiles`` says, with whole-array operations: an MoE
        trainer's plan may hold 20k blocked tensors): no block twice; along each
        dimension the blocks' distinct ranges cut it into consecutive pieces; and there
        are as many blocks as cells."""
        plan, ndims = self.plan, self.plan.ndims.astype(np.int64)
        width = int(ndims[blocky].max())
        tensors, starts, rows = [], [], []
        for s in self.senders:
            at = np.flatnonzero(blocky[s.tensors])
            if not len(at):
                continue
            t = s.tensors[at].astype(np.int64)
            # each part as a block: (start, rows) along every dimension, whole by default
            # (dimensions past a tensor's own are one slice long)
            extent = np.stack([np.where(d < ndims[t], plan.extents(t, np.minimum(d, ndims[t] - 1)), 1)
                               for d in range(width)], axis=1)
            start = np.zeros_like(extent)
            part = np.arange(len(at))
            start[part, s.dims[at]] = s.starts[at]
            extent[part, s.dims[at]] = s.rows[at]
            block = np.searchsorted(at, s.extra_parts)  # the blocks' rows: every such part is of a blocked tensor
            start[block, s.extra_dims] = s.extra_starts
            extent[block, s.extra_dims] = s.extra_rows
            tensors.append(t)
            starts.append(start)
            rows.append(extent)
        t, start, size = np.concatenate(tensors), np.concatenate(starts), np.concatenate(rows)
        bad: list[int] = []
        order = np.lexsort((*(start[:, d] for d in reversed(range(width))), t))
        same = (t[order][1:] == t[order][:-1]) & (start[order][1:] == start[order][:-1]).all(axis=1)
        bad += t[order][1:][same][:1].tolist()
        cells = np.ones(len(plan), dtype=np.int64)
        for d in range(width):
            order = np.lexsort((size[:, d], start[:, d], t))  # the distinct (tensor, start, rows), sorted
            rt, rs, rr = t[order], start[order, d], size[order, d]
            distinct = np.ones(len(rt), dtype=bool)
            distinct[1:] = (rt[1:] != rt[:-1]) | (rs[1:] != rs[:-1]) | (rr[1:] != rr[:-1])
            rt, rs, rr = rt[distinct], rs[distinct], rr[distinct]
            first = np.ones(len(rt), dtype=bool)
            first[1:] = rt[1:] != rt[:-1]
            last = np.ones(len(rt), dtype=bool)
            last[:-1] = first[1:]
            extent = np.where(d < ndims[rt], plan.extents(rt, np.minimum(d, ndims[rt] - 1)), 1)
            wrong = (first & (rs != 0)) | (~first & (rs != np.concatenate(([0], rs[:-1] + rr[:-1])))) \
                | (last & (rs + rr != extent))
            bad += rt[wrong][:1].tolist()
            cells *= np.maximum(np.bincount(rt, minlength=len(plan)), 1)
        counted = np.bincount(t, minlength=len(plan))
        bad += np.flatnonzero(blocky & (counted != cells))[:1].tolist()
        if bad:
            name = plan.names[int(min(bad))]
            raise InvalidArgument(f"the senders' blocks of {name!r} overlap, leave part of it unsent or do not "
                                  "form a grid", metadata={"tensor": name})

    def part_plan(self, sender: int) -> BucketPlan:
        """The layout of ``sender``'s stream: its parts as tensors, the round's bucket size."""
        with self._lock:
            plan = self._part_plans.get(sender)
            if plan is None:
                parts = self.parts_of(sender)
                names, dtypes, shapes = self.plan.names, self.plan.dtypes, self.plan.shapes
                extras = parts.extras()

                def block_shape(shape: tuple[int, ...], cuts) -> tuple[int, ...]:
                    cut = list(shape)
                    for d, _, r in cuts:
                        cut[d] = r
                    return tuple(cut)

                specs = [(names[t], dtypes[t], (*shapes[t][:d], r, *shapes[t][d + 1:]) if shapes[t] else ())
                         for t, r, d in zip(parts.tensors.tolist(), parts.rows.tolist(), parts.dims.tolist(),
                                            strict=True)]
                for i, cuts in extras.items():
                    specs[i] = (specs[i][0], specs[i][1], block_shape(specs[i][2], cuts))
                plan = self._part_plans[sender] = BucketPlan.build(specs, bucket_bytes=self.plan.bucket_bytes)
            return plan

    def part_views(self, sender: int, targets: Sequence[torch.Tensor]) -> PartViews:
        """Where ``sender``'s parts land in the full ``targets`` (plan order): row ranges,
        contiguous when the targets are; a part that is its whole tensor is the tensor.
        Each view is made when a receiver first asks for it, so with 20k parts the
        making is spread over the transfer instead of delaying its start.

        Targets that carry their addresses (``cross_memory.AddressedTensors``: the
        reference engine's parameters, kept while the plan and their storage stay, and
        never changed once made) give part views that carry theirs too, worked out once
        with whole-array arithmetic (a part starts ``start`` rows into its tensor) and
        reused while those same targets come back, so shm's direct reads need no view:
        an engine made 40k views a round at 20k tensors from two ranks, most of its CPU
        in such a round. Owners keeps only the addresses, and the targets only weakly.
        The views a receive does make (gloo's unpacking: 2 us a part, 80 ms a round per
        engine at 20k tensors from two ranks) are kept on the targets object itself
        (``_kept_views``), so they live exactly as long as the targets do: reused while
        the engine hands back the same targets, gone with them when it lets its weights
        go (sleep frees them), never keeping old weights alive."""
        layout = self._layout(sender)
        addresses = getattr(targets, "addresses", None)
        if addresses is None or getattr(targets, "sizes", None) is not self.plan.sizes or _staged(layout):
            return PartViews(layout, targets)
        with self._lock:
            known = self._addresses.get(sender)
        if known is None or known[0]() is not targets:
            parts = self.parts_of(sender)
            rows = self.plan.extents(np.arange(len(self.plan)), np.zeros(len(self.plan), dtype=np.int64))
            row_bytes = self.plan._nbytes // np.maximum(rows, 1)
            at = addresses[parts.tensors].astype(np.int64) + parts.starts * row_bytes[parts.tensors]
            known = (weakref.ref(targets), at.astype(np.uint64))
            with self._lock:
                self._addresses[sender] = known
        return PartViews(layout, targets, addresses=known[1], sizes=self.part_plan(sender).sizes,
                         made=_kept_views(targets, layout))

    def _layout(self, sender: int) -> Layout:
        """``sender``'s parts as Python lists (tensor, start, rows, whole, dim, a block's
        further slices or None), made once."""
        with self._lock:
            layout = self._layouts.get(sender)
            if layout is None:
                parts = self.parts_of(sender)
                total = self.plan.extents(parts.tensors, parts.dims)
                whole = (parts.starts == 0) & (parts.rows == total)
                whole[parts.extra_parts] = False
                extras = parts.extras()
                layout = self._layouts[sender] = (parts.tensors.tolist(), parts.starts.tolist(), parts.rows.tolist(),
                                                  whole.tolist(), parts.dims.tolist(),
                                                  [extras.get(i) for i in range(len(parts.tensors))] if extras else [])
            return layout


# One sender's parts as lists: tensor, start, rows, whole, dim, and each part's further
# slices (a block) or None -- an empty list where no part is a block.
Layout = tuple[list[int], list[int], list[int], list[bool], list[int], list]


def _kept_views(targets, layout: Layout) -> list:
    """The list of part views kept on ``targets`` (an ``AddressedTensors``) for the
    sender whose parts ``layout`` lists, made empty on first use. Keyed by the layout's
    identity, the layout kept beside the list so that the key is never another's."""
    kept = targets.__dict__.setdefault("part_views", {})
    entry = kept.get(id(layout))
    if entry is None or entry[0] is not layout:
        entry = kept[id(layout)] = (layout, [None] * len(layout[0]))
    return entry[1]


def _staged(layout: Layout) -> bool:
    """Whether some part is no contiguous view of its tensor: a slice along a dimension
    other than 0, or a block."""
    return any(layout[4]) or bool(layout[5])


class PartViews(Sequence):
    """One sender's part views of a set of full tensors (see ``Owners.part_views``):
    a sequence whose items are made on first access and kept until ``done``.

    A part that slices a dimension other than 0, or a block, is no contiguous view of
    its tensor: its item is a tensor of its own (``staged``), copied into place by
    ``done``, which the receive calls for each part once its last byte is in.

    ``addresses`` (uint64, one per part) and ``sizes`` (the part plan's byte sizes),
    where the targets carried their addresses: as ``cross_memory.AddressedTensors``
    has them, for ``cross_memory.addresses_for``. ``made``: a list of views kept from
    an earlier round of the same targets (no staged part), filled here and kept."""

    def __init__(self, layout: Layout, targets: Sequence[torch.Tensor], *, addresses: np.ndarray | None = None,
                 sizes: Sequence[int] | None = None, made: list | None = None) -> None:
        self._tensors, self._starts, self._rows, self._whole, self._dims, extras = layout
        self._extras = extras or [None] * len(self._tensors)
        self._targets = targets
        self.staged = _staged(layout)  # some part lands in a tensor of its own first
        if made is not None and self.staged:
            raise ValueError("staged parts are copied into place: their views are not kept")
        self._keep = made is not None
        self._made: list[torch.Tensor | None] = made if made is not None else [None] * len(self._tensors)
        self.addresses, self.sizes = addresses, sizes

    def _place(self, i: int) -> torch.Tensor:
        """Part ``i``'s place in its full tensor: a view, contiguous only for a row range."""
        view = self._targets[self._tensors[i]].narrow(self._dims[i], self._starts[i], self._rows[i])
        for dim, start, rows in self._extras[i] or ():
            view = view.narrow(dim, start, rows)
        return view

    def __len__(self) -> int:
        return len(self._tensors)

    def done(self, i: int) -> None:
        """Part ``i``'s bytes are all in: a staged part is copied into its tensor, and
        the view is let go (kept, it would keep its full tensor alive after the
        engine's loader let that go) -- unless the views are kept on the targets
        themselves (``made``), which live no longer than their tensors."""
        if self._keep:  # views of the targets' own memory, kept with them
            return
        made = self._made[i]
        self._made[i] = None
        if made is not None and (self._dims[i] or self._extras[i]) and not self._whole[i]:
            self._place(i).copy_(made)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self._made[i]
        if view is None:
            target = self._targets[self._tensors[i]]
            dim = self._dims[i]
            if self._whole[i]:
                view = target
            elif dim == 0 and not self._extras[i]:
                view = target.narrow(0, self._starts[i], self._rows[i])
            else:
                view = target.new_empty(self._place(i).shape)
            self._made[i] = view
        return view


# ----- the trainer side: what each rank holds, and who sends what ------------------------------


@dataclass(frozen=True)
class Holding:
    """What one rank holds of one tensor: slices ``[start, start + rows)`` along
    dimension ``dim`` of a tensor of ``shape`` (the full tensor's) -- a block where
    ``extra`` slices later dimensions too, (dim, start, rows) each -- as ``local``
    (contiguous, shaped like the slice)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    rows: int
    local: torch.Tensor
    dim: int = 0
    extra: tuple[tuple[int, int, int], ...] = ()

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.rows == (self.shape[self.dim] if self.shape else 1) and not self.extra


def _slices_of(name: str, shape: tuple[int, ...], placements, sizes, coordinates, shard) -> list[tuple[int, int, int]]:
    """The (dim, start, rows) this rank holds along each tensor dimension a mesh
    dimension shards (dimensions it holds whole left out), as torch places them:
    ``Shard(d)`` over several mesh dimensions chunks the chunk, in mesh order; FSDP2
    over tensor parallel's ``_StridedShard(d, split_factor)`` (followed by the plain
    ``Shard(d)`` of mesh dimensions that together make ``split_factor``) is chunked by
    those later mesh dimensions first, then by its own.

    Raises:
        InvalidArgument: a placement other than Shard, _StridedShard and Replicate
            (Partial()), or a _StridedShard in any other arrangement."""
    cuts: dict[int, list[tuple[int, object]]] = {}
    for mesh_dim, placement in enumerate(placements):
        if type(placement).__name__ == "Replicate":
            continue
        dim = getattr(placement, "dim", -1)
        strided = type(placement).__name__ == "_StridedShard"
        if not (isinstance(placement, shard) or strided) or not shape or not 0 <= dim < len(shape):
            raise InvalidArgument(f"tensor {name!r}: placements {tuple(placements)}; sharded sends support Shard(d) "
                                  "and Replicate() over any mesh dimensions (FSDP2, HSDP, tensor parallel, FSDP2 "
                                  "over tensor parallel; gather other layouts first)", metadata={"tensor": name})
        cuts.setdefault(dim, []).append((mesh_dim, placement))
    slices = []
    for dim in sorted(cuts):
        order = [mesh_dim for mesh_dim, _ in cuts[dim]]
        strided = [i for i, (_, p) in enumerate(cuts[dim]) if type(p).__name__ == "_StridedShard"]
        if strided:
            later = order[1:]
            factor = int(np.prod([sizes[m] for m in later], dtype=np.int64))
            if strided != [0] or not later or factor != getattr(cuts[dim][0][1], "split_factor", None):
                raise InvalidArgument(f"tensor {name!r}: placements {tuple(placements)}; a _StridedShard is supported "
                                      "as FSDP2 over tensor parallel places it (first, with split_factor the size "
                                      "of the mesh dimensions that shard the same tensor dimension after it)",
                                      metadata={"tensor": name})
            order = [*later, order[0]]
        start, rows = 0, shape[dim]
        for mesh_dim in order:  # torch.chunk: equal chunks, the last ones short or empty
            chunk = -(-rows // sizes[mesh_dim])
            offset = min(coordinates[mesh_dim] * chunk, rows)
            start, rows = start + offset, max(0, min(chunk, rows - offset))
        if (start, rows) != (0, shape[dim]):
            slices.append((dim, start, rows))
    return slices


def holding_of(name: str, tensor: torch.Tensor, meshes: dict | None = None) -> Holding:
    """What ``tensor`` (a plain tensor or a DTensor) gives this rank of ``name``.

    ``meshes``: a dict the caller keeps for one pass over a model, so each device mesh
    is asked for its size and this rank's coordinate once, not once per tensor (20k
    tensors share one mesh; asking cost 16 us a tensor).

    Raises:
        InvalidArgument: placements other than Shard(d), FSDP2-over-tensor-parallel's
            _StridedShard and Replicate() (Partial()), or a local shard whose size is
            not the one torch.chunk gives this rank.
    """
    shape = tuple(tensor.shape)
    types = _dtensor_types()
    if types is None or not isinstance(tensor, types[0]):
        return Holding(name, tensor.dtype, shape, 0, shape[0] if shape else 1, tensor.contiguous())
    shard = types[2]
    mesh, placements = tensor.device_mesh, tensor.placements
    known = meshes.get(id(mesh)) if meshes is not None else None
    if known is None:  # each mesh dimension's size, and this rank's coordinate along it
        known = (tuple(mesh.size(d) for d in range(mesh.ndim)),
                 tuple(mesh.get_local_rank(mesh_dim=d) for d in range(mesh.ndim)))
        if meshes is not None:
            meshes[id(mesh)] = known
    sizes, coordinates = known
    # The local shard itself: DTensor keeps it as ``_local_tensor``; ``to_local()``
    # returns a view of it through an autograd function (18 us a tensor). Its shape is
    # checked below either way.
    local = getattr(tensor, "_local_tensor", None)
    import torch  # loaded already: a DTensor is at hand
    if not isinstance(local, torch.Tensor):
        local = tensor.to_local()
    # Mesh dimensions that replicate the tensor (HSDP: Replicate() across the replica
    # groups, Shard(0) within each) leave several ranks the same slice, and ``assign``
    # has one of them send it.
    slices = _slices_of(name, shape, placements, sizes, coordinates, shard)
    want = list(shape)
    for dim, _, rows in slices:
        want[dim] = rows
    if tuple(local.shape) != tuple(want):
        raise InvalidArgument(f"tensor {name!r}: local shard {tuple(local.shape)} is not the torch.chunk shard "
                              f"{tuple(want)} of mesh coordinate {coordinates}", metadata={"tensor": name})
    if not slices:
        return Holding(name, tensor.dtype, shape, 0, shape[0] if shape else 1, local.contiguous())
    (dim, start, rows), *extra = slices
    return Holding(name, tensor.dtype, shape, start, rows, local.contiguous(), dim, tuple(extra))


class HeldReplay:
    """A rank's holdings from its last round, replayed while its model is the same.

    A sharded trainer sends the same parameters every step, updated in place. Working
    out each one's holding (``holding_of``) costs about 5 us per tensor (105 ms a round
    for 20k DTensors), and the 20k new objects a round soon set off a full garbage
    collection of the trainer's heap (0.5 s). ``replay`` is one pass that checks each
    tensor is the same object, over the same local tensor, of the same dtype, shape
    and layout as last round: then last round's holdings, description and signature
    stand unchanged; else the caller works them out again (``remember``).

    It holds last round's tensors (as the holdings' senders do during a round) until
    the next round replaces them or ``forget``: a trainer that replaces its model
    between syncs has the old one's tensors released at its next sync, or at close.
    """

    def __init__(self) -> None:
        # Per tensor: (name, tensor, its local tensor, its DTensor spec or None, dtype, local shape).
        self._seen: list[tuple] | None = None
        self.holdings: dict[str, Holding] = {}
        self.described: dict = {}
        self.signature = ""

    def replay(self, named_tensors) -> bool:
        """Whether ``named_tensors`` are last round's, unchanged (then ``holdings``,
        ``described`` and ``signature`` stand). Never raises for bad input: anything
        unexpected is "not the same", and the full path says what is wrong."""
        try:
            return self.replay_or_read(iter(named_tensors)) is None
        except TypeError:
            return False

    def replay_or_read(self, items: Iterator) -> list | None:
        """None where the pairs ``items`` yields are last round's, unchanged (as
        ``replay``); else every pair, those read before the change included, as a list
        for the caller to work out again. Reads ``items`` as it goes: the pairs a
        generator makes (``model.named_parameters()``, a new tuple per tensor) die one
        by one instead of being kept through the round as 20k new objects."""
        seen = self._seen
        if seen is None:
            return list(items)
        n, read = len(seen), 0
        for i, pair in enumerate(items):
            if i and not i % HAND_OVER_EVERY:
                hand_over_gil()  # a worker thread's pass: the event loop gets in (weightsync.gil)
            if i >= n or not _same_as(pair, seen[i]):
                return [entry[:2] for entry in seen[:i]] + [pair, *items]
            read = i + 1
        return None if read == n else [entry[:2] for entry in seen[:read]]

    def forget(self) -> None:
        """Lets go of every tensor held; the next round works its holdings out again."""
        self._seen, self.holdings, self.described, self.signature = None, {}, {}, ""

    def remember(self, named_tensors, holdings: dict[str, Holding], described: dict, signature: str) -> None:
        """This round's holdings (worked out by ``holding_of``), kept as the ones that
        stand, and for the next round to replay. Only holdings whose local tensor is
        the tensor's own (contiguous, not a copy) can be replayed: a copy made this
        round would be stale the next."""
        self.holdings, self.described, self.signature = holdings, described, signature
        self._seen = None
        seen = []
        for name, tensor in named_tensors:
            held = holdings.get(name)
            spec = getattr(tensor, "_spec", None) if hasattr(tensor, "_local_tensor") else None
            local = tensor if spec is None else tensor._local_tensor
            if held is None or held.local is not local:
                return
            seen.append((name, tensor, local, spec, local.dtype, local.shape))
        self._seen = seen


def _same_as(pair, entry: tuple) -> bool:
    """Whether ``pair`` is the (name, tensor) ``entry`` of ``HeldReplay`` remembered:
    the same name and tensor object, over the same local tensor and layout, of the
    same dtype and shape, still contiguous. Anything unexpected is False."""
    was_name, was, local, spec, dtype, local_shape = entry
    try:
        name, tensor = pair
        if name != was_name or tensor is not was:
            return False
        now = tensor if spec is None else tensor._local_tensor
        return not (now is not local or (spec is not None and tensor._spec is not spec) or now.dtype != dtype
                    or now.shape != local_shape or not now.is_contiguous())
    except (AttributeError, TypeError, ValueError):
        return False


def describe(holdings: Sequence[Holding]) -> dict:
    """A rank's holdings as plain data (JSON): what it tells the rank that plans."""
    from weightsync.dtypes import dtype_name
    described = {"names": [h.name for h in holdings], "dtypes": [dtype_name(h.dtype) for h in holdings],
                 "shapes": [list(h.shape) for h in holdings], "starts": [h.start for h in holdings],
                 "rows": [h.rows for h in holdings]}
    if any(h.dim for h in holdings):
        described["dims"] = [h.dim for h in holdings]
    if any(h.extra for h in holdings):
        described["extra"] = [[list(cut) for cut in h.extra] for h in holdings]
    return described


def assign(described: Sequence[dict], *, bucket_bytes: int,
           wire_dtype: torch.dtype | None = None) -> tuple[BucketPlan, Owners]:
    """The round's plan and owners from every rank's ``describe`` (index = rank).

    Tensors are planned in the order they first appear (rank 0's order, then tensors
    only later ranks hold). A tensor whose shards, over the ranks that hold a shard,
    cover it exactly once (slices of one dimension, or blocks that form a grid) is
    sent shard by shard, each shard several ranks hold (HSDP's replicas) from the one
    that sends the fewest bytes so far; otherwise a rank holding it whole sends it, the
    one that sends the fewest bytes so far (so replicated tensors spread over the ranks).

    Raises:
        InvalidArgument: ranks disagree on a tensor's dtype or shape, or a tensor is
            neither covered by shards nor held whole by any rank.
    """
    from weightsync.dtypes import ITEMSIZE, dtype_from_name, on_wire
    order: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    # name -> [(start, rows, dim, further slices, rank)]
    shards: dict[str, list[tuple[int, int, int, tuple, int]]] = {}
    whole: dict[str, list[int]] = {}
    for rank, d in enumerate(described):
        count = len(d["names"])
        dims = d.get("dims") or [0] * count
        extras = d.get("extra") or [()] * count
        for name, dt, shape, start, rows, dim, extra in zip(d["names"], d["dtypes"], d["shapes"], d["starts"],
                                                            d["rows"], dims, extras, strict=True):
            spec = (dtype_from_name(dt), tuple(shape))
            known = order.setdefault(name, spec)
            if known != spec:
                raise InvalidArgument(f"tensor {name!r}: rank {rank} holds {dt} {list(shape)}, another rank "
                                      f"{known[0]} {list(known[1])}", metadata={"tensor": name})
            extra = tuple(tuple(cut) for cut in extra)
            cut_dims = [dim, *(cut[0] for cut in extra)]
            if any(not 0 <= c < max(len(shape), 1) for c in cut_dims) or cut_dims != sorted(set(cut_dims)):
                raise InvalidArgument(f"tensor {name!r}: rank {rank} holds a slice of dimensions {cut_dims} of a "
                                      f"{len(shape)}-dimensional tensor", metadata={"tensor": name})
            extent = shape[dim] if shape else 1
            if start == 0 and rows == extent and not extra:
                whole.setdefault(name, []).append(rank)
            elif rows > 0 and all(cut[2] > 0 for cut in extra):
                shards.setdefault(name, []).append((start, rows, dim, extra, rank))
    names = list(order)
    dtypes = [on_wire(order[n][0], wire_dtype) for n in names]
    plan = BucketPlan.build(((n, d, order[n][1]) for n, d in zip(names, dtypes, strict=True)),
                            bucket_bytes=bucket_bytes)
    sent = [0] * len(described)
    parts: list[list[tuple[int, int, int, int, tuple]]] = [[] for _ in described]  # per rank: (tensor, start, rows, dim, extra)
    for index, name in enumerate(names):
        shape = order[name][1]
        itemsize = ITEMSIZE[dtypes[index]]
        # The same slice held by several ranks (HSDP's replica groups): one entry,
        # with every rank that holds it.
        holders: dict[tuple[int, int, int, tuple], list[int]] = {}
        for start, rows, dim, extra, rank in shards.get(name, ()):
            holders.setdefault((start, rows, dim, extra), []).append(rank)
        pieces = sorted(holders)
        if pieces and _covers(shape, pieces):
            for piece in pieces:
                start, rows, dim, extra = piece
                rank = min(holders[piece], key=lambda r: (sent[r], r))
                parts[rank].append((index, start, rows, dim, extra))
                block = _block(shape, dim, start, rows, extra)
                sent[rank] += itemsize * int(np.prod([r for _, r in block], dtype=np.int64))
        elif name in whole:
            rank = min(whole[name], key=lambda r: (sent[r], r))
            rows = shape[0] if shape else 1
            parts[rank].append((index, 0, rows, 0, ()))
            sent[rank] += itemsize * (int(np.prod(shape, dtype=np.int64)) if shape else 1)
        else:
            raise InvalidArgument(f"tensor {name!r}: no rank holds it whole and its shards do not cover it",
                                  metadata={"tensor": name})
    senders = []
    for rank, ps in enumerate(parts):
        if not ps:
            continue
        extra = [(i, *cut) for i, p in enumerate(ps) for cut in p[4]]
        senders.append(SenderParts(rank, np.array([p[0] for p in ps], dtype=np.int32),
                                   np.array([p[1] for p in ps], dtype=np.int64),
                                   np.array([p[2] for p in ps], dtype=np.int64),
                                   np.array([p[3] for p in ps], dtype=np.int8),
                                   np.array([e[0] for e in extra], dtype=np.int32),
                                   np.array([e[1] for e in extra], dtype=np.int8),
                                   np.array([e[2] for e in extra], dtype=np.int64),
                                   np.array([e[3] for e in extra], dtype=np.int64)))
    return plan, Owners(plan, senders)


def _covers(shape: tuple[int, ...], pieces: list[tuple[int, int, int, tuple]]) -> bool:
    """Whether ``pieces`` (start, rows, dim, further slices; sorted) cover a tensor of
    ``shape`` exactly once: consecutive slices of one dimension, or blocks that form a
    grid."""
    if any(extra for *_, extra in pieces):
        return _tiles(shape, [_block(shape, dim, start, rows, extra) for start, rows, dim, extra in pieces])
    dim, at = pieces[0][2], 0
    for start, rows, piece_dim, _ in pieces:
        if piece_dim != dim or start != at:
            return False
        at = start + rows
    return at == (shape[dim] if shape else 1)


def sources_for(owners: Owners, sender: int, holdings: dict[str, Holding]) -> list[torch.Tensor]:
    """``sender``'s source tensors, in its part plan's order: its own local tensors
    (a whole tensor it holds is sent whole; a shard as it is). Never a gather. A wire
    dtype is applied as the buckets are packed, as for any plan."""
    parts = owners.parts_of(sender)
    names = owners.plan.names
    extras = parts.extras()
    sources = []
    for i, (t, start, rows, dim) in enumerate(zip(parts.tensors.tolist(), parts.starts.tolist(),
                                                  parts.rows.tolist(), parts.dims.tolist(), strict=True)):
        h = holdings[names[t]]
        local = h.local
        extra = extras.get(i, ())
        if h.whole and (extra or not (start == 0 and rows == (h.shape[dim] if h.shape else 1))):
            # a whole copy asked for a slice (not planned today)
            for d, s, r in ((dim, start, rows), *extra):
                local = local.narrow(d, s, r)
            local = local.contiguous()
        sources.append(local)
    return sources


__all__ = ["Owners", "PartViews", "SenderParts", "Holding", "HeldReplay", "holding_of", "describe", "assign", "sources_for",
           "MAX_SENDERS"]
