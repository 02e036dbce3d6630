"""The SGLang adapter against a STAND-IN server that enforces SGLang's contract
(SGLang needs CUDA; see tests/sglang_standin.py). Agent and coordinator are real
processes; the weights move for real, through the stand-in's update group (gloo)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import start_agent, start_coordinator, wait_available
from tests.test_rounds_end import coordinator_events
from weightsync import metrics
from weightsync.apps.trainer_ranks import TrainerRanks
from weightsync.client import EngineClient, Probe, SyncFailed, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import (
    FailedPrecondition,
    InvalidArgument,
    TornWeightsError,
    Unsupported,
    WeightSyncError,
)
from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file
from weightsync.packing import weights_digest
from weightsync.v1 import agent_pb2, common_pb2

STANDIN = str(Path(__file__).with_name("sglang_standin.py"))


def tiny_weights(seed: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tiny reference model's weights (the stand-in serves the same architecture);
    with a seed, moved by noise so every round is different."""
    named = [(n, p.detach().clone()) for n, p in ReferenceLM(PRESETS["tiny"]).named_parameters()]
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        named = [(n, t + torch.randn(t.shape, generator=g)) for n, t in named]
    return named


def start_standin(tmp: str, *extra: str):
    model_dir = os.path.join(tmp, "model")
    os.makedirs(model_dir, exist_ok=True)
    save_file(dict(tiny_weights()), os.path.join(model_dir, "model.safetensors"))
    calls = os.path.join(tmp, "calls.jsonl")
    proc = spawn([sys.executable, STANDIN, os.path.join(tmp, "sglang.port"), calls, "--model-dir", model_dir,
                  *extra])
    url = f"http://127.0.0.1:{wait_for_file(os.path.join(tmp, 'sglang.port'), timeout_s=30, proc=proc)}"
    return proc, url, calls


@pytest.fixture
def sglang(tmp_path, request):
    """(coordinator, agent, SGLang url, call log, stand-in process). ``param``: the
    stand-in's extra options, optionally a dict {"standin": [...], "agent": [...]}."""
    tmp = str(tmp_path)
    extra = getattr(request, "param", ())
    standin_args, agent_args = (extra.get("standin", ()), extra.get("agent", ())) if isinstance(extra, dict) \
        else (extra, ())
    standin, url, calls = start_standin(tmp, *standin_args)
    procs = [standin]
    try:
        coordinator, address, _ = start_coordinator(tmp)
        procs.append(coordinator)
        agent = start_agent(tmp, address, "sglang-0", "--engine", "sglang", "--engine-url", url,
                            *(a.replace("{model_dir}", os.path.join(tmp, "model")) for a in agent_args))
        procs.append(agent.proc)
        wait_available(address, ["sglang-0"])
        # The calls the agent made at start-up (its version fence, see
        # test_the_agent_holds_sglang_until_it_knows_the_fleets_version) are set aside:
        # each test sees the calls its own steps made.
        if os.path.exists(calls):
            os.replace(calls, calls + ".startup")
        yield address, agent.address, url, calls, standin
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def calls_of(path: str) -> list[tuple[str, dict]]:
    with open(path) as f:
        return [(c["path"], c["body"]) for c in map(json.loads, f)]


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as response:
        return json.loads(response.read())


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


async def test_the_agent_holds_sglang_until_it_knows_the_fleets_version(sglang):
    """Before registering, the agent pauses SGLang in place (it may hold weights older
    than the fleet's); the coordinator answers version 0, which it holds, so the agent
    lets it continue -- before its address is even published."""
    _, _, _, calls, standin = sglang
    assert calls_of(calls + ".startup") == [("/pause_generation", {"mode": "in_place"}),
                                            ("/continue_generation", {})]
    assert standin.poll() is None


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
        await call(engine.stub.PauseEngine, agent_pb2.PauseEngineRequest(idempotency_key="p", mode=1))
        await call(engine.stub.Wake, agent_pb2.WakeRequest(idempotency_key="w", tags=["weights", "kv_cache"]))
        await call(engine.stub.ResumeEngine, agent_pb2.ResumeEngineRequest(idempotency_key="r"))
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


async def test_weights_sync_into_sglang_through_its_update_group(sglang):
    """Three rounds under KEEP pauses with requests held in place: every round lands
    bitwise, the group is joined once and reused, the cache is never flushed under
    an in-place pause (that kills SGLang's scheduler), and the version is recorded."""
    address, _, url, calls, standin = sglang
    before = get(url, "/standin/weights")["digest"]
    post(url, "/start_requests", {"n": 2})  # held in place across the syncs
    async with TrainerClient(address, transport="group") as client:
        for version in (1, 2, 3):
            weights = tiny_weights(seed=version)
            result = await client.update_weights(weights, version=version, mode="keep", timeout_s=60)
            assert result.ok and result.engines[0].weight_version == version
            assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
            assert get(url, "/model_info")["weight_version"] == str(version)
    assert before != weights_digest(sorted(tiny_weights(seed=3)))
    assert standin.poll() is None
    paths = [p for p, _ in calls_of(calls)]
    assert paths.count("/init_weights_update_group") == 1, "one group, reused every round"
    updates = [b for p, b in calls_of(calls) if p == "/update_weights_from_distributed"]
    assert len(updates) == 3 and not any(b["flush_cache"] for b in updates)
    assert updates[0]["names"] == [n for n, _ in tiny_weights()]
    init = next(b for p, b in calls_of(calls) if p == "/init_weights_update_group")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    # Every round: pause, update, version, continue -- never continue before the update ended.
    order = [p for p in paths if p in ("/pause_generation", "/update_weights_from_distributed",
                                       "/update_weight_version", "/continue_generation")]
    assert order == ["/pause_generation", "/update_weights_from_distributed", "/update_weight_version",
                     "/continue_generation"] * 3


async def test_one_broadcast_feeds_sglang_and_a_reference_engine_together(sglang, tmp_path):
    address, _, url, _, _ = sglang
    ref = start_agent(str(tmp_path), address, "ref-0", "--model", "tiny")
    try:
        wait_available(address, ["sglang-0", "ref-0"])
        weights = tiny_weights(seed=7)
        async with TrainerClient(address, transport="group") as client:
            result = await client.update_weights(weights, version=1, timeout_s=60)
            assert result.ok and {e.engine_id for e in result.engines} == {"sglang-0", "ref-0"}
            state = await client.get_state(include_digests=True)
            # SGLang gives no digest, and says so: the check does not wait out its
            # deadline for one, nor counts SGLang as holding or as unread.
            asked = time.monotonic()
            check = await client.check_engines(weights, version=1, within_s=60.0)
            assert time.monotonic() - asked < 30, "an engine that gives no digest was asked until the deadline"
            assert check.holding == ["ref-0"] and [e.engine_id for e in check.withheld] == ["sglang-0"]
            assert not check.ok and not check.unread and not check.different
            assert "sglang-0: gives no digest at version 1 (SGLang exposes no digest" in check.describe()
        digests = {e.engine_id: e.weights_digest for e in state.engines}
        assert digests["ref-0"] == weights_digest(weights) and digests["sglang-0"] == ""
        assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
    finally:
        stop_process(ref.proc, grace_s=10)


@pytest.mark.parametrize("sglang", [{"agent": ["--sglang-flattened-bucket"]}], indirect=True)
async def test_the_flattened_layout_feeds_sglang_a_run_of_tensors_per_call(sglang, tmp_path):
    """SGLang's ``load_format="flattened_bucket"``: one update call per run of tensors
    (at most a bucket), each run one broadcast of its bytes end to end. Two rounds into
    the SGLang stand-in and a reference engine together (weightsync's own receiver
    takes the same layout), bitwise; under an ABORT pause the cache is flushed after
    the last call only, under KEEP with requests held in place never."""
    address, _, url, calls, standin = sglang
    ref = start_agent(str(tmp_path), address, "ref-0", "--model", "tiny")
    try:
        wait_available(address, ["sglang-0", "ref-0"])
        async with TrainerClient(address, transport="group", group_layout="flattened",
                                 bucket_bytes=128 << 10) as client:
            for version, mode in ((1, "abort"), (2, "keep")):
                if mode == "keep":
                    post(url, "/start_requests", {"n": 2})
                weights = tiny_weights(seed=version)
                result = await client.update_weights(weights, version=version, mode=mode, timeout_s=60)
                assert result.ok and {e.weight_version for e in result.engines} == {version}
                assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
                state = await client.get_state(include_digests=True)
                digests = {e.engine_id: e.weights_digest for e in state.engines}
                assert digests["ref-0"] == weights_digest(weights)
    finally:
        stop_process(ref.proc, grace_s=10)
    assert standin.poll() is None
    updates = [b for p, b in calls_of(calls) if p == "/update_weights_from_distributed"]
    assert all(b["load_format"] == "flattened_bucket" for b in updates)
    names = [n for n, _ in tiny_weights()]
    per_round = len(updates) // 2
    assert 1 < per_round < len(names) and len(updates) == 2 * per_round
    for round_updates in (updates[:per_round], updates[per_round:]):
        assert [n for b in round_updates for n in b["names"]] == names  # every tensor once, in plan order
    assert [b["flush_cache"] for b in updates[:per_round]] == [False] * (per_round - 1) + [True]
    assert not any(b["flush_cache"] for b in updates[per_round:])


async def test_the_flattened_layout_is_refused_unless_the_agent_says_its_sglang_takes_it(sglang):
    """An SGLang without ``flattened_bucket`` ignores ``load_format`` and would wait for a
    broadcast per tensor: so the agent takes the layout only when started with
    ``--sglang-flattened-bucket``, and otherwise refuses it up front, typed, before
    SGLang is touched."""
    address, _, url, calls, _ = sglang
    before = get(url, "/standin/weights")["digest"]
    async with TrainerClient(address, transport="group", group_layout="flattened") as client:
        await client.pause()
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(tiny_weights(seed=1), version=1, timeout_s=30)
        assert info.value.reason == "GROUP_LAYOUT_UNSUPPORTED" and "--sglang-flattened-bucket" in info.value.message
        await client.resume()
    assert [p for p, _ in calls_of(calls)] == ["/pause_generation", "/continue_generation"]
    assert get(url, "/standin/weights")["digest"] == before


@pytest.mark.parametrize("flagged", [True, False])
async def test_the_default_group_layout_is_flattened_only_where_every_engine_takes_it(flagged, tmp_path):
    """A trainer that does not choose a layout gets ``auto``: the coordinator picks the
    flattened layout (a broadcast per run of tensors) for a round whose engines all say
    they take it, and a broadcast per tensor otherwise. An SGLang agent says so only
    with ``--sglang-flattened-bucket``; weightsync's own engines always do."""
    tmp = str(tmp_path)
    standin, url, calls = start_standin(tmp)
    procs = [standin]
    try:
        coordinator, address, _ = start_coordinator(tmp)
        procs.append(coordinator)
        flag = ["--sglang-flattened-bucket"] if flagged else []
        procs.append(start_agent(tmp, address, "sglang-0", "--engine", "sglang", "--engine-url", url, *flag).proc)
        procs.append(start_agent(tmp, address, "ref-0", "--model", "tiny").proc)
        wait_available(address, ["sglang-0", "ref-0"])
        os.replace(calls, calls + ".startup")
        async with TrainerClient(address, transport="group", bucket_bytes=128 << 10) as client:
            state = await client.get_state()
            assert {e.engine_id: list(e.group_layouts) for e in state.engines} == {
                "sglang-0": ["tensors", "flattened"] if flagged else ["tensors"], "ref-0": ["tensors", "flattened"]}
            weights = tiny_weights(seed=3)
            result = await client.update_weights(weights, version=1, timeout_s=60)
            assert result.ok and {e.weight_version for e in result.engines} == {1}
            digests = {e.engine_id: e.weights_digest for e in (await client.get_state(include_digests=True)).engines}
        assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
        assert digests["ref-0"] == weights_digest(weights)
        started = [e for e in await coordinator_events(address) if e.kind == "broadcast_started"]
        assert [e.fields["group_layout"] for e in started] == ["flattened" if flagged else "tensors"]
        updates = [b for p, b in calls_of(calls) if p == "/update_weights_from_distributed"]
        if flagged:
            assert 1 < len(updates) < len(weights)
            assert all(b["load_format"] == "flattened_bucket" for b in updates)
        else:
            # SGLang's classic call: every name in one request, a broadcast per tensor.
            assert [b["names"] for b in updates] == [[n for n, _ in weights]]
            assert not updates[0].get("load_format")
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


async def test_bad_plans_are_refused_before_sglang_is_touched(sglang):
    address, _, url, calls, _ = sglang
    before = get(url, "/standin/weights")["digest"]
    async with TrainerClient(address, transport="group") as client:
        await client.pause()
        extra = tiny_weights(seed=1) + [("lm_head.bias", torch.zeros(3))]
        with pytest.raises(InvalidArgument, match="lm_head.bias"):
            await client.broadcast(extra, version=1, timeout_s=30)
        wrong_shape = [(n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(tiny_weights(seed=1))]
        with pytest.raises(InvalidArgument, match="shape"):
            await client.broadcast(wrong_shape, version=1, timeout_s=30)
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(tiny_weights(seed=1), version=1, transport="gloo", timeout_s=30)
        assert info.value.reason == "TRANSPORT_UNSUPPORTED"
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(tiny_weights(seed=1), version=1, verify_digest=True, timeout_s=30)
        assert info.value.reason == "DIGEST_UNSUPPORTED"
        # SGLang has no way to score a probe while paused (no worker hook like vLLM's):
        # attestation is refused up front, never skipped silently.
        probe = Probe(sequences=((1, 2, 3),), logprobs=((-1.0, -1.0),), tolerance=1e-3)
        with pytest.raises(FailedPrecondition) as info:
            await client.broadcast(tiny_weights(seed=1), version=1, attest=probe, timeout_s=30)
        assert info.value.reason == "ATTESTATION_UNSUPPORTED"
        await client.resume()
    assert [p for p, _ in calls_of(calls)] == ["/pause_generation", "/continue_generation"]
    assert get(url, "/standin/weights")["digest"] == before


@pytest.mark.parametrize("sglang", [("--drop-param", "blocks.1.fc1.weight")], indirect=True)
async def test_a_partial_update_leaves_sglang_paused_and_torn(sglang):
    """The stand-in's model lacks a tensor its checkpoint has, so SGLang's load fails
    mid-way ("partially updated"): the engine is torn, stays paused, its group is
    destroyed, and only an explicit allow_torn resumes it."""
    address, _, url, calls, standin = sglang
    async with TrainerClient(address, transport="group") as client:
        await client.pause()
        with pytest.raises(SyncFailed, match="partially updated"):
            await client.broadcast(tiny_weights(seed=1), version=1, timeout_s=30)
        state = (await client.get_state()).engines[0]
        assert state.torn and state.paused and state.weight_version == 0
        refused = (await client.resume()).engines[0]
        assert not refused.ok and refused.error_reason == TornWeightsError.reason
        assert "/continue_generation" not in [p for p, _ in calls_of(calls)]
        allowed = (await client.resume(allow_torn=True)).engines[0]
        assert allowed.ok
    paths = [p for p, _ in calls_of(calls)]
    assert paths.index("/destroy_weights_update_group") > paths.index("/update_weights_from_distributed")
    assert "/update_weight_version" not in paths
    assert get(url, "/standin/weights")["groups"] == []
    assert standin.poll() is None


async def test_offload_kv_sync_wakes_sglangs_kv_before_it_continues(sglang):
    address, _, url, calls, standin = sglang
    async with TrainerClient(address, transport="group") as client:
        result = await client.update_weights(tiny_weights(seed=5), version=1, offload_kv=True, timeout_s=60)
        assert result.ok
        state = (await client.get_state()).engines[0]
    assert not state.asleep_tags and not state.paused and state.weight_version == 1
    assert [p for p, _ in calls_of(calls)] == [
        "/pause_generation", "/release_memory_occupation", "/init_weights_update_group",
        "/update_weights_from_distributed", "/update_weight_version", "/resume_memory_occupation",
        "/continue_generation"]
    assert get(url, "/standin/weights")["digest"] == weights_digest(tiny_weights(seed=5))
    assert standin.poll() is None


@pytest.mark.parametrize("layout", ["tensors", "flattened"])
@pytest.mark.parametrize("sglang", [{"standin": ["--die-during-update"], "agent": ["--sglang-flattened-bucket"]}],
                         indirect=True)
async def test_sglang_dying_mid_update_fails_the_round_at_once(sglang, layout):
    """SGLang crashes with the first tensor (or, flattened, the first run of them) in:
    the round fails well before its 60 s deadline (the trainer stops sending), and the
    engine is reported dead, not synced."""
    address, _, _, _, standin = sglang
    async with TrainerClient(address, transport="group", group_layout=layout, bucket_bytes=128 << 10) as client:
        await client.pause()
        started = time.monotonic()
        with pytest.raises(SyncFailed) as info:
            await client.broadcast(tiny_weights(seed=1), version=1, timeout_s=60)
        assert time.monotonic() - started < 30, "a dead engine must not hold the round to its deadline"
        assert not info.value.result.ok
        assert standin.wait(timeout=10) == 72
        state = (await client.get_state()).engines[0]
    assert state.weight_version == 0


@pytest.mark.parametrize("sglang", [
    {"standin": ["--report-model-path", "org/hub-model"]},
    {"standin": ["--report-model-path", "org/hub-model"], "agent": ["--checkpoint-dir", "{model_dir}"]},
], indirect=True, ids=["hub-id", "hub-id+checkpoint-dir"])
async def test_plans_are_checked_against_a_local_checkpoint(sglang, request):
    """SGLang serving a hub id: without --checkpoint-dir the agent cannot check plans
    and refuses the broadcast (typed, nothing touched); with it, the round runs."""
    address, _, url, calls, _ = sglang
    with_dir = bool(request.node.callspec.params["sglang"].get("agent"))
    async with TrainerClient(address, transport="group") as client:
        if with_dir:
            assert (await client.update_weights(tiny_weights(seed=2), version=1, timeout_s=60)).ok
            assert get(url, "/standin/weights")["digest"] == weights_digest(tiny_weights(seed=2))
        else:
            await client.pause()
            with pytest.raises(FailedPrecondition, match="--checkpoint-dir") as info:
                await client.broadcast(tiny_weights(seed=2), version=1, timeout_s=30)
            assert info.value.reason == "ENGINE_CANNOT_RECEIVE"
            await client.resume()
            assert [p for p, _ in calls_of(calls)] == ["/pause_generation", "/continue_generation"]


@pytest.mark.parametrize("layout", ["tensors", "flattened"])
@pytest.mark.parametrize("sglang", [{"standin": ["--tp-size", "2"], "agent": ["--sglang-flattened-bucket"]}],
                         indirect=True)
async def test_sglang_with_two_tensor_parallel_workers_joins_at_two_ranks_and_syncs(sglang, layout):
    # SGLang's tp workers each join the update group (rank_offset + tp rank) and each
    # receive the full tensors (the stand-in checks both got the same bytes): the engine
    # takes two ranks of the round's group, in either layout.
    address, _, url, calls, _ = sglang
    async with TrainerClient(address, transport="group", group_layout=layout, bucket_bytes=128 << 10) as client:
        state = await client.get_state()
        assert [e.workers for e in state.engines] == [2]
        for version in (1, 2):
            assert (await client.update_weights(tiny_weights(seed=version), version=version, timeout_s=60)).ok
            assert get(url, "/standin/weights")["digest"] == weights_digest(tiny_weights(seed=version))
    joins = [body for path, body in calls_of(calls) if path == "/init_weights_update_group"]
    assert joins and all(j["rank_offset"] == 1 and j["world_size"] == 3 for j in joins), joins
    updates = [body for path, body in calls_of(calls) if path == "/update_weights_from_distributed"]
    assert (len(updates) > 2) == (layout == "flattened")


async def test_what_sglang_cannot_do_is_refused_with_one_typed_error(sglang):
    """A WAIT pause, and generation through the agent (before: a NotImplementedError that
    reached the caller as INTERNAL): each an ``Unsupported`` naming what."""
    address, agent_address, _, _, _ = sglang
    async with TrainerClient(address) as client:
        with pytest.raises(Unsupported) as info:
            await client.pause(mode="wait")
        assert info.value.reason == "PAUSE_MODE_UNSUPPORTED"
    async with EngineClient(agent_address) as engine:
        for call in (lambda: engine.generate([1, 2, 3], 4), lambda: engine.get("r-1", wait_s=0.1)):
            with pytest.raises(Unsupported) as info:
                await call()
            assert info.value.reason == "GENERATION_UNSUPPORTED" and "engine's own API" in info.value.message
            assert info.value.code.name == "FAILED_PRECONDITION"


@pytest.mark.parametrize("sglang", [("--fail-version-update",)], indirect=True)
async def test_an_engine_that_cannot_record_the_version_fails_the_round_and_stays_usable(sglang):
    """The weights load but SGLang refuses /update_weight_version: the round fails for
    that engine (torn, paused), and the agent is not wedged -- Resume answers at once
    instead of waiting for a receive that never settled, and the next Receive is not
    refused as 'already running'."""
    address, _, _, _, _ = sglang
    async with TrainerClient(address, transport="group") as client:
        await client.pause()
        with pytest.raises(SyncFailed, match="update_weight_version"):
            await client.broadcast(tiny_weights(seed=1), version=1, timeout_s=30)
        state = (await client.get_state()).engines[0]
        assert state.torn and state.paused and not state.receiving
        started = time.monotonic()
        refused = (await client.resume(timeout_s=20)).engines[0]
        assert not refused.ok and refused.error_reason == TornWeightsError.reason
        assert time.monotonic() - started < 10
        with pytest.raises(SyncFailed) as again:
            await client.broadcast(tiny_weights(seed=2), version=2, timeout_s=30)
        assert "already running" not in str(again.value)
        allowed = (await client.resume(allow_torn=True)).engines[0]
        assert allowed.ok


METRICS_PORT = free_port()


@pytest.mark.parametrize("sglang", [{"standin": ["--slow-state", "3"], "agent": ["--metrics-port",
                                                                                str(METRICS_PORT)]}],
                         indirect=True)
async def test_a_slow_engine_does_not_block_the_agents_loop(sglang):
    # /health and /model_info each take 3 s. Before: every heartbeat and every RPC
    # start asked them on the agent's loop, so Pause, Resume and heartbeats stalled
    # and the coordinator (heartbeat timeout 1.5 s) marked the engine unavailable.
    address, agent_address, url, calls, standin = sglang
    async with TrainerClient(address, transport="group") as client:
        end = time.monotonic() + 6  # two /health calls and two /model_info calls at least
        rounds = 0
        while time.monotonic() < end:
            await client.pause(timeout_s=20)
            await client.resume(timeout_s=20)
            rounds += 1
            state = await client.get_state()
            assert [e.available for e in state.engines] == [True], state
            assert state.engines[0].heartbeat_age_s < 1.5, state
        lag_ms = metrics.sample(METRICS_PORT, "weightsync_loop_lag_ms", process="agent", window="all")
        assert lag_ms < 50, f"the agent's loop stalled {lag_ms:.0f} ms"
        assert rounds >= 3, f"only {rounds} pause/resume rounds in 6 s"
        result = await client.update_weights(tiny_weights(1), version=1, timeout_s=120)
        assert result.ok
    assert standin.poll() is None


async def test_an_unreadable_version_is_reported_unknown_not_zero(sglang):
    address, agent_address, url, calls, standin = sglang
    async with TrainerClient(address, transport="group") as client:
        assert (await client.update_weights(tiny_weights(1), version=1, timeout_s=120)).ok
        post(url, "/standin/break_version", {"broken": True})
        end = time.monotonic() + 10
        while not (state := await client.get_state()).engines[0].weight_version_unknown:
            assert time.monotonic() < end, "the agent never noticed the version cannot be read"
            await asyncio.sleep(0.1)
        # The last known version, flagged unknown -- never a made-up 0 going backwards.
        assert state.engines[0].weight_version == 1
        async with EngineClient(agent_address) as engine:
            assert (await engine.state()).weight_version == 1
        # A sync cannot check "newer" against an unknown version: a typed refusal, nothing changes.
        with pytest.raises(WeightSyncError, match="VERSION_UNKNOWN|cannot be read"):
            await client.update_weights(tiny_weights(2), version=2, timeout_s=60)
        post(url, "/standin/break_version", {"broken": False})
        end = time.monotonic() + 10
        while (await client.get_state()).engines[0].weight_version_unknown:
            assert time.monotonic() < end
            await asyncio.sleep(0.1)
        assert (await client.update_weights(tiny_weights(2), version=2, timeout_s=120)).ok


async def test_an_sglang_started_again_by_whatever_runs_it_is_fenced_and_joins_a_new_group(sglang, tmp_path):
    """SGLang restarted on its port behind the agent's back (the agent did not launch
    it) comes back on its boot weights, in no update group. It reads as SGLang's boot
    version record ("default") again: the agent counts the restart, fences it (paused,
    not ready) and forgets the group it had joined, so the next round makes a new
    group, which the new process joins, and lands. Before, that round failed: the agent
    sent the update into a group the new process had never joined. (Against a real
    vLLM: tests/vllm/test_vllm_restart.py.)"""
    address, _, url, calls, standin = sglang
    model_dir = os.path.join(str(tmp_path), "model")
    async with TrainerClient(address, transport="group") as client:
        assert (await client.update_weights(tiny_weights(1), version=1, timeout_s=60)).ok
        standin.kill()
        standin.wait(timeout=10)
        port_file = os.path.join(str(tmp_path), "sglang-again.port")
        again = spawn([sys.executable, STANDIN, port_file, calls, "--model-dir", model_dir,
                       "--port", url.rsplit(":", 1)[1]])
        try:
            wait_for_file(port_file, timeout_s=30, proc=again)
            end = time.monotonic() + 15
            while (state := (await client.get_state()).engines[0]).engine_restarts != 1:
                assert time.monotonic() < end, f"the agent never saw SGLang start again: {state}"
                await asyncio.sleep(0.1)
            assert state.fenced and state.paused and not state.ready and state.weight_version == 0, state
            paths = [p for p, _ in calls_of(calls)]
            assert paths[-1] == "/pause_generation", paths  # the new process, paused on sight
            weights = tiny_weights(seed=2)
            result = await client.update_weights(weights, version=2, timeout_s=60)
            assert result.ok, result
            assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
            assert get(url, "/model_info")["weight_version"] == "2"
            assert [p for p, _ in calls_of(calls)].count("/init_weights_update_group") == 2  # one per process
            # Ready once the agent has sent its state again for a few seconds (SGLang was
            # gone a while: a call it had queued may land late) -- not fenced from now on.
            end = time.monotonic() + 20
            while not (state := (await client.get_state()).engines[0]).ready:
                assert not state.fenced and time.monotonic() < end, state
                await asyncio.sleep(0.1)
        finally:
            stop_process(again, grace_s=10)


async def wait_standin_paused(url: str, want: str, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while (paused := get(url, "/standin/paused")["paused"]) != want:
        assert time.monotonic() < end, f"{what}: SGLang's pause state is {paused!r}"
        await asyncio.sleep(0.1)


async def test_an_sglang_that_comes_up_after_its_agent_is_paused_when_it_answers(tmp_path):
    """The fleet is at version 1 (a reference engine took it) when an agent starts for
    an SGLang that is not up yet. The agent fences it, but its pause cannot reach
    SGLang. Before, it then reported SGLang paused and fenced while SGLang, once up,
    was never asked again and served its boot weights; now the pause is sent again
    when SGLang answers (SGLang cannot say whether it is paused), and the next round
    brings it up and releases it. No catch-up from the reference engine is tried in
    between: SGLang takes neither shm nor gloo."""
    tmp = str(tmp_path)
    coordinator, address, _ = start_coordinator(tmp)
    procs = [coordinator]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        reference = start_agent(tmp, address, "ref-0")
        procs.append(reference.proc)
        wait_available(address, ["ref-0"])
        async with TrainerClient(address, transport="group") as client:
            assert (await client.update_weights(tiny_weights(1), version=1, timeout_s=60)).ok
            agent = start_agent(tmp, address, "sglang-0", "--engine", "sglang", "--engine-url", url)
            procs.append(agent.proc)
            model_dir = os.path.join(tmp, "model")
            os.makedirs(model_dir)
            save_file(dict(tiny_weights()), os.path.join(model_dir, "model.safetensors"))
            standin = spawn([sys.executable, STANDIN, os.path.join(tmp, "sglang.port"), os.path.join(tmp, "calls"),
                             "--model-dir", model_dir, "--port", str(port)])
            procs.append(standin)
            wait_for_file(os.path.join(tmp, "sglang.port"), timeout_s=30, proc=standin)
            await wait_standin_paused(url, "in_place", "SGLang up while its agent fences it")
            await asyncio.to_thread(wait_available, address, ["sglang-0"])
            state = next(e for e in (await client.get_state()).engines if e.engine_id == "sglang-0")
            assert state.fenced and not state.ready and state.weight_version == 0, state
            # A ready reference engine could be a catch-up source, but SGLang takes only
            # its update group: the coordinator does not try (an attempt over shm fails).
            assert list(state.receives) == [common_pb2.TRANSPORT_KIND_GROUP], state
            await asyncio.sleep(2)  # catch-up looks every 0.5 s
            tried = [e.kind for e in await coordinator_events(address) if e.kind.startswith("catch_up")]
            assert not tried, tried
            weights = tiny_weights(seed=2)
            result = await client.update_weights(weights, version=2, timeout_s=60)
            assert result.ok and [e.engine_id for e in result.engines] == ["ref-0", "sglang-0"], result
            assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))
            assert get(url, "/standin/paused")["paused"] == ""
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


async def test_a_pause_sglang_takes_after_its_round_gave_up_is_undone(sglang):
    """SGLang stalls (SIGSTOP) past a round's deadline: the agent's pause and its resume
    time out, and SGLang, when it goes on, takes them in whatever order its threads
    run them. The agent cannot ask SGLang whether it is paused; it sends its own state
    (running) again once SGLang answers, so SGLang does not stay paused, serving
    nothing, while the agent reports it ready. (vLLM, which can say, is put back by
    comparing: tests/vllm/test_vllm_e2e.py.)"""
    address, _, url, calls, standin = sglang
    async with TrainerClient(address, transport="group", resume_grace_s=3) as client:
        assert (await client.update_weights(tiny_weights(1), version=1, timeout_s=60)).ok
        os.kill(standin.pid, signal.SIGSTOP)
        try:
            with pytest.raises(WeightSyncError):
                await client.update_weights(tiny_weights(2), version=2, timeout_s=3)
        finally:
            os.kill(standin.pid, signal.SIGCONT)
        await wait_standin_paused(url, "", "the round that gave up is over")
        end = time.monotonic() + 20
        while not (state := (await client.get_state()).engines[0]).ready:
            assert time.monotonic() < end, f"SGLang is not ready again: {state}"
            await asyncio.sleep(0.1)
        assert "/pause_generation" in [p for p, _ in calls_of(calls)]
        assert get(url, "/standin/paused")["paused"] == ""  # and it stays so
        weights = tiny_weights(seed=3)
        assert (await client.update_weights(weights, version=3, timeout_s=60)).ok
        assert get(url, "/standin/weights")["digest"] == weights_digest(sorted(weights))


def test_a_sharded_trainers_parts_are_gathered_into_rank_0_which_sends_sglang_the_full_tensors(sglang, tmp_path):
    """SGLang's update group has one sender, so a ``DistributedTrainerClient`` with the
    group transport gathers every rank's parts into rank 0 over weightsync's own lanes
    (shm here) before the round starts, and rank 0 broadcasts the full tensors in the
    group. Tensor parallel over two real rank processes (column and row slices, staged
    and copied into place in rank 0). SGLang ends bitwise equal to the trainer's full
    model as torch itself gathers it (for the check only). A rank that leaves a shard
    out (FSDP2): the same typed error on both ranks, and no call reaches SGLang. (The gather's
    own check, ``verify_digest``, is tested into reference engines: SGLang gives no
    digest, so it refuses such rounds.)"""
    address, _, url, calls, standin = sglang
    common = ["--model", PRESETS["tiny"].to_json(), "--timeout", "60", "--transport", "group"]
    with TrainerRanks(str(tmp_path / "ranks"), address, 2,
                      [*common, "--parallel", "tp", "--rounds", "2", "--check-digests"]) as ranks:
        assert ranks.wait(240) == [0, 0], ranks.tail()
        rounds = [ranks.rounds(rank) for rank in (0, 1)]
        assert all(r[v]["ok"] for r in rounds for v in (1, 2)), ranks.tail()
    assert rounds[0][1]["full_digest"] != rounds[0][2]["full_digest"]
    assert get(url, "/standin/weights")["digest"] == rounds[0][2]["full_digest"]
    lanes = [e.fields["lanes"] for e in asyncio.run(coordinator_events(address)) if e.kind == "broadcast_started"]
    assert lanes == ["group:sglang-0"] * 2, lanes  # one sender: rank 0, with the full tensors
    assert [p for p, _ in calls_of(calls)].count("/update_weights_from_distributed") == 2

    before = calls_of(calls)
    with TrainerRanks(str(tmp_path / "dropped"), address, 2,
                      [*common, "--parallel", "fsdp", "--rounds", "1", "--first-version", "3", "--drop-on-rank", "1"]) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail()
        lines = [ranks.rounds(rank)[3] for rank in (0, 1)]
        assert [line["error_type"] for line in lines] == ["InvalidArgument"] * 2, ranks.tail()
        assert lines[0]["error"] == lines[1]["error"] and "do not cover" in lines[0]["error"], ranks.tail()
    assert calls_of(calls) == before  # not even a pause
    assert standin.poll() is None
