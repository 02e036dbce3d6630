"""Trainer event-loop lag during a large sync, next to real HTTP traffic on the same loop.

Starts a coordinator and N agents whose reference engines hold a model of --size
bytes, a local HTTP server in its own process, and a trainer that runs
update_weights while another coroutine on the same loop keeps making HTTP round
trips with a short timeout (the pattern that killed the run in the seed bug).
Prints max / p99 loop lag and how many HTTP requests timed out.

    python benchmarks/loop_lag.py --size 1GiB --engines 2 --transport gloo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

import torch

from weightsync.apps.bench.runner import parse_size
from weightsync.apps.local_cluster import LocalCluster
from weightsync.client import LoopLagProbe, TrainerClient
from weightsync.engine.model import ReferenceLM, config_for_size
from weightsync.lifecycle import spawn, stop_process, wait_for_file

HTTP_SERVER = r"""
import http.server, socketserver, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
with socketserver.ThreadingTCPServer(("127.0.0.1", 0), H) as s:
    open(sys.argv[1], "w").write(str(s.server_address[1])); s.serve_forever()
"""


async def http_loop(port: int, stop: asyncio.Event, timeout_s: float, counts: dict) -> None:
    while not stop.is_set():
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
                await writer.drain()
                await reader.read()
                writer.close()
            counts["ok"] += 1
        except TimeoutError:
            counts["timeouts"] += 1
        await asyncio.sleep(0.005)


def perturb(model: ReferenceLM) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


async def trainer(address: str, cfg, *, steps: int, transport: str, port: int, http_timeout_s: float) -> dict:
    model = ReferenceLM(cfg)
    counts = {"ok": 0, "timeouts": 0}
    stop = asyncio.Event()
    results = []
    async with TrainerClient(address, transport=transport) as client:
        http = asyncio.create_task(http_loop(port, stop, http_timeout_s, counts))
        async with LoopLagProbe(interval_s=0.002) as lag:
            for step in range(1, steps + 1):
                await asyncio.to_thread(perturb, model)  # the "optimizer step", off the loop too
                result = await client.update_weights(model.named_parameters(), version=step, timeout_s=600)
                results.append(result.total_seconds)
        stop.set()
        await http
    return {"bytes": result.bytes, "sync_seconds": results, "loop_lag_ms": {"max": lag.max_ms, "p99": lag.p99_ms},
            "http": counts, "http_timeout_s": http_timeout_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--transport", default="gloo", choices=["gloo", "shm"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--http-timeout", type=float, default=0.1)
    args = ap.parse_args()
    cfg = config_for_size(parse_size(args.size), args.tensors)
    procs = []
    with tempfile.TemporaryDirectory(prefix="weightsync-lag-") as tmp:
        try:
            procs.append(spawn([sys.executable, "-c", HTTP_SERVER, os.path.join(tmp, "http")]))
            port = int(wait_for_file(os.path.join(tmp, "http"), timeout_s=30, proc=procs[-1]))
            with LocalCluster(tmp, engines=args.engines, agent_args=("--model", cfg.to_json()), agent_timeout_s=300,
                              settle_s=1.0) as cluster:
                out = asyncio.run(trainer(cluster.address, cfg, steps=args.steps, transport=args.transport,
                                          port=port, http_timeout_s=args.http_timeout))
        finally:
            for p in reversed(procs):
                stop_process(p, grace_s=10)
    out.update(transport=args.transport, engines=args.engines)
    print(json.dumps(out, indent=2))
    return 0 if out["http"]["timeouts"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
