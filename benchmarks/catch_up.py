"""Catch-up from a peer against a trainer Broadcast of the same bytes, in one run.

    python benchmarks/catch_up.py [--size 1GiB] [--tensors 89] [--transports shm gloo]

For each catch-up transport: a coordinator and one agent (engine-0) on a reference
model of ``--size``; the trainer syncs version 1, then version 2 (timed: the
Broadcast, over the same transport; version 1 is timed too: like a catch-up, it
builds its plan, store and group first); then a second agent (engine-1) starts with
its boot weights. Measured:
from its registration (the coordinator's ``engine_registered`` event) to the moment
GetState reports it ready, and the catch-up transfer itself (``catch_up_done``'s
seconds). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import torch

from weightsync.apps.bench.runner import parse_size
from weightsync.apps.local_cluster import LocalCluster
from weightsync.client import TrainerClient
from weightsync.engine.model import ReferenceLM, config_for_size
from weightsync.v1 import coordinator_pb2


def perturb(model: ReferenceLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


async def events(client: TrainerClient, kind: str) -> list:
    """The coordinator's events of ``kind`` so far."""
    out = []
    call = client._ready().WatchEvents(coordinator_pb2.WatchEventsRequest())
    try:
        while True:
            event = (await asyncio.wait_for(call.read(), timeout=0.5)).event
            if event.kind == kind:
                out.append(event)
    except TimeoutError:
        pass
    finally:
        call.cancel()
    return out


async def measure(address: str, cluster: LocalCluster, model: ReferenceLM, agent_args: list[str],
                  transport: str) -> dict:
    async with TrainerClient(address, transport=transport) as client:
        started = time.perf_counter()
        await client.update_weights(model.named_parameters(), version=1, timeout_s=600)
        first_s = time.perf_counter() - started
        perturb(model, 2)
        started = time.perf_counter()
        result = await client.update_weights(model.named_parameters(), version=2, timeout_s=600)
        broadcast_s = time.perf_counter() - started
        assert result.ok, result
        await asyncio.to_thread(cluster.start_agent, "engine-1", *agent_args)
        end = time.monotonic() + 600
        while True:
            state = {e.engine_id: e for e in (await client.get_state()).engines}
            if "engine-1" in state and state["engine-1"].ready:
                ready_at = time.time()
                break
            if time.monotonic() > end:
                raise TimeoutError("engine-1 was not caught up in 600 s")
            await asyncio.sleep(0.02)
        registered = [e for e in await events(client, "engine_registered") if e.engine_id == "engine-1"]
        done = [e for e in await events(client, "catch_up_done") if e.engine_id == "engine-1"]
    return {"first_broadcast_s": round(first_s, 3), "broadcast_s": round(broadcast_s, 3),
            "registration_to_ready_s": round(ready_at - registered[-1].unix_time, 3),
            "catch_up_transfer_s": float(done[-1].fields["seconds"]),
            "bytes": int(done[-1].fields["bytes"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=89)
    parser.add_argument("--transports", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    args = parser.parse_args(argv)
    cfg = config_for_size(parse_size(args.size), args.tensors)
    model = ReferenceLM(cfg)
    agent_args = ["--model", cfg.to_json()]
    out = {"size": args.size, "tensors": len(list(model.parameters())), "runs": {}}
    for transport in args.transports:
        with tempfile.TemporaryDirectory(prefix="weightsync-catchup-") as tmp:
            with LocalCluster(tmp, engines=1, agent_args=agent_args, agent_timeout_s=600, settle_s=1.0,
                              coordinator_args=("--catch-up-transport", transport)) as cluster:
                run = asyncio.run(measure(cluster.address, cluster, model, agent_args, transport))
        run["catch_up_over_broadcast"] = round(run["catch_up_transfer_s"] / run["broadcast_s"], 2)
        out["runs"][transport] = run
        print(f"{transport}: {run}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
