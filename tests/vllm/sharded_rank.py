"""One rank of a sharded trainer syncing into vLLM (the vLLM tier's sharded test).

Started like torchrun starts a rank (``TrainerRanks``). Every rank builds the same full
tensors of the round (the tiny checkpoint moved by seeded noise, ``round_weights``),
holds its rows of each as a DTensor placed ``Shard(0)`` on a 1-D mesh over the world
(FSDP2's layout) -- or, with ``--columns``, its columns of every matrix (``Shard(1)``,
tensor parallel's row-wise layers) -- and calls ``DistributedTrainerClient.update_weights`` with them:
every rank sends its own rows. ``--attest``: the round carries the attestation probe of
the trainer's full model (transformers, built by every rank from the same full tensors).
One JSON line per round: {"rank", "round", "ok", "error", "attest_max_diff"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.vllm.harness import (
    PROBE_SEQUENCES,
    checkpoint,
    round_weights,
    trainer_logits_fn,
    trainer_model,
)
from weightsync.attest import Probe
from weightsync.client.distributed import DistributedTrainerClient
from weightsync.errors import WeightSyncError


async def run(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    base = checkpoint(args.model_dir)
    async with DistributedTrainerClient(args.coordinator, transport=args.transport,
                                        bucket_bytes=args.bucket_bytes, default_timeout_s=120) as client:
        for version, seed in zip(args.versions, args.seeds, strict=True):
            weights = round_weights(base, seed)
            named = [(name, distribute_tensor(full, mesh, [Shard(1 if args.columns and full.dim() >= 2 else 0)]))
                     for name, full in weights]
            probe = (Probe.from_model(trainer_logits_fn(trainer_model(args.model_dir, weights)), PROBE_SEQUENCES)
                     if args.attest else None)
            line = {"rank": rank, "round": version, "ok": False, "error": ""}
            try:
                result = await client.update_weights(named, version=version, timeout_s=120, attest=probe)
                line["ok"] = result.ok
                if probe is not None:
                    line["attest_max_diff"] = max(e.attest_max_diff or 0.0 for e in result.engines)
            except WeightSyncError as exc:
                line["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps(line), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="sharded_rank")
    parser.add_argument("coordinator")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--versions", type=int, nargs="+", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--columns", action="store_true", help="matrices placed Shard(1), not Shard(0)")
    parser.add_argument("--attest", action="store_true", help="carry the full model's attestation probe")
    parser.add_argument("--bucket-bytes", type=int, default=16 * 1024)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(run(args))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
