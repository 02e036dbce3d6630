"""A trainer for simulated hosts (the multi-host tests and ``weightsync bench --hosts``).

Runs on one host, syncs a reference model (the engines' ``--model`` config, moved by
seeded noise so every round differs) to every engine for a number of rounds, and
prints one JSON line per round:

    {"round", "ok", "error", "seconds", "bytes", "began", "ended",
     "engines": {id: {"ok", "transport", "relayed_by", "host_id", "reason", "message",
                      "digest_ok"}}}

``digest_ok`` compares the digest of an engine the round synced with this process's own
tensors, never with another engine (``TrainerClient.check_engines``; None for an engine
whose round failed; ``digest_check`` says what the others hold where one differs).
``seconds`` is the whole ``update_weights`` (pause, broadcast, resume); the digest check
after it is not counted.

Usage: python -m weightsync.apps.bench.host_trainer COORDINATOR HOST --model JSON
    [--rounds N] [--first-version V] [--transport T] [--timeout S] [--pause-between S] [--bucket-bytes B]
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
from weightsync.plan import DEFAULT_BUCKET_BYTES


def model_tensors(config: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The engines' model (same config) moved by seeded noise: every round differs."""
    gen = torch.Generator().manual_seed(seed)
    named = [(name, p.detach().clone()) for name, p in ReferenceLM(config).named_parameters()]
    for _, t in named:
        t.add_(0.1 * torch.randn(t.shape, generator=gen))
    return named


async def run(args: argparse.Namespace) -> None:
    config = ModelConfig.from_json(args.model)
    async with TrainerClient(args.coordinator, host=args.host, transport=args.transport,
                             bucket_bytes=args.bucket_bytes) as client:
        for r in range(args.first_version, args.first_version + args.rounds):
            named = await asyncio.to_thread(model_tensors, config, r)
            line: dict = {"round": r, "ok": False, "error": "", "engines": {}, "began": time.time(),
                          "bytes": sum(t.numel() * t.element_size() for _, t in named)}
            started = time.monotonic()
            try:
                result = await client.update_weights(named, version=r, timeout_s=args.timeout)
                line["ok"], outcomes = result.ok, result.engines
            except WeightSyncError as exc:
                line["error"] = f"{exc.reason}: {exc.message}"
                outcomes = getattr(getattr(exc, "result", None), "engines", ())
            line["seconds"] = round(time.monotonic() - started, 4)
            line["ended"] = time.time()
            state = await client.get_state()
            engines = {e.engine_id: e for e in state.engines}
            synced = [o.engine_id for o in outcomes if o.ok]
            check = await client.check_engines(named, version=r, engine_ids=synced) if synced else None
            for o in outcomes:
                engine = engines.get(o.engine_id)
                line["engines"][o.engine_id] = {
                    "ok": o.ok, "transport": o.transport, "relayed_by": o.relayed_by,
                    "host_id": engine.host_id if engine else "", "reason": o.error_reason,
                    "message": o.error_message[:300],
                    "digest_ok": o.engine_id in check.holding if o.ok else None}
            if check is not None and not check.ok:
                line["digest_check"] = check.describe()
            print(json.dumps(line), flush=True)
            await asyncio.sleep(args.pause_between)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="host_trainer")
    parser.add_argument("coordinator")
    parser.add_argument("host", help="this host's address: engines reach the trainer there")
    parser.add_argument("--model", required=True, help="the engines' --model JSON")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-version", type=int, default=1, help="version of the first round")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--pause-between", type=float, default=0.0)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
