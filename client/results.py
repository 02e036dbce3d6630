"""What a sync returns: ``SyncResult`` and each engine's ``EngineResult``, and the typed
error a failed round becomes (``sync_result_of``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync import transport as transports
from weightsync.errors import EngineOutputMismatch, StepTimeoutError, TransferError
from weightsync.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from weightsync.client.lane_sends import LaneSends


@dataclass(frozen=True)
class EngineResult:
    """One engine's part in a sync.

    Attributes:
        engine_id: the engine's id (``--engine-id`` of its agent).
        ok: it took the step (paused, received and loaded, resumed).
        weight_version: the version it serves -- after a failure too (asked of the
            engine at the end of the round; its last heartbeat's if it cannot answer).
        torn: it holds partly updated weights; it stays paused until a good round.
        paused: it was paused when this was reported.
        seconds: its time in the step.
        error_reason, error_message: why it failed (the typed error's reason).
        attest_max_diff: largest log-prob difference on the attestation probe, if attested.
        transport: what its bytes came over (``shm``, ``gloo``...; ``""`` if none came).
        relayed_by: the engine on its host whose relay fed it over shm, if any.
    """

    engine_id: str
    ok: bool
    weight_version: int
    torn: bool
    seconds: float
    error_reason: str = ""
    error_message: str = ""
    attest_max_diff: float | None = None  # largest |log-prob difference| on the probe, when attested
    transport: str = ""  # what it received over (with "auto": shm or gloo); "" if it never got to it
    relayed_by: str = ""  # the host relay it got the bytes from (over shm), if any
    paused: bool = False  # whether it was paused when this was reported (a failed engine stays paused)

    @classmethod
    def from_proto(cls, o: common_pb2.EngineOutcome) -> EngineResult:
        return cls(engine_id=o.engine_id, ok=o.ok, weight_version=o.weight_version, torn=o.torn, seconds=o.seconds,
                   error_reason=o.error_reason, error_message=o.error_message,
                   attest_max_diff=o.attest_max_diff if o.attested else None,
                   transport=transports.KIND_NAMES.get(o.transport, ""), relayed_by=o.relayed_by, paused=o.paused)


@dataclass(frozen=True)
class SyncResult:
    """What a broadcast (or a whole ``update_weights``) did."""

    version: int
    ok: bool
    bytes: int                    # stream bytes delivered to each engine
    transfer_seconds: float       # trainer side: first bucket packed -> last acknowledged
    engines: tuple[EngineResult, ...]
    pause_seconds: float = 0.0
    resume_seconds: float = 0.0
    total_seconds: float = 0.0
    resumed: tuple[str, ...] = ()   # engines serving again after the sync
    skipped: tuple[EngineResult, ...] = ()  # registered engines left out (unavailable, pause failed)
    loop_lag_ms: dict[str, float] | None = None  # {"max", "p99"} when measure_loop_lag is on

    @property
    def failed(self) -> tuple[EngineResult, ...]:
        return tuple(e for e in self.engines if not e.ok)


class SyncFailed(TransferError):
    """A broadcast finished with at least one engine failed; ``result`` says which."""

    def __init__(self, message: str, *, result: SyncResult) -> None:
        super().__init__(message, metadata={"failed": ",".join(e.engine_id for e in result.failed)})
        self.result = result

    def __reduce__(self):
        # Pickled whole (a bench sweep's child process raises it to its parent): the
        # default would call __init__ without ``result`` and lose the failure's message.
        return _sync_failed, (self.message, self.result)


def _sync_failed(message: str, result: SyncResult) -> SyncFailed:
    return SyncFailed(message, result=result)


def sync_result_of(result: coordinator_pb2.BroadcastResult, send: LaneSends) -> SyncResult:
    """The caller's result of a finished round, or its typed error: every engine's
    attestation mismatch or timeout as one error of that kind, otherwise ``SyncFailed``
    (chained to the sender's error, if it failed too); a sender that failed in a round
    the engines report good is a ``TransferError``."""
    send_error = send.error()
    send_seconds = send.seconds() if send.lanes and send_error is None else 0.0
    sync = SyncResult(version=result.version, ok=result.ok, bytes=result.bytes,
                      transfer_seconds=send_seconds or result.seconds,
                      engines=tuple(EngineResult.from_proto(o) for o in result.engines))
    if result.ok:
        if send_error is not None:
            raise TransferError(f"sender failed: {send_error}") from send_error
        return sync
    failed = "; ".join(f"{e.engine_id}: [{e.error_reason}] {e.error_message}" for e in sync.failed)
    error = SyncFailed(f"broadcast of version {result.version} failed on {len(sync.failed)} "
                       f"engine(s): {failed}", result=sync)
    if all(e.error_reason == EngineOutputMismatch.reason for e in sync.failed):
        worst = max(e.attest_max_diff or 0.0 for e in sync.failed)
        mismatch = EngineOutputMismatch(
            f"engines loaded version {result.version} but do not compute with it: {failed}",
            metadata={"failed": ",".join(e.engine_id for e in sync.failed), "max_diff": f"{worst:.6g}"})
        mismatch.result = sync  # type: ignore[attr-defined]
        raise mismatch from error
    if all(e.error_reason == StepTimeoutError.reason for e in sync.failed):
        # The engines' deadline fired first; the caller sees the same error as if its
        # own had: a timeout naming the operation.
        timeout = StepTimeoutError(f"deadline exceeded during broadcast: {failed}", operation="broadcast")
        timeout.result = sync  # type: ignore[attr-defined]
        raise timeout from error
    if send_error is not None:
        raise error from send_error
    raise error
