"""Closes an shm receiver while its receive is still copying out of the segment.

Run as a process by ``test_transports.py``: an unmap under a reader is a SIGSEGV
that would take a test runner down, so the race runs here and the test checks this
process's exit status. Prints how many rounds it survived.

    python tests/shm_close_race.py ROUNDS
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from weightsync.plan import BucketPlan  # noqa: E402
from weightsync.transport import shm  # noqa: E402
from weightsync.transport.shm import ShmReceiver, ShmSender  # noqa: E402
from weightsync.transport.store import host_store  # noqa: E402
from weightsync.v1 import common_pb2  # noqa: E402

MIB = 1024 * 1024


def one_round(store, sources, plan, targets) -> None:
    rendezvous = common_pb2.Rendezvous(group_id="race", session_id=uuid.uuid4().hex, store_host="127.0.0.1",
                                       store_port=store.port, world_size=2,
                                       transport=common_pb2.TRANSPORT_KIND_SHM)
    sender, receiver = ShmSender(store), ShmReceiver()
    abort = threading.Event()
    deadline_at = time.monotonic() + 60

    real_unpack = shm.unpack_bucket

    def unpack_while_closing(plan_, bucket, slot, targets_):
        # An agent's shutdown closes the receiver from another thread while the
        # receive thread is inside unpack_bucket, holding a view of the slot: the
        # close lands first here, deterministically; the copy must still be safe.
        if bucket == 1:
            closer = threading.Thread(target=receiver.close)
            closer.start()
            closer.join(30)
        real_unpack(plan_, bucket, slot, targets_)

    shm.unpack_bucket = unpack_while_closing

    def send():
        try:
            sender.send(rendezvous, plan, sources, deadline_at=deadline_at, abort=abort)
        except Exception:
            pass

    def receive():
        try:
            receiver.receive(rendezvous, 1, plan, targets, deadline_at=deadline_at, abort=abort,
                             )
        except Exception:
            pass
        abort.set()

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sender.close()
    shm.unpack_bucket = real_unpack


def main() -> None:
    rounds = int(sys.argv[1])
    store = host_store("127.0.0.1", timeout_s=60)
    named = [(f"t{i}", torch.randn(32 * MIB)) for i in range(4)]  # 4 x 128 MiB, one per bucket
    plan = BucketPlan.from_tensors(named, bucket_bytes=128 * MIB)
    sources = [t for _, t in named]
    targets = [torch.empty_like(t) for t in sources]
    for done in range(1, rounds + 1):
        one_round(store, sources, plan, targets)
        print(f"survived {done}", flush=True)


if __name__ == "__main__":
    main()
