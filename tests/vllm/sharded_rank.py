"""One rank of a sharded trainer syncing into vLLM (the vLLM tier's sharded test).

Started like torchrun starts a rank (``TrainerRanks``). Every rank builds the same full
tensors of the round (the tiny checkpoint moved by seeded noise, ``round_weights``),
holds its rows of each as a DTensor placed ``Shard(0)`` on a 1-D mesh over the world
(FSDP2's layout) -- or, for a round said to be by ``columns``, its columns of every
matrix (``Shard(1)``, tensor parallel's row-wise layers); by ``blocks`` (four ranks, a
2x2 mesh), a block of rows and columns of every matrix (``Shard(0), Shard(1)``: FSDP2
over tensor parallel's row-wise layers) and rows of the rest, which two ranks hold
each -- and calls ``DistributedTrainerClient.update_weights`` with them: every rank
sends its own slices. A round said to ``verify`` carries the parts' digest
(``verify_digest``), which vLLM's worker checks. A round said to ``attest`` carries the attestation probe
of the trainer's full model (transformers, built by every rank from the same full tensors).
Before each round a rank prints {"rank", "starting": VERSION}; after it, one JSON line:
{"rank", "round", "ok", "error", "attest_max_diff", "seconds"} (``seconds``: its
``update_weights`` call). Each round has a client of its own, unless ``--one-client``
(``benchmarks/vllm_round.py --trainer-ranks``: a trainer that keeps its client, as one
does between steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

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
from weightsync.lifecycle import wait_for_file


async def run(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2)) if world >= 4 and not world % 2 else None
    base = checkpoint(args.model_dir)
    kept: dict = {}  # --one-client: the client, and the DTensors every round updates in place
    try:
        for i, spec in enumerate(args.round):
            version, seed, transport, layout, *extra = spec.split(",")
            if i and args.go:  # the test checks the last round's engine before this one moves it on
                await asyncio.to_thread(wait_for_file, os.path.join(args.go, f"go-{version}"), timeout_s=300)
            version, weights = int(version), round_weights(base, int(seed))
            named = held(weights, layout, mesh, grid)
            if args.one_client and "named" in kept:  # as a trainer's step: the same tensors, new values
                for (_, mine), (_, new) in zip(kept["named"], named, strict=True):
                    mine.to_local().copy_(new.to_local())
                named = kept["named"]
            probe = (Probe.from_model(trainer_logits_fn(trainer_model(args.model_dir, weights)), PROBE_SEQUENCES)
                     if "attest" in extra else None)
            client = kept.get("client")
            if client is None:
                client = await DistributedTrainerClient(args.coordinator, transport=transport,
                                                        bucket_bytes=args.bucket_bytes, default_timeout_s=120).start()
                if args.one_client:
                    kept.update(client=client, named=named)
            line = {"rank": rank, "round": version, "ok": False, "error": ""}
            print(json.dumps({"rank": rank, "starting": version}), flush=True)
            started = time.monotonic()
            try:
                result = await client.update_weights(named, version=version, timeout_s=120, attest=probe,
                                                     verify_digest="verify" in extra)
                line["ok"] = result.ok
                if probe is not None:
                    line["attest_max_diff"] = max(e.attest_max_diff or 0.0 for e in result.engines)
            except WeightSyncError as exc:
                line["error"] = f"{type(exc).__name__}: {exc}"[:400]
            finally:
                line["seconds"] = round(time.monotonic() - started, 4)
                if not args.one_client:
                    await client.aclose()
            print(json.dumps(line), flush=True)
    finally:
        if "client" in kept:
            await kept["client"].aclose()


def held(weights, layout: str, mesh, grid) -> list:
    """This rank's DTensors of the full ``weights``: rows of each (FSDP2), columns of
    every matrix (``columns``), or blocks on the 2-D ``grid`` (``blocks``)."""
    if layout == "blocks":
        if grid is None:
            raise SystemExit("a round by blocks takes an even number of ranks, 4 or more")
        return [(name, distribute_tensor(full, grid, [Shard(0), Shard(1) if full.dim() >= 2 else Replicate()]))
                for name, full in weights]
    columns = layout == "columns"
    return [(name, distribute_tensor(full, mesh, [Shard(1 if columns and full.dim() >= 2 else 0)]))
            for name, full in weights]


def main() -> int:
    parser = argparse.ArgumentParser(prog="sharded_rank")
    parser.add_argument("coordinator")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--round", action="append", required=True,
                        help="VERSION,SEED,TRANSPORT,rows|columns|blocks[,attest][,verify]: one round, in order")
    parser.add_argument("--bucket-bytes", type=int, default=16 * 1024)
    parser.add_argument("--go", default="", help="before each round after the first, wait for GO/go-VERSION")
    parser.add_argument("--one-client", action="store_true",
                        help="one client for every round (the first round's transport), the tensors updated in place")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(run(args))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
