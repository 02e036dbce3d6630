"""The rank protocol of a sharded trainer's round: the store keys its ranks speak
through (``RoundKeys``, one place that names them), the blocking waits on them, and the
records (a round's result or its error) rank 0 hands the other ranks.

Per round, under ``ws-dist/SESSION/N``: each rank's ``holding/R`` (what it holds, or
its error); rank 0's ``plan/R`` and ``lane/R/I`` (the parts a rank sends, and each lane
to send them on); the rank's ``alive/R`` ticks, ``done/R/I`` per lane (and ``done/R``
when it gave up), rank 0's ``stop/R/I``; the round's ``result`` and each rank's
``read/R`` of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from weightsync.client.results import EngineResult, SyncFailed, SyncResult
from weightsync.errors import TransferError, WeightSyncError, outcome_error
from weightsync.transport.secure_store import SecureStore, StoreClient

HEARTBEAT_S = 0.25     # a rank's "alive" tick during a round
RANK_SILENCE_S = 3.0   # a rank whose tick stops this long is gone: its lane is stopped
CLOSE_GRACE_S = 5.0    # rank 0, closing: how long it waits for the others to read the last round's end
STOP_GRACE_S = 10.0    # after a stop, how long rank 0 waits for a rank to say its send ended
_WAIT_SLICE_S = 0.02   # a blocking store wait's slice: between slices the caller looks at its cancel, peers, deadline


@dataclass(frozen=True)
class RoundKeys:
    """The store keys of one round (see the module docstring)."""

    prefix: str

    @classmethod
    def of(cls, session: str, n: int) -> RoundKeys:
        return cls(f"ws-dist/{session}/{n}")

    def holding(self, rank: int) -> str:
        return f"{self.prefix}/holding/{rank}"

    def plan(self, rank: int) -> str:
        return f"{self.prefix}/plan/{rank}"

    def lane(self, rank: int, index: int) -> str:
        return f"{self.prefix}/lane/{rank}/{index}"

    def alive(self, rank: int) -> str:
        return f"{self.prefix}/alive/{rank}"

    def done(self, rank: int, index: int | None = None) -> str:
        return f"{self.prefix}/done/{rank}" + ("" if index is None else f"/{index}")

    def stop(self, rank: int, index: int) -> str:
        return f"{self.prefix}/stop/{rank}/{index}"

    @property
    def result(self) -> str:
        return f"{self.prefix}/result"

    def read(self, rank: int) -> str:
        return f"{self.prefix}/read/{rank}"


def first_set(store: StoreClient, keys: list[str], deadline_at: float) -> str | None:
    """The first of ``keys`` (in their order) that is set, waiting for one in the store
    (no polling: answered the moment one is set) for at most one slice
    (``_WAIT_SLICE_S``) and never past ``deadline_at``; None if none is set by then.
    The rank protocol's waits are made of these slices, so a key set is seen at once
    (polling every 5-20 ms cost a round of small tensors about 30 ms) while the caller
    still looks at its cancel, its peers and its deadline between slices."""
    slice_s = max(0.0, min(_WAIT_SLICE_S, deadline_at - time.monotonic()))
    # The answer may come as late as the caller's deadline (plus the store's grace): a
    # rank 0 slowed down by a loaded machine is no rank 0 gone, and a frozen one still
    # ends the wait by the deadline, as every engine's wait on the store does.
    done, key, _ = store.wait_either(keys[:1], keys[1:], slice_s, answer_by=deadline_at)
    return keys[0] if done else key


def acknowledge_read(store: SecureStore, key: str) -> None:
    """A rank > 0 tells rank 0 it has read the round's end: rank 0 may then close its
    store. Rank 0 sees the key as soon as its store holds it, before the store answers,
    so it may close the connection under the answer: the round's end is already read,
    and that lost answer is no failure of the round."""
    try:
        store.set(key, "1")
    except RuntimeError:
        pass


def error_record(exc: BaseException) -> dict:
    """The error rank 0's round ended with, as plain data for the other ranks."""
    if isinstance(exc, asyncio.CancelledError):
        return {"type": "CancelledError", "reason": "CANCELLED",
                "message": "the round was cancelled on rank 0 (which drives it); the engines hold whatever its "
                           "transfer left (a transfer is never abandoned half-way): see get_state"}
    if isinstance(exc, WeightSyncError):
        return {"type": type(exc).__name__, "reason": exc.reason, "message": exc.message,
                "operation": getattr(exc, "operation", "") or "", "code": exc.code.value[0]}
    return {"type": type(exc).__name__, "reason": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}


def result_record(result: SyncResult) -> dict:
    """A round's result as plain data (JSON) for the other ranks."""
    data = dataclasses.asdict(result)
    data["engines"] = [dataclasses.asdict(e) for e in result.engines]
    data["skipped"] = [dataclasses.asdict(e) for e in result.skipped]
    return data


def result_from(record: dict) -> SyncResult:
    """``result_record`` read back."""
    engines = tuple(EngineResult(**e) for e in record.pop("engines"))
    skipped = tuple(EngineResult(**e) for e in record.pop("skipped"))
    record["resumed"] = tuple(record["resumed"])
    return SyncResult(engines=engines, skipped=skipped, **record)


def raise_recorded(record: dict) -> None:
    """Raises the error rank 0's round ended with, as the same type."""
    error = record["error"]
    result = result_from(record["result"]) if "result" in record else None
    if error["type"] == SyncFailed.__name__ and result is not None:  # the same SyncFailed, with its result
        raise SyncFailed(error["message"], result=result)
    if error["type"] == "CancelledError":
        raise TransferError(error["message"])
    typed = outcome_error(error["reason"], error["message"], operation=error.get("operation") or "sync",
                          code=error.get("code", 0))
    if result is not None:  # a timeout or a mismatch that carries the round's outcome
        typed.result = result  # type: ignore[attr-defined]
    raise typed
