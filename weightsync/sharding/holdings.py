"""The trainer side of a sharded sync: what each rank holds of each tensor
(``holding_of``: plain tensors and DTensors), replayed while the model is the same
(``HeldReplay``), and described as plain data for the rank that plans (``describe``)."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import InvalidArgument
from weightsync.gil import HAND_OVER_EVERY, hand_over_gil

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


def slices_held(name: str, shape: tuple[int, ...], placements, sizes, coordinates, shard) -> list[tuple[int, int, int]]:
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
    slices = slices_held(name, shape, placements, sizes, coordinates, shard)
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


def holdings_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Holding]:
    """What this rank holds of every tensor it was given, by name (``holding_of`` each)."""
    import torch  # here, not at the top: the coordinator imports this package without torch

    held: dict[str, Holding] = {}
    meshes: dict = {}
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgument("named_tensors must be (name, torch.Tensor) pairs")
        if name in held:
            raise InvalidArgument(f"tensor {name!r} is listed twice", metadata={"tensor": name})
        held[name] = holding_of(name, tensor, meshes)
    if not held:
        raise InvalidArgument("no tensors to send")
    return held


def description_signature(described: dict) -> str:
    """A short hash of a rank's ``describe``: equal descriptions, equal signatures."""
    return hashlib.blake2b(json.dumps(described, separators=(",", ":")).encode(), digest_size=16).hexdigest()
