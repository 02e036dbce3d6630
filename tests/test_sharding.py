"""Plans with owners (weightsync/sharding.py) and receiving from several senders at once
(weightsync/transport/from_senders.py): in one process, real gloo/shm groups and a real
store; the processes-and-FSDP2 path is tests/test_sharded_trainer.py."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.gc_watch import collections_during
from weightsync import transport as transports
from weightsync.errors import InvalidArgument, TransferError
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan
from weightsync.sharding import (
    HeldReplay,
    Holding,
    Owners,
    SenderParts,
    assign,
    describe,
    sources_for,
)
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses
from weightsync.transport.from_senders import SenderLane, part_targets, receive_from_senders
from weightsync.transport.store import host_store, session_key
from weightsync.v1 import common_pb2

FULL = {"emb": torch.randn(10, 4), "w": torch.randn(7, 3), "b": torch.randn(7), "scale": torch.tensor(2.5),
        "steps": torch.arange(5, dtype=torch.int64)}


def chunk_slices(world: int, named, dim_of=lambda tensor: 0) -> list[list[Holding]]:
    """What ``world`` ranks hold when every tensor of ``named`` is sliced as torch.chunk
    slices it, along ``dim_of(tensor)``, and a 0-dimensional one is held whole by all."""
    ranks: list[list[Holding]] = [[] for _ in range(world)]
    for name, full in named:
        if full.dim() == 0:
            for r in range(world):
                ranks[r].append(Holding(name, full.dtype, (), 0, 1, full))
            continue
        dim = dim_of(full)
        chunk = -(-full.shape[dim] // world)
        for r in range(world):
            start = min(r * chunk, full.shape[dim])
            rows = max(0, min(chunk, full.shape[dim] - start))
            ranks[r].append(Holding(name, full.dtype, tuple(full.shape), start, rows,
                                    full.narrow(dim, start, rows).contiguous(), dim))
    return ranks


def _chunk(extent: int, ways: int, coordinate: int) -> tuple[int, int]:
    """The (start, rows) torch.chunk gives ``coordinate`` of ``ways`` chunks of ``extent``."""
    chunk = -(-extent // ways)
    start = min(coordinate * chunk, extent)
    return start, max(0, min(chunk, extent - start))


def grid_slices(row_ways: int, column_ways: int, named) -> list[list[Holding]]:
    """What a ``row_ways`` x ``column_ways`` mesh gives its ranks (rank = a *
    column_ways + b) when, as FSDP2 over tensor parallel does for row-wise layers,
    every tensor with two dimensions or more is cut into blocks: rows chunked by ``a``,
    columns by ``b``; a 1-dimensional one has rows chunked by ``a`` (the ranks that
    share ``a`` hold the same slice); a 0-dimensional one is held whole by all."""
    ranks: list[list[Holding]] = [[] for _ in range(row_ways * column_ways)]
    for name, full in named:
        for r in range(len(ranks)):
            a, b = divmod(r, column_ways)
            cuts = [(0, *_chunk(full.shape[0], row_ways, a))] if full.dim() else []
            if full.dim() >= 2:
                cuts.append((1, *_chunk(full.shape[1], column_ways, b)))
            cuts = [c for c in cuts if (c[1], c[2]) != (0, full.shape[c[0]])]
            local = full
            for dim, start, rows in cuts:
                local = local.narrow(dim, start, rows)
            if not cuts:
                ranks[r].append(Holding(name, full.dtype, tuple(full.shape), 0, full.shape[0] if full.dim() else 1,
                                        full))
            else:
                (dim, start, rows), *extra = cuts
                ranks[r].append(Holding(name, full.dtype, tuple(full.shape), start, rows, local.contiguous(), dim,
                                        tuple(extra)))
    return ranks


def chunk_holdings(world: int, *, columns: bool = False) -> list[list[Holding]]:
    """What FSDP2 gives each of ``world`` ranks of ``FULL``: torch.chunk row ranges of
    every tensor with rows, and a whole copy of the 0-dimensional one. ``columns``:
    what tensor parallel's row-wise layers give instead, column ranges (Shard(1)) of
    every tensor with two dimensions or more."""
    return chunk_slices(world, FULL.items(), lambda t: 1 if columns and t.dim() >= 2 else 0)


def parts(sender, tensors, starts, rows, dims=None):
    return SenderParts(sender, np.array(tensors, dtype=np.int32), np.array(starts, dtype=np.int64),
                       np.array(rows, dtype=np.int64), None if dims is None else np.array(dims, dtype=np.int8))


def test_assign_sends_shards_from_their_ranks_and_spreads_whole_tensors():
    holdings = chunk_holdings(3)
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    assert list(plan.names) == list(FULL)
    assert [tuple(s) for s in plan.shapes] == [tuple(t.shape) for t in FULL.values()]
    # every rank with rows sends its own rows; the scalar goes to one rank only
    w = plan.names.index("w")
    for r, held in enumerate(holdings):
        mine = owners.parts_of(r)
        row = list(mine.tensors).index(w)
        assert (int(mine.starts[row]), int(mine.rows[row])) == (held[1].start, held[1].rows)
    scalar_senders = [r for r in owners.sender_ranks if plan.names.index("scale") in owners.parts_of(r).tensors]
    assert len(scalar_senders) == 1
    # the parts, put back where part_views says, are the full tensors
    targets = [torch.zeros(t.shape, dtype=t.dtype) for t in FULL.values()]
    for r in owners.sender_ranks:
        by_name = {h.name: h for h in holdings[r]}
        for view, src in zip(owners.part_views(r, targets), sources_for(owners, r, by_name), strict=True):
            assert view.is_contiguous()
            view.copy_(src)
    assert weights_digest(zip(plan.names, targets, strict=True)) == weights_digest(FULL.items())


def test_replicated_tensors_are_balanced_over_the_ranks():
    tensors = {f"t{i}": torch.randn(8, 8) for i in range(8)}
    whole = [Holding(n, t.dtype, tuple(t.shape), 0, 8, t) for n, t in tensors.items()]
    _, owners = assign([describe(whole) for _ in range(4)], bucket_bytes=1024)
    assert sorted(len(owners.parts_of(r).tensors) for r in range(4)) == [2, 2, 2, 2]


def test_a_shard_several_ranks_hold_is_sent_once_by_one_of_them():
    """HSDP: replica groups {0, 1} and {2, 3} each shard every tensor over two ranks, so
    ranks 0 and 2 hold the same first half, 1 and 3 the second. Each half is sent once;
    across the tensors the replicas take turns, so all four ranks send."""
    halves = chunk_holdings(2)
    holdings = [halves[0], halves[1], halves[0], halves[1]]
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    counts = np.zeros(len(plan), dtype=int)
    for s in owners.senders:
        np.add.at(counts, s.tensors, 1)
    scalar = plan.names.index("scale")
    assert counts[scalar] == 1 and all(c == 2 for i, c in enumerate(counts) if i != scalar), counts
    assert sorted(owners.sender_ranks) == [0, 1, 2, 3]


def test_assign_refuses_disagreeing_ranks_and_uncovered_tensors():
    a = [Holding("w", torch.float32, (4, 2), 0, 2, torch.zeros(2, 2))]
    b = [Holding("w", torch.float32, (4, 3), 2, 2, torch.zeros(2, 3))]
    with pytest.raises(InvalidArgument, match="rank 1 holds"):
        assign([describe(a), describe(b)], bucket_bytes=64)
    c = [Holding("w", torch.float32, (4, 2), 3, 1, torch.zeros(1, 2))]
    with pytest.raises(InvalidArgument, match="shards do not cover"):
        assign([describe(a), describe(c)], bucket_bytes=64)


@pytest.mark.parametrize("bad, message", [
    ([parts(0, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [10, 7, 7, 1, 5]), parts(1, [0], [9], [1])], "overlap"),
    ([parts(0, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [9, 7, 7, 1, 5])], "overlap or leave rows unsent"),
    ([parts(0, [0, 1, 2, 3], [0, 0, 0, 0], [10, 7, 7, 1])], "no sender sends 'steps'"),
    ([parts(0, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [10, 7, 7, 1, 6])], "outside the tensor"),
    ([parts(0, [0, 1, 2, 3, 9], [0, 0, 0, 0, 0], [10, 7, 7, 1, 5])], "outside the plan"),
    ([parts(0, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [10, 7, 7, 2, 5])], "outside the tensor"),
    ([parts(0, [0, 0], [0, 5], [5, 5])], "lists a tensor twice"),
    ([parts(0, [0], [0], [0])], "no rows"),
    ([parts(0, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [10, 7, 7, 1, 5]), parts(0, [0], [0], [1])], "sender twice"),
    # slices along other dimensions (tensor parallel): one dimension per tensor, within it
    ([parts(0, [0, 1, 2, 3, 4], [0] * 5, [2, 7, 7, 1, 5], [1, 0, 0, 0, 0]), parts(1, [0], [2], [8], [0])],
     "slice different dimensions"),
    ([parts(0, [0, 1, 2, 3, 4], [0] * 5, [10, 7, 7, 1, 5], [0, 0, 1, 0, 0])], "dimension 1 of a 1-dimensional"),
    ([parts(0, [0, 1, 2, 3, 4], [0] * 5, [10, 7, 7, 1, 5], [0, 0, 0, 1, 0])], "dimension 1 of a 0-dimensional"),
    ([parts(0, [0, 1, 2, 3, 4], [0] * 5, [5, 7, 7, 1, 5], [1, 0, 0, 0, 0])], "outside the tensor"),
    ([parts(0, [0, 1, 2, 3, 4], [0] * 5, [2, 7, 7, 1, 5], [1, 0, 0, 0, 0]), parts(1, [0], [3], [1], [1])],
     "overlap or leave rows unsent"),
])
def test_owners_that_do_not_cover_every_tensor_once_are_refused(bad, message):
    plan = BucketPlan.from_tensors(FULL.items(), bucket_bytes=64)
    with pytest.raises(InvalidArgument, match=message):
        Owners(plan, bad)


def test_column_slices_make_part_plans_shaped_like_them_and_travel_in_the_owners():
    plan = BucketPlan.from_tensors(FULL.items(), bucket_bytes=64)
    owners = Owners(plan, [parts(0, [0, 1, 2, 3, 4], [0] * 5, [3, 7, 7, 1, 5], [1, 0, 0, 0, 0]),
                           parts(1, [0], [3], [1], [1])])
    assert owners.part_plan(0).shapes[0] == (10, 3) and owners.part_plan(1).shapes == ((10, 1),)
    again = Owners.from_proto(owners.to_proto(), plan)
    assert again.parts_of(1).dims.tolist() == [1] and again.part_plan(1).plan_id == owners.part_plan(1).plan_id
    # rows only: no dims on the wire (what an older peer sends and reads)
    rows_only = Owners(plan, [parts(0, [0, 1, 2, 3, 4], [0] * 5, [10, 7, 7, 1, 5])])
    assert rows_only.to_proto().senders[0].dims == b""
    msg = owners.to_proto()
    msg.senders[1].dims = b"\x01\x01"
    with pytest.raises(InvalidArgument, match="differ in length"):
        Owners.from_proto(msg, plan)


def blocks(sender, tensors, starts, rows, dims, extra):
    """``parts`` with further slices: ``extra`` lists (part, dim, start, rows)."""
    columns = [np.array([e[i] for e in extra], dtype=t) for i, t in enumerate((np.int32, np.int8, np.int64, np.int64))]
    return SenderParts(sender, np.array(tensors, dtype=np.int32), np.array(starts, dtype=np.int64),
                       np.array(rows, dtype=np.int64), np.array(dims, dtype=np.int8), *columns)


# FULL's "w" (7x3) as four blocks: rows 0..4 and 4..7, columns 0..2 and 2..3; sender 0
# sends every other tensor whole.
REST = ([0, 2, 3, 4], [0] * 4, [10, 7, 1, 5], [0] * 4)


def w_blocks(row_cuts=((0, 4), (4, 3)), column_cuts=((0, 2), (2, 1))):
    senders = [blocks(0, [*REST[0], 1], [*REST[1], row_cuts[0][0]], [*REST[2], row_cuts[0][1]], [*REST[3], 0],
                      [(4, 1, *column_cuts[0])])]
    pairs = [(r, c) for r in row_cuts for c in column_cuts][1:]
    senders += [blocks(i + 1, [1], [r[0]], [r[1]], [0], [(0, 1, *c)]) for i, (r, c) in enumerate(pairs)]
    return senders


@pytest.mark.parametrize("bad, message", [
    # a block sent twice: two senders, the same cell
    (w_blocks()[:3] + [blocks(3, [1], [0], [4], [0], [(0, 1, 0, 2)])], "overlap, leave part of it unsent"),
    # a cell no one sends
    (w_blocks()[:3], "overlap, leave part of it unsent"),
    # not a grid: the row bands cut the columns differently
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 4], [*REST[3], 0], [(4, 1, 0, 2)]),
      blocks(1, [1], [0], [4], [0], [(0, 1, 2, 1)]), blocks(2, [1], [4], [3], [0], [(0, 1, 0, 1)]),
      blocks(3, [1], [4], [3], [0], [(0, 1, 1, 2)])], "do not form a grid"),
    # a further slice along the part's own dimension, or before it
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 7], [*REST[3], 0], [(4, 0, 0, 7)])], "out of order"),
    # beyond the tensor's dimensions, or outside its extent
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 7], [*REST[3], 0], [(4, 2, 0, 1)])], "beyond the tensor"),
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 7], [*REST[3], 0], [(4, 1, 2, 2)])], "outside the tensor"),
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 7], [*REST[3], 0], [(4, 1, 0, 0)])], "is empty"),
    ([blocks(0, [*REST[0], 1], [*REST[1], 0], [*REST[2], 7], [*REST[3], 0], [(5, 1, 0, 3)])], "part outside its 5"),
])
def test_blocks_that_do_not_tile_their_tensor_as_a_grid_are_refused(bad, message):
    plan = BucketPlan.from_tensors(FULL.items(), bucket_bytes=64)
    with pytest.raises(InvalidArgument, match=message):
        Owners(plan, bad)


def _cuts(extent: int, pieces: int, rng) -> list[tuple[int, int]]:
    edges = sorted(rng.sample(range(1, extent), pieces - 1)) if pieces > 1 else []
    bounds = [0, *edges, extent]
    return [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_the_grid_check_agrees_with_a_block_by_block_one_on_random_layouts():
    """Owners' whole-array grid check against ``grid_tiles`` (the plain statement of what a
    grid tiling is) on random grids of 2-3 dimensional tensors, one block per sender,
    before and after one block is moved, resized or dropped."""
    import random

    from weightsync.sharding import grid_tiles
    rng = random.Random(7)
    agreed = {True: 0, False: 0}
    for _ in range(300):
        shape = tuple(rng.randint(2, 7) for _ in range(rng.choice((2, 3))))
        grid = [_cuts(n, rng.randint(1, min(n, 3)), rng) for n in shape]
        cells = [tuple(c) for c in np.ndindex(*(len(g) for g in grid))]
        if len(cells) < 2:
            continue
        blocks = [[grid[d][c[d]] for d in range(len(shape))] for c in cells]
        change = rng.choice(("none", "drop", "move", "resize"))
        if change == "drop":
            blocks.pop(rng.randrange(len(blocks)))
        elif change in ("move", "resize"):
            block = blocks[rng.randrange(len(blocks))]
            d = rng.randrange(len(shape))
            start, rows = block[d]
            if change == "move":
                start = rng.randint(0, shape[d] - rows)
            else:
                rows = rng.randint(1, shape[d] - start)
            block[d] = (start, rows)
        plan = BucketPlan.from_tensors([("x", torch.zeros(shape)), ("y", torch.zeros(3))], bucket_bytes=64)
        senders = [blocks_of(r, b) for r, b in enumerate(blocks)]
        senders[0] = blocks_of(0, blocks[0], and_y=True)
        expected = grid_tiles(shape, [tuple(b) for b in blocks])
        try:
            Owners(plan, senders)
            accepted = True
        except InvalidArgument as exc:
            assert "'x'" in str(exc), exc
            accepted = False
        assert accepted == expected, (shape, blocks)
        agreed[expected] += 1
    assert min(agreed.values()) > 50, agreed  # both outcomes were tried often


def blocks_of(sender: int, block, and_y: bool = False) -> SenderParts:
    """One sender's part of tensor 0 as ``block`` ((start, rows) per dimension; the
    whole first dimension is sliced as the part's own), and tensor 1 whole if asked."""
    extra = [(0, d, s, r) for d, (s, r) in enumerate(block) if d > 0]
    start, rows = block[0]
    if and_y:
        return blocks(sender, [0, 1], [start, 0], [rows, 3], [0, 0], extra)
    return blocks(sender, [0], [start], [rows], [0], extra)


def test_blocks_make_part_plans_shaped_like_them_and_travel_in_the_owners():
    plan = BucketPlan.from_tensors(FULL.items(), bucket_bytes=64)
    owners = Owners(plan, w_blocks())
    assert owners.part_plan(0).shapes[-1] == (4, 2) and owners.part_plan(3).shapes == ((3, 1),)
    again = Owners.from_proto(owners.to_proto(), plan)
    assert again.parts_of(2).extras() == {0: ((1, 0, 2),)}
    assert again.part_plan(3).plan_id == owners.part_plan(3).plan_id
    msg = owners.to_proto()
    msg.senders[1].extra_rows = b""
    with pytest.raises(InvalidArgument, match="block columns differ in length"):
        Owners.from_proto(msg, plan)
    msg = owners.to_proto()
    msg.senders[1].extra_parts = b"\x00\x00"
    with pytest.raises(InvalidArgument, match="whole int32/int64"):
        Owners.from_proto(msg, plan)


def test_assign_sends_each_block_once_and_each_replicated_slice_from_one_rank():
    """A 2x2 mesh's blocks: every block from the rank that holds it; the row ranges of
    1-dimensional tensors, which two ranks hold each, from one of them; the bytes
    spread so no rank sends much more than another."""
    holdings = grid_slices(2, 2, FULL.items())
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    w = plan.names.index("w")
    for r in range(4):
        held = {h.name: h for h in holdings[r]}
        mine = owners.parts_of(r)
        extras = mine.extras()
        i = mine.tensors.tolist().index(w)
        assert (int(mine.starts[i]), int(mine.rows[i]), extras[i]) == (held["w"].start, held["w"].rows,
                                                                        held["w"].extra)
        # each source is the rank's own local block, not a copy cut from something else
        assert sources_for(owners, r, held)[i] is held["w"].local
    b = plan.names.index("b")
    assert sorted(int(owners.parts_of(r).starts[owners.parts_of(r).tensors.tolist().index(b)])
                  for r in range(4) if b in owners.parts_of(r).tensors.tolist()) == [0, 4]
    sent = [owners.part_plan(r).total_bytes for r in range(4)]
    assert max(sent) - min(sent) <= 8 * 10, sent


def test_tensors_only_one_rank_holds_are_planned_and_sent_by_that_rank():
    """Expert parallelism: each rank holds the shared tensors and its own experts, whole.
    The plan lists every tensor (rank 0's in its order, then those only later ranks
    hold); each expert is sent by its holder, each shared tensor by one rank."""
    shared = [("embed", torch.randn(10, 4)), ("head", torch.randn(4, 10))]
    experts = [(f"experts.{e}.w", torch.randn(6, 4)) for e in range(6)]
    holdings = [[Holding(n, t.dtype, tuple(t.shape), 0, t.shape[0], t)
                 for n, t in shared + [x for e, x in enumerate(experts) if e % 3 == r]] for r in range(3)]
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    assert list(plan.names) == ["embed", "head", "experts.0.w", "experts.3.w", "experts.1.w", "experts.4.w",
                                "experts.2.w", "experts.5.w"]
    for e in range(6):
        senders = [r for r in owners.sender_ranks
                   if plan.names.index(f"experts.{e}.w") in owners.parts_of(r).tensors.tolist()]
        assert senders == [e % 3], (e, senders)
    shared_senders = [r for r in owners.sender_ranks for t in owners.parts_of(r).tensors.tolist() if t < 2]
    assert len(shared_senders) == 2  # each shared tensor once


def test_ranks_whose_block_of_a_small_tensor_is_empty_send_nothing_of_it():
    """A tensor with fewer rows than the mesh has row chunks (torch.chunk leaves the
    last chunks empty): the ranks whose block is empty send none of it, and the others'
    blocks cover it."""
    tiny = [("tiny", torch.arange(6.0).reshape(1, 6)), ("pair", torch.arange(8.0).reshape(2, 4))]
    holdings = grid_slices(3, 2, tiny)
    assert [h.rows for h in holdings[4]] == [0, 0]  # row chunk 2 of 3: empty for both
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    senders = {r: owners.parts_of(r).tensors.tolist() for r in owners.sender_ranks}
    assert 4 not in senders and 5 not in senders and sorted(senders) == [0, 1, 2, 3], senders
    targets = [torch.zeros(s) for s in plan.shapes]
    for r in owners.sender_ranks:
        views = owners.part_views(r, targets)
        for i, source in enumerate(sources_for(owners, r, {h.name: h for h in holdings[r]})):
            views[i].copy_(source)
            views.done(i)
    assert all(torch.equal(t, dict(tiny)[n]) for n, t in zip(plan.names, targets, strict=True))


@pytest.mark.parametrize("layout", ["rows", "columns", "blocks"])
def test_the_parts_digest_the_senders_combine_is_the_engines_of_the_same_slices(layout):
    """``verify_digest`` for a sharded trainer (weightsync/parts_digest.py): the hashes
    each rank makes of what it holds, combined by rank 0, equal what an engine hashes
    of the same slices of the full tensors; two elements of different parts swapped
    (bytes that landed in another part's place), one stale element, or a tensor of
    another dtype changes the engine's."""
    from weightsync.parts_digest import combine, holding_hashes, parts_digest, sender_hashes
    holdings = (grid_slices(2, 2, FULL.items()) if layout == "blocks"
                else chunk_holdings(3, columns=layout == "columns"))
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    trainer = combine(plan, owners, {r: sender_hashes(owners, r, holding_hashes(holdings[r]))
                                     for r in owners.sender_ranks})
    engine = {n: t.clone() for n, t in FULL.items()}
    assert parts_digest(plan, owners, engine.items()) == trainer
    swapped = dict(engine, w=engine["w"].clone())
    swapped["w"][0, 0], swapped["w"][6, 2] = engine["w"][6, 2], engine["w"][0, 0]
    stale = dict(engine, emb=engine["emb"].clone())
    stale["emb"][9, 3] += 1
    wider = dict(engine, w=engine["w"].double())
    for changed in (swapped, stale, wider):
        assert parts_digest(plan, owners, changed.items()) != trainer
    # a wire dtype: each rank hashes what it sends (bfloat16), the engine what it holds
    plan16, owners16 = assign([describe(h) for h in holdings], bucket_bytes=64, wire_dtype=torch.bfloat16)
    sent16 = combine(plan16, owners16, {r: sender_hashes(owners16, r, holding_hashes(holdings[r], torch.bfloat16))
                                        for r in owners16.sender_ranks})
    held16 = [(n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in FULL.items()]
    assert parts_digest(plan16, owners16, held16) == sent16 != trainer
    with pytest.raises(InvalidArgument, match="gave no hash of a tensor it sends"):
        sender_hashes(owners, owners.sender_ranks[0], {})
    with pytest.raises(InvalidArgument, match="hashed 0 parts"):
        combine(plan, owners, {r: [] for r in owners.sender_ranks})


def test_owners_round_trip_and_malformed_columns():
    plan, owners = assign([describe(h) for h in chunk_holdings(2)], bucket_bytes=64)
    again = Owners.from_proto(owners.to_proto(), plan)
    assert again.sender_ranks == owners.sender_ranks
    assert again.part_plan(1).plan_id == owners.part_plan(1).plan_id
    msg = owners.to_proto()
    msg.senders[0].starts = msg.senders[0].starts[:-8]
    with pytest.raises(InvalidArgument, match="differ in length"):
        Owners.from_proto(msg, plan)
    msg = owners.to_proto()
    msg.senders[0].rows = b"\x01\x02\x03"
    with pytest.raises(InvalidArgument, match="whole int32/int64"):
        Owners.from_proto(msg, plan)


def _lanes(kind, store, owners, receivers_per_sender, group):
    session = uuid.uuid4().hex
    return [common_pb2.Rendezvous(group_id=f"{group}-{s}", transport=kind, store_host="127.0.0.1",
                                  store_port=store.port, world_size=1 + receivers_per_sender,
                                  session_id=f"{session}-{s}", sender=s) for s in owners.sender_ranks]


@pytest.mark.parametrize("layout", ["rows", "columns", "blocks"])
@pytest.mark.parametrize("addressed", [False, True], ids=["plain-targets", "addressed-targets"])
@pytest.mark.parametrize("name", ["gloo", "shm"])
def test_an_engine_receives_every_senders_lane_into_its_full_tensors(name, addressed, layout):
    """``addressed``: the targets carry their addresses, as the reference engine's do,
    and stay the same from round to round (zeroed in place between rounds): the part
    views (kept on the targets) and their addresses made in the first round must land
    the second's bytes; a third round into new targets (the engine's weights in new
    storage, as after a wake) lands there and writes nothing into the old ones.
    ``columns``: the senders hold column ranges (tensor parallel's Shard(1)), which no
    view of a full tensor lays out end to end: each is received whole and copied in.
    ``blocks``: four senders of a 2x2 mesh hold blocks of rows and columns (FSDP2 over
    tensor parallel), and replicas of the 1-dimensional tensors' row ranges."""
    kind = {"gloo": common_pb2.TRANSPORT_KIND_GLOO, "shm": common_pb2.TRANSPORT_KIND_SHM}[name]
    holdings = (grid_slices(2, 2, FULL.items()) if layout == "blocks"
                else chunk_holdings(3, columns=layout == "columns"))
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    assert (layout == "blocks") == any(len(owners.parts_of(r).extra_parts) for r in owners.sender_ranks)
    store = host_store("127.0.0.1", timeout_s=20)
    senders = {r: transports.make_sender(kind, store) for r in owners.sender_ranks}
    receivers = [transports.make_receiver(kind) for _ in owners.sender_ranks]
    kept = [torch.zeros(s, dtype=d) for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
    kept = AddressedTensors(kept, tensor_addresses(kept, plan.dtypes, plan.sizes), plan.sizes)
    try:
        for step in range(3 if addressed else 2):
            lanes = _lanes(kind, store, owners, 1, f"{name}-{step}")
            for t in kept:
                t.zero_()
            if addressed and step == 2:
                moved = [torch.zeros(s, dtype=d) for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
                targets = AddressedTensors(moved, tensor_addresses(moved, plan.dtypes, plan.sizes), plan.sizes)
            elif addressed:
                targets = kept
            else:
                targets = [torch.zeros(s, dtype=d) for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
            engine_lanes = [SenderLane(lane, owners.part_plan(r), receivers[i], r)
                            for i, (r, lane) in enumerate(zip(owners.sender_ranks, lanes, strict=True))]
            deadline_at = time.monotonic() + 20
            threads = [threading.Thread(target=senders[r].send, args=(lane, owners.part_plan(r),
                                                                      sources_for(owners, r, {h.name: h for h in
                                                                                              holdings[r]})),
                                        kwargs={"deadline_at": deadline_at, "abort": threading.Event()})
                       for r, lane in zip(owners.sender_ranks, lanes, strict=True)]
            for t in threads:
                t.start()
            stats = receive_from_senders(engine_lanes, 1, part_targets(owners, targets), deadline_at=deadline_at,
                                         abort=threading.Event())
            for t in threads:
                t.join(20)
            assert weights_digest(zip(plan.names, targets, strict=True)) == weights_digest(FULL.items())
            if targets is not kept:
                assert not any(t.any() for t in kept)  # no view kept of the old weights was written
            assert stats.bytes == sum(owners.part_plan(r).total_bytes for r in owners.sender_ranks)
    finally:
        for s in senders.values():
            s.close()
        for r in receivers:
            r.close()


def test_part_views_of_addressed_targets_carry_each_views_address_worked_out_once():
    holdings = chunk_holdings(3)
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=64)
    full = [torch.zeros(s, dtype=d) for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
    targets = AddressedTensors(full, tensor_addresses(full, plan.dtypes, plan.sizes), plan.sizes)
    for r in owners.sender_ranks:
        views = owners.part_views(r, targets)
        assert views.sizes is owners.part_plan(r).sizes
        # Checked against the views themselves, made the ordinary way (narrow).
        assert views.addresses.tolist() == [views[i].data_ptr() for i in range(len(views))]
        assert [views[i].nbytes for i in range(len(views))] == list(owners.part_plan(r).sizes)
        # The same targets next round: the same addresses, not worked out again, and
        # the same views, kept on the targets themselves (no view made again).
        again = owners.part_views(r, targets)
        assert again.addresses is views.addresses
        assert all(again[i] is views[i] for i in range(len(views)))
    first = owners.sender_ranks[0]
    assert owners.part_views(first, list(full)).addresses is None  # no addresses carried: none made up
    moved = [t.clone() for t in full]  # the engine's weights in new storage (after a wake, say)
    moved = AddressedTensors(moved, tensor_addresses(moved, plan.dtypes, plan.sizes), plan.sizes)
    views = owners.part_views(first, moved)
    assert views.addresses.tolist() == [views[i].data_ptr() for i in range(len(views))]
    assert views[0] is not owners.part_views(first, targets)[0]  # new targets: views of their own
    # Nothing of the targets is held once the engine lets them go.
    gone = weakref.ref(moved[0])
    del moved, views
    gc.collect()
    assert gone() is None


def _remember(replay: HeldReplay, pairs) -> None:
    from weightsync.sharding import description_signature, holdings_of
    held = holdings_of(pairs)
    described = describe(held.values())
    replay.remember(pairs, held, described, description_signature(described))


def test_holdings_are_replayed_only_while_every_tensor_is_the_same_one():
    pairs = [(name, t.clone()) for name, t in FULL.items()]
    replay = HeldReplay()
    assert not replay.replay(pairs)  # nothing remembered yet
    _remember(replay, pairs)
    held = replay.holdings
    assert replay.replay(list(pairs))  # the same tensors, in a new list
    pairs[1][1].add_(1.0)  # updated in place, as an optimizer step does
    assert replay.replay(pairs) and replay.holdings is held and held["w"].local is pairs[1][1]
    changed = {
        "a tensor replaced": [pairs[0], ("w", pairs[1][1].clone()), *pairs[2:]],
        "renamed": [pairs[0], ("w2", pairs[1][1]), *pairs[2:]],
        "one more": [*pairs, ("extra", torch.ones(2))],
        "one fewer": pairs[:-1],
        "reordered": [pairs[1], pairs[0], *pairs[2:]],
        "not pairs": [pairs[0], "w"],
    }
    for why, other in changed.items():
        assert not replay.replay(other), why
        # Read as a generator goes, a change yields every pair, those before it included.
        assert replay.replay_or_read(iter(other)) == other, why
    assert replay.replay_or_read(pair for pair in pairs) is None  # unchanged: nothing listed
    pairs[2][1].resize_(3)  # the same object, another shape
    assert not replay.replay(pairs)
    _remember(replay, pairs[:2])
    gone = weakref.ref(pairs[0][1])
    replay.forget()  # as at close: nothing of the tensors is held any more
    del pairs[:2], held, changed, other  # the test's own references
    gc.collect()
    assert gone() is None and not replay.replay([])
    # A tensor that is not contiguous is sent from a copy made that round: never replayed.
    transposed = [("wt", torch.randn(3, 5).t())]
    _remember(replay, transposed)
    assert not replay.replay(transposed)
    assert torch.equal(replay.holdings["wt"].local, transposed[0][1])  # this round's copy stands


def test_a_replayed_round_read_from_named_parameters_keeps_no_per_tensor_objects_alive():
    """A sharded trainer passing ``model.named_parameters()`` every round: the pairs it
    makes (a new tuple per tensor) are read one by one, never listed, so a replayed
    round keeps no 20k new objects alive for the garbage collector to promote (and
    soon walk the trainer's whole heap for, holding the GIL)."""
    from weightsync.engine.model import ReferenceLM, config_for_size

    model = ReferenceLM(config_for_size(16 << 20, 20_000))
    replay = HeldReplay()
    _remember(replay, list(model.named_parameters()))
    with collections_during() as collections:
        assert replay.replay_or_read(model.named_parameters()) is None
    assert len(collections) <= 1, f"{len(collections)} collections during one replayed round"


def test_dtensor_holdings_are_replayed_while_the_same_local_shard_stands():
    """A one-rank gloo world in a child process (torch.distributed is global)."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import distribute_tensor, Shard\n"
        "from weightsync.sharding import HeldReplay, describe\n"
        "from weightsync.sharding import description_signature, holdings_of\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29000 + os.getpid() % 1000))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "pairs = [('a', distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])),\n"
        "         ('b', torch.nn.Parameter(distribute_tensor(torch.randn(8), mesh, [Shard(0)])))]\n"
        "replay = HeldReplay()\n"
        "held = holdings_of(pairs); d = describe(held.values()); replay.remember(pairs, held, d, description_signature(d))\n"
        "assert replay.replay(pairs), 'same DTensors'\n"
        "with torch.no_grad():\n"
        "    pairs[1][1].to_local().mul_(2)\n"
        "assert replay.replay(pairs) and torch.equal(replay.holdings['b'].local, pairs[1][1].to_local())\n"
        "other = [pairs[0], ('b', distribute_tensor(torch.randn(8), mesh, [Shard(0)]))]\n"
        "assert not replay.replay(other), 'a new DTensor'\n"
        "print('replayed as expected')\n"
        "dist.destroy_process_group()\n"
        "import sys; sys.stdout.flush(); os._exit(0)\n")  # see the test above: no finalization race
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "replayed as expected" in out.stdout


def test_one_lane_failing_stops_every_lane_and_tells_their_senders():
    """Sender 1 never comes; sender 0's lane works. The engine's receive fails as soon
    as lane 1 does (its abort key), lane 0 stops too and reports to sender 0."""
    kind = common_pb2.TRANSPORT_KIND_GLOO
    holdings = chunk_holdings(2)
    big = torch.randn(4096, 64)
    holdings[0].append(Holding("big", big.dtype, tuple(big.shape), 0, 2048, big[:2048].clone()))
    holdings[1].append(Holding("big", big.dtype, tuple(big.shape), 2048, 2048, big[2048:].clone()))
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=4096)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receivers = [transports.make_receiver(kind) for _ in range(2)]
    lanes = _lanes(kind, store, owners, 1, "fail")
    targets = [torch.zeros(s, dtype=d) for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
    engine_lanes = [SenderLane(lane, owners.part_plan(r), receivers[r], r) for r, lane in enumerate(lanes)]
    sent: dict = {}

    def send0():
        try:
            sender.send(lanes[0], owners.part_plan(0), sources_for(owners, 0, {h.name: h for h in holdings[0]}),
                        deadline_at=time.monotonic() + 30, abort=threading.Event())
        except BaseException as exc:
            sent["error"] = exc

    thread = threading.Thread(target=send0)
    thread.start()
    timer = threading.Timer(0.5, lambda: store.set(session_key(lanes[1], "abort"), "rank 1 was killed"))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TransferError, match="rank 1 was killed") as info:
            receive_from_senders(engine_lanes, 1, part_targets(owners, targets), deadline_at=time.monotonic() + 30,
                                 abort=threading.Event())
        assert time.monotonic() - started < 10
        assert getattr(info.value, "wrote_nothing", False) is False
        thread.join(15)
        assert not thread.is_alive(), "sender 0 must stop once the engine's other lane failed"
        # sender 0 finished or failed; if it failed, it was told by the engine
        if "error" in sent:
            assert "rank 1" in str(sent["error"]) or "receive aborted" in str(sent["error"])
    finally:
        timer.cancel()
        sender.close()
        for r in receivers:
            r.close()


def _mesh_placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    return [
        ((2, 2), [Shard(0), Shard(1)]),               # FSDP2 over tensor parallel, a row-wise weight
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # ... a column-wise weight
        ((2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((3, 2), [Shard(0), Replicate()]),            # a row-wise layer's bias
        ((2, 2), [Shard(0), Shard(0)]),               # two mesh dimensions chunk one tensor dimension
        ((2, 2, 2), [Replicate(), Shard(1), Shard(0)]),  # HSDP over tensor parallel
        ((4,), [Shard(1)]),
    ]


@pytest.mark.parametrize("shape", [(12, 8), (10, 6), (5, 3)])
@pytest.mark.parametrize("mesh, placements", _mesh_placements(), ids=lambda v: str(v))
def test_every_mesh_coordinates_slices_are_where_torch_puts_them(mesh, placements, shape):
    """What ``holding_of`` works out each rank holds, for every coordinate of a mesh
    (even and uneven sizes), against two things independent of it: torch's own local
    shape and global offset for that coordinate, and the block cut out of an arange
    tensor by nested torch.chunk (FSDP2 over tensor parallel chunks the tensor-parallel
    chunk: ``_StridedShard``); and the blocks of all coordinates tile the tensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from weightsync.sharding import grid_tiles, part_block, slices_held
    full = torch.arange(int(np.prod(shape))).reshape(shape)
    seen = set()
    for coordinate in np.ndindex(*mesh):
        slices = slices_held("t", shape, placements, mesh, coordinate, Shard)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh, coordinate.__getitem__,
                                                                     placements, False)
        block = [(0, n) for n in shape]
        for dim, start, rows in slices:
            block[dim] = (start, rows)
        assert tuple(r for _, r in block) == tuple(local_shape), (coordinate, slices)
        assert all(s == o for (s, r), o in zip(block, offset, strict=True) if r), (coordinate, slices, offset)
        # the data: nested torch.chunk, the strided mesh dimension last
        expected = full
        order = list(range(len(mesh)))
        if type(placements[0]).__name__ == "_StridedShard":
            order = [*order[1:], 0]
        for m in order:
            p = placements[m]
            if hasattr(p, "dim"):
                chunks = expected.chunk(mesh[m], p.dim)
                expected = (chunks[coordinate[m]] if coordinate[m] < len(chunks)
                            else expected.narrow(p.dim, 0, 0))
        got = full
        for dim, start, rows in slices:
            got = got.narrow(dim, start, rows)
        assert torch.equal(got, expected), (coordinate, slices)
        if all(r for _, r in block):
            seen.add(part_block(shape, slices[0][0], slices[0][1], slices[0][2], tuple(slices[1:])) if slices
                     else part_block(shape, 0, 0, shape[0]))
    assert grid_tiles(shape, sorted(seen)), seen


def test_a_strided_shard_placed_otherwise_than_fsdp2_over_tensor_parallel_is_refused():
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from weightsync.sharding import slices_held
    for placements in ([_StridedShard(0, split_factor=2)], [Shard(0), _StridedShard(0, split_factor=2)],
                       [_StridedShard(0, split_factor=3), Shard(0)]):
        with pytest.raises(InvalidArgument, match="_StridedShard is supported as FSDP2 over tensor parallel"):
            slices_held("w", (8, 4), placements, (2, 2)[:len(placements)], (0,) * len(placements), Shard)
    with pytest.raises(InvalidArgument, match="'w': placements .*Partial"):
        slices_held("w", (8, 4), [Shard(0), Partial()], (2, 2), (0, 0), Shard)


def test_an_unsupported_dtensor_placement_is_a_clear_error():
    """Shard(1) (tensor parallel's row-wise split) is taken as a slice of dimension 1;
    Partial() (a pending reduction) is refused naming the tensor and what is
    supported; a one-rank gloo world in a child process (torch.distributed is global)."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import DTensor, distribute_tensor, Shard, Replicate, Partial\n"
        "from weightsync.sharding import holding_of\n"
        "from weightsync.errors import InvalidArgument\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29000 + os.getpid() % 1000))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "t = torch.randn(4, 6)\n"
        "h = holding_of('rep', distribute_tensor(t, mesh, [Replicate()]))\n"
        "assert h.whole and torch.equal(h.local, t)\n"
        "h = holding_of('s0', distribute_tensor(t, mesh, [Shard(0)]))\n"
        "assert (h.start, h.rows) == (0, 4)\n"
        "h = holding_of('col', distribute_tensor(t, mesh, [Shard(1)]))\n"
        "assert h.whole and torch.equal(h.local, t)\n"
        "try:\n"
        "    holding_of('partial', DTensor.from_local(t, mesh, [Partial()]))\n"
        "except InvalidArgument as exc:\n"
        "    print('refused:', exc)\n"
        "dist.destroy_process_group()\n"
        # gloo's C++ worker threads can abort the interpreter's finalization ("terminate
        # called without an active exception", a torch teardown race seen once in CI),
        # which is not what this test checks: leave without finalizing.
        "import sys; sys.stdout.flush(); os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "'partial'" in out.stdout and "Shard(d) and Replicate()" in out.stdout


def test_every_rank_rebuilds_the_drivers_error_as_the_same_type():
    """Rank 0 records how the round ended; the other ranks raise the same type, with
    the round's result where it had one (in process: the records are plain JSON)."""
    import asyncio
    import json

    from weightsync.client.rank_protocol import error_record, raise_recorded, result_record
    from weightsync.client.trainer import EngineResult, SyncFailed, SyncResult
    from weightsync.errors import StepTimeoutError

    result = SyncResult(version=3, ok=False, bytes=10, transfer_seconds=0.5,
                        engines=(EngineResult("e0", False, 2, True, 0.4, "TRANSFER_FAILED", "peer gone"),),
                        resumed=("e1",))
    cases = [(SyncFailed("broadcast of version 3 failed", result=result), SyncFailed, result),
             (StepTimeoutError("deadline exceeded during broadcast", operation="broadcast"), StepTimeoutError, result),
             (InvalidArgument("tensor 'w': no rank holds it whole"), InvalidArgument, None),
             (asyncio.CancelledError(), TransferError, None)]
    for error, expected, carried in cases:
        record = {"error": error_record(error)}
        if carried is not None:
            record["result"] = result_record(carried)
        with pytest.raises(expected) as info:
            raise_recorded(json.loads(json.dumps(record)))
        if carried is not None:
            assert info.value.result == carried
        if not isinstance(error, asyncio.CancelledError):
            assert info.value.message == error.message
        if expected is StepTimeoutError:
            assert info.value.operation == "broadcast"


def test_sglang_refuses_a_sharded_round_before_anything_changes():
    """SGLang receives through its update group, which has one sender: a request with
    owners is refused by the adapter's check (the Broadcast's validation phase), naming
    why. The check reads the request alone: no SGLang is contacted (the address is
    closed). vLLM takes such a round (tests/vllm/test_vllm_e2e.py)."""
    from weightsync.engine.sglang import SglangAdapter
    from weightsync.errors import Unsupported
    from weightsync.v1 import agent_pb2

    plan, owners = assign([describe(h) for h in chunk_holdings(2)], bucket_bytes=64)
    lane = common_pb2.Rendezvous(transport=common_pb2.TRANSPORT_KIND_GROUP, world_size=2)
    request = agent_pb2.ReceiveRequest(plan=plan.to_proto(), owners=owners.to_proto(), rendezvous=lane)
    with pytest.raises(Unsupported) as info:
        SglangAdapter("http://127.0.0.1:9").check_receive(request)
    assert info.value.reason == "SHARDED_UNSUPPORTED"


def test_a_rank_whose_read_ack_loses_its_answer_to_rank_0_closing_still_has_the_round():
    """Rank 0 sees a rank's ``read`` key as soon as its store holds it, then closes its
    store: the store may drop the connection before the SET's answer is sent. The rank
    has read the round's end already, so the ack must not turn into 'rank 0 went away'
    (seen under load in CI). Here the host closes right after storing the key, every
    time, before it answers."""
    from weightsync.client.rank_protocol import acknowledge_read
    from weightsync.transport.secure_store import _SET, SecureStore, StoreHost

    def ack_with(set_key: Callable[[SecureStore, str], None]) -> bytes | None:
        host = StoreHost("127.0.0.1", timeout_s=5)
        answer = host._answer

        def store_then_close(fields):
            reply = answer(fields)
            if fields[0][0] == _SET:
                threading.Thread(target=host.close).start()
                time.sleep(0.5)  # the host is closed before this answer goes out
            return reply

        host._answer = store_then_close
        store = SecureStore("127.0.0.1", host.port, host.owner_secret, deadline_at=time.monotonic() + 5,
                            timeout_s=5)
        try:
            set_key(store, "ws-dist/s/1/read/1")
            return host.get("ws-dist/s/1/read/1")
        finally:
            store.close()
            host.close()

    with pytest.raises(RuntimeError):  # the store call itself fails ...
        ack_with(lambda store, key: store.set(key, "1"))
    assert ack_with(acknowledge_read) == b"1"  # ... the ack does not, and rank 0 has it


def test_a_sharded_trainers_client_refuses_what_it_cannot_send_on_every_rank(tmp_path):
    """Bad options are typed errors at construction, before any store or channel: a
    transport a sharded trainer has no lane for, a group layout that does not exist, a
    group transport told not to gather (it has one sender), a gather that is no bool.
    (A one-rank gloo group stands for the trainer's.)"""
    import torch.distributed as dist

    from weightsync.client.distributed import DistributedTrainerClient
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(InvalidArgument, match="auto, gloo, shm or group"):
            DistributedTrainerClient("127.0.0.1:1", transport="nccl")
        with pytest.raises(InvalidArgument, match="group_layout"):
            DistributedTrainerClient("127.0.0.1:1", transport="group", group_layout="diagonal")
        with pytest.raises(InvalidArgument, match="one sender"):
            DistributedTrainerClient("127.0.0.1:1", transport="group", gather=False)
        with pytest.raises(InvalidArgument, match="gather must be"):
            DistributedTrainerClient("127.0.0.1:1", gather="yes")
        client = DistributedTrainerClient("127.0.0.1:1", transport="group", group_layout="tensors")
        assert client.gathers and client._client.group_layout == "tensors"
        # the other transports gather only when asked to
        assert not DistributedTrainerClient("127.0.0.1:1").gathers
        assert DistributedTrainerClient("127.0.0.1:1", transport="auto", gather=True).gathers
    finally:
        dist.destroy_process_group()
