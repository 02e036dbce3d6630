"""weightsync rounds paired with a baseline's steps, alternated in the same minutes.

`weightsync bench` runs the weightsync transports and the baselines on separate sets of
processes, one after the other; on a shared machine whose speed moves from one minute
to the next, a ratio of two methods then carries that drift (`--passes` spreads it,
no more). Here a real local cluster (a coordinator, agents with reference engines) and
the bench's baseline receivers are up at once, and every round is a pair: one
weightsync round (Pause, then the timed Broadcast, then Resume, through
``TrainerClient``), then one step of the baseline, A B A B ... Each pair's ratio is
printed, and the ratio of the medians.

The payload is the same every round (the trainer's model does not move: the
baseline's receivers check its bytes against the digest taken at the start), and the
engines end holding exactly the trainer's bytes or the script fails.

    python benchmarks/paired_rounds.py --tensors 512 --rounds 10 --transport gloo --baseline flat-gloo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.apps.bench.baselines import METHODS, Baselines  # noqa: E402
from weightsync.apps.bench.runner import check_engines_hold, parse_size  # noqa: E402
from weightsync.apps.local_cluster import LocalCluster  # noqa: E402
from weightsync.client import TrainerClient  # noqa: E402
from weightsync.engine.model import ReferenceLM, config_for_size  # noqa: E402
from weightsync.packing import weights_digest  # noqa: E402

TRANSPORTS = ("gloo", "shm", "group")


async def paired(address: str, runs: Baselines, named, *, transport: str, baseline: str, rounds: int,
                 engines: int) -> tuple[list[float], list[float]]:
    """(weightsync seconds, baseline seconds) of ``rounds`` pairs, after one warm-up of each."""
    ours, theirs = [], []
    async with TrainerClient(address, transport=transport) as client:
        version = 1
        await client.update_weights(named, version=version, timeout_s=600)  # warm-up: group and plan
        await asyncio.to_thread(runs.step, baseline, 0)  # the baseline's warm-up
        for step in range(1, rounds + 1):
            version += 1
            await client.pause()
            start = time.perf_counter()
            await client.broadcast(named, version=version, timeout_s=600)
            ours.append(time.perf_counter() - start)
            await client.resume()
            theirs.append(await asyncio.to_thread(runs.step, baseline, step))
        await check_engines_hold(client, weights_digest(named), engines=engines, version=version,
                                  transport=transport)
    return ours, theirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=509)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10, help="timed pairs (after one warm-up of each side)")
    parser.add_argument("--transport", default="gloo", choices=TRANSPORTS)
    parser.add_argument("--baseline", default="flat-gloo", choices=METHODS)
    parser.add_argument("--json", default="", help="write every pair's figures here")
    args = parser.parse_args()
    if args.rounds < 1 or args.engines < 1 or args.tensors < 1:
        parser.error("--rounds, --engines and --tensors must be >= 1")
    cfg = config_for_size(parse_size(args.size), args.tensors)
    named = [(n, p.detach()) for n, p in ReferenceLM(cfg).named_parameters()]
    with tempfile.TemporaryDirectory(prefix="ws-paired-") as tmp, \
            LocalCluster(tmp, engines=args.engines, agent_args=("--model", cfg.to_json()), agent_timeout_s=600,
                         settle_s=1.0) as cluster, \
            Baselines(named, engines=args.engines, steps=args.rounds, tmp=tmp, methods=(args.baseline,)) as runs:
        ours, theirs = asyncio.run(paired(cluster.address, runs, named, transport=args.transport,
                                          baseline=args.baseline, rounds=args.rounds, engines=args.engines))
        runs.check(args.baseline)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"{len(named)} tensors, {sum(t.nbytes for _, t in named) / 2**20:.0f} MiB, {args.engines} engines, "
          f"{args.rounds} pairs alternated")
    print(f"| pair | weightsync {args.transport} s | {args.baseline} s | ratio |")
    print("|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        print(f"| {i} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    print(f"median: weightsync {args.transport} {statistics.median(ours):.3f} s, {args.baseline} "
          f"{statistics.median(theirs):.3f} s: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(named), "transport": args.transport, "baseline": args.baseline,
                       "weightsync_s": ours, "baseline_s": theirs, "ratio_of_medians": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
