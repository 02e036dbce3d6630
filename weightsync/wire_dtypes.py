"""The wire's dtypes: names and bytes per element, without torch.

``WeightPlan.dtypes`` holds a code per tensor, an index into ``WIRE_DTYPES``. Append
only. A table of its own so that the plan (which the coordinator reads, without torch)
and ``weightsync.dtypes`` (their torch dtypes, for the processes that hold tensors)
both depend on it, and not on each other.
"""

from __future__ import annotations

WIRE_DTYPES: tuple[tuple[str, int], ...] = (
    ("float32", 4), ("float64", 8), ("float16", 2), ("bfloat16", 2), ("int64", 8),
    ("int32", 4), ("int16", 2), ("int8", 1), ("uint8", 1), ("bool", 1),
)

__all__ = ["WIRE_DTYPES"]
