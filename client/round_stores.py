"""The rendezvous stores a trainer hosts for its rounds, each on first use.

gloo and shm rounds meet at the authenticated store (``StoreHost``: a fresh secret
per round admits that round's engines); the group transport at a torch TCPStore,
which SGLang joins with torch's own client. A client that only asks for state never
opens a port. A sharded trainer's rank 0 brings its own authenticated store (the
other ranks already know its address): ``RoundSenders.store_host``.
"""

from __future__ import annotations

from weightsync.transport.secure_store import StoreHost
from weightsync.transport.store import host_store, session_key
from weightsync.v1 import common_pb2


class RoundStores:
    """The trainer's stores (its worker thread uses them; ``close`` releases both)."""

    def __init__(self, host: str, *, timeout_s: float, given: StoreHost | None = None) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.secure: StoreHost | None = given
        self.plain = None  # the group transport's TCPStore

    def for_kind(self, kind: int) -> tuple[int, str]:
        """The store a round of ``kind`` meets at (hosted now if need be): its port and,
        for gloo and shm, a fresh secret that admits this round's engines."""
        if kind == common_pb2.TRANSPORT_KIND_GROUP:
            if self.plain is None:
                self.plain = host_store(self.host, timeout_s=self.timeout_s)
            return self.plain.port, ""
        if self.secure is None:
            self.secure = StoreHost(self.host, timeout_s=self.timeout_s)
        return self.secure.port, self.secure.new_secret()

    def sender_store(self, kind: int):
        """The store connection a new sender of ``kind`` talks through."""
        return self.plain if kind == common_pb2.TRANSPORT_KIND_GROUP else self.secure.client()

    def abort_lane(self, rendezvous: common_pb2.Rendezvous, why: str) -> None:
        """Sets a (relayed) lane's abort key: its engines stop waiting. In process, no I/O."""
        if self.secure is not None:
            self.secure.set(session_key(rendezvous, "abort"), why)

    def close(self) -> None:
        if self.secure is not None:
            self.secure.close()
        self.secure = self.plain = None


__all__ = ["RoundStores"]
