"""Rank 0's side of a sharded trainer's round (``ShardedSenders``), the ``RoundSenders``
its ``TrainerClient`` is given: it plans from every rank's holdings (``assign``), has
rank 0's own parts sent, and hands each other rank its lanes through the store (the
rank protocol, ``rank_protocol.py``), following each to its end.

What it needs of the ranks' client (``DistributedTrainerClient``) is ``ShardedRanks``:
the group's size and session, this rank's holdings, and the store's keys.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from weightsync import deadline as deadlines
from weightsync.attest import Probe
from weightsync.client.lane_sends import MAX_CONCURRENT_LANES, Lane
from weightsync.client.prepared_weights import AttestArg, Prepared
from weightsync.client.rank_protocol import RANK_SILENCE_S, STOP_GRACE_S, RoundKeys, first_set
from weightsync.client.round_senders import OneProcess
from weightsync.errors import (
    InvalidArgument,
    TransferError,
    outcome_error,
)
from weightsync.host_identity import host_id
from weightsync.parts_digest import combine, holding_hashes, sender_hashes
from weightsync.plan import BucketPlan
from weightsync.sharding import (
    Holding,
    Owners,
    assign,
    sources_for,
)
from weightsync.threads import run_in
from weightsync.transport.base import TransferStats
from weightsync.transport.secure_store import StoreHost
from weightsync.transport.store import session_key
from weightsync.v1 import common_pb2


def refuse_a_function_as_probe(attest) -> None:
    if attest is not None and not isinstance(attest, Probe):
        raise InvalidArgument("a sharded trainer's attest takes a Probe computed before the call, on every rank "
                              "(a collective forward: Probe.from_model on each), not a function rank 0 would "
                              "call alone")


class ShardedRanks(Protocol):
    """What ``ShardedSenders`` asks of the ranks' client (``DistributedTrainerClient``)."""

    world_size: int
    session: str
    gathers: bool  # the parts are gathered into rank 0 first, which then sends alone

    def hold(self, named_tensors):
        """This rank's holdings for the round (a ``HeldReplay``)."""

    def wait_key(self, key: str, *, operation: str, deadline_at: float | None = None) -> bytes:
        """Waits for a key another rank sets in the store."""

    def forget_rounds_before(self, prefix: str) -> None:
        """Drops the store keys of every round before the one under ``prefix``."""


class ShardedSenders:
    """Rank 0's ``RoundSenders``: plans from every rank's holdings, has its own parts
    sent, and hands the other ranks their lanes through the store."""

    def __init__(self, ranks: ShardedRanks, *, bucket_bytes: int, wire_dtype: torch.dtype | None,
                 default_timeout_s: float) -> None:
        self.ranks = ranks
        # The client's (the same ones): the plan of the full tensors is made here.
        self.bucket_bytes, self.wire_dtype = bucket_bytes, wire_dtype
        self.default_timeout_s = default_timeout_s
        self.store: StoreHost | None = None  # rank 0's, set once it is hosted (``use_store``)
        self.one_process = OneProcess()  # gathered: rank 0 holds the full tensors and sends alone
        # Following the other ranks' lanes: a thread per lane (they block on the store).
        self._follow_pool = ThreadPoolExecutor(MAX_CONCURRENT_LANES, thread_name_prefix="weightsync-follow")
        self._described: dict[int, tuple[str, dict]] = {}  # rank -> (signature, description)
        self._assigned: tuple[tuple, BucketPlan, Owners] | None = None  # (holdings key, plan, owners)
        self._sources: tuple[Owners, dict, list[torch.Tensor]] | None = None  # rank 0's, for those owners and holdings
        self.holdings: dict[str, Holding] = {}
        self.prefix = ""
        self.common_host = ""
        self.rank_hosts: dict[int, str] = {}  # each rank's host id, as it said this round
        self._handed: tuple[str, dict[int, int]] = ("", {})  # (round prefix, rank -> lanes handed to it so far)

    def use_store(self, store: StoreHost) -> None:
        """Rank 0's store, hosted at start, whose address the other ranks were told."""
        self.store = store

    def store_host(self) -> StoreHost | None:
        return self.store

    def begin_round(self, prefix: str) -> None:
        """The round under ``prefix`` (``RoundKeys``) is the one the next prepare is for."""
        self.prefix = prefix

    def forget(self) -> None:
        """Drops what refers to the caller's tensors (closing: nothing may hold them)."""
        self._sources, self.holdings = None, {}

    def close(self) -> None:
        self._follow_pool.shutdown(wait=False, cancel_futures=True)

    def trainer_host_id(self) -> str:
        if self.ranks.gathers:  # one sender, this rank: engines on its host read it over shm
            return self.one_process.trainer_host_id()
        return self.common_host

    def sender_host_ids(self) -> list[str]:
        """Ranks on several hosts, sharded: every rank's host, by rank, so that each
        rank's lanes are laid out from its own host (shm to the engines there, a relay
        on every other host with several engines). On one host ``trainer_host_id`` says
        it (as an older coordinator understands it too); gathered, rank 0 alone sends."""
        if self.ranks.gathers or self.common_host:
            return []
        return [self.rank_hosts[rank] for rank in range(self.ranks.world_size)]

    def prepare(self, named_tensors, with_digest: bool, attest: AttestArg, *, addresses: bool,
                bucket_bytes: int, wire_dtype: torch.dtype | None) -> Prepared:
        refuse_a_function_as_probe(attest)
        if self.ranks.gathers:  # the full tensors, gathered into this rank: a plain round
            return self.one_process.prepare(named_tensors, with_digest, attest, addresses=addresses,
                                            bucket_bytes=bucket_bytes, wire_dtype=wire_dtype)
        plan, owners, hashes = self.assigned(named_tensors, with_digest)
        sources: list[torch.Tensor] = []
        if 0 in owners.sender_ranks:  # the same list while the owners and the holdings stay
            if self._sources is None or self._sources[0] is not owners or self._sources[1] is not self.holdings:
                self._sources = (owners, self.holdings, sources_for(owners, 0, self.holdings))
            sources = self._sources[2]
        digest = ""
        if with_digest:  # the parts' digest (weightsync/parts_digest.py): engines hash the same slices
            digest = combine(plan, owners, {s: sender_hashes(owners, s, hashes[s]) for s in owners.sender_ranks})
        return Prepared(plan, sources, digest, attest, owners)

    def assigned(self, named_tensors, with_digest: bool) -> tuple[BucketPlan, Owners, list]:
        """This rank's holdings and every other rank's (each waited for in the store),
        planned: the plan of the full tensors, who sends which part, and (``with_digest``)
        each rank's hashes of what it holds, by rank."""
        replay = self.ranks.hold(named_tensors)
        self.holdings, mine = replay.holdings, replay.described
        described = [mine]
        hashes = [holding_hashes(self.holdings.values(), self.wire_dtype)] if with_digest else []
        self.rank_hosts = {0: host_id()}
        store = self.store
        for rank in range(1, self.ranks.world_size):
            record = self.ranks.wait_key(RoundKeys(self.prefix).holding(rank), operation="the ranks' holdings")
            held = json.loads(record)
            if held.get("error"):
                raise outcome_error(held["error"]["reason"], f"trainer rank {rank}: {held['error']['message']}",
                                    operation="broadcast", code=held["error"].get("code", 0))
            self.rank_hosts[rank] = held["host"]
            if with_digest:
                if "hashes" not in held:
                    raise InvalidArgument(f"trainer rank {rank} did not hash its holdings: every rank passes the "
                                          "same verify_digest")
                hashes.append(held["hashes"])
            cached = self._described.get(rank)
            if cached is None or cached[0] != held["sig"]:
                blob = store.get(f"ws-dist/{self.ranks.session}/described/{rank}/{held['sig']}")
                if blob is None:
                    raise TransferError(f"trainer rank {rank} did not publish what it holds")
                cached = self._described[rank] = (held["sig"], json.loads(blob))
            described.append(cached[1])
        # Every rank has said what it holds for this round, so each has read the end of
        # the rounds before: their keys can go (not sooner: a slow rank may still be
        # reading the last round's result when this one starts).
        self.ranks.forget_rounds_before(self.prefix)
        hosts = set(self.rank_hosts.values())
        self.common_host = next(iter(hosts)) if len(hosts) == 1 else ""
        sigs = (replay.signature, *(self._described[r][0] for r in range(1, self.ranks.world_size)))
        key = (sigs, self.bucket_bytes, str(self.wire_dtype))
        if self._assigned is None or self._assigned[0] != key:
            plan, owners = assign(described, bucket_bytes=self.bucket_bytes, wire_dtype=self.wire_dtype)
            self._assigned = (key, plan, owners)
        _, plan, owners = self._assigned
        return plan, owners, hashes

    def remote_send(self, rendezvous: common_pb2.Rendezvous, prepared: Prepared) -> Lane:
        """Hands rank ``rendezvous.sender`` one of its lanes (it may send several: shm to
        the engines on its host, gloo to each other host's relay) and its part layout;
        the lane's future ends when that rank says its send on it ended (or it goes
        silent, or the deadline)."""
        abort = threading.Event()
        if self._handed[0] != self.prefix:  # a new round: no lane handed yet
            self._handed = (self.prefix, {})
        handed = self._handed[1]  # the event loop's: lanes come one by one
        index = handed[rendezvous.sender] = handed.get(rendezvous.sender, -1) + 1
        # On the send pool, not the event loop: a rank's part plan may list 20k parts.
        follow = self.follow_rank(rendezvous, prepared.owners, abort, index)
        return Lane(rendezvous, run_in(self._follow_pool, follow), abort)

    def follow_rank(self, rendezvous, owners: Owners, abort: threading.Event,
                    index: int = 0) -> Callable[[], TransferStats]:
        """The follower of rank ``rendezvous.sender``'s ``index``-th lane of the round, to
        run on a thread: it hands the rank the lane and its part layout and returns when
        the rank says its send on it ended; it raises when the rank failed, went silent
        or let the deadline pass (then the lane's receivers are told to stop), and
        ``abort`` tells the rank to stop sending on this lane (its other lanes go on)."""
        rank, store = rendezvous.sender, self.store
        local = store.client()
        deadline_at = time.monotonic() + (deadlines.remaining(self.default_timeout_s) or 0.0)
        prefix = self.prefix

        def follow() -> TransferStats:
            plan = owners.part_plan(rank)
            if index == 0:  # one layout for all of the rank's lanes, set before the first
                store.set(RoundKeys(prefix).plan(rank), plan.to_proto().SerializeToString().hex())
            store.set(RoundKeys(prefix).lane(rank, index), rendezvous.SerializeToString().hex())
            # The lane's own report, or the rank's for all of them (it was cancelled)
            done_key, failed_key = RoundKeys(prefix).done(rank, index), RoundKeys(prefix).done(rank)
            alive_key = RoundKeys(prefix).alive(rank)
            last_tick, heard = store.get(alive_key), time.monotonic()
            stopped_at: float | None = None
            while True:
                done = store.get(done_key) or store.get(failed_key)
                if done is not None:
                    report = json.loads(done)
                    if report["ok"]:
                        return TransferStats(report["bytes"], report["seconds"], report["buckets"])
                    raise TransferError(f"trainer rank {rank}: {report['error']}")
                now = time.monotonic()
                tick = store.get(alive_key)
                if tick != last_tick:
                    last_tick, heard = tick, now
                if now - heard > RANK_SILENCE_S:
                    why = f"trainer rank {rank} stopped answering (no heartbeat for {now - heard:.1f}s)"
                    store.set(session_key(rendezvous, "abort"), why)  # its engines stop waiting
                    raise TransferError(why)
                if abort.is_set() and stopped_at is None:
                    stopped_at = now
                    store.set(RoundKeys(prefix).stop(rank, index), "stopped by rank 0")
                if now >= deadline_at or (stopped_at is not None and now - stopped_at > STOP_GRACE_S):
                    store.set(session_key(rendezvous, "abort"), f"trainer rank {rank} did not finish")
                    raise TransferError(f"trainer rank {rank} did not say its send ended")
                first_set(local, [done_key, failed_key], deadline_at)  # returns the moment the rank reports

        return follow
