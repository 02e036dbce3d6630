"""The Coordinator service: the control plane. It never touches tensor bytes.

Thin handlers: each validates its call, runs it once per idempotency key (the
SQLite-backed ``IdempotencyStore``) and maps errors to statuses. The sync round
itself -- Pause, Broadcast, Resume, its state and persistence -- is ``SyncRound``
(``server/coordinator/round.py``); registrations and availability are ``EngineRegistry``
(``server/coordinator/registry.py``); a running Broadcast's progress for its callers is
``BroadcastProgress``. Heartbeats, the event stream (``WatchEvents``) and
``GetState`` are here.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from weightsync import metrics
from weightsync.errors import (
    EngineUnavailable,
    FailedPrecondition,
    InvalidArgument,
    WeightSyncError,
    abort_with,
    nothing_changed,
)
from weightsync.event_log import EventLog
from weightsync.faults import FaultInjector
from weightsync.idempotency import IdempotencyStore, validate_key
from weightsync.loop_lag import LoopLagMonitor
from weightsync.security import INSECURE, Security
from weightsync.server.common.serving import WILDCARD_HOSTS
from weightsync.server.coordinator.agent_calls import call_agent
from weightsync.server.coordinator.broadcast_progress import BroadcastProgress
from weightsync.server.coordinator.registry import EngineRecord, EngineRegistry, unreachable_reason
from weightsync.server.coordinator.round import DEFAULT_PAUSE_TIMEOUT_S, SyncRound
from weightsync.server.coordinator.sync_ledger import SyncLedger, attempt_key
from weightsync.statedb import StateDB
from weightsync.v1 import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc
from weightsync.validate import MAX_ENGINE_ID_LEN, check_engine_id

log = logging.getLogger("weightsync.coordinator")
# The idempotency key of the operation the current task serves: events it emits
# carry it, so an operator can count executions per key.
OPERATION_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("weightsync_operation_key", default="")

MAX_ADDRESS_LEN = 512


def check_agent_address(address: str) -> None:
    """``HOST:PORT`` with a port in 1..65535 and a host of visible ASCII (no NUL, space or
    control character); InvalidArgument otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"agent_address must be HOST:PORT, got {address[:100]!r}")
    if not all(32 < ord(c) < 127 for c in host):
        raise InvalidArgument(f"agent_address has a character that cannot be in a host name: {address[:100]!r}")
    if host in WILDCARD_HOSTS:
        raise InvalidArgument(f"agent_address {address!r} is a wildcard: no other host can reach it; start the agent "
                              "with --advertise HOST")


class CoordinatorCore(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The Coordinator service (see the module docstring)."""

    def __init__(self, db: StateDB, *, heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0,
                 idempotency_retention_s: float = 24 * 3600.0, idempotency_max_records: int = 100_000,
                 security: Security = INSECURE, faults: FaultInjector | None = None) -> None:
        self.db = db
        self.faults = faults
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry = EngineRegistry(heartbeat_timeout_s=heartbeat_timeout_s, security=security)
        self.idempotency = IdempotencyStore(db, retention_s=idempotency_retention_s,
                                            max_records=idempotency_max_records)
        self.events = EventLog(log)
        self.loop_lag = LoopLagMonitor("coordinator")  # run by the coordinator's main on its loop
        self._progress: dict[str, BroadcastProgress] = {}  # by key, while a Broadcast runs or is watched
        self.accepting = True
        self._load()
        # An agent's next heartbeat after a restart comes within its interval plus the
        # channel's reconnect backoff (at most 1 s); the heartbeat timeout bounds both.
        self.ledger = SyncLedger(db, retention_s=idempotency_retention_s, max_records=idempotency_max_records)
        self.round = SyncRound(db, self.registry, emit=self.emit, rejoin_window_s=heartbeat_timeout_s + 1.0,
                               ledger=self.ledger, faults=faults)

    # ----- persistent state -------------------------------------------------------------

    def _load(self) -> None:
        aborted = self.idempotency.recover()
        self._persisted_engines = self.db.run_sync(
            lambda conn: conn.execute("SELECT engine_id, address, model FROM engines").fetchall())
        if aborted:
            log.warning("finished %d interrupted operation(s) as ABORTED", aborted)

    def restore_engines(self) -> None:
        """Recreates channels to the engines known before a restart (unavailable until they heartbeat)."""
        for engine_id, address, model in self._persisted_engines:
            self.registry.upsert(engine_id, address, model, heartbeat=False)

    # ----- events -----------------------------------------------------------------------

    async def emit(self, kind: str, engine_id: str = "", **fields: object) -> None:
        """Adds an event to the stream WatchEvents serves (a coroutine: the round and
        the handlers await it wherever they are)."""
        self.events.append(kind, engine_id=engine_id, key=OPERATION_KEY.get(), **fields)

    # ----- helpers ----------------------------------------------------------------------

    async def _guard(self, context, coro_fn: Callable[[], Awaitable], *, key: str = ""):
        try:
            OPERATION_KEY.set(key)  # this handler's context; the operation's task copies it
            if not self.accepting:
                raise EngineUnavailable("coordinator is shutting down", reason="SHUTTING_DOWN")
            return await coro_fn()
        except WeightSyncError as exc:
            await abort_with(context, exc)

    # ----- Pause ------------------------------------------------------------------------

    async def Pause(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self._pause(request))

    async def _pause(self, request) -> coordinator_pb2.PauseResponse:
        """A Pause under its key -- under the key of its attempt when it starts a logical
        sync (``sync_key``; ``server/coordinator/sync_ledger.py``)."""
        validate_key(request.idempotency_key)
        sync = None
        if request.sync_key:
            validate_key(request.sync_key)
            # A Broadcast still running (its trainer may have died mid-transfer) decides
            # by its result whether this Pause continues its attempt or starts the next.
            await self.round.wait_idle(request.timeout_s or DEFAULT_PAUSE_TIMEOUT_S)
            attempt = self.ledger.attempt_for_pause(request.sync_key, round_id=self.round.round_id,
                                                    phase=self.round.phase)
            request.idempotency_key = attempt_key(request.idempotency_key, attempt)
            OPERATION_KEY.set(request.idempotency_key)
            sync = (request.sync_key, attempt)
        return await self.idempotency.execute(request.idempotency_key, "pause", request,
                                              lambda: self.round.pause(request, sync=sync),
                                              coordinator_pb2.PauseResponse)

    # ----- Broadcast --------------------------------------------------------------------

    async def Broadcast(self, request, context):
        self.loop_lag.round_started()
        try:
            validate_key(request.idempotency_key)
        except WeightSyncError as exc:
            await abort_with(context, exc)
        # Every caller of this key -- the one that starts the operation and any retry
        # that attaches to it -- gets its progress events, the ones so far included;
        # but only once the idempotency store accepted the request as the same one (a
        # conflicting request must never see another round's rendezvous).
        sync = None
        if request.sync_key:
            try:
                validate_key(request.sync_key)
            except WeightSyncError as exc:
                await abort_with(context, exc)
            attempt = self.ledger.attempt(request.sync_key)
            request.idempotency_key = attempt_key(request.idempotency_key, attempt)
            sync = (request.sync_key, attempt)
        key = request.idempotency_key
        progress: asyncio.Queue[coordinator_pb2.BroadcastResponse] = asyncio.Queue()
        subscribed: list[BroadcastProgress] = []

        def accepted() -> None:
            channel = self._progress.setdefault(key, BroadcastProgress())
            channel.subscribe(progress)
            subscribed.append(channel)

        def forget_channel(_operation: asyncio.Future | None = None) -> None:
            channel = self._progress.get(key)
            if channel is not None and not channel.subscribers and not self.idempotency.is_running(key):
                del self._progress[key]

        try:
            operation = asyncio.ensure_future(self._guard_broadcast(request, accepted, sync))
            operation.add_done_callback(forget_channel)
            while True:
                getter = asyncio.ensure_future(progress.get())
                try:
                    await asyncio.wait({operation, getter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    yield getter.result()
                    continue
                break
            while not progress.empty():
                yield progress.get_nowait()
        finally:
            for channel in subscribed:
                channel.unsubscribe(progress)
            forget_channel()
        try:
            # shield: a caller that goes away does not cancel the round; its retry attaches.
            result = await asyncio.shield(operation)
        except WeightSyncError as exc:
            await abort_with(context, exc)
            return
        yield coordinator_pb2.BroadcastResponse(result=result)

    async def _guard_broadcast(self, request, accepted: Callable[[], None],
                               sync: tuple[str, int] | None) -> coordinator_pb2.BroadcastResult:
        OPERATION_KEY.set(request.idempotency_key)  # this task's context; the operation's task copies it
        if not self.accepting:
            raise EngineUnavailable("coordinator is shutting down", reason="SHUTTING_DOWN")
        async def run() -> coordinator_pb2.BroadcastResult:
            channel = self._progress[request.idempotency_key]
            try:
                return await self.round.broadcast(request, channel, sync=sync)
            finally:
                channel.finish()

        return await self.idempotency.execute(request.idempotency_key, "broadcast", request, run,
                                              coordinator_pb2.BroadcastResult, on_accept=accepted)

    # ----- Resume -----------------------------------------------------------------------

    async def Resume(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self._resume(request))

    async def _resume(self, request) -> coordinator_pb2.ResumeResponse:
        validate_key(request.idempotency_key)
        sync = None
        if request.sync_key:
            validate_key(request.sync_key)
            record = self.ledger.get(request.sync_key)
            sync = (request.sync_key, record.attempt if record is not None else 1)
            if record is None:
                # No Pause of this sync has finished (a cancel that came during it): a
                # Resume runs safely again, and recording it would make the retry's own
                # Resume replay this one instead of releasing the retry's round.
                return await self.round.resume(request, sync=sync)
            request.idempotency_key = attempt_key(request.idempotency_key, record.attempt)
            OPERATION_KEY.set(request.idempotency_key)
        return await self.idempotency.execute(
            request.idempotency_key, "resume", request, lambda: self.round.resume(request, sync=sync),
            # Paused engines serve nothing: a Resume runs even when the disk cannot record it.
            coordinator_pb2.ResumeResponse, record_optional=True)

    # ----- registry ---------------------------------------------------------------------

    async def RegisterEngine(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self.idempotency.execute(
            request.idempotency_key, "register", request, lambda: self._register(request),
            coordinator_pb2.RegisterEngineResponse))

    async def _register(self, request) -> coordinator_pb2.RegisterEngineResponse:
        engine_id, address = request.engine_id, request.agent_address
        with nothing_changed():
            # Lengths first: they are cheap, and every later step may echo the fields.
            if len(engine_id) > MAX_ENGINE_ID_LEN or len(address) > MAX_ADDRESS_LEN or len(request.model) > 4096:
                raise InvalidArgument(f"engine_id (at most {MAX_ENGINE_ID_LEN}), agent_address (at most "
                                      f"{MAX_ADDRESS_LEN}) or model (at most 4096) is too long")
            check_engine_id(engine_id)
            check_agent_address(address)
            await self._refuse_hijack(engine_id, address)
            why = await self.registry.probe(address)
            if why:
                raise FailedPrecondition(f"agent {engine_id} registered at {address}, which does not answer: {why}",
                                         reason="AGENT_UNREACHABLE")
        record, stale = self.registry.upsert(engine_id, address, request.model, heartbeat=True)
        if stale is not None:
            await stale.close(grace=None)

        def save(conn):
            conn.execute("INSERT INTO engines(engine_id, address, model, registered_at) VALUES(?,?,?,?) "
                         "ON CONFLICT(engine_id) DO UPDATE SET address=excluded.address, model=excluded.model",
                         (engine_id, request.agent_address, request.model, time.time()))

        await self.db.run(save)
        await self.emit("engine_registered", engine_id, address=request.agent_address, model=request.model)
        return coordinator_pb2.RegisterEngineResponse(heartbeat_interval_s=self.heartbeat_interval_s,
                                                      weight_version=self.round.weight_version)

    async def _refuse_hijack(self, engine_id: str, address: str) -> None:
        """An id that is live at another address stays there: re-registering it elsewhere
        would cut the real agent off from rounds while it keeps heartbeating. The old
        registration yields once its heartbeats lapse, or at once if it no longer
        answers a health check (an agent restarted on a new port)."""
        old = self.registry.get(engine_id)
        if old is None or old.address == address or old.heartbeat_age() >= self.registry.heartbeat_timeout_s:
            return
        if await unreachable_reason(old.channel, timeout_s=1.0):
            return
        raise FailedPrecondition(f"engine {engine_id} is live at {old.address}; a registration from {address} is "
                                 f"refused until that one expires ({self.registry.heartbeat_timeout_s:.1f}s "
                                 "without heartbeats)", reason="ENGINE_ID_IN_USE")

    async def DeregisterEngine(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self.idempotency.execute(
            request.idempotency_key, "deregister", request, lambda: self._deregister(request),
            coordinator_pb2.DeregisterEngineResponse))

    async def _deregister(self, request) -> coordinator_pb2.DeregisterEngineResponse:
        record = self.registry.remove(request.engine_id)
        if record is None:
            raise InvalidArgument(f"unknown engine {request.engine_id!r}")
        await record.channel.close(grace=None)
        await self.db.run(lambda conn: conn.execute("DELETE FROM engines WHERE engine_id=?", (request.engine_id,)))
        await self.emit("engine_deregistered", request.engine_id)
        return coordinator_pb2.DeregisterEngineResponse()

    async def Heartbeat(self, request, context):
        record = self.registry.get(request.state.engine_id)
        if record is None:
            return coordinator_pb2.HeartbeatResponse(registered=False)
        was_available = self.registry.is_available(record)
        last_done = record.state.buckets_done
        record.last_heartbeat = time.monotonic()
        record.unreachable = ""
        record.state.CopyFrom(request.state)
        if self.round.phase == "broadcasting" and request.state.receiving and request.state.buckets_done != last_done:
            await self.emit("bucket_progress", record.engine_id, done=request.state.buckets_done,
                            total=request.state.buckets_total)
        self._export_engine(record)
        if not was_available and self.registry.is_available(record):
            await self.emit("engine_available", record.engine_id)
        return coordinator_pb2.HeartbeatResponse(registered=True, weight_version=self.round.weight_version)

    def _versions_behind(self, state: common_pb2.EngineState) -> int:
        """How many versions the engine's weights are older than the fleet's."""
        return max(0, self.round.weight_version - state.weight_version)

    def _export_engine(self, record: EngineRecord) -> None:
        engine = record.engine_id
        available = self.registry.is_available(record)
        metrics.ENGINE_READY.labels(engine).set(1 if available and record.state.ready else 0)
        metrics.ENGINE_VERSIONS_BEHIND.labels(engine).set(self._versions_behind(record.state))
        metrics.ENGINE_VERSION.labels(engine).set(record.state.weight_version)
        metrics.ENGINE_AVAILABLE.labels(engine).set(1 if self.registry.is_available(record) else 0)
        metrics.ENGINE_PAUSED.labels(engine).set(1 if record.state.paused else 0)
        metrics.ENGINE_TORN.labels(engine).set(1 if record.state.torn else 0)

    async def watch_liveness(self, stop: asyncio.Event) -> None:
        """Emits an event when an engine's heartbeats stop (runs until ``stop``)."""
        known: dict[str, bool] = {}
        while not stop.is_set():
            for record in self.registry.all():
                now = self.registry.is_available(record)
                self._export_engine(record)
                if known.get(record.engine_id, False) and not now:
                    await self.emit("engine_unavailable", record.engine_id,
                                    heartbeat_age_s=f"{record.heartbeat_age():.2f}", fault=record.state.fault)
                known[record.engine_id] = now
            try:
                await asyncio.wait_for(stop.wait(), timeout=min(0.25, self.registry.heartbeat_timeout_s / 4))
            except TimeoutError:
                pass

    # ----- queries ----------------------------------------------------------------------

    async def GetState(self, request, context):
        records = self.registry.all()
        engines = [self.registry.view(r) for r in records]

        async def refresh(record: EngineRecord, view: common_pb2.EngineState) -> None:
            # Ask the agent itself: a heartbeat can be up to one interval old, and a
            # caller that just resumed expects to see it resumed.
            if not view.available:
                return
            probe_s = 30.0 if request.include_digests else 2.0
            try:
                reply = await call_agent(record, lambda: record.stub.GetEngineState(
                    agent_pb2.GetEngineStateRequest(include_digest=request.include_digests),
                    timeout=probe_s), "get_state")
                fresh = reply.state
            except EngineUnavailable as exc:  # it deregistered while we asked
                view.available = False
                view.fault = exc.message
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and record.heartbeat_age() < probe_s:
                    # Slow, not gone: a heartbeat arrived while we waited (our channel to
                    # it can be busy, e.g. carrying a plan of tens of MiB under load). A
                    # frozen agent sends none. Keep what its heartbeats say.
                    return
                # Recorded in the registry, not just this answer: a Pause right after
                # must not count in an engine GetState just reported unavailable.
                record.unreachable = f"GetEngineState failed: {exc.code().name}"
                view.available = False
                view.fault = record.unreachable
                return
            available, age = view.available, view.heartbeat_age_s
            view.CopyFrom(fresh)
            view.available, view.heartbeat_age_s = available, age

        await asyncio.gather(*(refresh(r, v) for r, v in zip(records, engines, strict=True)))
        for view in engines:
            view.versions_behind = self._versions_behind(view)
            view.ready = view.ready and view.available
        return coordinator_pb2.GetStateResponse(
            weight_version=self.round.weight_version, engines=engines, round=self.round.view())

    async def WatchEvents(self, request, context):
        after = request.after_seq
        while True:
            for event in await self.events.wait_after(after, timeout_s=1.0):
                yield coordinator_pb2.WatchEventsResponse(event=event)
                after = event.seq
            if not self.accepting:
                return


__all__ = ["CoordinatorCore"]
