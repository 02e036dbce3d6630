"""The rendezvous store of the data plane: a torch TCPStore hosted by the trainer.

The trainer (rank 0) is the store's master on an ephemeral port; engines connect as
clients. Every key of one Broadcast lives under its ``session_id``, so a late or
retried message from an old round can never be mistaken for a new one. Waits poll
``check`` with a short back-off instead of ``store.wait(timeout)`` because each
``wait`` timeout makes the C++ side log a warning, and because polling lets a wait
notice an abort flag or a peer's error key between polls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from weightsync.errors import StepTimeoutError, TransferError

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.005


def session_key(rendezvous, *parts: object) -> str:
    """The store key ``parts`` of one Broadcast: ``ws/<group_id>/<session_id>/...``."""
    return "/".join(["ws", rendezvous.group_id, rendezvous.session_id, *map(str, parts)])


def host_store(host: str, *, timeout_s: float) -> dist.TCPStore:
    """Starts a TCPStore master on ``host`` with an ephemeral port (``.port`` tells it)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.TCPStore:
    """Connects to the trainer's store; TransferError if it cannot be reached in time."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistNetworkError/RuntimeError variants
        raise TransferError(f"cannot reach the trainer's rendezvous store at {host}:{port}: {exc}") from exc


def wait_for_keys(store: dist.Store, keys: Sequence[str], *, deadline_at: float, operation: str,
                  abort: threading.Event | None = None, fail_keys: Sequence[str] = ()) -> None:
    """Waits until every key in ``keys`` is set.

    Raises:
        TransferError: a key of ``fail_keys`` was set (a peer reported failure), the
            store went away, or ``abort`` was set.
        StepTimeoutError: ``deadline_at`` (time.monotonic) passed; names ``operation``.
    """
    delay = _POLL_MIN_S
    keys = list(keys)
    fail_keys = list(fail_keys)
    while True:
        try:
            if store.check(keys):
                return
            if fail_keys:
                for key in fail_keys:
                    if store.check([key]):
                        raise TransferError(f"peer reported failure: {store.get(key).decode(errors='replace')}")
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"rendezvous store failed during {operation}: {exc}") from exc
        if abort is not None and abort.is_set():
            raise TransferError(f"{operation} aborted")
        if time.monotonic() >= deadline_at:
            raise StepTimeoutError(f"deadline exceeded during {operation} waiting for {keys[:3]}",
                                   operation=operation)
        time.sleep(delay)
        delay = min(_POLL_MAX_S, delay * 2)


__all__ = ["session_key", "host_store", "connect_store", "wait_for_keys"]
