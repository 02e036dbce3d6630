"""A trainer that stops at a chosen point of ``update_weights``, for the retry tests.

``InterruptibleClient(stop_at=POINT, on_reached=fn)`` is a real ``TrainerClient`` that
calls ``fn`` at POINT and then goes on (``pause``, ``broadcast``, ``resume``: the step
is in flight) or waits forever (``after-pause``, ``after-broadcast``: the next step
is never sent). The test then cancels the task or, with this file run as a script,
SIGKILLs the process once it printed ``REACHED``:

    python tests/interrupted_trainer.py COORDINATOR KEY VERSION POINT MODE

As a script it prints ``READY`` once connected and starts the sync only when a line
comes on stdin: the test sets the fleet up (a generation holding a WAIT pause) after
the process's slow start, not before it, so a loaded machine cannot let the
generation end before the Pause arrives.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from weightsync import transport as transports
from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM

POINTS = ("pause", "after-pause", "broadcast", "after-broadcast", "resume")
SEND_DELAY_S = 1.5  # "broadcast": how long the send waits once it started (bytes are due)


def model_of(version: int) -> ReferenceLM:
    """The trainer's model at ``version``: the same weights in every process."""
    torch.manual_seed(version)
    return ReferenceLM(PRESETS["tiny"])


class _DelayedSender:
    """A lane's sender that reports it started, then waits before sending: the engines
    are waiting for bytes when the trainer is interrupted."""

    def __init__(self, sender, on_reached) -> None:
        self._sender, self._on_reached = sender, on_reached

    def send(self, *args, **kwargs):
        self._on_reached()
        time.sleep(SEND_DELAY_S)
        return self._sender.send(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sender, name)


class InterruptibleClient(TrainerClient):
    """See the module docstring."""

    def __init__(self, *args, stop_at: str, on_reached, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if stop_at not in POINTS:
            raise ValueError(f"stop_at must be one of {POINTS}")
        self.stop_at, self._on_reached, self._fired = stop_at, on_reached, False

    def _reach(self, point: str) -> bool:
        if self.stop_at != point or self._fired:
            return False
        self._fired = True
        self._on_reached()
        return True

    async def pause(self, **kwargs):
        if self.stop_at != "pause" or self._fired:
            return await super().pause(**kwargs)
        call = asyncio.ensure_future(super().pause(**kwargs))
        await asyncio.sleep(0.3)  # the coordinator is pausing (a WAIT pause held by a generation)
        if not call.done():
            self._reach("pause")
        return await call

    async def broadcast(self, *args, **kwargs):
        if self._reach("after-pause"):
            await asyncio.Event().wait()
        return await super().broadcast(*args, **kwargs)

    def _start_send(self, rendezvous, prepared):
        lane = (rendezvous.transport, rendezvous.lane)
        if self.stop_at == "broadcast" and lane not in self._senders:
            # The lane's sender, made here as the client would make it, behind the delay.
            store = self.stores.secure.client()
            self._senders[lane] = _DelayedSender(
                transports.make_sender(rendezvous.transport, store, data_host=self.host),
                lambda: self._reach("broadcast"))
        return super()._start_send(rendezvous, prepared)

    async def resume(self, **kwargs):
        if self._reach("after-broadcast"):  # the broadcast returned; Resume is never sent
            await asyncio.Event().wait()
        if self.stop_at != "resume" or self._fired:
            return await super().resume(**kwargs)
        call = asyncio.ensure_future(super().resume(**kwargs))
        await asyncio.sleep(0.2)  # sent; the agents' Resume is slowed in the tests
        self._reach("resume")
        return await call


async def _main(coordinator: str, key: str, version: int, point: str, mode: str) -> None:
    def reached() -> None:
        print("REACHED", flush=True)

    model = model_of(version)
    async with InterruptibleClient(coordinator, stop_at=point, on_reached=reached) as client:
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        await client.update_weights(model.named_parameters(), version=version, key=key, mode=mode, timeout_s=60)
    print("FINISHED", flush=True)
    await asyncio.Event().wait()  # the test kills this process, after or before the call's end


if __name__ == "__main__":
    address, sync_key, version_arg, stop, pause_mode = sys.argv[1:6]
    asyncio.run(_main(address, sync_key, int(version_arg), stop, pause_mode))
