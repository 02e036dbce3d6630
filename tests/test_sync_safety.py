"""The trainer's loop never stalls and the engine-side order holds whatever happens
(invariants kv-awake, no-resume-mid-transfer, no-torn-serving, trainer-loop-free,
cancel-waits-for-transfer, every-wait-has-a-deadline; docs/invariants.md). Real
coordinator and agents as processes with real transfers; the only fake is the agents'
fault injection, which slows a transfer down or makes it fail on cue (keyed by version
and bucket)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import pytest
import torch

from weightsync.client import EngineClient, SyncFailed, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import FailedPrecondition, StepTimeoutError, TornWeightsError, TransferError
from weightsync.packing import weights_digest
from weightsync.v1 import agent_pb2, common_pb2

BUCKET = 64 * 1024  # the tiny model (~560 KB) becomes 9 buckets


def faulty_cluster(cluster_factory, rules, engines=2, agent_args=(), **kw):
    return cluster_factory(engines, agent_args=("--enable-fault-injection", *agent_args),
                           agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)}, **kw)


def slow(version, seconds=0.08):
    return {"op": "receive", "action": "delay", "version": version, "seconds": seconds, "times": 0}


def fail(version, bucket):
    return {"op": "receive", "action": "fail", "version": version, "bucket": bucket}


async def kinds(address: str) -> list[str]:
    async with EngineClient(address) as engine:
        return [e.kind for e in await engine.events()]


async def wait_for_event(address: str, kind: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while kind not in await kinds(address):
        assert time.monotonic() < end, f"no {kind} event on {address}"
        await asyncio.sleep(0.01)


async def wait_for_bucket(address: str, timeout_s: float = 20.0) -> None:
    """Until the engine's running receive has loaded at least one bucket."""
    end = time.monotonic() + timeout_s
    async with EngineClient(address) as engine:
        while (await engine.state()).buckets_done < 1:
            assert time.monotonic() < end, f"no bucket landed on {address}"
            await asyncio.sleep(0.005)


def in_order(events: list[str], *expected: str) -> bool:
    """``expected`` occur in ``events`` in this order (the last occurrence of each chain)."""
    pos = len(events)
    for kind in reversed(expected):
        try:
            pos = len(events) - 1 - events[::-1].index(kind, len(events) - pos)
        except ValueError:
            return False
    return True


def test_in_order_helper():
    assert in_order(["a", "b", "c"], "a", "c")
    assert not in_order(["c", "a"], "a", "c")
    assert not in_order(["a"], "a", "b")


async def test_sync_does_not_block_the_event_loop(cluster_factory):
    cluster = faulty_cluster(cluster_factory, [slow(1)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=60))
        await asyncio.sleep(0.2)
        # The seed's production failure: a timeout armed by another coroutine fired
        # because the loop was frozen. Here it must not fire.
        async with asyncio.timeout(0.2):
            await asyncio.sleep(0.05)
        assert not sync.done(), "the sync should still be running"
        result = await sync
    assert result.ok and result.total_seconds >= 0.5


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_cancellation_waits_for_transfer_then_kv_then_resume(cluster_factory, transport):
    cluster = faulty_cluster(cluster_factory, [slow(1)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport=transport, bucket_bytes=BUCKET) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, offload_kv=True,
                                                         timeout_s=60))
        await wait_for_event(cluster.agents[0].address, "transfer_started")
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sync
        for agent in cluster.agents:
            events = await kinds(agent.address)
            assert in_order(events, "paused", "kv_asleep", "transfer_started", "transfer_done", "kv_awake",
                            "resumed"), events
        state = await client.get_state(include_digests=True)
    for e in state.engines:
        assert e.weight_version == 1 and not e.paused and not e.torn and not e.asleep_tags and not e.faulted
        assert e.weights_digest == weights_digest(model.named_parameters())


async def test_cancellation_then_transfer_failure_chains_the_error(cluster_factory):
    cluster = faulty_cluster(cluster_factory, [slow(1), fail(1, 5)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport="shm", bucket_bytes=BUCKET) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=60))
        await wait_for_event(cluster.agents[0].address, "transfer_started")
        sync.cancel()
        with pytest.raises(asyncio.CancelledError) as info:
            await sync
        assert isinstance(info.value.__cause__, TransferError), repr(info.value.__cause__)
        for agent in cluster.agents:
            events = await kinds(agent.address)
            assert "transfer_failed" in events and "resumed" not in events, events


@pytest.mark.parametrize("cancel", [False, True], ids=["failure", "cancellation"])
async def test_offload_kv_is_woken_before_any_resume(cluster_factory, cancel):
    cluster = faulty_cluster(cluster_factory, [slow(1), fail(1, 5)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport="shm", bucket_bytes=BUCKET) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, offload_kv=True,
                                                         timeout_s=60))
        if cancel:
            await wait_for_event(cluster.agents[0].address, "transfer_started")
            sync.cancel()
        with pytest.raises((asyncio.CancelledError, SyncFailed)):
            await sync
        for agent in cluster.agents:
            events = await kinds(agent.address)
            assert in_order(events, "kv_asleep", "transfer_failed", "kv_awake"), events
            assert "resumed" not in events  # torn: stays paused
        state = await client.get_state(include_digests=True)
        for e in state.engines:
            assert e.torn and e.torn_version == 1 and e.paused and not e.asleep_tags and not e.faulted
        # explicitly allowing torn weights resumes them, KV already awake, no engine fault
        await client.pause()
        response = await client.resume(allow_torn=True)
        assert all(o.ok for o in response.engines)
        state = await client.get_state()
        assert not any(e.paused or e.faulted for e in state.engines)


async def test_torn_engine_stays_paused_until_a_good_broadcast(cluster_factory):
    cluster = faulty_cluster(cluster_factory, [fail(1, 2)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport="shm", bucket_bytes=BUCKET) as client:
        started = time.monotonic()
        with pytest.raises(SyncFailed) as info:
            await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        # The failure ends the round at once for every engine: none waits out the deadline
        # (an engine once read a key the trainer had just deleted and waited 59 s).
        assert time.monotonic() - started < 30, info.value
        assert not info.value.result.ok and {e.engine_id for e in info.value.result.failed} == {"engine-0",
                                                                                                 "engine-1"}
        assert any("stays paused" in note for note in info.value.__notes__)
        state = await client.get_state()
        assert state.weight_version == 0
        # Each engine that wrote bytes is torn at version 1 and stays paused. With shm's
        # direct reads an engine may fail at bucket 2 and stop the round before the other
        # has read a byte: that one kept its weights (its receive never started), so the
        # resume that follows every sync releases it, serving version 0 like the fleet.
        summary = [(e.engine_id, e.torn, e.torn_version, e.paused, e.weight_version) for e in state.engines]
        torn = [e.engine_id for e in state.engines if e.torn]
        assert torn and all(e.torn_version == 1 and e.paused for e in state.engines if e.torn), summary
        assert all(not e.paused and e.weight_version == 0 for e in state.engines if not e.torn), summary
        # a direct resume is refused with a typed error
        async with EngineClient(next(a.address for a in cluster.agents if a.engine_id == torn[0])) as engine:
            with pytest.raises(TornWeightsError):
                await engine._call(engine.stub.ResumeEngine, agent_pb2.ResumeEngineRequest(
                    idempotency_key=uuid.uuid4().hex), timeout_s=10, operation="resume")
        result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
        assert result.ok
        state = await client.get_state(include_digests=True)
    assert all(not e.torn and not e.paused and e.weight_version == 2 for e in state.engines)
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_agent_killed_mid_transfer(cluster_factory, transport):
    cluster = faulty_cluster(cluster_factory, [slow(1, 0.15)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, transport=transport, bucket_bytes=BUCKET) as client:
        # gloo cannot interrupt a survivor's pending receive: it ends at the deadline
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=10))
        # Killed once bytes are landing (a bucket is in): a kill before the group formed
        # would fail the survivor's rendezvous, which writes nothing and tears nothing.
        await wait_for_bucket(cluster.agents[1].address)
        started = time.monotonic()
        os.kill(cluster.agents[1].proc.pid, signal.SIGKILL)
        with pytest.raises((SyncFailed, StepTimeoutError)):
            await sync
        assert time.monotonic() - started < 10 + 5
        state = await client.get_state()
        survivor = next(e for e in state.engines if e.engine_id == "engine-0")
        assert survivor.paused and survivor.torn and survivor.torn_version == 1
        result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
        assert result.ok and [e.engine_id for e in result.engines] == ["engine-0"]
        state = await client.get_state(include_digests=True)
    survivor = next(e for e in state.engines if e.engine_id == "engine-0")
    assert not survivor.torn and not survivor.paused and survivor.weight_version == 2
    assert survivor.weights_digest == weights_digest(model.named_parameters())


async def test_deadline_names_the_operation_and_leaves_nothing_blocked(cluster_factory):
    cluster = faulty_cluster(cluster_factory, [slow(1, 1.0)])
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
        started = time.monotonic()
        with pytest.raises(StepTimeoutError) as info:
            await client.update_weights(model.named_parameters(), version=1, timeout_s=3.0)
        assert info.value.operation == "broadcast"
        assert time.monotonic() - started < 3.0 + 10
        for agent in cluster.agents:
            await wait_for_event(agent.address, "transfer_failed", timeout_s=10)
        state = await client.get_state()
        assert not any(e.receiving for e in state.engines)
        assert state.round.phase == "failed"


async def test_pause_deadline_names_pause(cluster_factory):
    cluster = cluster_factory(1, agent_args=("--step-delay", "0.05"))
    async with TrainerClient(cluster.address) as client, EngineClient(cluster.agents[0].address) as engine:
        await engine.generate([1, 2, 3], max_tokens=100)
        await asyncio.sleep(0.1)
        with pytest.raises(StepTimeoutError) as info:
            await client.pause(mode="wait", timeout_s=1.5)
        assert info.value.operation == "pause"


async def test_agent_wakes_kv_before_resume_whatever_the_caller_sends(cluster_factory):
    cluster = cluster_factory(1, agent_args=("--step-delay", "0.01"))
    async with EngineClient(cluster.agents[0].address) as engine:
        rid = await engine.generate([5, 6, 7], max_tokens=60)
        await asyncio.sleep(0.1)

        async def call(method, request):
            return await engine._call(method, request, timeout_s=10, operation="test")

        await call(engine.stub.PauseEngine, agent_pb2.PauseEngineRequest(idempotency_key="p1",
                                                                  mode=common_pb2.PAUSE_MODE_KEEP))
        await call(engine.stub.Sleep, agent_pb2.SleepRequest(idempotency_key="s1", tags=["kv_cache"]))
        # the caller "forgets" to wake the KV cache
        await call(engine.stub.ResumeEngine, agent_pb2.ResumeEngineRequest(idempotency_key="r1"))
        gen = await engine.get(rid, wait_s=30)
        assert gen.status == "finished", gen
        events = [e.kind for e in await engine.events()]
        assert in_order(events, "kv_asleep", "kv_awake", "resumed"), events
        state = await engine.state()
        assert not state.faulted and not state.asleep_tags


async def test_cancelled_while_pausing_still_resumes_the_engines(cluster_factory):
    """A cancellation that lands while Pause is in flight: the coordinator finishes the
    Pause it started (the agents' Pause is slowed to 2 s), so the client must resume
    before the cancellation propagates, or the engines stay paused for good."""
    rules = [{"op": "rpc", "action": "delay", "method": "PauseEngine", "seconds": 2.0, "times": 0}]
    cluster = faulty_cluster(cluster_factory, rules)
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        task = asyncio.ensure_future(client.update_weights(model.named_parameters(), version=1, timeout_s=60))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for agent in cluster.agents:  # the Pause the coordinator started did land
            await wait_for_event(agent.address, "paused")
        state = await client.get_state()
    assert state.weight_version == 0
    assert all(not e.paused for e in state.engines), [(e.engine_id, e.paused) for e in state.engines]
    for agent in cluster.agents:
        events = await kinds(agent.address)
        assert events.index("resumed") > events.index("paused"), (agent.engine_id, events)


async def test_two_trainers_at_once_get_whole_rounds_or_typed_refusals(cluster_factory):
    """Two trainers drive one coordinator at the same time (a restarted trainer whose
    old process is still running does this), their versions interleaved. The
    coordinator runs one round step at a time: each of their rounds lands whole or is
    refused with a typed FailedPrecondition (a version not newer than the fleet's, or a
    Pause the other trainer's Resume ended), and afterwards every engine runs, holding
    the bytes of the round that set the fleet's version -- told by that trainer's
    own tensors as sent."""
    cluster = cluster_factory(2)
    sent: dict[int, str] = {}
    outcomes: list[tuple[int, str]] = []

    async def trainer(versions) -> None:
        model = ReferenceLM(PRESETS["tiny"])
        async with TrainerClient(cluster.address) as client:
            for version in versions:
                with torch.no_grad():
                    next(model.parameters()).add_(float(version))
                sent[version] = weights_digest(model.named_parameters())
                try:
                    result = await client.update_weights(model.named_parameters(), version=version, timeout_s=60)
                except FailedPrecondition as exc:
                    outcomes.append((version, exc.reason))
                else:
                    assert result.ok, result
                    outcomes.append((version, "ok"))

    await asyncio.gather(trainer(range(1, 30, 2)), trainer(range(2, 31, 2)))
    assert {reason for _, reason in outcomes} <= {"ok", "VERSION_NOT_NEWER", "FAILED_PRECONDITION"}, outcomes
    landed = max(version for version, reason in outcomes if reason == "ok")
    async with TrainerClient(cluster.address) as client:
        check = await client.check_engines(digest=sent[landed], version=landed, engines=2)
        assert check.ok, check.describe()
        state = await client.get_state()
        assert state.weight_version == landed and state.round.phase == "idle", state
        assert all(e.ready and not e.paused and not e.torn for e in state.engines), state
