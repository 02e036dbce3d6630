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

The package, a file per job: ``owners`` (the wire form and its checks),
``part_views`` (where the parts land on an engine), ``holdings`` (what a trainer rank
holds) and ``assignment`` (who sends what).
"""

from weightsync.sharding.assignment import assign, sources_for
from weightsync.sharding.holdings import (
    HeldReplay,
    Holding,
    describe,
    description_signature,
    holding_of,
    holdings_of,
    slices_held,
)
from weightsync.sharding.owners import MAX_SENDERS, Owners, SenderParts, grid_tiles, part_block
from weightsync.sharding.part_views import PartLayout, PartViews

__all__ = ["Owners", "PartViews", "PartLayout", "SenderParts", "Holding", "HeldReplay", "holding_of", "holdings_of", "description_signature", "describe",
           "assign", "sources_for", "grid_tiles", "part_block", "slices_held", "MAX_SENDERS"]
