"""Idempotency keys: at most one execution per key (unit tests of the store, then the
real stack with execution counts read back from the agents' event logs)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from weightsync import transport as transports
from weightsync.client import EngineClient, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import IdempotencyConflict, InvalidArgument, OperationAborted, TransferError
from weightsync.idempotency import IdempotencyStore, derive_key, validate_key
from weightsync.plan import BucketPlan
from weightsync.statedb import StateDB
from weightsync.transport.store import host_store
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def req(key: str, version: int) -> coordinator_pb2.ResumeRequest:
    # any message with an idempotency_key works; allow_torn stands in for "the request"
    return coordinator_pb2.ResumeRequest(idempotency_key=key, allow_torn=version % 2 == 0)


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    db = StateDB(str(tmp_path / "s.db")) if request.param == "sqlite" else None
    yield IdempotencyStore(db)
    if db is not None:
        db.close()


async def test_runs_once_and_replays_outcome(store):
    runs = 0

    async def op():
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)
        return coordinator_pb2.ResumeResponse(engines=[common_pb2.EngineOutcome(engine_id=f"e{runs}")])

    results = await asyncio.gather(*(store.execute("k1", "resume", req("k1", 1), op,
                                                   coordinator_pb2.ResumeResponse) for _ in range(5)))
    again = await store.execute("k1", "resume", req("k1", 1), op, coordinator_pb2.ResumeResponse)
    assert runs == 1 and store.executions == 1
    assert all(r == results[0] for r in [*results, again])


async def test_stored_error_is_replayed_not_rerun(store):
    runs = 0

    async def op():
        nonlocal runs
        runs += 1
        raise TransferError("the wire broke")

    for _ in range(3):
        with pytest.raises(TransferError, match="the wire broke"):
            await store.execute("k2", "resume", req("k2", 1), op, coordinator_pb2.ResumeResponse)
    assert runs == 1


async def test_same_key_different_request_conflicts(store):
    async def op():
        return coordinator_pb2.ResumeResponse()

    await store.execute("k3", "resume", req("k3", 1), op, coordinator_pb2.ResumeResponse)
    # a smaller timeout is the same request (a retry has less time left) ...
    retry = req("k3", 1)
    retry.timeout_s = 0.5
    await store.execute("k3", "resume", retry, op, coordinator_pb2.ResumeResponse)
    # ... different content is not
    with pytest.raises(IdempotencyConflict) as info:
        await store.execute("k3", "resume", req("k3", 2), op, coordinator_pb2.ResumeResponse)
    assert info.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_key_validation_and_derivation():
    for bad in ("", "a" * 129, "tab\tkey", "ünï"):
        with pytest.raises(InvalidArgument):
            validate_key(bad)
    assert validate_key("a" * 128)
    k = derive_key("trainer-key", "engine-0")
    assert k == derive_key("trainer-key", "engine-0") != derive_key("trainer-key", "engine-1")
    assert validate_key(k)


async def test_running_operation_is_aborted_after_restart(tmp_path):
    path = str(tmp_path / "s.db")
    db = StateDB(path)
    store = IdempotencyStore(db)
    started = asyncio.Event()

    async def hang():
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(store.execute("k4", "resume", req("k4", 1), hang, coordinator_pb2.ResumeResponse))
    await started.wait()
    db.close()  # the process "dies" with the operation running: no outcome recorded
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    db2 = StateDB(path)
    try:
        # simulate what a crash leaves: the row still says running
        db2.run_sync(lambda c: c.execute("UPDATE idempotency SET state='running' WHERE key='k4'"))
        store2 = IdempotencyStore(db2)
        assert store2.recover() == 1
        ran = False

        async def op():
            nonlocal ran
            ran = True
            return coordinator_pb2.ResumeResponse()

        with pytest.raises(OperationAborted):
            await store2.execute("k4", "resume", req("k4", 1), op, coordinator_pb2.ResumeResponse)
        assert not ran
    finally:
        db2.close()


async def test_retention_is_bounded(tmp_path):
    store = IdempotencyStore(None, max_records=10)

    async def op():
        return coordinator_pb2.ResumeResponse()

    for i in range(25):
        await store.execute(f"k{i}", "resume", req(f"k{i}", 1), op, coordinator_pb2.ResumeResponse)
    assert len(store._memory) <= 11


# ----- the real stack -------------------------------------------------------------------

async def transfer_counts(cluster) -> dict[str, int]:
    counts = {}
    for agent in cluster.agents:
        async with EngineClient(agent.address) as engine:
            counts[agent.engine_id] = [e.kind for e in await engine.events()].count("transfer_started")
    return counts


async def test_repeated_broadcast_with_same_key_runs_once(cluster):
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        await client.pause()
        first = await client.broadcast(model.named_parameters(), version=1, key="bcast-1", timeout_s=30)
        second = await client.broadcast(model.named_parameters(), version=1, key="bcast-1", timeout_s=30)
        assert first.ok and second.ok and first.engines == second.engines
        with pytest.raises(IdempotencyConflict):
            await client.broadcast(model.named_parameters(), version=2, key="bcast-1", timeout_s=30)
        await client.resume()
    assert await transfer_counts(cluster) == {"engine-0": 1, "engine-1": 1}


async def test_concurrent_duplicate_broadcasts_share_one_transfer(cluster):
    model = ReferenceLM(PRESETS["tiny"])
    tensors = [t.detach() for _, t in model.named_parameters()]
    plan = BucketPlan.from_tensors(list(model.named_parameters()))
    store = host_store("127.0.0.1", timeout_s=30)
    sender = transports.make_sender(common_pb2.TRANSPORT_KIND_GLOO, store)
    request = coordinator_pb2.BroadcastRequest(
        idempotency_key="dup-1", version=1, plan=plan.to_proto(), transport=common_pb2.TRANSPORT_KIND_GLOO,
        store_host="127.0.0.1", store_port=store.port, timeout_s=30)
    async with TrainerClient(cluster.address) as client:
        await client.pause()
    sends = 0

    async def caller(stub):
        nonlocal sends
        events = []
        async for event in stub.Broadcast(request, timeout=60):
            events.append(event)
            if event.WhichOneof("event") == "rendezvous":
                sends += 1
                await asyncio.to_thread(sender.send, event.rendezvous, plan, tensors,
                                        deadline_at=time.monotonic() + 30, abort=threading.Event())
        return events

    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        a, b = await asyncio.gather(caller(stub), caller(stub))
    sender.close()
    assert sends == 1, "exactly one caller may drive the transfer"
    assert a[-1].result == b[-1].result and a[-1].result.ok
    assert await transfer_counts(cluster) == {"engine-0": 1, "engine-1": 1}
    async with TrainerClient(cluster.address) as client:
        await client.resume()
