"""What the GPU transports (nccl, cuda-ipc) share: cupy, bounded waits on CUDA work,
the device a list of tensors lives on, and allocations other processes can map.

cupy is imported lazily, never at module import: this module is imported on machines
without a GPU (the CPU suite checks the parts that need none). Every wait on the GPU
is a poll of a CUDA event with the round's deadline, the abort flag and the peers'
failure keys (``collective.wait_polling``), never a blocking synchronize: a kernel
queued behind a peer that died would otherwise hold the transfer thread forever.

NCCL itself is called through ``nccl_lib`` (ctypes), not through cupy.

An allocation that another process maps through CUDA IPC must be a whole
``cudaMalloc`` block: ``cudaIpcGetMemHandle`` names the block, and the importer gets
the block's first byte. torch's caching allocator carves many tensors out of one
block, so a tensor is exported as (its block's handle, its offset in that block),
the block found with the driver's ``cuMemGetAddressRange``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from weightsync.errors import TransferError

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

log = logging.getLogger("weightsync.transport.cuda")


def cupy_module():
    """cupy, or TransferError saying how to get it (``weightsync[cuda12]`` or
    ``weightsync[cuda13]``, or a preinstalled cupy build for the machine's CUDA)."""
    try:
        import cupy
    except ImportError as exc:
        raise TransferError(f"cupy is not importable ({exc}): install weightsync[cuda12] or weightsync[cuda13] "
                            "to match the machine's CUDA") from None
    return cupy


def tensors_device(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    """The one CUDA device of ``tensors`` (CPU tensors among them are allowed: they are
    copied in or out through the device), or the current device when none is on a GPU.
    TransferError when they span several GPUs: one transfer runs on one device."""
    devices = {t.device for t in tensors if t.is_cuda}
    if len(devices) > 1:
        raise TransferError(f"the {what} span several GPUs ({sorted(map(str, devices))}): one transfer uses one")
    if devices:
        return devices.pop()
    return torch.device("cuda", torch.cuda.current_device())


class EventDone:
    """A recorded CUDA event as a piece of work for ``collective.wait_polling``; ``check``
    (e.g. an NCCL communicator's asynchronous error check) runs at every poll."""

    def __init__(self, event: torch.cuda.Event, check: Callable[[], None] | None = None) -> None:
        self._event = event
        self._check = check

    def is_completed(self) -> bool:
        if self._check is not None:
            self._check()
        return self._event.query()

    def wait(self) -> None:
        """Completed: nothing left to wait for."""


class _Driver:
    """The few CUDA driver calls cupy does not expose, through ctypes."""

    _lock = threading.Lock()
    _lib: ctypes.CDLL | None = None

    @classmethod
    def lib(cls) -> ctypes.CDLL:
        with cls._lock:
            if cls._lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as exc:
                    raise TransferError(f"the CUDA driver library cannot be loaded: {exc}") from None
                fn = lib.cuMemGetAddressRange_v2
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                fn = lib.cuPointerGetAttribute
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                cls._lib = lib
            return cls._lib


def make_current(device: torch.device) -> None:
    """Makes ``device``'s primary context current on this thread: driver calls
    (``allocation_range``) need one, and a transfer thread may not have made any CUDA
    runtime call yet (torch skips ``cudaSetDevice`` when the device is already its
    current one, which binds no context)."""
    cupy = cupy_module()
    cupy.cuda.runtime.setDevice(device.index)
    cupy.cuda.runtime.free(0)  # cudaFree(NULL): initialises and binds the context, frees nothing


def allocation_range(address: int) -> tuple[int, int]:
    """(first byte, size) of the ``cudaMalloc`` block holding device ``address``; the
    device's context must be current on this thread (``make_current``)."""
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    status = _Driver.lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if status != 0:
        raise TransferError(f"cuMemGetAddressRange failed for a tensor at {address:#x} (CUDA driver error {status})")
    return base.value, size.value


_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7  # CUpointer_attribute in cuda.h


def buffer_id(address: int) -> int:
    """The driver's id of the allocation holding device ``address``, unique within the
    process: a block freed (``torch.cuda.empty_cache``, a model moved off the GPU and
    back) and allocated again at the same address gets another id, and another IPC
    handle, while its addresses stay the same. The device's context must be current."""
    value = ctypes.c_ulonglong(0)
    status = _Driver.lib().cuPointerGetAttribute(ctypes.byref(value), _CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                                 ctypes.c_uint64(address))
    if status != 0:
        raise TransferError(f"cuPointerGetAttribute failed for a tensor at {address:#x} (CUDA driver error {status})")
    return value.value


def export_handle(base: int) -> bytes:
    """The IPC handle (64 bytes) of the block starting at ``base``. TransferError where
    the block cannot be exported (memory from a virtual-memory allocator, e.g. torch's
    ``expandable_segments``)."""
    cupy = cupy_module()
    try:
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    except Exception as exc:
        raise TransferError(f"this GPU memory cannot be shared through CUDA IPC ({exc}); a trainer running with "
                            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot use cuda-ipc") from None
    if len(handle) != IPC_HANDLE_BYTES:
        raise TransferError(f"unexpected CUDA IPC handle of {len(handle)} bytes")
    return handle


class MappedBlock:
    """Another process's exported block, mapped into this one (closed by ``close``)."""

    def __init__(self, handle: bytes, size: int, device: torch.device) -> None:
        cupy = cupy_module()
        self.handle, self.size, self.device = handle, size, device
        with cupy.cuda.Device(device.index):
            try:
                self.address = int(cupy.cuda.runtime.ipcOpenMemHandle(handle))
            except Exception as exc:
                raise TransferError(f"cannot map the trainer's GPU memory through CUDA IPC ({exc}): cuda-ipc needs "
                                    "the engine on the trainer's host, in another process") from None
            memory = cupy.cuda.UnownedMemory(self.address, size, None, device.index)
            array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        # One uint8 tensor over the whole block: tensors are views of it. No device is
        # named: ``as_tensor`` then takes the mapping's own device and never copies (asked
        # for another GPU's than the block's, it would copy the block once, and every
        # later round would read that copy's stale bytes).
        self.bytes = torch.as_tensor(array)
        if self.bytes.data_ptr() != self.address:
            raise TransferError("mapping the trainer's GPU memory made a copy of it; refusing to read a copy")

    def close(self) -> None:
        """Unmaps the block; its tensor views must not be used after. A failure to
        unmap is logged, not raised: it comes when the trainer has freed the block
        already (a model moved off the GPU), and the round that drops the mapping must
        not fail for it."""
        if self.address:
            cupy = cupy_module()
            self.bytes = None  # type: ignore[assignment]
            try:
                with cupy.cuda.Device(self.device.index):
                    cupy.cuda.runtime.ipcCloseMemHandle(self.address)
            except Exception as exc:
                log.warning("unmapping the trainer's GPU block at %#x failed: %s", self.address, exc)
            finally:
                self.address = 0


__all__ = ["IPC_HANDLE_BYTES", "cupy_module", "tensors_device", "EventDone", "make_current", "allocation_range",
           "buffer_id", "export_handle", "MappedBlock"]
