"""The reaper: a tiny supervisor between an agent and the engine process tree it launched.

``python -m weightsync.reaper --parent PID --grace S -- CMD ARGS...``

Why it exists: a parent-death signal (``PR_SET_PDEATHSIG``) only reaches the direct
child. An engine such as vLLM forks its own workers; if the agent is SIGKILLed, those
grandchildren would be orphaned and keep their memory (in the seed, GPUs stayed busy).
The reaper gets SIGTERM when the agent dies (parent-death signal), marks itself a
child subreaper so orphaned descendants are re-parented to it rather than to init,
and on SIGTERM, SIGINT or the engine's exit it stops every descendant: SIGTERM, a
grace period, SIGKILL. A repeated signal never cuts that short.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass


def reap_descendants(grace_s: float) -> list[int]:
    """TERM every descendant of this process, then KILL what is left after ``grace_s``."""
    me = psutil.Process()
    killed: list[int] = []
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = me.children(recursive=True)
        for proc in procs:
            try:
                proc.send_signal(sig)
                if sig == signal.SIGKILL:
                    killed.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
        # Reap while waiting: as a subreaper, orphans become our children.
        while time.monotonic() < deadline and me.children(recursive=True):
            _reap_zombies()
            time.sleep(0.02)
        _reap_zombies()
        if not me.children(recursive=True):
            break
        deadline = time.monotonic() + grace_s
    return killed


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync.reaper")
    parser.add_argument("--parent", type=int, required=True, help="pid of the agent that launched us")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    stopping = False

    def on_signal(signum, _frame) -> None:
        nonlocal stopping
        stopping = True  # idempotent: a second signal changes nothing

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _become_subreaper()
    if os.getppid() != args.parent:  # the agent died before our parent-death signal was armed
        return 1
    child = subprocess.Popen(command)
    code: int | None = None
    while not stopping:
        code = child.poll()
        if code is not None:
            break
        if os.getppid() != args.parent:
            break
        time.sleep(0.05)
    reap_descendants(args.grace)
    if code is None:
        code = child.poll()
    return 0 if stopping and code is not None and code <= 0 else (code if code is not None else 1)


if __name__ == "__main__":
    sys.exit(main())
