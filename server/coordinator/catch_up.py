"""Catch-up: the coordinator brings a lagging engine to the fleet's version from a ready
peer, without the trainer.

Between trainer rounds (no round paused or broadcasting, the round lock free), every
``interval_s`` it looks for a *joiner* -- an available engine that is fenced and holds
a version older than the fleet's (a new replica, a relaunched engine, one that missed a
round) -- and a *source*: an available, ready engine at the fleet's version whose
adapter can export its weights. Holding the round lock (a trainer's Pause waits for the
catch-up; a catch-up never runs while a Broadcast moves an engine), it asks the source
to ``Export`` and the joiner to ``Receive`` the same stream, over shm when both agents
are on the same host and gloo otherwise, under keys derived from (engine, version) and
a nonce per attempt. The joiner's agent lifts its own fence once it holds the fleet's
version. A failed attempt leaves the joiner fenced (torn if bytes landed) and the
source is not tried again for that version; with no source left (all torn, or engines
that cannot export, as vLLM on CPU), or a joiner that takes neither transport (SGLang:
its update group only, ``EngineState.receives``), the next Broadcast includes the
joiner.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from weightsync import transport as transports
from weightsync.errors import EngineUnavailable, TransferError, WeightSyncError, from_rpc_error
from weightsync.idempotency import derive_key
from weightsync.server.coordinator.agent_calls import call_agent
from weightsync.server.coordinator.registry import EngineRecord, EngineRegistry
from weightsync.server.coordinator.round import RPC_MARGIN_S, SyncRound
from weightsync.server.coordinator.service import OPERATION_KEY
from weightsync.v1 import agent_pb2, common_pb2

log = logging.getLogger("weightsync.coordinator")
DEFAULT_INTERVAL_S = 0.5
DEFAULT_TIMEOUT_S = 300.0
Emit = Callable[..., Awaitable[None]]


def same_host(a: EngineRecord, b: EngineRecord) -> bool:
    """Whether shm works between two engines: the host ids they report are equal (an
    address's host part is not enough: containers and namespaces share 127.0.0.1)."""
    return bool(a.state.host_id) and a.state.host_id == b.state.host_id


class CatchUp:
    """The coordinator's catch-up loop (see the module docstring)."""

    def __init__(self, round_: SyncRound, registry: EngineRegistry, *, emit: Emit,
                 interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = 0, transport: str = "auto") -> None:
        if transport not in ("auto", "shm", "gloo"):
            raise ValueError(f"catch-up transport must be auto, shm or gloo, got {transport!r}")
        self.round = round_
        self.registry = registry
        self.emit = emit
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self._tried: dict[tuple[str, int], set[str]] = {}   # (joiner, version) -> sources that failed it
        self._done: set[tuple[str, int]] = set()            # (joiner, version) caught up, until it reports so

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until ``stop``; one catch-up at a time."""
        while not stop.is_set():
            try:
                await self.once()
            except Exception:  # never let one bad attempt end the loop
                log.exception("catch-up attempt failed unexpectedly")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass

    def _between_rounds(self) -> bool:
        return self.round.phase in ("idle", "failed") and not self.round.lock.locked()

    def _pairs(self) -> list[tuple[EngineRecord, EngineRecord]]:
        """(joiner, source) pairs worth an attempt now."""
        fleet = self.round.weight_version
        if fleet == 0 or not self._between_rounds():
            return []
        # What was tried or done for older versions no longer matters: drop it.
        self._tried = {k: v for k, v in self._tried.items() if k[1] == fleet}
        self._done = {k for k in self._done if k[1] == fleet}
        available = self.registry.available()
        sources = [r for r in available if r.state.ready and r.state.can_export and r.state.weight_version == fleet]
        pairs = []
        for joiner in available:
            state = joiner.state
            if (not state.fenced or state.receiving or state.weight_version >= fleet
                    or joiner.engine_id in self.round.round_engines or (joiner.engine_id, fleet) in self._done):
                continue
            tried = self._tried.get((joiner.engine_id, fleet), set())
            source = next((s for s in sources if s.engine_id not in tried and s is not joiner
                           and self._takes(joiner, self._transport(joiner, s))), None)
            if source is not None:
                pairs.append((joiner, source))
        return pairs

    async def once(self) -> None:
        for joiner, source in self._pairs():
            async with self.round.lock:
                fleet = self.round.weight_version
                if self.round.phase not in ("idle", "failed") or source.state.weight_version != fleet:
                    return  # a round ran meanwhile: look again next time
                ok = await self._catch_up(joiner, source, fleet)
            if ok:
                self._done.add((joiner.engine_id, fleet))
            else:
                self._tried.setdefault((joiner.engine_id, fleet), set()).add(source.engine_id)

    def _transport(self, joiner: EngineRecord, source: EngineRecord) -> int:
        """shm where the two share a host (or shm is asked for), else gloo."""
        use_shm = self.transport == "shm" or (self.transport == "auto" and same_host(joiner, source))
        return common_pb2.TRANSPORT_KIND_SHM if use_shm else common_pb2.TRANSPORT_KIND_GLOO

    @staticmethod
    def _takes(joiner: EngineRecord, kind: int) -> bool:
        """Whether the joiner receives over ``kind`` (an agent that does not say: yes).
        One that does not (SGLang: its update group only) waits for the next Broadcast."""
        return not joiner.state.receives or kind in joiner.state.receives

    async def _catch_up(self, joiner: EngineRecord, source: EngineRecord, fleet: int) -> bool:
        """One attempt; True if the joiner now holds the fleet's version."""
        key = derive_key(f"catchup-{joiner.engine_id}-v{fleet}", uuid.uuid4().hex[:12])
        kind = self._transport(joiner, source)
        token = OPERATION_KEY.set(key)  # the attempt's events carry its key
        try:
            return await self._attempt(joiner, source, fleet, key, kind)
        finally:
            OPERATION_KEY.reset(token)

    async def _attempt(self, joiner: EngineRecord, source: EngineRecord, fleet: int, key: str, kind) -> bool:
        rendezvous = common_pb2.Rendezvous(group_id=f"catchup-{uuid.uuid4().hex[:16]}", transport=kind,
                                           session_id=uuid.uuid4().hex, world_size=2)
        await self.emit("catch_up_started", joiner.engine_id, source=source.engine_id, version=fleet,
                        transport=transports.KIND_NAMES[kind])
        started = time.monotonic()
        export = None
        try:
            try:
                export = source.stub.Export(agent_pb2.ExportRequest(
                    idempotency_key=derive_key(key, source.engine_id), version=fleet, rendezvous=rendezvous,
                    timeout_s=self.timeout_s, bucket_bytes=self.bucket_bytes), timeout=self.timeout_s + RPC_MARGIN_S)
            except grpc.aio.UsageError:  # the source deregistered a moment ago
                raise EngineUnavailable(f"source {source.engine_id} went away (its channel closed)") from None
            ready = await call_agent(source, export.read, "catch-up")
            if ready is grpc.aio.EOF or not ready.HasField("ready"):
                raise TransferError(f"source {source.engine_id} ended its export without a rendezvous")
            received = await call_agent(joiner, lambda: joiner.stub.Receive(agent_pb2.ReceiveRequest(
                idempotency_key=derive_key(key, joiner.engine_id), version=fleet, plan=ready.ready.plan,
                rendezvous=ready.ready.rendezvous, rank=1, timeout_s=self.timeout_s),
                timeout=self.timeout_s + RPC_MARGIN_S), "catch-up")
            outcome = received.outcome
            result = await call_agent(source, export.read, "catch-up")
            if result is grpc.aio.EOF or not result.HasField("result") or not result.result.ok:
                raise TransferError(f"source {source.engine_id} did not confirm the export")
        except (grpc.aio.AioRpcError, WeightSyncError) as exc:
            error = from_rpc_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
            if export is not None:
                export.cancel()  # a source still waiting for the joiner stops sending
            await self.emit("catch_up_failed", joiner.engine_id, source=source.engine_id, version=fleet,
                            reason=error.reason, message=error.message)
            return False
        joiner.state.weight_version = fleet  # until its next heartbeat says so itself
        await self.emit("catch_up_done", joiner.engine_id, source=source.engine_id, version=fleet,
                        bytes=outcome.bytes, seconds=f"{time.monotonic() - started:.4f}")
        return True


__all__ = ["CatchUp"]
