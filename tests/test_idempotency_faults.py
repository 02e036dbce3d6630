"""Retries, duplicates, lost responses and a coordinator crash never run anything twice
(invariant one-key-one-execution) — on the real stack, with faults injected by the servers' test-only
interceptor and execution counts read back from the agents' event logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import wait_available
from tests.test_sync_safety import BUCKET, kinds, slow, wait_for_event
from weightsync.client import RetryPolicy, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import IdempotencyConflict, OperationAborted, WeightSyncError
from weightsync.idempotency import IdempotencyStore
from weightsync.packing import weights_digest
from weightsync.statedb import StateDB
from weightsync.v1 import coordinator_pb2

PATIENT = RetryPolicy(max_attempts=40, initial_backoff_s=0.05, max_backoff_s=0.5)


def rpc(method, action, times=1, seconds=0.0):
    return {"op": "rpc", "method": method, "action": action, "times": times, "seconds": seconds}


async def execution_counts(cluster) -> dict[str, dict[str, int]]:
    out = {}
    for agent in cluster.agents:
        events = await kinds(agent.address)
        out[agent.engine_id] = {k: events.count(k) for k in ("paused", "transfer_started", "resumed")}
    return out


async def test_lost_responses_on_every_trainer_call_are_replayed(cluster_factory):
    rules = [rpc("Pause", "drop_response"), rpc("Broadcast", "drop_response"), rpc("Resume", "drop_response"),
             rpc("GetState", "delay", seconds=0.3)]
    cluster = cluster_factory(2, coordinator_args=("--enable-fault-injection",))
    # the coordinator was started without the rules; restart it with them on the same state
    os.kill(cluster.coordinator.proc.pid, signal.SIGTERM)
    cluster.coordinator.proc.wait(30)
    proc = cluster.restart_coordinator(name="coordinator-faulty", env={"WEIGHTSYNC_FAULTS": json.dumps(rules)}).proc
    try:
        wait_available(cluster.address, ["engine-0", "engine-1"])
        model = ReferenceLM(PRESETS["tiny"])
        async with TrainerClient(cluster.address, retry=PATIENT) as client:
            result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
            assert result.ok and set(result.resumed) == {"engine-0", "engine-1"}
            state = await client.get_state(include_digests=True)
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
        counts = await execution_counts(cluster)
        assert counts == {e: {"paused": 1, "transfer_started": 1, "resumed": 1} for e in ("engine-0", "engine-1")}
        with open(os.path.join(cluster.tmp, "coordinator-faulty.log")) as f:
            assert f.read().count("injecting drop_response") == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def test_lost_and_duplicated_agent_calls_execute_once(cluster_factory):
    rules = [rpc("Receive", "drop_response", times=2), rpc("PauseEngine", "duplicate"),
             rpc("ResumeEngine", "drop_response")]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        assert result.ok
    assert await execution_counts(cluster) == {
        e: {"paused": 1, "transfer_started": 1, "resumed": 1} for e in ("engine-0", "engine-1")}


async def test_coordinator_killed_mid_broadcast_then_restarted(cluster_factory):
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps([slow(1, 0.3)])})
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET, retry=PATIENT) as client:
        await client.pause()
        broadcast = asyncio.create_task(client.broadcast(model.named_parameters(), version=1, key="crash-1",
                                                         timeout_s=30))
        # Both engines mid-transfer: under load the coordinator's Receive to the second
        # can still be on its way when the first has started.
        for agent in cluster.agents:
            await wait_for_event(agent.address, "transfer_started")
        os.kill(cluster.coordinator.proc.pid, signal.SIGKILL)
        cluster.coordinator.proc.wait(10)
        restarted = cluster.restart_coordinator(name="coordinator-restarted").proc
        try:
            started = time.monotonic()
            try:
                await broadcast
                raise AssertionError("the interrupted broadcast must not report success")
            except OperationAborted as exc:
                assert "not re-run" in str(exc) or "was running" in str(exc)
            # the same key again: the stored ABORTED outcome, nothing re-run
            try:
                await client.broadcast(model.named_parameters(), version=1, key="crash-1", timeout_s=30)
                raise AssertionError("replay must return the stored failure")
            except OperationAborted:
                pass
            # the engines do not wait forever for the old session
            end = time.monotonic() + 30
            while True:
                state = await client.get_state()
                if len(state.engines) == 2 and all(e.available and not e.receiving for e in state.engines):
                    break
                assert time.monotonic() < end, state
                await asyncio.sleep(0.1)
            assert time.monotonic() - started < 30
            counts = await execution_counts(cluster)
            assert all(c["transfer_started"] == 1 for c in counts.values()), counts
            # a new key syncs correctly
            result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
            assert result.ok
            state = await client.get_state(include_digests=True)
            assert state.weight_version == 2
            assert all(e.weight_version == 2 and not e.torn and not e.paused for e in state.engines)
            assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
        finally:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(30)


# ----- property: random interleavings of retries, duplicates, delays and restarts -------

actions = st.lists(st.one_of(
    st.tuples(st.just("call"), st.integers(0, 2), st.booleans(), st.floats(0, 0.01)),  # key, same request?, delay
    st.tuples(st.just("burst"), st.integers(0, 2), st.integers(2, 4), st.floats(0, 0.01)),  # concurrent duplicates
    st.tuples(st.just("restart"), st.just(0), st.just(False), st.just(0.0)),
), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=actions, fail_keys=st.sets(st.integers(0, 2)))
def test_random_interleavings_execute_each_key_at_most_once(tmp_path_factory, schedule, fail_keys):
    path = str(tmp_path_factory.mktemp("idem") / "state.db")
    executions: dict[str, int] = {}
    outcomes: dict[str, set] = {}

    async def scenario():
        db = StateDB(path)
        store = IdempotencyStore(db)

        async def call(k: int, same: bool, delay: float):
            key = f"key-{k}"
            request = coordinator_pb2.ResumeRequest(idempotency_key=key, allow_torn=not same)

            async def execute():
                executions[key] = executions.get(key, 0) + 1
                await asyncio.sleep(delay)
                if k in fail_keys:
                    raise WeightSyncError(f"engine failure for {key}", reason="TRANSFER_FAILED")
                return coordinator_pb2.ResumeResponse()

            try:
                await store.execute(key, "resume", request, execute, coordinator_pb2.ResumeResponse)
                outcome = ("ok", same)
            except IdempotencyConflict:
                outcome = ("conflict", same)
            except WeightSyncError as exc:
                outcome = (exc.reason, same)
            outcomes.setdefault(key, set()).add(outcome)

        try:
            for kind, k, flag, delay in schedule:
                if kind == "call":
                    await call(k, flag, delay)
                elif kind == "burst":
                    await asyncio.gather(*(call(k, True, delay) for _ in range(flag)))
                else:
                    db.close()
                    db = StateDB(path)
                    store = IdempotencyStore(db)
                    store.recover()
        finally:
            db.close()

    asyncio.run(scenario())
    assert all(n <= 1 for n in executions.values()), executions
    for key, seen in outcomes.items():
        first_request = {o for o in seen if o[0] != "conflict"}
        # every caller of the first-used request sees one outcome
        assert len({o[0] for o in first_request}) <= 1, (key, seen)
