"""GPU tests (marker ``gpu``): the group transport with CUDA tensors. Skipped without
CUDA; the nccl test needs two GPUs (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from weightsync import transport as transports
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan
from weightsync.transport.store import host_store
from weightsync.v1 import common_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GROUP = common_pb2.TRANSPORT_KIND_GROUP


def rendezvous(store, backend: str) -> common_pb2.Rendezvous:
    return common_pb2.Rendezvous(group_id=f"gpu-{uuid.uuid4().hex[:8]}", transport=GROUP, store_host="127.0.0.1",
                                 store_port=store.port, world_size=2, session_id=uuid.uuid4().hex,
                                 group_backend=backend)


def one_round(backend: str, sources: list[torch.Tensor], targets: list[torch.Tensor], receiver_device: int | None):
    store = host_store("127.0.0.1", timeout_s=60)
    rdzv = rendezvous(store, backend)
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=1 << 20)
    sender, receiver = transports.make_sender(GROUP, store), transports.make_receiver(GROUP)
    errors: list[BaseException] = []

    def receive():
        try:
            if receiver_device is not None:
                torch.cuda.set_device(receiver_device)
            receiver.receive(rdzv, 1, plan, targets, deadline_at=time.monotonic() + 60, abort=threading.Event())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 60, abort=threading.Event())
    finally:
        thread.join(70)
        sender.close()
        receiver.close()
    assert errors == []


def test_gloo_group_lands_cpu_weights_in_gpu_tensors():
    """What an SGLang or vLLM worker on a GPU does with a CPU trainer: gloo on the
    wire, the bytes staged in host memory and copied into CUDA tensors."""
    sources = [torch.randn(1024, 257), torch.randn(3000).to(torch.bfloat16), torch.arange(11)]
    targets = [torch.zeros(s.shape, dtype=s.dtype, device="cuda") for s in sources]
    one_round("gloo", sources, targets, receiver_device=None)
    assert weights_digest([(f"t{i}", t) for i, t in enumerate(targets)]) == \
        weights_digest([(f"t{i}", t) for i, t in enumerate(sources)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_group_moves_cuda_weights_between_gpus():
    torch.cuda.set_device(0)
    sources = [torch.randn(4096, 1024, device="cuda:0"), torch.randn(77, device="cuda:0").to(torch.bfloat16)]
    targets = [torch.zeros(s.shape, dtype=s.dtype, device="cuda:1") for s in sources]
    one_round("nccl", sources, targets, receiver_device=1)
    for s, t in zip(sources, targets, strict=True):
        assert torch.equal(s.cpu(), t.cpu())
