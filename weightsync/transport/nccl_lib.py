"""The few NCCL calls the nccl transport makes, through ctypes.

Why not cupy's ``NcclCommunicator``: its constructor calls ``ncclCommInitRank`` and its
``destroy``/``abort`` call ``ncclCommDestroy``/``ncclCommAbort`` while holding the GIL.
``ncclCommInitRank`` blocks until every rank has joined, so a peer that is late (or
dead) would freeze every thread of the process with it -- an agent's event loop and
heartbeats, a trainer's asyncio loop -- beyond any deadline: the seed bug, inside a
library. A ctypes foreign call releases the GIL for its whole duration, so here a
blocking NCCL call holds only the thread that made it.

Communicators are non-blocking (``ncclCommInitRankConfig`` with ``blocking = 0``,
NCCL 2.14 and later): no call waits on a peer. Building one returns at once while
NCCL joins the peers on a thread of its own, and a broadcast may return
``ncclInProgress`` before its kernel is on the stream; the caller polls ``ready``
(``ncclCommGetAsyncError``) with its deadline, and a communicator that cannot get
ready is ended by ``abort``, which stops NCCL's joining thread too. A blocking build
left behind by a deadline would stay blocked in its thread, holding the GPU, until
its peers came or the process ended. An older NCCL gets blocking communicators, and
so does a process with ``WEIGHTSYNC_NCCL_BLOCKING=1`` (for an NCCL whose non-blocking
mode misbehaves: torch stopped choosing it by default after random hangs with NCCL
2.26); their build blocks the side thread that runs it, and the deadline still ends
the wait for it (``nccl.join_communicator``).

The library is ``WEIGHTSYNC_NCCL_LIBRARY`` where set (a path), else the one the
process already uses where it is loaded (torch's CUDA builds and cupy load
``libnccl.so.2``), else the ``nvidia-nccl-cu*`` wheel's.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable

from weightsync.errors import TransferError

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
NCCL_UINT8 = 1         # ncclUint8 in ncclDataType_t
NCCL_IN_PROGRESS = 7   # ncclInProgress in ncclResult_t
_MAX_COUNT = (1 << 31) - 1
# ncclConfig_t of NCCL 2.14, the release that brought non-blocking communicators. NCCL
# reads a config by its ``size`` and ``version`` and gives every field a later release
# added its default, so this layout holds for every release since.
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # NCCL_VERSION(2, 14, 0)


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """ncclConfig_t as NCCL 2.14 laid it out (see ``_CONFIG_VERSION``)."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int)]

    @classmethod
    def non_blocking(cls) -> Config:
        return cls(ctypes.sizeof(cls), _CONFIG_MAGIC, _CONFIG_VERSION, 0)


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _candidates() -> list[str]:
    chosen = os.environ.get("WEIGHTSYNC_NCCL_LIBRARY")
    if chosen:
        return [chosen]
    paths = ["libnccl.so.2", "libnccl.so"]
    for package in ("nvidia.nccl", "nvidia"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            for sub in ("lib", os.path.join("nccl", "lib")):
                paths.append(os.path.join(root, sub, "libnccl.so.2"))
    return paths


def library() -> ctypes.CDLL:
    """libnccl, with the signatures used here; TransferError when none can be loaded."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise TransferError("NCCL cannot be loaded (install nvidia-nccl-cu12 or -cu13, or torch with CUDA): "
                                + "; ".join(errors[:2]))
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(c_int)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int],
            "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclCommGetAsyncError": [c_void_p, ctypes.POINTER(c_int)],
            "ncclCommAbort": [c_void_p],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, c_int
        if hasattr(lib, "ncclCommInitRankConfig"):  # NCCL 2.14 and later
            fn = lib.ncclCommInitRankConfig
            fn.argtypes, fn.restype = [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int, ctypes.POINTER(Config)], c_int
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [c_int], ctypes.c_char_p
        _lib = lib
        return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        text = library().ncclGetErrorString(status)
        raise TransferError(f"{call} failed: {text.decode(errors='replace') if text else status} (NCCL error {status})")


def version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3)."""
    value = ctypes.c_int(0)
    _check(library().ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
    return value.value


def new_unique_id() -> bytes:
    """A fresh unique id (rank 0 draws it; the others get it through the store)."""
    uid = UniqueId()
    _check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


class Communicator:
    """One rank's communicator. Every call releases the GIL while NCCL runs."""

    def __init__(self, world_size: int, unique_id: bytes, rank: int) -> None:
        """Starts joining the ``world_size`` ranks on the CUDA device current on this
        thread. Non-blocking (see the module docstring): returns at once, and the
        communicator is usable once ``ready`` says so. A blocking one (an NCCL older
        than 2.14, or ``WEIGHTSYNC_NCCL_BLOCKING=1``) blocks here, GIL released, until
        every rank has joined."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise TransferError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p(0)
        lib = library()
        self.blocking = os.environ.get("WEIGHTSYNC_NCCL_BLOCKING") == "1" or not hasattr(lib, "ncclCommInitRankConfig")
        if self.blocking:
            _check(lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        else:
            config = Config.non_blocking()
            status = lib.ncclCommInitRankConfig(ctypes.byref(comm), world_size, uid, rank, ctypes.byref(config))
            if status != NCCL_IN_PROGRESS:
                _check(status, "ncclCommInitRankConfig")  # a failed call frees what it made
        self._comm = comm

    def ready(self) -> bool:
        """Whether the last call has finished: the build, or the queueing of a
        broadcast on its stream (a non-blocking communicator may still be at either
        when the call returns). TransferError when it failed."""
        if not self._comm:
            raise TransferError("the NCCL communicator was aborted")
        state = ctypes.c_int(0)
        _check(library().ncclCommGetAsyncError(self._comm, ctypes.byref(state)), "ncclCommGetAsyncError")
        if state.value == NCCL_IN_PROGRESS:
            return False
        _check(state.value, "an NCCL operation")
        return True

    def broadcast(self, address: int, nbytes: int, stream: int, *, settle: Callable[[], None]) -> None:
        """Queues a broadcast of ``nbytes`` at device ``address`` from rank 0 on
        ``stream`` (in place: rank 0 sends it, the others receive into it). A call
        that NCCL is still queueing (``ncclInProgress``) is waited for by ``settle``
        (a bounded wait until ``ready``) before the next: until then its kernel is not
        on the stream, and an event recorded there would not wait for it."""
        lib = library()
        done = 0
        while done < nbytes:  # NCCL counts in int on some builds: chunks every side cuts alike
            count = min(nbytes - done, _MAX_COUNT)
            status = lib.ncclBroadcast(address + done, address + done, count, NCCL_UINT8, 0, self._comm, stream)
            if status == NCCL_IN_PROGRESS:
                settle()
            else:
                _check(status, "ncclBroadcast")
            done += count

    def check(self) -> None:
        """TransferError when NCCL reports an asynchronous error (a peer went away)."""
        self.ready()

    def abort(self) -> None:
        """ncclCommAbort: ends whatever is queued, or a build still joining its peers,
        and frees the communicator; local, it never waits on a peer (the only way
        weightsync ends a communicator)."""
        comm, self._comm = self._comm, ctypes.c_void_p(0)
        if comm:
            status = library().ncclCommAbort(comm)
            if status != NCCL_IN_PROGRESS:
                _check(status, "ncclCommAbort")


__all__ = ["Communicator", "Config", "NCCL_IN_PROGRESS", "UniqueId", "UNIQUE_ID_BYTES", "library", "new_unique_id", "version"]
