"""A rendezvous that fails before any byte moves: the Receive ends by its deadline even
when the trainer's store never answers, the engines keep their weights (not torn), the
error says the transfer never started, and the agents are free for the next round.

Real coordinator and agents; the "trainer" here is a raw gRPC client that names a store
address of its choosing: a socket that accepts connections and never answers (torch's
client would wait for it forever), or a port nobody listens on.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.packing import weights_digest
from weightsync.plan import BucketPlan
from weightsync.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEADLINE_S = 3.0
TRANSPORTS = {"gloo": common_pb2.TRANSPORT_KIND_GLOO, "shm": common_pb2.TRANSPORT_KIND_SHM}


def _silent_store() -> socket.socket:
    """A listening socket that never accepts: the kernel completes each connection, and
    nothing ever answers torch's handshake."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("store", ["silent", "closed"])
async def test_a_store_that_fails_ends_the_receive_by_its_deadline_and_tears_nothing(cluster, transport, store):
    model = ReferenceLM(PRESETS["tiny"])
    plan = BucketPlan.from_tensors(model.named_parameters())
    silent = _silent_store() if store == "silent" else None
    port = silent.getsockname()[1] if silent else _closed_port()
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            coordinator.Pause(coordinator_pb2.PauseRequest(idempotency_key=f"pause-{transport}-{store}",
                                                             mode=common_pb2.PAUSE_MODE_ABORT), timeout=30)
            started = time.monotonic()
            events = list(coordinator.Broadcast(coordinator_pb2.BroadcastRequest(
                idempotency_key=f"broadcast-{transport}-{store}", version=1, plan=plan.to_proto(),
                transport=TRANSPORTS[transport], store_host="127.0.0.1", store_port=port, timeout_s=DEADLINE_S),
                timeout=60))
            took = time.monotonic() - started
            result = next(e.result for e in events if e.HasField("result"))
            assert not result.ok
            # Receive's own deadline, plus its 1 s allowance, plus the validation
            # step before it and the trip back: the Broadcast ends well within 3 s more.
            assert took < DEADLINE_S + 3.0, f"the Broadcast took {took:.1f}s with a {DEADLINE_S}s deadline"
            for outcome in result.engines:
                assert not outcome.ok and not outcome.torn, outcome
                assert "never started" in outcome.error_message, outcome.error_message
            state = coordinator.GetState(coordinator_pb2.GetStateRequest(), timeout=10)
            assert all(not e.torn and not e.receiving for e in state.engines), state.engines
            # Not torn, so a plain Resume (no allow_torn) brings the engines back.
            resumed = coordinator.Resume(coordinator_pb2.ResumeRequest(idempotency_key=f"resume-{transport}-{store}"),
                                         timeout=30)
            assert all(o.ok for o in resumed.engines), resumed
    finally:
        if silent is not None:
            silent.close()
    # The agents are free at once: a real round succeeds, bitwise equal to the trainer.
    async with TrainerClient(cluster.address, transport=transport) as client:
        synced = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
        assert synced.ok
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
