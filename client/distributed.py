"""DistributedTrainerClient: one sync from every rank of a sharded trainer, no gather
unless asked (the ``group`` transport, ``gather=True``).

Every rank of a torch.distributed trainer (FSDP2, or any job whose ranks hold
different pieces of the model) opens the client and calls ``update_weights`` with the
tensors it holds (DTensors or plain tensors), collectively, like a torch.distributed
call. One logical call is one round:

- rank 0 drives it: Pause / Broadcast / Resume under one idempotency key, through a
  ``TrainerClient`` of its own. Its Broadcast carries the plan of the full tensors and
  its owners (``weightsync.sharding``): which rank sends which rows.
- every rank sends its own parts on its own lanes (its own groups, buckets, pipeline),
  at once; engines receive every rank's lane into their full tensors. Every rank's
  lanes are laid out as one trainer's from its own host: with ``auto``, shm to the
  engines on that host and gloo to one relay on every other host with several
  engines, which re-shares the rank's parts over its host's shm (the ranks on one
  host or on several).
- the ranks meet at rank 0's rendezvous store (authenticated; its address and secret
  go to the other ranks once, over the trainer's own process group, at ``start``):
  each rank says what it holds, rank 0 hands each its lanes and part layout, each says
  how its send on each lane ended, and rank 0 publishes the round's end, which every rank returns
  (the same ``SyncResult``) or raises (the same typed error).

Failures end the round for every rank, promptly: a rank that fails or is cancelled
reports it and rank 0 stops every lane; a rank that is killed stops heartbeating
(every 0.25 s during a round) and rank 0 stops its lane's engines within
``RANK_SILENCE_S``; rank 0 going away is a closed store connection on every other
rank. Every wait is bounded by the sync's deadline. Engines whose transfer stopped
are torn and stay paused; the next round heals them.

Attestation (``attest=``): a ``Probe`` the trainer computed before the call, on every
rank at once (its forward pass is a collective: ``Probe.from_model`` called on every
rank); rank 0's goes with the round, and every engine scores it after loading, as for
any trainer. ``verify_digest``: every rank hashes what it holds and the engines hash the
same slices of what they end with (``weightsync/parts_digest.py``). Not supported here
(a typed error): a function in place of the probe (rank 0 alone would call it: a
collective forward there waits forever for the other ranks).

The ``group`` transport (SGLang's update group) has one sender, so a client made with
``transport="group"`` *gathers* first: before the round starts (the engines serve on
meanwhile), every rank sends its parts to rank 0 on a lane of its own (shm from a rank
on rank 0's host, else gloo; followed like a round's lanes: heartbeats, reports,
deadline), received into full tensors rank 0 keeps while the plan stays -- a full copy
of the model in rank 0's host memory -- and rank 0 then runs a plain round with them.
``gather=True`` does the same for the other transports: rank 0's round is then a
single trainer's, with ``auto``'s host relays (one network copy per remote host,
re-shared there over shm), as a sharded ``auto`` round has too.
A gather that fails ends the call on every rank with the same typed error and changes
nothing in any engine. ``verify_digest`` checks the gathered parts against the hashes
each rank took of what it holds, then has the engines check the full tensors' digest.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from weightsync import deadline as deadlines
from weightsync import transport as transports
from weightsync.attest import Probe
from weightsync.cancellation import wait_through_cancellation
from weightsync.client.context import AsyncClient
from weightsync.client.rank_protocol import (
    CLOSE_GRACE_S,
    STOP_GRACE_S,
    RoundKeys,
    error_record,
    first_set,
    result_record,
)
from weightsync.client.rank_sender import RankSender
from weightsync.client.results import SyncResult
from weightsync.client.retry import RetryPolicy
from weightsync.client.sharded_senders import ShardedSenders, refuse_a_function_as_probe
from weightsync.client.trainer import TrainerClient
from weightsync.errors import (
    InvalidArgument,
    StepTimeoutError,
    TransferError,
    WeightSyncError,
)
from weightsync.idempotency import validate_key
from weightsync.parts_digest import combine, parts_digest, sender_hashes
from weightsync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from weightsync.security import Security
from weightsync.sharding import (
    HeldReplay,
    Owners,
    describe,
    description_signature,
    holdings_of,
    sources_for,
)
from weightsync.threads import run_in
from weightsync.transport import AUTO_LAYOUT, LAYOUTS
from weightsync.transport.base import Receiver
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses
from weightsync.transport.from_senders import SenderLane, part_targets, receive_from_senders
from weightsync.transport.secure_store import SecureStore, StoreHost
from weightsync.v1 import common_pb2

_START_TIMEOUT_S = 60.0


class _FirstFailure:
    """``is_set()`` once the caller cancelled or a rank's follower failed (the abort of a
    gather's receive); ``first()``: that follower's error."""

    def __init__(self, cancel: threading.Event, followers: list[futures.Future]) -> None:
        self.cancel, self.followers = cancel, followers
        self._first: BaseException | None = None

    def is_set(self) -> bool:
        return self.cancel.is_set() or self.first() is not None

    def first(self) -> BaseException | None:
        if self._first is None:
            self._first = next((f.exception() for f in self.followers if f.done() and f.exception() is not None),
                               None)
        return self._first


class DistributedTrainerClient(AsyncClient):
    """The trainer client of a sharded trainer; every rank of ``group`` opens one.

    Args:
        coordinator: ``HOST:PORT`` of the coordinator.
        group: the trainer's torch.distributed process group (default: the world).
            Used once, at ``start``, to share rank 0's store address; never during a
            round.
        transport: ``"auto"`` (each rank: shm to the engines on its host and a relay
            on every other host with several engines), ``"gloo"``, ``"shm"``, or
            ``"group"`` (one sender, for SGLang: the
            ranks' parts are gathered into rank 0 first; see the module's docstring).
        gather: gather the ranks' parts into rank 0 before each round, which then
            sends the full tensors as one trainer does (default: only for
            ``"group"``, which needs it). With ``"auto"``: shm to the engines on rank
            0's host and a relay on every other host with several engines, as a
            sharded ``auto`` round does without gathering; it
            costs a full copy of the model in rank 0's host memory and the gather's
            time. Give every rank the same.
        host: address engines (and the other ranks) reach this rank at: its end of
            each lane listens there; rank 0's rendezvous store too.
        bucket_bytes, wire_dtype, default_timeout_s, resume_grace_s, retry, security,
            group_layout: as for ``TrainerClient`` (``group_layout``: the group
            transport's, rank 0's round after the gather).
    """

    def __init__(self, coordinator: str, *, group: dist.ProcessGroup | None = None, transport: str = "auto",
                 host: str = "127.0.0.1", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: torch.dtype | None = None, default_timeout_s: float = 300.0,
                 resume_grace_s: float = 30.0, retry: RetryPolicy | None = None,
                 security: Security | None = None, group_layout: str = AUTO_LAYOUT,
                 gather: bool | None = None) -> None:
        if not dist.is_initialized():
            raise InvalidArgument("DistributedTrainerClient needs torch.distributed initialised on every rank")
        kind = transports.kind_from_name(transport)
        if kind not in (common_pb2.TRANSPORT_KIND_AUTO, common_pb2.TRANSPORT_KIND_GLOO,
                        common_pb2.TRANSPORT_KIND_SHM, common_pb2.TRANSPORT_KIND_GROUP):
            raise InvalidArgument("a sharded trainer sends over auto, gloo, shm or group")
        if group_layout not in (AUTO_LAYOUT, *LAYOUTS):
            raise InvalidArgument(f"group_layout must be one of {(AUTO_LAYOUT, *LAYOUTS)}, got {group_layout!r}")
        if gather is not None and not isinstance(gather, bool):
            raise InvalidArgument(f"gather must be True, False or None, got {gather!r}")
        # The group transport has one sender (SGLang's update group): the ranks' parts are
        # gathered into rank 0 first, which then sends the full tensors.
        if gather is False and kind == common_pb2.TRANSPORT_KIND_GROUP:
            raise InvalidArgument("the group transport has one sender: a sharded trainer gathers its parts into "
                                  "rank 0 for it (gather=False cannot be)")
        self.gathers = kind == common_pb2.TRANSPORT_KIND_GROUP if gather is None else gather
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.coordinator, self.host, self.transport = coordinator, host, transport
        self.wire_dtype = wire_dtype
        self.default_timeout_s, self.resume_grace_s = default_timeout_s, resume_grace_s
        self.session = ""
        # Rank 0: the client that drives the rounds, given this group's senders, and
        # the store every rank meets at (hosted at start).
        self._client: TrainerClient | None = None
        self._senders: ShardedSenders | None = None
        self._store: StoreHost | None = None
        if self.rank == 0:
            self._senders = ShardedSenders(self, bucket_bytes=bucket_bytes, wire_dtype=wire_dtype,
                                           default_timeout_s=default_timeout_s)
            self._client = TrainerClient(coordinator, transport=transport, host=host, bucket_bytes=bucket_bytes,
                                         wire_dtype=wire_dtype, default_timeout_s=default_timeout_s,
                                         resume_grace_s=resume_grace_s, retry=retry, security=security,
                                         group_layout=group_layout, round_senders=self._senders)
        self._rank_sender: RankSender | None = None  # ranks > 0: their side of every round
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightsync-rank")
        self.held = HeldReplay()  # this rank's holdings, replayed from round to round
        self._round = 0
        self._forgotten = 0  # rank 0: rounds whose store keys are gone
        self._closed = False
        # Rank 0 of a gathering client: its receivers of the other ranks' lanes (kept
        # while their groups stay good), the epoch of those groups, and the full tensors
        # the parts are gathered into (kept while the plan stays).
        self._gather_receivers: dict[tuple[int, int], Receiver] = {}
        self._gather_epoch = 0
        self._gathered: tuple[BucketPlan, list[torch.Tensor]] | None = None

    @property
    def rank_sender(self) -> RankSender | None:
        """Ranks > 0, once started: this rank's side of every round."""
        return self._rank_sender

    # ----- lifecycle --------------------------------------------------------------------

    async def start(self) -> DistributedTrainerClient:
        """Collective: every rank calls it. Rank 0 opens its client and store; the others
        learn where it is (over ``group``) and connect."""
        if self._client is not None:
            await self._client.start()
            host = self._store = await run_in(self._thread, lambda: StoreHost(self.host,
                                                                              timeout_s=self.default_timeout_s))
            self._senders.use_store(host)
            info = [host.host, host.port, host.owner_secret, uuid.uuid4().hex[:12]]
        else:
            info = [None, None, None, None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        await run_in(self._thread, dist.broadcast_object_list, info, src=src, group=self.group)
        store_host, port, secret, self.session = info
        if self._client is None:
            store = await run_in(self._thread, lambda: SecureStore(
                store_host, port, secret, deadline_at=time.monotonic() + _START_TIMEOUT_S,
                timeout_s=self.default_timeout_s))
            self._rank_sender = RankSender(store, rank=self.rank, session=self.session, host=self.host,
                                           wire_dtype=self.wire_dtype, resume_grace_s=self.resume_grace_s,
                                           hold=self.hold)
        return self

    async def aclose(self) -> None:
        """Releases this rank's senders, store connection, threads (rank 0: its client)."""
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            if self._rank_sender is not None:
                self._rank_sender.close()
            self._close_gather_receivers()
            self._gathered = None
            self.held.forget()  # the tensors last replayed, and the lists made of them
            if self._senders is not None:
                self._senders.forget()
        try:
            if self._store is not None and self._round:
                await run_in(self._thread, self._wait_until_read)
            await run_in(self._thread, close)
        finally:
            self._thread.shutdown(wait=False)
            if self._rank_sender is not None:
                self._rank_sender.shutdown_threads()
            if self._senders is not None:
                self._senders.close()
            if self._client is not None:
                await self._client.aclose()  # and the store it was given

    def _wait_until_read(self) -> None:
        """Rank 0, closing: the other ranks read the last round's end from its store
        before it goes (bounded: a rank that died never will)."""
        prefix, store = RoundKeys.of(self.session, self._round).prefix, self._store
        until = time.monotonic() + CLOSE_GRACE_S
        while time.monotonic() < until and store.get(RoundKeys(prefix).result) is not None:
            if all(store.get(RoundKeys(prefix).read(r)) is not None for r in range(1, self.world_size)):
                return
            time.sleep(0.01)

    # ----- the round ----------------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                             key: str | None = None, timeout_s: float | None = None, mode: str = "keep",
                             offload_kv: bool = False, required_engines: Iterable[str] = (),
                             attest: Probe | None = None, verify_digest: bool = False) -> SyncResult:
        """Collective: every rank calls it with what it holds (DTensors or plain tensors;
        the same names across ranks). Returns the round's SyncResult on every rank, or
        raises the same typed error on every rank (a rank that was cancelled raises
        ``CancelledError`` once the round has ended).

        ``key``: the idempotency key of this sync; give every rank the same one, or none
        (rank 0 makes one). A retried call with the same key never re-runs a transfer.
        ``attest``: a ``Probe`` of the trainer's model, computed before the call on
        every rank (collectively); rank 0's is used, the others may pass theirs or None.
        Engines then prove they compute with the new weights, as in
        ``TrainerClient.broadcast``.
        ``verify_digest``: give every rank the same. Every rank hashes what it holds,
        rank 0 combines the hashes of the parts each rank sends
        (``weightsync/parts_digest.py``), and each engine, before the version is
        committed, hashes the same slices of the tensors it ended with: a part that
        landed torn, stale or in the wrong place fails the round
        (``TransferError``), as ``TrainerClient``'s ``verify_digest`` does.
        Do not modify the tensors until this returns.
        """
        if self._closed or (self._client is None and self._rank_sender is None):
            raise RuntimeError("DistributedTrainerClient is not started")
        self._round += 1
        prefix = RoundKeys.of(self.session, self._round).prefix
        budget = timeout_s if timeout_s is not None else self.default_timeout_s
        if self._client is not None:
            return await self._drive(prefix, named_tensors, version=version, key=key, timeout_s=budget, mode=mode,
                                     offload_kv=offload_kv, required_engines=required_engines, attest=attest,
                                     verify_digest=verify_digest)
        cancel = threading.Event()
        work = run_in(self._thread, self._rank_sender.take_part, prefix, named_tensors, budget, cancel, verify_digest)
        # A cancel stops this rank's send; rank 0 then ends the round for everyone, and
        # this returns once it has.
        if await wait_through_cancellation(work, on_cancel=cancel.set):
            raise asyncio.CancelledError("update_weights cancelled") from work.exception()
        return work.result()

    async def _drive(self, prefix: str, named_tensors, *, version, key, timeout_s, mode, offload_kv,
                     required_engines, attest, verify_digest) -> SyncResult:
        """Rank 0: the round, then its end published for the other ranks."""
        self._senders.begin_round(prefix)
        store = self._store
        try:
            if self.gathers:
                refuse_a_function_as_probe(attest)
                deadline_at = time.monotonic() + timeout_s
                with deadlines.scope(timeout_s, operation="gather"):
                    cancel = threading.Event()
                    work = run_in(self._thread, self._gather, named_tensors, cancel, verify_digest)
                    if await wait_through_cancellation(work, on_cancel=cancel.set):
                        raise asyncio.CancelledError("update_weights cancelled") from work.exception()
                named_tensors = work.result()
                timeout_s = max(0.001, deadline_at - time.monotonic())
            result = await self._client.update_weights(named_tensors, version=version,
                                                       key=key and validate_key(key), timeout_s=timeout_s,
                                                       mode=mode, offload_kv=offload_kv,
                                                       required_engines=required_engines, attest=attest,
                                                 verify_digest=verify_digest)
        except BaseException as exc:
            record = {"error": error_record(exc)}
            result_of = getattr(exc, "result", None)
            if isinstance(result_of, SyncResult):
                record["result"] = result_record(result_of)
            store.set(RoundKeys(prefix).result, json.dumps(record))
            raise
        store.set(RoundKeys(prefix).result, json.dumps({"result": result_record(result)}))
        return result

    # ----- rank 0 of a gathering client: every rank's parts into full tensors here -------------

    def _gather(self, named_tensors, cancel: threading.Event, verify_digest: bool) -> list[tuple[str, torch.Tensor]]:
        """Rank 0 (its thread), of a gathering client: the full tensors, gathered
        before the round starts (the engines serve on meanwhile, and a gather that fails
        changes nothing in them). Each rank sends its parts on a lane of its own to this
        rank (shm from a rank on this host, else gloo), received into full tensors kept
        here while the plan stays; this rank's own parts are copied in. With
        ``verify_digest``, the parts gathered are checked against the hashes each rank
        took of what it holds (``weightsync/parts_digest.py``) before anything is sent."""
        senders = self._senders
        plan, owners, hashes = senders.assigned(named_tensors, verify_digest)
        if self._gathered is None or self._gathered[0] is not plan:
            self._gathered = None  # the old ones go before the new ones are made
            full = [torch.empty(shape, dtype=dtype) for dtype, shape in zip(plan.dtypes, plan.shapes, strict=True)]
            # Addressed, as an engine's weights are: the part views into them are made
            # once and kept with them, and shm's lanes read straight into them.
            self._gathered = (plan, AddressedTensors(full, tensor_addresses(full, plan.dtypes, plan.sizes),
                                                     plan.sizes))
        targets = self._gathered[1]
        if 0 in owners.sender_ranks:
            views = owners.part_views(0, targets)
            with torch.no_grad():
                for i, source in enumerate(sources_for(owners, 0, senders.holdings)):
                    views[i].copy_(source)
                    views.done(i)
        others = [s for s in owners.sender_ranks if s != 0]
        if others:
            self._receive_parts(owners, others, targets, cancel)
        if verify_digest:
            sent = combine(plan, owners, {s: sender_hashes(owners, s, hashes[s]) for s in owners.sender_ranks})
            if parts_digest(plan, owners, zip(plan.names, targets, strict=True)) != sent:
                raise TransferError("the parts gathered into trainer rank 0 differ from what the ranks hold (their "
                                    "hashes): nothing was sent to the engines")
        return list(zip(plan.names, targets, strict=True))

    def _receive_parts(self, owners: Owners, senders: list[int], targets: list[torch.Tensor],
                       cancel: threading.Event) -> None:
        """Every rank in ``senders`` sends its parts to this rank, each on its own lane, at
        once; each lane is followed as a round's lane is (the rank's heartbeat, its
        report). The first failure stops the others; all end before this returns or
        raises (bounded by the deadline)."""
        rank0, store = self._senders, self._store
        here = rank0.rank_hosts[0]
        lanes, aborts = [], []
        for s in senders:
            kind = common_pb2.TRANSPORT_KIND_SHM if rank0.rank_hosts.get(s) == here else \
                common_pb2.TRANSPORT_KIND_GLOO
            rendezvous = common_pb2.Rendezvous(
                group_id=f"ws-gather-{self.session}-{s}-{self._gather_epoch}", transport=kind, store_host=store.host,
                store_port=store.port, world_size=2, session_id=f"{self.session}-{self._round}",
                store_secret=store.owner_secret, lane=f"gather/sender{s}", engine_ids=["trainer-rank-0"], sender=s)
            receiver = self._gather_receivers.get((kind, s))
            if receiver is None:
                receiver = self._gather_receivers[(kind, s)] = transports.make_receiver(kind, data_host=self.host)
            lanes.append(SenderLane(rendezvous, owners.part_plan(s), receiver, s))
            aborts.append(threading.Event())
        deadline_at = time.monotonic() + (deadlines.remaining(self.default_timeout_s) or 0.0)
        with ThreadPoolExecutor(len(lanes), thread_name_prefix="weightsync-gather-follow") as pool:
            followers = [pool.submit(rank0.follow_rank(lane.rendezvous, owners, abort))
                         for lane, abort in zip(lanes, aborts, strict=True)]
            failed = _FirstFailure(cancel, followers)  # a rank that failed or went silent stops every lane
            try:
                receive_from_senders(lanes, 1, part_targets(owners, targets), deadline_at=deadline_at, abort=failed)
                for follower in followers:  # each rank says its send ended
                    follower.result(timeout=max(0.0, deadline_at - time.monotonic()) + STOP_GRACE_S)
            except BaseException as exc:
                # A rank's own account (it failed, was cancelled, went silent) says more
                # than the lane that saw its sender stop: its report is given a moment
                # to arrive, before the stop from here makes every rank report one.
                futures.wait(followers, timeout=1.0, return_when=futures.FIRST_EXCEPTION)
                first = failed.first()
                for abort in aborts:  # the ranks still sending stop
                    abort.set()
                futures.wait(followers, timeout=STOP_GRACE_S + 1.0)
                if first is None or isinstance(exc, StepTimeoutError):  # a deadline is the deadline
                    first = exc
                self._gather_epoch += 1  # the groups may be broken: the next gather makes new ones
                self._close_gather_receivers()
                if cancel.is_set():
                    raise TransferError("the gather into trainer rank 0 was cancelled") from exc
                if isinstance(first, WeightSyncError):
                    raise first from exc if first is not exc else None
                raise TransferError(f"the gather into trainer rank 0 failed: {first}") from exc

    def _close_gather_receivers(self) -> None:
        for receiver in self._gather_receivers.values():
            receiver.close()
        self._gather_receivers.clear()

    def forget_rounds_before(self, prefix: str) -> None:
        """Rank 0: drops the store keys of every round before this one."""
        for n in range(self._forgotten + 1, self._round):
            self._store.forget(RoundKeys.of(self.session, n).prefix + "/")
        self._forgotten = self._round - 1

    async def get_state(self, *, include_digests: bool = False):
        """The coordinator's view (rank 0 only: it holds the client that drives rounds)."""
        if self._client is None:
            raise InvalidArgument("get_state is asked on rank 0 (it drives the rounds)")
        return await self._client.get_state(include_digests=include_digests)

    async def check_engines(self, *, digest: str, version: int | None = None, engines: int | None = None,
                            engine_ids=None, within_s: float = 60.0):
        """Rank 0: ``TrainerClient.check_engines`` against the digest of the full,
        unsharded weights (which only a collective can gather: the caller's)."""
        if self._client is None:
            raise InvalidArgument("check_engines is asked on rank 0 (it drives the rounds)")
        return await self._client.check_engines(digest=digest, version=version, engines=engines,
                                                engine_ids=engine_ids, within_s=within_s)

    def hold(self, named_tensors) -> HeldReplay:
        """This rank's holdings for a round (``held``): last round's, replayed where the
        tensors are the same ones (``HeldReplay``), else worked out again.

        Raises:
            InvalidArgument: not (name, tensor) pairs, a name twice, a layout a sharded
                send cannot take (``holding_of``).
        """
        try:
            pairs = self.held.replay_or_read(iter(named_tensors))  # None: last round's stand
        except TypeError:
            raise InvalidArgument("named_tensors must be (name, torch.Tensor) pairs") from None
        if pairs is not None:
            holdings = holdings_of(pairs)
            described = describe(holdings.values())
            self.held.remember(pairs, holdings, described, description_signature(described))
        return self.held

    def wait_key(self, key: str, *, operation: str, deadline_at: float | None = None) -> bytes:
        """Rank 0: waits (in this process) for a key another rank sets."""
        host = self._store
        local = host.client()
        left = deadlines.remaining(self.default_timeout_s)
        until = deadline_at if deadline_at is not None else time.monotonic() + (left or 0.0)
        while True:
            if first_set(local, [key], until) is not None:
                return host.get(key)
            if time.monotonic() >= until:
                raise StepTimeoutError(f"deadline exceeded waiting for {operation}", operation="broadcast")

__all__ = ["DistributedTrainerClient"]
