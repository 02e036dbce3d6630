"""Streamed loading (``weightsync.engine.streamed_load``): each tensor goes to the
engine's loader as soon as its last byte is in, so a receiver holds a few buckets and
the tensors being filled, never a second copy of the model. Real transports (gloo,
shm) between threads of this process; the loader here is a plain function that
copies into a separate model, as vLLM's does into its parameters."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.test_sharding import chunk_slices, grid_slices
from tests.test_transports import KINDS, rendezvous
from weightsync import transport as transports
from weightsync.engine.streamed_load import receive_and_load, receive_and_load_from_senders
from weightsync.errors import StepTimeoutError, TransferError
from weightsync.packing import weights_digest
from weightsync.parts_digest import combine, holding_hashes, sender_hashes
from weightsync.plan import BucketPlan
from weightsync.sharding import assign, describe, sources_for
from weightsync.transport.from_senders import SenderLane
from weightsync.transport.store import host_store

BUCKET = 64 * 1024


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # 64 tensors of 32 KiB and two of 256 KiB (larger than a bucket): 2.5 MiB in all
    return ([(f"w{i}", torch.randn(8192, generator=g)) for i in range(64)]
            + [(f"big{i}", torch.randn(65536, generator=g)) for i in range(2)])


def _run(kind_name: str, load, sources):
    kind = KINDS[kind_name]
    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = transports.make_sender(kind, store), transports.make_receiver(kind)
    plan = BucketPlan.from_tensors(sources, bucket_bytes=BUCKET)
    rdzv = rendezvous(store, kind, 2)
    outcome: dict = {}

    def send():
        try:
            sender.send(rdzv, plan, [t for _, t in sources], deadline_at=time.monotonic() + 20,
                        abort=threading.Event())
        except BaseException as exc:
            outcome["send"] = exc

    thread = threading.Thread(target=send)
    thread.start()
    try:
        outcome["result"] = receive_and_load(receiver, rdzv, 1, plan, device=torch.device("cpu"),
                                             deadline_at=time.monotonic() + 20, abort=threading.Event(),
                                             load=load, max_ready_bytes=2 * BUCKET)
    except BaseException as exc:
        outcome["receive"] = exc
    finally:
        thread.join(30)
        sender.close()
        receiver.close()
    return plan, outcome


@pytest.mark.parametrize("kind_name", ["gloo", "shm"])
def test_every_tensor_is_loaded_as_it_completes_within_a_few_buckets(kind_name):
    sources = _model(1)
    loaded: dict[str, torch.Tensor] = {}

    def load(weights):  # a slow loader: the receive must wait for it, not pile up tensors
        for name, tensor in weights:
            time.sleep(0.002)
            loaded[name] = tensor.clone()

    plan, outcome = _run(kind_name, load, sources)
    assert "receive" not in outcome and "send" not in outcome, outcome
    digest, peak = outcome["result"]
    assert digest == weights_digest(sources)  # what the trainer's tensors hash to
    assert all(torch.equal(loaded[name], t) for name, t in sources) and len(loaded) == len(sources)
    largest = max(t.numel() * t.element_size() for _, t in sources)
    assert peak <= 4 * BUCKET + 2 * largest < plan.total_bytes / 2, (peak, plan.total_bytes)


@pytest.mark.parametrize("kind_name", ["gloo", "shm"])
def test_a_loader_that_fails_stops_the_receive_and_the_sender_promptly(kind_name):
    def load(weights):
        for i, _ in enumerate(weights):
            if i == 5:
                raise RuntimeError("the engine's loader broke")

    started = time.monotonic()
    _, outcome = _run(kind_name, load, _model(2))
    assert isinstance(outcome.get("receive"), RuntimeError), outcome
    assert isinstance(outcome.get("send"), TransferError), outcome  # not left waiting for acks
    assert time.monotonic() - started < 10


def test_a_loader_that_stops_early_is_an_error_not_a_partial_load():
    def load(weights):
        for i, _ in enumerate(weights):
            if i == 3:
                return

    _, outcome = _run("shm", load, _model(3))
    assert isinstance(outcome.get("receive"), TransferError) and "not loaded" in str(outcome["receive"]), outcome


def test_the_receive_thread_takes_the_engines_gpu_before_receiving(monkeypatch):
    """A GPU receiver (nccl, cuda-ipc, a group over nccl) works on its thread's current
    CUDA device, and a new thread's is the first GPU whatever the process chose: a vLLM
    worker on GPU 3 would build its communicator on GPU 0. The streamed receive's
    thread sets the engine's device first. There is no GPU here, so ``set_device`` is
    recorded instead of called, and the receiver is a stand-in that notes its thread;
    tests/gpu runs the real receivers through this path on a GPU."""
    calls: list[tuple[torch.device, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))

    class NotesItsThread:
        thread = ""

        def receive(self, rendezvous, rank, plan, targets, **_):
            NotesItsThread.thread = threading.current_thread().name
            raise TransferError("nothing to receive here")

    plan = BucketPlan.from_tensors(_model(4), bucket_bytes=BUCKET)
    for device, expected in ((torch.device("cuda", 3), [torch.device("cuda", 3)]), (torch.device("cpu"), [])):
        calls.clear()
        with pytest.raises(TransferError, match="nothing to receive"):
            receive_and_load(NotesItsThread(), None, 1, plan, device=device, deadline_at=time.monotonic() + 10,
                             abort=threading.Event(), load=lambda weights: list(weights))
        assert NotesItsThread.thread and NotesItsThread.thread != threading.current_thread().name
        assert [d for d, _ in calls] == expected
        assert all(thread == NotesItsThread.thread for _, thread in calls), calls


def _run_sharded(kind_name: str, load, sources, world: int = 2, fail_sender: int | None = None, dim: int = 0,
                 grid: bool = False, parts_digest: bool = True):
    """``world`` senders, each streaming its own slices on its own lane, into one
    streamed receive. ``fail_sender``: that sender's stream stops after its first
    bucket (its abort flag set), as a trainer rank that dies mid-round. ``grid``: four
    senders of a 2x2 mesh, each holding blocks of rows and columns."""
    kind = KINDS[kind_name]
    holdings = grid_slices(2, 2, sources) if grid else chunk_slices(world, sources, lambda tensor: dim)
    plan, owners = assign([describe(h) for h in holdings], bucket_bytes=BUCKET)
    store = host_store("127.0.0.1", timeout_s=20)
    senders = {r: transports.make_sender(kind, store) for r in owners.sender_ranks}
    receivers = [transports.make_receiver(kind) for _ in owners.sender_ranks]
    lanes = {r: rendezvous(store, kind, 2, group=f"lane-{r}") for r in owners.sender_ranks}
    for r, lane in lanes.items():
        lane.sender = r
    engine_lanes = [SenderLane(lanes[r], owners.part_plan(r), receivers[i], r)
                    for i, r in enumerate(owners.sender_ranks)]
    outcome: dict = {}
    deadline_at = time.monotonic() + 20

    def send(r: int) -> None:
        abort = threading.Event()
        if r == fail_sender:
            threading.Timer(0.05, abort.set).start()
        try:
            senders[r].send(lanes[r], owners.part_plan(r), sources_for(owners, r, {h.name: h for h in holdings[r]}),
                            deadline_at=deadline_at, abort=abort)
        except BaseException as exc:
            outcome[f"send{r}"] = exc

    threads = [threading.Thread(target=send, args=(r,)) for r in owners.sender_ranks]
    for t in threads:
        t.start()
    try:
        outcome["result"] = receive_and_load_from_senders(
            engine_lanes, 1, plan, owners, device=torch.device("cpu"), deadline_at=deadline_at,
            abort=threading.Event(), load=load, max_ready_bytes=2 * BUCKET, parts_digest=parts_digest)
    except BaseException as exc:
        outcome["receive"] = exc
    finally:
        for t in threads:
            t.join(30)
        for sender in senders.values():
            sender.close()
        for receiver in receivers:
            receiver.close()
    # what a trainer verifying the round would send: the senders' hashes of what they hold
    trainer_parts = combine(plan, owners, {r: sender_hashes(owners, r, holding_hashes(holdings[r]))
                                           for r in owners.sender_ranks})
    return plan, outcome, trainer_parts


@pytest.mark.parametrize("layout", ["rows", "columns", "blocks"])
@pytest.mark.parametrize("kind_name", ["gloo", "shm"])
def test_a_sharded_trainers_lanes_load_each_tensor_once_all_its_parts_are_in(kind_name, layout):
    """Two trainer ranks each send their own rows of every tensor (FSDP2's Shard(0)),
    or columns (tensor parallel's Shard(1)), or four send blocks of both (FSDP2 over
    tensor parallel); the engine's loader gets each full tensor once, as soon as its
    last part is in, equal to the trainer's full tensor, and the receive holds a few
    buckets' worth, not a second copy of the model."""
    sources = [(n, t.view(-1, 64)) for n, t in _model(5)]  # rows to shard: 128 and 1024 rows of 64
    loaded: dict[str, torch.Tensor] = {}
    seen: list[str] = []

    def load(weights):
        for name, tensor in weights:
            time.sleep(0.002)
            seen.append(name)
            loaded[name] = tensor.clone()

    plan, outcome, trainer_parts = _run_sharded(kind_name, load, sources, dim=int(layout == "columns"),
                                                grid=layout == "blocks")
    assert set(outcome) == {"result"}, outcome
    digest, peak, parts = outcome["result"]
    assert digest == weights_digest(sources)  # what the trainer's full tensors hash to
    assert parts == trainer_parts  # the senders' hashes of what they hold, combined
    assert sorted(seen) == sorted(n for n, _ in sources), "a tensor loaded twice, or never"
    assert all(torch.equal(loaded[name], t) for name, t in sources)
    largest = max(t.numel() * t.element_size() for _, t in sources)
    assert peak <= 6 * BUCKET + 2 * largest < plan.total_bytes / 2, (peak, plan.total_bytes)


def test_a_round_that_does_not_verify_loads_the_same_without_hashing_its_parts():
    """The parts' digest costs the loader's thread (the round's slowest part) a hash of
    every part; a round that does not ask to verify gets none, and the same tensors."""
    sources = [(n, t.view(-1, 64)) for n, t in _model(5)]
    loaded: dict[str, torch.Tensor] = {}
    _, outcome, _ = _run_sharded("shm", lambda weights: loaded.update((n, t.clone()) for n, t in weights), sources,
                                 parts_digest=False)
    assert set(outcome) == {"result"}, outcome
    digest, _, parts = outcome["result"]
    assert parts == "" and digest == weights_digest(sources)
    assert all(torch.equal(loaded[name], t) for name, t in sources)


@pytest.mark.parametrize("kind_name", ["gloo", "shm"])
def test_a_sharded_lane_that_stops_fails_the_receive_and_stops_the_other_sender(kind_name):
    sources = [(n, t.view(-1, 64)) for n, t in _model(6)]
    started = time.monotonic()
    _, outcome, _ = _run_sharded(kind_name, lambda weights: [time.sleep(0.01) for _ in weights], sources,
                              fail_sender=1)
    assert isinstance(outcome.get("receive"), (TransferError, StepTimeoutError)), outcome
    assert "result" not in outcome
    assert time.monotonic() - started < 15, "the receive or the other sender waited out the deadline"
