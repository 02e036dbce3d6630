"""cuda-ipc against a device-to-device memcpy of the same bytes, on one GPU.

The trainer (this process) holds --size bytes in --tensors CUDA tensors; an engine
process on the same GPU receives them over the cuda-ipc transport into CUDA tensors of
its own, --rounds times after a warm-up round. The baseline is one ``copy_`` of a flat
buffer of the same bytes inside one process. The figure that matters is
``memcpy_s / ipc_s``: the fraction of memcpy bandwidth a sync reaches (goal >= 0.8).
``digest_s``: one ``weights_digest`` of the trainer's GPU tensors (from host copies), what
a GPU engine's per-round digest of what it loaded costs.
The first and last rounds are checked bitwise (digests), the others by a checksum on
the GPU, before their times count. Writes JSON.

    python benchmarks/gpu_ipc.py --size 1GiB --size 8GiB --tensors 89 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
import uuid

import torch

from weightsync import transport as transports
from weightsync.apps.bench.runner import parse_size
from weightsync.packing import weights_digest
from weightsync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from weightsync.transport.secure_store import StoreHost
from weightsync.v1 import common_pb2

IPC = common_pb2.TRANSPORT_KIND_CUDA_IPC


def _engine(plan_bytes: bytes, rendezvous_bytes: list[bytes], results) -> None:
    torch.cuda.set_device(0)
    plan = BucketPlan.from_proto(common_pb2.WeightPlan.FromString(plan_bytes))
    targets = [torch.empty(s, dtype=d, device="cuda") for d, s in zip(plan.dtypes, plan.shapes, strict=True)]
    receiver = transports.make_receiver(IPC)
    try:
        for index, blob in enumerate(rendezvous_bytes):
            stats = receiver.receive(common_pb2.Rendezvous.FromString(blob), 1, plan, targets,
                                     deadline_at=time.monotonic() + 120, abort=threading.Event())
            # Hashing gigabytes on the host takes seconds: the first and the last round
            # are checked bitwise, the others by a sum on the GPU.
            last = index in (0, len(rendezvous_bytes) - 1)
            results.put((stats.seconds, weights_digest(zip(plan.names, targets, strict=True)) if last
                         else gpu_checksum(targets)))
    except Exception as exc:
        results.put((-1.0, f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()


def gpu_checksum(tensors) -> str:
    """A cheap check of the bytes (the sum of their int32 words, on the GPU)."""
    total = sum(int(t.contiguous().view(-1).view(torch.uint8)[: t.nbytes // 4 * 4].view(torch.int32)
                    .to(torch.int64).sum()) for t in tensors if t.nbytes >= 4)
    return f"sum:{total}"


def memcpy_seconds(nbytes: int, rounds: int) -> float:
    """Median time of one device-to-device copy of ``nbytes`` (one process)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(size: int, tensors: int, rounds: int, bucket_bytes: int) -> dict:
    per = max(1, size // tensors // 4)
    named = [(f"t{i}", torch.randn(per, device="cuda")) for i in range(tensors)]
    plan = BucketPlan.from_tensors(named, bucket_bytes=bucket_bytes)
    # The store a trainer's rounds meet at (TrainerClient's): the authenticated one, whose
    # waits wake the moment a key is set; torch's TCPStore would be polled.
    store = StoreHost("127.0.0.1", timeout_s=120)
    secret = store.new_secret()  # one for every round: the engine connects once and stays
    group = f"bench-{uuid.uuid4().hex[:8]}"
    rdzvs = [common_pb2.Rendezvous(group_id=group, transport=IPC, store_host="127.0.0.1", store_port=store.port,
                                   store_secret=secret, world_size=2, session_id=uuid.uuid4().hex)
             for _ in range(rounds + 1)]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    engine = spawn.Process(target=_engine, args=(plan.to_proto().SerializeToString(),
                                                 [r.SerializeToString() for r in rdzvs], results))
    engine.start()
    sender = transports.make_sender(IPC, store.client())
    sync, engine_copy = [], []
    digest_s = float("nan")
    try:
        for index, rdzv in enumerate(rdzvs):
            for _, t in named:
                t.add_(1.0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            sender.send(rdzv, plan, [t for _, t in named], deadline_at=time.monotonic() + 120,
                        abort=threading.Event())
            seconds = time.perf_counter() - start
            copy_s, digest = results.get(timeout=120)
            hashed_at = time.perf_counter()
            ours = weights_digest(named) if index in (0, len(rdzvs) - 1) else gpu_checksum([t for _, t in named])
            if index == len(rdzvs) - 1:
                # What a GPU engine's digest of a round costs (the vLLM worker hashes every
                # tensor it loads, from a host copy): the same call on the same tensors.
                digest_s = time.perf_counter() - hashed_at
            if copy_s < 0 or digest != ours:
                raise RuntimeError(f"round {index}: the engine does not hold the bytes sent ({digest})")
            if index:  # the first round maps the blocks: a warm-up
                sync.append(seconds)
                engine_copy.append(copy_s)
    finally:
        sender.close()
        engine.join(60)
        if engine.is_alive():
            engine.kill()
        store.close()
    nbytes = plan.total_bytes
    memcpy = memcpy_seconds(nbytes, rounds)
    ipc = statistics.median(sync)
    return {"bytes": nbytes, "tensors": tensors, "rounds": rounds, "bucket_bytes": bucket_bytes,
            "ipc_sync_s": ipc, "engine_copy_s": statistics.median(engine_copy), "memcpy_s": memcpy,
            "digest_s": digest_s, "digest_gbps": nbytes / digest_s / 1e9,
            "fraction_of_memcpy": memcpy / ipc, "ipc_gbps": nbytes / ipc / 1e9, "memcpy_gbps": nbytes / memcpy / 1e9,
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", default=None,
                        help="payload (repeatable; default 1GiB and 8GiB: a round's fixed cost, a few store round "
                             "trips, weighs on a 1 GiB copy, about half a millisecond on an H200)")
    parser.add_argument("--tensors", type=int, action="append", default=None, help="repeatable; default 89 and 2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    out = []
    for size in args.size or ["1GiB", "8GiB"]:
        for tensors in args.tensors or [89, 2048]:
            result = run(parse_size(size), tensors, args.rounds, args.bucket_bytes)
            out.append(result)
            print(f"{size:>6} {tensors:>6} tensors: cuda-ipc {result['ipc_sync_s'] * 1e3:8.2f} ms "
                  f"(engine copy {result['engine_copy_s'] * 1e3:.2f} ms), memcpy {result['memcpy_s'] * 1e3:8.2f} ms, "
                  f"{result['fraction_of_memcpy']:.2f} of memcpy bandwidth; digest from the GPU "
                  f"{result['digest_s'] * 1e3:.0f} ms", flush=True)
            if args.json:  # after every shape: a run cut short by its time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
