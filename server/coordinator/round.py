"""The sync round and its three steps (its lanes, request checks, persisted fields
and per-engine calls live in ``lanes``, ``broadcast_setup``, ``round_meta``,
``receive_call`` and ``fan_out`` beside it).

A round is ``pause`` -> ``broadcast`` -> ``resume`` (the Coordinator service's
handlers validate the call, run it under its idempotency key and map errors; the
round itself is here):
- ``pause`` fixes the round's members (available engines; ``required_engines`` must
  be among them) and pauses them concurrently.
- ``broadcast`` first asks every member to validate the request (``validate_only``),
  so a plan one engine rejects changes nothing anywhere; then it publishes the
  ``Rendezvous`` to the trainer, fans ``Receive`` out to every member with a deadline
  and records the result. A failure bumps the group epoch, so the next round builds a
  fresh data-plane group instead of reusing a broken one.
- ``resume`` resumes the members; engines holding torn weights refuse (they stay
  paused) unless ``allow_torn``.

Per-engine keys are derived from the trainer's, so a retried step can never start a
second receive on any engine. The round's state and the weight version persist in
SQLite (``meta``); a round that was broadcasting when the coordinator died comes back
``failed`` with a new epoch. A database that cannot be written (``StateNotWritable``)
refuses a step whose save comes before any change (a Broadcast, nothing moved), and
never a change already made: engines paused, weights moved or engines resumed are
kept in memory and written with the next save that succeeds (``save_after_change``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from weightsync import metrics
from weightsync import transport as transports
from weightsync.errors import (
    AFTER_TRANSFER,
    EngineUnavailable,
    FailedPrecondition,
    InvalidArgument,
    PlanUnknown,
    StateNotWritable,
    WeightSyncError,
    nothing_changed,
)
from weightsync.faults import FaultInjector
from weightsync.idempotency import derive_key
from weightsync.plan import is_reference
from weightsync.server.coordinator.agent_calls import call_agent, engine_error, fill_real_state
from weightsync.server.coordinator.broadcast_progress import BroadcastProgress
from weightsync.server.coordinator.broadcast_setup import BroadcastSetup, check_broadcast_request
from weightsync.server.coordinator.fan_out import call_with_retry, failed_outcome, fan_out
from weightsync.server.coordinator.lanes import (
    LanePlan,
    pick_group_layout,
    plan_lanes,
    sender_lanes,
)
from weightsync.server.coordinator.receive_call import call_receive
from weightsync.server.coordinator.registry import EngineRecord, EngineRegistry
from weightsync.server.coordinator.round_meta import load_round_meta, save_round_meta
from weightsync.server.coordinator.sync_ledger import SyncLedger
from weightsync.statedb import StateDB
from weightsync.transport import TENSORS
from weightsync.v1 import agent_pb2, common_pb2, coordinator_pb2
from weightsync.validate import check_pause_mode, check_timeout

log = logging.getLogger("weightsync.coordinator")

DEFAULT_PAUSE_TIMEOUT_S = 60.0
DEFAULT_TRANSFER_TIMEOUT_S = 300.0
RPC_MARGIN_S = 5.0          # an agent's own deadline fires before the coordinator's RPC one
VALIDATE_TIMEOUT_S = 30.0   # an engine's check of a Broadcast (phase 1)
LAPSE_CHECK_S = 0.1         # how often a running Receive checks that its engine still heartbeats
Emit = Callable[..., Awaitable[None]]  # emit(kind, engine_id="", **fields): the coordinator's event stream


class SyncRound:
    """The coordinator's one round at a time (see the module docstring).

    Args:
        db: the coordinator's state file (the round's state is read at once).
        registry: the engines and their availability.
        emit: the coordinator's event stream.
        rejoin_window_s: after a restart, how long a round waits for known engines'
            first heartbeats before deciding on its members.
        ledger: the logical syncs (``update_weights``' keys) whose steps this round
            records, each under the lock, in the order they happened.
        faults: test-only fault injection.
    """

    def __init__(self, db: StateDB, registry: EngineRegistry, *, emit: Emit, rejoin_window_s: float,
                 ledger: SyncLedger | None = None, faults: FaultInjector | None = None) -> None:
        self.db = db
        self.ledger = ledger
        self.registry = registry
        self.emit = emit
        self.faults = faults
        self.lock = asyncio.Lock()  # one step of one round at a time
        self.started_at = time.monotonic()
        self.rejoin_window_s = rejoin_window_s
        self._load()

    # ----- state ------------------------------------------------------------------------

    def _load(self) -> None:
        meta = self.db.run_sync(load_round_meta)
        self.weight_version = int(meta["weight_version"])
        self.epoch = int(meta["epoch"])
        self.round_id = int(meta["round_id"])
        self.phase: str = meta["phase"]  # idle | paused | broadcasting | broadcast_done | failed
        self.round_engines: list[str] = json.loads(meta["round_engines"])
        self.target_version = int(meta["target_version"])
        self.group_key: str = meta["group_key"]

    async def save(self) -> None:
        values = {"round_id": self.round_id, "phase": self.phase, "round_engines": json.dumps(self.round_engines),
                  "epoch": self.epoch, "weight_version": self.weight_version,
                  "target_version": self.target_version, "group_key": self.group_key}
        await self.db.run(lambda conn: save_round_meta(conn, values))

    async def save_after_change(self, what: str) -> None:
        """Saves state that records a change already made (``what``). A database that
        cannot take it must not turn that change into a failure: the engines did pause,
        receive or resume. The state stays in memory (the next save writes all of it)
        and the failure is logged and counted."""
        try:
            await self.save()
        except StateNotWritable as exc:
            metrics.STATE_UNSAVED.inc()
            log.error("the round's state after %s is kept in memory only: %s", what, exc.message)

    def view(self) -> coordinator_pb2.RoundState:
        """The round as GetState shows it."""
        return coordinator_pb2.RoundState(round_id=self.round_id, phase=self.phase, engines=self.round_engines,
                                          target_version=self.target_version)

    def _members(self) -> list[EngineRecord]:
        return [r for r in map(self.registry.get, self.round_engines) if r is not None]

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

    async def wait_idle(self, timeout_s: float) -> None:
        """Waits (at most ``timeout_s``) until no step of a round is running."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self.lock:
                    pass
        except TimeoutError:
            pass  # the caller's own step queues on the lock, under its own deadline

    async def _record_sync(self, sync: tuple[str, int] | None, step: str, ok: bool = False) -> None:
        """Tells the ledger how far the logical sync ``sync`` (key, attempt) got."""
        if sync is None or self.ledger is None:
            return
        key, attempt = sync
        if step == "pause":
            await self.ledger.paused(key, attempt, self.round_id)
        elif step == "broadcast":
            await self.ledger.broadcast_done(key, attempt, ok)
        else:
            await self.ledger.resumed(key, attempt)

    # ----- pause ------------------------------------------------------------------------

    async def pause(self, request: coordinator_pb2.PauseRequest, *,
                    sync: tuple[str, int] | None = None) -> coordinator_pb2.PauseResponse:
        check_pause_mode(request.mode)
        check_timeout(request.timeout_s)
        timeout_s = request.timeout_s or DEFAULT_PAUSE_TIMEOUT_S
        async with self.lock:
            with nothing_changed():
                if request.version and request.version <= self.weight_version:
                    # Before any engine pauses: a round that could only be refused later.
                    raise FailedPrecondition(
                        f"version {request.version} is not newer than the fleet's version {self.weight_version}: "
                        f"nothing was paused; sync a version above {self.weight_version}",
                        reason="VERSION_NOT_NEWER")
                members = await self._pause_members(request, timeout_s)

            async def call(record: EngineRecord) -> common_pb2.EngineOutcome:
                reply = await record.stub.PauseEngine(agent_pb2.PauseEngineRequest(
                    idempotency_key=derive_key(request.idempotency_key, record.engine_id), mode=request.mode,
                    offload_kv=request.offload_kv, timeout_s=timeout_s), timeout=timeout_s + RPC_MARGIN_S)
                return reply.outcome

            outcomes = await fan_out(members, call, operation="pause")
            member_ids = {r.engine_id for r in members}
            # Registered engines that are down are reported, not silently skipped.
            for record in self.registry.all():
                if record.engine_id not in member_ids:
                    why = self.registry.why_unavailable(record)
                    outcomes.append(failed_outcome(record.engine_id, EngineUnavailable(
                        f"engine {record.engine_id} is unavailable: {why}")))
            await fill_real_state(self.registry, outcomes)
            self.round_id += 1
            self.round_engines = [o.engine_id for o in outcomes if o.ok]
            self.phase = "paused" if self.round_engines else "idle"
            await self.save_after_change("a pause")
            if self.round_engines:
                await self._record_sync(sync, "pause")
            self._report("pause", outcomes, ok=bool(self.round_engines))
            metrics.ROUND_ID.set(self.round_id)
            await self.emit("paused", round_id=self.round_id, engines=",".join(self.round_engines),
                            failed=",".join(o.engine_id for o in outcomes if not o.ok))
            unpaused = [o for o in outcomes if not o.ok and o.engine_id in request.required_engines]
            if unpaused:
                # The engines that did pause stay members, so a Resume releases them.
                raise EngineUnavailable("required engines did not pause: " + "; ".join(
                    f"{o.engine_id}: {o.error_message}" for o in unpaused),
                    metadata={"engines": ",".join(o.engine_id for o in unpaused)})
            return coordinator_pb2.PauseResponse(round_id=self.round_id, engines=outcomes)

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

    def _report(self, step: str, outcomes: list[common_pb2.EngineOutcome], *, ok: bool) -> None:
        metrics.ROUNDS.labels(step, "ok" if ok else "failed").inc()
        for o in outcomes:
            if not o.ok:
                metrics.FAILURES.labels(step, o.error_reason).inc()

    # ----- broadcast --------------------------------------------------------------------

    async def broadcast(self, request: coordinator_pb2.BroadcastRequest, progress: BroadcastProgress, *,
                        sync: tuple[str, int] | None = None) -> coordinator_pb2.BroadcastResult:
        """Phase 1 (nothing changes anywhere): the request checked here and by every
        member. Phase 2: the transfer, its result recorded."""
        async with self.lock:
            with nothing_changed():  # until the transfer starts, a failure leaves everything as it was
                setup = await self._set_up(request)
                await self._check_with_every_engine(request, setup)
            before = self.phase, self.target_version
            self.phase, self.target_version = "broadcasting", request.version
            try:
                with nothing_changed():
                    await self.save()
            except WeightSyncError:
                self.phase, self.target_version = before  # nothing moved: the round is as it was
                raise
            try:
                result = await self._transfer(request, setup, progress)
                await self._record_sync(sync, "broadcast", result.ok)
                return result
            except BaseException as exc:
                if self.phase == "broadcasting":
                    # Whatever broke (a bug, a cancellation at shutdown), the round must not
                    # stay "broadcasting": that phase refuses every Pause until a restart.
                    self.phase = "failed"
                    self.epoch += 1  # never reuse a group that saw a failure
                    metrics.BROADCAST_IN_PROGRESS.set(0)
                    await asyncio.shield(self.save_after_change("a failed broadcast"))
                    await asyncio.shield(self._record_sync(sync, "broadcast", False))
                    await self.emit("broadcast_failed", version=request.version, error=repr(exc))
                raise

    async def _set_up(self, request) -> BroadcastSetup:
        try:
            plan, owners = await asyncio.to_thread(check_broadcast_request, request, self.weight_version)
        except PlanUnknown:  # the trainer sends the whole plan again, same key
            await self.emit("plan_unknown", plan_id=request.plan.plan_id)
            raise
        if self.phase not in ("paused", "failed", "broadcast_done"):
            raise FailedPrecondition(f"no paused round (phase {self.phase!r}): call Pause first")
        timeout_s = request.timeout_s or DEFAULT_TRANSFER_TIMEOUT_S
        await self._await_rejoin(self.round_engines, timeout_s)
        members = [r for r in self._members() if self.registry.is_available(r)]
        if not members:
            raise EngineUnavailable("no engine of the paused round is available")
        taking_part = {r.engine_id for r in members}
        widths = {r.engine_id: max(1, r.state.workers) for r in members}
        if owners is not None:
            layout = sender_lanes(request.transport, members, request.trainer_host_id, owners.sender_ranks,
                                  request.sender_host_ids)
        else:
            layout = plan_lanes(request.transport, members, request.trainer_host_id)
        group_id = await self._group_id(request, members, layout, widths)
        session = uuid.uuid4().hex
        lanes = [common_pb2.Rendezvous(
            group_id=group_id if len(layout) == 1 else f"{group_id}-{i}", transport=lane.transport,
            store_host=request.store_host, store_port=request.store_port,
            # a relay's upstream lane: the trainer and the relay (one process, whatever its engine's workers)
            world_size=2 if lane.serves else 1 + sum(widths[e] for e in lane.receivers),
            session_id=session if len(layout) == 1 else f"{session}-{i}", group_backend=request.group_backend,
            group_layout=pick_group_layout(request.group_layout, members, plan),
            store_secret=request.store_secret, lane=lane.name, engine_ids=lane.serves or lane.receivers,
            relayed_by=lane.relayed_by, sender=lane.sender)
            for i, lane in enumerate(layout)]
        return BroadcastSetup(plan, members, [e for e in self.round_engines if e not in taking_part], lanes,
                              timeout_s, widths, owners)

    async def _group_id(self, request, members: list[EngineRecord], layout: list[LanePlan],
                        widths: dict[str, int]) -> str:
        """The data-plane group id of this Broadcast: the same id only for the same group.

        Members keep their group between rounds while the id stays (plan once, replay).
        So an id must never name two different groups: whenever anything that defines
        the group differs from the last round's (transport, backend, the trainer's
        store, the members, their lanes, ranks and worker counts, a member's registration or engine process),
        the epoch moves on and the id is new -- also when an earlier membership recurs,
        whose store keys and half-dropped groups still exist. A failed round moves it
        on as well.
        """
        ranks: dict[str, str] = {}
        for lane in layout:  # a relay is in two lanes
            for i, e in enumerate(lane.receivers):
                ranks[e] = f"{ranks[e]}+" if e in ranks else ""
                ranks[e] += f"{lane.name}/{i + 1}x{widths[e]}"
        membership = "|".join(f"{r.engine_id}={ranks[r.engine_id]}@{r.incarnation}.{r.state.engine_restarts}"
                              for r in sorted(members, key=lambda r: r.engine_id))
        group_key = hashlib.blake2b(
            f"{request.transport}|{request.group_backend}|{request.store_host}:{request.store_port}|{membership}"
            .encode(), digest_size=8).hexdigest()
        if group_key != self.group_key:
            self.epoch += 1
            self.group_key = group_key
            await self.save()
        return f"e{self.epoch}-{group_key}"

    async def _check_with_every_engine(self, request, setup: BroadcastSetup) -> None:
        """Phase 1: every engine checks the request (``validate_only``); one refusal
        refuses the Broadcast, and nothing has changed anywhere."""
        checks = await fan_out(setup.members, lambda r: call_receive(request, setup, r, True, VALIDATE_TIMEOUT_S,
                                                                     emit=self.emit),
                               operation="validate")
        rejected = [o for o in checks if not o.ok]
        if not rejected:
            return
        first = rejected[0]
        detail = "; ".join(f"{o.engine_id}: {o.error_message}" for o in rejected)
        if first.error_reason == InvalidArgument.reason:
            raise InvalidArgument(f"engine rejected the broadcast: {detail}", metadata={"engine_id": first.engine_id})
        raise FailedPrecondition(f"engine cannot take the broadcast: {detail}",
                                 reason=first.error_reason or "FAILED_PRECONDITION",
                                 metadata={"engine_id": first.engine_id})

    async def _transfer(self, request, setup: BroadcastSetup,
                        progress: BroadcastProgress) -> coordinator_pb2.BroadcastResult:
        """Phase 2: the rendezvous to the trainer, every member's Receive, the result."""
        await self.emit("broadcast_started", version=request.version, bytes=setup.plan.total_bytes,
                        plan="by_id" if is_reference(request.plan) else "whole", engines=",".join(setup.ranks),
                        transport=transports.KIND_NAMES[request.transport],
                        lanes=";".join(f"{lane.lane}:{','.join(lane.engine_ids)}" for lane in setup.lanes),
                        **({"group_layout": setup.lanes[0].group_layout or TENSORS}
                           if request.transport == common_pb2.TRANSPORT_KIND_GROUP else {}))
        # The trainer starts one send per lane it sends; a host's relayed lane goes to it
        # too, so that if the relay dies it can still tell that host's engines to stop.
        for lane in setup.lanes:
            progress.publish(coordinator_pb2.BroadcastResponse(rendezvous=lane))
        started = time.monotonic()
        metrics.BROADCAST_IN_PROGRESS.set(1)
        if self.faults is not None and self.faults.take("round", method="transfer") is not None:
            raise RuntimeError("injected failure in the transfer phase")

        async def receive(record: EngineRecord) -> common_pb2.EngineOutcome:
            try:
                return await self._unless_it_lapses(record, call_agent(record, lambda: call_with_retry(
                    record, lambda r: call_receive(request, setup, r, False, setup.timeout_s + RPC_MARGIN_S,
                                                         emit=self.emit)),
                    "broadcast"))
            except EngineUnavailable as exc:  # its heartbeats stopped mid-transfer, or its channel closed
                progress.publish(coordinator_pb2.BroadcastResponse(engine_failed=failed_outcome(record.engine_id, exc)))
                raise
            except grpc.aio.AioRpcError as exc:
                # Tell the trainer now, so it stops sending instead of waiting out its
                # deadline for an engine that will never acknowledge. Not when the engine
                # had all its bytes and a later check failed: its lane's other engines
                # may still be reading, and stopping it would tear them too.
                error = engine_error(record, exc, "broadcast")
                if error.metadata.get(AFTER_TRANSFER) != "true":
                    progress.publish(coordinator_pb2.BroadcastResponse(
                        engine_failed=failed_outcome(record.engine_id, error)))
                raise

        try:
            outcomes = await fan_out(setup.members, receive, operation="broadcast", retry=False)
        finally:
            metrics.BROADCAST_IN_PROGRESS.set(0)
        for o in outcomes:
            o.rank = setup.ranks[o.engine_id]
            lane = setup.lane_of[o.engine_id]
            o.relayed_by = lane.relayed_by
            o.transport = common_pb2.TRANSPORT_KIND_GLOO if lane.relayed_by else lane.transport
        for engine_id in setup.gone:
            outcomes.append(failed_outcome(engine_id, EngineUnavailable(f"engine {engine_id} stopped heartbeating")))
        await fill_real_state(self.registry, outcomes)
        return await self._record_broadcast(request, setup, outcomes, time.monotonic() - started)

    async def _unless_it_lapses(self, record: EngineRecord, call: Awaitable[common_pb2.EngineOutcome]):
        """``call`` (an engine's Receive), unless the engine stops heartbeating first: then
        EngineUnavailable at once. A dead host or a cut link sends no reset, so the call
        itself would only fail when keepalives give up, or at the round's deadline; the
        heartbeats (on the agent's loop, which never blocks) say it within the timeout."""
        task = asyncio.ensure_future(call)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=LAPSE_CHECK_S)
                # Heartbeats only: an engine that reports a fault still answers its call,
                # with the receive's own outcome (torn or not), which says more.
                silent_s = record.heartbeat_age()
                if not task.done() and silent_s >= self.registry.heartbeat_timeout_s:
                    task.cancel()
                    error = EngineUnavailable(f"engine {record.engine_id} stopped heartbeating during the "
                                              f"broadcast (none for {silent_s:.1f} s)")
                    error.metadata["engine_id"] = record.engine_id
                    raise error
            return task.result()
        finally:
            task.cancel()

    async def _record_broadcast(self, request, setup: BroadcastSetup, outcomes: list[common_pb2.EngineOutcome],
                                seconds: float) -> coordinator_pb2.BroadcastResult:
        ok = all(o.ok for o in outcomes)
        if ok:
            self.weight_version = request.version
            self.phase = "broadcast_done"
        else:
            self.phase = "failed"
            self.epoch += 1  # never reuse a group that saw a failure
        await self.save_after_change("a broadcast")
        self._report("broadcast", outcomes, ok=ok)
        metrics.SYNC_SECONDS.observe(seconds)
        if ok:
            metrics.SYNC_BYTES.observe(setup.plan.total_bytes)
            metrics.WEIGHT_VERSION.set(self.weight_version)
        for o in outcomes:
            transport = transports.KIND_NAMES.get(o.transport, "")
            metrics.ENGINE_TRANSFERS.labels(o.engine_id, transport, "ok" if o.ok else "failed").inc()
            await self.emit("engine_received" if o.ok else "engine_failed", o.engine_id, version=request.version,
                            transport=transport, reason=o.error_reason, message=o.error_message)
        await self.emit("broadcast_done" if ok else "broadcast_failed", version=request.version,
                        seconds=f"{seconds:.4f}")
        return coordinator_pb2.BroadcastResult(version=request.version, ok=ok, engines=outcomes,
                                               bytes=setup.plan.total_bytes, seconds=seconds)

    # ----- resume -----------------------------------------------------------------------

    async def resume(self, request: coordinator_pb2.ResumeRequest, *,
                     sync: tuple[str, int] | None = None) -> coordinator_pb2.ResumeResponse:
        check_timeout(request.timeout_s)
        async with self.lock:
            if self.phase == "idle" or not self.round_engines:
                await self._record_sync(sync, "resume")
                return coordinator_pb2.ResumeResponse()
            timeout_s = request.timeout_s or DEFAULT_PAUSE_TIMEOUT_S

            async def call(record: EngineRecord) -> common_pb2.EngineOutcome:
                reply = await record.stub.ResumeEngine(agent_pb2.ResumeEngineRequest(
                    idempotency_key=derive_key(request.idempotency_key, record.engine_id),
                    allow_torn=request.allow_torn, timeout_s=timeout_s), timeout=timeout_s + RPC_MARGIN_S)
                return reply.outcome

            outcomes = await fan_out(self._members(), call, operation="resume")
            still_paused = [o.engine_id for o in outcomes if not o.ok]
            self.round_engines = still_paused  # they stay members until a good round
            self.phase = "failed" if still_paused else "idle"
            await self.save_after_change("a resume")
            await self._record_sync(sync, "resume")
            self._report("resume", outcomes, ok=not still_paused)
            await self.emit("resumed", engines=",".join(o.engine_id for o in outcomes if o.ok),
                            still_paused=",".join(still_paused))
            return coordinator_pb2.ResumeResponse(engines=outcomes)


__all__ = ["SyncRound", "DEFAULT_PAUSE_TIMEOUT_S", "DEFAULT_TRANSFER_TIMEOUT_S", "RPC_MARGIN_S"]
