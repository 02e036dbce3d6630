"""Bad input changes nothing and gets a clear, typed error (real processes, real gRPC)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM, config_for_size
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan
from weightsync.sharding import Owners, SenderParts
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def named(model):
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def extra_tensor(tensors):
    return tensors + [("not.a.weight", torch.zeros(3))]


def wrong_dtype(tensors):
    name, t = tensors[1]
    return tensors[:1] + [(name, t.double())] + tensors[2:]


def wrong_shape(tensors):
    name, t = tensors[1]
    return tensors[:1] + [(name, t.reshape(-1)[:-1].clone())] + tensors[2:]


def missing_tensor(tensors):
    return tensors[1:]


@pytest.mark.parametrize("mutate,expected", [
    (extra_tensor, "not.a.weight"),
    (wrong_dtype, "dtype"),
    (wrong_shape, "shape"),
    (missing_tensor, "lacks"),
])
async def test_bad_plan_is_rejected_and_changes_nothing(cluster, mutate, expected):
    model = ReferenceLM(PRESETS["tiny"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # so a wrongly accepted transfer would be visible
    async with TrainerClient(cluster.address) as client:
        before = await client.get_state(include_digests=True)
        await client.pause()
        with pytest.raises(InvalidArgument) as info:
            await client.broadcast(mutate(named(model)), version=1, timeout_s=30)
        assert expected in str(info.value)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        await client.resume()
        after = await client.get_state(include_digests=True)
    assert after.weight_version == before.weight_version == 0
    for b, a in zip(before.engines, after.engines, strict=True):
        assert a.weights_digest == b.weights_digest
        assert a.weight_version == 0 and not a.torn and not a.paused


async def test_missing_or_malformed_idempotency_key_is_invalid_argument(cluster):
    plan = BucketPlan.from_tensors(named(ReferenceLM(PRESETS["tiny"])))
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for key in ("", "x" * 129, "bad\nkey"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Pause(coordinator_pb2.PauseRequest(idempotency_key=key, mode=common_pb2.PAUSE_MODE_KEEP),
                                 timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "idempotency_key" in info.value.details()
            call = stub.Broadcast(coordinator_pb2.BroadcastRequest(
                idempotency_key=key, version=1, plan=plan.to_proto(), transport=common_pb2.TRANSPORT_KIND_GLOO,
                store_host="127.0.0.1", store_port=1234), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        state = await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=10)
        assert state.round.phase == "idle" and not any(e.paused for e in state.engines)


async def test_a_bad_group_layout_is_refused_and_changes_nothing(cluster):
    """group_layout: one of tensors/flattened/auto, and only with the group transport; the
    client refuses a bad one before any call."""
    plan = BucketPlan.from_tensors(named(ReferenceLM(PRESETS["tiny"])))
    with pytest.raises(InvalidArgument, match="group_layout"):
        TrainerClient(cluster.address, group_layout="packed")
    async with TrainerClient(cluster.address) as client:
        before = await client.get_state(include_digests=True)
        await client.pause()
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            for transport, layout, expected in ((common_pb2.TRANSPORT_KIND_GROUP, "packed", "one of"),
                                                (common_pb2.TRANSPORT_KIND_GLOO, "flattened", "group transport only"),
                                                (common_pb2.TRANSPORT_KIND_SHM, "auto", "group transport only")):
                call = stub.Broadcast(coordinator_pb2.BroadcastRequest(
                    idempotency_key=f"layout-{layout}", version=1, plan=plan.to_proto(), transport=transport,
                    store_host="127.0.0.1", store_port=1234, group_layout=layout), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert expected in info.value.details() and "group_layout" in info.value.details()
        await client.resume()
        after = await client.get_state(include_digests=True)
    assert after.weight_version == 0
    assert [e.weights_digest for e in after.engines] == [e.weights_digest for e in before.engines]
    assert not any(e.paused or e.torn for e in after.engines)


async def test_version_must_increase(cluster):
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(model.named_parameters(), version=5, timeout_s=60)
        await client.pause()
        for stale in (5, 3):
            with pytest.raises(FailedPrecondition) as info:
                await client.broadcast(model.named_parameters(), version=stale, timeout_s=30)
            assert info.value.reason == "VERSION_NOT_NEWER"
        await client.resume()
        state = await client.get_state(include_digests=True)
    assert state.weight_version == 5
    assert {e.weight_version for e in state.engines} == {5}
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


async def test_broadcast_without_pause_is_refused(cluster):
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(model.named_parameters(), version=1, timeout_s=30)
        assert "Pause" in str(info.value)
        state = await client.get_state()
    assert state.weight_version == 0


def fuse_experts(tensors):
    """What a trainer whose model fuses each layer's experts (transformers 5 does, for
    Qwen-MoE and Mixtral) would send: one stacked tensor per layer and matrix kind in
    place of a tensor per expert."""
    out, fused = [], {}
    for name, t in tensors:
        head, sep, rest = name.partition(".experts.")
        if not sep:
            out.append((name, t))
            continue
        kind = rest.split(".", 1)[1]  # "<expert>.<kind>"
        fused.setdefault(f"{head}.experts.{kind.removesuffix('.weight')}", []).append(t)
    return out + [(name, torch.stack(ts)) for name, ts in fused.items()]


async def test_fused_experts_are_refused_with_the_checkpoint_names_to_send(cluster_factory):
    """An engine whose checkpoint keeps each expert apart, a plan with the experts of
    each layer fused: refused before anything changes, naming one of the engine's
    per-expert tensors and where the README says how to send them."""
    config = config_for_size(1 << 20, 200, profile="moe")
    cluster = cluster_factory(1, agent_args=("--model", config.to_json()))
    tensors = named(ReferenceLM(config))
    fused = fuse_experts(tensors)
    assert len(fused) < len(tensors) and any(n.endswith(".experts.gate") for n, _ in fused)
    async with TrainerClient(cluster.address) as client:
        before = await client.get_state(include_digests=True)
        await client.pause()
        with pytest.raises(InvalidArgument) as info:
            await client.broadcast(fused, version=1, timeout_s=30)
        await client.resume()
        after = await client.get_state(include_digests=True)
    message = str(info.value)
    assert "keeps each expert's matrices apart" in message and "Mixture-of-experts models" in message, message
    assert ".moe.experts.0." in message, message
    assert after.weight_version == before.weight_version == 0
    assert after.engines[0].weights_digest == before.engines[0].weights_digest and not after.engines[0].torn


async def test_a_compiled_models_names_are_refused_with_the_wrapper_named(cluster):
    """``torch.compile(model).named_parameters()`` names every tensor under ``_orig_mod.``
    (no compilation happens for that: the wrapper is lazy). Refused before anything
    changes, saying which engine tensor the name wraps and what to send instead; the
    wrapped module's own tensors then sync."""
    model = ReferenceLM(PRESETS["tiny"])
    compiled = torch.compile(model)
    wrapped = [(n, p.detach()) for n, p in compiled.named_parameters()]
    assert all(n.startswith("_orig_mod.") for n, _ in wrapped)
    async with TrainerClient(cluster.address) as client:
        before = await client.get_state(include_digests=True)
        with pytest.raises(InvalidArgument) as info:
            await client.update_weights(wrapped, version=1, timeout_s=30)
        after = await client.get_state(include_digests=True)
        message = str(info.value)
        first = wrapped[0][0]
        assert f"{first!r} is the engine's {first.removeprefix('_orig_mod.')!r}" in message, message
        assert "_orig_mod. prefix" in message and "model._orig_mod" in message, message
        assert after.weight_version == before.weight_version == 0
        assert [e.weights_digest for e in after.engines] == [e.weights_digest for e in before.engines]
        assert not any(e.paused or e.torn for e in after.engines)
        assert (await client.update_weights(compiled._orig_mod.named_parameters(), version=1, timeout_s=30)).ok


async def test_a_bad_sender_host_list_is_refused_and_changes_nothing(cluster):
    """sender_host_ids (auto, a sharded trainer on several hosts): only with owners, a
    host id of 1 to 64 characters for every rank up to the last sender; auto needs it
    or trainer_host_id. Each refused before any engine is asked."""
    plan = BucketPlan.from_tensors(named(ReferenceLM(PRESETS["tiny"])))
    whole = [(i, max(1, shape[0]) if shape else 1) for i, shape in enumerate(plan.shapes)]
    owners = Owners(plan, [SenderParts(s, np.array([i for i, _ in whole[s::2]], dtype=np.int32),
                                       np.zeros(len(whole[s::2]), dtype=np.int64),
                                       np.array([rows for _, rows in whole[s::2]], dtype=np.int64))
                           for s in (0, 1)]).to_proto()
    async with TrainerClient(cluster.address) as client:
        before = await client.get_state(include_digests=True)
        await client.pause()
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            for hosts, with_owners, expected in ((["host-a", "host-b"], False, "owners"),
                                                 (["host-a", ""], True, "1 to 64"),
                                                 (["host-a", "h" * 65], True, "1 to 64"),
                                                 (["host-a"], True, "sender rank 1"),
                                                 ([], True, "needs trainer_host_id")):
                call = stub.Broadcast(coordinator_pb2.BroadcastRequest(
                    idempotency_key=f"hosts-{len(hosts)}-{with_owners}-{expected[:3]}", version=1,
                    plan=plan.to_proto(), transport=common_pb2.TRANSPORT_KIND_AUTO, store_host="127.0.0.1",
                    store_port=1234, sender_host_ids=hosts, owners=owners if with_owners else None), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (hosts, info.value.details())
                assert expected in info.value.details(), (hosts, info.value.details())
        await client.resume()
        after = await client.get_state(include_digests=True)
    assert after.weight_version == 0
    assert [e.weights_digest for e in after.engines] == [e.weights_digest for e in before.engines]
    assert not any(e.paused or e.torn for e in after.engines)
