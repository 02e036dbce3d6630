"""Idempotency keys: one key, at most one execution, whatever the retries.

``IdempotencyStore.execute(key, operation, request, fn)``:
- key missing or malformed -> ``InvalidArgument``;
- first time -> runs ``fn`` as a task of its own (a caller that goes away does not
  cancel it), records the outcome, returns it;
- same key and same request while running -> attaches to the running task;
- same key and same request once finished -> the stored response, or the stored error
  -- except an error raised before anything changed (``WeightSyncError.nothing_ran``,
  e.g. "no engine is available" right after a coordinator restart): the key is then
  forgotten, so a retry runs afresh instead of replaying "try again" forever;
- same key, different request -> ``IdempotencyConflict`` (``IDEMPOTENCY_KEY_REUSED``).

The request fingerprint is the operation name plus the request's deterministic
protobuf serialisation with the call-scoped fields cleared: the key, ``timeout_s``
(a retry naturally carries less of its deadline) and the trainer's store address (a
restarted trainer retrying its own key hosts a new store; where the bytes come from
is not what the operation means -- version, plan, transport and digest are). Records live in memory (agents:
for the life of the process) or in the coordinator's SQLite state, where an operation
that was running when the process died is finished as ``OPERATION_ABORTED`` on the
next start, never re-run. Retention is bounded by age and by count.

A state database that cannot be written (``StateNotWritable``: the disk full) refuses
a new key, nothing run -- except for operations that are safe to run again and must
not wait for the disk (``record_optional``: the coordinator's Resume, without which
paused engines serve nothing); their records, and every outcome the database could
not take, are kept in this process's memory instead, so a retry here still replays.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from weightsync.errors import (
    IdempotencyConflict,
    InvalidArgument,
    OperationAborted,
    StateNotWritable,
    WeightSyncError,
    from_status,
)
from weightsync.statedb import StateDB
from weightsync.v1 import common_pb2

M = TypeVar("M", bound=Message)
log = logging.getLogger("weightsync.idempotency")

MAX_KEY_LEN = 128
DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_MAX_RECORDS = 100_000


def validate_key(key: str) -> str:
    """Returns ``key`` if it is 1-128 printable ASCII characters, else InvalidArgument."""
    if not key:
        raise InvalidArgument("idempotency_key is required", metadata={"field": "idempotency_key"})
    if len(key) > MAX_KEY_LEN or not all(32 <= ord(c) < 127 for c in key):
        raise InvalidArgument("idempotency_key must be 1-128 printable ASCII characters",
                              metadata={"field": "idempotency_key"})
    return key


def derive_key(key: str, scope: str) -> str:
    """A per-target key derived from ``key`` (e.g. the coordinator's key for one engine).

    Deterministic, so a retried trainer call derives the same key for every agent.
    """
    digest = hashlib.blake2b(f"{key}\0{scope}".encode(), digest_size=16).hexdigest()
    return f"d-{digest}"


CALL_SCOPED_FIELDS = ("idempotency_key", "timeout_s", "store_host", "store_port", "store_secret")


def fingerprint(operation: str, request: Message) -> str:
    """Operation + request contents, ignoring the call-scoped fields (key, timeout, store).

    A weight plan counts by its ``plan_id`` (which names its contents, and is checked
    against them wherever a whole plan is taken in), so a request that lists the plan's
    tensors and its retry that names the plan by id alone are the same request, and a
    20k-tensor plan is not copied and hashed for every call.
    """
    copy = type(request)()
    for field, value in request.ListFields():
        if field.name in CALL_SCOPED_FIELDS:
            continue
        if field.name == "plan" and value.plan_id:
            copy.plan.CopyFrom(common_pb2.WeightPlan(plan_id=value.plan_id, bucket_bytes=value.bucket_bytes,
                                                     total_bytes=value.total_bytes))
        elif field.is_repeated or field.message_type is not None:
            getattr(copy, field.name).MergeFrom(value)
        else:
            setattr(copy, field.name, value)
    h = hashlib.sha256(operation.encode() + b"\0" + copy.SerializeToString(deterministic=True))
    return h.hexdigest()


@dataclass
class _Record:
    operation: str
    fingerprint: str
    state: str                       # running | done | failed
    response: bytes | None = None
    error: WeightSyncError | None = None
    created_at: float = 0.0


def _error_fields(error: WeightSyncError) -> tuple[int, str, str, str]:
    return error.code.value[0], error.reason, error.message, json.dumps(error.metadata)


def _error_from_fields(code: int, reason: str, message: str, metadata: str) -> WeightSyncError:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2

    from weightsync.errors import DOMAIN

    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=json.loads(metadata or "{}"))
    detail = any_pb2.Any()
    detail.Pack(info)
    return from_status(code, message, [detail])


class IdempotencyStore:
    """See the module docstring. Use from one event loop."""

    def __init__(self, db: StateDB | None = None, *, retention_s: float = DEFAULT_RETENTION_S,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self._db = db
        self.retention_s = retention_s
        self.max_records = max_records
        self._memory: OrderedDict[str, _Record] = OrderedDict()
        # With a database: what it could not take (None: a key it could not forget),
        # consulted before it; bounded like the rest.
        self._unsaved: OrderedDict[str, _Record | None] = OrderedDict()
        self._running: dict[str, asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.executions = 0  # operations actually started (not replays)
        self.replays = 0

    def recover(self) -> int:
        """At start-up: finishes as ABORTED every operation a dead process left running.

        Blocking (call before serving). Returns how many were aborted.
        """
        if self._db is None:
            return 0
        error = OperationAborted("the operation was running when the server stopped; it was not re-run")
        code, reason, message, metadata = _error_fields(error)

        def fix(conn):
            cur = conn.execute(
                "UPDATE idempotency SET state='failed', error_code=?, error_reason=?, error_message=?, "
                "error_metadata=? WHERE state='running'", (code, reason, message, metadata))
            return cur.rowcount

        return self._db.run_sync(fix)

    async def execute(self, key: str, operation: str, request: Message,
                      fn: Callable[[], Awaitable[M]], response_type: type[M], *,
                      on_accept: Callable[[], None] | None = None, record_optional: bool = False) -> M:
        """Runs ``fn`` at most once for ``key``; see the module docstring.

        ``on_accept`` is called once the request is known to be the key's own (new,
        attaching or replayed; never for a conflicting one), before ``fn`` starts.
        ``record_optional``: run even when the database cannot record the key (the
        record is then kept in memory); otherwise that is ``StateNotWritable``.
        """
        validate_key(key)
        # Off the loop: a Broadcast's or Receive's request holds the whole plan (a
        # megabyte at 20k tensors), copied and hashed here.
        fp = await asyncio.to_thread(fingerprint, operation, request)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # makes look-up + insert atomic for concurrent duplicates
            record = await self._load(key)
            if record is not None:
                if record.fingerprint != fp:
                    raise IdempotencyConflict(
                        f"idempotency key {key!r} was already used for a different {record.operation} request",
                        metadata={"key": key, "operation": record.operation})
                task = self._running.get(key)
                if on_accept is not None:
                    on_accept()
                if task is None:
                    self._count_replay()
                    return self._outcome(record, response_type)
            else:
                if on_accept is not None:
                    on_accept()
                new = _Record(operation, fp, "running", created_at=time.time())
                await self._insert(key, new, optional=record_optional)
                self.executions += 1
                task = asyncio.ensure_future(self._run_and_record(key, new, fn))
                self._running[key] = task
                task.add_done_callback(lambda _t, k=key: self._forget_running(k))
        if task is not None and record is not None:
            self._count_replay()
        response = await asyncio.shield(task)
        return response  # type: ignore[return-value]

    def is_running(self, key: str) -> bool:
        """Whether the operation of ``key`` is running now."""
        return key in self._running

    async def wait_for(self, key: str) -> None:
        """Waits until the operation of ``key`` (if running) has ended, whatever its
        outcome (the operation's own deadline bounds the wait)."""
        task = self._running.get(key)
        if task is not None:
            await asyncio.wait({task})

    def _count_replay(self) -> None:
        self.replays += 1
        from weightsync import metrics  # lazy: agents and unit tests need no exporter
        metrics.REPLAYS.inc()

    def _forget_running(self, key: str) -> None:
        self._running.pop(key, None)
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            self._locks.pop(key, None)

    async def _run_and_record(self, key: str, record: _Record, fn: Callable[[], Awaitable[M]]) -> M:
        try:
            response = await fn()
        except WeightSyncError as exc:
            if exc.nothing_ran:
                await self._forget(key)
            else:
                await self._update(key, record, state="failed", error=exc)
            raise
        except asyncio.CancelledError:
            err = OperationAborted("the operation was cancelled (server shutting down)")
            await asyncio.shield(self._update(key, record, state="failed", error=err))
            raise
        except Exception as exc:
            err = WeightSyncError(f"internal error: {exc!r}")
            await self._update(key, record, state="failed", error=err)
            raise err from exc
        await self._update(key, record, state="done", response=response.SerializeToString())
        return response

    @staticmethod
    def _outcome(record: _Record, response_type: type[M]) -> M:
        if record.state == "done" and record.response is not None:
            return response_type.FromString(record.response)
        if record.state == "failed" and record.error is not None:
            raise record.error
        raise OperationAborted("the operation was interrupted and will not be re-run")

    # ----- persistence ----------------------------------------------------------------

    async def _load(self, key: str) -> _Record | None:
        if self._db is None:
            return self._memory.get(key)
        if key in self._unsaved:
            return self._unsaved[key]

        def load(conn):
            return conn.execute(
                "SELECT operation, fingerprint, state, response, error_code, error_reason, error_message, "
                "error_metadata, created_at FROM idempotency WHERE key=?", (key,)).fetchone()

        row = await self._db.run(load)
        if row is None:
            return None
        op, fp, state, response, code, reason, message, metadata, created = row
        error = _error_from_fields(code, reason, message, metadata) if state == "failed" else None
        return _Record(op, fp, state, response, error, created)

    def _keep_unsaved(self, key: str, record: _Record | None, exc: StateNotWritable) -> None:
        log.error("idempotency key %s kept in memory only: %s", key, exc.message)
        self._unsaved[key] = record
        self._unsaved.move_to_end(key)
        while len(self._unsaved) > self.max_records:
            self._unsaved.popitem(last=False)

    async def _insert(self, key: str, record: _Record, *, optional: bool = False) -> None:
        if self._db is None:
            self._memory[key] = record
            self._prune_memory()
            return
        cutoff = time.time() - self.retention_s
        limit = self.max_records

        def insert(conn):
            conn.execute("INSERT INTO idempotency(key, operation, fingerprint, state, created_at) "
                         "VALUES(?,?,?,?,?)", (key, record.operation, record.fingerprint, record.state,
                                               record.created_at))
            conn.execute("DELETE FROM idempotency WHERE created_at < ? AND state != 'running'", (cutoff,))
            conn.execute("DELETE FROM idempotency WHERE state != 'running' AND key IN (SELECT key FROM "
                         "idempotency ORDER BY created_at DESC LIMIT -1 OFFSET ?)", (limit,))

        try:
            await self._db.run(insert)
        except StateNotWritable as exc:
            if not optional:
                raise
            self._keep_unsaved(key, record, exc)

    async def _update(self, key: str, record: _Record, *, state: str, response: bytes | None = None,
                      error: WeightSyncError | None = None) -> None:
        """Records the outcome. It has happened: a database that cannot take it keeps it
        from no caller (the record stays in memory), and never replaces it with its own error."""
        record.state, record.response, record.error = state, response, error
        if self._db is None:
            return
        fields = _error_fields(error) if error is not None else (None, None, None, None)

        def update(conn) -> int:
            return conn.execute("UPDATE idempotency SET state=?, response=?, error_code=?, error_reason=?, "
                                "error_message=?, error_metadata=? WHERE key=?",
                                (state, response, *fields, key)).rowcount

        try:
            updated = await self._db.run(update)
        except StateNotWritable as exc:
            self._keep_unsaved(key, record, exc)
        else:
            if updated:  # else the key's record is the one in memory (its insert failed)
                self._unsaved.pop(key, None)

    async def _forget(self, key: str) -> None:
        if self._db is None:
            self._memory.pop(key, None)
            return
        try:
            await self._db.run(lambda conn: conn.execute("DELETE FROM idempotency WHERE key=?", (key,)))
        except StateNotWritable as exc:
            self._keep_unsaved(key, None, exc)
        else:
            self._unsaved.pop(key, None)

    def _prune_memory(self) -> None:
        cutoff = time.time() - self.retention_s
        while self._memory:
            key, oldest = next(iter(self._memory.items()))
            if key in self._running:
                break
            if len(self._memory) > self.max_records or oldest.created_at < cutoff:
                self._memory.popitem(last=False)
            else:
                break


__all__ = ["IdempotencyStore", "validate_key", "derive_key", "fingerprint", "MAX_KEY_LEN"]
