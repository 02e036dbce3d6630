"""group transport: tensor by tensor over a torch.distributed group (SGLang's protocol).

This is the wire protocol of SGLang's weight update group
(``/init_weights_update_group`` + ``/update_weights_from_distributed``), which RL
frameworks speak from their trainers: the trainer is rank 0 of a group that the
engines join by rendezvous at ``tcp://store_host:store_port`` (the trainer's
TCPStore), and every tensor of the plan, in plan order, is one broadcast from rank
0 in the plan's dtype and shape. Backend ``gloo`` moves CPU tensors, ``nccl`` CUDA
tensors. weightsync's own receivers (the reference engine's agent) speak it too, so
one Broadcast can feed SGLang engines and others together.

Key layout. The engines build their group with torch's group helper, under a
``PrefixStore(group_name)`` of the rendezvous store (SGLang's
``init_custom_process_group``); the helper keys the backend's rendezvous under
``<group_name>/`` and then ``<device>/`` (``cpu/`` for gloo, ``cuda/`` for nccl). This
module builds the backend directly under the same keys, so its groups are never
registered in torch's global group table and a retired group never blocks a name.

Failure handling is the gloo transport's: waits poll, peers' failure keys in the
store stop them at once, and a failed group is retired on a daemon thread. With
nccl, torch builds NCCL's communicator inside the group's first collective, and that
call blocks, with no deadline, until every rank has built it: a peer that died before
its first receive would hold the transfer thread for good. So ``open_group`` builds
it at once (``eager_connect_single_device``) on the join's side thread, where the
round's deadline and the peers' failure keys bound the wait. The group's GPU is the
trainer's tensors' (``cuda.tensors_device``) on rank 0, the receive thread's current
device elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from weightsync.errors import FailedPrecondition, InvalidArgument, TransferError
from weightsync.transport.base import Receiver, Sender, TransferStats, nothing_written
from weightsync.transport.collective import (
    broadcast_from_root,
    join_in_background,
    retire,
    wait_polling,
)
from weightsync.transport.cuda import tensors_device
from weightsync.transport.flattened import (
    FLATTENED,
    LAYOUTS,
    TENSORS,
    Staging,
    byte_flat,
    copy_all,
    flattened_calls,
)
from weightsync.transport.gloo import gloo_options
from weightsync.transport.memory_runs import call_view
from weightsync.transport.store import connect_store, session_key
from weightsync.v1 import common_pb2

BACKENDS = ("gloo", "nccl")
# Tensors posted but not yet complete, in bytes: bounds the copies a dtype cast makes
# (and a receiver's staging tensors) without serialising the broadcasts.
IN_FLIGHT_BYTES = 256 * 1024 * 1024


def group_name(rendezvous: common_pb2.Rendezvous) -> str:
    """The group's name: what an engine is told in ``/init_weights_update_group``."""
    return f"weightsync-{rendezvous.group_id}"


def group_backend(rendezvous: common_pb2.Rendezvous) -> str:
    """``gloo`` (the default) or ``nccl``; InvalidArgument for anything else."""
    backend = rendezvous.group_backend or "gloo"
    if backend not in BACKENDS:
        raise InvalidArgument(f"group backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def group_layout(rendezvous: common_pb2.Rendezvous) -> str:
    """``tensors`` (the default: a broadcast per tensor) or ``flattened`` (runs of
    tensors, SGLang's ``flattened_bucket``; ``weightsync.transport.flattened``);
    InvalidArgument for anything else."""
    layout = rendezvous.group_layout or TENSORS
    if layout not in LAYOUTS:
        raise InvalidArgument(f"group layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def open_group(rendezvous: common_pb2.Rendezvous, rank: int, *, watch: dist.Store, deadline_at: float,
               abort: threading.Event, device: torch.device, stop_keys: Sequence[str] = (),
               bind_host: str = "") -> dist.ProcessGroup:
    """Joins the rendezvous' group as ``rank``; returns once every rank has joined.
    With the gloo backend, this side listens on ``bind_host`` (when given; SGLang's own
    side of the group picks its address itself). With nccl, the group's communicator
    is built on ``device`` (the wire's GPU) before it returns.

    The join runs in ``join_in_background``: a peer that failed before joining stops
    the wait at once, and the deadline holds whatever torch does.
    """
    name, world_size, backend = group_name(rendezvous), rendezvous.world_size, group_backend(rendezvous)
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise FailedPrecondition("the nccl group backend needs CUDA and torch's NCCL; use gloo",
                                 reason="TRANSPORT_UNAVAILABLE")
    timeout = timedelta(seconds=max(deadline_at - time.monotonic(), 0.001))

    def build(store: dist.Store) -> dist.ProcessGroup:
        keyed = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", keyed), rank, world_size, options)
            # Here, not inside the first broadcast (module docstring); on the caller's GPU,
            # not this side thread's current one.
            pg.eager_connect_single_device(device)
            return pg
        if not bind_host:
            return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", keyed), rank, world_size, timeout)
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", keyed), rank, world_size,
                                     gloo_options(bind_host, timeout))

    return join_in_background(build, rendezvous, operation=f"{backend} group setup", deadline_at=deadline_at,
                              abort=abort, watch=watch, stop_keys=stop_keys)


class _Joined:
    """A joined group, reused while the rendezvous' group id and backend stay."""

    def __init__(self, rendezvous: common_pb2.Rendezvous, pg: dist.ProcessGroup, timeout_s: float,
                 device: torch.device) -> None:
        self.group_id = rendezvous.group_id
        self.backend = group_backend(rendezvous)
        self.device = device  # the wire's: an nccl group's communicator lives on one GPU
        self.pg = pg
        self.timeout_s = timeout_s  # every op's; retire() waits it out

    def matches(self, rendezvous: common_pb2.Rendezvous, device: torch.device) -> bool:
        return (self.group_id == rendezvous.group_id and self.backend == group_backend(rendezvous)
                and self.device == device)


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _sender_device(backend: str, sources: Sequence[torch.Tensor]) -> torch.device:
    """The trainer's wire device: with nccl the GPU its tensors are on (NCCL's rank 0
    is that GPU), else the CPU."""
    return tensors_device(sources, "trainer's tensors") if backend == "nccl" else torch.device("cpu")


def _fail(store: dist.Store | None, key: str, message: str, joined: _Joined | None) -> None:
    """After a failure: tells the peers (``key`` in the store) and retires the group,
    which is never reused (peers may be mid-op)."""
    if store is not None:
        try:
            store.set(key, message)
        except Exception:
            pass  # the store is gone too: peers find out from their own deadlines
    if joined is not None:
        retire(joined)


class _InFlight:
    """Posted broadcasts not yet waited for, at most ``IN_FLIGHT_BYTES`` of them (the
    oldest is finished first), so that cast copies and staging tensors stay bounded
    without serialising the broadcasts. Each posted broadcast gets a number, in order."""

    def __init__(self, finish: Callable[[dist.Work, object], None]) -> None:
        self._pending: deque[tuple[dist.Work, torch.Tensor, object]] = deque()
        self._bytes = 0
        self._finish = finish
        self._posted = 0
        self._finished = 0

    def add(self, work: dist.Work, tensor: torch.Tensor, item: object = None) -> int:
        """``tensor`` is kept alive until ``work`` is finished; ``item`` goes to ``finish``.
        Returns the broadcast's number."""
        self._pending.append((work, tensor, item))
        self._posted += 1
        self._bytes += tensor.nbytes
        while self._bytes > IN_FLIGHT_BYTES and len(self._pending) > 1:
            self._pop()
        return self._posted

    def finish_through(self, number: int) -> None:
        """Finishes every broadcast up to number ``number`` (0: none)."""
        while self._finished < number:
            self._pop()

    def drain(self) -> None:
        while self._pending:
            self._pop()

    def _pop(self) -> None:
        work, tensor, item = self._pending.popleft()
        self._finish(work, item)
        self._bytes -= tensor.nbytes
        self._finished += 1


def _takes_wire(target: torch.Tensor, dtype: torch.dtype, wire_device: torch.device) -> bool:
    """Whether ``target`` can receive the wire's bytes itself: the plan's dtype,
    contiguous, on the device the backend moves."""
    return target.dtype == dtype and target.is_contiguous() and target.device.type == wire_device.type


class GroupSender(Sender):
    """Rank 0 of a group on the trainer's store."""

    kind = common_pb2.TRANSPORT_KIND_GROUP

    def __init__(self, store: dist.Store, bind_host: str = "") -> None:
        self._store = store
        self._bind_host = bind_host
        self._joined: _Joined | None = None
        self._staging = Staging()  # the flattened layout's two buffers

    def send(self, rendezvous, plan, sources, *, deadline_at, abort):
        start = time.monotonic()
        stop = [session_key(rendezvous, "err", r) for r in range(1, rendezvous.world_size)]
        try:
            backend = group_backend(rendezvous)
            device = _sender_device(backend, sources)
            pg = self._ensure(rendezvous, device, deadline_at, abort, stop)
            in_flight = _InFlight(lambda work, _: wait_polling(work, deadline_at, "broadcast", abort=abort,
                                                        store=self._store, stop_keys=stop))
            if group_layout(rendezvous) == FLATTENED:
                self._send_flattened(pg, plan, sources, device, in_flight, abort)
            else:
                for slot, source in zip(plan.slots, sources, strict=True):
                    if abort.is_set():
                        raise TransferError("send aborted")
                    wire = source.to(device=device, dtype=slot.dtype).contiguous()
                    in_flight.add(broadcast_from_root(pg, wire), wire)
            in_flight.drain()
        except BaseException as exc:
            # our receivers stop waiting for tensors that will never come
            _fail(self._store, session_key(rendezvous, "abort"), str(exc) or type(exc).__name__, self._joined)
            self._joined = None
            self._staging.release()  # the retired group's pending ops may still use the buffers
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _send_flattened(self, pg, plan, sources, device: torch.device, in_flight: _InFlight,
                        abort: threading.Event) -> None:
        """A broadcast per flattened call: a call of one tensor straight from the tensor
        (cast or moved first where the wire needs it), a call of several from where its
        tensors lie end to end if they do, else packed into a staging buffer while the
        previous one is on the wire."""
        calls = flattened_calls(plan)
        self._staging.fit(plan, device)
        for call, (first, end) in enumerate(calls.bounds):
            if abort.is_set():
                raise TransferError("send aborted")
            if end - first == 1:
                wire = byte_flat(sources[first].to(device=device, dtype=plan.dtypes[first]).contiguous())
                in_flight.add(broadcast_from_root(pg, wire), wire)
                continue
            run = call_view(calls, call, sources) if device.type == "cpu" else None
            if run is not None:  # the call's tensors lie end to end in memory: sent from there
                in_flight.add(broadcast_from_root(pg, run), run)
                continue
            slot, views = self._staging.take(calls, call, plan, in_flight.finish_through)
            copy_all(views, sources[first:end])
            buffer = self._staging.buffer(slot, calls.nbytes(call))
            self._staging.used(slot, in_flight.add(broadcast_from_root(pg, buffer), buffer))

    def _ensure(self, rendezvous, device: torch.device, deadline_at: float, abort: threading.Event,
                stop: Sequence[str]) -> dist.ProcessGroup:
        if self._joined is None or not self._joined.matches(rendezvous, device):
            self.close()
            timeout_s = max(deadline_at - time.monotonic(), 0.001)  # open_group's op timeout
            pg = open_group(rendezvous, 0, watch=self._store, deadline_at=deadline_at, abort=abort, stop_keys=stop,
                            bind_host=self._bind_host, device=device)
            self._joined = _Joined(rendezvous, pg, timeout_s, device)
        return self._joined.pg

    def close(self) -> None:
        self._joined = None  # idle group: dropping it is immediate
        self._staging.release()


class GroupReceiver(Receiver):
    """Rank >= 1 of a group: in an agent (CPU targets, gloo) or in vLLM's worker
    (``weightsync.engine.vllm_worker``; CUDA targets with nccl)."""

    kind = common_pb2.TRANSPORT_KIND_GROUP

    def __init__(self, bind_host: str = "") -> None:
        self._bind_host = bind_host
        self._store: tuple[tuple[str, int], dist.Store] | None = None
        self._joined: _Joined | None = None
        self._staging = Staging()  # the flattened layout's two buffers

    def receive(self, rendezvous, rank, plan, targets, *, deadline_at, abort, on_bucket=None):
        start = time.monotonic()
        try:
            wire_device = _device_for(group_backend(rendezvous))
            stop = [session_key(rendezvous, "abort")]
            with nothing_written():
                pg = self._ensure(rendezvous, rank, wire_device, deadline_at, abort, stop)
            store = self._store[1]
            buckets_done = 0

            def progress(last: int) -> None:
                """on_bucket for every bucket whose bytes all landed, tensor ``last`` being
                the last landed (tensors land in plan order)."""
                nonlocal buckets_done
                slot = plan.slots[last]
                done = plan.num_buckets if last == len(plan.slots) - 1 else min(
                    plan.num_buckets, (slot.offset + slot.nbytes) // plan.bucket_bytes)
                while on_bucket is not None and buckets_done < done:
                    on_bucket(buckets_done)
                    buckets_done += 1

            def land(work: dist.Work, item: object) -> None:
                wait_polling(work, deadline_at, "receive", abort=abort, store=store, stop_keys=stop)
                first, end, into, views = item
                if views is not None:  # a flattened call of several tensors, in a staging buffer
                    copy_all([targets[i] for i in range(first, end)], views)
                elif into is not None:  # one tensor, staged
                    targets[first].copy_(into.view(plan.dtypes[first]).view(plan.shapes[first]))
                progress(end - 1)

            in_flight = _InFlight(land)
            if group_layout(rendezvous) == FLATTENED:
                self._receive_flattened(pg, plan, targets, wire_device, in_flight, abort)
            else:
                for index, slot in enumerate(plan.slots):
                    if abort.is_set():
                        raise TransferError("receive aborted")
                    target = targets[index]
                    # Straight into the engine's tensor when it is what the wire carries, where
                    # the backend moves it; else through a staging tensor, copied after.
                    if _takes_wire(target, slot.dtype, wire_device):
                        in_flight.add(broadcast_from_root(pg, target), target, (index, index + 1, None, None))
                    else:
                        into = torch.empty(slot.shape, dtype=slot.dtype, device=wire_device)
                        in_flight.add(broadcast_from_root(pg, into), into, (index, index + 1, byte_flat(into), None))
            in_flight.drain()
        except BaseException as exc:
            # the sender stops at once instead of waiting out its deadline
            _fail(self._store[1] if self._store else None, session_key(rendezvous, "err", rank),
                  f"rank {rank}: {exc}", self._joined)
            self._joined = None
            self._staging.release()  # the retired group's pending ops may still write into them
            raise
        return TransferStats(plan.total_bytes, time.monotonic() - start, plan.num_buckets)

    def _receive_flattened(self, pg, plan, targets, wire_device: torch.device, in_flight: _InFlight,
                           abort: threading.Event) -> None:
        """A broadcast per flattened call: a call of one tensor straight into the target
        where it can take the wire's bytes, a call of several straight into the targets
        where they lie end to end as the call carries them, else into a staging buffer,
        copied out once it has arrived (while the next call arrives in the other)."""
        calls = flattened_calls(plan)
        self._staging.fit(plan, wire_device)
        for call, (first, end) in enumerate(calls.bounds):
            if abort.is_set():
                raise TransferError("receive aborted")
            if end - first == 1:
                target = targets[first]
                if _takes_wire(target, plan.dtypes[first], wire_device):
                    into = byte_flat(target)
                    in_flight.add(broadcast_from_root(pg, into), into, (first, end, None, None))
                else:
                    into = torch.empty(calls.nbytes(call), dtype=torch.uint8, device=wire_device)
                    in_flight.add(broadcast_from_root(pg, into), into, (first, end, into, None))
                continue
            run = call_view(calls, call, targets) if wire_device.type == "cpu" else None
            if run is not None:  # the targets lie end to end as the call carries them: straight in
                in_flight.add(broadcast_from_root(pg, run), run, (first, end, None, None))
                continue
            slot, views = self._staging.take(calls, call, plan, in_flight.finish_through)
            buffer = self._staging.buffer(slot, calls.nbytes(call))
            self._staging.used(slot, in_flight.add(broadcast_from_root(pg, buffer), buffer,
                                                   (first, end, buffer, views)))

    def _ensure(self, rendezvous, rank: int, device: torch.device, deadline_at: float, abort: threading.Event,
                stop: Sequence[str]) -> dist.ProcessGroup:
        if self._joined is not None and self._joined.matches(rendezvous, device):
            return self._joined.pg
        self._joined = None
        where = (rendezvous.store_host, rendezvous.store_port)
        if self._store is None or self._store[0] != where:
            self._store = (where, connect_store(*where, deadline_at=deadline_at, secret=rendezvous.store_secret))
        timeout_s = max(deadline_at - time.monotonic(), 0.001)  # open_group's op timeout
        pg = open_group(rendezvous, rank, watch=self._store[1], deadline_at=deadline_at, abort=abort,
                        bind_host=self._bind_host, stop_keys=stop, device=device)
        self._joined = _Joined(rendezvous, pg, timeout_s, device)
        return pg

    def close(self) -> None:
        self._joined = None
        self._store = None
        self._staging.release()


__all__ = ["GroupSender", "GroupReceiver", "group_name", "group_backend", "group_layout", "open_group", "BACKENDS"]
