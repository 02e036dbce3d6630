"""Checkpoint facts read from safetensors headers, without loading a byte of weights.

Engines that repack or fuse their weights (vLLM's oneDNN Linear layers, SGLang's
stacked QKV) do not show checkpoint shapes in their parameters, but they load
checkpoint-named tensors. So a plan for them is checked against the served model's
checkpoint: name, dtype and shape of every tensor, read from the file headers.
"""

from __future__ import annotations

import glob
import json
import os
import struct

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def checkpoint_specs(model_dir: str) -> list[list]:
    """[name, dtype, shape] of every tensor in ``model_dir``'s safetensors files (headers only)."""
    specs = []
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                specs.append([name, _SAFETENSORS_DTYPES[info["dtype"]], list(info["shape"])])
    return specs


__all__ = ["checkpoint_specs"]
