"""What the per-step work over a model's tensors costs, at a realistic tensor count.

A trainer that syncs every step walks its tensors every step: the cached plan is
checked against them, each is made contiguous, and for shm's direct reads each one's
address is taken. After an optimizer step has written every parameter, the tensors'
objects are out of the CPU's caches, and fetching them is most of a pass's cost; so
this writes every parameter before each try, as a step does.

Three ways, medians of --repeat tries in this process:
- ``three passes``: the check, ``contiguous`` and the addresses one after another;
- ``one pass``: ``TrainerClient._prepare`` with addresses, the way rounds run;
- ``engine targets``: listing an engine's targets' addresses, which the reference
  engine's adapter now does once per plan and storage, not once per round.

    python benchmarks/step_pass.py --size 1GiB --tensors 89 20000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.apps.bench.runner import parse_size  # noqa: E402
from weightsync.client import TrainerClient  # noqa: E402
from weightsync.engine.model import ReferenceLM, config_for_size  # noqa: E402
from weightsync.transport.cross_memory import tensor_addresses  # noqa: E402


def measure(size: int, count: int, repeat: int) -> tuple[int, list[float]]:
    """The tensor count made and the median ms of each way (see the module docstring)."""
    model = ReferenceLM(config_for_size(size, count))
    named = list(model.named_parameters())
    client = TrainerClient("127.0.0.1:1", transport="shm")  # never connects: preparation only
    plan = client._prepare(named, False).plan  # plans once, as a first step does
    names, dtypes, shapes = plan.names, [t.dtype for _, t in named], [t.shape for _, t in named]

    def three_passes():
        same = all(n == cn and t.dtype == cd and t.shape == cs
                   for (n, t), cn, cd, cs in zip(named, names, dtypes, shapes, strict=True))
        sources = [t.contiguous() for _, t in named]
        assert same and tensor_addresses(sources, plan.dtypes, plan.sizes) is not None

    def one_pass():
        assert client._prepare(named, False, addresses=True).sources.addresses is not None

    def engine_targets():
        assert tensor_addresses([t for _, t in named], plan.dtypes, plan.sizes) is not None

    medians = []
    for way in (three_passes, one_pass, engine_targets):
        tries = []
        for _ in range(repeat):
            with torch.no_grad():
                for p in model.parameters():  # an optimizer step's writes
                    p.add_(1e-3)
            start = time.perf_counter()
            way()
            tries.append(time.perf_counter() - start)
        medians.append(statistics.median(tries) * 1000)
    return len(named), medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, nargs="+", default=[89, 20_000])
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    print("| tensors | three passes ms | one pass ms | engine targets ms |")
    print("|---:|---:|---:|---:|")
    for count in args.tensors:
        made, ms = measure(parse_size(args.size), count, args.repeat)
        print(f"| {made} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} |")


if __name__ == "__main__":
    main()
