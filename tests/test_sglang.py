"""The SGLang adapter against a STAND-IN server that enforces SGLang's contract
(SGLang needs CUDA; see tests/sglang_standin.py). Agent and coordinator are real."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import start_agent, start_coordinator, wait_available
from weightsync.client import EngineClient, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import FailedPrecondition, WeightSyncError
from weightsync.lifecycle import spawn, stop_process, wait_for_file
from weightsync.v1 import agent_pb2

STANDIN = str(Path(__file__).with_name("sglang_standin.py"))


@pytest.fixture
def sglang(tmp_path):
    tmp = str(tmp_path)
    calls = os.path.join(tmp, "calls.jsonl")
    standin = spawn([sys.executable, STANDIN, os.path.join(tmp, "sglang.port"), calls])
    procs = [standin]
    try:
        url = f"http://127.0.0.1:{wait_for_file(os.path.join(tmp, 'sglang.port'), timeout_s=30, proc=standin)}"
        coordinator, address, _ = start_coordinator(tmp)
        procs.append(coordinator)
        agent = start_agent(tmp, address, "sglang-0", "--engine", "sglang", "--engine-url", url)
        procs.append(agent.proc)
        wait_available(address, ["sglang-0"])
        yield address, agent.address, url, calls, standin
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def calls_of(path: str) -> list[tuple[str, dict]]:
    with open(path) as f:
        return [(c["path"], c["body"]) for c in map(json.loads, f)]


async def test_offload_kv_round_releases_and_resumes_exactly_the_released_tags(sglang):
    address, _, url, calls, standin = sglang
    async with TrainerClient(address) as client:
        await client.pause(mode="keep", offload_kv=True)
        state = (await client.get_state()).engines[0]
        assert state.paused and state.asleep_tags == ["kv_cache"]
        response = await client.resume()
        assert all(o.ok for o in response.engines)
    assert calls_of(calls) == [
        ("/pause_generation", {"mode": "in_place"}),
        ("/release_memory_occupation", {"tags": ["kv_cache"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),  # before continuing: KV awake first
        ("/continue_generation", {}),
    ]
    assert standin.poll() is None


async def test_waking_a_tag_never_released_is_not_sent(sglang):
    address, agent_address, url, calls, standin = sglang
    async with EngineClient(agent_address) as engine:
        async def call(method, request):
            return await engine._call(method, request, timeout_s=10, operation="test")
        await call(engine.stub.Pause, agent_pb2.AgentPauseRequest(idempotency_key="p", mode=1))
        await call(engine.stub.Wake, agent_pb2.WakeRequest(idempotency_key="w", tags=["weights", "kv_cache"]))
        await call(engine.stub.Resume, agent_pb2.AgentResumeRequest(idempotency_key="r"))
    assert standin.poll() is None, "the stand-in died: a tag that was never released was resumed"
    assert "/resume_memory_occupation" not in [p for p, _ in calls_of(calls)]


async def test_release_while_requests_run_is_a_clear_error(sglang):
    address, agent_address, url, calls, standin = sglang
    urllib.request.urlopen(urllib.request.Request(url + "/start_requests", data=b'{"n": 2}', method="POST"),
                           timeout=5).read()
    async with TrainerClient(address) as client:
        with pytest.raises(WeightSyncError) as info:
            await client.pause(mode="keep", offload_kv=True)
        assert "idle" in str(info.value)
        await client.resume()
    assert standin.poll() is None


async def test_broadcast_to_sglang_is_refused_before_anything_changes(sglang):
    address, _, _, calls, _ = sglang
    async with TrainerClient(address) as client:
        await client.pause()
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(ReferenceLM(PRESETS["tiny"]).named_parameters(), version=1, timeout_s=30)
        assert info.value.reason == "ENGINE_CANNOT_RECEIVE"
        await client.resume()
    assert [p for p, _ in calls_of(calls)] == ["/pause_generation", "/continue_generation"]


async def test_wait_pause_is_refused_with_a_typed_error(sglang):
    address, _, _, _, _ = sglang
    async with TrainerClient(address) as client:
        with pytest.raises(FailedPrecondition) as info:
            await client.pause(mode="wait")
        assert info.value.reason == "PAUSE_MODE_UNSUPPORTED"
