"""SyncLedger's decisions, one by one: which attempt of a logical sync a Pause belongs
to, given how far the last attempt got and the coordinator's round; and that the ledger
survives a coordinator restart (a real SQLite state file)."""

from __future__ import annotations

import pytest

from weightsync.server.coordinator.sync_ledger import (
    BROADCAST,
    FINISHED,
    PAUSED,
    UNDONE,
    SyncLedger,
    attempt_key,
)
from weightsync.statedb import StateDB


@pytest.fixture
def db(tmp_path):
    state = StateDB(str(tmp_path / "state.db"))
    yield state
    state.close()


async def test_a_pause_continues_its_attempt_while_the_round_holds_and_starts_the_next_otherwise(db):
    ledger = SyncLedger(db)
    assert ledger.attempt_for_pause("k", round_id=1, phase="idle") == 1  # never seen
    await ledger.paused("k", 1, round_id=4)
    assert ledger.get("k").stage == PAUSED
    for phase in ("paused", "broadcasting", "broadcast_done"):
        assert ledger.attempt_for_pause("k", round_id=4, phase=phase) == 1, phase
    assert ledger.attempt_for_pause("k", round_id=4, phase="failed") == 2  # its broadcast failed
    assert ledger.attempt_for_pause("k", round_id=5, phase="paused") == 2  # another round took over
    assert ledger.attempt_for_pause("k", round_id=4, phase="idle") == 2    # resumed outside the ledger
    await ledger.resumed("k", 1)
    assert ledger.get("k").stage == UNDONE
    assert ledger.attempt_for_pause("k", round_id=4, phase="paused") == 2


async def test_a_broadcast_decides_between_finishing_and_a_new_attempt(db):
    ledger = SyncLedger(db)
    await ledger.paused("ok", 1, round_id=1)
    await ledger.broadcast_done("ok", 1, ok=True)
    assert ledger.get("ok").stage == BROADCAST
    assert ledger.attempt_for_pause("ok", round_id=9, phase="idle") == 1  # the version is in: resume only
    await ledger.paused("bad", 1, round_id=2)
    await ledger.broadcast_done("bad", 1, ok=False)
    assert ledger.attempt_for_pause("bad", round_id=2, phase="failed") == 2  # nobody finished it
    await ledger.resumed("bad", 1)
    assert ledger.get("bad").stage == FINISHED  # the caller was told: replay from now on
    assert ledger.attempt_for_pause("bad", round_id=2, phase="failed") == 1
    await ledger.broadcast_done("bad", 7, ok=True)  # another attempt's news changes nothing
    assert ledger.get("bad").stage == FINISHED and not ledger.get("bad").ok


async def test_the_ledger_survives_a_restart_and_attempt_keys_are_fresh(tmp_path):
    path = str(tmp_path / "state.db")
    first = StateDB(path)
    ledger = SyncLedger(first)
    await ledger.paused("k", 3, round_id=8)
    first.close()
    again = StateDB(path)
    try:
        record = SyncLedger(again).get("k")
        assert (record.attempt, record.stage, record.round_id) == (3, PAUSED, 8)
    finally:
        again.close()
    assert attempt_key("step", 1) == "step"
    assert len({attempt_key("step", n) for n in (1, 2, 3)}) == 3
