"""One engine's Receive: its request serialised on a worker thread (the whole plan
encoded once for all engines and appended, or named by id to an agent that holds
it), and sent again whole to an agent that forgot the plan (PLAN_UNKNOWN)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from weightsync.errors import PlanUnknown, from_rpc_error
from weightsync.idempotency import derive_key
from weightsync.server.coordinator.broadcast_setup import BroadcastSetup
from weightsync.server.coordinator.registry import EngineRecord
from weightsync.v1 import agent_pb2, common_pb2, coordinator_pb2

RECEIVE_PLAN_FIELD = agent_pb2.ReceiveRequest.DESCRIPTOR.fields_by_name["plan"].number
Emit = Callable[..., Awaitable[None]]  # emit(kind, engine_id="", **fields): the coordinator's event stream


def receive_payload(request: coordinator_pb2.BroadcastRequest, setup: BroadcastSetup, record: EngineRecord,
                    validate_only: bool, by_reference: bool) -> bytes:
    """One engine's Receive, serialised. The whole plan is encoded once and appended
    (protobuf merges concatenated messages): not copied and re-encoded per engine."""
    head = agent_pb2.ReceiveRequest(
        idempotency_key=derive_key(request.idempotency_key, record.engine_id), version=request.version,
        plan=setup.plan.reference_proto() if by_reference else None, rendezvous=setup.lane_of[record.engine_id],
        rank=setup.ranks[record.engine_id], weights_digest=request.weights_digest, timeout_s=setup.timeout_s,
        validate_only=validate_only, probe=request.probe if request.HasField("probe") else None,
        relay=setup.relay_of.get(record.engine_id), owners=setup.owners_for(record.engine_id),
    ).SerializeToString()
    return head if by_reference else head + setup.plan.embedded(RECEIVE_PLAN_FIELD)

async def call_receive(request: coordinator_pb2.BroadcastRequest, setup: BroadcastSetup, record: EngineRecord,
                       validate_only: bool, rpc_timeout_s: float, *, emit: Emit) -> common_pb2.EngineOutcome:
    """One engine's Receive. Built on a worker thread: a whole plan may name 20k
    tensors. An agent that took this plan before gets its id alone; one that forgot
    it (PLAN_UNKNOWN: nothing ran) gets the whole plan again."""
    plan_id = setup.plan.plan_id
    by_reference = plan_id in record.plans_held
    payload = await asyncio.to_thread(receive_payload, request, setup, record, validate_only, by_reference)
    try:
        reply = await record.receive_serialized(payload, timeout=rpc_timeout_s)
    except grpc.aio.AioRpcError as exc:
        if not (by_reference and isinstance(from_rpc_error(exc), PlanUnknown)):
            raise
        record.plans_held.discard(plan_id)
        await emit("plan_unknown", engine_id=record.engine_id, plan_id=plan_id)
        payload = await asyncio.to_thread(receive_payload, request, setup, record, validate_only, False)
        reply = await record.receive_serialized(payload, timeout=rpc_timeout_s)
    record.plans_held.add(plan_id)
    return reply.outcome
