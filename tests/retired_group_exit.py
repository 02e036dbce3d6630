"""Run by ``test_retired_groups.py``: a process retires a failed gloo group with no op
running (its peer was killed) and exits at once, while the retire thread may be
destroying it. Before the exit handler waited for that, every such exit aborted
("terminate called without an active exception", exit code -6).

``python tests/retired_group_exit.py main`` (the peer is this script with ``peer``)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from weightsync.transport import collective


class _Holder:
    """What a transport hands to ``retire``: a group as ``.pg`` and its op timeout."""

    def __init__(self, pg, timeout_s: float) -> None:
        self.pg, self.timeout_s = pg, timeout_s


def main() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=20), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, __file__, "peer", str(store.port)], stdout=subprocess.PIPE)
    try:
        pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=30))
        peer.stdout.readline()  # the peer is in the group
    finally:
        peer.kill()
        peer.wait()
    holder = _Holder(pg, 30.0)
    del pg  # the holder's is the only reference: the retire thread's drop destroys the group
    collective.retire(holder)  # no op running: dropped at once, on the retire thread


def peer(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=20))
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=30))
    print("joined", flush=True)
    del pg
    time.sleep(60)  # killed by main


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        peer(int(sys.argv[2]))
    else:
        main()
