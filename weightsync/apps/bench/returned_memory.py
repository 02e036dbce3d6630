"""Memory this virtual machine hands back to its host, and waiting for it to stop.

Some virtual machines tell their host which of their pages are free (virtio-balloon's
*free page reporting*), and the host takes those pages back. On the 2-core VM this
project is measured on, the guest reports the memory a process freed about 2 s after
the free, in batches of ~600-700 MiB every ~2.3 s, and while the host takes a batch back
every CPU of the VM stands still for 25-35 ms: every process's loop lags at once, and
Linux mostly counts it as steal. Freeing 3 GiB stalls the machine five times over the
next ~10 s. A benchmark step that runs in those seconds measures the host, not the
method; the processes the bench itself just stopped (the baselines' receivers, a
cluster, the previous tensor count's trainer) are what freed the memory.

This kernel counts the reported memory (``reported_kib`` of the ``page_reporting``
module's parameters); others do not expose it, and there the bench neither measures
nor waits (``returned_kib`` is None).
"""

from __future__ import annotations

import time
from collections import deque

REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"
QUIET_S = 4.0        # longer than the ~2 s from a free to its first report
BATCH_MIB = 64       # a few MiB go back every couple of seconds on an idle machine, with no stall
MAX_SETTLE_S = 60.0  # 3 GiB freed took ~10 s to go back


def returned_kib(path: str = REPORTED_KIB) -> int | None:
    """KiB of free memory this machine has handed back to its host since boot; None
    where the kernel does not say."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def settle(*, quiet_s: float = QUIET_S, batch_mib: float = BATCH_MIB, max_s: float = MAX_SETTLE_S,
           poll_s: float = 0.1, path: str = REPORTED_KIB) -> dict | None:
    """Waits (at most ``max_s``) until ``quiet_s`` have passed in which the machine
    handed back less than ``batch_mib`` to its host. Returns what the wait saw:
    ``seconds`` waited, ``returned_mib`` meanwhile, ``quiet`` (False when ``max_s``
    ran out first); None, at once, where the kernel does not count it or ``quiet_s``
    is 0."""
    first = returned_kib(path)
    if first is None or quiet_s <= 0:
        return None
    start = time.monotonic()
    seen: deque[tuple[float, int]] = deque([(start, first)])
    while True:
        now = time.monotonic()
        value = returned_kib(path)
        if value is None:  # the counter went away: nothing more to learn from it
            return {"seconds": round(now - start, 2), "returned_mib": None, "quiet": False}
        seen.append((now, value))
        while len(seen) > 1 and seen[1][0] <= now - quiet_s:
            seen.popleft()  # keep one reading at or before the window's start
        quiet = now - start >= quiet_s and value - seen[0][1] < batch_mib * 1024
        if quiet or now - start >= max_s:
            return {"seconds": round(now - start, 2), "returned_mib": round((value - first) / 1024, 1),
                    "quiet": quiet}
        time.sleep(poll_s)


__all__ = ["returned_kib", "settle", "REPORTED_KIB", "QUIET_S"]
