"""What a weight plan costs at realistic and at hostile sizes.

For each tensor count: building the plan on the trainer (``BucketPlan.build``), its
wire size, decoding the wire bytes, and checking them the way the coordinator and every
agent do (``BucketPlan.from_proto``, uncached), each the median of --repeat runs in this
process. Names look like a mixture-of-experts model's.

    python benchmarks/plan_check.py --tensors 89 20000 100000 1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync import plan as plans  # noqa: E402
from weightsync.v1 import common_pb2  # noqa: E402


def specs(count: int):
    return ((f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.down_proj.weight", torch.bfloat16, (2048,))
            for i in range(count))


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[89, 20_000, 100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| tensors | wire MiB | build s | decode s | check s |")
    print("|---:|---:|---:|---:|---:|")
    for count in args.tensors:
        build = timed(lambda c=count: plans.BucketPlan.build(specs(c)), args.repeat)
        wire = plans.BucketPlan.build(specs(count)).to_proto().SerializeToString()
        decode = timed(lambda w=wire: common_pb2.WeightPlan.FromString(w), args.repeat)
        msg = common_pb2.WeightPlan.FromString(wire)

        def check(m=msg):
            plans._PLANS_BY_ID.clear()  # every run checks from scratch, as a new plan would be
            plans.BucketPlan.from_proto(m)
        print(f"| {count} | {len(wire) / 2**20:.2f} | {build:.3f} | {decode:.3f} | {timed(check, args.repeat):.3f} |")


if __name__ == "__main__":
    main()
