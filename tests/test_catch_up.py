"""Catch-up from a healthy peer (real coordinator and agent processes).

A fenced engine behind the fleet is brought to the fleet's version by a ready peer's
agent, without the trainer; it serves no token of an older version, ever. A source
that dies mid-transfer leaves the joiner fenced and another source finishes the job;
with no usable source the joiner stays fenced until the next Broadcast includes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from tests.conftest import wait_available
from tests.test_attestation import perturbed
from tests.test_fencing import engines_by_id, serving, until
from tests.test_rounds_end import coordinator_events
from tests.test_sync_safety import fail, slow
from weightsync.client import EngineClient, SyncFailed, TrainerClient
from weightsync.packing import weights_digest

PROMPT = [1, 2, 3, 4]


async def _ready(client: TrainerClient, engine_id: str) -> bool:
    engine = engines_by_id(await client.get_state()).get(engine_id)
    return engine is not None and engine.ready


@pytest.mark.parametrize("transport", ["auto", "gloo"])
async def test_a_joiner_is_caught_up_from_a_peer_without_the_trainer(cluster_factory, transport):
    cluster = cluster_factory(1, coordinator_args=("--catch-up-transport", transport))
    model = perturbed(2)
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)).ok
        assert (await client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        joiner = await asyncio.to_thread(cluster.start_agent, "engine-1")
        async with EngineClient(joiner.address) as engine:
            request_id = await engine.generate(PROMPT, 6)  # sent at once: it may only run on version 2
            await until(lambda: _ready(client, "engine-1"), timeout_s=30, what="engine-1 caught up")
            finished = await engine.get(request_id, wait_s=10.0)
        assert finished.status == "finished" and set(finished.versions) == {2}, finished
        state = await client.get_state(include_digests=True)
        assert all(e.ready and e.weight_version == 2 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
        await until(lambda: serving(joiner.address), what="weightsync.ready SERVING")
    events = [e for e in await coordinator_events(cluster.address) if e.kind.startswith("catch_up")]
    assert [(e.kind, e.engine_id, e.fields["source"], e.fields["version"]) for e in events] == [
        ("catch_up_started", "engine-1", "engine-0", "2"), ("catch_up_done", "engine-1", "engine-0", "2")], events
    # auto: both agents are on this host, so shm
    assert events[0].fields["transport"] == ("shm" if transport == "auto" else "gloo")


async def test_a_source_killed_mid_transfer_leaves_the_joiner_fenced_and_another_source_finishes(
        cluster_factory):
    cluster = cluster_factory(2, agent_args=("--model", "small"),
                              coordinator_args=("--catch-up-bucket-bytes", str(1 << 20)))
    model = perturbed(1, "small")
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(model.named_parameters(), version=1, timeout_s=60)).ok
        # The joiner takes 0.3 s per bucket (13 buckets): the first source dies mid-way.
        joiner = await asyncio.to_thread(cluster.start_agent, "engine-2", "--model", "small",
                                         "--enable-fault-injection",
                                         env={"WEIGHTSYNC_FAULTS": json.dumps([slow(1, 0.3)])})
        started = await until(lambda: _event(cluster.address, "catch_up_started"), timeout_s=30,
                              what="a catch-up started")
        first_source = started.fields["source"]
        await asyncio.sleep(1.0)
        os.kill(cluster.agent(first_source).proc.pid, signal.SIGKILL)
        failed = await until(lambda: _event(cluster.address, "catch_up_failed"), timeout_s=60,
                             what="the catch-up failed")
        assert failed.fields["source"] == first_source
        await until(lambda: _ready(client, "engine-2"), timeout_s=60, what="engine-2 caught up by the other source")
        done = await _event(cluster.address, "catch_up_done")
        assert done.fields["source"] != first_source
        state = engines_by_id(await client.get_state(include_digests=True))
        assert not state["engine-2"].torn and state["engine-2"].weight_version == 1
        assert state["engine-2"].weights_digest == weights_digest(model.named_parameters())
    assert joiner.proc.poll() is None


async def test_with_every_peer_torn_the_joiner_stays_fenced_until_the_next_broadcast(cluster_factory):
    cluster = cluster_factory(1, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps([fail(2, 0)])})
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)).ok
        try:
            await client.update_weights(perturbed(2).named_parameters(), version=2, timeout_s=60)
            raise AssertionError("the round to version 2 must fail: engine-0's receive is made to")
        except SyncFailed:
            pass
        assert engines_by_id(await client.get_state())["engine-0"].torn  # the fleet stays at version 1
        await asyncio.to_thread(cluster.start_agent, "engine-1")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        await asyncio.sleep(2.0)  # several catch-up passes: no source is ready
        late = engines_by_id(await client.get_state())["engine-1"]
        assert late.fenced and not late.ready and late.weight_version == 0, late
        assert not [e for e in await coordinator_events(cluster.address) if e.kind.startswith("catch_up")]

        model = perturbed(3)
        assert (await client.update_weights(model.named_parameters(), version=3, timeout_s=60)).ok
        state = await client.get_state(include_digests=True)
        assert all(e.ready and e.weight_version == 3 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


async def test_a_coordinator_killed_during_a_catch_up_starts_a_new_one_and_the_ledger_stays(cluster_factory):
    """The interrupted attempt ends at the agents (the source's export is cancelled with
    the coordinator's connection, so the joiner's receive fails: torn and still
    fenced); the restarted coordinator starts a new attempt under a new key. The
    fleet's version never goes back."""
    cluster = cluster_factory(1, agent_args=("--model", "small"),
                              coordinator_args=("--catch-up-bucket-bytes", str(1 << 20)))
    model = perturbed(1, "small")
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(model.named_parameters(), version=1, timeout_s=60)).ok
    joiner = await asyncio.to_thread(cluster.start_agent, "engine-1", "--model", "small", "--enable-fault-injection",
                                     env={"WEIGHTSYNC_FAULTS": json.dumps([slow(1, 0.3)])})
    await until(lambda: _event(cluster.address, "catch_up_started"), timeout_s=30, what="a catch-up started")
    await asyncio.sleep(1.0)
    cluster.coordinator.proc.kill()
    await asyncio.to_thread(cluster.coordinator.proc.wait, 10)
    await asyncio.to_thread(cluster.restart_coordinator, name="coordinator2")
    async with TrainerClient(cluster.address) as client:
        assert (await client.get_state()).weight_version == 1
        await until(lambda: _ready(client, "engine-1"), timeout_s=90, what="engine-1 caught up after the restart")
        state = await client.get_state(include_digests=True)
    assert state.weight_version == 1
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
    async with EngineClient(joiner.address) as engine:
        kinds = [e.kind for e in await engine.events()]
    assert "transfer_failed" in kinds and kinds.index("transfer_failed") < kinds.index("transfer_done"), kinds


async def _event(address: str, kind: str):
    """The last coordinator event of ``kind``, or None."""
    matching = [e for e in await coordinator_events(address, timeout_s=0.5) if e.kind == kind]
    return matching[-1] if matching else None
