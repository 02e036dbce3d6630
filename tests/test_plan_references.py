"""A plan travels whole once, then by id (issue: tensor count).

A 20k-tensor plan is a megabyte: sent whole on every step, to the coordinator and from
it to every engine, it was copied, serialised, parsed and hashed five times per engine
per round. A server that holds the plan takes its id alone; one that does not (it
restarted, or forgot it after newer plans) answers PLAN_UNKNOWN, nothing runs, and the
sender sends the whole plan again under the same key. Real processes and real
restarts; the plan each hop carried is read from the servers' own events.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import wait_available
from tests.test_attestation import perturbed
from tests.test_rounds_end import agent_events, coordinator_events
from weightsync.client import TrainerClient
from weightsync.errors import InvalidArgument, PlanUnknown
from weightsync.idempotency import fingerprint
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan, is_reference
from weightsync.v1 import common_pb2, coordinator_pb2


def small_plan(bucket_bytes: int = 1024) -> BucketPlan:
    import torch
    return BucketPlan.build([(f"w{i}", torch.float32, (8, i + 1)) for i in range(50)], bucket_bytes=bucket_bytes)


def test_a_reference_names_a_plan_this_process_validated():
    plan = small_plan(2048)
    whole = plan.to_proto()
    reference = plan.reference_proto()
    assert is_reference(reference) and not is_reference(whole)
    assert len(reference.SerializeToString()) < 100 < len(whole.SerializeToString())
    taken = BucketPlan.from_proto(whole)
    assert BucketPlan.from_proto(reference) is taken
    stranger = common_pb2.WeightPlan(plan_id="0" * 32, bucket_bytes=2048, total_bytes=taken.total_bytes)
    with pytest.raises(PlanUnknown) as unknown:
        BucketPlan.from_proto(stranger)
    assert unknown.value.nothing_ran and unknown.value.reason == "PLAN_UNKNOWN"
    lying = plan.reference_proto()
    lying.total_bytes += 8
    with pytest.raises(InvalidArgument):
        BucketPlan.from_proto(lying)
    with pytest.raises(InvalidArgument):  # neither tensors nor an id: no plan at all
        BucketPlan.from_proto(common_pb2.WeightPlan(bucket_bytes=2048))


def test_a_request_with_the_whole_plan_and_its_retry_by_id_are_the_same_request():
    plan = small_plan(4096)
    whole = coordinator_pb2.BroadcastRequest(idempotency_key="k", version=3, plan=plan.to_proto())
    by_id = coordinator_pb2.BroadcastRequest(idempotency_key="k", version=3, plan=plan.reference_proto())
    assert fingerprint("broadcast", whole) == fingerprint("broadcast", by_id)
    other = coordinator_pb2.BroadcastRequest(idempotency_key="k", version=3, plan=small_plan(8192).to_proto())
    assert fingerprint("broadcast", other) != fingerprint("broadcast", whole)
    newer = coordinator_pb2.BroadcastRequest(idempotency_key="k", version=4, plan=plan.reference_proto())
    assert fingerprint("broadcast", newer) != fingerprint("broadcast", by_id)


def plans_carried(events, kind: str) -> list[str]:
    return [e.fields["plan"] for e in events if e.kind == kind]


def plan_unknown(events) -> list[str]:
    """Who was asked for a plan by id it did not hold: an engine id, or "" for the
    coordinator itself (asked by the trainer)."""
    return [e.engine_id for e in events if e.kind == "plan_unknown"]


async def test_steps_name_the_plan_by_id_and_restarts_get_it_whole(cluster):
    models = [perturbed(seed) for seed in range(1, 5)]
    async with TrainerClient(cluster.address) as client:
        for version in (1, 2):
            assert (await client.update_weights(models[version - 1].named_parameters(), version=version,
                                                timeout_s=60)).ok
        events = await coordinator_events(cluster.address)
        assert plans_carried(events, "broadcast_started") == ["whole", "by_id"]
        assert plan_unknown(events) == []
        # Each agent took the whole plan in the first round's check; every transfer
        # then named it by id.
        for agent in cluster.agents:
            assert plans_carried(await agent_events(agent.address), "transfer_started") == ["by_id", "by_id"]

        # A restarted coordinator holds no plan: the trainer's step by id is answered
        # PLAN_UNKNOWN, and the same key with the whole plan then runs once.
        os.kill(cluster.coordinator.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(cluster.coordinator.proc.wait, 10)
        await asyncio.to_thread(cluster.restart_coordinator, name="coordinator2")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        assert (await client.update_weights(models[2].named_parameters(), version=3, timeout_s=60)).ok
        events = await coordinator_events(cluster.address)
        assert plan_unknown(events) == [""] and plans_carried(events, "broadcast_started") == ["whole"]

        # A restarted agent is a new process: the coordinator sends it the whole plan
        # at once (it never asks the new process for a plan by id).
        engine_1 = cluster.agent("engine-1")
        os.kill(engine_1.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(engine_1.proc.wait, 10)
        await asyncio.to_thread(cluster.start_agent, "engine-1")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        result = await client.update_weights(models[3].named_parameters(), version=4, timeout_s=60)
        assert result.ok and len(result.engines) == 2, result
        state = await client.get_state(include_digests=True)
    events = await coordinator_events(cluster.address)
    assert plans_carried(events, "broadcast_started") == ["whole", "by_id"]
    assert plan_unknown(events) == [""], "a restarted agent was asked for a plan by id"
    assert {e.weights_digest for e in state.engines} == {weights_digest(models[3].named_parameters())}


async def test_a_plan_the_servers_forgot_is_sent_whole_again(cluster_factory):
    # Servers remember the last 8 plans. Nine clients with nine bucket sizes (nine
    # plans of the same model) push the first one out of the coordinator and of the
    # agent; the first client's next step names it by id, and both hops fall back.
    cluster = cluster_factory(1)
    model = perturbed(5)
    clients = [TrainerClient(cluster.address, bucket_bytes=(64 + 8 * i) * 1024) for i in range(9)]
    try:
        for client in clients:
            await client.start()
        version = 0
        for client in clients:
            version += 1
            assert (await client.update_weights(model.named_parameters(), version=version, timeout_s=60)).ok
        assert plan_unknown(await coordinator_events(cluster.address)) == []
        version += 1
        result = await clients[0].update_weights(perturbed(6).named_parameters(), version=version, timeout_s=60)
        assert result.ok, result
        state = await clients[0].get_state(include_digests=True)
    finally:
        for client in clients:
            await client.aclose()
    assert [e.weights_digest for e in state.engines] == [weights_digest(perturbed(6).named_parameters())]
    assert plan_unknown(await coordinator_events(cluster.address)) == ["", "engine-0"]
    agent = plans_carried(await agent_events(cluster.agents[0].address), "transfer_started")
    assert len(agent) == 10 and set(agent) == {"by_id"}, agent
