"""shm's push mode: the trainer writes its tensors into engines whose weights lie in
arenas (``process_vm_writev``), and stops writing the moment a round fails. Real
store, real kernel calls, real processes (an engine killed mid-write, a process an
engine names that is not its own). Where a write must still be under way when
something fails, each kernel call is slowed by a sleep before it (the calls
themselves are real); cross-process rounds through the agents are in test_e2e."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tests.test_transports import KINDS, rendezvous, run_round
from weightsync.arena import place_in_arena, place_on_huge_pages
from weightsync.errors import TransferError
from weightsync.plan import BucketPlan
from weightsync.transport import cross_memory, shm_push
from weightsync.transport.shm import ShmReceiver, ShmSender
from weightsync.transport.store import host_store, session_key

SHM = KINDS["shm"]


def model_tensors() -> list[torch.Tensor]:
    # Small tensors (whole inside a bucket), one spanning several buckets, a 0-d one.
    return ([torch.randn(7, 3) for _ in range(40)] + [torch.randn(5000)] + [torch.tensor(2.5)]
            + [torch.arange(100, dtype=torch.int64)])


def arena_targets(plan) -> list[torch.Tensor]:
    """Zeroed targets laid end to end in an arena, as the reference engine keeps its
    weights."""
    params = [torch.nn.Parameter(torch.zeros(s.shape, dtype=s.dtype), requires_grad=False) for s in plan.slots]
    place_in_arena(params, [(s.dtype, tuple(s.shape)) for s in plan.slots], keep_values=False)
    return [p.data for p in params]


def plain_targets(plan) -> list[torch.Tensor]:
    return [torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots]


@pytest.fixture
def slowed_writes(monkeypatch):
    """Each write call of this process sleeps 10 ms first; returns when each call ran."""
    real = cross_memory._process_vm("writev")
    calls: list[float] = []

    def slowed(*args):
        time.sleep(0.01)
        calls.append(time.monotonic())
        return real(*args)

    monkeypatch.setitem(cross_memory._calls, "writev", slowed)
    return calls


def test_the_trainer_writes_into_arena_engines_and_the_others_read_as_before():
    """Three engines in one round, three rounds: one whose weights are an arena is
    written into by the trainer; one with plain tensors reads directly; one that does
    not read directly takes the ring. All bitwise equal to the trainer every round."""
    store = host_store("127.0.0.1", timeout_s=20)
    sender = ShmSender(store, push=True)
    receivers = [ShmReceiver(), ShmReceiver(), ShmReceiver(direct=False)]
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    assert plan.num_buckets > 5
    targets = [arena_targets(plan), plain_targets(plan), plain_targets(plan)]
    try:
        for step in range(3):
            for s in sources:
                s.add_(step + 1)
            _, errors = run_round(sender, receivers, rendezvous(store, SHM, 4), plan, sources, targets=targets)
            assert errors == {}, errors
            assert sender.last_pushed_ranks == (1,) and sender.last_direct_ranks == (2,)
            assert [r.last_mode for r in receivers] == ["push", "direct", "ring"]
            for engine in targets:
                assert all(torch.equal(got, want) for got, want in zip(engine, sources, strict=True))
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_engines_read_where_the_trainers_weights_are_on_huge_pages_or_push_is_off(monkeypatch):
    """The trainer offers to write only where its own tensors are on small pages: once
    placed on huge pages (``place_on_huge_pages``) engines read them, as fast. Either
    side's switch turns the push mode off; a forced offer reaches an arena engine."""
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = ShmSender(store), ShmReceiver()
    targets = [arena_targets(plan)]

    def round_reads(how: str) -> None:
        _, errors = run_round(sender, [receiver], rendezvous(store, SHM, 2), plan, sources, targets=targets)
        assert errors == {} and receiver.last_mode == how
        assert all(torch.equal(got, want) for got, want in zip(targets[0], sources, strict=True))

    try:
        addresses = np.array([t.data_ptr() for t in sources], np.uint64)
        monkeypatch.setattr(shm_push, "_small_pages", True)  # as on a THP "madvise" machine, nothing set
        assert shm_push.on_small_pages(addresses)
        round_reads("push")
        monkeypatch.setenv("WEIGHTSYNC_SHM_PUSH", "0")  # the trainer's switch (the engine's too: one process)
        round_reads("direct")
        monkeypatch.delenv("WEIGHTSYNC_SHM_PUSH")
        receiver._push = False  # the engine alone says no
        round_reads("direct")
        receiver._push = None
        place_on_huge_pages(sources)
        addresses = np.array([t.data_ptr() for t in sources], np.uint64)
        assert not shm_push.on_small_pages(addresses)
        for s in sources:
            s.add_(1)
        round_reads("direct")
    finally:
        sender.close()
        receiver.close()


def test_an_engine_that_fails_mid_write_stops_the_trainers_writes(monkeypatch, slowed_writes):
    """The engine gives up while the trainer is writing into it: the trainer stops
    before its next call, fails the round naming the engine, and says it stopped; the
    engine's receive returns only after that, and nothing is written into the engine
    after it returned."""
    sources = [torch.randn(1 << 20) for _ in range(16)]  # 64 MiB: 16 calls of 4 MiB, 10 ms each here
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=8 << 20)
    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = ShmSender(store, push=True), ShmReceiver()
    targets = arena_targets(plan)
    real_await = shm_push.await_written

    def give_up(store, rdzv, rank, *, deadline_at, abort, stop_keys):
        end = time.monotonic() + 20
        while not slowed_writes and time.monotonic() < end:  # once the writes are under way
            time.sleep(0.001)
        abort.set()  # as the agent does when its deadline or a cancel comes
        return real_await(store, rdzv, rank, deadline_at=deadline_at, abort=abort, stop_keys=stop_keys)

    monkeypatch.setattr(shm_push, "await_written", give_up)
    rdzv = rendezvous(store, SHM, 2)
    returned = {}

    def engine():
        try:
            receiver.receive(rdzv, 1, plan, targets, deadline_at=time.monotonic() + 30, abort=threading.Event())
        except TransferError as exc:
            returned.update(error=exc, at=time.monotonic(), calls=len(slowed_writes),
                            digest=[hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in targets])

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        with pytest.raises(TransferError, match="peer reported failure: rank 1"):
            sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 30, abort=threading.Event())
        thread.join(30)
        assert "aborted" in str(returned["error"])
        assert store.check([session_key(rdzv, "push-stopped")])
        assert 0 < returned["calls"] < 16, "the writes were under way and were cut short"
        time.sleep(0.1)
        assert len(slowed_writes) == returned["calls"], "no call after the engine's receive returned"
        assert [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in targets] == returned["digest"]
        assert not shm_push.quarantined
    finally:
        sender.close()
        receiver.close()


ENGINE = """
import sys, threading, time, torch
from weightsync.plan import BucketPlan
from weightsync.transport.shm import ShmReceiver
from weightsync.v1 import common_pb2
from tests.test_shm_push import arena_targets
count, port, group, session = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
plan = BucketPlan.from_tensors([(f"t{i}", torch.zeros(1 << 20)) for i in range(count)], bucket_bytes=8 << 20)
rdzv = common_pb2.Rendezvous(group_id=group, transport=common_pb2.TRANSPORT_KIND_SHM, store_host="127.0.0.1",
                             store_port=port, world_size=2, session_id=session)
ShmReceiver().receive(rdzv, 1, plan, arena_targets(plan), deadline_at=time.monotonic() + 60,
                      abort=threading.Event())
"""


def test_an_engine_killed_mid_write_fails_the_round_at_once(slowed_writes):
    """An engine process killed (SIGKILL) while the trainer writes into it: the trainer's
    next call sees the process gone and the round fails in well under its 60 s
    deadline, typed, naming the engine."""
    count = 32  # 128 MiB, 32 calls of 10 ms at least
    sources = [torch.randn(1 << 20) for _ in range(count)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=8 << 20)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = ShmSender(store, push=True)
    rdzv = rendezvous(store, SHM, 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", ENGINE, str(count), str(store.port), rdzv.group_id,
                              rdzv.session_id], cwd=root, env={**os.environ, "PYTHONPATH": root})
    outcome = {}

    def trainer():
        try:
            sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 60, abort=threading.Event())
        except BaseException as exc:
            outcome.update(error=exc, at=time.monotonic())

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(slowed_writes) < 2 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(slowed_writes) >= 2, "the trainer never wrote into the engine"
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        child.wait(30)
        thread.join(60)
        assert isinstance(outcome["error"], TransferError), outcome
        assert outcome["at"] - killed < 10, "the trainer noticed at its next call, not at the deadline"
        assert len(slowed_writes) < count
        assert f"pid {child.pid}" in str(outcome["error"]) or "rank 1" in str(outcome["error"])
        assert store.check([session_key(rdzv, "push-stopped")])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        sender.close()


VICTIM = """
import ctypes, hashlib, sys
buffer = ctypes.create_string_buffer(1 << 16)
print(ctypes.addressof(buffer), flush=True)
sys.stdin.readline()
print(hashlib.sha256(buffer.raw).hexdigest(), flush=True)
"""


@pytest.mark.parametrize("nonce", ["wrong", "right"])
def test_an_engine_cannot_make_the_trainer_write_into_another_process(nonce):
    """A hostile engine names another process (its memory zeros) as the one to write
    into. Without this round's nonce the trainer fails the round, typed; with the nonce
    but naming a process that does not hold it, the beacon does not read back and the
    trainer says no (the engine would read directly). Either way not a byte is written
    into the other process."""
    victim = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    address = int(victim.stdout.readline())
    sources = [torch.randn(1024) for _ in range(4)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = ShmSender(store, push=True)
    rdzv = rendezvous(store, SHM, 2)
    answer = {}

    def hostile_engine():
        key = lambda *parts: session_key(rdzv, *parts)  # noqa: E731
        deadline = time.monotonic() + 20
        while not store.check([key("segment")]) and time.monotonic() < deadline:
            time.sleep(0.005)
        offered = store.get(key("push")).decode()
        value = offered if nonce == "right" else "00" * 16  # the victim's bytes there are zeros
        store.set(key("push-targets", 1), np.array([address + 4096 * i for i in range(4)], np.uint64).tobytes())
        store.set(key("push-to", 1), f"{victim.pid}|{address}|{value}".encode())
        store.set(key("mode", 1), b"push")
        while not store.check([key("push-ok", 1)]) and not store.check([key("abort")]) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        answer["ok"] = store.get(key("push-ok", 1)) if store.check([key("push-ok", 1)]) else None
        store.set(key("done", 1), b"1")  # what an engine told no does after reading directly

    thread = threading.Thread(target=hostile_engine)
    thread.start()
    try:
        before = hashlib.sha256(bytes(1 << 16)).hexdigest()
        if nonce == "wrong":
            with pytest.raises(TransferError, match="without this round's nonce"):
                sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 20, abort=threading.Event())
        else:
            sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 20, abort=threading.Event())
            assert sender.last_pushed_ranks == () and sender.last_direct_ranks == (1,)
        thread.join(30)
        assert answer["ok"] == (b"0" if nonce == "right" else None)
        victim.stdin.write("\n")
        victim.stdin.flush()
        assert victim.stdout.readline().strip() == before
    finally:
        victim.kill()
        victim.wait(30)
        sender.close()


def test_a_failed_engine_keeps_its_targets_while_the_trainer_may_still_write(monkeypatch):
    """The engine's side after a failed round it asked to be written into: it returns at
    once when the trainer said its writes stopped or the trainer is gone; when neither
    comes (a trainer alive but silent), it keeps the targets' memory for good."""
    monkeypatch.setattr(shm_push, "PUSH_STOPPED_WAIT_S", 0.3)
    monkeypatch.setattr(shm_push, "quarantined", [])
    store = host_store("127.0.0.1", timeout_s=20)
    rdzv = rendezvous(store, SHM, 2)
    targets = [torch.zeros(4)]
    began = time.monotonic()
    shm_push.settle_after_failure(store, rdzv, os.getpid(), targets)  # alive, silent
    assert time.monotonic() - began >= 0.3 and shm_push.quarantined == [targets]

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    began = time.monotonic()
    shm_push.settle_after_failure(store, rdzv, gone.pid, [torch.zeros(4)])
    assert time.monotonic() - began < 0.3 and len(shm_push.quarantined) == 1

    store.set(session_key(rdzv, "push-stopped"), b"1")
    shm_push.settle_after_failure(store, rdzv, os.getpid(), [torch.zeros(4)])
    assert len(shm_push.quarantined) == 1


def test_push_rounds_leave_no_key_of_their_own_in_the_store():
    """After each round with the push mode (one engine written into, one that asked and
    one that did not) the store holds what it held before."""
    store = host_store("127.0.0.1", timeout_s=20)
    sender = ShmSender(store, push=True)
    receivers = [ShmReceiver(), ShmReceiver()]
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    targets = [arena_targets(plan), plain_targets(plan)]
    try:
        counts = []
        for _ in range(3):
            _, errors = run_round(sender, receivers, rendezvous(store, SHM, 3), plan, sources, targets=targets)
            assert errors == {}
            counts.append(store.num_keys())
        assert counts[1] == counts[0] == counts[2], counts
        assert [r.last_mode for r in receivers] == ["push", "direct"]
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_a_trainer_that_fails_before_answering_releases_the_engines_at_once():
    """The trainer offers the push mode, one engine asks, and the round fails before the
    trainer answers (another engine never shows up; the trainer's round is aborted):
    the trainer says no write will come, so the engine that asked fails at once, keeps
    nothing back and quarantines nothing."""
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = ShmSender(store, push=True), ShmReceiver()
    rdzv = rendezvous(store, SHM, 3)  # rank 2 never comes
    abort = threading.Event()
    returned = {}

    def engine():
        try:
            receiver.receive(rdzv, 1, plan, arena_targets(plan), deadline_at=time.monotonic() + 30,
                             abort=threading.Event())
        except TransferError as exc:
            returned.update(error=exc, at=time.monotonic())

    def trainer():
        try:
            sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 30, abort=abort)
        except TransferError as exc:
            returned.update(trainer=exc, failed_at=time.monotonic())

    threads = [threading.Thread(target=engine), threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while not store.check([session_key(rdzv, "mode", 1)]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.get(session_key(rdzv, "mode", 1)) == b"push"
        abort.set()
        for t in threads:
            t.join(30)
        assert "aborted" in str(returned["trainer"])
        assert "peer reported failure" in str(returned["error"])
        assert returned["at"] - returned["failed_at"] < 2.0, "not held for the push-stopped wait"
        assert store.check([session_key(rdzv, "push-stopped")]) and not shm_push.quarantined
    finally:
        sender.close()
        receiver.close()
