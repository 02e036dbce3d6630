"""The data plane is closed to strangers: the trainer's rendezvous store admits only peers
that prove the round's secret, which only the round's engines learn (over the control
plane). A stranger who reaches the store's port during rounds learns nothing and
changes nothing; the rounds stay bitwise equal to the trainer's model.

Real coordinator, real agents, a real TrainerClient; the stranger is this test, with
torch's own store client, the weightsync store client with a guessed secret, and raw
bytes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import TransferError
from weightsync.packing import weights_digest
from weightsync.transport.secure_store import SecureStore, StoreHost


def _torch_client(port: int) -> str:
    """torch's TCPStore client (which could list every key of a TCPStore) against the
    store; returns what happened, bounded (torch may wait for an answer that never comes)."""
    outcome: list[str] = []

    def connect() -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
            outcome.append(f"connected; keys: {store.list_keys()}")
        except Exception as exc:  # noqa: BLE001 - any refusal is the expected outcome
            outcome.append(f"refused: {type(exc).__name__}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout=20)
    return outcome[0] if outcome else "no answer"


def _raw_bytes(port: int) -> bytes:
    """Connects, sends garbage in place of the handshake; returns all the store sent."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\x00" * 64 + b"set ws/x/abort now\n" * 10)
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return received


@pytest.mark.parametrize("transport", ["gloo", "shm"])
async def test_a_stranger_at_the_store_learns_nothing_and_changes_nothing(cluster, transport):
    model = ReferenceLM(PRESETS["tiny"])
    stop = threading.Event()
    attempts: list[str] = []

    def stranger(port: int) -> None:
        while not stop.is_set():
            attempts.append(_torch_client(port))
            try:
                SecureStore("127.0.0.1", port, "00" * 32, deadline_at=time.monotonic() + 5, timeout_s=5)
                attempts.append("guessed secret admitted")
            except TransferError:
                attempts.append("guessed secret refused")
            hello = _raw_bytes(port)
            attempts.append("raw: nonce only" if len(hello) == 36 and hello.startswith(b"WSS1")
                            else f"raw: got {len(hello)} bytes")

    async with TrainerClient(cluster.address, transport=transport) as client:
        first = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        assert first.ok
        port = client.stores.secure.port
        thread = threading.Thread(target=stranger, args=(port,), daemon=True)
        thread.start()
        try:
            for version in range(2, 6):  # rounds while the stranger keeps trying
                with_noise = [(n, p.detach() + version) for n, p in model.named_parameters()]
                synced = await client.update_weights(with_noise, version=version, timeout_s=60)
                assert synced.ok, synced
                state = await client.get_state(include_digests=True)
                assert {e.weights_digest for e in state.engines} == {weights_digest(with_noise)}
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 60)
        refused = client.stores.secure.refused
    assert attempts, "the stranger never ran"
    assert all(a in ("guessed secret refused", "raw: nonce only") or a.startswith("refused")
               or a == "no answer" for a in attempts), attempts
    assert refused >= len([a for a in attempts if a == "guessed secret refused"]) > 0


def test_store_operations_and_secrets():
    """The store's own contract: a round's secret admits a connection, an unknown one does
    not; keys, prefixes, counters, waits with their timeout."""
    host = StoreHost("127.0.0.1", timeout_s=5)
    try:
        secret = host.new_secret()
        store = SecureStore("127.0.0.1", host.port, secret, deadline_at=time.monotonic() + 5, timeout_s=5)
        store.set("a", b"1")
        assert store.check(["a"]) and not store.check(["a", "b"])
        assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.add("n", 3) == 5
        scoped = store.with_prefix("ws/g")
        scoped.set("k", "v")
        assert store.get("ws/g/k") == b"v" and scoped.get("k") == b"v"
        assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
        assert store.delete_key("a") and not store.check(["a"])
        store.set_timeout(timedelta(seconds=0.3))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            store.get("never-set")
        assert time.monotonic() - started < 3
        with pytest.raises(TransferError, match="refused this connection"):
            SecureStore("127.0.0.1", host.port, "ab" * 32, deadline_at=time.monotonic() + 5, timeout_s=5)
        assert host.refused == 1
        # secrets of many rounds ago no longer admit new connections
        for _ in range(20):
            host.new_secret()
        with pytest.raises(TransferError):
            SecureStore("127.0.0.1", host.port, secret, deadline_at=time.monotonic() + 5, timeout_s=5)
        store.set("still", b"works")  # an admitted connection stays admitted
        assert store.get("still") == b"works"
    finally:
        host.close()
