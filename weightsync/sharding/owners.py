"""Owners: which sender sends which parts (row ranges, blocks) of a plan's tensors,
their wire form, and the checks that the parts cover every tensor exactly once
(whole-array operations: a plan may list 20k tensors). See ``weightsync.sharding``."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import InvalidArgument
from weightsync.plan import BucketPlan
from weightsync.sharding.part_views import PartLayout, PartViews, has_staged_parts, kept_views
from weightsync.v1 import common_pb2

if TYPE_CHECKING:  # the coordinator checks owners without torch; the ranks hold tensors
    import torch


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


def grid_tiles(shape: Sequence[int], blocks: Sequence[tuple[tuple[int, int], ...]]) -> bool:
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


def part_block(shape: Sequence[int], dim: int, start: int, rows: int,
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
        tile it as a grid (as ``grid_tiles`` says, with whole-array operations: an MoE
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
        (``kept_views``), so they live exactly as long as the targets do: reused while
        the engine hands back the same targets, gone with them when it lets its weights
        go (sleep frees them), never keeping old weights alive."""
        layout = self._layout(sender)
        addresses = getattr(targets, "addresses", None)
        if addresses is None or getattr(targets, "sizes", None) is not self.plan.sizes or has_staged_parts(layout):
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
                         made=kept_views(targets, layout))

    def _layout(self, sender: int) -> PartLayout:
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
                layout = self._layouts[sender] = PartLayout(
                    parts.tensors.tolist(), parts.starts.tolist(), parts.rows.tolist(), whole.tolist(),
                    parts.dims.tolist(), [extras.get(i) for i in range(len(parts.tensors))] if extras else [])
            return layout

