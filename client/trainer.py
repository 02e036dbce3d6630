"""TrainerClient: the asyncio client a trainer uses to push weights to every engine.

The event loop only awaits. Everything that blocks (materialising tensors, planning,
hosting the rendezvous store) runs on one dedicated worker thread, and each lane's
send (packing, the collective, waiting for peers) on a thread of the send pool, with
the caller's context copied so the deadline ContextVar goes along. Control calls are
grpc.aio.

A round may have several lanes: with ``transport="auto"`` the coordinator gives the
engines on this trainer's host shm and every other host a gloo group of its own; the
trainer sends to all lanes at once, and an engine's failure stops only its lane.

``update_weights`` is ``pause`` -> ``broadcast`` -> ``resume``:
- a cancellation that lands while bytes move waits for the transfer to end, then
  propagates, chained (``__cause__``) to the transfer's error if it failed;
- ``resume`` always runs (with its own small budget if the sync's deadline is spent),
  and the agents make sure no engine resumes onto torn weights or a sleeping KV cache;
- on expiry the caller gets ``StepTimeoutError`` naming the operation that was running.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch

from weightsync import deadline
from weightsync import transport as transports
from weightsync.cancellation import wait_through_cancellation
from weightsync.client.channel import LoopChannel
from weightsync.client.context import AsyncClient
from weightsync.client.lane_sends import ADDRESSED_KINDS, MAX_CONCURRENT_LANES, Lane, LaneSends
from weightsync.client.prepared_weights import AttestArg, Prepared
from weightsync.client.results import EngineResult, SyncFailed, SyncResult, sync_result_of
from weightsync.client.retry import (
    RetryPolicy,
    call_with_retry,
    is_transient,
    new_key,
)
from weightsync.client.round_senders import OneProcess, RoundSenders
from weightsync.client.round_stores import RoundStores
from weightsync.client.verify import WeightsCheck, check_engines, trainer_digest, validate_request
from weightsync.client.whole_sync import WholeSync
from weightsync.dtypes import dtype_name
from weightsync.errors import (
    CoordinatorUnavailable,
    InvalidArgument,
    PlanUnknown,
    TransferError,
    coordinator_error,
    from_rpc_error,
    outcome_error,
)
from weightsync.grpc_options import CHANNEL_OPTIONS
from weightsync.plan import DEFAULT_BUCKET_BYTES, is_reference
from weightsync.retry import retry
from weightsync.security import Security
from weightsync.threads import run_in
from weightsync.transport import AUTO_LAYOUT, LAYOUTS, is_relayed
from weightsync.transport.base import Sender
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

T = TypeVar("T")
log = logging.getLogger("weightsync.client")

CONNECT_ATTEMPT_S = 10.0  # start(): an address that gives no answer at all, not even a refusal

PAUSE_MODES = {"keep": common_pb2.PAUSE_MODE_KEEP, "abort": common_pb2.PAUSE_MODE_ABORT,
               "wait": common_pb2.PAUSE_MODE_WAIT}


class TrainerClient(AsyncClient):
    """Async context manager; see the module docstring.

    Args:
        coordinator: ``HOST:PORT`` of the coordinator.
        transport: default data plane: ``"auto"`` (per engine: shm on this host, gloo to
            other hosts, one network copy per host), ``"gloo"``, ``"shm"`` or ``"group"``
            (tensor by tensor over a torch.distributed group; what SGLang engines receive).
        host: address engines use to reach this trainer (its rendezvous store and its end
            of the network data plane both listen there, never on whatever this machine's
            hostname resolves to).
        bucket_bytes: bucket size of the plan.
        wire_dtype: cast floating tensors to this dtype on the way (fp32 -> bf16).
        default_timeout_s: deadline of one ``update_weights`` when none is given.
        resume_grace_s: budget of the resume that follows a failed or expired sync.
        retry: retry policy for transient control-plane failures.
        security: TLS material and token (default: plaintext, no token).
        measure_loop_lag: run a LoopLagProbe during every update_weights; the result
            carries it and the ``weightsync_trainer_loop_lag_ms`` gauge exports it.
        group_layout: for the group transport, ``"auto"`` (the default: ``"flattened"``
            when the tensors average under 1 MiB and the round's engines all take it,
            else ``"tensors"``), ``"tensors"`` (a
            broadcast per tensor, what every SGLang takes) or ``"flattened"`` (runs of
            tensors up to a bucket in one broadcast each: SGLang's
            ``load_format="flattened_bucket"``, which SGLang releases since late 2025
            accept, and an agent started with ``--sglang-flattened-bucket`` says so;
            much faster with many tensors). weightsync's own engines take both.
        connect_timeout_s: how long ``start()`` (``async with``) keeps trying to reach
            the coordinator before it raises ``CoordinatorUnavailable``. 0 (the
            default) fails at the first refused connection (or after
            ``CONNECT_ATTEMPT_S`` without any answer); give seconds to wait for a
            coordinator that is still starting.
        round_senders: who prepares and sends the rounds (``client/round_senders.py``):
            this process by default; ``DistributedTrainerClient`` passes rank 0's
            ``ShardedSenders``. Not for a single trainer to set.
    """

    def __init__(self, coordinator: str, *, transport: str = "auto", host: str = "127.0.0.1",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, wire_dtype: torch.dtype | None = None,
                 default_timeout_s: float = 300.0, resume_grace_s: float = 30.0,
                 retry: RetryPolicy | None = None, security: Security | None = None,
                 measure_loop_lag: bool = False, group_layout: str = AUTO_LAYOUT,
                 connect_timeout_s: float = 0.0, round_senders: RoundSenders | None = None) -> None:
        self.coordinator = coordinator
        if connect_timeout_s < 0:
            raise InvalidArgument(f"connect_timeout_s must be 0 or more, got {connect_timeout_s}")
        self.connect_timeout_s = connect_timeout_s
        if group_layout not in (AUTO_LAYOUT, *LAYOUTS):
            raise InvalidArgument(f"group_layout must be one of {(AUTO_LAYOUT, *LAYOUTS)}, got {group_layout!r}")
        self.group_layout = group_layout
        self.security = security or Security()
        self.measure_loop_lag = measure_loop_lag
        self.transport = transports.kind_from_name(transport)
        self.host = host
        if bucket_bytes <= 0 or bucket_bytes % 8:
            raise InvalidArgument("bucket_bytes must be a positive multiple of 8")
        self.bucket_bytes = bucket_bytes
        if wire_dtype is not None:
            dtype_name(wire_dtype)
        self.wire_dtype = wire_dtype
        if default_timeout_s <= 0 or resume_grace_s <= 0:
            raise InvalidArgument("timeouts must be positive")
        self.default_timeout_s = default_timeout_s
        self.resume_grace_s = resume_grace_s
        self.retry = retry or RetryPolicy()
        self._executor: ThreadPoolExecutor | None = None
        self._send_pool: ThreadPoolExecutor | None = None  # one thread per lane being sent
        # The coordinator's channel, reopened on a new event loop (asyncio.run per step).
        self._control: LoopChannel[coordinator_pb2_grpc.CoordinatorServiceStub] | None = None
        self._senders: dict[tuple[int, str], Sender] = {}  # by (transport, lane)
        # Who prepares and sends the rounds: this process (the default), or rank 0 of a
        # sharded trainer (``DistributedTrainerClient`` passes its ``ShardedSenders``).
        self.round_senders: RoundSenders = round_senders or OneProcess()
        self._stores: RoundStores | None = None  # made on the worker thread, with the first round
        # Plan ids this client's coordinator has taken in whole: later Broadcasts name
        # them by id (a megabyte less per step at 20k tensors). A coordinator that no
        # longer holds one answers PLAN_UNKNOWN and gets the whole plan again.
        self._plans_sent: set[str] = set()
        self._closed = False

    # ----- lifecycle --------------------------------------------------------------------

    async def start(self) -> TrainerClient:
        """Opens the channel and the worker threads, and connects to the coordinator
        (``CoordinatorUnavailable`` if it cannot: see ``connect_timeout_s``)."""
        if self._closed:
            raise RuntimeError("TrainerClient is closed")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightsync-transfer")
            # Lanes beyond this many wait for a thread: their engines' deadlines still hold.
            self._send_pool = ThreadPoolExecutor(MAX_CONCURRENT_LANES, thread_name_prefix="weightsync-send")
            self._control = LoopChannel(
                lambda: self.security.channel(self.coordinator, options=CHANNEL_OPTIONS),
                coordinator_pb2_grpc.CoordinatorServiceStub, owner="TrainerClient")
        if not await self._control.connect(keep_trying_s=self.connect_timeout_s, attempt_timeout_s=CONNECT_ATTEMPT_S):
            waited = f" (kept trying for {self.connect_timeout_s:g} s)" if self.connect_timeout_s else ""
            raise CoordinatorUnavailable(
                f"cannot connect to the coordinator at {self.coordinator}{waited}: check the address, that "
                "`weightsync coordinator` is running there and that its TLS settings match this client's; or "
                "pass connect_timeout_s=SECONDS to wait for one that is starting",
                metadata={"coordinator": self.coordinator})
        return self

    async def aclose(self) -> None:
        """Releases senders, the store, the thread and the channel. Idempotent; survives a
        half-finished ``start``; raises an ExceptionGroup of every failure."""
        if self._closed:
            return
        self._closed = True
        errors: list[Exception] = []
        executor, self._executor = self._executor, None
        if executor is not None:
            def close_thread_side() -> None:
                for sender in self._senders.values():
                    sender.close()
                self._senders.clear()
                if self._stores is not None:
                    self._stores.close()
            try:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(executor, close_thread_side), 30)
            except Exception as exc:
                errors.append(exc)
            executor.shutdown(wait=False, cancel_futures=True)
        if self._send_pool is not None:
            self._send_pool.shutdown(wait=False, cancel_futures=True)
            self._send_pool = None
        if self._control is not None:
            try:
                await self._control.aclose()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise ExceptionGroup("TrainerClient.aclose failed", errors)

    def _ready(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if self._control is None or self._closed:
            raise RuntimeError("TrainerClient is not started (use 'async with' or await start())")
        return self._control.stub()

    async def _in_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs blocking work on the transfer thread with the caller's context (deadline)."""
        assert self._executor is not None
        return await run_in(self._executor, fn, *args, **kwargs)

    # ----- the three calls ---------------------------------------------------------------

    async def pause(self, *, mode: str = "keep", offload_kv: bool = False, required_engines: Iterable[str] = (),
                    key: str | None = None, timeout_s: float | None = None, version: int = 0,
                    sync_key: str = "") -> coordinator_pb2.PauseResponse:
        """Pauses every available engine (a new round). ``mode``: keep | abort | wait.

        Returns each engine's outcome; engines that failed to pause are left out of
        the round. Raises the (typed) failure when no engine paused at all.
        ``version``: the version about to be broadcast; one that is not newer than the
        fleet's is refused (``FailedPrecondition``, ``VERSION_NOT_NEWER``) before any
        engine pauses. ``sync_key``: the logical sync (``update_weights``' key) this
        Pause starts, so that the coordinator can tell a retry of the whole sync from
        a Pause of its own.
        """
        if mode not in PAUSE_MODES:
            raise InvalidArgument(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        stub = self._ready()
        request = coordinator_pb2.PauseRequest(idempotency_key=key or new_key("pause"), mode=PAUSE_MODES[mode],
                                               offload_kv=offload_kv, required_engines=list(required_engines),
                                               version=version, sync_key=sync_key)
        with deadline.scope(timeout_s, operation="pause"), deadline.operation("pause"):
            async def attempt(left):
                request.timeout_s = max(0.001, left - 1.0) if left is not None else 0.0
                return await stub.Pause(request, timeout=left)
            response = await call_with_retry(self.retry, attempt, operation="pause",
                                              coordinator=self.coordinator)
        if response.engines and not any(o.ok for o in response.engines):
            first = response.engines[0]
            error = outcome_error(first.error_reason, f"no engine paused: {first.engine_id}: {first.error_message}",
                                  operation="pause", code=first.error_code)
            error.response = response  # type: ignore[attr-defined]
            raise error
        return response

    async def resume(self, *, allow_torn: bool = False, key: str | None = None,
                     timeout_s: float | None = None, sync_key: str = "") -> coordinator_pb2.ResumeResponse:
        """Resumes the round's engines; torn ones stay paused unless ``allow_torn``.
        ``sync_key``: the logical sync this Resume ends (see ``pause``)."""
        stub = self._ready()
        request = coordinator_pb2.ResumeRequest(idempotency_key=key or new_key("resume"), allow_torn=allow_torn,
                                                sync_key=sync_key)
        with deadline.scope(timeout_s, operation="resume"), deadline.operation("resume"):
            async def attempt(left):
                request.timeout_s = max(0.001, left - 1.0) if left is not None else 0.0
                return await stub.Resume(request, timeout=left)
            return await call_with_retry(self.retry, attempt, operation="resume", coordinator=self.coordinator)

    async def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                        transport: str | None = None, key: str | None = None, timeout_s: float | None = None,
                        verify_digest: bool = False, attest: AttestArg = None, sync_key: str = "") -> SyncResult:
        """Sends ``named_tensors`` as weight ``version`` to the paused engines.

        ``attest``: a ``Probe``, or a function returning one (``lambda:
        Probe.from_model(model, sequences)``), which the client calls on its worker
        thread, never on the event loop. Every engine then scores the probe after
        loading and before it may resume; ``EngineResult.attest_max_diff`` reports how
        far each was from the trainer's log-probs. ``sync_key``: the logical sync this
        Broadcast belongs to (see ``pause``).

        Raises:
            EngineOutputMismatch: every failed engine loaded the bytes but computes
                something else (torn, paused; ``.result`` has details).
            SyncFailed: some engine did not get the weights (``.result`` has details).
            StepTimeoutError: the deadline expired (operation ``broadcast``).
            asyncio.CancelledError: after the running transfer ended, chained to its error.
        """
        stub = self._ready()
        kind = transports.kind_from_name(transport) if transport else self.transport
        if version <= 0:
            raise InvalidArgument("version must be a positive integer")
        key = key or new_key("broadcast")
        with deadline.scope(timeout_s, operation="broadcast"), deadline.operation("broadcast"):
            store_port, secret = await self._in_thread(lambda: self.stores.for_kind(kind))
            # Addresses for shm's direct reads, and for the network transports' runs of
            # memory (``memory_runs``, ``whole_buckets``): taken in the per-step pass.
            # (Taking them turns nothing on: shm asks ``direct_enabled`` itself.)
            addresses = kind in ADDRESSED_KINDS
            prepared = await self._in_thread(self._prepare, named_tensors, verify_digest, attest,
                                             addresses=addresses)
            auto = kind == common_pb2.TRANSPORT_KIND_AUTO
            trainer_host = self.round_senders.trainer_host_id() if auto else ""
            sender_hosts = self.round_senders.sender_host_ids() if auto else []
            # Built on the worker thread too: a request with the whole plan lists every tensor.
            by_reference = prepared.plan.plan_id in self._plans_sent
            request = await self._in_thread(lambda: coordinator_pb2.BroadcastRequest(
                idempotency_key=key, version=version, transport=kind,
                plan=prepared.plan.reference_proto() if by_reference else prepared.plan.to_proto(),
                store_host=self.host, store_port=store_port, store_secret=secret, weights_digest=prepared.digest,
                group_backend=prepared.group_backend(kind), trainer_host_id=trainer_host,
                sender_host_ids=sender_hosts, sync_key=sync_key,
                group_layout=self.group_layout if kind == common_pb2.TRANSPORT_KIND_GROUP else "",
                probe=prepared.probe.to_proto() if prepared.probe is not None else None,
                owners=prepared.owners.to_proto() if prepared.owners is not None else None))
            # Once the Broadcast is sent, engines may already be waiting for bytes: a
            # cancellation from here on waits for the round (bounded by the deadline),
            # then propagates chained to its error, so nothing is resumed mid-transfer
            # and no engine is left waiting for a sender that never came.
            round_task = asyncio.ensure_future(self._broadcast(stub, request, prepared))
            if await wait_through_cancellation(round_task):
                cause = None if round_task.cancelled() else round_task.exception()
                raise asyncio.CancelledError("broadcast cancelled") from cause
            return round_task.result()

    async def _broadcast(self, stub, request, prepared: Prepared) -> SyncResult:
        """The Broadcast call, retried with the same key (a retry attaches to the running
        round, never re-runs it), and the send it starts; the send always ends before
        this returns or raises."""
        send = LaneSends(self.stores.abort_lane)
        try:
            try:
                result = await retry(lambda: self._attempt_broadcast(stub, request, prepared, send),
                                     policy=self.retry, retryable=is_transient, time_left=deadline.remaining)
            except grpc.aio.AioRpcError as exc:
                raise coordinator_error(exc, coordinator=self.coordinator, operation="broadcast") from exc
        except BaseException:
            send.stop()
            await send.finish()
            send.error()  # retrieved: the round's own error is the one that matters
            raise
        await send.finish()
        return sync_result_of(result, send)

    async def _attempt_broadcast(self, stub, request, prepared: Prepared, send: LaneSends) -> coordinator_pb2.BroadcastResult:
        """One attempt. A coordinator that answers PLAN_UNKNOWN to a plan named by id
        (it restarted, or forgot the plan) ran nothing: the same key with the whole plan
        is the same request, sent at once, not a retry."""
        while True:
            try:
                return await self._follow_round(stub, request, prepared, send)
            except grpc.aio.AioRpcError as exc:
                if not (isinstance(from_rpc_error(exc), PlanUnknown) and is_reference(request.plan)):
                    raise
            self._plans_sent.discard(prepared.plan.plan_id)
            await self._in_thread(request.plan.CopyFrom, prepared.plan.to_proto())

    async def _follow_round(self, stub, request, prepared: Prepared, send: LaneSends) -> coordinator_pb2.BroadcastResult:
        """One Broadcast call, followed to its result: the rendezvous starts the send, an
        engine's failure stops it."""
        left = deadline.remaining()
        request.timeout_s = max(0.001, left - 1.0) if left is not None else 0.0
        result = None
        async for event in stub.Broadcast(request, timeout=left):  # read to the end: the status too
            self._plans_sent.add(prepared.plan.plan_id)  # validated: the coordinator holds it
            which = event.WhichOneof("event")
            if which == "rendezvous" and is_relayed(event.rendezvous):
                lanes = send.relayed.setdefault(event.rendezvous.relayed_by, [])
                if all(r.session_id != event.rendezvous.session_id for r in lanes):
                    lanes.append(event.rendezvous)
            elif which == "rendezvous" and event.rendezvous.session_id not in send.lanes:
                send.lanes[event.rendezvous.session_id] = self._start_send(event.rendezvous, prepared)
            elif which == "engine_failed":
                # Stop sending to that engine's lane, which cannot complete; other lanes go on.
                send.stop(event.engine_failed.engine_id or None)
            elif which == "result":
                result = event.result
        if result is None:
            raise TransferError("broadcast stream ended without a result")
        return result

    @property
    def stores(self) -> RoundStores:
        """The rendezvous stores of this client's rounds (``client/round_stores.py``)."""
        if self._stores is None:
            self._stores = RoundStores(self.host, timeout_s=self.default_timeout_s,
                                       given=self.round_senders.store_host())
        return self._stores

    def _start_send(self, rendezvous, prepared: Prepared) -> Lane:
        """Starts one lane's send on the send pool (lanes run concurrently). Each lane has
        its own sender (its own group, buffers and store connection), kept for the next
        round while the lane's name stays. A sharded trainer's lane of another rank is
        that rank's to send."""
        if rendezvous.sender != 0:
            return self.round_senders.remote_send(rendezvous, prepared)
        deadline_at = time.monotonic() + (deadline.remaining(self.default_timeout_s) or 0.0)
        kind, abort = rendezvous.transport, threading.Event()
        plan = prepared.owners.part_plan(0) if prepared.owners is not None else prepared.plan

        def send():
            sender = self._senders.get((kind, rendezvous.lane))
            if sender is None:
                store = self.stores.sender_store(kind)
                sender = self._senders[(kind, rendezvous.lane)] = transports.make_sender(kind, store,
                                                                                        data_host=self.host)
            with torch.no_grad():  # sources are the caller's tensors, not detached copies
                return sender.send(rendezvous, plan, prepared.sources, deadline_at=deadline_at, abort=abort)

        return Lane(rendezvous, run_in(self._send_pool, send), abort)

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]], with_digest: bool,
                 attest: AttestArg = None, *, addresses: bool = False) -> Prepared:
        """Worker thread: this step's tensors, plan, digest and probe (``round_senders``)."""
        return self.round_senders.prepare(named_tensors, with_digest, attest, addresses=addresses,
                                          bucket_bytes=self.bucket_bytes, wire_dtype=self.wire_dtype)

    # ----- the whole sync -----------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                             transport: str | None = None, mode: str = "keep", offload_kv: bool = False,
                             timeout_s: float | None = None, verify_digest: bool = False,
                             required_engines: Iterable[str] = (), attest: AttestArg = None,
                             key: str | None = None, min_engines: int | None = None) -> SyncResult:
        """Pause -> Broadcast -> Resume. Returns the broadcast's SyncResult with timings.

        Which engines take part: every registered engine that is available and pauses.
        The others are left out -- in ``SyncResult.skipped``, each with why, and named
        in a warning log line -- and are fenced until they catch up. ``SyncResult.ok``
        means every engine that took part now serves ``version``; it says nothing of
        the skipped ones. To make a partial sync a failure instead:
        ``required_engines`` (these ids must take part) and ``min_engines`` (at least
        this many must). Either one unmet raises ``EngineUnavailable`` before any byte
        moves, and the engines that paused are resumed.

        ``key``: the idempotency key of this logical sync (default: a new one). Called
        again with the same key, weights, version and mode -- after a cancelled call, or
        from a trainer restarted after a SIGKILL, wherever the first call stopped -- it
        ends with every available engine at ``version``, or returns (raises) the first
        call's outcome if that call had finished; a transfer that completed never runs
        again. The coordinator keeps the sync's attempts under the key
        (``docs/round-in-detail.md``, "One logical sync").

        ``attest`` (see ``broadcast``): engines prove they compute with the new weights
        before they resume; one that does not stays paused and torn, and this raises
        ``EngineOutputMismatch``.

        Do not modify the tensors until this returns: they are read on the worker thread.
        """
        return await WholeSync(self).run(named_tensors, version=version, transport=transport, mode=mode,
                                         offload_kv=offload_kv, timeout_s=timeout_s, verify_digest=verify_digest,
                                         required_engines=required_engines, attest=attest, key=key,
                                         min_engines=min_engines)

    async def get_state(self, *, include_digests: bool = False) -> coordinator_pb2.GetStateResponse:
        """The coordinator's view: weight version, engines, the current round."""
        stub = self._ready()

        async def attempt(left):
            return await stub.GetState(coordinator_pb2.GetStateRequest(include_digests=include_digests),
                                       timeout=left if left is not None else 60.0)
        return await call_with_retry(self.retry, attempt, operation="get_state", coordinator=self.coordinator)

    async def check_engines(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                            digest: str = "", version: int | None = None, engines: int | None = None,
                            engine_ids: Collection[str] | None = None, within_s: float = 60.0) -> WeightsCheck:
        """Whether every engine holds exactly the trainer's weights, bitwise: give the
        tensors as sent (``named_tensors``; hashed off the event loop, cast to this
        client's ``wire_dtype`` as the send does) or their ``digest``; ``version`` also
        asks that each engine be at that weight version, ``engines`` that that many be
        registered, ``engine_ids`` that only those be checked (say, the engines a round
        reported synced). An engine the coordinator could not read is asked again until
        ``within_s`` has passed, then reported as unread, not as different; an engine
        that gives no digest at all (SGLang, a vLLM on its boot weights) says why and
        is not asked again (``WeightsCheck.unread`` / ``.withheld`` / ``.different`` /
        ``.ok`` / ``.describe()``)."""
        if (named_tensors is None) == (not digest):
            raise InvalidArgument("check_engines takes the tensors or their digest, one of the two")
        validate_request(engines=engines, engine_ids=engine_ids, within_s=within_s)
        if named_tensors is not None:
            digest = await asyncio.to_thread(trainer_digest, named_tensors, self.wire_dtype)
        return await check_engines(lambda: self.get_state(include_digests=True), digest, version=version,
                                   engines=engines, engine_ids=engine_ids, within_s=within_s)


__all__ = ["TrainerClient", "SyncResult", "EngineResult", "SyncFailed", "PAUSE_MODES"]
