"""The gloo transport's rounds against plain gloo broadcasts, alternated in the same processes.

`weightsync bench` runs each method in processes of its own, one method after the
other; on a shared 2-core machine the same work costs loopback TCP a different amount
from one process pair to the next and from one minute to the next, so a ratio of two
methods there moves by 10-30 %. Here one trainer process and its receiver processes
run every variant, round after round in turn (A, B, C, A, B, C, ...), so the
variants share the processes and the minutes:

- ``threads:N``: the real ``GlooSender`` and ``GlooReceiver`` (the plan's cut, packing
  of small tensors, polled waits), their groups with N gloo worker threads;
- ``posted``: the same plan's broadcasts straight from the trainer's tensors into the
  receivers' (small runs from a spare buffer, unpacked nowhere), all posted at once,
  waited for in gloo; the floor for that many broadcasts;
- ``flat``: one broadcast of a buffer as large as the model (the bench's flat-gloo),
  gloo's default threads;
- ``placed``: ``threads:8`` from a copy of the trainer's weights placed end to end on
  huge pages (``place_on_huge_pages``): each bucket lies as one run at both ends, so
  it is one broadcast (``whole_buckets``) instead of the plan's cut.

The receivers' targets are laid out as the reference engine's are: end to end in one
arena, in model order, with their addresses at hand (``weightsync.arena``), so a bucket of
small tensors lands there with no unpack; ``--plain-targets`` gives each target an
allocation of its own instead (every small tensor unpacked, as in an engine that does
not keep its weights so).

Each round is timed in the trainer from the send's start until every receiver has
said it is done; the trainer's asyncio loop ticks every millisecond on a thread of
its own meanwhile (its largest lateness per round is the ``lag`` column).

    python benchmarks/gloo_rounds.py --tensors 509 --rounds 8 --variants threads:2,threads:8,posted,flat
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import weightsync.transport.gloo as gloo  # noqa: E402
from weightsync import transport as transports  # noqa: E402
from weightsync.apps.bench.runner import parse_size  # noqa: E402
from weightsync.arena import place_in_arena, place_on_huge_pages  # noqa: E402
from weightsync.engine.model import ReferenceLM, config_for_size  # noqa: E402
from weightsync.plan import BucketPlan  # noqa: E402
from weightsync.transport.collective import broadcast_from_root  # noqa: E402
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses  # noqa: E402
from weightsync.transport.store import host_store  # noqa: E402
from weightsync.v1 import common_pb2  # noqa: E402

GLOO = common_pb2.TRANSPORT_KIND_GLOO
OP_TIMEOUT = timedelta(seconds=120)


class PlainGloo:
    """``posted`` and ``flat``: plain broadcasts on a group of their own."""

    def __init__(self, variant: str, store: dist.Store, rank: int, world: int, plan: BucketPlan,
                 tensors: list[torch.Tensor]) -> None:
        self.variant, self.plan, self.tensors = variant, plan, tensors
        threads = gloo.GLOO_THREADS if variant == "posted" else 2
        options = dist.ProcessGroupGloo._Options()
        options._timeout, options._threads = OP_TIMEOUT, threads
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(variant, store), rank, world, options)
        self.flat = torch.zeros(plan.total_bytes if variant == "flat" else 0, dtype=torch.uint8)
        self.spare = torch.zeros(plan.bucket_bytes if variant == "posted" else 0, dtype=torch.uint8)
        self.gathered = torch.zeros(plan.gathered_bytes if variant == "posted" else 0, dtype=torch.uint8)

    def round(self) -> None:
        if self.variant == "flat":
            broadcast_from_root(self.pg, self.flat).wait()
            return
        works = []
        for bucket in range(self.plan.num_buckets):
            wire = self.plan.wire_ops(bucket)
            if wire.gathered:
                works.append(broadcast_from_root(self.pg, self.gathered[:wire.gathered_bytes]))
            for lo, hi, piece in wire.ops:
                data = self.spare[lo:hi]
                if piece is not None:
                    view = gloo._wire_bytes(self.tensors[piece.tensor_index], self.plan.dtypes[piece.tensor_index],
                                            piece)
                    data = data if view is None else view
                works.append(broadcast_from_root(self.pg, data))
        for work in works:
            work.wait()


def model_tensors(size: int, count: int) -> tuple[BucketPlan, list[torch.Tensor]]:
    torch.manual_seed(0)
    named = [(n, p.detach()) for n, p in ReferenceLM(config_for_size(size, count)).named_parameters()]
    return BucketPlan.from_tensors(named), [t for _, t in named]


def rendezvous(store_port: int, variant: str, world: int) -> common_pb2.Rendezvous:
    return common_pb2.Rendezvous(group_id=f"bench-{variant}", transport=GLOO, store_host="127.0.0.1",
                                 store_port=store_port, world_size=world, session_id=uuid.uuid4().hex)


def set_threads(variant: str) -> None:
    if variant.startswith("threads:"):
        gloo.GLOO_THREADS = int(variant.split(":", 1)[1])  # read when a group is made: one group per variant
    elif variant == "placed":
        gloo.GLOO_THREADS = 8


def is_transport(variant: str) -> bool:
    """Whether ``variant`` runs the real GlooSender and GlooReceiver."""
    return variant.startswith("threads:") or variant == "placed"


def engine_targets(plan: BucketPlan, tensors: list[torch.Tensor]) -> AddressedTensors:
    """``tensors`` moved into one arena as the reference engine keeps its weights, with
    their addresses, as its adapter hands them to a receiver."""
    params = [torch.nn.Parameter(t, requires_grad=False) for t in tensors]
    place_in_arena(params, [(t.dtype, tuple(t.shape)) for t in tensors], keep_values=True)
    targets = [p.data for p in params]
    return AddressedTensors(targets, tensor_addresses(targets, plan.dtypes, plan.sizes), plan.sizes)


def receiver(port: int, rank: int, world: int, size: int, count: int, variants: list[str], rounds: int,
             plain_targets: bool) -> None:
    plan, targets = model_tensors(size, count)
    if not plain_targets:
        targets = engine_targets(plan, targets)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=OP_TIMEOUT)
    sides: dict = {}
    for i in range(rounds * len(variants)):
        variant = variants[i % len(variants)]
        set_threads(variant)
        found = store.get(f"round/{i}")
        if variant not in sides:
            sides[variant] = (transports.make_receiver(GLOO) if is_transport(variant)
                              else PlainGloo(variant, store, rank, world, plan, targets))
        if is_transport(variant):
            rd = common_pb2.Rendezvous()
            rd.ParseFromString(found)
            sides[variant].receive(rd, rank, plan, targets, deadline_at=time.monotonic() + 120,
                                   abort=threading.Event())
        else:
            sides[variant].round()
        store.set(f"done/{i}/{rank}", b"1")


class LoopLag:
    """An asyncio loop on a thread of its own, ticking every millisecond."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._tick(), self.loop)

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=509)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per variant (after one warm-up each)")
    parser.add_argument("--variants", default="threads:2,threads:8,posted,flat")
    parser.add_argument("--plain-targets", action="store_true",
                        help="each receiver target an allocation of its own, not the reference engine's arena")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if v not in ("posted", "flat", "placed") and not (v.startswith("threads:") and v[8:].isdigit()
                                                          and int(v[8:]) > 0):
            parser.error(f"unknown variant {v!r}: threads:N, posted, flat or placed")
    size, world, rounds = parse_size(args.size), args.engines + 1, args.rounds + 1
    plan, sources = model_tensors(size, args.tensors)
    # What the transport's sends take: the trainer's tensors with their addresses (as the
    # trainer's per-step pass hands them over), and for ``placed`` a copy placed on huge pages.
    given = {"placed": None}
    if "placed" in variants:
        placed = [t.clone() for t in sources]
        place_on_huge_pages(placed)
        given["placed"] = AddressedTensors(placed, tensor_addresses(placed, plan.dtypes, plan.sizes), plan.sizes)
    plain = AddressedTensors(sources, tensor_addresses(sources, plan.dtypes, plan.sizes), plan.sizes)
    store = host_store("127.0.0.1", timeout_s=120)
    receivers = [subprocess.Popen([sys.executable, __file__, "--receiver", str(store.port), str(rank), str(world),
                                   str(size), str(args.tensors), args.variants, str(rounds),
                                   "1" if args.plain_targets else "0"])
                 for rank in range(1, world)]
    lag = LoopLag()
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    lags: dict[str, list[float]] = {v: [] for v in variants}
    sides: dict = {}
    try:
        for i in range(rounds * len(variants)):
            variant = variants[i % len(variants)]
            set_threads(variant)
            rd = rendezvous(store.port, variant, world)
            store.set(f"round/{i}", rd.SerializeToString())
            lag.take()
            start = time.perf_counter()
            if variant not in sides:
                sides[variant] = (transports.make_sender(GLOO, store) if is_transport(variant)
                                  else PlainGloo(variant, store, 0, world, plan, sources))
            if is_transport(variant):
                sides[variant].send(rd, plan, given.get(variant) or plain, deadline_at=time.monotonic() + 120, abort=threading.Event())
            else:
                sides[variant].round()
            store.wait([f"done/{i}/{rank}" for rank in range(1, world)])
            if i >= len(variants):  # the first round of each variant builds its group
                seconds[variant].append(time.perf_counter() - start)
                lags[variant].append(lag.take())
            time.sleep(0.1)
    finally:
        for proc in receivers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    flat = statistics.median(seconds["flat"]) if "flat" in seconds else None
    print(f"{len(plan)} tensors, {plan.total_bytes / 2**20:.0f} MiB, {args.engines} receivers, "
          f"{args.rounds} rounds per variant, alternated")
    print("| variant | median s | min s | / flat | trainer loop lag max ms, median of rounds |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        med = statistics.median(seconds[v])
        ratio = f"{med / flat:.2f}x" if flat else "-"
        print(f"| {v} | {med:.3f} | {min(seconds[v]):.3f} | {ratio} | {statistics.median(lags[v]):.1f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiver"]:
        port, rank, world, size, count, variants, rounds, plain = sys.argv[2:10]
        receiver(int(port), int(rank), int(world), int(size), int(count), variants.split(","), int(rounds),
                 plain == "1")
    else:
        main()
