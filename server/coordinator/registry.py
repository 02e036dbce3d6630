"""The coordinator's engine registry: who is registered, who is alive, how to reach them.

Liveness is heartbeat age: an engine is available while its last heartbeat is newer
than ``heartbeat_timeout_s`` and it does not report a fault. Registrations persist in
the state database; after a coordinator restart every engine counts as unavailable
until its agent heartbeats again.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.grpc_options import CHANNEL_OPTIONS
from weightsync.security import INSECURE, Security
from weightsync.v1 import agent_pb2, agent_pb2_grpc, common_pb2


@dataclass
class EngineRecord:
    """One registered engine and the channel to its agent."""

    engine_id: str
    address: str
    model: str
    channel: grpc.aio.Channel
    stub: agent_pb2_grpc.EngineAgentServiceStub
    last_heartbeat: float = 0.0                       # time.monotonic(); 0 = never
    # Changes on every registration: an agent that registers again (a restarted
    # process) holds no data-plane group, so no group id may carry over to it.
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Set when a direct call (GetState's probe) found the agent unreachable; cleared
    # by its next heartbeat. Part of availability, so every path sees the same thing.
    unreachable: str = ""
    state: common_pb2.EngineState = field(default_factory=common_pb2.EngineState)
    # Plan ids this incarnation of the agent has taken in whole: Receive names them by id.
    plans_held: set[str] = field(default_factory=set, repr=False)
    _receive_raw: grpc.aio.UnaryUnaryMultiCallable | None = field(default=None, repr=False)

    def heartbeat_age(self) -> float:
        return float("inf") if not self.last_heartbeat else time.monotonic() - self.last_heartbeat

    def receive_serialized(self, payload: bytes, *, timeout: float) -> grpc.aio.UnaryUnaryCall:
        """``Receive`` with a request the caller already serialised (off the event loop):
        a plan of 20k tensors is a megabyte, and the stub would serialise it on the loop
        for every engine, twice a round."""
        if self._receive_raw is None:
            self._receive_raw = self.channel.unary_unary(
                "/weightsync.v1.EngineAgentService/Receive", request_serializer=None,
                response_deserializer=agent_pb2.ReceiveResponse.FromString)
        return self._receive_raw(payload, timeout=timeout)


PROBE_TIMEOUT_S = 3.0


async def unreachable_reason(channel: grpc.aio.Channel, *, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Why the agent behind ``channel`` does not answer a health check ("" when it does,
    with SERVING). Health checks need no token and are open to every authenticated peer."""
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                   timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return f"its health check failed ({exc.code().name})"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"its health check says {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return ""


class EngineRegistry:
    """Engines by id (in memory; persisted by the coordinator)."""

    def __init__(self, *, heartbeat_timeout_s: float, security: Security = INSECURE) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.security = security
        self._engines: dict[str, EngineRecord] = {}

    def upsert(self, engine_id: str, address: str, model: str, *, heartbeat: bool) -> tuple[EngineRecord, grpc.aio.Channel | None]:
        """Adds or updates an engine; returns it and a replaced channel to close, if any."""
        old = self._engines.get(engine_id)
        stale_channel = None
        if old is not None and old.address == address:
            record = old
            record.model = model
        else:
            channel = self.security.channel(address, options=CHANNEL_OPTIONS)
            record = EngineRecord(engine_id, address, model, channel, agent_pb2_grpc.EngineAgentServiceStub(channel))
            stale_channel = old.channel if old is not None else None
            self._engines[engine_id] = record
        if heartbeat:  # a registration
            record.last_heartbeat = time.monotonic()
            record.incarnation = uuid.uuid4().hex
            record.plans_held = set()  # a new process holds no plan
        return record, stale_channel

    async def probe(self, address: str) -> str:
        """Why an agent at ``address`` cannot be reached ("" when it answers)."""
        channel = self.security.channel(address, options=CHANNEL_OPTIONS)
        try:
            return await unreachable_reason(channel)
        finally:
            await channel.close(grace=None)

    def remove(self, engine_id: str) -> EngineRecord | None:
        return self._engines.pop(engine_id, None)

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def all(self) -> list[EngineRecord]:
        return sorted(self._engines.values(), key=lambda r: r.engine_id)

    def is_available(self, record: EngineRecord) -> bool:
        """The one availability view (Pause, Broadcast, GetState, metrics): heartbeats
        arriving, no fault reported, and not found unreachable since the last one."""
        return (record.heartbeat_age() < self.heartbeat_timeout_s and not record.state.faulted
                and not record.unreachable)

    def why_unavailable(self, record: EngineRecord) -> str:
        if record.state.faulted:
            return record.state.fault or "the engine reports a fault"
        if record.unreachable:
            return record.unreachable
        return f"no heartbeat for {record.heartbeat_age():.1f}s"

    def available(self) -> list[EngineRecord]:
        return [r for r in self.all() if self.is_available(r)]

    def view(self, record: EngineRecord) -> common_pb2.EngineState:
        """The engine's last reported state, with the coordinator's liveness view."""
        state = common_pb2.EngineState()
        state.CopyFrom(record.state)
        state.engine_id = record.engine_id
        state.address = record.address
        state.model = state.model or record.model
        state.available = self.is_available(record)
        age = record.heartbeat_age()
        state.heartbeat_age_s = age if age != float("inf") else -1.0
        return state

    async def close(self) -> None:
        for record in self._engines.values():
            await record.channel.close(grace=None)
        self._engines.clear()


__all__ = ["EngineRecord", "EngineRegistry"]
