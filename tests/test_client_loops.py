"""The trainer client on the event loops trainers really run it on.

Synchronous training loops drive the async client with ``asyncio.run`` once per step
(a new event loop each time); stacks built around vLLM run uvloop; a client whose
loop runs in a background thread must not be used from another loop meanwhile. Real
coordinator and agent processes; the reference is the trainer's own model.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.test_e2e import perturbed
from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import FailedPrecondition


def assert_engines_hold(check, model: ReferenceLM, version: int) -> None:
    assert check.ok, check
    assert {e.version for e in check.engines} == {version} and len(check.engines) == 2, check


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_synchronous_trainer_that_runs_each_step_on_a_new_event_loop(cluster_factory, transport):
    # Before the client followed its caller's loop, step 2 failed with a bare
    # "RuntimeError: Event loop is closed" from inside grpc.
    cluster = cluster_factory(2)
    model = ReferenceLM(PRESETS["tiny"])
    client = TrainerClient(cluster.address, transport=transport)
    asyncio.run(client.start())
    try:
        for version in (1, 2, 3):
            perturbed(model, version)
            result = asyncio.run(client.update_weights(model.named_parameters(), version=version, timeout_s=60))
            assert result.ok and result.version == version, result
        check = asyncio.run(client.check_engines(model.named_parameters()))
        assert_engines_hold(check, model, 3)
        assert client._control.opened == 5  # start, three steps, the check: a channel on each loop
    finally:
        asyncio.run(client.aclose())  # on yet another loop: the last channel is let go of, not awaited


def test_the_client_under_uvloop(cluster_factory):
    uvloop = pytest.importorskip("uvloop", reason="uvloop comes with the vLLM tier's packages")
    cluster = cluster_factory(2)
    model = ReferenceLM(PRESETS["tiny"])

    async def train():
        async with TrainerClient(cluster.address, transport="auto") as client:
            for version in (1, 2):
                perturbed(model, version)
                result = await client.update_weights(model.named_parameters(), version=version, timeout_s=60)
                assert result.ok, result
            return await client.check_engines(model.named_parameters())

    assert_engines_hold(uvloop.run(train()), model, 2)


def test_a_client_whose_loop_runs_in_another_thread_is_refused_elsewhere_and_keeps_working(cluster_factory):
    cluster = cluster_factory(2)
    model = ReferenceLM(PRESETS["tiny"])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="trainer-loop", daemon=True)
    thread.start()

    def on_its_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=90)

    client = TrainerClient(cluster.address, transport="shm")
    try:
        on_its_loop(client.start())
        perturbed(model, 1)
        assert on_its_loop(client.update_weights(model.named_parameters(), version=1, timeout_s=60)).ok
        perturbed(model, 2)
        with pytest.raises(FailedPrecondition, match="event loop running in another thread"):
            asyncio.run(client.update_weights(model.named_parameters(), version=2, timeout_s=60))
        # Refused before anything moved: the engines still hold version 1, and the
        # client goes on from its own loop.
        state = on_its_loop(client.get_state())
        assert state.weight_version == 1 and all(not e.paused for e in state.engines), state
        assert on_its_loop(client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        assert_engines_hold(on_its_loop(client.check_engines(model.named_parameters())), model, 2)
    finally:
        on_its_loop(client.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
