"""The rendezvous store of the data plane: a torch TCPStore hosted by the trainer.

The trainer (rank 0) is the store's master on an ephemeral port; engines connect as
clients. Every key of one Broadcast lives under its ``session_id``, so a late or
retried message from an old round can never be mistaken for a new one. On torch's
TCPStore waits poll ``check`` with a short back-off instead of
``store.wait(timeout)`` because each ``wait`` timeout makes the C++ side log a
warning, and because polling lets a wait notice an abort flag or a peer's error key
between polls; weightsync's own store (``secure_store``) waits for the keys or a
peer's error key in one blocking call per slice instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.transport.listen import listen_on

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.005
_BLOCK_SLICE_S = 0.025  # a wait blocking in the store looks at its abort flag this often


def session_key(rendezvous, *parts: object) -> str:
    """The store key ``parts`` of one Broadcast: ``ws/<group_id>/<session_id>/...``."""
    return "/".join(["ws", rendezvous.group_id, rendezvous.session_id, *map(str, parts)])


def host_store(host: str, *, timeout_s: float) -> dist.TCPStore:
    """Starts a TCPStore master listening on ``host`` only, on an ephemeral port
    (``.port`` tells it).

    torch's store server listens on every interface whatever host it is given; here it
    gets a socket bound to ``host`` alone, so a trainer that names 127.0.0.1 is not
    reachable from the network. The store has no authentication of its own: anyone who
    can reach this address can read and write its keys (docs/guides/security.md).
    """
    listener = listen_on(host)
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on (detach: Python must not close it).
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                         master_listen_fd=listener.detach())


def connect_store(host: str, port: int, *, deadline_at: float, secret: str = "") -> dist.Store:
    """Connects to the trainer's store by ``deadline_at`` (time.monotonic).

    With ``secret`` (gloo and shm rounds) the store is the trainer's authenticated
    ``StoreHost`` and the connection proves the round's secret (``secure_store``).
    Without it, a torch TCPStore: the ``group`` transport, whose store SGLang joins with
    torch's own client.

    torch's client does not keep its own timeout: a refused connection is retried for
    about twice the timeout, and a peer that accepts but never answers the handshake
    blocks it for good. So the connection is made on a daemon thread, with half the time
    left as torch's timeout, and abandoned at the deadline (the thread ends when torch
    gives up, or when the silent peer closes the socket).

    Raises:
        StepTimeoutError: no connection by the deadline.
        TransferError: the store refused or failed.
    """
    if secret:
        from weightsync.transport.secure_store import SecureStore
        return SecureStore(host, port, secret, deadline_at=deadline_at,
                           timeout_s=max(deadline_at - time.monotonic(), 0.05))
    left = deadline_at - time.monotonic()
    if left <= 0:
        raise StepTimeoutError(f"deadline passed before connecting to the rendezvous store at {host}:{port}",
                               operation="rendezvous")
    result: list = []

    def connect() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(left / 2, 0.05)))
            store.set_timeout(timedelta(seconds=max(deadline_at - time.monotonic(), 0.05)))
            result.append(store)
        except Exception as exc:  # torch raises DistNetworkError/RuntimeError variants
            result.append(exc)

    thread = threading.Thread(target=connect, name=f"weightsync-store-connect-{host}:{port}", daemon=True)
    thread.start()
    thread.join(timeout=left)
    if not result:
        raise StepTimeoutError(f"the trainer's rendezvous store at {host}:{port} did not answer within {left:.1f}s",
                               operation="rendezvous")
    if isinstance(result[0], Exception):
        raise TransferError(f"cannot reach the trainer's rendezvous store at {host}:{port}: "
                            f"{str(result[0]).splitlines()[0][:300]}") from result[0]
    return result[0]


def delete_keys(store: dist.Store, keys: Sequence[str]) -> None:
    """Deletes a round's ``keys`` once its readers are done (bounded store growth over
    thousands of steps): one request on weightsync's store, one per key on another.
    Never raises: a key left behind is harmless (missing keys are fine too)."""
    try:
        many = getattr(store, "delete_keys", None)
        if many is not None:
            many(list(keys))
            return
        for key in keys:
            store.delete_key(key)
    except Exception:
        return


def prefixed(store: dist.Store, prefix: str) -> dist.Store:
    """``store`` with its keys under ``prefix`` (torch's PrefixStore cannot wrap the
    Python-implemented authenticated store, which namespaces keys itself)."""
    from weightsync.transport.secure_store import StoreClient
    if isinstance(store, StoreClient):
        return store.with_prefix(prefix)
    return dist.PrefixStore(prefix, store)


def wait_for_keys(store: dist.Store, keys: Sequence[str], *, deadline_at: float, operation: str,
                  abort: threading.Event | None = None, fail_keys: Sequence[str] = (),
                  max_poll_s: float = _POLL_MAX_S) -> None:
    """Waits until every key in ``keys`` is set. On weightsync's authenticated store
    (a client with ``wait_either``) the wait blocks in the store and wakes the moment
    the keys are set, looking at ``abort`` every ``_BLOCK_SLICE_S``; on any other store
    it polls at most every ``max_poll_s`` (a transfer that ends in about a
    millisecond, cuda-ipc's, polls more often).

    Raises:
        TransferError: a key of ``fail_keys`` was set (a peer reported failure), the
            store went away, or ``abort`` was set.
        StepTimeoutError: ``deadline_at`` (time.monotonic) passed; names ``operation``.
    """
    keys = list(keys)
    fail_keys = list(fail_keys)
    wait_either = getattr(store, "wait_either", None)
    if wait_either is not None:
        try:
            _wait_in_store(wait_either, keys, fail_keys, deadline_at=deadline_at, operation=operation, abort=abort)
            return
        except NotImplementedError:  # the trainer runs an older release: poll
            pass
    delay = _POLL_MIN_S
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
        _raise_if_over(keys, deadline_at=deadline_at, operation=operation, abort=abort)
        time.sleep(delay)
        delay = min(max_poll_s, delay * 2)


def _wait_in_store(wait_either, keys: list[str], fail_keys: list[str], *, deadline_at: float, operation: str,
                   abort: threading.Event | None) -> None:
    """``wait_for_keys`` on a store that waits itself: one round trip per
    ``_BLOCK_SLICE_S`` (or until the keys are set), where polling made one or two
    every 5 ms, each costing both processes CPU while the round's copy wants it."""
    while True:
        left = deadline_at - time.monotonic()
        stopping = left <= 0 or (abort is not None and abort.is_set())
        try:
            done, failed, value = wait_either(keys, fail_keys, 0.0 if stopping else min(left, _BLOCK_SLICE_S),
                                              answer_by=deadline_at)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise TransferError(f"rendezvous store failed during {operation}: {exc}") from exc
        if done:
            return
        if failed is not None:
            raise TransferError(f"peer reported failure: {value.decode(errors='replace')}")
        _raise_if_over(keys, deadline_at=deadline_at, operation=operation, abort=abort)


def _raise_if_over(keys: list[str], *, deadline_at: float, operation: str, abort: threading.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise TransferError(f"{operation} aborted")
    if time.monotonic() >= deadline_at:
        raise StepTimeoutError(f"deadline exceeded during {operation} waiting for {keys[:3]}",
                               operation=operation)


class StoreLink:
    """A receiver's connection to the trainer's store, kept from round to round while the
    trainer's store stays at the same address."""

    def __init__(self) -> None:
        self._where: tuple[str, int] | None = None
        self.store: dist.Store | None = None  # the last connection (None before the first)

    def connect(self, rendezvous, *, deadline_at: float) -> dist.Store:
        """The connection to ``rendezvous``'s store (a new one when it moved, or when
        the last one was given up: a request unanswered in time)."""
        where = (rendezvous.store_host, rendezvous.store_port)
        if self.store is None or self._where != where or getattr(self.store, "broken", False):
            self.store = connect_store(*where, deadline_at=deadline_at, secret=rendezvous.store_secret)
            self._where = where
        return self.store

    def forget(self) -> None:
        self._where, self.store = None, None


__all__ = ["session_key", "host_store", "connect_store", "prefixed", "wait_for_keys", "StoreLink"]
