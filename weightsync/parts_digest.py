"""The weights digest of a sharded trainer's round, which both sides can compute.

``packing.WeightsDigest`` hashes each full tensor's bytes in order, and no rank of a
sharded trainer holds a full tensor. Here a tensor's hash is made of its *parts'*
hashes -- the parts the round's ``Owners`` name, each the bytes of one rank's slice or
block laid out contiguously, as that rank holds and sends it -- in a fixed order (by
where each part starts). So every rank hashes its own holdings, rank 0 combines what
the senders hashed (``combine``), and an engine hashes the same slices of the full
tensors it ended with (``PartsDigest``): equal iff every part's bytes, and every
tensor's name, dtype and shape, are.

This checks the transfer (a part landed in the wrong place, torn, or stale), not the
slicing itself: both sides take the parts from the same owners. The trainer's own
model, gathered, is what checks that (``check_engines``, attestation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xxhash

from weightsync.errors import InvalidArgument
from weightsync.packing import byte_view
from weightsync.plan import BucketPlan
from weightsync.sharding import Owners, part_block


def part_hash(tensor: torch.Tensor) -> bytes:
    """The hash of one part's bytes, laid out contiguously (XXH3, 128 bits)."""
    t = tensor.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return xxhash.xxh3_128_digest(byte_view(t).numpy() if t.numel() else b"")


def _tensor_hash(name: str, dtype: torch.dtype, shape: Sequence[int], parts: Sequence[bytes]) -> bytes:
    h = xxhash.xxh3_128(f"{name}|{dtype}|{tuple(shape)}|{len(parts)}|".encode())
    for part in parts:
        h.update(part)
    return h.digest()


def _digest(tensor_hashes: Mapping[str, bytes]) -> str:
    h = xxhash.xxh3_128(b"parts|")
    for name in sorted(tensor_hashes):
        h.update(tensor_hashes[name])
    return h.hexdigest()


def _parts_by_tensor(plan: BucketPlan, owners: Owners) -> list[list[tuple[tuple, int, int]]]:
    """Per tensor: its parts as (block, sender, part index), in the digest's order;
    worked out once per owners (kept on them: rounds replay the same owners)."""
    known = getattr(owners, "_digest_parts", None)
    if known is not None:
        return known
    found: list[list[tuple[tuple, int, int]]] = [[] for _ in range(len(plan))]
    shapes = plan.shapes
    for s in owners.senders:
        extras = s.extras()
        for i, (t, start, rows, dim) in enumerate(zip(s.tensors.tolist(), s.starts.tolist(), s.rows.tolist(),
                                                      s.dims.tolist(), strict=True)):
            block = part_block(shapes[t], dim, start, rows, extras.get(i, ())) if shapes[t] else ()
            found[t].append((block, s.sender, i))
    for parts in found:
        if len(parts) > 1:
            parts.sort()
    owners._digest_parts = found
    return found


def combine(plan: BucketPlan, owners: Owners, hashes: Mapping[int, Sequence[bytes]]) -> str:
    """The round's digest from each sender's part hashes (``hashes[sender][i]``: of its
    ``i``-th part, in its owners' order).

    Raises:
        InvalidArgument: a sender's hashes do not number its parts.
    """
    for s in owners.senders:
        if len(hashes.get(s.sender, ())) != len(s.tensors):
            raise InvalidArgument(f"trainer rank {s.sender} hashed {len(hashes.get(s.sender, ()))} parts; it sends "
                                  f"{len(s.tensors)}")
    names, dtypes, shapes = plan.names, plan.dtypes, plan.shapes
    return _digest({names[t]: _tensor_hash(names[t], dtypes[t], shapes[t], [hashes[s][i] for _, s, i in parts])
                    for t, parts in enumerate(_parts_by_tensor(plan, owners))})


def holding_hashes(holdings: Sequence, wire_dtype: torch.dtype | None = None) -> dict[str, str]:
    """A rank's side: the hash of each of its holdings' local tensors, as it sends them
    (cast to the wire dtype), by name (hex)."""
    from weightsync.dtypes import on_wire
    out = {}
    for h in holdings:
        local = h.local
        wire = on_wire(local.dtype, wire_dtype)
        out[h.name] = part_hash(local if wire == local.dtype else local.to(wire)).hex()
    return out


def sender_hashes(owners: Owners, sender: int, by_name: Mapping[str, str]) -> list[bytes]:
    """``sender``'s part hashes, in its owners' order, from its ``holding_hashes``
    (every part a rank sends is one of its holdings, as it holds it: ``assign``).

    Raises:
        InvalidArgument: the rank hashed no holding of a tensor it sends."""
    names = owners.plan.names
    try:
        return [bytes.fromhex(by_name[names[t]]) for t in owners.parts_of(sender).tensors.tolist()]
    except (KeyError, ValueError) as exc:
        raise InvalidArgument(f"trainer rank {sender} gave no hash of a tensor it sends ({exc})") from None


class PartsDigest:
    """The engine's side: each full tensor, once complete, hashed part by part as the
    owners cut it (``add``, in any order); then ``hexdigest``."""

    def __init__(self, plan: BucketPlan, owners: Owners) -> None:
        self._plan = plan
        self._parts = _parts_by_tensor(plan, owners)
        self._index = {name: i for i, name in enumerate(plan.names)}
        self._hashes: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        parts = self._parts[self._index[name]]
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        if len(parts) == 1 and parts[0][0] == tuple((0, n) for n in t.shape):  # sent whole
            hashes = [part_hash(t)]
        else:
            # Each part a numpy view of the tensor's bytes (one more axis: the element's
            # bytes), made contiguous only where it is not (a block, a column slice).
            as_bytes = byte_view(t).numpy().reshape(*t.shape, t.element_size())
            hashes = [xxhash.xxh3_128_digest(np.ascontiguousarray(as_bytes[tuple(slice(s, s + r) for s, r in block)]))
                      for block, _, _ in parts]
        self._hashes[name] = _tensor_hash(name, tensor.dtype, tuple(tensor.shape), hashes)

    def hexdigest(self) -> str:
        return _digest(self._hashes)


def parts_digest(plan: BucketPlan, owners: Owners, named_tensors) -> str:
    """``PartsDigest`` of full tensors at hand (``(name, tensor)`` pairs)."""
    digest = PartsDigest(plan, owners)
    for name, tensor in named_tensors:
        digest.add(name, tensor)
    return digest.hexdigest()


__all__ = ["PartsDigest", "combine", "holding_hashes", "part_hash", "parts_digest", "sender_hashes"]
