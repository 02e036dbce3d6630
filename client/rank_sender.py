"""A sharded trainer's ranks other than 0, in a round: each says what it holds, sends
its own parts on every lane rank 0 hands it (each lane on a thread of its own), says
how each send ended, and returns (or raises) the round's end as rank 0 recorded it.
All of it through rank 0's store, under the keys ``RoundKeys`` names."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync import transport as transports
from weightsync.client.lane_sends import MAX_CONCURRENT_LANES
from weightsync.client.rank_protocol import (
    HEARTBEAT_S,
    RoundKeys,
    acknowledge_read,
    error_record,
    first_set,
    raise_recorded,
    result_from,
)
from weightsync.client.results import SyncResult
from weightsync.errors import InvalidArgument, StepTimeoutError, TransferError, WeightSyncError
from weightsync.host_identity import host_id
from weightsync.parts_digest import holding_hashes
from weightsync.plan import BucketPlan
from weightsync.sharding import HeldReplay, Holding
from weightsync.transport.base import Sender
from weightsync.transport.secure_store import SecureStore
from weightsync.v1 import common_pb2


class RankSender:
    """One rank's side of every round (see the module docstring). ``hold(named_tensors)``:
    this rank's holdings, replayed while its tensors stay (the client's ``hold``)."""

    def __init__(self, store: SecureStore, *, rank: int, session: str, host: str, wire_dtype: torch.dtype | None,
                 resume_grace_s: float, hold: Callable[..., HeldReplay]) -> None:
        self._store = store  # this rank's connection to rank 0's store
        self.rank, self.session, self.host = rank, session, host
        self.wire_dtype, self.resume_grace_s, self.hold = wire_dtype, resume_grace_s, hold
        # One thread per lane this rank sends at once (shm to its host, gloo to each relay).
        self._send_threads = ThreadPoolExecutor(MAX_CONCURRENT_LANES, thread_name_prefix="weightsync-rank-send")
        self._senders: dict[tuple[int, str], Sender] = {}
        self._published: str = ""  # signature of the holdings this rank last described
        # The part plan, holdings and sources of the last lane: reused while they stay.
        self._lane_sources: tuple[BucketPlan, dict, list[torch.Tensor]] | None = None

    def close(self) -> None:
        """Its thread: the senders, the sources it kept and the store connection."""
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        self._lane_sources = None
        self._store.close()

    def shutdown_threads(self) -> None:
        self._send_threads.shutdown(wait=False)

    def take_part(self, prefix: str, named_tensors, budget_s: float, cancel: threading.Event,
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
                        sending.append((self._send_threads.submit(self.send_lane, rendezvous, *layout, deadline_at,
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

    def send_lane(self, rendezvous, plan: BucketPlan, sources, deadline_at: float, abort: threading.Event):
        """One lane's send (on a thread of its own): this rank's parts, on its sender for the lane."""
        kind = rendezvous.transport
        sender = self._senders.get((kind, rendezvous.lane))
        if sender is None:
            store = self._store.clone()
            sender = self._senders[(kind, rendezvous.lane)] = transports.make_sender(kind, store, data_host=self.host)
        with torch.no_grad():
            return sender.send(rendezvous, plan, sources, deadline_at=deadline_at, abort=abort)
