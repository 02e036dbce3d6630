"""Version fencing and readiness (real coordinator and agent processes).

An engine never serves weights older than the fleet's: one that joins after rounds
ran, or that missed a round while it could not be reached, is kept paused (fenced)
and reported not ready -- in GetState, the coordinator's metrics, the agent's gRPC
health service ``weightsync.ready`` and its HTTP ``/ready`` -- until a broadcast (or a
catch-up from a peer, see test_catch_up.py) brings it to the fleet's version.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

from tests.conftest import start_coordinator, wait_available
from tests.test_attestation import perturbed
from tests.test_observability import free_port, scrape
from tests.test_rounds_end import agent_events
from tests.test_sglang import STANDIN, get, tiny_weights
from weightsync.client import EngineClient, TrainerClient
from weightsync.lifecycle import spawn, stop_process, wait_for_file, weightsync_command
from weightsync.packing import weights_digest

PROMPT = [1, 2, 3, 4]
# These tests watch the fence itself: a peer catching the engine up first
# (test_catch_up.py) would end it before they look.
NO_CATCH_UP = ("--no-catch-up",)


def http_ready(port: int, path: str = "/ready") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def grpc_ready(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="weightsync.ready"), timeout=5)
        return response.status


async def serving(address: str) -> bool:
    return await grpc_ready(address) == health_pb2.HealthCheckResponse.SERVING


async def _not_serving(address: str) -> bool:
    return await grpc_ready(address) == health_pb2.HealthCheckResponse.NOT_SERVING


async def until(condition, *, timeout_s: float = 15.0, what: str = "condition"):
    """Polls an async ``condition`` until it returns a truthy value (bounded)."""
    end = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def engines_by_id(state) -> dict:
    return {e.engine_id: e for e in state.engines}


async def test_an_engine_that_joins_late_is_fenced_until_a_broadcast_brings_it_up(cluster_factory):
    metrics_port, ready_port = free_port(), free_port()
    cluster = cluster_factory(1, coordinator_args=("--metrics-port", str(metrics_port), *NO_CATCH_UP))
    async with TrainerClient(cluster.address) as client:
        for version in (1, 2):
            assert (await client.update_weights(perturbed(version).named_parameters(), version=version,
                                                timeout_s=60)).ok
        joiner = await asyncio.to_thread(cluster.start_agent, "engine-1", "--ready-port", str(ready_port))
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])

        state = engines_by_id(await client.get_state())
        late, current = state["engine-1"], state["engine-0"]
        assert (late.weight_version, late.versions_behind, late.fenced, late.paused, late.ready) == \
            (0, 2, True, True, False), late
        assert (current.versions_behind, current.fenced, current.ready) == (0, False, True), current
        assert await grpc_ready(joiner.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await grpc_ready(current.address) == health_pb2.HealthCheckResponse.SERVING
        status, body = http_ready(ready_port)
        assert status == 503 and not body["ready"] and body["fleet_version"] == 2, body
        assert "holds version 0" in body["why"], body
        assert http_ready(ready_port, "/other")[0] == 404
        metrics = scrape(metrics_port)
        assert metrics['weightsync_engine_ready{engine="engine-1"}'] == 0
        assert metrics['weightsync_engine_versions_behind{engine="engine-1"}'] == 2
        assert metrics['weightsync_engine_ready{engine="engine-0"}'] == 1

        # A request to the fenced engine makes no progress: no token from boot weights.
        async with EngineClient(joiner.address) as engine:
            request_id = await engine.generate(PROMPT, 6)
            waiting = await engine.get(request_id, wait_s=1.0)
            assert waiting.status in ("queued", "running") and not waiting.tokens, waiting

            model = perturbed(3)
            result = await client.update_weights(model.named_parameters(), version=3, timeout_s=60)
            assert result.ok and {e.engine_id for e in result.engines} == {"engine-0", "engine-1"}, result

            finished = await engine.get(request_id, wait_s=10.0)
            assert finished.status == "finished", finished
            # Every token it ever made came from the fleet's version.
            assert finished.versions and set(finished.versions) == {3}, list(finished.versions)

        state = await client.get_state(include_digests=True)
        assert all(e.ready and not e.fenced and e.versions_behind == 0 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
        await until(lambda: serving(joiner.address), what="weightsync.ready SERVING")
        status, body = http_ready(ready_port)
        assert status == 200 and body["ready"] and body["weight_version"] == 3, body
    kinds = [e.kind for e in await agent_events(joiner.address)]
    assert kinds.index("fenced") < kinds.index("transfer_done") < kinds.index("resumed"), kinds


async def test_a_resume_never_releases_an_engine_behind_the_fleet(cluster_factory):
    cluster = cluster_factory(1, coordinator_args=NO_CATCH_UP)
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)).ok
        await asyncio.to_thread(cluster.start_agent, "engine-1")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])

        paused = await client.pause()  # a round that takes the fenced engine in ...
        assert {o.engine_id for o in paused.engines if o.ok} == {"engine-0", "engine-1"}
        resumed = {o.engine_id: o for o in (await client.resume()).engines}  # ... and ends without a broadcast
        assert resumed["engine-0"].ok
        assert not resumed["engine-1"].ok and resumed["engine-1"].error_reason == "ENGINE_BEHIND", resumed
        state = engines_by_id(await client.get_state())
        assert state["engine-1"].paused and state["engine-1"].fenced and not state["engine-1"].ready
        assert state["engine-0"].ready

        model = perturbed(2)
        assert (await client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        state = await client.get_state(include_digests=True)
        assert all(e.ready and e.weight_version == 2 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


async def test_an_engine_that_missed_a_round_is_fenced_when_it_comes_back(cluster_factory):
    cluster = cluster_factory(2, coordinator_args=NO_CATCH_UP)
    stopped = cluster.agent("engine-1")
    async with TrainerClient(cluster.address) as client:
        stopped.proc.send_signal(signal.SIGSTOP)  # unreachable: heartbeats stop, its engine too
        try:
            await until(lambda: _unavailable(client, "engine-1"), what="engine-1 unavailable")
            result = await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)
            assert result.ok and {e.engine_id for e in result.engines} == {"engine-0"}, result
        finally:
            stopped.proc.send_signal(signal.SIGCONT)
        # Back: its first heartbeat answer names version 1, and it holds 0.
        await until(lambda: _fenced(client, "engine-1"), what="engine-1 fenced")
        state = engines_by_id(await client.get_state())
        assert (state["engine-1"].versions_behind, state["engine-1"].ready) == (1, False)
        await until(lambda: _not_serving(stopped.address), what="weightsync.ready NOT_SERVING")

        model = perturbed(2)
        assert (await client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        state = await client.get_state(include_digests=True)
        assert all(e.ready and e.weight_version == 2 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
    kinds = [e.kind for e in await agent_events(stopped.address)]
    assert kinds.count("fenced") == 2 and kinds.count("unfenced") == 2, kinds  # start-up, then the missed round


async def test_an_agent_killed_and_started_again_is_fenced_until_it_is_brought_up(cluster_factory):
    """The reference engine lives in its agent's process: a SIGKILLed agent started
    again serves its boot weights. It re-registers (once the old registration's
    heartbeats lapse), is fenced, and the next Broadcast brings it to the fleet's
    version."""
    cluster = cluster_factory(2, coordinator_args=NO_CATCH_UP)
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)).ok
        cluster.agent("engine-1").proc.kill()
        await asyncio.to_thread(cluster.agent("engine-1").proc.wait, 10)
        restarted = await asyncio.to_thread(cluster.start_agent, "engine-1")
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        late = engines_by_id(await client.get_state())["engine-1"]
        assert (late.weight_version, late.versions_behind, late.fenced, late.ready) == (0, 1, True, False), late
        assert not await serving(restarted.address)

        model = perturbed(2)
        assert (await client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        state = await client.get_state(include_digests=True)
        assert all(e.ready and e.weight_version == 2 for e in state.engines), state.engines
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}


async def _unavailable(client: TrainerClient, engine_id: str) -> bool:
    return not engines_by_id(await client.get_state())[engine_id].available


async def _ready(client: TrainerClient, engine_id: str) -> bool:
    return engines_by_id(await client.get_state())[engine_id].ready


async def _fenced(client: TrainerClient, engine_id: str) -> bool:
    engine = engines_by_id(await client.get_state())[engine_id]
    return engine.available and engine.fenced


@pytest.mark.parametrize("killed", ["engine", "reaper"])
async def test_a_relaunched_engine_is_fenced_until_it_holds_the_fleets_weights(tmp_path, killed):
    """``--restart on-failure``: the engine the agent launched is SIGKILLed (or the
    reaper above it, which leaves the engine running on its port: the relaunch must stop
    that tree first); the agent relaunches it (boot weights), fences it, and /ready
    answers 503 from the crash until the next Broadcast brings it to the fleet's
    version, then 200. The engine is the SGLang stand-in (SGLang needs a GPU; see
    tests/sglang_standin.py): the relaunch, the fence and the readiness are
    weightsync's and run for real."""
    tmp = str(tmp_path)
    model_dir = os.path.join(tmp, "model")
    os.makedirs(model_dir)
    save_file(dict(tiny_weights()), os.path.join(model_dir, "model.safetensors"))
    engine_port, ready_port = free_port(), free_port()
    url = f"http://127.0.0.1:{engine_port}"
    coordinator, address, _ = start_coordinator(tmp)
    agent = None
    try:
        with open(os.path.join(tmp, "agent.log"), "w") as log:
            agent = spawn(weightsync_command(
                "agent", "--insecure", "--coordinator", address, "--engine-id", "sglang-0", "--engine", "sglang",
                "--engine-url", url, "--health-url", f"{url}/health", "--launch-timeout", "60",
                "--restart", "on-failure", "--max-restarts", "2", "--ready-port", str(ready_port),
                "--port-file", os.path.join(tmp, "agent.addr"), "--launch", "--", sys.executable, STANDIN,
                os.path.join(tmp, "sglang.port"), os.path.join(tmp, "calls.jsonl"), "--model-dir", model_dir,
                "--port", str(engine_port)), stdout=log, stderr=log)
        agent_address = wait_for_file(os.path.join(tmp, "agent.addr"), timeout_s=60, proc=agent)
        await asyncio.to_thread(wait_available, address, ["sglang-0"])
        async with TrainerClient(address, transport="group") as client:
            assert (await client.update_weights(tiny_weights(seed=1), version=1, timeout_s=60)).ok
            assert http_ready(ready_port)[0] == 200

            engine = _standin(agent.pid)
            (engine if killed == "engine" else engine.parent()).kill()
            # Not ready from the crash on: faulted, then relaunching, then fenced.
            await until(lambda: _http_status(ready_port, 503), what="/ready 503 after the crash")
            await until(lambda: _fenced(client, "sglang-0"), timeout_s=60, what="the relaunched engine fenced")
            relaunched = _standin(agent.pid)
            assert relaunched.pid != engine.pid and not engine.is_running()
            assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(tiny_weights()))  # boot weights
            late = engines_by_id(await client.get_state())["sglang-0"]
            assert (late.weight_version, late.versions_behind, late.ready) == (0, 1, False), late
            status, body = http_ready(ready_port)
            assert status == 503 and "holds version 0" in body["why"], body

            assert (await client.update_weights(tiny_weights(seed=2), version=2, timeout_s=60)).ok
            await until(lambda: _http_status(ready_port, 200), what="/ready 200 after the broadcast")
            assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(tiny_weights(seed=2)))
            # the coordinator says so too (an engine whose heartbeat is late under load
            # counts unavailable, and so not ready, until the next one arrives)
            await until(lambda: _ready(client, "sglang-0"), what="GetState: sglang-0 ready")
        kinds = [e.kind for e in await agent_events(agent_address)]
        assert kinds.index("engine_relaunched") < len(kinds) - 1 - kinds[::-1].index("fenced"), kinds
    finally:
        if agent is not None:
            stop_process(agent, grace_s=10)
        stop_process(coordinator, grace_s=10)


def _standin(agent_pid: int) -> psutil.Process:
    """The stand-in process under the agent's reaper (not the reaper, whose command line
    names it too)."""
    return next(p for p in psutil.Process(agent_pid).children(recursive=True)
                if p.cmdline()[1:2] == [STANDIN])


async def _http_status(port: int, status: int) -> bool:
    try:
        return (await asyncio.to_thread(http_ready, port))[0] == status
    except OSError:  # the agent is relaunching: treat a refused connection as not yet
        return False
