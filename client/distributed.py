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
from weightsync.client.lane_sends import MAX_CONCURRENT_LANES
from weightsync.client.rank_protocol import (
    CLOSE_GRACE_S,
    HEARTBEAT_S,
    STOP_GRACE_S,
    RoundKeys,
    acknowledge_read,
    error_record,
    first_set,
    raise_recorded,
    result_from,
    result_record,
)
from weightsync.client.results import SyncResult
from weightsync.client.retry import RetryPolicy
from weightsync.client.sharded_driver import ShardedDriver, refuse_a_function_as_probe
from weightsync.errors import (
    InvalidArgument,
    StepTimeoutError,
    TransferError,
    WeightSyncError,
)
from weightsync.host_identity import host_id
from weightsync.idempotency import validate_key
from weightsync.parts_digest import combine, holding_hashes, parts_digest, sender_hashes
from weightsync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from weightsync.security import Security
from weightsync.sharding import (
    HeldReplay,
    Holding,
    Owners,
    describe,
    description_signature,
    holdings_of,
    sources_for,
)
from weightsync.threads import run_in
from weightsync.transport import AUTO_LAYOUT, LAYOUTS
from weightsync.transport.base import Receiver, Sender
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
        self._driver: ShardedDriver | None = None
        if self.rank == 0:
            self._driver = ShardedDriver(coordinator, self, transport=transport, host=host, bucket_bytes=bucket_bytes,
                                          wire_dtype=wire_dtype, default_timeout_s=default_timeout_s,
                                          resume_grace_s=resume_grace_s, retry=retry, security=security,
                                          group_layout=group_layout)
        self._store: SecureStore | None = None       # ranks > 0: their connection to rank 0's store
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightsync-rank")
        # One thread per lane this rank sends at once (shm to its host, gloo to each relay).
        self._send_threads = ThreadPoolExecutor(MAX_CONCURRENT_LANES, thread_name_prefix="weightsync-rank-send")
        self._senders: dict[tuple[int, str], Sender] = {}
        self._published: str = ""  # signature of the holdings this rank last described
        self.held = HeldReplay()  # this rank's holdings, replayed from round to round
        self._lane_sources: tuple[BucketPlan, dict, list[torch.Tensor]] | None = None  # ranks > 0: (plan, holdings, sources)
        self._round = 0
        self._forgotten = 0  # rank 0: rounds whose store keys are gone
        self._closed = False
        # Rank 0 of a gathering client: its receivers of the other ranks' lanes (kept
        # while their groups stay good), the epoch of those groups, and the full tensors
        # the parts are gathered into (kept while the plan stays).
        self._gather_receivers: dict[tuple[int, int], Receiver] = {}
        self._gather_epoch = 0
        self._gathered: tuple[BucketPlan, list[torch.Tensor]] | None = None

    # ----- lifecycle --------------------------------------------------------------------

    async def start(self) -> DistributedTrainerClient:
        """Collective: every rank calls it. Rank 0 opens its client and store; the others
        learn where it is (over ``group``) and connect."""
        if self._driver is not None:
            await self._driver.start()
            host = await run_in(self._thread, lambda: StoreHost(self.host, timeout_s=self.default_timeout_s))
            self._driver._store_host = host
            info = [host.host, host.port, host.owner_secret, uuid.uuid4().hex[:12]]
        else:
            info = [None, None, None, None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        await run_in(self._thread, dist.broadcast_object_list, info, src=src, group=self.group)
        store_host, port, secret, self.session = info
        if self._driver is None:
            self._store = await run_in(self._thread, lambda: SecureStore(
                store_host, port, secret, deadline_at=time.monotonic() + _START_TIMEOUT_S,
                timeout_s=self.default_timeout_s))
        return self

    async def aclose(self) -> None:
        """Releases this rank's senders, store connection, threads (rank 0: its client)."""
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            for sender in self._senders.values():
                sender.close()
            self._senders.clear()
            self._close_gather_receivers()
            self._gathered = None
            self.held.forget()  # the tensors last replayed, and the lists made of them
            self._lane_sources = None
            if self._driver is not None:
                self._driver._sources, self._driver.holdings = None, {}
            if self._store is not None:
                self._store.close()
        try:
            if self._driver is not None and self._driver._store_host is not None and self._round:
                await run_in(self._thread, self._wait_until_read)
            await run_in(self._thread, close)
        finally:
            self._thread.shutdown(wait=False)
            self._send_threads.shutdown(wait=False)
            if self._driver is not None:
                await self._driver.aclose()

    def _wait_until_read(self) -> None:
        """Rank 0, closing: the other ranks read the last round's end from its store
        before it goes (bounded: a rank that died never will)."""
        prefix, store = RoundKeys.of(self.session, self._round).prefix, self._driver._store_host
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
        if self._closed or (self._driver is None and self._store is None):
            raise RuntimeError("DistributedTrainerClient is not started")
        self._round += 1
        prefix = RoundKeys.of(self.session, self._round).prefix
        budget = timeout_s if timeout_s is not None else self.default_timeout_s
        if self._driver is not None:
            return await self._drive(prefix, named_tensors, version=version, key=key, timeout_s=budget, mode=mode,
                                     offload_kv=offload_kv, required_engines=required_engines, attest=attest,
                                     verify_digest=verify_digest)
        cancel = threading.Event()
        work = run_in(self._thread, self._take_part, prefix, named_tensors, budget, cancel, verify_digest)
        # A cancel stops this rank's send; rank 0 then ends the round for everyone, and
        # this returns once it has.
        if await wait_through_cancellation(work, on_cancel=cancel.set):
            raise asyncio.CancelledError("update_weights cancelled") from work.exception()
        return work.result()

    async def _drive(self, prefix: str, named_tensors, *, version, key, timeout_s, mode, offload_kv,
                     required_engines, attest, verify_digest) -> SyncResult:
        """Rank 0: the round, then its end published for the other ranks."""
        driver = self._driver
        driver.prefix = prefix
        store = driver._store_host
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
            result = await driver.update_weights(named_tensors, version=version, key=key and validate_key(key),
                                                 timeout_s=timeout_s, mode=mode, offload_kv=offload_kv,
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
        driver = self._driver
        plan, owners, hashes = driver.assigned(named_tensors, verify_digest)
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
                for i, source in enumerate(sources_for(owners, 0, driver.holdings)):
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
        driver, store = self._driver, self._driver._store_host
        here = driver.rank_hosts[0]
        lanes, aborts = [], []
        for s in senders:
            kind = common_pb2.TRANSPORT_KIND_SHM if driver.rank_hosts.get(s) == here else \
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
            followers = [pool.submit(driver.follow_rank(lane.rendezvous, owners, abort))
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
            self._driver._store_host.forget(RoundKeys.of(self.session, n).prefix + "/")
        self._forgotten = self._round - 1

    async def get_state(self, *, include_digests: bool = False):
        """The coordinator's view (rank 0 only: it holds the client that drives rounds)."""
        if self._driver is None:
            raise InvalidArgument("get_state is asked on rank 0 (it drives the rounds)")
        return await self._driver.get_state(include_digests=include_digests)

    async def check_engines(self, *, digest: str, version: int | None = None, engines: int | None = None,
                            engine_ids=None, within_s: float = 60.0):
        """Rank 0: ``TrainerClient.check_engines`` against the digest of the full,
        unsharded weights (which only a collective can gather: the caller's)."""
        if self._driver is None:
            raise InvalidArgument("check_engines is asked on rank 0 (it drives the rounds)")
        return await self._driver.check_engines(digest=digest, version=version, engines=engines,
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
        host = self._driver._store_host
        local = host.client()
        left = deadlines.remaining(self.default_timeout_s)
        until = deadline_at if deadline_at is not None else time.monotonic() + (left or 0.0)
        while True:
            if first_set(local, [key], until) is not None:
                return host.get(key)
            if time.monotonic() >= until:
                raise StepTimeoutError(f"deadline exceeded waiting for {operation}", operation="broadcast")

    def _take_part(self, prefix: str, named_tensors, budget_s: float, cancel: threading.Event,
                   verify_digest: bool = False) -> SyncResult:
        """Ranks > 0 (their thread): say what this rank holds, send its lane when rank 0
        hands it one, say how the send ended, and return (or raise) the round's end."""
        store, rank = self._store, self.rank
        deadline_at = time.monotonic() + budget_s + self.resume_grace_s
        alive = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(RoundKeys(prefix).alive(rank), alive), daemon=True,
                                  name="weightsync-rank-alive")
        ticker.start()
        try:
            held: dict[str, Holding] | None = None
            try:
                replay = self.hold(named_tensors)
                held, sig = replay.holdings, replay.signature
                if sig != self._published:
                    store.set(f"ws-dist/{self.session}/described/{rank}/{sig}", json.dumps(replay.described))
                    self._published = sig
                record = {"sig": sig, "host": host_id()}
                if verify_digest:  # what this rank sends, hashed (rank 0 combines the senders' hashes)
                    record["hashes"] = holding_hashes(held.values(), self.wire_dtype)
                store.set(RoundKeys(prefix).holding(rank), json.dumps(record))
            except WeightSyncError as exc:
                store.set(RoundKeys(prefix).holding(rank), json.dumps({"error": error_record(exc)}))
                held = None
            if held is not None:
                self._send_lanes(prefix, held, deadline_at, cancel)
            else:
                self._wait_any(prefix, [RoundKeys(prefix).result], deadline_at, cancel)
            record = json.loads(store.get(RoundKeys(prefix).result))
            acknowledge_read(store, RoundKeys(prefix).read(rank))
        except RuntimeError as exc:  # SecureStore: the connection to rank 0's store failed
            raise TransferError(f"trainer rank 0 (which drives the round) went away: {exc}") from exc
        finally:
            alive.set()
            ticker.join(timeout=1.0)
        if "error" in record:
            raise_recorded(record)
        return result_from(record["result"])

    def _tick(self, key: str, stop: threading.Event) -> None:
        """This rank's heartbeat during a round, on its own connection (the round's
        thread may be blocked in a store wait)."""
        try:
            store = self._store.clone()
        except Exception:
            return
        try:
            while not stop.wait(HEARTBEAT_S):
                store.add(key, 1)
        except Exception:
            pass  # rank 0 went away: the round's thread says so
        finally:
            store.close()

    def _wait_any(self, prefix: str, keys: list[str], deadline_at: float, cancel: threading.Event | None) -> str:
        """The first of ``keys`` set. A cancel before then is reported to rank 0 (as this
        rank's failed send); the wait goes on for the round's end."""
        store, reported = self._store, False
        while True:
            found = first_set(store, keys, deadline_at)
            if found is not None:
                return found
            if cancel is not None and cancel.is_set() and not reported:
                store.set(RoundKeys(prefix).done(self.rank), json.dumps({"ok": False, "error": "cancelled on this rank"}))
                reported = True
            if time.monotonic() >= deadline_at:
                raise StepTimeoutError(f"deadline exceeded waiting for rank 0 ({keys[0].rsplit('/', 1)[-1]})",
                                       operation="sync")

    def _send_lanes(self, prefix: str, held: dict[str, Holding], deadline_at: float,
                    cancel: threading.Event) -> None:
        """Sends this rank's parts on each lane rank 0 hands it (``lane/<rank>/<i>``, one
        after another: shm to the engines on its host, gloo to each other host's relay),
        each on a thread of its own as it comes, and says how each ended
        (``done/<rank>/<i>``). A lane stops when rank 0 says so (``stop/<rank>/<i>``: an
        engine on it failed; the others go on) or the caller cancels (every lane, and
        ``done/<rank>`` tells rank 0 at once). Returns once the round's result is set."""
        store, rank = self._store, self.rank
        result_key = RoundKeys(prefix).result
        sending: list[tuple[futures.Future, threading.Event]] = []
        reported: set[int] = set()
        layout: tuple[BucketPlan, list[torch.Tensor]] | None = None
        cancel_reported = False
        try:
            while True:
                lane_key = RoundKeys(prefix).lane(rank, len(sending))
                found = first_set(store, [lane_key, result_key], deadline_at)
                if found == lane_key:
                    abort = threading.Event()
                    rendezvous = common_pb2.Rendezvous.FromString(bytes.fromhex(store.get(lane_key).decode()))
                    try:
                        if layout is None:
                            layout = self._lane_layout(prefix, held)
                        sending.append((self._send_threads.submit(self._send, rendezvous, *layout, deadline_at,
                                                                  abort), abort))
                    except BaseException as exc:  # this rank cannot send what it was asked: the lane fails
                        failed: futures.Future = futures.Future()
                        failed.set_exception(exc)
                        sending.append((failed, abort))
                for index, (send, abort) in enumerate(sending):
                    if not send.done() and (cancel.is_set() or store.check([RoundKeys(prefix).stop(rank, index)])):
                        abort.set()
                    if send.done() and index not in reported:
                        store.set(RoundKeys(prefix).done(rank, index), json.dumps(self._report(send, cancel)))
                        reported.add(index)
                if cancel.is_set() and not cancel_reported:
                    store.set(RoundKeys(prefix).done(rank), json.dumps({"ok": False, "error": "cancelled on this rank"}))
                    cancel_reported = True
                if found == result_key:
                    return
                if time.monotonic() >= deadline_at:
                    raise StepTimeoutError("deadline exceeded waiting for rank 0 (result)", operation="sync")
        finally:
            # Whatever ended the watch (rank 0's store gone, the round's end), every send
            # ends before this returns: its group must be retired by the sender itself,
            # never left to the sender being closed under it.
            for send, abort in sending:
                if not send.done():
                    abort.set()
            futures.wait([send for send, _ in sending], timeout=max(0.0, deadline_at - time.monotonic()))

    @staticmethod
    def _report(send: futures.Future, cancel: threading.Event) -> dict:
        """How one lane's send ended, for rank 0."""
        try:
            stats = send.result()
        except BaseException as exc:
            return {"ok": False, "error": "cancelled on this rank" if cancel.is_set() else str(exc) or
                    type(exc).__name__}
        return {"ok": True, "bytes": stats.bytes, "seconds": stats.seconds, "buckets": stats.buckets}

    def _lane_layout(self, prefix: str, held: dict[str, Holding]) -> tuple[BucketPlan, list[torch.Tensor]]:
        """This rank's part plan for the round and the tensors it sends, one per part."""
        store, rank = self._store, self.rank
        plan = BucketPlan.from_proto(common_pb2.WeightPlan.FromString(
            bytes.fromhex(store.get(RoundKeys(prefix).plan(rank)).decode())))
        # The same list while the part plan (a repeat parses to the same object) and
        # the holdings (replayed) stay: a per-part pass costs ~8 ms at 20k parts.
        if self._lane_sources is not None and self._lane_sources[0] is plan and self._lane_sources[1] is held:
            return plan, self._lane_sources[2]
        sources = []
        for name, shape in zip(plan.names, plan.shapes, strict=True):
            local = held[name].local if name in held else None
            if local is None or tuple(local.shape) != shape:
                raise InvalidArgument(f"rank {rank} was asked to send {name!r} {list(shape)}, which it does "
                                      "not hold")
            sources.append(local)
        self._lane_sources = (plan, held, sources)
        return plan, sources

    def _send(self, rendezvous, plan: BucketPlan, sources, deadline_at: float, abort: threading.Event):
        kind = rendezvous.transport
        sender = self._senders.get((kind, rendezvous.lane))
        if sender is None:
            store = self._store.clone()
            sender = self._senders[(kind, rendezvous.lane)] = transports.make_sender(kind, store, data_host=self.host)
        with torch.no_grad():
            return sender.send(rendezvous, plan, sources, deadline_at=deadline_at, abort=abort)


__all__ = ["DistributedTrainerClient"]
