"""The address an agent registers is one the coordinator and peers can reach.

An agent listening on a wildcard (``0.0.0.0``) used to register as ``0.0.0.0:PORT``,
which no other host can reach. Now it registers this host's address on the route to
the coordinator, or the host given with ``--advertise``; the coordinator refuses a
wildcard registration. (Across real hosts: issue #18's network-namespace tests.)
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from tests.test_attestation import perturbed
from weightsync.client import TrainerClient
from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc


@pytest.mark.parametrize("advertise", [(), ("--advertise", "localhost")], ids=["route", "advertised"])
async def test_an_agent_on_a_wildcard_registers_a_reachable_address(cluster_factory, advertise):
    cluster = cluster_factory(2, agent_args=("--listen", "0.0.0.0:0", *advertise))
    expected_host = "localhost" if advertise else "127.0.0.1"  # the route to a coordinator on 127.0.0.1
    async with TrainerClient(cluster.address) as client:
        state = await client.get_state()
        hosts = {e.address.rpartition(":")[0] for e in state.engines}
        assert hosts == {expected_host}, [e.address for e in state.engines]
        assert {a.address for a in cluster.agents} == {e.address for e in state.engines}
        assert (await client.update_weights(perturbed(1).named_parameters(), version=1, timeout_s=60)).ok


@pytest.mark.parametrize("bad", ["0.0.0.0", "127.0.0.1:5000", "two words"])
def test_a_bad_advertised_host_refuses_to_start(bad):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "agent", "--insecure", "--coordinator", "127.0.0.1:1",
                           "--advertise", bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--advertise takes a host" in proc.stderr, proc.stderr


async def test_the_coordinator_refuses_a_wildcard_registration(cluster):
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterEngine(coordinator_pb2.RegisterEngineRequest(
                idempotency_key="wildcard", engine_id="engine-9", agent_address="0.0.0.0:5000"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--advertise" in info.value.details()
