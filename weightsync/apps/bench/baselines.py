"""The alternatives ``weightsync bench`` measures against, each doing the same job:
the same payload reaching the same number of receiver processes (``worker.py``).

- ``per-tensor-gloo``: one gloo broadcast per tensor (what many trainers do);
- ``flat-gloo``: one gloo broadcast of one pre-flattened buffer (the gloo floor);
- ``disk``: safetensors save to /dev/shm, each receiver loads it ("update from disk");
- ``grpc-stream``: the bytes streamed through a gRPC call to each receiver;
- ``memcpy``: one in-process copy of the payload (the memory-bandwidth bound).

Each method first runs one untimed step, as each weightsync transport does a warm-up
round: it pays for what a first step alone pays (the receivers' buffers touched for
the first time, gloo's first connections, memcpy's destination allocated). Each timed
step is then timed from the sender's start until every receiver has acknowledged
through the store; at the end each receiver's digest must match the sender's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from weightsync.apps.bench.cpu import CpuMeter
from weightsync.arena import new_arena
from weightsync.dtypes import dtype_name
from weightsync.lifecycle import spawn, stop_process
from weightsync.packing import weights_digest
from weightsync.transport.shm import SHM_DIR
from weightsync.transport.store import host_store, wait_for_keys

METHODS = ("per-tensor-gloo", "flat-gloo", "disk", "grpc-stream", "memcpy")
CHUNK = 4 * 1024 * 1024


class Baselines:
    """Runs the baselines over one set of receiver processes."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], *, engines: int, steps: int, tmp: str,
                 methods: tuple[str, ...] = METHODS, huge_pages: bool = False) -> None:
        """``huge_pages``: the flat buffers (flat-gloo's, disk's and grpc-stream's source,
        memcpy's both ends) on transparent huge pages, as a trainer's weights placed
        there are (``weightsync.arena.place_on_huge_pages``)."""
        self.named = named
        self.tensors = [t for _, t in named]
        self.engines = engines
        self.steps = steps
        self.tmp = tmp
        self.methods = methods
        self.huge_pages = huge_pages
        self.flat = self._buffer(sum(t.nbytes for t in self.tensors))
        torch.cat([t.reshape(-1).view(torch.uint8) for t in self.tensors], out=self.flat)
        self.digest = weights_digest(named)
        self.store = host_store("127.0.0.1", timeout_s=600)
        self.procs = []
        self.pg = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        return new_arena(nbytes) if self.huge_pages else torch.empty(nbytes, dtype=torch.uint8)

    def __enter__(self) -> Baselines:
        plan_path = os.path.join(self.tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump([(n, dtype_name(t.dtype), list(t.shape)) for n, t in self.named], f)
        remote = [m for m in self.methods if m != "memcpy"]
        if remote:
            for rank in range(1, self.engines + 1):
                self.procs.append(spawn([sys.executable, "-m", "weightsync.apps.bench.worker", "--store",
                                         f"127.0.0.1:{self.store.port}", "--rank", str(rank), "--world",
                                         str(self.engines + 1), "--plan-json", plan_path, "--steps",
                                         str(self.steps + 1), "--methods", ",".join(remote)]))
        if any(m.endswith("gloo") for m in remote):
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bench/gloo", self.store), 0, self.engines + 1,
                                            timedelta(seconds=600))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.store.set("bench/finished", b"1")
        except Exception:
            pass
        for proc in self.procs:
            stop_process(proc, grace_s=30)
        path = os.path.join(SHM_DIR, f"weightsync-bench-{os.getpid()}.safetensors")
        if os.path.exists(path):
            os.unlink(path)

    def _wait_done(self, method: str, step: int) -> None:
        keys = [f"done/{method}/{step}/{r}" for r in range(1, self.engines + 1)]
        wait_for_keys(self.store, keys, deadline_at=time.monotonic() + 600, operation=method)

    def processes(self, method: str) -> dict[str, list[int]]:
        """The pids whose CPU time ``method`` costs: this sender's, and the receivers'
        (none for memcpy, which copies in this process)."""
        return {"sender": [os.getpid()], "receivers": [] if method == "memcpy" else [p.pid for p in self.procs]}

    def run(self, method: str, progress: Callable[[int], None] = lambda _s: None,
            cpu: CpuMeter | None = None) -> list[tuple[float, float]]:
        """Runs ``method`` once untimed (the warm-up), then times ``steps`` runs (and, with
        ``cpu``, their CPU time); checks the receivers' bytes at the end. Returns each
        timed step's (wall-clock start, seconds)."""
        self.step(method, 0)  # the warm-up
        timings = []
        for step in range(1, self.steps + 1):
            if cpu is not None:
                cpu.start()
            started_at = time.time()
            timings.append((started_at, self.step(method, step)))
            if cpu is not None:
                cpu.stop()
            progress(step - 1)
        self.check(method)
        return timings

    def step(self, method: str, step: int) -> float:
        """One step of ``method`` (0 is the warm-up; the receivers serve 0 to ``steps``,
        in order): seconds from the sender's start until every receiver has it."""
        start = time.perf_counter()
        getattr(self, "_" + method.replace("-", "_"))(step)
        if method != "memcpy":
            self._wait_done(method, step)
        return time.perf_counter() - start

    def check(self, method: str) -> None:
        """After ``method``'s last step: RuntimeError unless every receiver holds the
        sender's bytes (their digests, against the sender's)."""
        if method == "memcpy":
            return
        keys = [f"digest/{method}/{r}" for r in range(1, self.engines + 1)]
        wait_for_keys(self.store, keys, deadline_at=time.monotonic() + 600, operation=method)
        got = {self.store.get(k).decode() for k in keys}
        if got != {self.digest}:
            raise RuntimeError(f"{method}: receivers did not get the bytes that were sent")

    def _go(self, method: str, step: int) -> None:
        self.store.set(f"go/{method}/{step}", b"1")

    def _per_tensor_gloo(self, step: int) -> None:
        self._go("per-tensor-gloo", step)
        for t in self.tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.pg.broadcast([t], opts).wait()

    def _flat_gloo(self, step: int) -> None:
        self._go("flat-gloo", step)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([self.flat], opts).wait()

    def _disk(self, step: int) -> None:
        from safetensors.torch import save_file
        path = os.path.join(SHM_DIR, f"weightsync-bench-{os.getpid()}.safetensors")
        save_file(dict(self.named), path)
        self.store.set("disk-path", path)
        self._go("disk", step)

    def _grpc_stream(self, step: int) -> None:
        self._go("grpc-stream", step)
        flat = self.flat

        def chunks():
            for offset in range(0, flat.numel(), CHUNK):
                yield flat[offset:offset + CHUNK].numpy().tobytes()

        def send(rank: int) -> None:
            port = int(self.store.get(f"grpc-port/{rank}").decode())
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.max_send_message_length", 64 * 1024 * 1024)]) as channel:
                put = channel.stream_unary("/weightsync.bench.Sink/Put", request_serializer=None,
                                           response_deserializer=None)
                put(chunks(), timeout=600)
            self.store.set(f"grpc-done/{step}/{rank}", b"1")

        threads = [threading.Thread(target=send, args=(r,)) for r in range(1, self.engines + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)

    def _memcpy(self, step: int) -> None:
        if not hasattr(self, "_dst"):
            self._dst = self._buffer(self.flat.numel())
        self._dst.copy_(self.flat)


__all__ = ["Baselines", "METHODS"]
