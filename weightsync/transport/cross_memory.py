"""Reading the trainer's memory straight into an engine's tensors: Linux cross-memory
attach (``process_vm_readv``), the shm transport's direct mode.

Through the shared-memory ring every byte is copied twice (the trainer packs it into a
slot, each engine copies it out). With cross-memory attach each engine's kernel call
copies the trainer's tensors into the engine's own, once, and the trainer copies
nothing. The kernel allows it where the engine could ptrace the trainer: the same user
and no Yama restriction (``/proc/sys/kernel/yama/ptrace_scope`` 0), or
``CAP_SYS_PTRACE``; in the same PID namespace, because the trainer is named by its pid.
So this is no new access: a process that passes the check could already read all of
the trainer's memory.

The trainer proves which process it is with a *beacon*: 16 random bytes in its memory,
whose address and value travel through the authenticated rendezvous store. An engine
reads the beacon first (wrong process, other PID namespace, not permitted: the engine
uses the ring instead) and again after its last bucket (the trainer, not a process that
took its pid, was read the whole time).

``WEIGHTSYNC_SHM_DIRECT=0`` on either side turns the direct mode off.

Page size matters: the kernel pins every page it reads, so a trainer whose tensors sit
on 4 KiB pages is read at about half the speed of one on transparent huge pages (1 GiB
per reader: 0.16 s against 0.09 s on the CI machine, memcpy 0.08 s). torch puts CPU
tensors of 2 MiB or more on huge pages when ``THP_MEM_ALLOC_ENABLE=1`` is set before
the trainer starts, and glibc its heap (smaller tensors) with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; or the trainer moves its weights onto huge
pages itself, once (``weightsync.arena.place_on_huge_pages``). ``hugepage_advice``
says so once where none of that was done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from weightsync.arena import in_arenas
from weightsync.errors import TransferError

# At most IOV_MAX (1024) segments per call. And at most 4 MiB per call: while a call
# runs, the trainer's own threads stall (measured with two readers of 1 GiB: its event
# loop lagged 31 ms with 32 MiB calls, 6 ms with 4 MiB ones, same total time).
_IOV_MAX = 1024
_MAX_CALL_BYTES = 4 << 20
_BEACON_BYTES = 16


def direct_enabled() -> bool:
    """Whether this process may use the direct mode (``WEIGHTSYNC_SHM_DIRECT``, default on;
    Linux on a 64-bit machine only)."""
    return (os.environ.get("WEIGHTSYNC_SHM_DIRECT", "1") != "0" and sys.platform == "linux"
            and ctypes.sizeof(ctypes.c_void_p) == 8)


log = logging.getLogger("weightsync.transport.shm")

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_advised = False


def hugepage_advice(setting_path: str | None = None, env: dict[str, str] | None = None) -> str | None:
    """What to set for faster direct reads of this process's tensors, or None when
    they are on huge pages already or cannot be. The kernel puts anonymous memory on
    transparent huge pages always, never, or where a process asks (``madvise``); in the
    last case torch asks for its tensors of 2 MiB or more only with
    ``THP_MEM_ALLOC_ENABLE`` set, and glibc for its heap (where smaller tensors live)
    only with the tunable ``glibc.malloc.hugetlb``; both are read once, at start."""
    env = os.environ if env is None else env
    try:
        with open(setting_path or THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return None
    if "[madvise]" not in setting:
        return None
    missing = []
    try:
        torch_asks = int(env.get("THP_MEM_ALLOC_ENABLE", "0")) != 0
    except ValueError:
        torch_asks = False
    if not torch_asks:
        missing.append("THP_MEM_ALLOC_ENABLE=1 (torch's tensors of 2 MiB or more)")
    tunables = env.get("GLIBC_TUNABLES", "").split(":")
    if not any(t in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2") for t in tunables):
        missing.append("glibc.malloc.hugetlb=1 in GLIBC_TUNABLES (smaller tensors, from glibc's heap; "
                       "glibc 2.35 or later)")
    if not missing:
        return None
    return ("the trainer's tensors are on 4 KiB pages, which engines read at about half the speed of huge "
            "pages (engines whose weights are in huge-page arenas are written into instead, as fast; the others, "
            "a vLLM worker's among them, read): call weightsync.client.place_on_huge_pages(model) once after building the model, or set "
            + " and ".join(missing) + " in the trainer's environment, before it starts")


def advise_hugepages_once(addresses: np.ndarray) -> None:
    """Logs ``hugepage_advice`` the first time this process offers direct reads of
    tensors at ``addresses``, unless they lie in arenas (``place_on_huge_pages``, or
    an engine's own weights when it is the source of a catch-up)."""
    global _advised
    if not _advised:
        _advised = True
        advice = None if in_arenas(addresses) else hugepage_advice()
        if advice is not None:
            log.info("shm direct reads: %s", advice)


_calls: dict[str, object] = {}


def _process_vm(direction: str):
    """libc's ``process_vm_readv`` or ``process_vm_writev`` (``direction``), typed once."""
    if direction not in _calls:
        fn = getattr(ctypes.CDLL(None, use_errno=True), f"process_vm_{direction}")
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                       ctypes.c_ulong]
        _calls[direction] = fn
    return _calls[direction]


class Beacon:
    """Random bytes at a fixed address of this process, for the other side to check it
    is reading (or writing) this process: the trainer's, for readers; an engine's
    (holding the trainer's nonce of the round, ``value``), for shm's push mode."""

    def __init__(self, value: bytes | None = None) -> None:
        self._value = secrets.token_bytes(_BEACON_BYTES) if value is None else value
        self._buffer = ctypes.create_string_buffer(self._value, _BEACON_BYTES)

    def describe(self) -> bytes:
        """What the other side needs: ``pid|address|value`` (value in hex)."""
        return f"{os.getpid()}|{ctypes.addressof(self._buffer)}|{self._value.hex()}".encode()


def tensor_addresses(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
                     sizes: Sequence[int]) -> np.ndarray | None:
    """The address of each tensor's first byte (uint64), or None unless every tensor is
    a contiguous CPU tensor of the given dtype and byte size: only those can be read or
    written as one run of bytes."""
    # One tight pass (20k tensors: about 10 ms); torch's cheapest accessors.
    out = []
    for tensor, dtype, size in zip(tensors, dtypes, sizes, strict=True):
        if not tensor.is_cpu or tensor.dtype is not dtype or tensor.nbytes != size or not tensor.is_contiguous():
            return None
        out.append(tensor.data_ptr())
    return np.array(out, dtype=np.uint64)


class AddressedTensors(list):
    """Tensors whose first-byte addresses were taken where the list was made.

    The trainer's per-step pass over its tensors (20k in a mixture-of-experts model)
    checks the cached plan, makes each tensor contiguous and takes its address at once:
    most of a pass's cost is fetching each tensor's objects from memory, so one pass
    costs less than three (18 ms against 28.5 ms at 20k parameters just written,
    ``benchmarks/step_pass.py``). The reference engine keeps its targets' addresses
    this way from round to round.

    ``addresses``: uint64, one per tensor, or None where some tensor cannot be read as
    one run of bytes. ``sizes``: the plan's byte sizes they were checked against; they
    stand for that plan only (``addresses_for`` compares by identity). The list is not
    to be changed once made.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], addresses: np.ndarray | None,
                 sizes: Sequence[int]) -> None:
        super().__init__(tensors)
        self.addresses = addresses
        self.sizes = sizes


def carries_addresses(tensors, sizes: Sequence[int]) -> bool:
    """Whether ``tensors`` carries the addresses of its tensors, taken for a plan of
    these ``sizes`` (the same tuple object: a plan's sizes are made once)."""
    return getattr(tensors, "sizes", None) is sizes and hasattr(tensors, "addresses")


def addresses_for(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
                  sizes: Sequence[int]) -> np.ndarray | None:
    """``tensor_addresses``, taken from ``tensors`` itself where it carries them for
    these ``sizes`` (an ``AddressedTensors``, or ``sharding.PartViews`` of one)."""
    if carries_addresses(tensors, sizes):
        return tensors.addresses
    return tensor_addresses(tensors, dtypes, sizes)


class RemoteMemory:
    """Another process's memory, named by its pid and checked by its beacon: an engine
    reads the trainer's runs of bytes into its own (direct mode), the trainer writes
    its own into an engine's (push mode, ``shm_push``)."""

    def __init__(self, pid: int, beacon_address: int, beacon_value: bytes, description: bytes = b"") -> None:
        self.pid = pid
        self._beacon = (beacon_address, beacon_value)
        self._description = description

    def describes(self, description: bytes) -> bool:
        """Whether ``description`` is the one this was attached with."""
        return description == self._description

    @classmethod
    def attach(cls, description: bytes) -> RemoteMemory | None:
        """The trainer ``description`` (``Beacon.describe``) names, if its beacon reads
        back right from here; None where the kernel refuses or another process answers."""
        try:
            pid, address, value = description.decode().split("|")
            memory = cls(int(pid), int(address), bytes.fromhex(value), description)
        except ValueError:
            return None
        return memory if memory.beacon_matches() else None

    def beacon_matches(self) -> bool:
        """Whether the beacon still reads back (False on any refusal)."""
        address, value = self._beacon
        got = ctypes.create_string_buffer(len(value))
        try:
            self.read(np.array([ctypes.addressof(got)], np.uint64), np.array([address], np.uint64),
                      np.array([len(value)], np.uint64))
        except TransferError:
            return False
        return got.raw == value

    def read(self, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        """Copies ``lengths[i]`` bytes from the trainer's ``remote[i]`` to our ``local[i]``
        for every i (uint64 arrays of one length); TransferError if any byte could not be
        read."""
        self._transfer(_process_vm("readv"), local, remote, lengths, "read", "from")

    def write(self, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray,
              before_call: Callable[[], None] | None = None) -> None:
        """Copies ``lengths[i]`` bytes from our ``local[i]`` to the other process's
        ``remote[i]`` (shm's push mode, the trainer writing into an engine);
        ``before_call`` runs before each kernel call (at most 4 MiB each) and stops the
        writes by raising. TransferError if any byte could not be written."""
        self._transfer(_process_vm("writev"), local, remote, lengths, "write", "into", before_call)

    def _transfer(self, call, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, verb: str, preposition: str,
                  before_call: Callable[[], None] | None = None) -> None:
        keep = lengths > 0
        local, remote, lengths = _coalesce(local[keep], remote[keep], lengths[keep])
        if len(lengths) and int(lengths.max()) > _MAX_CALL_BYTES:
            local, remote, lengths = _split_runs(local, remote, lengths, _MAX_CALL_BYTES)
        n = len(lengths)
        if n == 0:
            return
        # struct iovec is {void *base; size_t len}: two uint64 columns, row-major.
        local_iov = np.empty((n, 2), np.uint64)
        remote_iov = np.empty((n, 2), np.uint64)
        local_iov[:, 0], local_iov[:, 1] = local, lengths
        remote_iov[:, 0], remote_iov[:, 1] = remote, lengths
        cumulative = np.cumsum(lengths, dtype=np.uint64)
        start = 0
        while start < n:
            # As many segments as one call takes, within the byte cap.
            base = int(cumulative[start - 1]) if start else 0
            stop = min(n, start + _IOV_MAX, int(np.searchsorted(cumulative, base + _MAX_CALL_BYTES, "right")))
            stop = max(stop, start + 1)
            want = int(cumulative[stop - 1]) - base
            count = stop - start
            if before_call is not None:
                before_call()
            got = call(self.pid, local_iov[start:].ctypes.data, count, remote_iov[start:].ctypes.data, count, 0)
            if got < 0:
                err = ctypes.get_errno()
                raise TransferError(f"cannot {verb} {preposition} the memory of pid {self.pid}: {os.strerror(err)}")
            if got != want:
                raise TransferError(f"{verb} {got} of {want} bytes {preposition} the memory of pid {self.pid}")
            start = stop


def _coalesce(local: np.ndarray, remote: np.ndarray,
              lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies with each run of segments that follow one another on both sides
    (one ends where the next begins, here and in the trainer) made one segment.

    Where the trainer's weights lie end to end (``place_on_huge_pages``) and so do the
    engine's (the reference engine's arena), a bucket of 20k-tensor-model small
    tensors is one segment instead of hundreds: the kernel's work per segment was what
    made shm's rounds at 20k tensors cost more per byte than at 89. Whole-array work;
    segments with anything between them on either side (alignment padding, another
    allocation) stay apart."""
    if len(lengths) < 2:
        return local, remote, lengths
    joins = (local[:-1] + lengths[:-1] == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    if not joins.any():
        return local, remote, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts)


def _split_runs(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray,
                most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same runs cut into pieces of at most ``most`` bytes (whole-array work)."""
    counts = (lengths + np.uint64(most - 1)) // np.uint64(most)
    run = np.repeat(np.arange(len(lengths)), counts.astype(np.int64))
    first = np.repeat(np.cumsum(counts) - counts, counts.astype(np.int64))
    offset = (np.arange(len(run), dtype=np.uint64) - first) * np.uint64(most)
    return local[run] + offset, remote[run] + offset, np.minimum(np.uint64(most), lengths[run] - offset)


__all__ = ["AddressedTensors", "Beacon", "RemoteMemory", "addresses_for", "carries_addresses", "advise_hugepages_once", "direct_enabled", "hugepage_advice", "tensor_addresses"]
