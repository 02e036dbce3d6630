"""EngineAgent: the sidecar beside one engine.

It serves the ``EngineAgent`` RPCs, drives its engine through an ``EngineAdapter``,
joins the data plane to receive weights, and enforces the engine-side invariants
whatever its callers send:

- kv-awake: ``Resume`` wakes the KV cache first; a receive that ran with the KV cache
  offloaded wakes it when it ends, on success, failure and cancellation.
- no-resume-mid-transfer: ``Resume`` waits for a running receive to end.
- no-torn-serving: a failed receive leaves the engine paused and ``torn`` (with the
  version it was moving to) until a good receive, unless the resume says ``allow_torn``.
- monotonic-versions: a receive for a version <= the served one is refused
  (``receive_checks.py``, with every other check made before anything changes).

Every mutating RPC goes through an in-memory ``IdempotencyStore`` (keys derived by
the coordinator), so a retried Receive can never start a second transfer. Engine
control runs on one thread, the transfer on another; the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from weightsync import transport as transports
from weightsync.attest import Probe
from weightsync.engine.adapter import Delivery, EngineAdapter, validate_tags
from weightsync.errors import (
    DigestWithheld,
    EngineFault,
    EngineOutputMismatch,
    FailedPrecondition,
    InvalidArgument,
    StepTimeoutError,
    TornWeightsError,
    TransferError,
    WeightSyncError,
    abort_with,
)
from weightsync.event_log import EventLog
from weightsync.faults import FaultInjector
from weightsync.grpc_options import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from weightsync.host_identity import host_id
from weightsync.idempotency import IdempotencyStore
from weightsync.loop_lag import LoopLagMonitor
from weightsync.plan import BucketPlan, is_reference
from weightsync.server.agent.engine_ledger import EngineLedger
from weightsync.server.agent.engine_watch import EngineWatch
from weightsync.server.agent.fence import VersionFence
from weightsync.server.agent.launcher import EngineLauncher
from weightsync.server.agent.pause_keeper import PauseKeeper
from weightsync.server.agent.receive_checks import ReceiveChecks
from weightsync.server.agent.receive_job import ReceiveJob, never_started
from weightsync.server.agent.weight_export import WeightExporter
from weightsync.sharding import MAX_SENDERS
from weightsync.threads import run_in
from weightsync.transport.base import Receiver
from weightsync.transport.relay import HostRelay
from weightsync.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from weightsync.validate import check_pause_mode, check_timeout

log = logging.getLogger("weightsync.agent")
T = TypeVar("T")
# The idempotency key of the operation the current task serves: events it records
# carry it, so an operator can count executions per key.
OPERATION_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("weightsync_agent_operation_key", default="")

DEFAULT_TIMEOUT_S = 60.0
# A receive with no contact with the coordinator for this long is abandoned: longer than
# the coordinator's keepalive takes to fail its call to this agent (ping, then timeout).
COORDINATOR_SILENCE_S = KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + 1.0
EXPORT_END_WAIT_S = 10.0  # how long a receive waits for an export that is ending
# A relay's threads, made as they are needed: one per lane it forwards at once (a
# sharded trainer's round: one per sender, as many as a round may have).
MAX_RELAYED_LANES = MAX_SENDERS


class AgentCore(agent_pb2_grpc.EngineAgentServiceServicer):
    """The agent's state machine and RPC handlers (see the module docstring)."""

    @property
    def data_host(self) -> str:
        """Where this agent's network receivers (and catch-up senders) listen: the host
        it registered, the one the coordinator and trainers reach it at."""
        return self.address.rpartition(":")[0].strip("[]") or "127.0.0.1"

    def __init__(self, *, engine_id: str, adapter: EngineAdapter, injected_faults: FaultInjector | None = None,
                 launcher: EngineLauncher | None = None) -> None:
        self.engine_id = engine_id
        self.adapter = adapter
        # Test-only fault injection (``--enable-fault-injection``); never the engine's own
        # fault, which ``fault()`` reports.
        self.injected_faults = injected_faults
        self.launcher = launcher
        self.watch = EngineWatch(adapter, launcher=launcher)
        self.watch.on_reboot = self.engine_rebooted
        self.address = ""  # HOST:PORT registered with the coordinator (set at start)
        self._control = ThreadPoolExecutor(1, thread_name_prefix="weightsync-engine")
        self._transfer = ThreadPoolExecutor(1, thread_name_prefix="weightsync-receive")
        self._receivers: dict[tuple[int, int], Receiver] = {}  # by (transport, lane)
        # This agent as its host's relay (made on first use), one per lane it forwards
        # (a sharded trainer's: one per sender), each on its own thread, because they
        # run alongside the engine's own receive of the bytes they re-share.
        self._relays: dict[int, HostRelay] = {}
        self._relay_threads = ThreadPoolExecutor(MAX_RELAYED_LANES, thread_name_prefix="weightsync-relay")
        self._coordinator_heard_at = time.monotonic()  # the last heartbeat that got through
        self.workers = 0  # ranks the engine takes in a group (its worker processes); 0 = not asked yet
        self.receive_checks = ReceiveChecks(engine_id, adapter, receiver_for=self._receiver,
                                            note_workers=lambda n: setattr(self, "workers", n))
        self.registered = False  # with the coordinator, at least once (the shutdown deregisters then)
        self._idempotency = IdempotencyStore()
        self._abort = threading.Event()
        self.ledger = EngineLedger()
        self._progress = (0, 0)  # (buckets done, buckets total) of the running or last receive
        self.events = EventLog(log, engine_id=engine_id)
        self.loop_lag = LoopLagMonitor("agent")  # run by the agent's main on its loop
        self.accepting = True
        self.fence = VersionFence(self.ledger, self)
        self.pause_keeper = PauseKeeper(self.ledger, self, self.fence)
        self.fence.pause_mismatch = self.pause_keeper.mismatch
        self.exporter = WeightExporter(self, self.fence)

    # ----- helpers --------------------------------------------------------------------

    def record(self, kind: str, **fields: object) -> None:
        """Appends to the agent's event log (GetEvents): what happened, in order."""
        self.events.append(kind, key=OPERATION_KEY.get(), **fields)

    async def run_on_engine(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs ``fn`` on the engine's control thread (one call at a time)."""
        return await run_in(self._control, fn, *args, **kwargs)

    def receiving(self) -> bool:
        """A receive is running (its settlement included)."""
        return self.ledger.receiving()

    def fault(self) -> str:
        """Why this engine cannot serve: the engine's own fault or its launched process's.

        Never asks an HTTP engine (see ``EngineWatch``): safe on the event loop."""
        return self.watch.fault()

    def _check_alive(self) -> None:
        fault = self.fault()
        if fault:
            raise EngineFault(f"engine {self.engine_id} is dead: {fault}", metadata={"engine_id": self.engine_id})

    def _outcome(self, ok: bool = True, **fields) -> common_pb2.EngineOutcome:
        return common_pb2.EngineOutcome(engine_id=self.engine_id, ok=ok,
                                        weight_version=self.watch.current().weight_version,
                                        torn=self.ledger.torn, paused=self.ledger.paused, **fields)

    async def _handle(self, context, key: str, operation: str, request, fn, response_type):
        """Runs a mutating RPC through the idempotency store; errors become statuses."""
        try:
            if not self.accepting and operation not in ("resume",):
                raise FailedPrecondition("agent is shutting down", reason="SHUTTING_DOWN")
            OPERATION_KEY.set(key)  # this handler's context; the operation's task copies it
            return await self._idempotency.execute(key, operation, request, fn, response_type)
        except WeightSyncError as exc:
            await abort_with(context, exc)

    def _asleep_tags(self) -> list[str]:
        return list(self.adapter.asleep)

    def state(self, *, include_digest: bool = False) -> common_pb2.EngineState:
        """This engine's state as reported to the coordinator and to GetState.

        Built from the watched snapshot, so it never blocks (heartbeats call it on the
        loop); only ``include_digest`` reads the engine (call that off the loop)."""
        engine = self.watch.current()
        fault = self.fault()
        digest = withheld = ""
        if include_digest:
            try:
                digest = self.adapter.weights_digest()
            except DigestWithheld as exc:
                withheld = exc.message
        return common_pb2.EngineState(
            engine_id=self.engine_id, address=self.address, available=not fault,
            paused=self.ledger.paused or self.fence.fenced, fenced=self.fence.fenced, ready=not self.fence.not_ready_reason(),
            receiving=self.receiving(), engine_restarts=self.engine_restarts,
            can_export=self.adapter.can_export_weights, host_id=host_id(), workers=self.workers,
            group_layouts=self.adapter.group_layouts, receives=self.adapter.receives,
            faulted=bool(fault), fault=fault, weight_version=engine.weight_version,
            weight_version_unknown=not engine.version_known, torn=self.ledger.torn,
            torn_version=self.ledger.torn_version, asleep_tags=self._asleep_tags(),
            model=getattr(self.adapter, "model_label", "") or self.adapter.name,
            weights_digest=digest, digest_withheld=withheld,
            running_requests=engine.running, queued_requests=engine.queued, buckets_done=self._progress[0],
            buckets_total=self._progress[1])

    # ----- RPCs: control --------------------------------------------------------------

    async def PauseEngine(self, request, context):
        outcome = await self._handle(context, request.idempotency_key, "pause", request,
                                     lambda: self._pause(request), common_pb2.EngineOutcome)
        return agent_pb2.PauseEngineResponse(outcome=outcome)

    async def _pause(self, request) -> common_pb2.EngineOutcome:
        self._check_alive()
        check_pause_mode(request.mode)
        timeout_s = check_timeout(request.timeout_s) or DEFAULT_TIMEOUT_S
        async with self.fence.lock:  # a fence being lifted never resumes the engine under this Pause
            await self.pause_engine(request.mode, timeout_s=timeout_s)
            self.ledger.paused = True
        self.record("paused", mode=common_pb2.PauseMode.Name(request.mode))
        if request.offload_kv:
            slept = await self.run_on_engine(self.adapter.sleep, ["kv_cache"])
            if slept:
                self.ledger.kv_offloaded_for_sync = True
                self.record("kv_asleep")
        return self._outcome()

    async def Sleep(self, request, context):
        outcome = await self._handle(context, request.idempotency_key, "sleep", request,
                                     lambda: self._sleep(request), common_pb2.EngineOutcome)
        return agent_pb2.SleepResponse(outcome=outcome)

    async def _sleep(self, request) -> common_pb2.EngineOutcome:
        self._check_alive()
        tags = validate_tags(request.tags)
        if not self.ledger.paused:
            raise FailedPrecondition("sleep needs a paused engine: call Pause first")
        slept = await self.run_on_engine(self.adapter.sleep, tags)
        for tag in slept:
            self.record(f"{tag}_asleep".replace("kv_cache", "kv"))
        return self._outcome()

    async def Wake(self, request, context):
        outcome = await self._handle(context, request.idempotency_key, "wake", request,
                                     lambda: self._wake(request), common_pb2.EngineOutcome)
        return agent_pb2.WakeResponse(outcome=outcome)

    async def _wake(self, request) -> common_pb2.EngineOutcome:
        self._check_alive()
        tags = validate_tags(request.tags)
        await self._wake_tags(tags)
        return self._outcome()

    async def _wake_tags(self, tags: list[str], *, keep_paused: bool = False) -> None:
        woken = await self.run_on_engine(self.adapter.wake_paused if keep_paused else self.adapter.wake, tags)
        if "weights" in woken:
            # Woken weights are empty storage: nothing trustworthy until a good receive.
            self.ledger.torn, self.ledger.torn_version = True, self.ledger.torn_version or 0
            self.record("weights_awake")
        if "kv_cache" in woken:
            self.ledger.kv_offloaded_for_sync = False
            self.record("kv_awake")

    async def ResumeEngine(self, request, context):
        outcome = await self._handle(context, request.idempotency_key, "resume", request,
                                     lambda: self._resume(request), common_pb2.EngineOutcome)
        return agent_pb2.ResumeEngineResponse(outcome=outcome)

    async def _resume(self, request) -> common_pb2.EngineOutcome:
        self._check_alive()
        timeout_s = check_timeout(request.timeout_s) or DEFAULT_TIMEOUT_S
        task = self.ledger.receive
        if task is not None and not task.done():
            # Invariant no-resume-mid-transfer: never resume while bytes still land.
            self.record("resume_waits_for_receive")
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                raise StepTimeoutError("resume waited too long for a running receive", operation="resume")
        if "weights" in self._asleep_tags():
            await self._wake_tags(["weights"])
        if self.ledger.torn and not request.allow_torn:
            raise TornWeightsError(
                f"engine {self.engine_id} holds torn weights (failed move to version {self.ledger.torn_version}); "
                "it stays paused until a good broadcast or a resume with allow_torn",
                metadata={"engine_id": self.engine_id, "torn_version": str(self.ledger.torn_version)})
        async with self.fence.lock:
            # Never release an engine older than the fleet: it stays paused and fenced.
            self.fence.check_resume(self.watch.current().weight_version)
            await self.release_engine()
            self.ledger.paused = False
        self.record("resumed", allow_torn=request.allow_torn, torn=self.ledger.torn)
        return self._outcome()

    @property
    def engine_restarts(self) -> int:
        """How often the engine was started again under this agent: relaunched by its
        launcher, or (an engine it did not launch) seen to have booted again. Part of
        the round's group identity: a new process has joined no group."""
        return self.launcher.restarts if self.launcher else self.watch.reboots

    async def engine_relaunched(self) -> None:
        """The launcher started a new engine process (``--restart on-failure``): it holds
        its boot weights and none of the old process's state. It is fenced before its
        fault clears; the next heartbeat answer lifts the fence if it is current."""
        await self._engine_started_again("engine_relaunched", why="engine relaunched")

    async def engine_rebooted(self) -> None:
        """An engine this agent did not launch was started again by whatever runs it (its
        version record is its boot one again, ``EngineWatch.reboots``): as after a
        relaunch, whatever this agent knew of the old process is forgotten and the
        engine is fenced until it holds the fleet's version."""
        await self._engine_started_again("engine_rebooted", why="engine restarted outside the agent")

    async def _engine_started_again(self, event: str, *, why: str) -> None:
        self.adapter.engine_restarted()
        self.ledger.torn, self.ledger.torn_version = False, 0  # boot weights: whole, if perhaps old
        self.ledger.kv_offloaded_for_sync = False
        self.record(event, restarts=self.engine_restarts)
        # Paused first: the engine serves its boot weights from its first healthy answer
        # until this pause (SGLang cannot boot paused, nor a vLLM started without
        # weightsync's boot-paused scheduler), so nothing goes before it.
        await self.fence.raise_now(why=why)
        await self.watch.refresh()

    def found_torn(self, version: int) -> None:
        """At start-up: the engine records a receive to ``version`` that never finished
        (an agent before this one died during it). Its weights are torn: it stays paused,
        as after a failed transfer here, until a good broadcast (invariant no-torn-serving)."""
        self.ledger.torn, self.ledger.torn_version, self.ledger.paused = True, version, True
        self.record("torn_found", version=version)

    async def release_engine(self) -> None:
        """Lets the engine run: its KV cache awake first (invariant kv-awake), then resumed."""
        if "kv_cache" in self._asleep_tags():
            await self._wake_tags(["kv_cache"])
        await self._command(self.adapter.resume)

    async def pause_engine(self, mode: int, *, timeout_s: float) -> None:
        """Pauses the engine (every pause the agent makes goes through here)."""
        await self._command(self.adapter.pause, mode, timeout_s=timeout_s)

    async def _command(self, fn: Callable[..., None], *args, **kwargs) -> None:
        """A pause or resume; one that failed leaves the pause keeper in doubt (it may
        have landed, or land later, or never reached the engine)."""
        known = False
        try:
            await self.run_on_engine(fn, *args, **kwargs)
            known = True
        except (FailedPrecondition, InvalidArgument):
            known = True  # refused before anything was sent: the engine is as it was
            raise
        finally:
            self.pause_keeper.commanded(landed=known)

    # ----- RPCs: weights --------------------------------------------------------------

    async def Export(self, request, context):
        """Catch-up source: see ``server/agent/weight_export.py``. Not through the idempotency
        store: it changes nothing here, and the coordinator never retries it (a new
        attempt has a new key)."""
        if not self.accepting:
            await abort_with(context, FailedPrecondition("agent is shutting down", reason="SHUTTING_DOWN"))
        OPERATION_KEY.set(request.idempotency_key)
        try:
            async for event in self.exporter.export(request):
                yield event
        except WeightSyncError as exc:
            await abort_with(context, exc)

    async def Receive(self, request, context):
        if request.validate_only:
            try:
                # Off the loop: the plan may hold 20k tensors, and an HTTP engine answers slowly.
                await self.run_on_engine(self._check_alive)
                await self.run_on_engine(self.receive_checks.validate, request)
            except WeightSyncError as exc:
                await abort_with(context, exc)
            return agent_pb2.ReceiveResponse(outcome=self._outcome())
        self.loop_lag.round_started()
        outcome = await self._handle(context, request.idempotency_key, "receive", request,
                                     lambda: self._receive(request), common_pb2.EngineOutcome)
        return agent_pb2.ReceiveResponse(outcome=outcome)

    def _receiver(self, kind: int, lane: int = 0) -> Receiver:
        """This agent's receiver of ``kind`` for its ``lane``-th concurrent lane (each has
        its own group and buffers, kept while the lane's group id stays)."""
        receiver = self._receivers.get((kind, lane))
        if receiver is None:
            receiver = self._receivers[(kind, lane)] = transports.make_receiver(kind, data_host=self.data_host)
        return receiver

    async def _receive(self, request) -> common_pb2.EngineOutcome:
        job = await self._start_receive(request)
        try:
            await self._receive_steps(job)
        except BaseException as exc:  # anything before or around the transfer: nothing trustworthy landed
            job.error = exc
            job.cancelled |= isinstance(exc, asyncio.CancelledError)
        finally:
            await self._settle_receive(job)
        return job.outcome(self._outcome)

    async def _start_receive(self, request) -> ReceiveJob:
        """Checks everything, then claims the engine for one receive (nothing has
        changed if this raises)."""
        await self.run_on_engine(self._check_alive)
        checked = await self.run_on_engine(self.receive_checks.validate, request)
        if not (self.ledger.paused or self.fence.fenced):  # a fenced engine is paused: a catch-up receives into it
            raise FailedPrecondition("receive needs a paused engine: call Pause first")
        # Its weights are being sent to a peer: they must not change. Only the end of an
        # export the coordinator gave up on can meet a round (found: a round's receive
        # 20 ms after a catch-up failed, refused, and the round's other engine then
        # waited in the group for this one until the deadline).
        if self.exporter.running and not await self.exporter.wait_ended(EXPORT_END_WAIT_S):
            raise FailedPrecondition("this engine is exporting its weights to a peer; try again when it is done")
        if self.ledger.receive is not None and not self.ledger.receive.done():
            raise FailedPrecondition("a receive is already running on this engine")
        if "weights" in self._asleep_tags():
            await self._wake_tags(["weights"])
        self.ledger.receive = asyncio.get_running_loop().create_future()
        self._abort.clear()
        self.record("transfer_started", version=request.version, bytes=checked.plan.total_bytes,
                    plan="by_id" if is_reference(request.plan) else "whole")
        return ReceiveJob(request, checked.plan, checked.receiver, checked.probe, checked.senders, checked.owners,
                           checked.relays,
                           deadline_at=time.monotonic() + (request.timeout_s or DEFAULT_TIMEOUT_S))

    async def _receive_steps(self, job: ReceiveJob) -> None:
        """The bytes, then the checks that decide whether they are good (digest, the
        attestation probe), then the version commit. Invariant cancel-waits-for-transfer
        on the engine side: a cancellation still waits for each step, so the receive
        always settles."""
        request, plan = job.request, job.plan
        restore_stale = self._inject_stale_tensor(plan, request.version)
        await job.wait(self._start_transfer(job))
        job.bytes_in = job.error is None
        if job.error is None and restore_stale is not None:
            restore_stale()
        if job.error is None and request.weights_digest:
            digest = await job.wait(asyncio.ensure_future(self.run_on_engine(self.adapter.received_digest,
                                                                             job.owners)))
            if job.error is None and len(digest) != len(request.weights_digest):
                job.error = TransferError(
                    f"the trainer's weights digest is of another kind than this agent's ({len(request.weights_digest)}"
                    f" hex digits, this side's {len(digest)}): run the same weightsync release on both sides")
            elif job.error is None and digest != request.weights_digest:
                job.error = TransferError("received weights do not match the trainer's digest")
        if job.error is None and job.probe is not None:
            # Invariant ok-means-computed: the engine's own outputs, not the bytes, decide "ok".
            attested = await job.wait(asyncio.ensure_future(self._attest(job.probe, request.version,
                                                                         job.deadline_at)))
            if attested is not None:
                job.attest_max_diff, job.error = attested
        if job.error is None:
            # Off the loop (an HTTP call for vLLM and SGLang): an engine that cannot record
            # the version fails the receive like any other step.
            await job.wait(asyncio.ensure_future(self.run_on_engine(self.adapter.commit, request.version)))
            if job.error is None:
                self.watch.committed(request.version)

    def _start_transfer(self, job: ReceiveJob) -> asyncio.Future:
        """The transfer, on the transfer thread, through the adapter's one receive entry
        point (into tensors this process holds, or inside the engine's own processes)."""
        request, faults, version = job.request, self.injected_faults, job.request.version
        total = sum(lane.plan.num_buckets for lane in job.senders) if job.senders else job.plan.num_buckets
        skip_post_load = faults is not None and faults.take("receive", version=version,
                                                            action="skip_post_load") is not None
        self._progress = (0, total)

        def on_bucket(bucket: int) -> None:
            # Runs on the transfer thread; a tuple swap is atomic, heartbeats read it.
            self._progress = (bucket + 1, total)
            if faults is not None:
                faults.on_bucket("receive", version, bucket, deadline_at=job.deadline_at)

        own = run_in(self._transfer, self.adapter.receive, Delivery(
            rendezvous=request.rendezvous, rank=request.rank, plan=job.plan, receiver=job.receiver,
            deadline_at=job.deadline_at, abort=self._abort, on_bucket=on_bucket, skip_post_load=skip_post_load,
            data_host=self.data_host, senders=job.senders, owners=job.owners, version=request.version,
            verify_parts=bool(request.weights_digest)))
        if not job.relays:
            return own
        relays = []
        for forward in job.relays:
            relay = self._relays.get(forward.index)
            if relay is None:
                relay = self._relays[forward.index] = HostRelay(self.data_host)
            relays.append(run_in(self._relay_threads, relay.forward, forward.upstream, forward.downstream,
                                 forward.plan, deadline_at=job.deadline_at, abort=self._abort))
        return asyncio.ensure_future(self._with_relays(own, relays, version))

    async def _with_relays(self, own: asyncio.Future, relays: list[asyncio.Future], version: int):
        """The engine's own receive, once the relays it depends on have ended too (each
        is bounded by the deadline; a failure of one ends the lanes that need it)."""
        results = await asyncio.gather(own, *relays, return_exceptions=True)
        for result in results[1:]:
            if isinstance(result, BaseException):
                self.record("relay_failed", version=version, error=str(result))
        if isinstance(results[0], BaseException):
            raise results[0]
        return results[0]

    async def _settle_receive(self, job: ReceiveJob) -> None:
        """Always runs, once per receive: the engine's weights are trusted, or torn, or
        (a rendezvous that wrote nothing) as they were; the receive slot is freed; the
        KV cache the sync put to sleep is woken."""
        request, error = job.request, job.error
        job.finished = time.monotonic()
        if error is None:
            self._progress = (self._progress[1], self._progress[1])
            self.ledger.torn, self.ledger.torn_version = False, 0
            # shm says how it read the bytes: "direct" (from the trainer's memory) or "ring".
            read = getattr(job.receiver, "last_mode", "")
            self.record("transfer_done", version=request.version, seconds=f"{job.seconds():.4f}",
                        **self.adapter.receive_stats(), **({"read": read} if read else {}),
                        **({} if job.attest_max_diff is None else {"attest_max_diff": f"{job.attest_max_diff:.3g}"}))
        elif getattr(error, "wrote_nothing", False):
            # The rendezvous failed before any byte reached the engine's tensors: its
            # weights are what they were (trusted unless already torn), and the error
            # says the transfer never started.
            job.error = never_started(error)
            self.record("transfer_failed", version=request.version, error=str(job.error), wrote="nothing")
        else:
            self.ledger.torn, self.ledger.torn_version = True, request.version
            self.record("transfer_failed", version=request.version, error=str(error))
        self.ledger.receive.set_result(None)
        # Wake the KV cache the sync put to sleep. An engine that now holds torn weights
        # must stay paused: an engine that cannot wake without resuming (vLLM) keeps it
        # asleep, and Resume wakes it first if the engine is ever allowed to run.
        if self.ledger.kv_offloaded_for_sync and "kv_cache" in self._asleep_tags():
            await asyncio.shield(self._wake_tags(["kv_cache"], keep_paused=job.error is not None))

    async def _attest(self, probe: Probe, version: int, deadline_at: float) -> tuple[float, BaseException | None]:
        """Runs the probe on the engine (transfer thread, within the receive's deadline);
        returns the largest difference and the error that makes the engine torn, if any."""
        scoring = run_in(self._transfer, self.adapter.score, probe.sequences)
        left = deadline_at - time.monotonic()
        done, _ = await asyncio.wait({scoring}, timeout=max(left, 0.0))
        if not done:
            # The engine stays paused and torn; the scoring call ends by its own deadline.
            return float("nan"), StepTimeoutError("the attestation probe ran past the receive's deadline",
                                                  operation="attest")
        if scoring.exception() is not None:
            return float("nan"), scoring.exception()
        comparison = probe.compare(scoring.result())
        self.record("attested", version=version, max_diff=f"{comparison.max_diff:.3g}",
                    tolerance=probe.tolerance)
        if not comparison.max_diff <= probe.tolerance:  # NaN is a mismatch too
            return comparison.max_diff, EngineOutputMismatch(
                f"engine {self.engine_id} loaded version {version} but does not compute with it: "
                f"{comparison.describe()}, tolerance {probe.tolerance:g}; it stays paused and torn",
                metadata={"engine_id": self.engine_id, "max_diff": f"{comparison.max_diff:.6g}"})
        return comparison.max_diff, None

    def _inject_stale_tensor(self, plan: BucketPlan, version: int) -> Callable[[], None] | None:
        """Test-only fault ``stale_tensor``: one tensor keeps its old contents after the
        receive (the bytes arrived; the engine does not use them), as a reload that skips
        a layer does. Returns the function that puts the old contents back."""
        rule = self.injected_faults.take("receive", version=version, action="stale_tensor") if self.injected_faults else None
        targets = self.adapter.load_targets(plan) if rule is not None else []
        if not targets:
            return None
        index = plan.names.index(rule.tensor) if rule.tensor in plan.names else 0
        target, old = targets[index], targets[index].clone()
        return lambda: target.copy_(old)

    # ----- RPCs: queries and generation -----------------------------------------------

    async def GetEngineState(self, request, context):
        if request.include_digest:
            return agent_pb2.GetEngineStateResponse(
                state=await self.run_on_engine(lambda: self.state(include_digest=True)))
        return agent_pb2.GetEngineStateResponse(state=self.state())

    async def Generate(self, request, context):
        async def submit() -> agent_pb2.GenerateResponse:
            self._check_alive()
            rid = await self.run_on_engine(self.adapter.submit, list(request.prompt), request.max_tokens)
            return agent_pb2.GenerateResponse(request_id=rid)
        return await self._handle(context, request.idempotency_key, "generate", request, submit,
                                  agent_pb2.GenerateResponse)

    async def GetGeneration(self, request, context):
        try:
            wait_s = min(check_timeout(request.wait_s, "wait_s"), 60.0)
            # Waiting happens on a worker thread, not the control thread, so a long
            # poll never delays a Pause.
            req = await asyncio.to_thread(self.adapter.get, request.request_id, wait_s)
        except WeightSyncError as exc:
            await abort_with(context, exc)
            return
        return agent_pb2.GetGenerationResponse(generation=agent_pb2.Generation(
            request_id=req.request_id, status=req.status, tokens=list(req.tokens),
            versions=list(req.versions), error=req.error))

    async def GetEvents(self, request, context):
        return agent_pb2.GetEventsResponse(events=self.events.after(request.after_seq))

    # ----- lifecycle ------------------------------------------------------------------

    def coordinator_heard(self) -> None:
        """A heartbeat got through."""
        self._coordinator_heard_at = time.monotonic()

    def coordinator_silent(self) -> None:
        """A heartbeat failed. A receive that has gone without any contact with the
        coordinator for longer than its keepalives allow is abandoned: by then the
        coordinator's own call to this agent has failed (its keepalive closed the
        connection), so the round has recorded this engine as failed, and the receive
        would otherwise hold the engine until its deadline (a cut link tells no one; a
        sender behind it never reports). The engine stays paused and torn, as after any
        failed receive, and the next round can take it at once."""
        silent_s = time.monotonic() - self._coordinator_heard_at
        task = self.ledger.receive
        if silent_s > COORDINATOR_SILENCE_S and task is not None and not task.done() and not self._abort.is_set():
            log.warning("no contact with the coordinator for %.1f s during a receive: abandoning it", silent_s)
            self.record("receive_abandoned", silent_s=f"{silent_s:.1f}")
            self._abort.set()

    async def drain(self, grace_s: float) -> None:
        """Stops new work; lets a running receive finish within ``grace_s``, else abandons it
        (the engine stays paused and torn, never resumed mid-transfer)."""
        self.accepting = False
        task = self.ledger.receive
        if task is not None and not task.done():
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                # Abandoning is the orderly outcome of a shutdown that ran out of grace,
                # not a failed cleanup step: the exit code stays 0 (docs/guides/operations.md)
                log.warning("abandoning the running transfer after %.1fs of grace: the engine stays paused and torn",
                            grace_s)
                self.record("transfer_abandoned", grace_s=grace_s)
                self._abort.set()
                await asyncio.wait({task}, timeout=grace_s)

    def close(self, timeout_s: float = 10.0) -> list[BaseException]:
        """Closes receivers, the engine and the threads; returns every failure (never raises)."""
        errors: list[BaseException] = []
        for receiver in self._receivers.values():
            try:
                receiver.close()
            except Exception as exc:
                errors.append(exc)
        self._receivers.clear()
        for relay in self._relays.values():
            try:
                relay.close()
            except Exception as exc:
                errors.append(exc)
        self._relays.clear()
        errors += self.exporter.close()
        try:
            self.adapter.close()
        except Exception as exc:
            errors.append(exc)
        self.watch.close()
        for executor in (self._control, self._transfer, self._relay_threads):
            executor.shutdown(wait=False, cancel_futures=True)
        return errors


__all__ = ["AgentCore", "DEFAULT_TIMEOUT_S"]
