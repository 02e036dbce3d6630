"""Copies of many small tensors without OpenMP parallel regions.

One bucket of a 20k-tensor model is hundreds of copies of tens of kilobytes, each
big enough for torch to start an OpenMP parallel region. When a trainer and its
receivers share cores (and each process has as many OpenMP threads as there are
cores), every region's closing barrier waits for threads the scheduler has put
aside: on this project's 2-core machine, 1 GiB in 20k tensors took 1.55x as long as
1 GiB in 89 tensors over shm, and 1.1x once those copies ran on one thread.

``serial_copies`` sets OpenMP's *per-thread* thread count, so only the calling
thread is affected, and only inside the block: other threads, torch's default for
new threads and MKL's threads (``torch.set_num_threads`` would change those, the
trainer's matmuls included) stay as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded into this process (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line and "omp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_get_max_threads.restype = ctypes.c_int
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    return None


@contextlib.contextmanager
def serial_copies() -> Iterator[None]:
    """Inside the block, torch kernels run by this thread use no parallel region."""
    lib = _openmp()
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch's per-thread lazy set-up first, so it cannot undo ours
    before = lib.omp_get_max_threads()
    if before <= 1:
        yield
        return
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)


__all__ = ["serial_copies"]
