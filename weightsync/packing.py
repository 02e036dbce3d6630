"""Copies between tensors and bucket buffers, laid out by a ``BucketPlan``, and the
weights digest (names, dtypes, shapes, exact bytes).

The torch side of a plan: ``weightsync.plan`` says where every byte goes and imports
no torch; this module moves the bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
import xxhash

from weightsync.dtypes import ITEMSIZE
from weightsync.errors import InvalidArgument
from weightsync.plan import SERIAL_COPY_BYTES, BucketPlan, Piece
from weightsync.serial_copy import serial_copies


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
def pack_bucket(plan: BucketPlan, bucket: int, sources: Sequence[torch.Tensor], out: torch.Tensor, *,
                small_only: bool = False) -> None:
    """Copies (casting where the plan's dtype differs) bucket ``bucket`` into ``out`` (uint8).

    Tensors that lie whole in the bucket go in one ``torch._foreach_copy_`` call per
    size group (one Python call for thousands of small tensors); pieces of larger ones
    one by one. ``small_only``: only the pieces under ``SERIAL_COPY_BYTES`` (the packed
    ranges of ``plan.bucket_ops``; the large pieces travel on their own)."""
    whole, small, split, serial = _bucket_copies(plan, bucket, small_only)
    if whole:
        _copy_whole(small, plan.bucket_views(out, bucket)[:len(whole)], [sources[i] for i in whole])
    with serial_copies() if serial else contextlib.nullcontext():
        _pack_split(plan, split, sources, out)


def _bucket_copies(plan: BucketPlan, bucket: int, small_only: bool) -> tuple[list[int], int, list[Piece], bool]:
    """What ``pack_bucket``/``unpack_bucket`` copy of ``bucket``: the whole tensors, how
    many of them are small, the pieces of split tensors, and whether those pieces are
    all small (then copied with no OpenMP region, see ``weightsync.serial_copy``).
    ``small_only`` keeps only the pieces under ``SERIAL_COPY_BYTES``: all small, even in
    a bucket that a large tensor's piece also crosses (copied with regions, one to
    each small piece, a gloo round at 509 tensors spent 25 ms of CPU per round packing
    under 1 MiB, against 2 ms apart)."""
    whole, small, split = plan._whole_and_split[bucket]
    if small_only:
        return whole[:small], small, [p for p in split if p.length < SERIAL_COPY_BYTES], True
    return whole, small, split, plan._small_splits[bucket]


def _pack_split(plan: BucketPlan, split: Sequence[Piece], sources: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    for p in split:
        dtype = plan.dtypes[p.tensor_index]
        src = sources[p.tensor_index].reshape(-1)
        dst = out[p.bucket_start:p.bucket_start + p.length]
        if src.dtype == dtype:
            dst.copy_(byte_view(src)[p.tensor_start:p.tensor_start + p.length])
        else:
            first = p.tensor_start // ITEMSIZE[dtype]
            count = p.length // ITEMSIZE[dtype]
            dst.view(dtype).copy_(src[first:first + count])


def pack_piece(plan: BucketPlan, piece: Piece, sources: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copies one piece into ``out`` (the bucket's buffer) at its place in the bucket."""
    with torch.no_grad():
        _pack_split(plan, [piece], sources, out)


@torch.no_grad()
def unpack_bucket(plan: BucketPlan, bucket: int, data: torch.Tensor, targets: Sequence[torch.Tensor], *,
                  small_only: bool = False) -> None:
    """Copies bucket ``bucket`` from ``data`` (uint8) into ``targets`` (same dtypes as the plan);
    whole tensors grouped as in ``pack_bucket``; ``small_only`` as there."""
    whole, small, split, serial = _bucket_copies(plan, bucket, small_only)
    if whole:
        _copy_whole(small, [targets[i] for i in whole], plan.bucket_views(data, bucket)[:len(whole)])
    with serial_copies() if serial else contextlib.nullcontext():
        for p in split:
            unpack_piece(plan, p, data, targets)


def unpack_piece(plan: BucketPlan, piece: Piece, data: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copies one piece from ``data`` (the bucket's buffer) into its tensor."""
    index, p = piece.tensor_index, piece
    with torch.no_grad():
        if p.tensor_start == 0 and p.length == plan.sizes[index]:  # a whole tensor: any layout, any device
            view = data[p.bucket_start:p.bucket_start + p.length].view(plan.dtypes[index]).view(plan.shapes[index])
            targets[index].copy_(view)
        else:
            dst = byte_view(targets[index])
            dst[p.tensor_start:p.tensor_start + p.length].copy_(data[p.bucket_start:p.bucket_start + p.length])


def _range_views(buffer: torch.Tensor, ranges: Sequence[tuple[int, int]],
                 packed: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``buffer``'s ranges, and the same lengths of ``packed`` end to end."""
    spread, together, at = [], [], 0
    for start, end in ranges:
        spread.append(buffer[start:end])
        together.append(packed[at:at + end - start])
        at += end - start
    return spread, together


def gather_ranges(buffer: torch.Tensor, ranges: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
    """Copies ``buffer[start:end]`` for each range, end to end, to the front of ``out``
    (both uint8): the gathered operation of ``BucketPlan.wire_ops``."""
    spread, together = _range_views(buffer, ranges, out)
    with torch.no_grad(), serial_copies():  # ranges of small tensors: no parallel region each
        torch._foreach_copy_(together, spread)


def scatter_ranges(data: torch.Tensor, ranges: Sequence[tuple[int, int]], buffer: torch.Tensor) -> None:
    """The inverse of ``gather_ranges``: ``data``'s bytes, end to end, back to each range
    of ``buffer``."""
    spread, together = _range_views(buffer, ranges, data)
    with torch.no_grad(), serial_copies():
        torch._foreach_copy_(spread, together)


# The hash of a weights digest: XXH3, 128 bits. The digest tells bitwise-equal weights
# from weights that differ by accident (a torn or stale load, a wrong cast); it is no
# proof against an engine that lies, which could report any digest it liked. A vLLM
# worker hashes every tensor it loads, inside the round (its tensors are repacked or
# gone afterwards): at blake2b's 0.65 GiB/s here that was most of a round's time for a
# large model; XXH3 hashes 17 GiB/s here, and releases the GIL while it does.
DIGEST_HEX_DIGITS = 32


class WeightsDigest:
    """``weights_digest`` built one tensor at a time, in any order: a receiver that
    loads each tensor as it completes and lets it go never holds the whole model.
    Each tensor is hashed on its own (name, dtype, shape, exact bytes); the digest is
    the hash of those, in name order."""

    def __init__(self) -> None:
        self._parts: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()  # GPU weights are hashed from a host copy
        h = xxhash.xxh3_128(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(byte_view(t).numpy())  # hashes the tensor's memory in place, no copy
        self._parts[name] = h.digest()

    def hexdigest(self) -> str:
        h = xxhash.xxh3_128()
        for name in sorted(self._parts):
            h.update(self._parts[name])
        return h.hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of names, dtypes, shapes and exact bytes; equal iff bitwise equal."""
    digest = WeightsDigest()
    for name, tensor in named_tensors:
        digest.add(name, tensor)
    return digest.hexdigest()


__all__ = ["DIGEST_HEX_DIGITS", "byte_view", "pack_bucket", "unpack_bucket", "pack_piece", "unpack_piece", "gather_ranges",
           "scatter_ranges", "weights_digest", "WeightsDigest"]
