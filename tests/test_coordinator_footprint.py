"""The coordinator is a control plane: it never loads torch.

It checks plans, owners and probes, plans lanes and drives rounds; it never holds a
tensor. Without torch it starts in a fraction of the time (about 0.4 s against 1.5-3 s
here) and holds about 55 MB instead of 240. A lazy import taken on the first round
would also block its event loop for a second or more, so the check runs after rounds
over every CPU transport, an attested round and a catch-up, and reads the process's
memory map (``/proc/PID/maps``): what the kernel mapped, not what the code says.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.test_attestation import perturbed, probe_of
from tests.test_fencing import engines_by_id, until
from weightsync.client import TrainerClient

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/maps (Linux)")


def torch_loaded(pid: int) -> bool:
    """Whether torch's native library is mapped into process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch" in line for line in maps)


async def test_the_coordinator_never_loads_torch(cluster_factory):
    cluster = cluster_factory(2, coordinator_args=("--catch-up-transport", "auto"))
    coordinator = cluster.coordinator.proc.pid
    assert torch_loaded(cluster.agents[0].proc.pid), "the check must see torch where it is loaded"
    assert not torch_loaded(coordinator), "at start-up"
    async with TrainerClient(cluster.address) as client:
        for version, transport in enumerate(("shm", "gloo", "group", "auto"), start=1):
            model = perturbed(version)
            result = await client.update_weights(model.named_parameters(), version=version, transport=transport,
                                                 attest=probe_of(model), verify_digest=True, timeout_s=60)
            assert result.ok, (transport, result)
        joiner = await asyncio.to_thread(cluster.start_agent, "engine-2")

        async def caught_up():
            engine = engines_by_id(await client.get_state()).get("engine-2")
            return engine is not None and engine.ready and engine.weight_version == 4
        await until(caught_up, timeout_s=30, what="engine-2 caught up from a peer")
    assert joiner.proc.poll() is None
    assert not torch_loaded(coordinator), "after rounds over shm, gloo, group and auto, attested, and a catch-up"
