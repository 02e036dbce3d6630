"""Letting an event loop in while a worker thread walks thousands of tensors in Python.

A thread that runs Python keeps the GIL until the interpreter makes it switch, which
it does only ``sys.getswitchinterval()`` (5 ms by default) after another thread asked
for it. So an asyncio loop that wakes while a worker thread is in a long Python loop
waits up to 5 ms for each wake-up, and longer when the machine is busy: the trainer's
per-step pass over a 20k-tensor model (~20 ms of Python) made its loop 5.5 ms late at
every wake-up and up to 15.8 ms in a round, in rounds the hypervisor took nothing
from. Setting a shorter switch interval would change it for the whole process, the
user's own threads included; instead such loops call ``hand_over_gil`` every
``HAND_OVER_EVERY`` items: ``time.sleep(0)`` releases the GIL around a system call
that returns at once, and a thread waiting for it takes it there.

Measured on the trainer of a real round (1 GiB in 19997 tensors, shm, 2 engines, 8
rounds per variant, two alternations): the loop's worst lateness per round was
5.4-11.1 ms as is and 2.0-4.5 ms with ``time.sleep(0)`` every 1024 tensors (one round
12.9 ms). Not ``os.sched_yield``, which gives up the CPU as well: on a busy machine
the worker thread then waited for a CPU with the loop's next hand-back pending, and
the loop's worst lateness grew to 12-21 ms in most rounds.
"""

from __future__ import annotations

import time

HAND_OVER_EVERY = 1024  # items between hand-overs: about 1 ms of per-tensor Python


def hand_over_gil() -> None:
    """Lets a thread waiting for the GIL (an event loop) take it now; returns at once
    when none is waiting. Call it from worker threads, never from the event loop."""
    time.sleep(0)


__all__ = ["HAND_OVER_EVERY", "hand_over_gil"]
