"""One logical sync, one idempotent record: ``update_weights(key=K)`` interrupted at
every point -- during Pause, between Pause and Broadcast, during Broadcast, between
Broadcast and Resume, during Resume -- by a cancelled task or by its trainer process
SIGKILLed, then retried with the same key and request, ends with every engine at the
version (checked against the trainer's own model, not through the load path), nothing
paused, and no engine having received the version twice (the agents' event logs).

Real coordinator and agent processes; the SIGKILLed trainer is a real process too
(``tests/interrupted_trainer.py``). The engines step slowly (``--step-delay``), so a
WAIT pause is held by a running generation for seconds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from tests.interrupted_trainer import POINTS, InterruptibleClient, model_of
from weightsync.client import EngineClient, TrainerClient

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ARGS = ("--step-delay", "0.03", "--enable-fault-injection")
# Every agent's Resume takes a second (test-only fault injection), so an interruption
# "during Resume" lands while the coordinator's Resume is in flight.
SLOW_RESUME = {"WEIGHTSYNC_FAULTS": json.dumps([{"op": "rpc", "action": "delay", "method": "ResumeEngine",
                                                  "seconds": 1.0, "times": 0}])}


async def _hold_a_wait_pause(cluster) -> None:
    """Starts a generation on every engine: a WAIT pause then waits for it (~3 s)."""
    for agent in cluster.agents:
        async with EngineClient(agent.address) as engine:
            await engine.generate([1, 2, 3], max_tokens=100)
    await asyncio.sleep(0.1)


async def _received(cluster, version: int) -> dict[str, int]:
    """How many times each engine finished receiving ``version`` (its event log)."""
    counts = {}
    for agent in cluster.agents:
        async with EngineClient(agent.address) as engine:
            counts[agent.engine_id] = sum(1 for e in await engine.events()
                                          if e.kind == "transfer_done" and e.fields.get("version") == str(version))
    return counts


async def _retry_and_check(cluster, *, key: str, version: int, point: str, how: str) -> None:
    """The same key, weights, version and mode again: the sync ends, once."""
    model = model_of(version)
    where = f"{how} at {point!r}"
    async with TrainerClient(cluster.address) as client:
        result = await client.update_weights(model.named_parameters(), version=version, key=key, mode="wait",
                                             timeout_s=60)
        assert result.ok and result.version == version, where
        check = await client.check_engines(model.named_parameters(), version=version, engines=2)
        assert check.ok, f"{where}: {check.describe()}"
        state = await client.get_state()
        assert state.weight_version == version, where
        assert not any(e.paused for e in state.engines), f"{where}: an engine stays paused"
        assert state.round.phase == "idle", f"{where}: round phase {state.round.phase}"
        # Once more: the stored outcome, nothing run again.
        again = await client.update_weights(model.named_parameters(), version=version, key=key, mode="wait",
                                            timeout_s=60)
        assert again.ok and [e.engine_id for e in again.engines] == [e.engine_id for e in result.engines], where
    assert await _received(cluster, version) == {"engine-0": 1, "engine-1": 1}, f"{where}: received twice"


async def test_a_cancelled_update_weights_retried_with_its_key_ends_at_the_version_wherever_it_was_cancelled(
        cluster_factory):
    cluster = cluster_factory(2, agent_args=ENGINE_ARGS, agent_env=SLOW_RESUME)
    for version, point in enumerate(POINTS, start=1):
        key = f"cancelled-{point}"
        if point == "pause":
            await _hold_a_wait_pause(cluster)
        reached = asyncio.Event()
        on_reached = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, reached.set)
        model = model_of(version)
        async with InterruptibleClient(cluster.address, stop_at=point, on_reached=on_reached) as client:
            task = asyncio.ensure_future(client.update_weights(model.named_parameters(), version=version, key=key,
                                                               mode="wait", timeout_s=60))
            await asyncio.wait_for(reached.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 60)
                pytest.fail(f"update_weights cancelled at {point!r} returned")
        await _retry_and_check(cluster, key=key, version=version, point=point, how="cancelled")


def _trainer_process(address: str, key: str, version: int, point: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "interrupted_trainer.py"), address, key,
                             str(version), point, "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _wait_for_line(proc: subprocess.Popen, line: str, timeout_s: float) -> None:
    """Reads the trainer's output (on a thread: off the test's loop) until ``line``, for
    at most ``timeout_s`` (a trainer that hangs silently fails the test, not the suite)."""
    end = time.monotonic() + timeout_s
    seen = []
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < end:
            if not selector.select(timeout=max(0.0, end - time.monotonic())):
                break
            out = proc.stdout.readline()
            if not out:
                break
            seen.append(out)
            if out.strip() == line:
                return
    raise AssertionError(f"the trainer never printed {line}: {''.join(seen)[-3000:]}")


async def test_a_sigkilled_trainer_retried_with_its_key_ends_at_the_version_wherever_it_was_killed(
        cluster_factory):
    cluster = cluster_factory(2, agent_args=ENGINE_ARGS, agent_env=SLOW_RESUME)
    for version, point in enumerate(POINTS, start=1):
        key = f"killed-{point}"
        proc = _trainer_process(cluster.address, key, version, point)
        try:
            try:
                await asyncio.to_thread(_wait_for_line, proc, "READY", 90)
                if point == "pause":
                    await _hold_a_wait_pause(cluster)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                await asyncio.to_thread(_wait_for_line, proc, "REACHED", 90)
            except AssertionError as exc:
                raise AssertionError(f"stopping at {point!r}: {exc}") from None
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait, 30)
            proc.stdin.close()
            proc.stdout.close()
        await _retry_and_check(cluster, key=key, version=version, point=point, how="SIGKILLed")
