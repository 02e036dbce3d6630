"""Receiver process for the baselines of ``weightsync bench`` (never used by weightsync itself).

``python -m weightsync.apps.bench.worker --store HOST:PORT --rank R --world W --plan-json PATH``

Each baseline is a step driven through the bench's TCPStore: the worker waits for
``go/<method>/<step>``, receives the payload its way, then sets
``done/<method>/<step>/<rank>``; at the end of a method it publishes the digest of
what it received in ``digest/<method>/<rank>`` so the bench can check the bytes.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from weightsync.dtypes import DTYPES
from weightsync.packing import weights_digest
from weightsync.transport.store import connect_store, wait_for_keys

SINK = "weightsync.bench.Sink"


def _wait(store, key: str, timeout_s: float = 600.0) -> None:
    wait_for_keys(store, [key], deadline_at=time.monotonic() + timeout_s, operation=f"bench wait {key}")


class GrpcSink:
    """A gRPC server taking the payload as a client stream of raw byte chunks."""

    def __init__(self, total: int) -> None:
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        handler = grpc.method_handlers_generic_handler(SINK, {"Put": grpc.stream_unary_rpc_method_handler(
            self.put, request_deserializer=None, response_serializer=None)})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def put(self, chunks, context) -> bytes:
        offset = 0
        for chunk in chunks:
            n = len(chunk)
            self.buffer[offset:offset + n].copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
            offset += n
        return str(offset).encode()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--plan-json", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--methods", required=True)
    args = ap.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = connect_store(host, int(port), deadline_at=time.monotonic() + 60)
    with open(args.plan_json) as f:
        specs = [(n, DTYPES[d], tuple(s)) for n, d, s in json.load(f)]
    tensors = [torch.empty(shape, dtype=dtype) for _, dtype, shape in specs]
    names = [n for n, _, _ in specs]
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8)
    pg = None
    sink = None
    for method in args.methods.split(","):
        if method in ("per-tensor-gloo", "flat-gloo") and pg is None:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("bench/gloo", store), args.rank, args.world,
                                       timedelta(seconds=600))
        if method == "grpc-stream" and sink is None:
            sink = GrpcSink(total)
            store.set(f"grpc-port/{args.rank}", str(sink.port))
        for step in range(args.steps):
            _wait(store, f"go/{method}/{step}")
            if method == "per-tensor-gloo":
                for t in tensors:
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    pg.broadcast([t], opts).wait()
            elif method == "flat-gloo":
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([flat], opts).wait()
            elif method == "disk":
                from safetensors.torch import load_file
                loaded = load_file(store.get("disk-path").decode())
                for name, t in zip(names, tensors, strict=True):
                    t.copy_(loaded[name])
                del loaded
            elif method == "grpc-stream":
                _wait(store, f"grpc-done/{step}/{args.rank}")
            store.set(f"done/{method}/{step}/{args.rank}", b"1")
        if method in ("flat-gloo", "grpc-stream"):
            source = flat if method == "flat-gloo" else sink.buffer
            offset = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.reshape(-1).view(torch.uint8).copy_(source[offset:offset + n])
                offset += n
        store.set(f"digest/{method}/{args.rank}", weights_digest(zip(names, tensors, strict=True)))
    _wait(store, "bench/finished")
    if sink is not None:
        sink.server.stop(grace=1).wait(5)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench-worker"
    raise SystemExit(main())
