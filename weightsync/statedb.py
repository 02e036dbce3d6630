"""SQLite (WAL) state of a server, accessed from one dedicated thread.

SQLite calls block, so none runs on the event loop: every statement goes through a
single-thread executor, which also serialises writes. WAL + ``synchronous=NORMAL``
keeps a committed transaction across a process crash (SIGKILL), which is what
restart recovery relies on.

A database that cannot be written (the disk full, an I/O error, a read-only file)
raises ``StateNotWritable``, rolled back: callers decide whether the write had to
come before a change (the call is refused, nothing changed) or records one already
made (logged, the state kept in memory until a later write succeeds).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from weightsync.errors import StateNotWritable
from weightsync.threads import run_in

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS engines (
    engine_id TEXT PRIMARY KEY, address TEXT NOT NULL, model TEXT NOT NULL, registered_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY, operation TEXT NOT NULL, fingerprint TEXT NOT NULL,
    state TEXT NOT NULL, response BLOB, error_code INTEGER, error_reason TEXT,
    error_message TEXT, error_metadata TEXT, created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency(created_at);
CREATE TABLE IF NOT EXISTS syncs (
    key TEXT PRIMARY KEY, attempt INTEGER NOT NULL, stage TEXT NOT NULL, round_id INTEGER NOT NULL,
    ok INTEGER NOT NULL, created_at REAL NOT NULL);
"""


# SQLite's primary result codes of a storage that fails: SQLITE_BUSY, SQLITE_LOCKED,
# SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN.
STORAGE_FAILURES = frozenset({5, 6, 8, 10, 13, 14})


class StateDB:
    """One SQLite file, one thread. ``await db.run(fn)`` calls ``fn(connection)`` there."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="weightsync-sqlite")
        self._conn: sqlite3.Connection | None = self._executor.submit(self._open).result(timeout=30)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        return conn

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``fn(connection)`` on the database thread, inside a transaction."""
        if self._executor is None or self._conn is None:
            raise RuntimeError("state database is closed")
        return await run_in(self._executor, self._transaction, self._conn, fn)

    def run_sync(self, fn: Callable[[sqlite3.Connection], T], timeout_s: float = 30.0) -> T:
        """Blocking variant for start-up and shutdown paths (never call from the loop)."""
        if self._executor is None or self._conn is None:
            raise RuntimeError("state database is closed")
        return self._executor.submit(self._transaction, self._conn, fn).result(timeout=timeout_s)

    def _transaction(self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(conn)`` in one transaction, on the database thread; SQLite's storage
        failures come out as StateNotWritable."""
        try:
            with conn:  # commits, or rolls back on error
                conn.execute("BEGIN IMMEDIATE")
                return fn(conn)
        except sqlite3.OperationalError as exc:
            if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) not in STORAGE_FAILURES:
                raise  # a statement's own error: a bug, not the storage
            raise StateNotWritable(f"state database {self.path} cannot be written: {exc}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        """Closes the connection and the thread (bounded). Idempotent."""
        executor, conn = self._executor, self._conn
        self._executor, self._conn = None, None
        if executor is None:
            return
        if conn is not None:
            executor.submit(conn.close).result(timeout=timeout_s)
        executor.shutdown(wait=False, cancel_futures=True)


def get_meta(conn: sqlite3.Connection, key: str, default: str) -> str:
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return row[0] if row else default


def set_meta(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                 (key, str(value)))


__all__ = ["StateDB", "get_meta", "set_meta"]
