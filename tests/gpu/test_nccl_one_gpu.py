"""GPU checks (marker ``gpu``) of weightsync's NCCL calls that one GPU allows: NCCL
refuses two ranks on one device, but a communicator of one rank, or one whose other
rank never comes, needs a single GPU. They check on the real library what the CPU
suite checks against a stand-in (tests/nccl_standin.c): the non-blocking build with
weightsync's config, a broadcast settled and completed, ``ncclCommAbort`` of a build
whose peer never comes returning by the deadline, and the nccl transport's and the
nccl group's sending side end to end. Skipped without CUDA; last in tests/gpu, so a
hang here costs the device kit nothing else."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from weightsync import transport as transports
from weightsync.errors import StepTimeoutError
from weightsync.plan import BucketPlan
from weightsync.transport import nccl_lib
from weightsync.transport.nccl import join_communicator
from weightsync.transport.store import host_store
from weightsync.v1 import common_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rendezvous(store, kind: int, world_size: int, backend: str = "") -> common_pb2.Rendezvous:
    return common_pb2.Rendezvous(group_id=f"one-{uuid.uuid4().hex[:8]}", transport=kind, store_host="127.0.0.1",
                                 store_port=store.port, world_size=world_size, session_id=uuid.uuid4().hex,
                                 group_backend=backend)


def _build(world_size: int, unique_id: bytes):
    def build(store):
        torch.cuda.set_device(0)  # the side thread's GPU
        return nccl_lib.Communicator(world_size, unique_id, 0)
    return build


def _settle(comm, deadline_at: float):
    def settle() -> None:
        while not comm.ready():
            assert time.monotonic() < deadline_at, "NCCL kept the broadcast in progress"
            time.sleep(0.0005)
    return settle


def test_a_one_rank_communicator_is_built_non_blocking_broadcasts_and_aborts():
    store = host_store("127.0.0.1", timeout_s=60)
    rdzv = rendezvous(store, common_pb2.TRANSPORT_KIND_NCCL, 1)
    deadline_at = time.monotonic() + 60
    comm = join_communicator(_build(1, nccl_lib.new_unique_id()), rdzv, deadline_at=deadline_at,
                             abort=threading.Event(), watch=store, stop_keys=[])
    try:
        assert not comm.blocking and nccl_lib.version() >= 21400
        data = torch.arange(3 << 20, dtype=torch.int32, device="cuda:0")
        expected = data.clone()
        stream = torch.cuda.Stream(0)
        stream.wait_stream(torch.cuda.current_stream(0))
        comm.broadcast(data.data_ptr(), data.nbytes, stream.cuda_stream, settle=_settle(comm, deadline_at))
        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():
            comm.check()
            assert time.monotonic() < deadline_at
            time.sleep(0.001)
        assert torch.equal(data, expected)  # rank 0 broadcasts in place: its bytes stay
    finally:
        comm.abort()


def test_a_build_whose_peer_never_comes_is_aborted_by_its_deadline_and_the_gpu_stays_usable():
    store = host_store("127.0.0.1", timeout_s=60)
    rdzv = rendezvous(store, common_pb2.TRANSPORT_KIND_NCCL, 2)
    started = time.monotonic()
    with pytest.raises(StepTimeoutError):
        join_communicator(_build(2, nccl_lib.new_unique_id()), rdzv, deadline_at=started + 3,
                          abort=threading.Event(), watch=store, stop_keys=[])
    assert time.monotonic() - started < 30, "ncclCommAbort of a build still joining took long"
    comm = join_communicator(_build(1, nccl_lib.new_unique_id()), rendezvous(store, common_pb2.TRANSPORT_KIND_NCCL, 1),
                             deadline_at=time.monotonic() + 60, abort=threading.Event(), watch=store, stop_keys=[])
    comm.abort()


@pytest.mark.parametrize("kind, backend", [(common_pb2.TRANSPORT_KIND_NCCL, ""),
                                           (common_pb2.TRANSPORT_KIND_GROUP, "nccl")])
def test_the_sending_side_runs_end_to_end_in_a_group_of_one(kind, backend):
    """The trainer's whole send (buckets packed on the device, double-buffered,
    broadcast, waited for; for the group, the communicator built as the group is
    joined), three rounds reusing the group, with no engine: a world of one rank."""
    torch.cuda.set_device(0)
    store = host_store("127.0.0.1", timeout_s=60)
    g = torch.Generator(device="cpu").manual_seed(0)
    named = [(f"w{i}", torch.randn(1000 + i, generator=g).to("cuda")) for i in range(40)]
    named.append(("big", torch.randn(700_000, generator=g).to("cuda")))  # spans buckets
    plan = BucketPlan.from_tensors(named, bucket_bytes=1 << 20)
    sender = transports.make_sender(kind, store)
    first = rendezvous(store, kind, 1, backend)
    try:
        for _ in range(3):
            rdzv = common_pb2.Rendezvous()
            rdzv.CopyFrom(first)
            rdzv.session_id = uuid.uuid4().hex  # a round of its own in the same group
            stats = sender.send(rdzv, plan, [t for _, t in named], deadline_at=time.monotonic() + 60,
                                abort=threading.Event())
            assert stats.bytes == plan.total_bytes
    finally:
        sender.close()
