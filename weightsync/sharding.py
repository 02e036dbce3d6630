"""Plans with owners: which trainer rank sends which part of each tensor.

A sharded trainer (FSDP2, tensor parallel, or any torch.distributed job whose ranks
hold different pieces of the model) sends from every rank at once, each rank what it
holds; nothing is gathered to one rank first. The round's ``BucketPlan`` still
describes the full tensors the engines hold; ``Owners`` adds, per sending rank, its
*parts*: slices ``[start, start + rows)`` along one dimension of a tensor (``dims``;
dimension 0 -- rows -- unless said otherwise; a whole tensor is all its rows; a
0-dimensional tensor is one "row"). A sender's parts, in its order, are laid out as a
plan of their own (``part_plan``): tensors shaped like the parts, with the round's
bucket size. Each sender streams that plan on its own lane, and an engine receives
every lane into views of its full tensors (``part_views``): a row range of a
contiguous tensor is itself contiguous, so every transport's receiver works on it
unchanged. A slice along another dimension is not: it is received into a tensor of
its own and copied into place once its last byte is in (``PartViews.done``).

The parts of every tensor, over all senders, must cover it exactly once: checked
with whole-array operations (a plan may list 20k tensors), by the coordinator and by
every engine, before anything changes.

What the trainer side can describe (``holding_of``): plain tensors (a full copy),
DTensors placed ``Shard(d)`` over one mesh dimension (FSDP2's default is ``Shard(0)``;
tensor parallel's column- and row-wise layers ``Shard(0)`` and ``Shard(1)``: slices as
``torch.chunk`` makes them) and ``Replicate()`` over any others (HSDP's replica
groups: several ranks hold the same slice, and one of them sends it). A tensor several ranks hold whole
is sent by one of them, chosen to balance the bytes each rank sends.
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
    """One sender's parts, in the order it streams them."""

    sender: int
    tensors: np.ndarray  # int32: index into the plan's tensors
    starts: np.ndarray   # int64: first slice ("row") along the part's dimension
    rows: np.ndarray     # int64: number of slices
    dims: np.ndarray | None = None  # int8: the dimension each part slices; None: all 0

    def __post_init__(self) -> None:
        if self.dims is None:
            object.__setattr__(self, "dims", np.zeros(len(self.tensors), dtype=np.int8))

    def to_proto(self) -> common_pb2.SenderParts:
        return common_pb2.SenderParts(sender=self.sender, tensors=self.tensors.astype("<i4").tobytes(),
                                      starts=self.starts.astype("<i8").tobytes(),
                                      rows=self.rows.astype("<i8").tobytes(),
                                      dims=self.dims.astype(np.int8).tobytes() if self.dims.any() else b"")


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

    @classmethod
    def from_proto(cls, msg: common_pb2.Owners, plan: BucketPlan) -> Owners:
        """The owners a request carries, checked against its plan.

        Rounds replay the same owners: a checked one is remembered by its plan's id
        and its parts' fingerprint, so the next round gets the same object, with the
        part plans it built (and the bucket views those keep) instead of rebuilding
        20k-part plans every round."""
        digest = hashlib.blake2b(plan.plan_id.encode(), digest_size=16)
        for s in msg.senders:
            digest.update(b"%d|%d|%d|%d|%d|" % (s.sender, len(s.tensors), len(s.starts), len(s.rows), len(s.dims)))
            digest.update(s.tensors)
            digest.update(s.starts)
            digest.update(s.rows)
            digest.update(s.dims)
        key = digest.hexdigest()
        with _OWNERS_LOCK:
            known = _OWNERS_BY_KEY.get(key)
            if known is not None:
                _OWNERS_BY_KEY.move_to_end(key)
                return known
        owners = cls._from_proto(msg, plan)
        with _OWNERS_LOCK:
            _OWNERS_BY_KEY[key] = owners
            while len(_OWNERS_BY_KEY) > _OWNERS_KEPT:
                _OWNERS_BY_KEY.popitem(last=False)
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
            senders.append(SenderParts(s.sender, tensors, starts, rows, dims))
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
        tensors = np.concatenate([s.tensors for s in self.senders]).astype(np.int64)
        starts = np.concatenate([s.starts for s in self.senders])
        ends = starts + np.concatenate([s.rows for s in self.senders])
        dims = np.concatenate([s.dims for s in self.senders])
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
        if first.sum() != n:
            covered = np.zeros(n, dtype=bool)
            covered[tensors] = True
            name = self.plan.names[int(np.flatnonzero(~covered)[0])]
            raise InvalidArgument(f"no sender sends {name!r}", metadata={"tensor": name})

    def part_plan(self, sender: int) -> BucketPlan:
        """The layout of ``sender``'s stream: its parts as tensors, the round's bucket size."""
        with self._lock:
            plan = self._part_plans.get(sender)
            if plan is None:
                parts = self.parts_of(sender)
                names, dtypes, shapes = self.plan.names, self.plan.dtypes, self.plan.shapes
                specs = ((names[t], dtypes[t], (*shapes[t][:d], r, *shapes[t][d + 1:]) if shapes[t] else ())
                         for t, r, d in zip(parts.tensors.tolist(), parts.rows.tolist(), parts.dims.tolist(),
                                            strict=True))
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
        in such a round. Only the addresses are kept, and the targets only weakly: views
        kept from round to round would keep an engine's old weights alive after it let
        them go (sleep frees them)."""
        layout = self._layout(sender)
        addresses = getattr(targets, "addresses", None)
        if addresses is None or getattr(targets, "sizes", None) is not self.plan.sizes or any(layout[4]):
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
        return PartViews(layout, targets, addresses=known[1], sizes=self.part_plan(sender).sizes)

    def _layout(self, sender: int) -> tuple[list[int], list[int], list[int], list[bool], list[int]]:
        """``sender``'s parts as Python lists (tensor, start, rows, whole, dim), made once."""
        with self._lock:
            layout = self._layouts.get(sender)
            if layout is None:
                parts = self.parts_of(sender)
                total = self.plan.extents(parts.tensors, parts.dims)
                whole = ((parts.starts == 0) & (parts.rows == total)).tolist()
                layout = self._layouts[sender] = (parts.tensors.tolist(), parts.starts.tolist(), parts.rows.tolist(),
                                                  whole, parts.dims.tolist())
            return layout


class PartViews(Sequence):
    """One sender's part views of a set of full tensors (see ``Owners.part_views``):
    a sequence whose items are made on first access and kept until ``done``.

    A part that slices a dimension other than 0 is no contiguous view of its tensor:
    its item is a tensor of its own (``staged``), copied into place by ``done``, which
    the receive calls for each part once its last byte is in.

    ``addresses`` (uint64, one per part) and ``sizes`` (the part plan's byte sizes),
    where the targets carried their addresses: as ``cross_memory.AddressedTensors``
    has them, for ``cross_memory.addresses_for``."""

    def __init__(self, layout: tuple[list[int], list[int], list[int], list[bool], list[int]],
                 targets: Sequence[torch.Tensor], *, addresses: np.ndarray | None = None,
                 sizes: Sequence[int] | None = None) -> None:
        self._tensors, self._starts, self._rows, self._whole, self._dims = layout
        self._targets = targets
        self._made: list[torch.Tensor | None] = [None] * len(self._tensors)
        self.addresses, self.sizes = addresses, sizes
        self.staged = any(self._dims)  # some part lands in a tensor of its own first

    def __len__(self) -> int:
        return len(self._tensors)

    def done(self, i: int) -> None:
        """Part ``i``'s bytes are all in: a staged part is copied into its tensor, and
        the view is let go (kept, it would keep its full tensor alive after the
        engine's loader let that go)."""
        made = self._made[i]
        self._made[i] = None
        if made is not None and self._dims[i] and not self._whole[i]:
            target = self._targets[self._tensors[i]]
            target.narrow(self._dims[i], self._starts[i], self._rows[i]).copy_(made)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self._made[i]
        if view is None:
            target = self._targets[self._tensors[i]]
            dim = self._dims[i]
            if self._whole[i]:
                view = target
            elif dim == 0:
                view = target.narrow(0, self._starts[i], self._rows[i])
            else:
                shape = list(target.shape)
                shape[dim] = self._rows[i]
                view = target.new_empty(shape)
            self._made[i] = view
        return view


# ----- the trainer side: what each rank holds, and who sends what ------------------------------


@dataclass(frozen=True)
class Holding:
    """What one rank holds of one tensor: slices ``[start, start + rows)`` along
    dimension ``dim`` of a tensor of ``shape`` (the full tensor's), as ``local``
    (contiguous, shaped like the slice)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    rows: int
    local: torch.Tensor
    dim: int = 0

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.rows == (self.shape[self.dim] if self.shape else 1)


def holding_of(name: str, tensor: torch.Tensor, meshes: dict | None = None) -> Holding:
    """What ``tensor`` (a plain tensor or a DTensor) gives this rank of ``name``.

    ``meshes``: a dict the caller keeps for one pass over a model, so each device mesh
    is asked for its size and this rank's coordinate once, not once per tensor (20k
    tensors share one mesh; asking cost 16 us a tensor).

    Raises:
        InvalidArgument: placements other than one Shard(d) and any Replicate() (a
            tensor sliced over two mesh dimensions, Partial()), or a local shard whose
            size is not the one torch.chunk gives this rank.
    """
    shape = tuple(tensor.shape)
    types = _dtensor_types()
    if types is None or not isinstance(tensor, types[0]):
        return Holding(name, tensor.dtype, shape, 0, shape[0] if shape else 1, tensor.contiguous())
    _, replicate, shard = types
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
    # At most one mesh dimension shards the tensor; along the others it is replicated
    # (HSDP: Replicate() across the replica groups, Shard(0) within each). Several
    # ranks then hold the same slice, and ``assign`` has one of them send it.
    sharding = [(i, p) for i, p in enumerate(placements) if not isinstance(p, replicate)]
    if not sharding:
        return Holding(name, tensor.dtype, shape, 0, shape[0] if shape else 1, local.contiguous())
    mesh_dim, placement = sharding[0]
    dim = getattr(placement, "dim", -1)
    if (len(sharding) > 1 or not isinstance(placement, shard) or not shape or not 0 <= dim < len(shape)):
        raise InvalidArgument(f"tensor {name!r}: placements {tuple(placements)}; sharded sends support one "
                              "Shard(d) over one mesh dimension, Replicate() over the others (FSDP2, HSDP, tensor "
                              "parallel; gather other layouts first)", metadata={"tensor": name})
    size, coordinate = sizes[mesh_dim], coordinates[mesh_dim]
    extent = shape[dim]
    chunk = -(-extent // size)  # torch.chunk: equal chunks, the last ones short or empty
    start = min(coordinate * chunk, extent)
    rows = max(0, min(chunk, extent - start))
    want = (*shape[:dim], rows, *shape[dim + 1:])
    if tuple(local.shape) != want:
        raise InvalidArgument(f"tensor {name!r}: local shard {tuple(local.shape)} is not the torch.chunk shard "
                              f"{want} of mesh coordinate {coordinate}", metadata={"tensor": name})
    return Holding(name, tensor.dtype, shape, start, rows, local.contiguous(), dim)


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
    return described


def assign(described: Sequence[dict], *, bucket_bytes: int,
           wire_dtype: torch.dtype | None = None) -> tuple[BucketPlan, Owners]:
    """The round's plan and owners from every rank's ``describe`` (index = rank).

    Tensors are planned in the order they first appear (rank 0's order, then tensors
    only later ranks hold). A tensor whose shards, over the ranks that hold a shard,
    slice one dimension and cover it is sent shard by shard, each shard several ranks
    hold (HSDP's replicas) from the one that sends the fewest bytes so far; otherwise a rank holding it whole sends it,
    the one that sends the fewest bytes so far (so replicated tensors spread over
    the ranks).

    Raises:
        InvalidArgument: ranks disagree on a tensor's dtype or shape, or a tensor is
            neither covered by shards nor held whole by any rank.
    """
    from weightsync.dtypes import ITEMSIZE, dtype_from_name, on_wire
    order: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    shards: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> [(start, rows, rank, dim)]
    whole: dict[str, list[int]] = {}
    for rank, d in enumerate(described):
        dims = d.get("dims") or [0] * len(d["names"])
        for name, dt, shape, start, rows, dim in zip(d["names"], d["dtypes"], d["shapes"], d["starts"], d["rows"],
                                                     dims, strict=True):
            spec = (dtype_from_name(dt), tuple(shape))
            known = order.setdefault(name, spec)
            if known != spec:
                raise InvalidArgument(f"tensor {name!r}: rank {rank} holds {dt} {list(shape)}, another rank "
                                      f"{known[0]} {list(known[1])}", metadata={"tensor": name})
            if not 0 <= dim < max(len(shape), 1):
                raise InvalidArgument(f"tensor {name!r}: rank {rank} holds a slice of dimension {dim} of a "
                                      f"{len(shape)}-dimensional tensor", metadata={"tensor": name})
            extent = shape[dim] if shape else 1
            if start == 0 and rows == extent:
                whole.setdefault(name, []).append(rank)
            elif rows > 0:
                shards.setdefault(name, []).append((start, rows, rank, dim))
    names = list(order)
    dtypes = [on_wire(order[n][0], wire_dtype) for n in names]
    plan = BucketPlan.build(((n, d, order[n][1]) for n, d in zip(names, dtypes, strict=True)),
                            bucket_bytes=bucket_bytes)
    sent = [0] * len(described)
    parts: list[list[tuple[int, int, int, int]]] = [[] for _ in described]  # per rank: (tensor, start, rows, dim)
    for index, name in enumerate(names):
        shape = order[name][1]
        # The same slice held by several ranks (HSDP's replica groups): one entry,
        # with every rank that holds it.
        holders: dict[tuple[int, int, int], list[int]] = {}
        for start, rows, rank, dim in shards.get(name, ()):
            holders.setdefault((start, rows, dim), []).append(rank)
        pieces = sorted(holders)
        dim = pieces[0][2] if pieces else 0
        covered, at = all(p[2] == dim for p in pieces), 0
        for start, rows, _ in pieces:
            covered &= start == at
            at = start + rows
        # bytes of one slice along ``dim``: the tensor's bytes over its extent there
        slice_bytes = ITEMSIZE[dtypes[index]] * (int(np.prod(shape, dtype=np.int64)) // max(shape[dim], 1)
                                                 if shape else 1)
        if pieces and covered and at == shape[dim]:
            for start, rows, _ in pieces:
                rank = min(holders[(start, rows, dim)], key=lambda r: (sent[r], r))
                parts[rank].append((index, start, rows, dim))
                sent[rank] += rows * slice_bytes
        elif name in whole:
            rank = min(whole[name], key=lambda r: (sent[r], r))
            rows = shape[0] if shape else 1
            parts[rank].append((index, 0, rows, 0))
            sent[rank] += ITEMSIZE[dtypes[index]] * (int(np.prod(shape, dtype=np.int64)) if shape else 1)
        else:
            raise InvalidArgument(f"tensor {name!r}: no rank holds it whole and its shards do not cover it",
                                  metadata={"tensor": name})
    senders = [SenderParts(rank, np.array([p[0] for p in ps], dtype=np.int32),
                           np.array([p[1] for p in ps], dtype=np.int64), np.array([p[2] for p in ps], dtype=np.int64),
                           np.array([p[3] for p in ps], dtype=np.int8))
               for rank, ps in enumerate(parts) if ps]
    return plan, Owners(plan, senders)


def sources_for(owners: Owners, sender: int, holdings: dict[str, Holding]) -> list[torch.Tensor]:
    """``sender``'s source tensors, in its part plan's order: its own local tensors
    (a whole tensor it holds is sent whole; a shard as it is). Never a gather. A wire
    dtype is applied as the buckets are packed, as for any plan."""
    parts = owners.parts_of(sender)
    names = owners.plan.names
    sources = []
    for t, start, rows, dim in zip(parts.tensors.tolist(), parts.starts.tolist(), parts.rows.tolist(),
                                   parts.dims.tolist(), strict=True):
        h = holdings[names[t]]
        local = h.local
        if h.whole and not (start == 0 and rows == (h.shape[dim] if h.shape else 1)):
            # a whole copy asked for a slice (not planned today)
            local = local.narrow(dim, start, rows).contiguous()
        sources.append(local)
    return sources


__all__ = ["Owners", "PartViews", "SenderParts", "Holding", "HeldReplay", "holding_of", "describe", "assign", "sources_for",
           "MAX_SENDERS"]
