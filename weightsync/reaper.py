"""The reaper: a tiny supervisor between an agent and the engine process tree it launched.

``python -m weightsync.reaper --parent PID --grace S -- CMD ARGS...``

Why it exists: a parent-death signal (``PR_SET_PDEATHSIG``) only reaches the direct
child. An engine such as vLLM forks its own workers; if the agent is SIGKILLed, those
grandchildren would be orphaned and keep their memory (in the seed, GPUs stayed busy).
The reaper gets SIGTERM when the agent dies (parent-death signal), marks itself a
child subreaper so orphaned descendants are re-parented to it rather than to init,
and on SIGTERM, SIGINT or the engine's exit it stops every descendant: SIGTERM, a
grace period, SIGKILL. A repeated signal never cuts that short.

Then it removes the shared memory the tree left behind: every file under /dev/shm
that one of its processes had mapped, that was made after the engine started, and
that no live process maps once the tree is gone (weightsync's own transport
segments excepted: their senders own them). A process killed mid-run never unlinks
its segments, and vLLM does not always: in one test-suite run its executor's message
queues (240 and 160 MiB) and the named semaphore beside them stayed in /dev/shm after
a vLLM was stopped, and its CPU communicator never unlinks its own files at all.
Memory in /dev/shm is RAM, held until the machine restarts. A segment another
process still maps (a trainer's, for instance) is left alone. Named semaphores are
unlinked by the multiprocessing resource tracker that registered them, once the
processes sharing its pipe are gone: so the KILL round spares the trackers until the
others are dead (``kill_trackers_last``).
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


TRACKER_EXIT_S = 2.0


def is_resource_tracker(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a Python multiprocessing resource tracker: it ignores SIGTERM
    and, once every process that shares its pipe is gone, unlinks the semaphores and
    segments they registered and exits."""
    try:
        return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def kill_trackers_last(procs: list[psutil.Process]) -> list[int]:
    """SIGKILLs ``procs``, the multiprocessing resource trackers among them last, after
    up to ``TRACKER_EXIT_S`` to exit on their own (the others' deaths close their pipe):
    a tracker killed with the processes it serves leaves their named semaphores in
    /dev/shm for good (vLLM's, one per engine frozen and killed). Returns the pids
    signalled."""
    trackers = [proc for proc in procs if is_resource_tracker(proc)]
    killed: list[int] = []

    def kill(chosen) -> None:
        for proc in chosen:
            try:
                proc.kill()
                killed.append(proc.pid)
            except psutil.NoSuchProcess:
                pass

    kill(proc for proc in procs if proc not in trackers)
    if trackers:
        _, left = psutil.wait_procs(trackers, timeout=TRACKER_EXIT_S)
        kill(left)
    return killed


def reap_descendants(grace_s: float) -> list[int]:
    """TERM every descendant of this process, then KILL what is left after ``grace_s``
    (``kill_trackers_last``); returns the pids KILLed."""
    me = psutil.Process()
    killed: list[int] = []
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = me.children(recursive=True)
        if sig == signal.SIGKILL:
            killed += kill_trackers_last(procs)
        else:
            for proc in procs:
                try:
                    proc.send_signal(sig)
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


SHM_DIR = "/dev/shm"
SHM_LOOK_S = 2.0


def shm_mapped_by(pids) -> set[str]:
    """The files under /dev/shm that the processes ``pids`` have mapped
    (``/proc/PID/maps``; processes that are gone or unreadable are skipped)."""
    found: set[str] = set()
    marker = " " + SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(marker)
                    if at >= 0 and not line.endswith(" (deleted)\n"):
                        found.add(line[at + 1:].rstrip("\n"))
        except OSError:
            continue
    return found


def remove_orphaned_shm(paths: set[str], *, made_since: float) -> list[str]:
    """Unlinks each of ``paths`` that was made at or after ``made_since`` (a Unix time:
    the engine's launch) and that no live process maps any more; returns those removed.

    Never weightsync's own transport segments (``weightsync-*``): their senders own
    them, and a sender in another container (its own process namespace, the same
    /dev/shm) maps its segment where this process cannot see it. In a sticky /dev/shm
    only a file's owner can unlink it, and a process of the same owner can read every
    other's maps."""
    candidates = {p for p in paths if not os.path.basename(p).startswith("weightsync-")}
    if not candidates:
        return []
    left = candidates - shm_mapped_by(int(name) for name in os.listdir("/proc") if name.isdigit())
    removed = []
    for path in sorted(left):
        try:
            if os.stat(path).st_ctime < made_since:  # there before the engine: not its to leave
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone already, or not ours
            continue
    return removed


def _look_at_shm(seen: set[str]) -> set[str]:
    """``seen`` plus what this process's descendants map in /dev/shm now, less the
    files that no longer exist (an engine that makes and removes segments all day
    must not grow the set)."""
    seen = seen | shm_mapped_by(p.pid for p in psutil.Process().children(recursive=True))
    if len(seen) > 256:
        seen = {path for path in seen if os.path.exists(path)}
    return seen


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
    launched_at = time.time() - 1.0  # file times are coarser than the clock
    child = subprocess.Popen(command)
    code: int | None = None
    mapped: set[str] = set()  # what the tree has mapped in /dev/shm, looked at every SHM_LOOK_S
    next_look = time.monotonic()
    while not stopping:
        code = child.poll()
        if code is not None:
            break
        if os.getppid() != args.parent:
            break
        if time.monotonic() >= next_look:  # an engine that crashes leaves no maps to read afterwards
            mapped = _look_at_shm(mapped)
            next_look = time.monotonic() + SHM_LOOK_S
        time.sleep(0.05)
    mapped = _look_at_shm(mapped)
    reap_descendants(args.grace)
    for path in remove_orphaned_shm(mapped, made_since=launched_at):
        print(f"weightsync.reaper: removed {path}, which the stopped engine left in shared memory",
              file=sys.stderr, flush=True)
    if code is None:
        code = child.poll()
    return 0 if stopping and code is not None and code <= 0 else (code if code is not None else 1)


if __name__ == "__main__":
    sys.exit(main())
