"""SyncLedger: one logical sync (``update_weights(key=K)``) kept as one record across attempts.

``update_weights`` is three calls (Pause, Broadcast, Resume), each under a key derived
from K, and each alone replays its stored outcome. That is not enough for the whole:
a Pause whose effect was undone -- the trainer was cancelled, and its cancel path
resumed the fleet before any broadcast -- would replay a success that no longer
describes the fleet, and the retry would then broadcast into an idle fleet, forever.
So the coordinator keeps, under K, which *attempt* of the sync is current and how far
it got, and runs each step under a key of that attempt (``attempt_key``):

- ``paused``: the attempt's Pause ran; its round is ``round_id``;
- ``broadcast``: its Broadcast ran to a result (``ok`` or not);
- ``finished``: its Resume ran after its Broadcast. The sync is over: every step of
  the attempt replays its stored outcome from now on;
- ``undone``: its Resume ran before any Broadcast. The Pause no longer holds.

A Pause under K continues the current attempt (replays its Pause, so the Broadcast
attaches to, or replays, the attempt's own) while its round still holds: paused, or
broadcast to a good result. It starts the next attempt -- a fresh Pause, Broadcast and
Resume, with fresh per-engine keys -- when the attempt was undone, when its round is
no longer the coordinator's current one, or when its Broadcast failed and nobody
finished the sync (the trainer died mid-transfer: the engines are torn and paused,
waiting for a good round). A transfer that completed is never run again.

Attempt 1 runs under the step's key itself, so its records read as a plain call's.
The ledger persists in the coordinator's SQLite state (table ``syncs``); a write the
database cannot take is kept in memory and logged, never turned into a failure of a
step that already changed the fleet. Entries are pruned like idempotency records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from weightsync.errors import StateNotWritable
from weightsync.idempotency import DEFAULT_MAX_RECORDS, DEFAULT_RETENTION_S, derive_key
from weightsync.statedb import StateDB

log = logging.getLogger("weightsync.coordinator")

PAUSED, BROADCAST, FINISHED, UNDONE = "paused", "broadcast", "finished", "undone"
# Round phases in which the attempt's round still holds its engines for its Broadcast.
# Not "failed": that round's Broadcast failed (also one the ledger never heard the end
# of, the coordinator having died during it), so the sync needs a new attempt.
_HOLDING_PHASES = ("paused", "broadcasting", "broadcast_done")


@dataclass(frozen=True)
class SyncRecord:
    """How far the current attempt of one logical sync got."""

    attempt: int
    stage: str          # paused | broadcast | finished | undone
    round_id: int = 0   # the round the attempt's Pause opened
    ok: bool = False    # stage broadcast or finished: the Broadcast's result
    created_at: float = 0.0


def attempt_key(step_key: str, attempt: int) -> str:
    """The idempotency key of one step in one attempt (attempt 1: the step's own key)."""
    return step_key if attempt <= 1 else derive_key(step_key, f"attempt-{attempt}")


class SyncLedger:
    """See the module docstring. Use from the coordinator's event loop."""

    def __init__(self, db: StateDB, *, retention_s: float = DEFAULT_RETENTION_S,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self._db = db
        self.retention_s = retention_s
        self.max_records = max_records
        self._records: dict[str, SyncRecord] = {}
        rows = db.run_sync(lambda conn: conn.execute(
            "SELECT key, attempt, stage, round_id, ok, created_at FROM syncs").fetchall())
        for key, attempt, stage, round_id, ok, created in rows:
            self._records[key] = SyncRecord(attempt, stage, round_id, bool(ok), created)

    def get(self, sync_key: str) -> SyncRecord | None:
        """The current attempt of ``sync_key``, or None if no Pause of it has run."""
        return self._records.get(sync_key)

    def attempt_for_pause(self, sync_key: str, *, round_id: int, phase: str) -> int:
        """The attempt a Pause under ``sync_key`` belongs to, given the coordinator's
        current round: the current one while its round still holds, else the next."""
        record = self._records.get(sync_key)
        if record is None:
            return 1
        if record.stage == FINISHED:
            return record.attempt
        if record.stage == BROADCAST and record.ok:
            return record.attempt  # the version is in; only the Resume is left
        if record.stage == PAUSED and record.round_id == round_id and phase in _HOLDING_PHASES:
            return record.attempt
        return record.attempt + 1

    def attempt(self, sync_key: str) -> int:
        """The attempt a Broadcast or Resume under ``sync_key`` belongs to."""
        record = self._records.get(sync_key)
        return record.attempt if record is not None else 1

    async def paused(self, sync_key: str, attempt: int, round_id: int) -> None:
        """The attempt's Pause ran and opened ``round_id``."""
        await self._put(sync_key, SyncRecord(attempt, PAUSED, round_id, created_at=time.time()))

    async def broadcast_done(self, sync_key: str, attempt: int, ok: bool) -> None:
        """The attempt's Broadcast reached a result."""
        record = self._records.get(sync_key)
        if record is not None and record.attempt == attempt:
            await self._put(sync_key, replace(record, stage=BROADCAST, ok=ok))

    async def resumed(self, sync_key: str, attempt: int) -> None:
        """The attempt's Resume ran: the sync finished if it broadcast, else its Pause is undone."""
        record = self._records.get(sync_key)
        if record is not None and record.attempt == attempt and record.stage in (PAUSED, BROADCAST):
            await self._put(sync_key, replace(record, stage=FINISHED if record.stage == BROADCAST else UNDONE))

    async def _put(self, sync_key: str, record: SyncRecord) -> None:
        self._records[sync_key] = record
        cutoff = time.time() - self.retention_s
        if len(self._records) > self.max_records:
            oldest = sorted(self._records, key=lambda k: self._records[k].created_at)
            for key in oldest[:len(self._records) - self.max_records]:
                del self._records[key]
        limit = self.max_records

        def save(conn):
            conn.execute("INSERT INTO syncs(key, attempt, stage, round_id, ok, created_at) VALUES(?,?,?,?,?,?) "
                         "ON CONFLICT(key) DO UPDATE SET attempt=excluded.attempt, stage=excluded.stage, "
                         "round_id=excluded.round_id, ok=excluded.ok",
                         (sync_key, record.attempt, record.stage, record.round_id, int(record.ok),
                          record.created_at))
            conn.execute("DELETE FROM syncs WHERE created_at < ?", (cutoff,))
            conn.execute("DELETE FROM syncs WHERE key IN (SELECT key FROM syncs ORDER BY created_at DESC "
                         "LIMIT -1 OFFSET ?)", (limit,))

        try:
            await self._db.run(save)
        except StateNotWritable as exc:
            log.error("logical sync %s kept in memory only: %s", sync_key, exc.message)


__all__ = ["SyncLedger", "SyncRecord", "attempt_key", "PAUSED", "BROADCAST", "FINISHED", "UNDONE"]
