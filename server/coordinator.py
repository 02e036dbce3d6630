"""Coordinator: the control plane of sync rounds. It never touches tensor bytes.

A round is ``Pause`` -> ``Broadcast`` -> ``Resume``:
- ``Pause`` fixes the round's members (available engines; ``required_engines`` must
  be among them) and pauses them concurrently.
- ``Broadcast`` first asks every member to validate the request (``validate_only``),
  so a plan one engine rejects changes nothing anywhere; then it streams the
  ``Rendezvous`` to the trainer, fans ``Receive`` out to every member with a
  deadline and streams the result. A failure bumps the group epoch, so the next
  round builds a fresh data-plane group instead of reusing a broken one.
- ``Resume`` resumes the members; engines holding torn weights refuse (they stay
  paused) unless ``allow_torn``.

Every mutating RPC runs through the SQLite-backed ``IdempotencyStore``; per-engine
keys are derived from the trainer's key, so a retried Broadcast can never start a
second receive on any engine. Round state and the weight version persist in SQLite.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

import grpc

from weightsync import metrics
from weightsync import transport as transports
from weightsync.attest import Probe
from weightsync.errors import (
    EngineUnavailable,
    FailedPrecondition,
    InvalidArgument,
    PlanUnknown,
    WeightSyncError,
    abort_with,
    from_rpc_error,
    nothing_changed,
)
from weightsync.faults import FaultInjector
from weightsync.idempotency import IdempotencyStore, derive_key, validate_key
from weightsync.plan import BucketPlan, is_reference
from weightsync.security import INSECURE, Security
from weightsync.server.broadcast_progress import BroadcastProgress
from weightsync.server.registry import EngineRecord, EngineRegistry, unreachable_reason
from weightsync.statedb import StateDB, get_meta, set_meta
from weightsync.v1 import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc
from weightsync.validate import check_pause_mode, check_port, check_timeout

log = logging.getLogger("weightsync.coordinator")
# The idempotency key of the operation the current task serves: events it emits
# carry it, so an operator can count executions per key.
OPERATION_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("weightsync_operation_key", default="")

DEFAULT_PAUSE_TIMEOUT_S = 60.0
DEFAULT_TRANSFER_TIMEOUT_S = 300.0
RPC_MARGIN_S = 5.0          # an agent's own deadline fires before the coordinator's RPC one
RECEIVE_PLAN_FIELD = agent_pb2.ReceiveRequest.DESCRIPTOR.fields_by_name["plan"].number
MAX_EVENTS = 10_000
MAX_ENGINE_ID_LEN = 128
MAX_ADDRESS_LEN = 512
AGENT_ATTEMPTS = 3          # coordinator -> agent retries of UNAVAILABLE (keyed, so safe)


def check_agent_address(address: str) -> None:
    """``HOST:PORT`` with a port in 1..65535 and a host of visible ASCII (no NUL, space or
    control character); InvalidArgument otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"agent_address must be HOST:PORT, got {address[:100]!r}")
    if not all(32 < ord(c) < 127 for c in host):
        raise InvalidArgument(f"agent_address has a character that cannot be in a host name: {address[:100]!r}")


def _failed(engine_id: str, error: WeightSyncError) -> common_pb2.EngineOutcome:
    outcome = common_pb2.EngineOutcome(engine_id=engine_id, ok=False, error_reason=error.reason,
                                       error_message=error.message, error_code=error.code.value[0])
    if "max_diff" in error.metadata:  # an attestation that ran and failed: report how far off
        try:
            outcome.attested, outcome.attest_max_diff = True, float(error.metadata["max_diff"])
        except ValueError:
            pass
    return outcome


def _channel_closed(record: EngineRecord, operation: str) -> EngineUnavailable | None:
    """The engine's failure when grpc.aio cancelled its call because the channel closed.

    Closing a channel (the engine deregistered, or re-registered at a new address)
    raises ``CancelledError`` in every call on it, not an ``AioRpcError``. That is this
    engine's failure, not a cancellation of the round: the caller must hear at once,
    not wait out its deadline. Returns None when our own task is being cancelled.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    error = EngineUnavailable(f"engine {record.engine_id} went away during {operation} (its channel closed: "
                              "it deregistered or re-registered)")
    error.metadata["engine_id"] = record.engine_id
    return error


def _engine_error(record: EngineRecord, exc: grpc.aio.AioRpcError, operation: str) -> WeightSyncError:
    """The typed error of a failed agent call; an unreachable agent is ENGINE_UNAVAILABLE."""
    error = from_rpc_error(exc, operation=operation)
    if exc.code() == grpc.StatusCode.UNAVAILABLE and error.reason == "UNAVAILABLE":
        error = EngineUnavailable(f"engine {record.engine_id} unreachable during {operation}: {exc.details()}")
    error.metadata["engine_id"] = record.engine_id
    return error


class CoordinatorCore(coordinator_pb2_grpc.CoordinatorServicer):
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
        self._events: deque[common_pb2.Event] = deque(maxlen=MAX_EVENTS)
        self._event_cond = asyncio.Condition()
        self._seq = 0
        self._round_lock = asyncio.Lock()
        self._progress: dict[str, BroadcastProgress] = {}  # by key, while a Broadcast runs or is watched
        self.accepting = True
        self.started_at = time.monotonic()
        # An agent's next heartbeat after a restart comes within its interval plus the
        # channel's reconnect backoff (at most 1 s); the heartbeat timeout bounds both.
        self.rejoin_window_s = heartbeat_timeout_s + 1.0
        self._load()

    # ----- persistent state -------------------------------------------------------------

    def _load(self) -> None:
        aborted = self.idempotency.recover()

        def read(conn):
            meta = {k: get_meta(conn, k, d) for k, d in
                    (("weight_version", "0"), ("epoch", "0"), ("round_id", "0"), ("phase", "idle"),
                     ("round_engines", "[]"), ("target_version", "0"), ("group_key", ""))}
            engines = conn.execute("SELECT engine_id, address, model FROM engines").fetchall()
            if meta["phase"] == "broadcasting":
                # A Broadcast was running when we died: its transfer did not complete
                # here, so the next one must build a fresh group.
                meta["phase"] = "failed"
                meta["epoch"] = str(int(meta["epoch"]) + 1)
                set_meta(conn, "phase", meta["phase"])
                set_meta(conn, "epoch", meta["epoch"])
            return meta, engines

        meta, engines = self.db.run_sync(read)
        self.weight_version = int(meta["weight_version"])
        self.epoch = int(meta["epoch"])
        self.round_id = int(meta["round_id"])
        self.phase = meta["phase"]
        self.round_engines: list[str] = json.loads(meta["round_engines"])
        self.target_version = int(meta["target_version"])
        self.group_key = meta["group_key"]
        self._persisted_engines = engines
        if aborted:
            log.warning("finished %d interrupted operation(s) as ABORTED", aborted)

    def restore_engines(self) -> None:
        """Recreates channels to the engines known before a restart (unavailable until they heartbeat)."""
        for engine_id, address, model in self._persisted_engines:
            self.registry.upsert(engine_id, address, model, heartbeat=False)

    async def _save_round(self, **extra: object) -> None:
        values = {"round_id": self.round_id, "phase": self.phase, "round_engines": json.dumps(self.round_engines),
                  "epoch": self.epoch, "weight_version": self.weight_version,
                  "target_version": self.target_version, "group_key": self.group_key, **extra}

        def save(conn):
            for key, value in values.items():
                set_meta(conn, key, value)

        await self.db.run(save)

    # ----- events -----------------------------------------------------------------------

    async def emit(self, kind: str, engine_id: str = "", **fields: object) -> None:
        """Adds an event to the stream WatchEvents serves."""
        self._seq += 1
        self._events.append(common_pb2.Event(seq=self._seq, unix_time=time.time(), kind=kind, engine_id=engine_id,
                                             idempotency_key=OPERATION_KEY.get(),
                                             fields={k: str(v) for k, v in fields.items()}))
        log.info("%s %s %s", kind, engine_id, fields or "")
        async with self._event_cond:
            self._event_cond.notify_all()

    # ----- helpers ----------------------------------------------------------------------

    async def _guard(self, context, coro_fn: Callable[[], Awaitable], *, key: str = ""):
        try:
            OPERATION_KEY.set(key)  # this handler's context; the operation's task copies it
            if not self.accepting:
                raise EngineUnavailable("coordinator is shutting down", reason="SHUTTING_DOWN")
            return await coro_fn()
        except WeightSyncError as exc:
            await abort_with(context, exc)

    async def _fan_out(self, records: list[EngineRecord], call: Callable[[EngineRecord], Awaitable],
                       *, operation: str, retry: bool = True) -> list[common_pb2.EngineOutcome]:
        """Calls every engine concurrently; each failure becomes that engine's outcome."""
        async def one(record: EngineRecord) -> common_pb2.EngineOutcome:
            try:
                outcome = await (self._call_with_retry(record, call) if retry else call(record))
                outcome.engine_id = record.engine_id
                return outcome
            except grpc.aio.AioRpcError as exc:
                return _failed(record.engine_id, _engine_error(record, exc, operation))
            except WeightSyncError as exc:
                return _failed(record.engine_id, exc)
            except asyncio.CancelledError:
                closed = _channel_closed(record, operation)
                if closed is None:
                    raise
                return _failed(record.engine_id, closed)
        return list(await asyncio.gather(*(one(r) for r in records)))

    @staticmethod
    async def _call_with_retry(record: EngineRecord, call: Callable[[EngineRecord], Awaitable]):
        """A few quick retries of UNAVAILABLE. Safe because every agent call carries a
        key derived from the trainer's: a retry attaches to, or replays, the first."""
        for attempt in range(1, AGENT_ATTEMPTS + 1):
            try:
                return await call(record)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == AGENT_ATTEMPTS:
                    raise
                await asyncio.sleep(0.1 * attempt)

    def _members(self) -> list[EngineRecord]:
        records = []
        for engine_id in self.round_engines:
            record = self.registry.get(engine_id)
            if record is not None:
                records.append(record)
        return records

    async def _group_id(self, request, members: list[EngineRecord], ranks: dict[str, int]) -> str:
        """The data-plane group id of this Broadcast: the same id only for the same group.

        Members keep their group between rounds while the id stays (plan once, replay).
        So an id must never name two different groups: whenever anything that defines
        the group differs from the last round's (transport, backend, the trainer's
        store, the members, their ranks, a member's registration), the epoch moves on
        and the id is new -- also when an earlier membership recurs, whose store keys
        and half-dropped groups still exist. A failed round moves it on as well.
        """
        membership = "|".join(f"{r.engine_id}={ranks[r.engine_id]}@{r.incarnation}"
                              for r in sorted(members, key=lambda r: r.engine_id))
        group_key = hashlib.blake2b(
            f"{request.transport}|{request.group_backend}|{request.store_host}:{request.store_port}|{membership}"
            .encode(), digest_size=8).hexdigest()
        if group_key != self.group_key:
            self.epoch += 1
            self.group_key = group_key
            await self._save_round()
        return f"e{self.epoch}-{group_key}"

    # ----- Pause ------------------------------------------------------------------------

    async def Pause(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self.idempotency.execute(
            request.idempotency_key, "pause", request, lambda: self._pause(request), coordinator_pb2.PauseResponse))

    async def _pause_members(self, request, timeout_s: float) -> list[EngineRecord]:
        """The engines a Pause takes in, or the reason it cannot start (nothing changed yet)."""
        if self.phase == "broadcasting":
            raise FailedPrecondition("a broadcast is running; wait for its result")
        await self._await_rejoin([r.engine_id for r in self.registry.all()], timeout_s)
        available = {r.engine_id: r for r in self.registry.available()}
        missing = [e for e in request.required_engines if e not in available]
        if missing:
            raise EngineUnavailable(f"required engines unavailable: {missing}",
                                    metadata={"engines": ",".join(missing)})
        members = list(available.values())  # torn engines of an unfinished round too: they are available
        if not members:
            raise EngineUnavailable("no engine is available")
        return members

    async def _await_rejoin(self, engine_ids: list[str], timeout_s: float) -> None:
        """Right after a restart every known engine counts as unavailable until its
        first heartbeat. A round that starts in that window waits (bounded by its
        deadline) for those engines to report, instead of deciding on a subset that
        would then be final for its key."""
        end = min(self.started_at + self.rejoin_window_s, time.monotonic() + timeout_s)
        while time.monotonic() < end:
            silent = [e for e in engine_ids
                      if (record := self.registry.get(e)) is not None and not record.last_heartbeat]
            if not silent:
                return
            await asyncio.sleep(0.05)

    async def _pause(self, request) -> coordinator_pb2.PauseResponse:
        check_pause_mode(request.mode)
        check_timeout(request.timeout_s)
        timeout_s = request.timeout_s or DEFAULT_PAUSE_TIMEOUT_S
        async with self._round_lock:
            with nothing_changed():
                members = await self._pause_members(request, timeout_s)

            def call(record: EngineRecord):
                return record.stub.Pause(agent_pb2.AgentPauseRequest(
                    idempotency_key=derive_key(request.idempotency_key, record.engine_id), mode=request.mode,
                    offload_kv=request.offload_kv, timeout_s=timeout_s), timeout=timeout_s + RPC_MARGIN_S)

            outcomes = await self._fan_out(members, call, operation="pause")
            member_ids = {r.engine_id for r in members}
            # Registered engines that are down are reported, not silently skipped.
            for record in self.registry.all():
                if record.engine_id not in member_ids:
                    why = self.registry.why_unavailable(record)
                    outcomes.append(_failed(record.engine_id, EngineUnavailable(
                        f"engine {record.engine_id} is unavailable: {why}")))
            self.round_id += 1
            self.round_engines = [o.engine_id for o in outcomes if o.ok]
            self.phase = "paused" if self.round_engines else "idle"
            await self._save_round()
            metrics.ROUNDS.labels("pause", "ok" if self.round_engines else "failed").inc()
            metrics.ROUND_ID.set(self.round_id)
            for o in outcomes:
                if not o.ok:
                    metrics.FAILURES.labels("pause", o.error_reason).inc()
            await self.emit("paused", round_id=self.round_id, engines=",".join(self.round_engines),
                            failed=",".join(o.engine_id for o in outcomes if not o.ok))
            unpaused = [o for o in outcomes if not o.ok and o.engine_id in request.required_engines]
            if unpaused:
                # The engines that did pause stay members, so a Resume releases them.
                raise EngineUnavailable("required engines did not pause: " + "; ".join(
                    f"{o.engine_id}: {o.error_message}" for o in unpaused),
                    metadata={"engines": ",".join(o.engine_id for o in unpaused)})
            return coordinator_pb2.PauseResponse(round_id=self.round_id, engines=outcomes)

    # ----- Broadcast --------------------------------------------------------------------

    async def Broadcast(self, request, context):
        try:
            validate_key(request.idempotency_key)
        except WeightSyncError as exc:
            await abort_with(context, exc)
        # Every caller of this key -- the one that starts the operation and any retry
        # that attaches to it -- gets its progress events, the ones so far included;
        # but only once the idempotency store accepted the request as the same one (a
        # conflicting request must never see another round's rendezvous).
        key = request.idempotency_key
        progress: asyncio.Queue[coordinator_pb2.BroadcastEvent] = asyncio.Queue()
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
            operation = asyncio.ensure_future(self._guard_broadcast(request, accepted))
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
        yield coordinator_pb2.BroadcastEvent(result=result)

    async def _guard_broadcast(self, request, accepted: Callable[[], None]) -> coordinator_pb2.BroadcastResult:
        OPERATION_KEY.set(request.idempotency_key)  # this task's context; the operation's task copies it
        if not self.accepting:
            raise EngineUnavailable("coordinator is shutting down", reason="SHUTTING_DOWN")
        async def run() -> coordinator_pb2.BroadcastResult:
            channel = self._progress[request.idempotency_key]
            try:
                return await self._broadcast(request, channel)
            finally:
                channel.finish()

        return await self.idempotency.execute(request.idempotency_key, "broadcast", request, run,
                                              coordinator_pb2.BroadcastResult, on_accept=accepted)

    def _validate_broadcast(self, request) -> BucketPlan:
        """Runs on a worker thread: a plan may hold tens of thousands of tensors."""
        plan = BucketPlan.from_proto(request.plan)
        if request.transport not in transports.KIND_NAMES:
            raise InvalidArgument(f"unknown transport {request.transport}")
        if request.group_backend not in ("", "gloo", "nccl"):
            raise InvalidArgument(f"group_backend must be gloo or nccl, got {request.group_backend!r}")
        if request.group_backend and request.transport != common_pb2.TRANSPORT_KIND_GROUP:
            raise InvalidArgument("group_backend applies to the group transport only")
        if not request.store_host:
            raise InvalidArgument("store_host is required")
        check_port(request.store_port, "store_port")
        if len(request.store_secret) > 128 or any(c not in "0123456789abcdef" for c in request.store_secret):
            raise InvalidArgument("store_secret must be at most 128 lowercase hex characters")
        check_timeout(request.timeout_s)
        if request.HasField("probe"):
            Probe.from_proto(request.probe)  # InvalidArgument before any engine is asked
        if request.version <= self.weight_version:
            raise FailedPrecondition(f"version {request.version} is not newer than the current version "
                                     f"{self.weight_version}", reason="VERSION_NOT_NEWER")
        return plan

    async def _broadcast(self, request, progress: BroadcastProgress) -> coordinator_pb2.BroadcastResult:
        async with self._round_lock:
            with nothing_changed():  # until the transfer starts, a failure leaves everything as it was
                try:
                    plan = await asyncio.to_thread(self._validate_broadcast, request)
                except PlanUnknown:  # the trainer sends the whole plan again, same key
                    await self.emit("plan_unknown", plan_id=request.plan.plan_id)
                    raise
                if self.phase not in ("paused", "failed", "broadcast_done"):
                    raise FailedPrecondition(f"no paused round (phase {self.phase!r}): call Pause first")
                timeout_s = request.timeout_s or DEFAULT_TRANSFER_TIMEOUT_S
                await self._await_rejoin(self.round_engines, timeout_s)
                members = [r for r in self._members() if self.registry.is_available(r)]
                gone = [e for e in self.round_engines if e not in {r.engine_id for r in members}]
                if not members:
                    raise EngineUnavailable("no engine of the paused round is available")
                ranks = {r.engine_id: i + 1 for i, r in enumerate(members)}
                group_id = await self._group_id(request, members, ranks)
                rendezvous = common_pb2.Rendezvous(
                    group_id=group_id, transport=request.transport,
                    store_host=request.store_host, store_port=request.store_port, world_size=len(members) + 1,
                    session_id=uuid.uuid4().hex, group_backend=request.group_backend,
                    store_secret=request.store_secret)

                def receive_request(record: EngineRecord, validate_only: bool, by_reference: bool) -> bytes:
                    # The whole plan is encoded once and appended (protobuf merges
                    # concatenated messages): not copied and re-encoded per engine.
                    head = agent_pb2.ReceiveRequest(
                        idempotency_key=derive_key(request.idempotency_key, record.engine_id), version=request.version,
                        plan=plan.reference_proto() if by_reference else None,
                        rendezvous=rendezvous, rank=ranks[record.engine_id],
                        weights_digest=request.weights_digest, timeout_s=timeout_s, validate_only=validate_only,
                        probe=request.probe if request.HasField("probe") else None).SerializeToString()
                    return head if by_reference else head + plan.embedded(RECEIVE_PLAN_FIELD)

                async def call_receive(record: EngineRecord, validate_only: bool, rpc_timeout_s: float):
                    # Built and serialised on a worker thread: a whole plan may name 20k
                    # tensors. An agent that took this plan before gets its id alone; one
                    # that forgot it (PLAN_UNKNOWN: nothing ran) gets the whole plan again.
                    by_reference = plan.plan_id in record.plans_held
                    payload = await asyncio.to_thread(receive_request, record, validate_only, by_reference)
                    try:
                        outcome = await record.receive_serialized(payload, timeout=rpc_timeout_s)
                    except grpc.aio.AioRpcError as exc:
                        if not (by_reference and isinstance(from_rpc_error(exc), PlanUnknown)):
                            raise
                        record.plans_held.discard(plan.plan_id)
                        await self.emit("plan_unknown", engine_id=record.engine_id, plan_id=plan.plan_id)
                        payload = await asyncio.to_thread(receive_request, record, validate_only, False)
                        outcome = await record.receive_serialized(payload, timeout=rpc_timeout_s)
                    record.plans_held.add(plan.plan_id)
                    return outcome

                # Phase 1: every engine checks the request; nothing changes anywhere yet.
                checks = await self._fan_out(members, lambda r: call_receive(r, True, 30.0), operation="validate")
                rejected = [o for o in checks if not o.ok]
                if rejected:
                    first = rejected[0]
                    detail = "; ".join(f"{o.engine_id}: {o.error_message}" for o in rejected)
                    if first.error_reason == InvalidArgument.reason:
                        raise InvalidArgument(f"engine rejected the broadcast: {detail}",
                                              metadata={"engine_id": first.engine_id})
                    raise FailedPrecondition(f"engine cannot take the broadcast: {detail}",
                                             reason=first.error_reason or "FAILED_PRECONDITION",
                                             metadata={"engine_id": first.engine_id})

            # Phase 2: the transfer.
            self.phase, self.target_version = "broadcasting", request.version
            await self._save_round()
            try:
                await self.emit("broadcast_started", version=request.version, bytes=plan.total_bytes,
                                plan="by_id" if is_reference(request.plan) else "whole",
                                engines=",".join(ranks), transport=transports.KIND_NAMES[request.transport])
                progress.publish(coordinator_pb2.BroadcastEvent(rendezvous=rendezvous))
                started = time.monotonic()
                metrics.BROADCAST_IN_PROGRESS.set(1)
                if self.faults is not None and self.faults.take("round", method="transfer") is not None:
                    raise RuntimeError("injected failure in the transfer phase")

                async def receive(record: EngineRecord) -> common_pb2.EngineOutcome:
                    try:
                        return await self._call_with_retry(
                            record, lambda r: call_receive(r, False, timeout_s + RPC_MARGIN_S))
                    except grpc.aio.AioRpcError as exc:
                        # Tell the trainer now, so it stops sending instead of waiting out
                        # its deadline for an engine that will never acknowledge.
                        error = _engine_error(record, exc, "broadcast")
                        progress.publish(coordinator_pb2.BroadcastEvent(engine_failed=_failed(record.engine_id, error)))
                        raise
                    except asyncio.CancelledError:
                        closed = _channel_closed(record, "broadcast")
                        if closed is None:
                            raise
                        progress.publish(coordinator_pb2.BroadcastEvent(engine_failed=_failed(record.engine_id, closed)))
                        raise closed from None

                try:
                    outcomes = await self._fan_out(members, receive, operation="broadcast", retry=False)
                finally:
                    metrics.BROADCAST_IN_PROGRESS.set(0)
                for o in outcomes:
                    o.rank = ranks[o.engine_id]
                for engine_id in gone:
                    outcomes.append(_failed(engine_id, EngineUnavailable(f"engine {engine_id} stopped heartbeating")))
                seconds = time.monotonic() - started
                ok = all(o.ok for o in outcomes)
                if ok:
                    self.weight_version = request.version
                    self.phase = "broadcast_done"
                else:
                    self.phase = "failed"
                    self.epoch += 1  # never reuse a group that saw a failure
                await self._save_round()
                metrics.ROUNDS.labels("broadcast", "ok" if ok else "failed").inc()
                metrics.SYNC_SECONDS.observe(seconds)
                if ok:
                    metrics.SYNC_BYTES.observe(plan.total_bytes)
                    metrics.WEIGHT_VERSION.set(self.weight_version)
                for o in outcomes:
                    if not o.ok:
                        metrics.FAILURES.labels("broadcast", o.error_reason).inc()
                    await self.emit("engine_received" if o.ok else "engine_failed", o.engine_id,
                                    version=request.version, reason=o.error_reason, message=o.error_message)
                await self.emit("broadcast_done" if ok else "broadcast_failed", version=request.version,
                                seconds=f"{seconds:.4f}")
                return coordinator_pb2.BroadcastResult(version=request.version, ok=ok, engines=outcomes,
                                                       bytes=plan.total_bytes, seconds=seconds)
            except BaseException as exc:
                if self.phase == "broadcasting":
                    # Whatever broke (a bug, a cancellation at shutdown), the round must not
                    # stay "broadcasting": that phase refuses every Pause until a restart.
                    self.phase = "failed"
                    self.epoch += 1  # never reuse a group that saw a failure
                    metrics.BROADCAST_IN_PROGRESS.set(0)
                    await asyncio.shield(self._save_round())
                    await self.emit("broadcast_failed", version=request.version, error=repr(exc))
                raise

    # ----- Resume -----------------------------------------------------------------------

    async def Resume(self, request, context):
        return await self._guard(context, key=request.idempotency_key, coro_fn=lambda: self.idempotency.execute(
            request.idempotency_key, "resume", request, lambda: self._resume(request),
            coordinator_pb2.ResumeResponse))

    async def _resume(self, request) -> coordinator_pb2.ResumeResponse:
        check_timeout(request.timeout_s)
        async with self._round_lock:
            if self.phase == "idle" or not self.round_engines:
                return coordinator_pb2.ResumeResponse()
            timeout_s = request.timeout_s or DEFAULT_PAUSE_TIMEOUT_S
            members = self._members()

            def call(record: EngineRecord):
                return record.stub.Resume(agent_pb2.AgentResumeRequest(
                    idempotency_key=derive_key(request.idempotency_key, record.engine_id),
                    allow_torn=request.allow_torn, timeout_s=timeout_s), timeout=timeout_s + RPC_MARGIN_S)

            outcomes = await self._fan_out(members, call, operation="resume")
            still_paused = [o.engine_id for o in outcomes if not o.ok]
            self.round_engines = still_paused  # they stay members until a good round
            self.phase = "failed" if still_paused else "idle"
            await self._save_round()
            metrics.ROUNDS.labels("resume", "failed" if still_paused else "ok").inc()
            for o in outcomes:
                if not o.ok:
                    metrics.FAILURES.labels("resume", o.error_reason).inc()
            await self.emit("resumed", engines=",".join(o.engine_id for o in outcomes if o.ok),
                            still_paused=",".join(still_paused))
            return coordinator_pb2.ResumeResponse(engines=outcomes)

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
            if not engine_id or not all(32 < ord(c) < 127 for c in engine_id):
                raise InvalidArgument("engine_id must be 1-128 printable ASCII characters without spaces")
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
                                                      weight_version=self.weight_version)

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
        if self.phase == "broadcasting" and request.state.receiving and request.state.buckets_done != last_done:
            await self.emit("bucket_progress", record.engine_id, done=request.state.buckets_done,
                            total=request.state.buckets_total)
        self._export_engine(record)
        if not was_available and self.registry.is_available(record):
            await self.emit("engine_available", record.engine_id)
        return coordinator_pb2.HeartbeatResponse(registered=True)

    def _export_engine(self, record: EngineRecord) -> None:
        engine = record.engine_id
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
            try:
                fresh = await record.stub.GetState(
                    agent_pb2.AgentStateRequest(include_digest=request.include_digests),
                    timeout=30.0 if request.include_digests else 2.0)
            except grpc.aio.AioRpcError as exc:
                # Recorded in the registry, not just this answer: a Pause right after
                # must not count in an engine GetState just reported unavailable.
                record.unreachable = f"GetState failed: {exc.code().name}"
                view.available = False
                view.fault = record.unreachable
                return
            available, age = view.available, view.heartbeat_age_s
            view.CopyFrom(fresh)
            view.available, view.heartbeat_age_s = available, age

        await asyncio.gather(*(refresh(r, v) for r, v in zip(records, engines, strict=True)))
        return coordinator_pb2.GetStateResponse(
            weight_version=self.weight_version, engines=engines,
            round=coordinator_pb2.RoundState(round_id=self.round_id, phase=self.phase, engines=self.round_engines,
                                             target_version=self.target_version))

    async def WatchEvents(self, request, context):
        after = request.after_seq
        while True:
            pending = [e for e in self._events if e.seq > after]
            for event in pending:
                yield event
                after = event.seq
            async with self._event_cond:
                if not any(e.seq > after for e in self._events):
                    try:
                        await asyncio.wait_for(self._event_cond.wait(), timeout=1.0)
                    except TimeoutError:
                        pass
            if not self.accepting:
                return


__all__ = ["CoordinatorCore"]
