"""Behavioural attestation with reference engines: real coordinator and agent processes.

The probe's expected log-probs come from the trainer's ``ReferenceLM.forward`` (the
batched training pass); each engine scores with ``forward_cached`` on a scratch KV
cache (its serving pass), so the two sides share weights, not code paths. The broken load is the
agents' test-only fault ``stale_tensor``: the bytes arrive, the engine keeps computing
with one old tensor.
"""

from __future__ import annotations

import json
import math

import grpc
import pytest
import torch

from tests.conftest import Cluster
from weightsync.attest import MAX_SEQUENCES, Probe, default_tolerance
from weightsync.client import EngineClient, SyncFailed, TrainerClient
from weightsync.client import prepared_weights as trainer_module
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.engine.reference import ReferenceEngine
from weightsync.errors import EngineOutputMismatch, InvalidArgument
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

SEQUENCES = [[1, 2, 3, 4, 5, 6, 7, 8], [200, 17, 42, 9], [65, 66]]


def perturbed(seed: int, preset: str = "tiny") -> ReferenceLM:
    """A reference model of ``preset`` moved by seeded noise (every seed different)."""
    model = ReferenceLM(PRESETS[preset])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def probe_of(model: ReferenceLM):
    return lambda: Probe.from_model(model, SEQUENCES)


# ----- the probe itself ----------------------------------------------------------------

def test_probe_is_validated_and_round_trips():
    good = Probe(((1, 2, 3),), ((-0.5, -1.5),), 1e-3)
    assert Probe.from_proto(good.to_proto()) == good
    bad = [
        dict(sequences=((1, 2, 3),), logprobs=((-0.5, -1.5),), tolerance=0.0),
        dict(sequences=((1, 2, 3),), logprobs=((-0.5, -1.5),), tolerance=math.nan),
        dict(sequences=((1,),), logprobs=((),), tolerance=1e-3),
        dict(sequences=((1, 2, 3),), logprobs=((-0.5,),), tolerance=1e-3),
        dict(sequences=((1, 2, 3),), logprobs=((-0.5, math.inf),), tolerance=1e-3),
        dict(sequences=((1, 2, 3),), logprobs=((-0.5, 0.7),), tolerance=1e-3),
        dict(sequences=((1, -2, 3),), logprobs=((-0.5, -0.5),), tolerance=1e-3),
        dict(sequences=(), logprobs=(), tolerance=1e-3),
        dict(sequences=((1, 2),) * (MAX_SEQUENCES + 1), logprobs=((-1.0,),) * (MAX_SEQUENCES + 1), tolerance=1e-3),
    ]
    for fields in bad:
        with pytest.raises(InvalidArgument):
            Probe(**fields)


def test_compare_names_the_worst_position_and_treats_nan_as_a_mismatch():
    probe = Probe(((1, 2, 3), (4, 5)), ((-1.0, -2.0), (-3.0,)), 1e-3)
    worst = probe.compare([[-1.0, -2.0001], [-3.5]])
    assert (worst.sequence, worst.position, worst.got) == (1, 1, -3.5)
    assert worst.max_diff == pytest.approx(0.5)
    assert math.isinf(probe.compare([[-1.0, math.nan], [-3.0]]).max_diff)
    with pytest.raises(InvalidArgument):
        probe.compare([[-1.0, -2.0]])


def test_engine_scores_with_its_serving_path_what_the_trainer_computes():
    model = perturbed(3)
    probe = Probe.from_model(model, SEQUENCES)
    assert probe.tolerance == default_tolerance(torch.float32)
    engine = ReferenceEngine(PRESETS["tiny"])
    try:
        engine.pause(common_pb2.PAUSE_MODE_KEEP)
        assert probe.compare(engine.score(SEQUENCES)).max_diff > 0.1, "different weights must show"
        with torch.no_grad():
            for (_, mine), theirs in zip(engine.named_tensors(), model.parameters(), strict=True):
                mine.copy_(theirs)
        assert probe.compare(engine.score(SEQUENCES)).max_diff < 1e-5
    finally:
        engine.close()


# ----- through the service -------------------------------------------------------------

async def test_attested_sync_reports_each_engines_difference(cluster: Cluster):
    model = perturbed(1)
    async with TrainerClient(cluster.address) as client:
        result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60,
                                             attest=probe_of(model))
    assert result.ok and len(result.engines) == 2 and len(result.resumed) == 2
    for engine in result.engines:
        assert engine.attest_max_diff is not None and engine.attest_max_diff < 1e-5, engine
    async with EngineClient(cluster.agents[0].address) as engine:
        events = [e.kind for e in await engine.events()]
    assert "attested" in events


async def test_an_engine_that_does_not_compute_with_the_new_weights_is_torn_and_paused(cluster_factory):
    rules = [{"op": "receive", "action": "stale_tensor", "version": 2, "tensor": "head.weight"}]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    first, second = perturbed(1), perturbed(2)
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(first.named_parameters(), version=1, timeout_s=60, attest=probe_of(first))
        # The bytes and their digest are right; the engines keep the old output layer.
        with pytest.raises(EngineOutputMismatch) as caught:
            await client.update_weights(second.named_parameters(), version=2, timeout_s=60, verify_digest=False,
                                        attest=probe_of(second))
        assert caught.value.reason == "ENGINE_OUTPUT_MISMATCH"
        for engine in caught.value.result.engines:
            assert not engine.ok and engine.error_reason == "ENGINE_OUTPUT_MISMATCH"
            assert engine.attest_max_diff > 0.01 and "log-prob difference" in engine.error_message
        state = await client.get_state()
        assert state.weight_version == 1
        for engine in state.engines:
            assert engine.torn and engine.paused and engine.torn_version == 2 and engine.weight_version == 1
        # Nothing resumes onto the engines: a plain resume is refused, the round stays paused.
        resumed = await client.resume()
        assert all(not o.ok and o.error_reason == "TORN_WEIGHTS" for o in resumed.engines)
        # A good round (the fault fired once per engine) heals them.
        result = await client.update_weights(second.named_parameters(), version=3, timeout_s=60,
                                             attest=probe_of(second))
        assert result.ok and len(result.resumed) == 2
        assert all(e.attest_max_diff < 1e-5 for e in result.engines)


async def test_verify_digest_catches_a_stale_tensor_and_names_a_digest_of_another_kind(cluster_factory, monkeypatch):
    """The same stale output layer, checked by bytes instead of outputs: with
    ``verify_digest`` every engine's digest of what it holds differs from the
    trainer's, the round fails and leaves them torn. A trainer whose digests are of
    another kind (a release that hashed otherwise: 40 hex digits) is told so, not that
    the weights differ."""
    rules = [{"op": "receive", "action": "stale_tensor", "version": 2, "tensor": "head.weight"}]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    first, second, third = perturbed(1), perturbed(2), perturbed(3)
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(first.named_parameters(), version=1, timeout_s=60, verify_digest=True)
        with pytest.raises(SyncFailed) as caught:
            await client.update_weights(second.named_parameters(), version=2, timeout_s=60, verify_digest=True)
        assert all(not e.ok and "do not match the trainer's digest" in e.error_message
                   for e in caught.value.result.engines), caught.value
        state = await client.get_state()
        assert state.weight_version == 1 and all(e.torn and e.torn_version == 2 for e in state.engines)

        monkeypatch.setattr(trainer_module, "weights_digest", lambda _named: "ab" * 20)
        with pytest.raises(SyncFailed) as other_kind:
            await client.update_weights(third.named_parameters(), version=3, timeout_s=60, verify_digest=True)
        assert all("digest is of another kind" in e.error_message and "40 hex digits" in e.error_message
                   for e in other_kind.value.result.engines), other_kind.value
        monkeypatch.undo()
        result = await client.update_weights(third.named_parameters(), version=4, timeout_s=60, verify_digest=True)
        assert result.ok and len(result.resumed) == 2


async def test_an_engine_that_fails_its_checks_does_not_stop_a_slower_engine_on_the_same_lane(cluster_factory):
    """Both engines read one shm lane. engine-1 gets every byte, then fails its
    attestation while engine-0 (delayed after its first bucket) is still reading. The
    trainer's send is not the cause, so it must go on: engine-0 ends with version 2,
    trusted; only engine-1 is torn. (Before the fix the coordinator told the trainer to
    stop the lane, and engine-0 was torn by a failure that was not its own.)"""
    rules = [{"op": "receive", "action": "stale_tensor", "version": 2, "tensor": "head.weight", "engine": "engine-1"},
             {"op": "receive", "action": "delay", "version": 2, "bucket": 0, "seconds": 3.0, "engine": "engine-0"}]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    first, second = perturbed(1), perturbed(2)
    async with TrainerClient(cluster.address, bucket_bytes=16 * 1024) as client:
        await client.update_weights(first.named_parameters(), version=1, timeout_s=60, attest=probe_of(first))
        with pytest.raises(EngineOutputMismatch) as caught:
            await client.update_weights(second.named_parameters(), version=2, timeout_s=60, transport="shm",
                                        verify_digest=False, attest=probe_of(second))
        by_id = {e.engine_id: e for e in caught.value.result.engines}
        assert caught.value.result.bytes > 4 * 16 * 1024, "the plan must have several buckets"
        assert not by_id["engine-1"].ok and by_id["engine-1"].error_reason == "ENGINE_OUTPUT_MISMATCH"
        assert by_id["engine-0"].ok, by_id["engine-0"]
        assert by_id["engine-0"].attest_max_diff < 1e-5
        state = {e.engine_id: e for e in (await client.get_state()).engines}
        assert not state["engine-0"].torn and state["engine-0"].weight_version == 2
        assert state["engine-1"].torn and state["engine-1"].torn_version == 2 and state["engine-1"].paused
    async with EngineClient(cluster.agents[0].address) as engine:
        events = [e.kind for e in await engine.events()]
    assert "transfer_done" in events and "transfer_failed" not in events


async def test_a_probe_the_engines_cannot_run_is_refused_before_anything_changes(cluster: Cluster):
    model = perturbed(1)
    outside_vocab = Probe(((1, 2, 300),), ((-1.0, -1.0),), 1e-3)  # the tiny model has 256 tokens
    async with TrainerClient(cluster.address) as client:
        await client.pause()
        with pytest.raises(InvalidArgument, match="vocabulary"):
            await client.broadcast(model.named_parameters(), version=1, attest=outside_vocab, timeout_s=30)
        with pytest.raises(InvalidArgument, match="Probe"):
            await client.broadcast(model.named_parameters(), version=1, attest=lambda: "not a probe", timeout_s=30)
        await client.resume()
        state = await client.get_state()
    assert state.weight_version == 0
    assert all(not e.torn and not e.paused for e in state.engines)


async def test_the_coordinator_rejects_a_malformed_probe_with_invalid_argument(cluster: Cluster):
    model = ReferenceLM(PRESETS["tiny"])
    plan = Probe.from_model(model, SEQUENCES)
    bad = plan.to_proto()
    bad.sequences[0].logprobs.pop()  # one log-prob short
    async with TrainerClient(cluster.address) as client:
        from weightsync.plan import BucketPlan
        specs = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
        request = coordinator_pb2.BroadcastRequest(
            idempotency_key="malformed-probe", version=1, plan=BucketPlan.build(specs).to_proto(),
            transport=common_pb2.TRANSPORT_KIND_GLOO, store_host="127.0.0.1", store_port=1, probe=bad)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Broadcast(request, timeout=30):
                    pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "log-probs" in caught.value.details()
        assert (await client.get_state()).weight_version == 0
