"""An authenticated rendezvous store: only peers holding a round's secret may connect.

torch's TCPStore has no authentication, and it lets any client list every key
(``list_keys``): anyone who reaches its port can read a round's keys (gloo's peer
addresses, the shared-memory segment's name) and write them (redirect a gloo peer, or
report a false failure). This store serves the same operations to peers that prove,
when they connect, that they hold one of the secrets the trainer allowed:

- The trainer makes a fresh secret for every Broadcast (``StoreHost.new_secret``) and
  sends it in the BroadcastRequest; the coordinator passes it only to that round's
  member agents, in their Receive, over the control plane (mutual TLS in production).
- Handshake: the server sends a nonce, the client answers with its own nonce and
  ``HMAC-SHA256(secret, "client" | server nonce | client nonce)``; the server checks it
  against the allowed secrets and proves it holds the same secret the same way. A peer
  that fails is disconnected before it can send a single operation.
- The secret itself never crosses the data-plane network. Connections, once made, last
  for the store's life (receivers reuse theirs across rounds).

Beyond torch's operations: ``wait_either`` waits in the store for a round's keys or a
peer's error key, answered the moment either is set (a wait costs a request per slice,
not a poll every few milliseconds on both sides while a round's copy wants the CPUs),
and ``delete_keys`` deletes a round's keys in one request. Every request is bounded:
a store that gives no answer a second past the request's own wait (its timeout, or
the caller's deadline) is given up, since a frozen trainer keeps its connections open
and answers nothing. The trainer's own client (``StoreHost.client()``, a
``LocalStore``) answers in its process, without a socket.

The client is a ``torch.distributed.Store`` (a Python subclass), so gloo groups are
built on it directly. Keys are namespaced by the client's ``prefix`` (torch's
``PrefixStore`` cannot wrap a Python store). The store carries only coordination data:
tensor bytes move over gloo or shared memory, never through it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from datetime import timedelta

import torch.distributed as dist

from weightsync.errors import StepTimeoutError, TransferError
from weightsync.transport.listen import listen_on

log = logging.getLogger("weightsync.store")

_MAGIC = b"WSS1"
_NONCE = 32
_MAX_FRAME = 64 * 1024 * 1024
_SECRETS_KEPT = 16        # rounds whose secret still admits a new connection
_HANDSHAKE_TIMEOUT_S = 5.0
# How much later than it should a request's answer may come before the connection is
# given up (a trainer frozen mid-round, a host gone without a reset): every request is
# bounded, so no wait on the store outlives its deadline by more than this.
_ANSWER_GRACE_S = 1.0

# Operations (one byte) and answers.
_SET, _GET, _ADD, _CHECK, _WAIT, _DELETE, _NUM_KEYS, _COMPARE_SET, _WAIT_EITHER, _DELETE_MANY = range(1, 11)
_OK, _TIMEOUT, _ERROR = 0, 1, 2


def _mac(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + b"|" + first + b"|" + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _send_frame(sock: socket.socket, fields: list[bytes]) -> None:
    body = b"".join(struct.pack(">I", len(f)) + f for f in fields)
    sock.sendall(struct.pack(">II", len(body), len(fields)) + body)


def _recv_frame(sock: socket.socket) -> list[bytes]:
    size, count = struct.unpack(">II", _recv_exact(sock, 8))
    if size > _MAX_FRAME or count > size + 1:
        raise ConnectionError(f"store frame of {size} bytes / {count} fields refused")
    body = memoryview(_recv_exact(sock, size))
    fields, at = [], 0
    for _ in range(count):
        (n,) = struct.unpack(">I", body[at:at + 4])
        fields.append(bytes(body[at + 4:at + 4 + n]))
        at += 4 + n
    return fields


class StoreHost:
    """The trainer's store server: a listening socket bound to ``host`` and one thread per
    authenticated connection. ``close()`` stops it and every connection."""

    def __init__(self, host: str, *, timeout_s: float) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._listener = listen_on(host)
        self.port = self._listener.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._secrets: deque[bytes] = deque(maxlen=_SECRETS_KEPT)
        self._owner_secret = secrets.token_bytes(32)
        self._connections: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  # connections that failed the handshake (tests, metrics)
        self._thread = threading.Thread(target=self._accept, name=f"weightsync-store-{self.port}", daemon=True)
        self._thread.start()

    def new_secret(self) -> str:
        """A fresh secret for one round; connections proving it are admitted (the last
        ``_SECRETS_KEPT`` rounds' secrets stay valid for new connections)."""
        secret = secrets.token_hex(32)
        with self._changed:
            self._secrets.append(bytes.fromhex(secret))
        return secret

    def set(self, key: str, value: str) -> None:
        """Sets ``key`` from this process, without a connection (never blocks on I/O)."""
        with self._changed:
            self._data[key] = value.encode()
            self._changed.notify_all()

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` read in this process (no connection, never blocks on I/O);
        None when it is not set."""
        with self._changed:
            return self._data.get(key)

    def forget(self, prefix: str) -> None:
        """Deletes every key that starts with ``prefix`` (in this process)."""
        with self._changed:
            for key in [k for k in self._data if k.startswith(prefix)]:
                del self._data[key]

    @property
    def owner_secret(self) -> str:
        """The secret of the trainer's own connections (hex): given to the other ranks of
        a sharded trainer, never to engines."""
        return self._owner_secret.hex()

    def client(self) -> LocalStore:
        """The trainer's own client (in this process: no connection)."""
        return LocalStore(self)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (the trainer's own client then refuses)."""
        return self._closed

    def close(self) -> None:
        self._closed = True
        with self._changed:
            self._changed.notify_all()
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(timeout=5)

    # ----- server threads -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name=f"weightsync-store-{self.port}-conn",
                             daemon=True).start()

    def _admit(self, sock: socket.socket) -> bool:
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        nonce_s = os.urandom(_NONCE)
        sock.sendall(_MAGIC + nonce_s)
        answer = _recv_exact(sock, _NONCE + 32)
        nonce_c, mac = answer[:_NONCE], answer[_NONCE:]
        with self._changed:
            candidates = [self._owner_secret, *self._secrets]
        for secret in candidates:
            if hmac.compare_digest(mac, _mac(secret, b"client", nonce_s, nonce_c)):
                sock.sendall(_mac(secret, b"server", nonce_c, nonce_s))
                sock.settimeout(None)
                return True
        return False

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                if not self._admit(sock):
                    self.refused += 1
                    log.warning("refused a rendezvous store connection that does not hold a round's secret")
                    return
                with self._changed:
                    self._connections.add(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed:
                    _send_frame(sock, self._answer(_recv_frame(sock)))
            except (OSError, ConnectionError, struct.error, ValueError):
                return  # the peer went away, or spoke garbage: drop it
            finally:
                with self._changed:
                    self._connections.discard(sock)

    def _wait_for(self, keys: list[str], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._closed or all(k in self._data for k in keys),
                                          timeout=timeout_s) and not self._closed

    def _wait_either(self, keys: list[str], fail_keys: list[str], timeout_s: float) -> list[bytes]:
        def settled() -> bool:
            return (self._closed or all(k in self._data for k in keys)
                    or any(k in self._data for k in fail_keys))

        with self._changed:
            self._changed.wait_for(settled, timeout=timeout_s)
            if self._closed:
                return [bytes([_ERROR]), b"the store is closing"]
            if all(k in self._data for k in keys):
                return [bytes([_OK]), b"set"]
            for key in fail_keys:
                if key in self._data:
                    return [bytes([_OK]), b"failed", key.encode(), self._data[key]]
        return [bytes([_TIMEOUT])]

    def _answer(self, fields: list[bytes]) -> list[bytes]:
        op, args = fields[0][0], fields[1:]
        data, changed = self._data, self._changed
        if op == _SET:
            with changed:
                data[args[0].decode()] = args[1]
                changed.notify_all()
            return [bytes([_OK])]
        if op == _GET:
            key, timeout_s = args[0].decode(), float(args[1])
            if not self._wait_for([key], timeout_s):
                return [bytes([_TIMEOUT])]
            with changed:
                value = data.get(key)  # deleted since the wait woke: as if never set
            return [bytes([_TIMEOUT])] if value is None else [bytes([_OK]), value]
        if op == _ADD:
            key = args[0].decode()
            with changed:
                value = int(data.get(key, b"0")) + int(args[1])
                data[key] = str(value).encode()
                changed.notify_all()
            return [bytes([_OK]), str(value).encode()]
        if op == _CHECK:
            with changed:
                return [bytes([_OK]), b"1" if all(k.decode() in data for k in args) else b"0"]
        if op == _WAIT:
            keys = [k.decode() for k in args[1:]]
            return [bytes([_OK if self._wait_for(keys, float(args[0])) else _TIMEOUT])]
        if op == _WAIT_EITHER:
            wanted = int(args[1])
            keys = [k.decode() for k in args[2:2 + wanted]]
            return self._wait_either(keys, [k.decode() for k in args[2 + wanted:]], float(args[0]))
        if op == _DELETE_MANY:
            with changed:
                return [bytes([_OK]), str(sum(data.pop(k.decode(), None) is not None for k in args)).encode()]
        if op == _DELETE:
            with changed:
                return [bytes([_OK]), b"1" if data.pop(args[0].decode(), None) is not None else b"0"]
        if op == _NUM_KEYS:
            with changed:
                return [bytes([_OK]), str(len(data)).encode()]
        if op == _COMPARE_SET:
            key, expected, desired = args[0].decode(), args[1], args[2]
            with changed:
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = desired
                    changed.notify_all()
                    return [bytes([_OK]), desired]
                return [bytes([_OK]), expected if current is None else current]
        return [bytes([_ERROR]), f"unknown store operation {op}".encode()]


def _as_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class StoreClient(dist.Store):
    """The operations of a ``torch.distributed.Store`` on a ``StoreHost``, with keys
    namespaced under ``prefix``; subclasses say how a request reaches the host
    (``_exchange``): over an authenticated connection (``SecureStore``) or, in the
    trainer's own process, by a call (``LocalStore``)."""

    prefix: str
    _timeout_s: float

    def _exchange(self, fields: list[bytes], answer_within_s: float) -> list[bytes]:
        """Sends one request, returns the host's answer; RuntimeError if the host is
        unreachable or gives no answer within ``answer_within_s``."""
        raise NotImplementedError

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, op: int, *args: bytes, waits_s: float | None = None) -> list[bytes]:
        """One request; ``waits_s``: how long the host may wait before it answers (a
        get's or a wait's timeout; the store's timeout bounds the others too)."""
        answer = self._exchange([bytes([op]), *args], (self._timeout_s if waits_s is None else waits_s) + _ANSWER_GRACE_S)
        if answer[0][0] == _TIMEOUT:
            raise RuntimeError(f"rendezvous store wait timed out after {self._timeout_s:.1f}s")
        if answer[0][0] != _OK:
            raise RuntimeError(answer[1].decode(errors="replace"))
        return answer[1:]

    def wait_either(self, keys, fail_keys, timeout_s: float, *,
                    answer_by: float | None = None) -> tuple[bool, str | None, bytes]:
        """Blocks in the store (no polling) until every key of ``keys`` is set, or any
        key of ``fail_keys`` is, or ``timeout_s`` passed. Returns ``(True, None, b"")``
        when ``keys`` are all set (looked at first, as ``check`` then the fail keys),
        ``(False, key, value)`` when ``key`` of ``fail_keys`` is set, ``(False, None,
        b"")`` on timeout. One round trip, where polling is one per look.
        NotImplementedError where the store is an older release's (it polls then).
        ``answer_by`` (time.monotonic): the caller's deadline; a host that has not
        answered by then (plus a second's grace) is given up (RuntimeError)."""
        prefixed = {self._key(k): k for k in fail_keys}
        waits_s = timeout_s if answer_by is None else max(timeout_s, answer_by - time.monotonic())
        answer = self._exchange([bytes([_WAIT_EITHER]), str(float(timeout_s)).encode(), str(len(keys)).encode(),
                                 *(self._key(k).encode() for k in keys), *(k.encode() for k in prefixed)],
                                waits_s + _ANSWER_GRACE_S)
        if answer[0][0] == _TIMEOUT:
            return False, None, b""
        if answer[0][0] != _OK:
            message = answer[1].decode(errors="replace")
            if message.startswith("unknown store operation"):  # an older release's store: poll instead
                raise NotImplementedError(message)
            raise RuntimeError(message)
        if answer[1] == b"failed":
            return False, prefixed.get(answer[2].decode(), answer[2].decode()), answer[3]
        return True, None, b""

    # ----- torch.distributed.Store --------------------------------------------------------

    def set(self, key, value) -> None:
        self._call(_SET, self._key(key).encode(), _as_bytes(value))

    def get(self, key) -> bytes:
        return self._call(_GET, self._key(key).encode(), str(self._timeout_s).encode(), waits_s=self._timeout_s)[0]

    def add(self, key, amount) -> int:
        return int(self._call(_ADD, self._key(key).encode(), str(int(amount)).encode())[0])

    def check(self, keys) -> bool:
        return self._call(_CHECK, *(self._key(k).encode() for k in keys))[0] == b"1"

    def wait(self, keys, timeout=None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout_s
        self._call(_WAIT, str(seconds).encode(), *(self._key(k).encode() for k in keys), waits_s=seconds)

    def delete_key(self, key) -> bool:
        return self._call(_DELETE, self._key(key).encode())[0] == b"1"

    def delete_keys(self, keys) -> int:
        """Deletes every key of ``keys`` in one request; how many were set."""
        return int(self._call(_DELETE_MANY, *(self._key(k).encode() for k in keys))[0])

    def num_keys(self) -> int:
        return int(self._call(_NUM_KEYS)[0])

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call(_COMPARE_SET, self._key(key).encode(), _as_bytes(expected_value),
                          _as_bytes(desired_value))[0]

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class SecureStore(StoreClient):
    """A client of ``StoreHost``: a ``torch.distributed.Store`` over one authenticated
    connection (thread-safe: one operation at a time, like TCPStore's client).

    Raises (constructor):
        StepTimeoutError: no answer by ``deadline_at``.
        TransferError: refused, or the server could not prove it holds the secret.
    """

    def __init__(self, host: str, port: int, secret: str, *, deadline_at: float, timeout_s: float,
                 prefix: str = "") -> None:
        super().__init__()
        self.host, self.port, self.prefix = host, port, prefix
        self._secret = secret
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken = False
        try:
            key = bytes.fromhex(secret)
        except ValueError:
            raise TransferError("the round's store secret is not hex") from None
        left = deadline_at - time.monotonic()
        if left <= 0:
            raise StepTimeoutError(f"deadline passed before connecting to the rendezvous store at {host}:{port}",
                                   operation="rendezvous")
        try:
            self._sock = socket.create_connection((host, port), timeout=left)
        except TimeoutError:
            raise StepTimeoutError(f"the rendezvous store at {host}:{port} did not answer within {left:.1f}s",
                                   operation="rendezvous") from None
        except OSError as exc:
            raise TransferError(f"cannot reach the trainer's rendezvous store at {host}:{port}: {exc}") from None
        try:
            self._sock.settimeout(max(deadline_at - time.monotonic(), 0.001))
            hello = _recv_exact(self._sock, len(_MAGIC) + _NONCE)
            if hello[:len(_MAGIC)] != _MAGIC:
                raise TransferError(f"{host}:{port} is not a weightsync rendezvous store")
            nonce_s, nonce_c = hello[len(_MAGIC):], os.urandom(_NONCE)
            self._sock.sendall(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
            proof = _recv_exact(self._sock, 32)
            if not hmac.compare_digest(proof, _mac(key, b"server", nonce_c, nonce_s)):
                raise TransferError(f"the store at {host}:{port} does not hold this round's secret")
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            self._sock.close()
            raise StepTimeoutError(f"the rendezvous store at {host}:{port} did not answer within {left:.1f}s",
                                   operation="rendezvous") from None
        except (OSError, ConnectionError) as exc:
            self._sock.close()
            raise TransferError(f"the rendezvous store at {host}:{port} refused this connection (a wrong or "
                                f"expired round secret?): {exc}") from None
        except BaseException:
            self._sock.close()
            raise

    def with_prefix(self, prefix: str) -> SecureStore:
        """A new connection whose keys live under ``prefix/`` (PrefixStore's layout)."""
        return SecureStore(self.host, self.port, self._secret, deadline_at=time.monotonic() + self._timeout_s,
                           timeout_s=self._timeout_s, prefix=self._key(prefix))

    def clone(self) -> SecureStore:
        return SecureStore(self.host, self.port, self._secret, deadline_at=time.monotonic() + self._timeout_s,
                           timeout_s=self._timeout_s, prefix=self.prefix)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    @property
    def broken(self) -> bool:
        """Whether a request went unanswered in time: the connection was closed (an
        answer that came later would be taken for the next request's)."""
        return self._broken

    def _exchange(self, fields: list[bytes], answer_within_s: float) -> list[bytes]:
        with self._lock:
            if self._broken:
                raise RuntimeError("rendezvous store connection failed: closed after a request that got no answer "
                                   "in time")
            try:
                self._sock.settimeout(max(answer_within_s, 0.001))
                _send_frame(self._sock, fields)
                return _recv_frame(self._sock)
            except TimeoutError:
                self._broken = True
                self.close()
                raise RuntimeError(f"rendezvous store connection failed: the store at {self.host}:{self.port} gave "
                                   f"no answer within {answer_within_s:.1f} s (its process frozen, or its host "
                                   "gone)") from None
            except (OSError, ConnectionError) as exc:
                raise RuntimeError(f"rendezvous store connection failed: {exc}") from None


class LocalStore(StoreClient):
    """The trainer's own client of its ``StoreHost``, in its process: the same
    operations, answered by a call instead of a loopback round trip through one of the
    host's threads (a trainer makes some 30 store operations a round; each round trip
    was 0.05-0.7 ms, the latter under a round's copy). Thread-safe; ``close`` is a
    no-op (the host's ``close`` ends it)."""

    def __init__(self, host: StoreHost, *, prefix: str = "") -> None:
        super().__init__()
        self._host = host
        self.prefix = prefix
        self._timeout_s = host.timeout_s

    def with_prefix(self, prefix: str) -> LocalStore:
        """A client whose keys live under ``prefix/`` (PrefixStore's layout)."""
        return LocalStore(self._host, prefix=self._key(prefix))

    def clone(self) -> LocalStore:
        return LocalStore(self._host, prefix=self.prefix)

    def close(self) -> None:
        pass

    def _exchange(self, fields: list[bytes], answer_within_s: float) -> list[bytes]:
        if self._host.closed:
            raise RuntimeError("rendezvous store connection failed: the store is closed")
        return self._host._answer(fields)


__all__ = ["StoreHost", "StoreClient", "SecureStore", "LocalStore"]
