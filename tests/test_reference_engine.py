"""The reference engine behaves like the real ones (in-process; it is our own engine)."""

from __future__ import annotations

import time

import pytest
import torch

from weightsync.engine.model import (
    PRESETS,
    ModelConfig,
    ReferenceLM,
    config_for_size,
    resolve_config,
)
from weightsync.engine.reference import ReferenceEngine
from weightsync.errors import EngineFault, FailedPrecondition, InvalidArgument, StepTimeoutError
from weightsync.v1 import common_pb2

KEEP, ABORT, WAIT = common_pb2.PAUSE_MODE_KEEP, common_pb2.PAUSE_MODE_ABORT, common_pb2.PAUSE_MODE_WAIT


@pytest.fixture
def engine():
    e = ReferenceEngine(PRESETS["tiny"], step_delay_s=0.005)
    yield e
    e.close()


def wait_tokens(engine, rid, n, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while len(engine.get(rid).tokens) < n:
        assert time.monotonic() < end, "engine made no progress"
        time.sleep(0.005)


def test_generation_matches_the_model_and_tags_versions(engine):
    rid = engine.submit([10, 20, 30], 8)
    req = engine.get(rid, wait_s=10)
    assert req.status == "finished" and len(req.tokens) == 8 and req.versions == [0] * 8
    # The cached incremental path agrees with a full causal forward pass (greedy).
    model = ReferenceLM(PRESETS["tiny"])
    seq = [10, 20, 30]
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert req.tokens == seq[3:]


def test_continuous_requests_join_and_leave(engine):
    ids = [engine.submit([i + 1], 5 + i) for i in range(12)]  # more than max_running slots
    for i, rid in enumerate(ids):
        req = engine.get(rid, wait_s=20)
        assert req.status == "finished" and len(req.tokens) == 5 + i


def test_keep_pause_holds_requests_and_resume_continues(engine):
    rid = engine.submit([1, 2, 3], 100)
    wait_tokens(engine, rid, 2)
    engine.pause(KEEP)
    held = len(engine.get(rid).tokens)
    queued = engine.submit([4, 5], 3)  # accepted and queued while paused
    time.sleep(0.1)
    assert len(engine.get(rid).tokens) == held and engine.get(queued).status == "queued"
    engine.weight_version = 7
    engine.resume()
    req = engine.get(rid, wait_s=20)
    assert req.status == "finished" and req.versions[held - 1] == 0 and req.versions[-1] == 7
    assert engine.get(queued, wait_s=10).versions == [7, 7, 7]


def test_abort_pause_ends_requests(engine):
    rid = engine.submit([1, 2, 3], 100)
    wait_tokens(engine, rid, 1)
    engine.pause(ABORT)
    assert engine.get(rid).status == "aborted"
    assert engine.counts() == (0, 0)


def test_wait_pause_finishes_in_flight_and_holds_new(engine):
    rid = engine.submit([1, 2, 3], 20)
    wait_tokens(engine, rid, 1)
    engine.pause(WAIT, timeout_s=20)
    assert engine.get(rid).status == "finished"
    late = engine.submit([9], 3)
    time.sleep(0.05)
    assert engine.get(late).status == "queued"
    engine.resume()
    assert engine.get(late, wait_s=10).status == "finished"


def test_wait_pause_times_out_and_changes_nothing():
    e = ReferenceEngine(PRESETS["tiny"], step_delay_s=0.05)
    try:
        rid = e.submit([1], 100)
        with pytest.raises(StepTimeoutError) as info:
            e.pause(WAIT, timeout_s=0.2)
        assert info.value.operation == "pause"
        assert not e.paused and e.get(rid).status == "running"
    finally:
        e.close()


def test_sleep_frees_kv_and_a_step_while_asleep_is_a_hard_fault(engine):
    rid = engine.submit([1, 2, 3], 100)
    wait_tokens(engine, rid, 2)
    engine.pause(KEEP)
    assert engine.kv_bytes() > 0
    assert engine.sleep(["kv_cache"]) == ["kv_cache"]
    assert engine.kv_bytes() == 0
    engine.resume()  # like vLLM's /resume: does not check sleep state
    end = time.monotonic() + 10
    while engine.fault is None and time.monotonic() < end:
        time.sleep(0.01)
    assert "KV cache asleep" in engine.fault
    assert engine.get(rid).status == "failed"
    with pytest.raises(EngineFault):
        engine.submit([1], 1)


def test_wake_kv_recomputes_and_continues(engine):
    rid = engine.submit([1, 2, 3], 40)
    wait_tokens(engine, rid, 3)
    engine.pause(KEEP)
    engine.sleep(["kv_cache"])
    engine.wake(["kv_cache"])
    engine.resume()
    req = engine.get(rid, wait_s=20)
    assert req.status == "finished" and engine.fault is None
    # recomputing the cache gives the same greedy continuation as never sleeping
    again = engine.get(engine.submit([1, 2, 3], 40), wait_s=20)
    assert again.tokens == req.tokens


def test_weights_sleep_really_frees_them(engine):
    engine.pause(KEEP)
    engine.sleep(["weights"])
    assert all(t.numel() == 0 for _, t in engine.named_tensors())
    engine.wake(["weights"])
    specs = engine.tensor_specs()
    assert all(tuple(t.shape) == specs[n][1] and not t.any() for n, t in engine.named_tensors())


def test_sleep_needs_pause_and_tags_are_checked(engine):
    with pytest.raises(FailedPrecondition):
        engine.sleep(["kv_cache"])
    engine.pause(KEEP)
    with pytest.raises(InvalidArgument):
        engine.sleep(["gpu"])


def test_bad_requests(engine):
    for prompt, n in (([], 3), ([300], 3), ([1], 0), ([1], 1000)):
        with pytest.raises(InvalidArgument):
            engine.submit(prompt, n)
    with pytest.raises(InvalidArgument):
        engine.get("req-nope")


def test_configs():
    assert resolve_config("tiny") == PRESETS["tiny"]
    assert resolve_config('{"d_model": 32, "n_heads": 2}').d_model == 32
    for bad in ("huge", '{"d_model": 30, "n_heads": 4}', '{"bogus": 1}', "{not json"):
        with pytest.raises(InvalidArgument):
            resolve_config(bad)
    cfg = config_for_size(64 * 1024 * 1024, 100)
    size = sum(p.numel() * 4 for p in ReferenceLM(cfg).parameters())
    assert 0.5 < size / (64 * 1024 * 1024) < 2.0
    assert ModelConfig().head_dim == 16


@pytest.mark.parametrize("tensors", [89, 512, 2048])
def test_moe_shape_profile_makes_many_small_expert_tensors(tensors):
    cfg = config_for_size(1 << 30, tensors, profile="moe")
    with torch.device("meta"):  # shapes only: no 1 GiB allocation
        named = list(ReferenceLM(cfg).named_parameters())
    assert 0.9 < len(named) / tensors < 1.1
    assert 0.85 < sum(p.numel() * 4 for _, p in named) / (1 << 30) < 1.05
    experts = [n for n, _ in named if ".moe.experts." in n]
    assert len(experts) / len(named) > 0.5  # most tensors are expert matrices
    assert max(p.numel() for n, p in named if n in set(experts)) < max(p.numel() for _, p in named)
    # The layout arithmetic the 20k-tensor sweeps rely on (building that model takes
    # about a minute of module construction on a busy machine): 8 attention and norm
    # tensors, a router and 3 per expert in each layer, 5 outside.
    assert len(named) == cfg.n_layers * (9 + 3 * cfg.n_experts) + 5
    big = config_for_size(1 << 30, 20000, profile="moe")
    assert big.n_experts == 128 and 0.95 < (big.n_layers * (9 + 3 * 128) + 5) / 20000 < 1.05


def test_moe_model_routes_tokens_and_caches_like_the_batched_pass():
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=16, n_layers=2, n_experts=8, experts_per_token=2,
                      max_seq_len=32)
    model = ReferenceLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (12,))
    batched = model(tokens.unsqueeze(0))[0]
    cache = torch.zeros(model.kv_shape())
    cached = torch.cat([model.forward_cached(tokens[:5], cache, 0, all_logits=True),
                        model.forward_cached(tokens[5:], cache, 5, all_logits=True)])
    assert torch.allclose(batched, cached, atol=1e-5)
    # Changing one expert's weights changes the output only through the tokens routed to it.
    with torch.no_grad():
        for expert in model.blocks[0].moe.experts:
            expert.down.weight.zero_()
        assert not torch.allclose(model(tokens.unsqueeze(0))[0], batched)


def test_moe_configs_are_checked():
    for bad in ('{"n_experts": -1}', '{"n_experts": 4, "experts_per_token": 5}',
                '{"n_experts": 4, "experts_per_token": 0}', '{"n_experts": true}'):
        with pytest.raises(InvalidArgument):
            resolve_config(bad)
    with pytest.raises(InvalidArgument):
        config_for_size(1 << 20, 100, profile="sparse")
    assert resolve_config('{"n_experts": 4}').experts_per_token == 2


def test_state_reads_never_wait_for_a_running_step(engine):
    # The agent reads the reference engine's state live on its event loop (heartbeats,
    # GetState); a step holds the engine's lock for a whole forward pass.
    import threading

    engine.submit([1, 2, 3], 5)
    got = {}
    with engine._cond:  # as a long step would

        def read():
            got["counts"] = engine.counts()
            got["fault"], got["version"] = engine.fault, engine.weight_version
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=2.0)
        blocked = reader.is_alive()
    reader.join()
    assert not blocked, "reading the engine's state waited for its lock"
    assert sum(got["counts"]) >= 1 and got["fault"] is None
