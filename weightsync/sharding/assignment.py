"""Who sends what: the round's plan and owners from every rank's holdings
(``assign``), and each rank's source tensors in its part plan's order
(``sources_for``), never a gather."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import InvalidArgument
from weightsync.plan import BucketPlan
from weightsync.sharding.holdings import Holding
from weightsync.sharding.owners import Owners, SenderParts, grid_tiles, part_block

if TYPE_CHECKING:  # the coordinator checks owners without torch; the ranks hold tensors
    import torch


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
                block = part_block(shape, dim, start, rows, extra)
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
        return grid_tiles(shape, [part_block(shape, dim, start, rows, extra) for start, rows, dim, extra in pieces])
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

