"""Which host this process runs on, as the data plane sees it.

Two processes may use shared memory and loopback between them only when they share
a machine's boot (``/proc/sys/kernel/random/boot_id``), its network namespace
(containers and simulated hosts each have their own) and its ``/dev/shm`` (a
container's private tmpfs is another). The host id is a digest of those three: equal
for processes that can use shm with each other, different otherwise. A hostname or an
IP address says neither (containers share hostnames; hosts share 127.0.0.1).
"""

from __future__ import annotations

import functools
import hashlib
import os


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_id(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


@functools.cache
def host_id() -> str:
    """This process's host id (16 hex digits; cached: it cannot change while it runs)."""
    parts = (_read("/proc/sys/kernel/random/boot_id"), _stat_id("/proc/self/ns/net"), _stat_id("/dev/shm"))
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


__all__ = ["host_id"]
