"""A coordinator whose state database's disk fills up (trainers' checkpoints fill disks).

The coordinator's SQLite state lives on a small tmpfs of its own, filled to the last
byte mid-run with a file and emptied again: the real ENOSPC, through SQLite. Found
that way: every call failed with an untyped "UNKNOWN: database or disk is full", and a
round whose Broadcast failed so left its engines paused (its Resume could not be
recorded either): no engine served anything until the disk had room again and
someone resumed them. Real coordinator and agent processes; the reference is the
trainer's own model. Needs root (mount); skips with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess

import pytest

from tests.test_e2e import perturbed
from tests.test_sync_safety import slow
from weightsync.client import EngineClient, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import StateNotWritable


def _mount_reason() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small tmpfs for the coordinator's state needs root"
    return None


pytestmark = pytest.mark.skipif(_mount_reason() is not None, reason=str(_mount_reason()))


class SmallDisk:
    """A 4 MiB tmpfs; ``fill()`` takes every free byte, ``free()`` gives them back."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.filler = os.path.join(path, "filler")

    def fill(self) -> None:
        with contextlib.suppress(OSError), open(self.filler, "ab", buffering=0) as f:  # ENOSPC ends it
            while True:
                f.write(b"\0" * 4096)
        assert os.statvfs(self.path).f_bavail == 0

    def free(self) -> None:
        os.remove(self.filler)


@pytest.fixture
def small_disk(tmp_path):
    path = str(tmp_path / "state")
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


async def engines(client: TrainerClient) -> list[tuple[int, bool, bool, bool]]:
    """(version, paused, torn, ready) of every engine."""
    return [(e.weight_version, e.paused, e.torn, e.ready) for e in (await client.get_state()).engines]


async def test_a_full_disk_refuses_what_has_not_started_and_never_leaves_engines_paused(cluster_factory,
                                                                                        small_disk):
    cluster = cluster_factory(2, coordinator_args=("--state-db", os.path.join(small_disk.path, "state.db")))
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        perturbed(model, 1)
        assert (await client.update_weights(model.named_parameters(), version=1, timeout_s=60)).ok

        # Full before the sync: refused typed at its Pause; the engines never stopped.
        small_disk.fill()
        perturbed(model, 2)
        with pytest.raises(StateNotWritable, match="disk is full"):
            await client.update_weights(model.named_parameters(), version=2, timeout_s=30)
        assert await engines(client) == [(1, False, False, True)] * 2

        # Full between a Pause and its Broadcast: the Broadcast is refused, nothing moved,
        # and the Resume (update_weights always resumes) still releases the engines.
        small_disk.free()
        await client.pause()
        small_disk.fill()
        with pytest.raises(StateNotWritable):
            await client.update_weights(model.named_parameters(), version=2, timeout_s=30)
        assert await engines(client) == [(1, False, False, True)] * 2
        # A Resume whose key cannot be written runs all the same, and the same key again
        # is answered from memory, not run twice.
        small_disk.free()
        await client.pause()
        small_disk.fill()
        again = await client.resume(key="resume-while-full")
        assert [e.ok for e in again.engines] == [True, True]
        assert (await client.resume(key="resume-while-full")) == again

        small_disk.free()
        assert (await client.update_weights(model.named_parameters(), version=2, timeout_s=60)).ok
        check = await client.check_engines(model.named_parameters(), version=2)
        assert check.ok, check.describe()
    assert cluster.coordinator.proc.poll() is None


async def test_a_broadcast_whose_outcome_cannot_be_written_is_still_reported(cluster_factory, small_disk):
    # The engines take 0.2 s per bucket of version 2, so the disk fills while the bytes move.
    cluster = cluster_factory(2, coordinator_args=("--state-db", os.path.join(small_disk.path, "state.db")),
                              agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps([slow(2, 0.2)])})
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=64 * 1024) as client:
        perturbed(model, 1)
        assert (await client.update_weights(model.named_parameters(), version=1, timeout_s=60)).ok
        perturbed(model, 2)
        sync = asyncio.ensure_future(client.update_weights(model.named_parameters(), version=2, timeout_s=60))
        # The bytes are moving (an engine started its transfer): the round's own save
        # before the transfer has happened. A disk filled before that save refuses the
        # Broadcast with nothing changed, which is another test's case.
        async with EngineClient(cluster.agents[0].address) as engine:
            while not any(e.kind == "transfer_started" and e.fields.get("version") == "2"
                          for e in await engine.events()):
                assert not sync.done(), sync
                await asyncio.sleep(0.02)
        small_disk.fill()
        result = await sync
        # The engines did move and resume: that is what the trainer hears, not the disk.
        assert result.ok and result.version == 2 and result.resumed == ("engine-0", "engine-1"), result
        state = await client.get_state()
        assert state.weight_version == 2 and state.round.phase == "idle", state
        assert await engines(client) == [(2, False, False, True)] * 2
        check = await client.check_engines(model.named_parameters(), version=2)
        assert check.ok, check.describe()
        small_disk.free()
        perturbed(model, 3)
        assert (await client.update_weights(model.named_parameters(), version=3, timeout_s=60)).ok
