"""End to end: a coordinator and two agents as real processes, real gRPC, real transfers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.client import EngineClient, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.packing import weights_digest
from weightsync.transport.cross_memory import hugepage_advice


def perturbed(model: ReferenceLM, step: int) -> None:
    """Deterministically changes every weight (stands in for an optimizer step)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


async def assert_engines_equal(client: TrainerClient, model: ReferenceLM, version: int) -> None:
    state = await client.get_state(include_digests=True)
    local = weights_digest(model.named_parameters())
    assert state.weight_version == version
    assert len(state.engines) == 2
    for e in state.engines:
        assert e.weight_version == version, e
        assert e.weights_digest == local, f"{e.engine_id} differs from the trainer at version {version}"
        assert not e.torn and not e.paused


SHM_VARIANTS = {"shm-ring": {"WEIGHTSYNC_SHM_DIRECT": "0"}, "shm-read": {"WEIGHTSYNC_SHM_PUSH": "0"}}


@pytest.mark.parametrize("transport", ["gloo", "shm", "shm-read", "shm-ring"])
async def test_three_rounds_bitwise_equal(cluster_factory, transport):
    """shm goes straight between the trainer's memory and the engines' where the kernel
    allows it (here: same user, no Yama): the trainer writes into the agents' arenas
    where its own tensors are on small pages (this model's are, unless the machine puts
    every allocation on huge pages), else the engines read. "shm-read" is shm with the
    agents opting out of the writes (WEIGHTSYNC_SHM_PUSH=0): they read the trainer's
    memory; "shm-ring" with them opting out of both (WEIGHTSYNC_SHM_DIRECT=0), so the
    shared-memory ring carries every byte."""
    variant = transport
    cluster = cluster_factory(2, agent_env=SHM_VARIANTS.get(variant))
    transport = "shm" if variant.startswith("shm") else transport
    model = ReferenceLM(PRESETS["tiny"])
    # a small bucket forces tensors to span buckets and the double buffer to cycle
    async with TrainerClient(cluster.address, transport=transport, bucket_bytes=64 * 1024) as client:
        for version in (1, 2, 3):
            perturbed(model, version)
            result = await client.update_weights(model.named_parameters(), version=version, timeout_s=60)
            assert result.ok and result.version == version
            assert result.bytes >= sum(p.numel() * 4 for p in model.parameters())
            assert 0.0 < result.transfer_seconds <= result.total_seconds, result  # the trainer's own clock
            assert all(0.0 < e.seconds <= result.total_seconds for e in result.engines), result
            assert [e.engine_id for e in result.engines] == ["engine-0", "engine-1"]
            assert set(result.resumed) == {"engine-0", "engine-1"}
            await assert_engines_equal(client, model, version)
        # the group and buffers were set up once and replayed: one transfer_started per round,
        # and the agents report no re-registration or failure
        for agent in cluster.agents:
            async with EngineClient(agent.address) as engine:
                events = await engine.events()
            kinds = [e.kind for e in events]
            assert kinds.count("transfer_done") == 3
            assert "transfer_failed" not in kinds
            reads = {e.fields.get("read") for e in events if e.kind == "transfer_done"}
            pushed = "push" if hugepage_advice() is not None else "direct"
            assert reads == {"gloo": {None}, "shm": {pushed}, "shm-read": {"direct"}, "shm-ring": {"ring"}}[variant], reads


async def test_keep_pause_request_continues_with_new_version(cluster_factory):
    cluster = cluster_factory(2, agent_args=("--step-delay", "0.02"))
    model = ReferenceLM(PRESETS["tiny"])
    perturbed(model, 1)
    async with TrainerClient(cluster.address) as client, EngineClient(cluster.agents[0].address) as engine:
        rid = await engine.generate([40, 41, 42], max_tokens=60)
        for _ in range(200):  # bounded: until a few tokens exist
            gen = await engine.get(rid)
            if len(gen.tokens) >= 3:
                break
            await asyncio.sleep(0.01)
        assert gen.status == "running" and set(gen.versions) == {0}
        result = await client.update_weights(model.named_parameters(), version=1, mode="keep", timeout_s=60)
        assert result.ok
        gen = await engine.get(rid, wait_s=30)
        assert gen.status == "finished", gen
        assert len(gen.tokens) == 60
        assert gen.versions[0] == 0 and gen.versions[-1] == 1
        assert list(gen.versions) == sorted(gen.versions), "versions within one request only go up"


async def test_abort_pause_ends_in_flight_requests(cluster_factory):
    # 120 tokens at 50 ms each: still generating (6 s) when the abort lands, however slow
    # the machine; the abort ends it at once.
    cluster = cluster_factory(1, agent_args=("--step-delay", "0.05"))
    model = ReferenceLM(PRESETS["tiny"])
    perturbed(model, 1)
    async with TrainerClient(cluster.address) as client, EngineClient(cluster.agents[0].address) as engine:
        rid = await engine.generate([40, 41, 42], max_tokens=120)
        await asyncio.sleep(0.1)
        state = await client.get_state()
        assert state.engines[0].available
        await client.update_weights(model.named_parameters(), version=1, mode="abort", timeout_s=60)
        gen = await engine.get(rid, wait_s=5)
        assert gen.status == "aborted"
        assert set(gen.versions) == {0}
        # the engine serves new requests with the new weights
        rid2 = await engine.generate([40, 41, 42], max_tokens=5)
        gen2 = await engine.get(rid2, wait_s=30)
        assert gen2.status == "finished" and set(gen2.versions) == {1}


async def test_eight_engines_take_every_round_over_each_cpu_transport(cluster_factory):
    """A fleet larger than the other tests': eight agents in one round, the round's
    transport changing from round to round (each change is a new group of nine
    members), every engine checked against the trainer's own tensors after each."""
    cluster = cluster_factory(8)
    model = ReferenceLM(PRESETS["tiny"])
    engines = [f"engine-{i}" for i in range(8)]
    async with TrainerClient(cluster.address, bucket_bytes=256 * 1024) as client:
        for version, transport in enumerate(("shm", "gloo", "group", "shm"), start=1):
            perturbed(model, version)
            result = await client.update_weights(model.named_parameters(), version=version, timeout_s=120,
                                                 transport=transport)
            assert result.ok and sorted(e.engine_id for e in result.engines) == engines, result
            assert set(result.resumed) == set(engines)
            state = await client.get_state(include_digests=True)
            local = weights_digest(model.named_parameters())
            assert sorted(e.engine_id for e in state.engines) == engines
            for e in state.engines:
                assert e.weight_version == version and e.weights_digest == local, (transport, e.engine_id)
                assert not e.torn and not e.paused
