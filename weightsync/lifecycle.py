"""Starting and stopping local processes so that none outlives its owner.

``spawn`` starts a child in its own process group with a parent-death signal
(Linux ``PR_SET_PDEATHSIG``), so it dies even if its owner is SIGKILLed.
``terminate_tree`` stops a process and all its descendants: SIGTERM, a grace
period, then SIGKILL for whatever is left, and it waits (bounded) until they are gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Has this process get ``sig`` when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing). A parent that died before this call is not noticed: check
    ``os.getppid()`` after it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def _parent_death_signal(sig: int):
    def arm() -> None:  # runs in the child between fork and exec
        die_with_parent(sig)
    return arm


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that ``with`` blocks and ``finally``
    clauses stop what they started (``interrupt_on_sigterm``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def interrupt_on_sigterm() -> None:
    """From now on, this process's first SIGTERM raises ``Terminated`` in its main thread
    (as Ctrl-C raises KeyboardInterrupt) instead of ending it on the spot; later ones are
    ignored, so that they cannot cut the clean-up short. Call it from the main thread."""
    def on_signal(signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(signum)
    signal.signal(signal.SIGTERM, on_signal)


def spawn(args: Sequence[str], *, env: dict[str, str] | None = None, stdout=None, stderr=None,
          cwd: str | None = None, death_signal: int = signal.SIGKILL) -> subprocess.Popen:
    """Starts ``args`` in a new process group; it gets ``death_signal`` if this process dies.

    A process group, not a session: Linux's autogroup scheduler puts each session in a
    CPU group of its own, and a thread of a mostly idle group that wakes on a CPU the
    busy groups hold can wait long for it. Each in a session of its own, an agent and
    the coordinator on a loaded two-core machine waited up to 0.6 s for a CPU beside a
    busy engine, their heartbeats lapsed and a KEEP Pause took 3.4 s instead of 30 ms
    (``docs/benchmarks.md``, "A CPU group per started process"). In their starter's
    session they share its group; their own process group still lets a tree be
    stopped as one (``os.killpg``) and keeps a terminal's Ctrl-C, which goes to the
    foreground group, away from them.

    Linux sends the death signal when the *thread* that started the child ends, not
    the process: start children from a thread that lives as long as the process (the
    main thread, an event loop's), never from a pool thread that may be retired first.
    That is why the launcher starts its engine on the agent's loop thread."""
    # stdin: none. A process outside the terminal's foreground group that read it
    # would be stopped (SIGTTIN); nothing weightsync starts reads it.
    return subprocess.Popen(list(args), env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd,
                            process_group=0,
                            preexec_fn=_parent_death_signal(death_signal) if sys.platform.startswith("linux") else None)


def weightsync_command(*args: str) -> list[str]:
    """The command line that runs ``weightsync ARGS`` with this interpreter."""
    return [sys.executable, "-m", "weightsync", *args]


def terminate_tree(pid: int, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pid`` and its descendants, SIGKILL survivors after ``grace_s``.

    Returns the pids that had to be killed. Never waits longer than about 2 x grace_s.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Children forked during the grace period are descendants too.
    try:
        alive += [c for c in root.children(recursive=True) if c not in alive]
    except psutil.NoSuchProcess:
        pass
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]


def stop_process(proc: subprocess.Popen, *, grace_s: float = 10.0) -> int | None:
    """Stops a process started with ``spawn`` and reaps it; returns its exit code."""
    if proc.poll() is None:
        terminate_tree(proc.pid, grace_s=grace_s)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=grace_s)


_handed_out: set[int] = set()
_FIXED_PORTS_FROM = 10000  # below the kernel's ephemeral range, above well-known services


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing is bound to now, for a child to bind (another process
    could still take it first, so use it at once).

    Taken from below the kernel's ephemeral range (``ip_local_port_range``) where
    there is room: a port bound to ``0``, or the local end of any outgoing
    connection, comes from that range, so a port picked there was now and then taken
    by one of the very servers or connections started before the child bound it
    (``address already in use``, seen under load). No port is handed out twice by one
    process."""
    low = _ephemeral_low()
    for _ in range(200) if low - _FIXED_PORTS_FROM >= 1000 else ():
        port = random.randrange(_FIXED_PORTS_FROM, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_for_file(path: str, *, timeout_s: float, proc: subprocess.Popen | None = None) -> str:
    """Waits until ``path`` exists and is non-empty; returns its content.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: nothing appeared within ``timeout_s``.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path) as f:
                content = f.read().strip()
            if content:
                return content
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args} exited with {proc.returncode} before writing {path}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")


def exit_without_finalizing(code: int) -> None:
    """Ends this process with ``code`` once its own orderly shutdown has run and its
    output is out, skipping the interpreter's finalization. Used where finalization
    can hang or abort after everything that matters is closed: the agent (destroying a
    gloo group retired after a failed transfer blocks until the group's pending ops
    time out, up to the transfer deadline) and the bench's trainer ranks (one was seen
    to abort, "terminate called without an active exception", after its process group
    was destroyed: torch's gloo work objects can still hold tensors when the
    interpreter finalizes, pytorch/pytorch#179291)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["exit_without_finalizing", "spawn", "weightsync_command", "terminate_tree", "stop_process", "wait_for_file", "die_with_parent",
           "interrupt_on_sigterm", "Terminated"]
