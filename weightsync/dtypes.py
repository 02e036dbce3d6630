"""The torch dtypes of a plan's wire dtypes (``weightsync.wire_dtypes.WIRE_DTYPES``).

Kept apart from the plan so that a process that only checks and lays out plans (the
coordinator) never imports torch; the processes that hold tensors use these tables.
"""

from __future__ import annotations

import torch

from weightsync.errors import InvalidArgument
from weightsync.wire_dtypes import WIRE_DTYPES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name, _ in WIRE_DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Bytes per element, looked up per tensor (making a tensor to ask took 6 us a slot).
ITEMSIZE: dict[torch.dtype, int] = {d: d.itemsize for d in DTYPES.values()}
# A wire dtype code is an index here.
DTYPE_CODES: tuple[torch.dtype, ...] = tuple(DTYPES.values())
CODE_OF: dict[torch.dtype, int] = {d: i for i, d in enumerate(DTYPE_CODES)}
assert all(ITEMSIZE[DTYPES[name]] == size for name, size in WIRE_DTYPES), "WIRE_DTYPES' sizes are torch's"


def dtype_from_name(name: str) -> torch.dtype:
    """Returns the torch dtype called ``name``; InvalidArgument if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Returns the wire name of a torch dtype; InvalidArgument if unsupported."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {dtype}") from None


def on_wire(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as when a trainer casts to ``wire_dtype``:
    floating tensors are cast, the others (integers, bool) go as they are."""
    return wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype


__all__ = ["DTYPES", "DTYPE_NAMES", "ITEMSIZE", "DTYPE_CODES", "CODE_OF", "dtype_from_name", "dtype_name", "on_wire"]
