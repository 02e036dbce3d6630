"""cuda-ipc transport: engines on the trainer's host copy the trainer's GPU tensors
straight into their own, device to device, through CUDA IPC (colocated RL).

The trainer copies nothing (a tensor is staged only where it is not a contiguous tensor
of the plan's dtype on the trainer's GPU). It publishes a *table* under the round's
session key: the IPC handle of every ``cudaMalloc`` block that holds one of its tensors,
and each tensor's (block, offset) -- bytes, never pickle. It first waits (bounded, see
``cuda.EventDone``) for its own queued work on those tensors. Each engine maps the
blocks (once: handles stay open while the group id stays the same and the trainer's
tensors stay where they are, in the same blocks; a block allocated anew at the same
address has a new handle and is mapped anew), copies bucket by bucket on a stream of its
own, waits for the copies, and sets ``done/<rank>``; the trainer returns once every
engine is done, so it never changes a tensor an engine is still reading. A failure on
either side sets the usual ``abort`` / ``err/<rank>`` keys and the others stop at once.

The table (``encode_table``): ``b"wsipc1"``, the number of blocks and of tensors
(uint32 each), the blocks' handles (64 bytes each) and sizes (uint64), then per tensor
its block (int32, -1 for an empty tensor) and offset (uint64). A receiver checks every
tensor lies inside its block before mapping anything.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from weightsync.errors import TransferError
from weightsync.packing import byte_view
from weightsync.plan import BucketPlan
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.collective import wait_polling
from weightsync.transport.cuda import (
    IPC_HANDLE_BYTES,
    EventDone,
    MappedBlock,
    allocation_range,
    buffer_id,
    export_handle,
    make_current,
    tensors_device,
)
from weightsync.transport.store import StoreLink, delete_keys, session_key, wait_for_keys
from weightsync.v1 import common_pb2

_MAGIC = b"wsipc1"
# How often the trainer polls for the engines' done keys, and an engine for the table:
# the copies take about a millisecond per GiB, so the store's usual 5 ms would dominate.
_POLL_S = 0.0005
_HEADER = struct.Struct("<II")


def encode_table(handles: Sequence[bytes], block_sizes: Sequence[int], blocks: np.ndarray,
                 offsets: np.ndarray) -> bytes:
    """The trainer's table (see the module docstring)."""
    if any(len(h) != IPC_HANDLE_BYTES for h in handles) or len(handles) != len(block_sizes):
        raise ValueError("one 64-byte handle and one size per block")
    if len(blocks) != len(offsets):
        raise ValueError("one block and one offset per tensor")
    return b"".join([_MAGIC, _HEADER.pack(len(handles), len(blocks)), *handles,
                     np.asarray(block_sizes, dtype="<u8").tobytes(), np.asarray(blocks, dtype="<i4").tobytes(),
                     np.asarray(offsets, dtype="<u8").tobytes()])


class IpcTable:
    """A decoded, checked table: ``handles`` and ``block_sizes`` per block; ``blocks``
    and ``offsets`` per tensor (plan order); ``digest`` names its content."""

    def __init__(self, handles: list[bytes], block_sizes: np.ndarray, blocks: np.ndarray, offsets: np.ndarray,
                 digest: bytes) -> None:
        self.handles, self.block_sizes, self.blocks, self.offsets, self.digest = (
            handles, block_sizes, blocks, offsets, digest)


def decode_table(blob: bytes, sizes: Sequence[int]) -> IpcTable:
    """The table in ``blob`` for tensors of byte ``sizes`` (the plan's), or
    TransferError: malformed, another tensor count, or a tensor outside its block."""
    if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _HEADER.size:
        raise TransferError("the trainer's cuda-ipc table is malformed (run the same weightsync release on both sides)")
    n_blocks, n_tensors = _HEADER.unpack_from(blob, len(_MAGIC))
    if n_tensors != len(sizes):
        raise TransferError(f"the trainer's cuda-ipc table lists {n_tensors} tensors for a plan of {len(sizes)}")
    at = len(_MAGIC) + _HEADER.size
    expected = at + n_blocks * (IPC_HANDLE_BYTES + 8) + n_tensors * 12
    if len(blob) != expected:
        raise TransferError(f"the trainer's cuda-ipc table has {len(blob)} bytes, {expected} expected")
    handles = [blob[at + i * IPC_HANDLE_BYTES:at + (i + 1) * IPC_HANDLE_BYTES] for i in range(n_blocks)]
    at += n_blocks * IPC_HANDLE_BYTES
    block_sizes = np.frombuffer(blob, dtype="<u8", count=n_blocks, offset=at)
    at += n_blocks * 8
    blocks = np.frombuffer(blob, dtype="<i4", count=n_tensors, offset=at)
    at += n_tensors * 4
    offsets = np.frombuffer(blob, dtype="<u8", count=n_tensors, offset=at)
    nbytes = np.asarray(sizes, dtype=np.uint64)
    empty = blocks == -1
    if np.any(empty & (nbytes != 0)) or np.any((blocks < -1) | (blocks >= n_blocks)):
        raise TransferError("the trainer's cuda-ipc table names a block that does not exist")
    placed = ~empty
    limit = block_sizes[blocks[placed]]
    if np.any(offsets[placed] > limit) or np.any(nbytes[placed] > limit - offsets[placed]):
        raise TransferError("the trainer's cuda-ipc table puts a tensor outside its block")
    return IpcTable(handles, block_sizes, blocks, offsets, hashlib.blake2b(blob, digest_size=16).digest())


def copy_bucket(plan: BucketPlan, bucket: int, sources: Sequence[torch.Tensor],
                targets: Sequence[torch.Tensor]) -> None:
    """Copies bucket ``bucket`` from ``sources`` (the trainer's tensors, plan dtypes and
    shapes) into ``targets``: whole tensors in one ``torch._foreach_copy_`` (one batched
    kernel for thousands of small ones on a GPU), pieces of bucket-spanning tensors as
    byte ranges. A target that cannot take a byte range (not contiguous, another dtype)
    is copied whole with its last piece."""
    whole, _, split = plan._whole_and_split[bucket]
    with torch.no_grad():
        if whole:
            dsts, srcs = [targets[i] for i in whole], [sources[i] for i in whole]
            try:
                torch._foreach_copy_(dsts, srcs)
            except RuntimeError:  # mixed devices or dtypes: one copy each
                for dst, src in zip(dsts, srcs, strict=True):
                    dst.copy_(src)
        for p in split:
            target, source = targets[p.tensor_index], sources[p.tensor_index]
            if target.is_contiguous() and target.dtype == source.dtype:
                byte_view(target)[p.tensor_start:p.tensor_start + p.length].copy_(
                    byte_view(source)[p.tensor_start:p.tensor_start + p.length])
            elif p.tensor_start + p.length == plan.sizes[p.tensor_index]:
                target.copy_(source)


class _Exported(NamedTuple):
    """A table the sender may publish again while ``addresses`` (per tensor) and the
    ``buffer_ids`` of its blocks (at ``bases``) stay the same."""

    addresses: np.ndarray
    bases: list[int]
    buffer_ids: list[int]
    table: bytes


class CudaIpcSender(Sender):
    """Rank 0: publishes the trainer's tensors; copies nothing itself."""

    kind = common_pb2.TRANSPORT_KIND_CUDA_IPC

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._exported: _Exported | None = None  # the last table of the trainer's own tensors

    def send(self, rendezvous, plan, sources, *, deadline_at, abort):
        start = time.monotonic()
        store = self._store
        ranks = range(1, rendezvous.world_size)
        errors = [session_key(rendezvous, "err", r) for r in ranks]
        try:
            device = tensors_device(sources, "trainer's tensors")
            make_current(device)
            shared = _shareable(plan, sources, device)  # held until every engine is done
            # A staged copy lives for this round only: its block may be freed and another
            # allocated at the same address, so only the trainer's own tensors are remembered.
            table = self._table(shared, remember=all(a is b for a, b in zip(shared, sources, strict=True)))
            # The trainer's own queued writes to these tensors finish before anyone reads.
            with torch.cuda.device(device):
                written = torch.cuda.Event()
                written.record(torch.cuda.current_stream(device))
            wait_polling(EventDone(written), deadline_at, "broadcast", abort=abort, store=store, stop_keys=errors)
            store.set(session_key(rendezvous, "ipc-table"), table)
            wait_for_keys(store, [session_key(rendezvous, "done", r) for r in ranks], deadline_at=deadline_at,
                          operation="broadcast", abort=abort, fail_keys=errors, max_poll_s=_POLL_S)
        except BaseException as exc:
            try:  # engines stop waiting, or copying
                store.set(session_key(rendezvous, "abort"), str(exc) or type(exc).__name__)
            except Exception:
                pass
            raise
        delete_keys(store, [session_key(rendezvous, "ipc-table")] + [session_key(rendezvous, "done", r) for r in ranks])
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _table(self, shared: Sequence[torch.Tensor], *, remember: bool) -> bytes:
        """The table of ``shared``; recomputed only when a tensor moved or a block was
        allocated anew (a model's parameters stay where they are from step to step).
        Same addresses are not enough: a model moved off the GPU and back, with the
        cache emptied between, can land at the very same addresses in new blocks, whose
        handles differ; engines still holding the old blocks' mappings would copy from
        freed memory. So every round checks each block's driver id (``buffer_id``)."""
        addresses = np.fromiter((t.data_ptr() for t in shared), dtype=np.uint64, count=len(shared))
        last = self._exported
        if (remember and last is not None and np.array_equal(last.addresses, addresses)
                and [buffer_id(base) for base in last.bases] == last.buffer_ids):
            return last.table
        sizes = np.fromiter((t.nbytes for t in shared), dtype=np.uint64, count=len(shared))
        blocks = np.full(len(shared), -1, dtype=np.int32)
        offsets = np.zeros(len(shared), dtype=np.uint64)
        bases: list[int] = []
        block_sizes: list[int] = []
        # Tensors by address: each block is looked up once, then its tensors follow.
        for index in np.argsort(addresses, kind="stable").tolist():
            if sizes[index] == 0:
                continue
            address = int(addresses[index])
            if not bases or not (bases[-1] <= address < bases[-1] + block_sizes[-1]):
                base, size = allocation_range(address)
                bases.append(base)
                block_sizes.append(size)
            blocks[index] = len(bases) - 1
            offsets[index] = address - bases[-1]
        table = encode_table([export_handle(b) for b in bases], block_sizes, blocks, offsets)
        self._exported = _Exported(addresses, bases, [buffer_id(b) for b in bases], table) if remember else None
        return table

    def close(self) -> None:
        self._exported = None


def _shareable(plan: BucketPlan, sources: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``sources`` as contiguous tensors of the plan's dtypes on ``device``: the tensor
    itself where it is one, else a staged copy."""
    out = []
    for tensor, dtype in zip(sources, plan.dtypes, strict=True):
        if not (tensor.device == device and tensor.dtype == dtype and tensor.is_contiguous()):
            tensor = tensor.to(device=device, dtype=dtype).contiguous()
        out.append(tensor)
    return out


class CudaIpcReceiver(Receiver):
    """Rank >= 1: maps the trainer's blocks and copies into the engine's tensors."""

    kind = common_pb2.TRANSPORT_KIND_CUDA_IPC

    def __init__(self) -> None:
        self._store = StoreLink()
        self._group_id = ""
        self._blocks: dict[bytes, MappedBlock] = {}
        self._sources: tuple[bytes, list[torch.Tensor]] | None = None  # (table digest, views)
        self._stream: torch.cuda.Stream | None = None

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        with nothing_written():
            store = self._store.connect(rendezvous, deadline_at=deadline_at)
        stop = [session_key(rendezvous, "abort")]
        try:
            with nothing_written():
                if rendezvous.group_id != self._group_id:
                    self.close()  # handles are opened once per group
                    self._group_id = rendezvous.group_id
                key = session_key(rendezvous, "ipc-table")
                wait_for_keys(store, [key], deadline_at=deadline_at, operation="receive", abort=abort, fail_keys=stop,
                              max_poll_s=_POLL_S)
                table = decode_table(store.get(key), plan.sizes)
                device = torch.device("cuda", torch.cuda.current_device())
                sources = self._views(table, plan, device)
                if self._stream is None or self._stream.device != device:
                    self._stream = torch.cuda.Stream(device)
            stream = self._stream
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_stream(torch.cuda.default_stream(device))  # the engine's own work on its tensors
                copied: dict[int, torch.cuda.Event] = {}

                def queue_copy(bucket: int) -> None:
                    copy_bucket(plan, bucket, sources, targets)
                    copied[bucket] = torch.cuda.Event()
                    copied[bucket].record(stream)

                # Bucket k+1's copies are queued before bucket k is waited for: the GPU
                # never idles on the host's poll, and no more than two buckets' targets
                # are being filled at once (a streamed load makes them as they are used).
                queue_copy(0)
                for bucket in range(plan.num_buckets):
                    if abort.is_set():
                        raise TransferError("receive aborted")
                    if bucket + 1 < plan.num_buckets:
                        queue_copy(bucket + 1)
                    wait_polling(EventDone(copied.pop(bucket)), deadline_at, "receive", abort=abort, store=store,
                                 stop_keys=stop)
                    if on_bucket is not None:
                        on_bucket(bucket)
            store.set(session_key(rendezvous, "done", rank), b"1")
        except BaseException as exc:
            try:
                store.set(session_key(rendezvous, "err", rank), f"rank {rank}: {exc}")
            except Exception:
                pass
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _views(self, table: IpcTable, plan: BucketPlan, device: torch.device) -> list[torch.Tensor]:
        """The trainer's tensors as views of the mapped blocks (plan dtypes and shapes);
        built once per table. Blocks the table no longer names are unmapped."""
        if self._sources is not None and self._sources[0] == table.digest:
            return self._sources[1]
        self._sources = None  # old views go before any block is unmapped
        for handle, size in zip(table.handles, table.block_sizes.tolist(), strict=True):
            if handle not in self._blocks:
                self._blocks[handle] = MappedBlock(handle, size, device)
        for handle in set(self._blocks) - set(table.handles):
            self._blocks.pop(handle).close()
        mapped = [self._blocks[h].bytes for h in table.handles]
        views = []
        for block, offset, size, dtype, shape in zip(table.blocks.tolist(), table.offsets.tolist(), plan.sizes,
                                                     plan.dtypes, plan.shapes, strict=True):
            if block < 0:
                views.append(torch.empty(shape, dtype=dtype, device=device))
            else:
                views.append(mapped[block][offset:offset + size].view(dtype).view(shape))
        self._sources = (table.digest, views)
        return views

    def close(self) -> None:
        self._sources = None
        blocks, self._blocks = self._blocks, {}
        for block in blocks.values():
            block.close()
        self._group_id = ""


__all__ = ["CudaIpcSender", "CudaIpcReceiver", "encode_table", "decode_table", "IpcTable", "copy_bucket"]
