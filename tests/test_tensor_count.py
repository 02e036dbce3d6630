"""A round's cost grows with its bytes, not with its tensor count (invariant 15).

Real processes (a coordinator, two reference-engine agents), the same payload size in
~100 and in ~20,000 tensors, rounds timed in this one run. Per-tensor work that is
quadratic, or a rebuild per round, shows as a ratio in the hundreds (20k tensors took
minutes per round before plans, specs and targets were cached); the bound is loose
enough for a busy 2-core machine, where per-tensor Python costs dominate a payload this
small. ``weightsync bench --tensors`` gives the figures at 1 GiB (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time

import pytest

from weightsync.client import TrainerClient
from weightsync.engine.model import ReferenceLM, config_for_size
from weightsync.local_cluster import LocalCluster

PAYLOAD = 128 << 20
MAX_RATIO = 12.0


async def median_round_seconds(tmp: str, tensors: int, rounds: int = 3) -> tuple[float, int]:
    cfg = config_for_size(PAYLOAD, tensors)
    model = ReferenceLM(cfg)
    named = list(model.named_parameters())
    with LocalCluster(tmp, engines=2, agent_args=("--model", cfg.to_json()), agent_timeout_s=240,
                      settle_s=0.5) as cluster:
        return await _rounds(cluster.address, named, rounds), len(named)


async def _rounds(address: str, named, rounds: int) -> float:
    seconds = []
    async with TrainerClient(address, transport="shm") as client:
        await client.update_weights(named, version=1, timeout_s=300)  # first round builds plan and group
        for version in range(2, rounds + 2):
            start = time.perf_counter()
            result = await client.update_weights(named, version=version, timeout_s=300)
            seconds.append(time.perf_counter() - start)
            assert result.ok and len(result.engines) == 2
    return statistics.median(seconds)


@pytest.mark.timeout(600)
async def test_twenty_thousand_tensors_cost_a_small_multiple_of_a_hundred(tmp_path):
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    few, few_count = await median_round_seconds(str(tmp_path / "few"), 100)
    many, many_count = await median_round_seconds(str(tmp_path / "many"), 20_000)
    assert few_count < 200 and many_count > 19_000
    ratio = many / few
    print(f"{PAYLOAD >> 20} MiB: {few_count} tensors {few:.3f} s, {many_count} tensors {many:.3f} s, ratio {ratio:.2f}")
    assert ratio <= MAX_RATIO, f"a round with {many_count} tensors took {ratio:.1f}x one with {few_count}"
