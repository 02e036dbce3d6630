"""A plan of a million tensors -- the most a plan may list -- sent to a real coordinator
with two agents (real processes). It used to freeze the coordinator's event loop for
9-15 s (a protobuf message and Python objects per tensor, some of it on the loop), long
enough for both engines to be reported unavailable. Now the plan is four packed columns,
checked with whole-array operations off the loop: it must be refused with what is wrong,
while every engine stays available and nothing changes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from weightsync.plan import MAX_TENSORS, BucketPlan
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def expert_plan(count: int) -> BucketPlan:
    """A mixture-of-experts-like plan: ``count`` small tensors with long names."""
    return BucketPlan.build((f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.down_proj.weight", torch.float32,
                              (4,)) for i in range(count))


def test_a_plan_of_a_million_tensors_is_refused_while_every_engine_stays_available(cluster_factory):
    # The service's default heartbeats (every 0.5 s, unavailable after 3 s), not the
    # suite's tighter ones: a plan this size moves 57 MiB through gRPC three times, and
    # the suite may share two cores with another; the freeze this guards against
    # lasted 9-15 s.
    cluster = cluster_factory(2, coordinator_args=("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3.0"))
    plan = expert_plan(MAX_TENSORS)
    wire = plan.to_proto()
    assert len(wire.SerializeToString()) > 40 * 1024 * 1024  # the real thing: tens of megabytes

    async def go():
        async with grpc.aio.insecure_channel(cluster.address, options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024)]) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            before = await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=10)
            events = stub.WatchEvents(coordinator_pb2.WatchEventsRequest(after_seq=0))
            await stub.Pause(coordinator_pb2.PauseRequest(idempotency_key="huge-pause", mode=common_pb2.PAUSE_MODE_ABORT), timeout=30)
            answers: list[coordinator_pb2.GetStateResponse] = []
            done = asyncio.Event()

            async def watch_state():
                while not done.is_set():
                    answers.append(await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=30))
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch_state())
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Broadcast(coordinator_pb2.BroadcastRequest(
                        idempotency_key="huge-broadcast", version=before.weight_version + 1, plan=wire,
                        transport=common_pb2.TRANSPORT_KIND_SHM, store_host="127.0.0.1", store_port=1), timeout=120):
                    pass
            refused_after = time.monotonic() - started
            await asyncio.sleep(3.5)  # a heartbeat lapse shows within the timeout (3 s) after the stall
            done.set()
            await watcher
            after = await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=10)
            await stub.Resume(coordinator_pb2.ResumeRequest(idempotency_key="huge-resume"), timeout=30)
            kinds = []
            while True:  # everything emitted so far, then stop reading
                try:
                    event = await asyncio.wait_for(events.read(), 1.0)
                except TimeoutError:
                    break
                kinds.append((event.event.kind, event.event.engine_id))
            events.cancel()
            return refused.value, refused_after, answers, before, after, kinds

    error, refused_after, answers, before, after, kinds = asyncio.run(go())
    print(f"1M-tensor Broadcast refused after {refused_after:.2f} s; {len(answers)} GetState answers meanwhile")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "engine does not have" in error.details()
    assert answers, "GetState was never answered while the plan was checked"
    assert ("engine_unavailable", "engine-0") not in kinds and ("engine_unavailable", "engine-1") not in kinds, kinds
    for state in answers + [after]:
        assert all(e.available and not e.torn for e in state.engines), state
    assert after.weight_version == before.weight_version
