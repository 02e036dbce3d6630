"""A trainer for the simulated-hosts tests: runs on one simulated host, syncs a model
to every engine for a number of rounds, and prints one JSON line per round.

Usage: python tests/topology/sync_rounds.py COORDINATOR HOST --model JSON --rounds N
    [--transport T] [--timeout S] [--pause-between S] [--bucket-bytes B]

Each line: {"round", "ok", "error", "seconds", "engines": {id: {"ok", "transport",
"reason", "message", "digest_ok"}}} -- digest_ok compares the engine's digest with
this process's own model, not with another engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from weightsync.client import TrainerClient
from weightsync.engine.model import ModelConfig, ReferenceLM
from weightsync.errors import WeightSyncError
from weightsync.plan import DEFAULT_BUCKET_BYTES, weights_digest


def model_tensors(config: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The engines' model (same config) moved by seeded noise: every round differs."""
    gen = torch.Generator().manual_seed(seed)
    named = [(name, p.detach().clone()) for name, p in ReferenceLM(config).named_parameters()]
    for _, t in named:
        t.add_(0.1 * torch.randn(t.shape, generator=gen))
    return named


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("coordinator")
    parser.add_argument("host")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", required=True, help="the engines' --model JSON")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--pause-between", type=float, default=0.0)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    args = parser.parse_args()
    config = ModelConfig.from_json(args.model)
    async with TrainerClient(args.coordinator, host=args.host, transport=args.transport,
                             bucket_bytes=args.bucket_bytes) as client:
        for r in range(1, args.rounds + 1):
            named = model_tensors(config, seed=r)
            line: dict = {"round": r, "ok": False, "error": "", "engines": {}, "began": time.time()}
            started = time.monotonic()
            try:
                result = await client.update_weights(named, version=r, timeout_s=args.timeout)
                line["ok"] = result.ok
                outcomes = result.engines
            except WeightSyncError as exc:
                line["error"] = f"{exc.reason}: {exc.message}"
                outcomes = getattr(getattr(exc, "result", None), "engines", ())
            line["seconds"] = round(time.monotonic() - started, 3)
            line["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
            asked = time.monotonic()
            state = await client.get_state(include_digests=True)
            line["state_seconds"] = round(time.monotonic() - asked, 3)
            digests = {e.engine_id: e.weights_digest for e in state.engines}
            local = weights_digest(named)
            for o in outcomes:
                line["engines"][o.engine_id] = {
                    "ok": o.ok, "transport": o.transport, "relayed_by": o.relayed_by, "reason": o.error_reason,
                    "message": o.error_message[:300], "digest_ok": digests.get(o.engine_id) == local}
            line["ended"] = time.time()
            print(json.dumps(line), flush=True)
            await asyncio.sleep(args.pause_between)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
