"""TrainerClient.check_engines against a real coordinator and agents: an engine holding
the trainer's bytes, one holding others, one the coordinator cannot read (a frozen
agent, SIGSTOP), and requests that cannot be asked."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from weightsync.client import TrainerClient
from weightsync.client.verify import check_engines, trainer_digest
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import InvalidArgument
from weightsync.packing import pack_bucket, unpack_bucket, weights_digest
from weightsync.plan import BucketPlan


async def _wait_unavailable(client: TrainerClient, engine_id: str, within_s: float = 15.0) -> None:
    end = time.monotonic() + within_s
    while any(e.available for e in (await client.get_state()).engines if e.engine_id == engine_id):
        assert time.monotonic() < end, f"a frozen {engine_id} still counts as available"
        await asyncio.sleep(0.1)


async def test_holding_other_bytes_and_too_few_engines_are_told_apart(cluster_factory):
    cluster = cluster_factory(1)
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        check = await client.check_engines(model.named_parameters(), version=1, engines=1)
        assert check.ok and check.holding == ["engine-0"] and not check.unread and not check.different
        assert check.digest == weights_digest(model.named_parameters())  # the trainer's own tensors
        assert "every one holds" in check.describe()

        # the same bytes at another version do not pass a check for that version
        assert not (await client.check_engines(model.named_parameters(), version=2)).ok

        sent = check.digest
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        check = await client.check_engines(model.named_parameters(), version=1)
        assert not check.ok and [e.engine_id for e in check.different] == ["engine-0"] and not check.unread
        assert f"engine-0: digest {sent[:12]} at version 1" in check.describe()

        calls = []

        async def get_state():
            calls.append(time.monotonic())
            return await client.get_state(include_digests=True)

        check = await check_engines(get_state, sent, engines=2, within_s=1.0)
        assert not check.ok and check.registered == 1 and "1 of 2 engines registered" in check.describe()
        assert len(calls) >= 2, "a missing engine is asked for again until the deadline"


async def test_an_engine_the_coordinator_cannot_read_is_unread_not_different(cluster_factory):
    cluster = cluster_factory(2)
    model = ReferenceLM(PRESETS["tiny"])
    frozen = cluster.agents[0]
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            await _wait_unavailable(client, frozen.engine_id)
            check = await client.check_engines(model.named_parameters(), version=1, within_s=1.0)
            assert not check.ok
            assert [e.engine_id for e in check.unread] == [frozen.engine_id] and not check.different
            assert f"{frozen.engine_id}: no digest (available=False" in check.describe()
            # only the engine that can be read: it holds the bytes, at once
            check = await client.check_engines(model.named_parameters(), version=1, engine_ids=["engine-1"])
            assert check.ok and check.holding == ["engine-1"]
            # an id the coordinator does not know is unread, not skipped
            check = await client.check_engines(model.named_parameters(), engine_ids=["engine-1", "engine-9"],
                                               within_s=0.5)
            assert not check.ok and [e.engine_id for e in check.unread] == ["engine-9"]
            assert "1 of 2 engines registered" in check.describe() and "not registered" in check.describe()
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        # thawed while the check asks again: it ends as soon as every engine is read
        check = await client.check_engines(model.named_parameters(), version=1, engines=2, within_s=60.0)
        assert check.ok and check.holding == ["engine-0", "engine-1"], check.describe()


def test_the_trainers_digest_is_of_what_a_receiver_unpacks_with_a_wire_dtype():
    """With ``wire_dtype`` an engine holds the cast tensors: the digest a check compares
    with is that of what a receiver unpacks through the cast plan (the packing path,
    not the digest's own cast), and not that of the trainer's fp32 tensors."""
    named = [("w", torch.randn(7, 3)), ("i", torch.arange(5)), ("h", torch.randn(4).half())]
    plan = BucketPlan.from_tensors(named, bucket_bytes=64, wire_dtype=torch.bfloat16)
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in plan.slots]
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    for b in range(plan.num_buckets):
        pack_bucket(plan, b, [t for _, t in named], buf)
        unpack_bucket(plan, b, buf, targets)
    received = weights_digest(zip(plan.names, targets, strict=True))
    assert trainer_digest(named, torch.bfloat16) == received
    assert trainer_digest(named) == weights_digest(named) != received


@pytest.mark.parametrize("kwargs, message", [
    (dict(within_s=-1.0), "within_s"),
    (dict(within_s=float("nan")), "within_s"),
    (dict(engines=0), "engines must be"),
    (dict(engines=1, engine_ids=["engine-0"]), "not both"),
    (dict(engine_ids="engine-0"), "collection of engine ids"),
    (dict(engine_ids=[]), "names no engine"),
    (dict(digest="abc"), "one of the two"),
])
async def test_a_check_that_cannot_be_asked_is_refused_before_any_tensor_is_read(kwargs, message):
    read = []

    def tensors():
        read.append(True)
        yield "w", torch.zeros(2)

    client = TrainerClient("127.0.0.1:1")  # never started: a refusal asks no coordinator
    with pytest.raises(InvalidArgument, match=message):
        await client.check_engines(tensors(), **kwargs)
    with pytest.raises(InvalidArgument, match="one of the two"):
        await client.check_engines()
    assert read == []
