"""The shm transport's direct mode: engines read the trainer's tensors with cross-memory
attach (``process_vm_readv``), one copy, and fall back to the shared-memory ring where
they cannot. Real store, real kernel calls; the kernel's refusal is a real one (a
reader running as another user). Cross-process rounds are in test_e2e (``shm`` and
``shm-ring``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tests.test_transports import KINDS, rendezvous, run_round
from weightsync import transport as transports
from weightsync.errors import TransferError
from weightsync.plan import BucketPlan
from weightsync.transport.cross_memory import AddressedTensors, Beacon, RemoteMemory, addresses_for
from weightsync.transport.store import host_store

SHM = KINDS["shm"]


def model_tensors() -> list[torch.Tensor]:
    # Many small tensors (whole inside a bucket), one spanning several buckets, a 0-d one.
    return ([torch.randn(7, 3) for _ in range(40)] + [torch.randn(5000)] + [torch.tensor(2.5)]
            + [torch.arange(100, dtype=torch.int64)])


def receive_all(sender, receivers, plan, sources, targets):
    _, errors = run_round(sender, receivers, rendezvous(sender._store, SHM, len(receivers) + 1), plan, sources,
                          targets=targets)
    assert errors == {}, errors


def zeros_like(plan):
    return [torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots]


def round_into_zeros(sender, receiver, plan, sources, *, mode: str) -> None:
    """One round to one receiver into fresh zeroed targets: read ``mode`` way, bitwise."""
    targets = zeros_like(plan)
    receive_all(sender, [receiver], plan, sources, [targets])
    assert receiver.last_mode == mode
    assert all(torch.equal(a, b) for a, b in zip(targets, sources, strict=True))


def test_engines_read_the_trainers_tensors_directly_and_one_that_cannot_takes_the_ring():
    """Receiver 1 reads directly; one of its targets is a transposed view (not a run of
    bytes), read through a bounce buffer. Receiver 2 does not read directly (as where
    the kernel refuses): it takes the ring, in the same round. Both end bitwise equal to
    the trainer, round after round."""
    from weightsync.transport.shm import ShmReceiver

    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(SHM, store)
    receivers = [ShmReceiver(), ShmReceiver(direct=False)]
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    assert plan.num_buckets > 5
    direct_targets = zeros_like(plan)
    direct_targets[0] = torch.zeros(3, 7).t()  # same shape and dtype, not contiguous
    ring_targets = zeros_like(plan)
    try:
        for step in range(3):
            for s in sources:
                s.add_(step + 1)
            receive_all(sender, receivers, plan, sources, [direct_targets, ring_targets])
            assert sender.last_direct_ranks == (1,)
            assert [r.last_mode for r in receivers] == ["direct", "ring"]
            for targets in (direct_targets, ring_targets):
                for got, want in zip(targets, sources, strict=True):
                    assert torch.equal(got, want)
        # Every engine direct: the ring carries nothing (the trainer packs no bucket).
        receive_all(sender, receivers[:1], plan, sources, [direct_targets])
        assert sender.last_direct_ranks == (1,) and receivers[0].last_mode == "direct"
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_a_streamed_load_gets_its_tensors_bucket_by_bucket():
    """Direct reads ask for targets as their buckets come, like the ring: a streamed
    load (vLLM's worker) never holds more than the buckets being read."""
    from weightsync.engine.streamed_load import StreamedTargets

    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(SHM, store)
    receiver = transports.make_receiver(SHM)
    sources = [torch.randn(1024) for _ in range(16)]  # 4 KiB each, one per bucket
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    targets = StreamedTargets(plan, torch.device("cpu"))
    seen = []
    try:
        rdzv = rendezvous(store, SHM, 2)
        thread = threading.Thread(target=sender.send, args=(rdzv, plan, sources),
                                  kwargs={"deadline_at": time.monotonic() + 20, "abort": threading.Event()})
        thread.start()

        def on_bucket(bucket):  # what the streamed load does: hand the tensor on, let it go
            seen.append(targets.take(bucket))

        receiver.receive(rdzv, 1, plan, targets, deadline_at=time.monotonic() + 20, abort=threading.Event(),
                         on_bucket=on_bucket)
        thread.join(20)
        assert receiver.last_mode == "direct"
        assert targets.peak_bytes == 4096, "one tensor alive at a time"
        assert all(torch.equal(a, b) for a, b in zip(seen, sources, strict=True))
    finally:
        sender.close()
        receiver.close()


def test_sources_that_are_not_runs_of_bytes_go_through_the_ring():
    """A non-contiguous source, or a plan that casts, cannot be read directly: the
    trainer offers nothing and every engine takes the ring."""
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(SHM, store)
    receiver = transports.make_receiver(SHM)
    try:
        strided = [torch.randn(30, 40).t(), torch.randn(100)]
        plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(strided)], bucket_bytes=1024)
        targets = zeros_like(plan)
        receive_all(sender, [receiver], plan, strided, [targets])
        assert sender.last_direct_ranks == () and receiver.last_mode == "ring"
        assert all(torch.equal(a, b) for a, b in zip(targets, strided, strict=True))

        cast = [torch.randn(300)]
        plan = BucketPlan.from_tensors([("c", cast[0])], bucket_bytes=256, wire_dtype=torch.bfloat16)
        targets = zeros_like(plan)
        receive_all(sender, [receiver], plan, cast, [targets])
        assert receiver.last_mode == "ring" and torch.equal(targets[0], cast[0].to(torch.bfloat16))
    finally:
        sender.close()
        receiver.close()


def test_the_switch_turns_direct_reads_off(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_SHM_DIRECT", "0")
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(SHM, store)
    receiver = transports.make_receiver(SHM)
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    try:
        round_into_zeros(sender, receiver, plan, sources, mode="ring")
    finally:
        sender.close()
        receiver.close()


def test_a_beacon_that_does_not_read_back_is_not_attached():
    beacon = Beacon()
    pid, address, value = beacon.describe().decode().split("|")
    assert RemoteMemory.attach(beacon.describe()) is not None
    wrong_value = f"{pid}|{address}|{'00' * 16}".encode()
    assert RemoteMemory.attach(wrong_value) is None
    assert RemoteMemory.attach(b"not a description") is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert RemoteMemory.attach(f"{gone.pid}|{address}|{value}".encode()) is None


def test_reading_a_process_that_exited_is_a_transfer_error():
    """What an engine sees when the trainer dies mid-read: the next read fails, typed."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    memory = RemoteMemory(child.pid, 0, b"")
    child.stdin.close()
    child.wait(timeout=30)
    out = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TransferError, match=f"pid {child.pid}"):
        memory.read(np.array([out.data_ptr()], np.uint64), np.array([4096], np.uint64), np.array([16], np.uint64))


def test_many_runs_are_read_in_calls_the_kernel_accepts():
    """More runs than one call takes (IOV_MAX 1024): read in several calls, all bytes right."""
    source = torch.randn(5000)
    out = torch.zeros(5000)
    beacon = Beacon()
    memory = RemoteMemory.attach(beacon.describe()) or pytest.fail("cannot read this process")
    starts = np.arange(0, 5000 * 4, 4, dtype=np.uint64)  # one run per float: 5000 runs
    memory.read(out.data_ptr() + starts, source.data_ptr() + starts, np.full(5000, 4, np.uint64))
    assert torch.equal(out, source)
    # Runs longer than one call's share (4 MiB) are cut into pieces, an odd tail included.
    big = torch.randint(0, 255, ((9 << 20) + 3,), dtype=torch.uint8)
    into = torch.zeros_like(big)
    memory.read(np.array([into.data_ptr(), into.data_ptr() + 10], np.uint64),
                np.array([big.data_ptr(), big.data_ptr() + 10], np.uint64),
                np.array([10, big.numel() - 10], np.uint64))
    assert torch.equal(into, big)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop a reader to another user")
def test_the_kernel_refuses_a_reader_of_another_user():
    """A reader that may not ptrace the trainer (a forked child that became 'nobody') is
    refused by the kernel, and attach says so (the engine would take the ring); the same
    child before dropping its user reads the beacon."""
    beacon = Beacon()
    description = beacon.describe()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only ctypes calls, then _exit
        try:
            before = RemoteMemory.attach(description) is not None
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            after = RemoteMemory.attach(description) is not None
            os.write(write, f"{before} {after}".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert answer == "True False", answer


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "ring"])
def test_a_round_leaves_no_key_of_its_own_in_the_store(direct):
    """Thousands of steps must not grow the trainer's store: after each shm round (direct
    reads or the ring) the store holds what it held before. The connections' own keys
    (each receiver's first connection) are counted once, after a first round."""
    kind = KINDS["shm"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    from weightsync.transport.shm import ShmReceiver

    receivers = [ShmReceiver(direct=direct) for _ in range(2)]
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    try:
        counts = []
        for _ in range(3):
            _, errors = run_round(sender, receivers, rendezvous(store, kind, 3), plan, sources)
            assert errors == {}
            counts.append(store.num_keys())
        assert counts[1] == counts[0] == counts[2], counts
        assert [r.last_mode for r in receivers] == ["direct" if direct else "ring"] * 2
    finally:
        sender.close()
        for r in receivers:
            r.close()


GLIBC_HUGE = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize(("setting", "env", "missing"), [
    ("always [madvise] never\n", {}, ["THP_MEM_ALLOC_ENABLE=1", "glibc.malloc.hugetlb=1"]),
    ("always [madvise] never\n", {"THP_MEM_ALLOC_ENABLE": "0", **GLIBC_HUGE}, ["THP_MEM_ALLOC_ENABLE=1"]),
    ("always [madvise] never\n", {"THP_MEM_ALLOC_ENABLE": "1"}, ["glibc.malloc.hugetlb=1"]),
    ("always [madvise] never\n", {"THP_MEM_ALLOC_ENABLE": "1", **GLIBC_HUGE}, []),
    ("[always] madvise never\n", {}, []),  # every large region is on huge pages already
    ("always madvise [never]\n", {}, []),  # the machine's choice: nothing a trainer can set
])
def test_hugepage_advice_names_what_is_missing_only_where_it_would_help(tmp_path, setting, env, missing):
    from weightsync.transport.cross_memory import hugepage_advice

    path = tmp_path / "enabled"
    path.write_text(setting)
    advice = hugepage_advice(str(path), env)
    if not missing:
        assert advice is None
    else:
        assert advice is not None
        for what in ["THP_MEM_ALLOC_ENABLE=1", "glibc.malloc.hugetlb=1"]:
            assert (what in advice) == (what in missing), advice
    assert hugepage_advice(str(tmp_path / "missing"), env) is None  # no THP in this kernel


def test_a_trainer_offering_direct_reads_is_told_once_how_to_make_them_faster(tmp_path, monkeypatch, caplog):
    """The advice is logged by a real direct round, once per process, not every round."""
    import logging

    from weightsync.transport import cross_memory
    from weightsync.transport.shm import ShmReceiver

    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(cross_memory, "THP_SETTING", str(setting))
    monkeypatch.setattr(cross_memory, "_advised", False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(SHM, store)
    sources = model_tensors()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=4096)
    receiver = ShmReceiver()
    try:
        with caplog.at_level(logging.INFO, logger="weightsync.transport.shm"):
            for _ in range(2):
                round_into_zeros(sender, receiver, plan, sources, mode="direct")
    finally:
        sender.close()
        receiver.close()
    advice = [r for r in caplog.records if "THP_MEM_ALLOC_ENABLE=1" in r.getMessage()]
    assert len(advice) == 1


def test_addresses_kept_for_one_plan_are_not_used_for_another():
    """Addresses taken in an earlier pass stand for the plan they were taken for only."""
    tensors = [torch.randn(10), torch.randn(20)]
    first = BucketPlan.from_tensors([("a", tensors[0]), ("b", tensors[1])], bucket_bytes=4096)
    other = BucketPlan.from_tensors([("x", tensors[0]), ("y", tensors[1])], bucket_bytes=4096)
    kept = AddressedTensors(tensors, np.array([1, 2], np.uint64), first.sizes)
    assert addresses_for(kept, first.dtypes, first.sizes).tolist() == [1, 2]
    assert addresses_for(kept, other.dtypes, other.sizes).tolist() == [t.data_ptr() for t in tensors]


@pytest.mark.parametrize("mode", ["direct", "push"])
def test_an_engines_kept_target_addresses_follow_its_weights_to_new_storage(mode):
    """The reference engine's adapter keeps its parameters' addresses from round to round
    (shm's direct reads write there; in the push mode the trainer writes there). Weights put to sleep and woken get new storage
    (the old arena is held meanwhile, so its memory cannot be handed back): the next
    round must land in the tensors the engine now computes with, not in the old memory."""
    from weightsync.engine.model import config_for_size
    from weightsync.engine.reference import ReferenceAdapter
    from weightsync.transport.shm import ShmReceiver, ShmSender
    from weightsync.v1 import common_pb2

    adapter = ReferenceAdapter(config_for_size(1 << 20, 60))
    store = host_store("127.0.0.1", timeout_s=20)
    sender = ShmSender(store, push=True)
    receiver = ShmReceiver(push=mode == "push")
    try:
        names = [n for n, _ in adapter.engine.named_tensors()]
        sources = [torch.randn_like(t) for _, t in adapter.engine.named_tensors()]
        plan = BucketPlan.from_tensors(list(zip(names, sources, strict=True)), bucket_bytes=64 << 10)
        receive_all(sender, [receiver], plan, sources, [adapter.load_targets(plan)])
        assert receiver.last_mode == mode
        before = [t.data_ptr() for _, t in adapter.engine.named_tensors()]
        old = [t for _, t in adapter.engine.named_tensors()]

        adapter.pause(common_pb2.PAUSE_MODE_KEEP, timeout_s=10)
        adapter.sleep(["weights"])
        # Views of the old arena, taken before sleep, hold its memory: the woken arena
        # cannot be mapped where it was.
        adapter.wake(["weights"])
        assert [t.data_ptr() for _, t in adapter.engine.named_tensors()] != before
        for s in sources:
            s.add_(1)
        receive_all(sender, [receiver], plan, sources, [adapter.load_targets(plan)])
        assert receiver.last_mode == mode
        assert all(torch.equal(t, s) for (_, t), s in zip(adapter.engine.named_tensors(), sources, strict=True))
        assert not any(torch.equal(t, s) for t, s in zip(old, sources, strict=True))  # nothing went to the old
    finally:
        sender.close()
        receiver.close()
        adapter.engine.close()
