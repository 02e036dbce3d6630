"""The coordinator's and the agents' event-loop lag during a large sync to slow engines.

Starts --engines SGLang stand-ins (tests/sglang_standin.py: SGLang needs CUDA) whose
/health and /model_info take --slow-state seconds, each serving a checkpoint of
--size bytes in --tensors tensors, one agent per stand-in (--metrics-port), and a
coordinator (--metrics-port). Then it syncs --steps times through SGLang's update
group (transport group, gloo) and reads every server's
``weightsync_loop_lag_ms{window="all"}`` and ``{window="recent"}`` (last 10 s).
Also prints the trainer's loop lag and whether any engine was ever reported
unavailable.

    python benchmarks/server_loop_lag.py --size 1GiB --engines 2 --slow-state 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import start_agent, start_coordinator, wait_available  # noqa: E402
from weightsync.client import TrainerClient  # noqa: E402
from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file  # noqa: E402

STANDIN = str(Path(__file__).resolve().parent.parent / "tests" / "sglang_standin.py")


def loop_lag(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weightsync_loop_lag_ms":
                out[sample.labels["window"]] = sample.value
    return out


def weights(size: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    per = max(1, size // 4 // tensors)
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


async def run(args) -> None:
    size = int(float(args.size[:-3]) * (1 << 30)) if args.size.endswith("GiB") else int(float(args.size[:-3]) * (1 << 20))
    tmp = tempfile.mkdtemp(prefix="weightsync-lag-")
    model_dir = os.path.join(tmp, "model")
    os.makedirs(model_dir)
    save_file(weights(size, args.tensors, 0), os.path.join(model_dir, "model.safetensors"))
    procs = []
    try:
        coordinator_metrics = free_port()
        coordinator, address, _ = start_coordinator(tmp, "--metrics-port", str(coordinator_metrics),
                                                    "--heartbeat-timeout", "3")
        procs.append(coordinator)
        agents = []
        for i in range(args.engines):
            port_file = os.path.join(tmp, f"standin-{i}.port")
            standin = spawn([sys.executable, STANDIN, port_file, os.path.join(tmp, f"calls-{i}.jsonl"),
                             "--model-dir", model_dir, "--slow-state", str(args.slow_state)])
            procs.append(standin)
            url = f"http://127.0.0.1:{wait_for_file(port_file, timeout_s=60, proc=standin)}"
            metrics_port = free_port()
            agent = start_agent(tmp, address, f"sglang-{i}", "--engine", "sglang", "--engine-url", url,
                                "--metrics-port", str(metrics_port))
            procs.append(agent.proc)
            agents.append((agent.engine_id, metrics_port))
        wait_available(address, [a for a, _ in agents], timeout_s=120)
        unavailable = 0
        async with TrainerClient(address, transport="group", measure_loop_lag=True) as client:
            for step in range(1, args.steps + 1):
                named = sorted(weights(size, args.tensors, step).items())
                sync = asyncio.create_task(client.update_weights(named, version=step, timeout_s=600))
                while not sync.done():  # watch availability while the bytes move
                    state = await client.get_state()
                    unavailable += sum(not e.available for e in state.engines)
                    await asyncio.sleep(0.25)
                result = sync.result()
                print(f"step {step}: ok={result.ok} total {result.total_seconds:.2f} s, "
                      f"trainer loop lag max {result.loop_lag_ms['max']:.1f} ms")
        print(f"engines reported unavailable during syncs: {unavailable} time(s)")
        print(f"coordinator loop lag (ms): {loop_lag(coordinator_metrics)}")
        for engine_id, port in agents:
            print(f"agent {engine_id} loop lag (ms): {loop_lag(port)}")
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slow-state", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=3)
    started = time.monotonic()
    asyncio.run(run(parser.parse_args()))
    print(f"({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
