"""Rounds always end, promptly and in a known state (issue: chaos-proof rounds).

Real coordinator and agent processes and real signals throughout; a coordinator bug
is provoked with its test-only fault injection (``op: "round"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from tests.conftest import start_agent, wait_available
from tests.test_attestation import perturbed
from tests.test_sync_safety import BUCKET, slow, wait_for_event
from weightsync.client import EngineClient, RetryPolicy, SyncFailed, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import EngineUnavailable, WeightSyncError
from weightsync.idempotency import derive_key
from weightsync.lifecycle import stop_process
from weightsync.packing import weights_digest


async def agent_events(address: str):
    async with EngineClient(address) as engine:
        return await engine.events()


async def test_agent_that_deregisters_during_a_pause_fails_that_engine_at_once(cluster_factory):
    # engine-1's Pause hangs for 30 s in its interceptor; SIGTERM makes it deregister,
    # which closes the coordinator's channel under the call in flight.
    cluster = cluster_factory(1)
    slow_pause = [{"op": "rpc", "action": "delay", "method": "PauseEngine", "seconds": 30}]
    stuck = start_agent(cluster.tmp, cluster.address, "engine-1", "--enable-fault-injection",
                        "--shutdown-grace", "1", env={"WEIGHTSYNC_FAULTS": json.dumps(slow_pause)})
    try:
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        async with TrainerClient(cluster.address) as client:
            pausing = asyncio.create_task(client.pause(timeout_s=45))
            await asyncio.sleep(1.0)  # the Pause is in flight to both engines
            started = time.monotonic()
            stuck.proc.send_signal(signal.SIGTERM)
            response = await asyncio.wait_for(pausing, timeout=40)
            waited = time.monotonic() - started
            outcomes = {o.engine_id: o for o in response.engines}
            assert outcomes["engine-0"].ok
            assert not outcomes["engine-1"].ok
            assert outcomes["engine-1"].error_reason == "ENGINE_UNAVAILABLE", outcomes["engine-1"]
            # Before the fix the trainer waited out its whole deadline (the call was
            # cancelled by the closed channel and nobody answered).
            assert waited < 15, f"the trainer waited {waited:.1f}s for a deregistered engine"
            await client.resume()
        assert await asyncio.to_thread(stuck.proc.wait, 30) == 0
    finally:
        stop_process(stuck.proc, grace_s=10)


async def test_a_get_state_that_asks_an_engine_as_it_deregisters_answers_at_once(cluster_factory):
    # The coordinator's GetState asks every engine; engine-1 answers 30 s late, and
    # SIGTERM makes it deregister meanwhile, which closes the coordinator's channel
    # under that question. Before the fix the handler ended without an answer and the
    # trainer waited out its own 60 s deadline (seen in CI right after a failed round).
    cluster = cluster_factory(1)
    slow_state = [{"op": "rpc", "action": "delay", "method": "GetEngineState", "seconds": 30, "times": 0}]
    stuck = start_agent(cluster.tmp, cluster.address, "engine-1", "--enable-fault-injection",
                        "--shutdown-grace", "1", env={"WEIGHTSYNC_FAULTS": json.dumps(slow_state)})
    try:
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        async with TrainerClient(cluster.address) as client:
            # With digests the coordinator waits up to 30 s for each engine's answer.
            asking = asyncio.create_task(client.get_state(include_digests=True))
            await asyncio.sleep(1.0)
            started = time.monotonic()
            stuck.proc.send_signal(signal.SIGTERM)
            state = await asyncio.wait_for(asking, timeout=45)
            waited = time.monotonic() - started
            assert waited < 15, f"GetState took {waited:.1f}s after engine-1 deregistered"
            views = {e.engine_id: e for e in state.engines}
            assert views["engine-0"].available and views["engine-0"].weights_digest
            assert not views["engine-1"].available
            assert "went away" in views["engine-1"].fault, views["engine-1"]
            after = await client.get_state()
            assert [e.engine_id for e in after.engines] == ["engine-0"]
        assert await asyncio.to_thread(stuck.proc.wait, 30) == 0
    finally:
        stop_process(stuck.proc, grace_s=10)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_agent_that_deregisters_during_a_receive_fails_the_round_promptly(cluster_factory, transport):
    cluster = cluster_factory(1)
    slow_receive = [slow(1, 0.5)]  # 9 buckets x 0.5 s: the transfer is still running at SIGTERM
    stuck = start_agent(cluster.tmp, cluster.address, "engine-1", "--enable-fault-injection",
                        "--shutdown-grace", "0.5", env={"WEIGHTSYNC_FAULTS": json.dumps(slow_receive)})
    model = ReferenceLM(PRESETS["tiny"])
    try:
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        async with TrainerClient(cluster.address, bucket_bytes=BUCKET, transport=transport) as client:
            await client.pause()
            sync = asyncio.create_task(client.broadcast(model.named_parameters(), version=1, timeout_s=60))
            await wait_for_event(stuck.address, "transfer_started")
            started = time.monotonic()
            stuck.proc.send_signal(signal.SIGTERM)
            with pytest.raises(SyncFailed) as failure:
                await asyncio.wait_for(sync, timeout=50)
            waited = time.monotonic() - started
            # The collective breaks for every member when one leaves; engine-1 is among the failed.
            assert "engine-1" in {e.engine_id for e in failure.value.result.failed}
            assert waited < 20, f"the round took {waited:.1f}s to notice a deregistered engine"
            state = await client.get_state()
            assert state.round.phase == "failed"
        # The README: abandoning a transfer at shutdown is not a failed step -> exit 0.
        assert await asyncio.to_thread(stuck.proc.wait, 30) == 0
        assert "abandoning the running transfer" in open(stuck.log_path).read()
    finally:
        stop_process(stuck.proc, grace_s=10)


async def test_an_unexpected_error_inside_a_broadcast_does_not_leave_the_round_broadcasting(cluster_factory):
    # The coordinator raises once inside the transfer phase, as a bug would.
    bug = [{"op": "round", "action": "fail", "method": "transfer"}]
    cluster = cluster_factory(2, coordinator_args=("--enable-fault-injection",),
                              coordinator_env={"WEIGHTSYNC_FAULTS": json.dumps(bug)})
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
        await client.pause()
        with pytest.raises(WeightSyncError, match="injected failure in the transfer phase"):
            await client.broadcast(model.named_parameters(), version=1, timeout_s=60)
        state = await client.get_state()
        assert state.round.phase == "failed", "the round must not stay 'broadcasting'"
        # The next round runs: its Pause is not refused as "a broadcast is running".
        result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
        assert result.ok
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


async def test_two_trainers_alternating_never_reuse_a_dropped_group(cluster_factory):
    # Each agent keeps one gloo group; A's group is dropped when B's round builds its
    # own, so A's third round must get a new group id, not the one A still holds.
    cluster = cluster_factory(2)
    models = [perturbed(seed) for seed in (1, 2, 3)]
    async with TrainerClient(cluster.address) as a, TrainerClient(cluster.address) as b:
        for version, client in enumerate((a, b, a), start=1):
            result = await client.update_weights(models[version - 1].named_parameters(), version=version,
                                                 timeout_s=60)
            assert result.ok, result
        state = await a.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(models[2].named_parameters())}


async def test_a_membership_that_recurs_gets_a_new_group(cluster_factory):
    # Rounds over {0,1,2}, then {0,2} while engine-1 is down, then {0,1,2} again after
    # it restarts: the third round must not reuse the first round's id and store keys.
    cluster = cluster_factory(3)
    models = [perturbed(seed) for seed in (1, 2, 3)]
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(models[0].named_parameters(), version=1, timeout_s=60)).ok
        os.kill(cluster.agent("engine-1").proc.pid, signal.SIGKILL)
        await asyncio.to_thread(cluster.agent("engine-1").proc.wait, 10)
        end = time.monotonic() + 15
        while any(e.available for e in (await client.get_state()).engines if e.engine_id == "engine-1"):
            assert time.monotonic() < end, "the killed engine still counts as available"
            await asyncio.sleep(0.1)
        result = await client.update_weights(models[1].named_parameters(), version=2, timeout_s=60)
        assert [e.engine_id for e in result.engines] == ["engine-0", "engine-2"]
        await asyncio.to_thread(cluster.start_agent, "engine-1")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1", "engine-2"])
        result = await client.update_weights(models[2].named_parameters(), version=3, timeout_s=60)
        assert result.ok and len(result.engines) == 3, result
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(models[2].named_parameters())}


async def test_a_restarted_trainer_retries_its_whole_sync_with_its_key(cluster):
    model = perturbed(7)
    async with TrainerClient(cluster.address) as first:
        result = await first.update_weights(model.named_parameters(), version=1, key="sync-v1", timeout_s=60)
        assert result.ok
    # A new process hosts a new store (another port): the retry must get the stored
    # outcome, not IDEMPOTENCY_KEY_REUSED, and nothing may run again.
    async with TrainerClient(cluster.address) as restarted:
        again = await restarted.update_weights(model.named_parameters(), version=1, key="sync-v1", timeout_s=60)
        assert again.ok and again.version == 1
        assert sorted(e.engine_id for e in again.engines) == ["engine-0", "engine-1"]
        # A trainer that died right after its Pause: the retry replays that Pause and
        # runs the rest once.
        await restarted.pause(key=derive_key("sync-v2", "pause"), version=2, sync_key="sync-v2")
    async with TrainerClient(cluster.address) as third:
        result = await third.update_weights(perturbed(8).named_parameters(), version=2, key="sync-v2",
                                            timeout_s=60)
        assert result.ok
        state = await third.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(perturbed(8).named_parameters())}
    for agent in cluster.agents:
        events = [e.kind for e in await agent_events(agent.address)]
        assert events.count("transfer_started") == 2, events  # one per logical sync
        assert events.count("paused") == 2, events


async def test_a_sync_right_after_a_coordinator_restart_waits_for_the_engines(cluster):
    model = perturbed(3)
    cluster.coordinator.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(cluster.coordinator.proc.wait, 30) == 0
    await asyncio.to_thread(cluster.restart_coordinator, name="coordinator2")
    # No waiting for the agents to heartbeat again: the coordinator waits for them
    # (they are known from before the restart) instead of syncing a subset or none.
    async with TrainerClient(cluster.address) as client:
        result = await client.update_weights(model.named_parameters(), version=1, key="after-restart",
                                             timeout_s=60)
        assert result.ok
        assert sorted(e.engine_id for e in result.engines) == ["engine-0", "engine-1"], result
        assert result.skipped == ()


async def test_try_again_outcomes_are_not_stored_for_the_key(cluster_factory):
    cluster = cluster_factory(1)
    agent = cluster.agents[0].proc
    async with TrainerClient(cluster.address) as client:
        os.kill(agent.pid, signal.SIGSTOP)  # frozen: its heartbeats stop
        try:
            end = time.monotonic() + 15
            while any(e.available for e in (await client.get_state()).engines):
                assert time.monotonic() < end, "a frozen engine still counts as available"
                await asyncio.sleep(0.1)
            with pytest.raises(EngineUnavailable, match="no engine is available"):
                await client.pause(key="pause-1", timeout_s=10)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0"])
        # Nothing ran the first time, so the same key now runs (before: the stored
        # "no engine is available" was replayed for ever).
        response = await client.pause(key="pause-1", timeout_s=10)
        assert [o.engine_id for o in response.engines if o.ok] == ["engine-0"]
        await client.resume()


async def test_a_retry_that_attaches_to_a_running_broadcast_gets_its_rendezvous(cluster_factory):
    # The first Broadcast stream breaks before the rendezvous reaches the trainer; the
    # round goes on. The retry (same key) attaches to it and must be told where to send.
    broken = [{"op": "rpc", "action": "drop_stream", "method": "Broadcast"}]
    cluster = cluster_factory(2, coordinator_args=("--enable-fault-injection",),
                              coordinator_env={"WEIGHTSYNC_FAULTS": json.dumps(broken)})
    model = perturbed(5)
    async with TrainerClient(cluster.address, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1)) as client:
        started = time.monotonic()
        result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        assert result.ok
        assert time.monotonic() - started < 30  # before the fix it waited out the deadline, then failed
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
    assert "injecting drop_stream into Broadcast" in open(os.path.join(cluster.tmp, "coordinator.log")).read()
    for agent in cluster.agents:
        assert [e.kind for e in await agent_events(agent.address)].count("transfer_started") == 1


async def coordinator_events(address: str, timeout_s: float = 2.0) -> list:
    """The coordinator's event stream so far (WatchEvents, read until it goes quiet)."""
    import grpc

    from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

    events = []
    async with grpc.aio.insecure_channel(address) as channel:
        stream = coordinator_pb2_grpc.CoordinatorServiceStub(channel).WatchEvents(coordinator_pb2.WatchEventsRequest())
        try:
            while True:
                events.append((await asyncio.wait_for(stream.read(), timeout=timeout_s)).event)
        except TimeoutError:
            stream.cancel()
    return events


async def test_events_carry_the_key_of_their_operation(cluster):
    model = perturbed(11)
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(model.named_parameters(), version=1, key="sync-events")).ok
    keys = {step: derive_key("sync-events", step) for step in ("pause", "broadcast", "resume")}
    by_kind = {}
    for event in await coordinator_events(cluster.address):
        by_kind.setdefault(event.kind, []).append(event.idempotency_key)
    assert by_kind["paused"] == [keys["pause"]]
    assert by_kind["broadcast_started"] == by_kind["broadcast_done"] == [keys["broadcast"]]
    assert by_kind["resumed"] == [keys["resume"]]
    for agent in cluster.agents:
        mine = derive_key(keys["broadcast"], agent.engine_id)  # the coordinator's key for this engine
        started = [e.idempotency_key for e in await agent_events(agent.address) if e.kind == "transfer_started"]
        assert started == [mine], "one execution per key, and the event says which"


async def test_a_slow_getstate_from_an_agent_that_heartbeats_is_not_unavailable(cluster_factory):
    """The other side of the test below: an agent that answers GetState late (always 3 s, past
    the coordinator's 2 s probe; its channel busy, say, with a plan of tens of MiB) but
    keeps heartbeating is alive. It stays available, and no engine_unavailable event
    says otherwise (seen on CI: a 1M-tensor plan made a probe time out)."""
    slow_state = [{"op": "rpc", "action": "delay", "method": "GetEngineState", "seconds": 3, "times": 0}]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(slow_state)})
    async with TrainerClient(cluster.address) as client:
        started = time.monotonic()
        state = await client.get_state()
        assert time.monotonic() - started >= 2.0, "the probe did not wait for the slow agents"
        assert all(e.available for e in state.engines), state
        assert all(o.ok for o in (await client.pause(timeout_s=30)).engines)
        await client.resume()
    kinds = [e.kind for e in await coordinator_events(cluster.address)]
    assert "engine_unavailable" not in kinds, kinds


async def test_pause_does_not_count_in_an_engine_getstate_reported_unavailable(cluster_factory):
    # A long heartbeat timeout widens the window in which heartbeats alone still say
    # "available" for a frozen engine; GetState's own probe finds it unreachable first.
    cluster = cluster_factory(2, coordinator_args=("--heartbeat-timeout", "20"))
    frozen = cluster.agent("engine-1").proc
    async with TrainerClient(cluster.address) as client:
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 15
            while any(e.available for e in (await client.get_state()).engines if e.engine_id == "engine-1"):
                assert time.monotonic() < end, "GetState never noticed the frozen engine"
            started = time.monotonic()
            response = await client.pause(timeout_s=30)
            waited = time.monotonic() - started
            outcomes = {o.engine_id: o for o in response.engines}
            assert outcomes["engine-0"].ok
            assert not outcomes["engine-1"].ok and outcomes["engine-1"].error_reason == "ENGINE_UNAVAILABLE"
            # Before: Pause counted it in and waited its whole timeout on it.
            assert waited < 10, f"Pause waited {waited:.1f}s on an engine reported unavailable"
            await client.resume()
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])


# A trainer in a process of its own, so that the test can freeze it: shm's ring (no
# direct reads), small buckets, so the engines wait on its store for every bucket.
_TRAINER_PROCESS = """
import asyncio, os, sys
os.environ["WEIGHTSYNC_SHM_DIRECT"] = "0"
from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM

async def main():
    weights = ReferenceLM(PRESETS["tiny"]).named_parameters()
    async with TrainerClient(sys.argv[1], transport="shm", bucket_bytes=64 * 1024) as client:
        print("SYNCING", flush=True)  # the round's deadline counts from here
        await client.update_weights(weights, version=1, timeout_s=float(sys.argv[2]))
asyncio.run(main())
"""


async def test_a_trainer_frozen_mid_round_does_not_hold_the_engines_receive_past_its_deadline(cluster_factory):
    """SIGSTOP on the trainer while the engines receive: its store's connections stay
    open and answer nothing. Each engine's receive still ends by the round's deadline
    (plus the store's one-second grace), not when the trainer is finally killed; the
    engines are then free, and the next trainer's round brings them back, bitwise."""
    import subprocess
    import sys

    from tests.test_sync_safety import faulty_cluster, wait_for_bucket

    deadline_s = 4.0
    cluster = faulty_cluster(cluster_factory, [slow(1, 0.3)])  # 9 buckets, 0.3 s each: ~2.7 s of receive
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER_PROCESS, cluster.address, str(deadline_s)],
                               stdout=subprocess.PIPE, text=True)
    try:
        # From the trainer's own start of the sync, not its process's: under load its
        # start-up (the torch import) can take longer than the whole round's deadline.
        line = await asyncio.wait_for(asyncio.to_thread(trainer.stdout.readline), timeout=120)
        assert line.strip() == "SYNCING", f"the trainer printed {line!r}"
        started = time.monotonic()
        await wait_for_bucket(cluster.agents[0].address)
        os.kill(trainer.pid, signal.SIGSTOP)
        async with TrainerClient(cluster.address) as observer:
            while True:
                state = await observer.get_state()
                if not any(e.receiving for e in state.engines):
                    break
                assert time.monotonic() - started < deadline_s + 4.0, \
                    f"engines still receiving {time.monotonic() - started:.1f} s after a {deadline_s} s round began"
                await asyncio.sleep(0.1)
            assert all(e.torn for e in state.engines), state.engines  # some buckets had landed
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    model = perturbed(11)
    async with TrainerClient(cluster.address, transport="shm") as client:
        result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
        assert result.ok, result
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
