"""Export: an agent sends its engine's weights to a lagging peer (catch-up).

The coordinator (``server/coordinator/catch_up.py``) asks a ready engine's agent to ``Export`` the
fleet's version. The agent checks that its engine holds exactly that version and is
ready, takes the engine's live weight tensors (``EngineAdapter.export_weights``; an
engine that cannot export refuses), plans them like a trainer, hosts an authenticated
store with a fresh secret on its own host, streams ``ExportReady`` (the plan and the
rendezvous), and sends as a trainer's rank 0 would; the lagging peer receives through
its usual ``Receive``. The source keeps serving meanwhile: sending only reads its
weights, and no round can change them while a catch-up holds the coordinator's round
lock (the agent also refuses a ``Receive`` while it exports).

Blocking work (planning, the store, the send) runs on the exporter's own thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from weightsync import transport as transports
from weightsync.cancellation import wait_through_cancellation
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from weightsync.threads import run_in
from weightsync.transport.base import Sender, TransferStats
from weightsync.transport.secure_store import StoreHost
from weightsync.v1 import agent_pb2, common_pb2
from weightsync.validate import check_timeout

if TYPE_CHECKING:
    from weightsync.server.agent.engine_ledger import EngineCommands
    from weightsync.server.agent.fence import VersionFence

log = logging.getLogger("weightsync.agent")
EXPORT_TRANSPORTS = (common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM)
DEFAULT_EXPORT_TIMEOUT_S = 300.0
SOURCE_NOT_READY = "SOURCE_NOT_READY"


class WeightExporter:
    """One agent's exports, one at a time."""

    def __init__(self, control: EngineCommands, fence: VersionFence) -> None:
        self.control = control
        self.fence = fence
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightsync-export")
        self._store: StoreHost | None = None
        self._senders: dict[int, Sender] = {}
        self._plan: tuple[tuple, BucketPlan] | None = None  # (names, dtypes, shapes, bucket bytes) -> plan
        self._abort = threading.Event()
        self.running = False
        self._idle = asyncio.Event()  # set while no export runs
        self._idle.set()

    async def wait_ended(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a running export to end; whether none runs now.
        A round meets one only as it ends: a catch-up holds the coordinator's round lock,
        and one the coordinator gave up on stops sending a moment after it let go."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return not self.running

    def _check(self, request: agent_pb2.ExportRequest) -> None:
        control = self.control
        check_timeout(request.timeout_s)
        if request.rendezvous.transport not in EXPORT_TRANSPORTS:
            raise InvalidArgument("a catch-up exports over gloo or shm")
        if not request.rendezvous.group_id or not request.rendezvous.session_id:
            raise InvalidArgument("an export needs the rendezvous' group_id and session_id")
        if not control.adapter.can_export_weights:
            raise FailedPrecondition(f"{control.adapter.name} engines cannot export their weights",
                                     reason="EXPORT_UNSUPPORTED")
        if self.running:
            raise FailedPrecondition("an export is already running on this engine", reason=SOURCE_NOT_READY)
        why = self.fence.not_ready_reason()
        served = control.watch.current().weight_version
        if why or served != request.version:
            raise FailedPrecondition(f"engine {control.engine_id} cannot be a catch-up source for version "
                                     f"{request.version}: {why or f'it holds version {served}'}",
                                     reason=SOURCE_NOT_READY)

    async def export(self, request: agent_pb2.ExportRequest):
        """The Export stream: ``ready`` (plan and rendezvous), then ``result``."""
        self._check(request)
        self.running = True
        self._idle.clear()
        try:
            named = await self.control.run_on_engine(self.control.adapter.export_weights)
            plan, sources = await run_in(self._executor, self._prepare, named,
                                         request.bucket_bytes or DEFAULT_BUCKET_BYTES)
            rendezvous = await run_in(self._executor, self._rendezvous, request.rendezvous)
            self.control.record("export_started", version=request.version, group=rendezvous.group_id,
                             transport=transports.KIND_NAMES[rendezvous.transport], bytes=plan.total_bytes)
            yield agent_pb2.ExportResponse(ready=agent_pb2.ExportReady(plan=plan.to_proto(), rendezvous=rendezvous))
            deadline_at = time.monotonic() + (request.timeout_s or DEFAULT_EXPORT_TIMEOUT_S)
            self._abort.clear()
            sending = run_in(self._executor, self._send, rendezvous, plan, sources, deadline_at)
            try:
                await asyncio.shield(sending)
            except asyncio.CancelledError:  # the coordinator gave up: stop sending, let it end, then end
                self._abort.set()
                await wait_through_cancellation(sending)
                if not sending.cancelled() and sending.exception() is not None:
                    self.control.record("export_failed", version=request.version, error="cancelled by the coordinator")
                raise
            except Exception:
                pass  # the send's own error, read below
            if sending.exception() is not None:
                self.control.record("export_failed", version=request.version, error=repr(sending.exception()))
                raise sending.exception()
            stats = sending.result()
            self.control.record("export_done", version=request.version, seconds=f"{stats.seconds:.4f}")
            yield agent_pb2.ExportResponse(result=common_pb2.EngineOutcome(
                engine_id=self.control.engine_id, ok=True, weight_version=request.version, bytes=stats.bytes,
                seconds=stats.seconds))
        finally:
            self.running = False
            self._idle.set()

    def _prepare(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int):
        """Exporter thread: the plan (kept while names, dtypes and shapes stay) and the
        tensors to send, contiguous."""
        key = (tuple(n for n, _ in named), tuple(t.dtype for _, t in named), tuple(tuple(t.shape) for _, t in named),
               bucket_bytes)
        if self._plan is None or self._plan[0] != key:
            plan = BucketPlan.build(((n, t.dtype, t.shape) for n, t in named), bucket_bytes=bucket_bytes)
            self._plan = (key, plan)
        return self._plan[1], [t.contiguous() for _, t in named]

    def _rendezvous(self, asked: common_pb2.Rendezvous) -> common_pb2.Rendezvous:
        """Exporter thread: the coordinator's rendezvous with this agent's store (hosted
        on first use, on the host the agent serves on) and a fresh secret."""
        if self._store is None:
            host = self.control.data_host
            self._store = StoreHost(host, timeout_s=DEFAULT_EXPORT_TIMEOUT_S)
        rendezvous = common_pb2.Rendezvous()
        rendezvous.CopyFrom(asked)
        rendezvous.store_host, rendezvous.store_port = self._store.host, self._store.port
        rendezvous.store_secret = self._store.new_secret()
        rendezvous.world_size = 2
        return rendezvous

    def _send(self, rendezvous, plan: BucketPlan, sources, deadline_at: float) -> TransferStats:
        sender = self._senders.get(rendezvous.transport)
        if sender is None:
            sender = self._senders[rendezvous.transport] = transports.make_sender(
                rendezvous.transport, self._store.client(), data_host=self.control.data_host)
        with torch.no_grad():
            return sender.send(rendezvous, plan, sources, deadline_at=deadline_at, abort=self._abort)

    def close(self) -> list[BaseException]:
        """Stops the senders and the store; returns what failed."""
        failures: list[BaseException] = []
        self._abort.set()
        for sender in self._senders.values():
            try:
                sender.close()
            except Exception as exc:
                failures.append(exc)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as exc:
                failures.append(exc)
        self._executor.shutdown(wait=False, cancel_futures=True)
        return failures


__all__ = ["WeightExporter", "EXPORT_TRANSPORTS", "SOURCE_NOT_READY"]
