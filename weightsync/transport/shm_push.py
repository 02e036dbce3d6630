"""shm's push mode: the trainer writes its tensors straight into an engine's weights
(``process_vm_writev``), where the engine's weights lie on huge pages and the
trainer's do not.

Why: a cross-memory call pins every page of the *other* process that it touches, and
on 4 KiB pages the pinning costs about as much as the copy (``cross_memory``). A
trainer that never placed its weights (``place_on_huge_pages``) holds them on 4 KiB
pages; an engine that keeps its weights in an arena (the reference engine) holds them
on 2 MiB pages. Read by the engines, the trainer's small pages are pinned; written by
the trainer, the engines' huge pages are: 1 GiB in 509 tensors into two engines,
0.12 s with one writer thread per engine, against 0.22 s for two engines reading
(this machine, docs/benchmarks.md).

A round, over the trainer's store (keys of the round's session), inside shm's direct
mode:

- the trainer offers ``push`` = a fresh random nonce, where its tensors are not on
  huge pages (``offer``);
- an engine whose targets all lie in its arenas answers ``mode/<rank>`` = ``push``,
  with ``push-to/<rank>``, the description of a beacon holding that nonce (pid,
  address, value), and ``push-targets/<rank>``, its targets' addresses (``propose``);
- the trainer reads the beacon back from that pid, says ``push-ok/<rank>`` = 1, writes
  every tensor from a thread of its own (4 MiB per kernel call) and sets
  ``written/<rank>``; or says 0 where it cannot (the kernel refuses: another user,
  Yama; no pidfd), and the engine reads directly instead;
- the engine waits for ``written/<rank>`` and sets ``done/<rank>``.

An engine cannot stop another process writing into it, so the trainer stops itself:
before every call a writer checks that the round still stands (its stop flag, which
the trainer sets as soon as its wait sees an engine's error key, an abort or the
deadline; the deadline itself) and that the engine's process is still the one it
checked (a pidfd, so a pid reused after the engine exited is never written). When a round
that offered the push mode fails, the trainer joins its writers (if any started) and
sets ``push-stopped``. An engine whose receive fails after proposing and before
``written/<rank>`` waits for that key (or for the trainer to be gone) before its
receive returns, up to ``PUSH_STOPPED_WAIT_S``; past that it keeps its targets' memory
alive for the life of the process (``quarantined``), so a late write can land only in
memory nothing reuses.

Security: the trainer writes only into the process that showed it holds this round's
nonce, at addresses that process named: an engine can make it write only into memory
the engine could write itself.

``WEIGHTSYNC_SHM_PUSH=0`` on either side turns the push mode off (engines read).
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import threading
import time

import numpy as np
import psutil
import torch.distributed as dist

from weightsync.arena import in_arenas
from weightsync.errors import StepTimeoutError, TransferError
from weightsync.transport.cross_memory import Beacon, RemoteMemory, hugepage_advice
from weightsync.transport.store import session_key, wait_for_keys

log = logging.getLogger("weightsync.transport.shm")

PUSH_STOPPED_WAIT_S = 5.0  # how long a failed engine waits for the trainer's writes to stop
_CHECK_S = 0.05  # how often the trainer looks at the engines' error keys while it writes

# Targets of failed rounds whose writer never said it stopped: kept alive, never freed.
quarantined: list[object] = []


def push_enabled() -> bool:
    """Whether this process may use the push mode (``WEIGHTSYNC_SHM_PUSH``, default on)."""
    return os.environ.get("WEIGHTSYNC_SHM_PUSH", "1") != "0"


_small_pages: bool | None = None


def on_small_pages(addresses: np.ndarray) -> bool:
    """Whether the sender's tensors at ``addresses`` are on 4 KiB pages: not in an
    arena (a trainer's placed weights, or an engine's own when it is the source of a
    catch-up), and neither the kernel nor torch's and glibc's settings put them there
    (``hugepage_advice``; read once per process, as the allocators do)."""
    global _small_pages
    if in_arenas(addresses):
        return False
    if _small_pages is None:
        _small_pages = hugepage_advice() is not None
    return _small_pages


# --- the trainer's side --------------------------------------------------------------


def offer(store: dist.Store, rendezvous, addresses: np.ndarray, wanted: bool | None) -> bytes | None:
    """Offers the round's engines to write into them (``wanted``: True always, False
    never, None where push is enabled and the trainer's tensors are on small pages);
    returns the round's nonce, or None where nothing was offered."""
    if wanted is False or (wanted is None and not (push_enabled() and on_small_pages(addresses))):
        return None
    nonce = secrets.token_bytes(16)
    store.set(session_key(rendezvous, "push"), nonce.hex().encode())
    return nonce


class _Writer:
    """The trainer's writes into one engine, on a thread of their own."""

    def __init__(self, rank: int, memory: RemoteMemory, pidfd: int, targets: np.ndarray) -> None:
        self.rank = rank
        self.memory = memory
        self.pidfd = pidfd
        self.targets = targets
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.announced = False


class Pushes:
    """The trainer's writes of one round: one thread per engine that asked, started by
    ``start``, awaited by ``wait``, stopped by ``stop`` (which every failed round
    calls)."""

    def __init__(self, store: dist.Store, rendezvous, nonce: bytes, sources: np.ndarray, sizes: np.ndarray,
                 deadline_at: float) -> None:
        self._store = store
        self._rendezvous = rendezvous
        self._nonce = nonce
        self._sources = sources
        self._sizes = sizes
        self._deadline_at = deadline_at
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._writers: list[_Writer] = []

    @property
    def ranks(self) -> tuple[int, ...]:
        """The engines being written into."""
        return tuple(w.rank for w in self._writers)

    def start(self, ranks) -> list[int]:
        """Answers each engine of ``ranks`` (which asked to be written into) and starts
        writing into those it can; returns the others (they read directly)."""
        refused = []
        for rank in ranks:
            writer = self._attach(rank)
            self._store.set(session_key(self._rendezvous, "push-ok", rank), b"0" if writer is None else b"1")
            if writer is None:
                refused.append(rank)
                continue
            writer.thread = threading.Thread(target=self._write, args=(writer,), daemon=True,
                                             name=f"weightsync-shm-push-{rank}")
            self._writers.append(writer)
            writer.thread.start()
        return refused

    def _attach(self, rank: int) -> _Writer | None:
        """The engine's memory, where its beacon holds this round's nonce and the kernel
        lets this process write there; None otherwise (logged)."""
        description = self._store.get(session_key(self._rendezvous, "push-to", rank))
        targets = np.frombuffer(self._store.get(session_key(self._rendezvous, "push-targets", rank)), np.uint64)
        if len(targets) != len(self._sources):
            raise TransferError(f"engine rank {rank} named {len(targets)} target addresses for a plan of "
                                f"{len(self._sources)}")
        try:
            value = description.decode().rsplit("|", 1)[1]
        except (UnicodeDecodeError, IndexError):
            value = ""
        if value != self._nonce.hex():
            raise TransferError(f"engine rank {rank} answered the push offer without this round's nonce")
        memory = RemoteMemory.attach(description)
        if memory is None:
            log.info("shm push: cannot reach the memory of engine rank %d; it reads directly", rank)
            return None
        try:
            pidfd = os.pidfd_open(memory.pid)
        except (AttributeError, OSError) as exc:  # no pidfd here: a reused pid could not be told apart
            log.info("shm push: no pidfd for engine rank %d (%s); it reads directly", rank, exc)
            return None
        if not memory.beacon_matches():  # the pid was the engine's when the pidfd was opened
            os.close(pidfd)
            return None
        return _Writer(rank, memory, pidfd, targets)

    def _write(self, writer: _Writer) -> None:
        def before_call() -> None:
            if self._stop.is_set():
                raise TransferError("the round stopped")
            if time.monotonic() >= self._deadline_at:
                raise StepTimeoutError("deadline exceeded during broadcast", operation="broadcast")
            if select.select([writer.pidfd], [], [], 0)[0]:  # readable: the process exited
                raise TransferError(f"engine rank {writer.rank} (pid {writer.memory.pid}) exited")
        try:
            writer.memory.write(self._sources, writer.targets, self._sizes, before_call)
        except BaseException as exc:
            writer.error = exc
        finally:
            self._finished.set()

    def wait(self, errors: list[str], abort: threading.Event) -> None:
        """Until every writer is done, announcing each (``written/<rank>``) as it ends;
        raises on a writer's error, an engine's error key, abort or the deadline."""
        next_check = 0.0
        while True:
            self._finished.clear()
            running = False
            for writer in self._writers:
                if writer.thread.is_alive():
                    running = True
                elif writer.error is not None:
                    raise writer.error
                elif not writer.announced:
                    self._store.set(session_key(self._rendezvous, "written", writer.rank), b"1")
                    writer.announced = True
            if not running:
                return
            if abort.is_set():
                raise TransferError("broadcast aborted")
            if time.monotonic() >= self._deadline_at:
                raise StepTimeoutError("deadline exceeded during broadcast", operation="broadcast")
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _CHECK_S
                for key in errors:
                    if self._store.check([key]):
                        raise TransferError(f"peer reported failure: {self._store.get(key).decode(errors='replace')}")
            self._finished.wait(_CHECK_S)

    def stop(self) -> None:
        """Stops every writer (each ends before its next call, at most 4 MiB away), then
        tells the engines (``push-stopped``). Never raises."""
        self._stop.set()
        for writer in self._writers:
            writer.thread.join(10.0)
        say_stopped(self._store, self._rendezvous)
        self.close()

    def close(self) -> None:
        for writer in self._writers:
            if writer.pidfd >= 0 and not writer.thread.is_alive():
                os.close(writer.pidfd)
                writer.pidfd = -1

    @staticmethod
    def keys(rendezvous, ranks) -> list[str]:
        """The round's push keys, for the trainer to delete after a good round."""
        return [session_key(rendezvous, "push")] + [
            session_key(rendezvous, name, r) for r in ranks for name in ("push-to", "push-targets", "push-ok",
                                                                         "written")]


def say_stopped(store: dist.Store, rendezvous) -> None:
    """Tells the round's engines that no write of this trainer's is under way or will
    come (``push-stopped``), after a failed round that offered the push mode. Never
    raises."""
    try:
        store.set(session_key(rendezvous, "push-stopped"), b"1")
    except Exception:
        pass


# --- the engine's side ---------------------------------------------------------------


def propose(store: dist.Store, rendezvous, rank: int, addresses: np.ndarray | None,
            wanted: bool | None) -> Beacon | None:
    """Asks the trainer to write into this engine's targets at ``addresses`` where it
    offered to (``wanted``: True whenever offered, False never, None where push is
    enabled and every target lies in an arena of this process). Returns the beacon
    holding the nonce (keep it alive until the round ends), or None where nothing was
    asked."""
    offer_key = session_key(rendezvous, "push")
    if addresses is None or wanted is False or not store.check([offer_key]):
        return None
    if wanted is None and not (push_enabled() and in_arenas(addresses)):
        return None
    try:
        nonce = bytes.fromhex(store.get(offer_key).decode())
    except ValueError as exc:
        raise TransferError(f"the trainer's push offer is not a nonce: {exc}") from None
    beacon = Beacon(nonce)
    store.set(session_key(rendezvous, "push-targets", rank), addresses.tobytes())
    store.set(session_key(rendezvous, "push-to", rank), beacon.describe())
    return beacon


def accepted(store: dist.Store, rendezvous, rank: int, *, deadline_at: float, abort, stop_keys) -> bool:
    """Whether the trainer will write into this engine (else the engine reads)."""
    key = session_key(rendezvous, "push-ok", rank)
    wait_for_keys(store, [key], deadline_at=deadline_at, operation="receive", abort=abort, fail_keys=stop_keys)
    return store.get(key) == b"1"


def await_written(store: dist.Store, rendezvous, rank: int, *, deadline_at: float, abort, stop_keys) -> None:
    """Until the trainer says it wrote every byte into this engine."""
    wait_for_keys(store, [session_key(rendezvous, "written", rank)], deadline_at=deadline_at,
                  operation="receive", abort=abort, fail_keys=stop_keys)


def settle_after_failure(store: dist.Store, rendezvous, trainer_pid: int, targets) -> None:
    """After a failed receive that asked to be written into: returns once the trainer
    said its writes stopped or is gone; after ``PUSH_STOPPED_WAIT_S`` without either,
    keeps ``targets`` (and the memory under them) alive for good and logs why."""
    deadline_at = time.monotonic() + PUSH_STOPPED_WAIT_S
    key = session_key(rendezvous, "push-stopped")
    while time.monotonic() < deadline_at:
        try:
            if store.check([key]):
                return
        except Exception:  # the store is gone: the trainer may be too
            pass
        if not _alive(trainer_pid):
            return
        time.sleep(0.01)
    quarantined.append(targets)
    log.warning("shm push: the trainer (pid %d) did not say its writes into this engine stopped within %.0f s; "
                "the targets' memory is kept (never freed) so that a late write lands nowhere in use",
                trainer_pid, PUSH_STOPPED_WAIT_S)


def _alive(pid: int) -> bool:
    """Whether ``pid`` may still write (a zombie cannot)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


__all__ = ["PUSH_STOPPED_WAIT_S", "Pushes", "accepted", "await_written", "offer", "on_small_pages", "propose",
           "push_enabled", "quarantined", "say_stopped", "settle_after_failure"]
