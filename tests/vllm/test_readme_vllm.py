"""The README's vLLM quickstart runs as written against a real vLLM: its agent command
launches vLLM on a Hugging Face checkpoint (a tiny Llama made here), its trainer block
syncs the transformers model of that checkpoint, and vLLM then generates exactly what the
trainer's own model does at those weights (greedy tokens and log-probs: an independent
check, not a reload). Only MODEL_DIR, the ports and the coordinator's address are
substituted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import start_coordinator, wait_available
from tests.readme_blocks import (
    README_ADDRESS,
    Block,
    as_process,
    commands,
    free_port,
    quickstart_blocks,
    substitute,
)
from tests.vllm.harness import (
    PROMPTS,
    assert_same_outputs,
    checkpoint,
    greedy_all,
    make_model,
    ready_for_a_test,
    stop_vllm_agent,
    trainer_greedy,
    trainer_model,
    vllm_env,
)
from weightsync.lifecycle import spawn, stop_process

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                              reason="vllm is not installed")]


async def _registered_while_alive(address: str, agent, *, timeout_s: float) -> None:
    """Waits for the agent's engine to be available, failing at once if the agent exits."""
    import asyncio
    import time
    end = time.monotonic() + timeout_s
    while True:
        assert agent.poll() is None, f"the README's agent command exited with {agent.returncode}"
        try:
            await asyncio.to_thread(wait_available, address, ["vllm-0"], 2.0)
            return
        except TimeoutError:
            if time.monotonic() > end:
                raise


async def test_the_readme_vllm_quickstart_syncs_a_real_vllm(tmp_path):
    blocks = quickstart_blocks()
    agent_block = [b for b in blocks if b.language == "bash"][1]
    trainer_block = [b for b in blocks if b.language == "python"][1]
    model_dir = make_model(str(tmp_path / "model"))
    coordinator, address, _ = start_coordinator(str(tmp_path))
    port = free_port()
    swap = {README_ADDRESS: address, "MODEL_DIR": model_dir, "127.0.0.1:8000": f"127.0.0.1:{port}",
            "--port 8000": f"--port {port}"}
    [line] = commands(Block(agent_block.language, substitute(agent_block.text, swap)))
    env, argv = as_process(line)
    agent = None
    try:
        with open(tmp_path / "agent.log", "w") as log:
            agent = spawn(argv, env={**vllm_env(), **env}, stdout=log, stderr=log)
        await _registered_while_alive(address, agent, timeout_s=620)
        run = subprocess.run([sys.executable, "-c", substitute(trainer_block.text, swap)], capture_output=True,
                             text=True, timeout=300, env=vllm_env(), cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr[-4000:]
        assert "('vllm-0', 1, 'shm')" in run.stdout, run.stdout
        assert f"--port {port}" in " ".join(argv), "the README's vLLM port was not substituted"
        url = f"http://127.0.0.1:{port}"
        await ready_for_a_test(address, url)
        model = trainer_model(model_dir, [(n, t * 1.01) for n, t in checkpoint(model_dir)])
        assert_same_outputs(greedy_all(url), [trainer_greedy(model, p) for p in PROMPTS], "the README's vLLM round")
    finally:
        if agent is not None:
            stop_vllm_agent(agent)
        stop_process(coordinator, grace_s=10)
        if os.path.exists(tmp_path / "agent.log") and agent is not None and agent.returncode not in (0, None):
            print((tmp_path / "agent.log").read_text()[-4000:])
