"""One logical sync: Pause -> Broadcast -> Resume under one key, as
``TrainerClient.update_weights`` runs it.

``WholeSync`` drives the three steps through a narrow interface (``SyncSteps``: the
client's public ``pause``, ``broadcast`` and ``resume`` and three settings), so the
order it keeps is the same whichever client supplies them: the engines that paused are
resumed whatever fails or is cancelled (with ``resume_grace_s`` even when the sync's
deadline is spent), a partial sync is logged or refused (``min_engines``), and the
result carries each step's timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Protocol

import torch

from weightsync import deadline, metrics
from weightsync.client.loop_lag import LoopLagProbe
from weightsync.client.results import EngineResult, SyncResult
from weightsync.client.retry import new_key
from weightsync.errors import (
    CoordinatorUnavailable,
    EngineUnavailable,
    InvalidArgument,
    WeightSyncError,
    outcome_error,
)
from weightsync.idempotency import derive_key, validate_key
from weightsync.v1 import coordinator_pb2

log = logging.getLogger("weightsync.client")


class SyncSteps(Protocol):
    """What ``WholeSync`` needs of a client."""

    default_timeout_s: float
    resume_grace_s: float
    measure_loop_lag: bool

    async def pause(self, **kwargs) -> coordinator_pb2.PauseResponse: ...

    async def broadcast(self, named_tensors, **kwargs) -> SyncResult: ...

    async def resume(self, **kwargs) -> coordinator_pb2.ResumeResponse: ...


class WholeSync:
    """One ``update_weights`` call over ``steps`` (see the module docstring)."""

    def __init__(self, steps: SyncSteps) -> None:
        self._steps = steps

    async def run(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                  transport: str | None = None, mode: str = "keep", offload_kv: bool = False,
                  timeout_s: float | None = None, verify_digest: bool = False,
                  required_engines: Iterable[str] = (), attest=None, key: str | None = None,
                  min_engines: int | None = None) -> SyncResult:
        """``TrainerClient.update_weights``: its docstring says what this promises."""
        started = time.monotonic()
        if version <= 0:
            raise InvalidArgument("version must be a positive integer")
        if min_engines is not None and (not isinstance(min_engines, int) or min_engines < 1):
            raise InvalidArgument(f"min_engines must be a positive integer, got {min_engines!r}")
        sync_key = validate_key(key) if key else new_key("sync")
        keys = {step: derive_key(sync_key, step) for step in ("pause", "broadcast", "resume")}
        keys["sync"] = sync_key
        probe = LoopLagProbe().start() if self._steps.measure_loop_lag else None
        try:
            result = await self._update_weights(named_tensors, version=version, transport=transport, mode=mode,
                                                offload_kv=offload_kv, timeout_s=timeout_s,
                                                verify_digest=verify_digest, required_engines=required_engines,
                                                attest=attest, keys=keys, min_engines=min_engines)
        finally:
            if probe is not None:
                await probe.stop()
        metrics.CLIENT_SYNC_SECONDS.observe(time.monotonic() - started)
        if probe is None:
            return result
        lag = {"max": probe.max_ms, "p99": probe.p99_ms}
        for stat, value in lag.items():
            metrics.CLIENT_LOOP_LAG_MS.labels(stat).set(value)
        return dataclasses.replace(result, loop_lag_ms=lag)

    async def _update_weights(self, named_tensors, *, version, transport, mode, offload_kv, timeout_s,
                              verify_digest, required_engines, attest, keys: dict[str, str],
                              min_engines: int | None = None) -> SyncResult:
        started = time.monotonic()
        budget = timeout_s if timeout_s is not None else self._steps.default_timeout_s
        with deadline.scope(budget, operation="sync"):
            with deadline.operation("pause"):
                t0 = time.monotonic()
                try:
                    paused = await self._steps.pause(mode=mode, offload_kv=offload_kv, required_engines=required_engines,
                                              key=keys["pause"], version=version, sync_key=keys["sync"])
                except (WeightSyncError, asyncio.CancelledError) as exc:
                    # Release the engines that did pause -- also when the caller cancelled:
                    # the coordinator finishes a Pause it started, and nothing else would
                    # ever resume those engines. (A coordinator that cannot be reached
                    # paused nothing, and a Resume would only fail the same way.)
                    if not isinstance(exc, CoordinatorUnavailable):
                        await self._resume_after(exc, keys)
                    raise
                pause_s = time.monotonic() - t0
                skipped = tuple(EngineResult.from_proto(o) for o in paused.engines if not o.ok)
                await self._check_taking_part(paused, skipped, version=version, min_engines=min_engines, keys=keys)
            primary: BaseException | None = None
            result: SyncResult | None = None
            try:
                with deadline.operation("broadcast"):
                    result = await self._steps.broadcast(named_tensors, version=version, transport=transport,
                                                  verify_digest=verify_digest, attest=attest, key=keys["broadcast"],
                                                  sync_key=keys["sync"])
            except BaseException as exc:
                primary = exc
                raise
            finally:
                t1 = time.monotonic()
                resumed = await self._resume_after(primary, keys)
                resume_s = time.monotonic() - t1
        assert result is not None
        return SyncResult(version=result.version, ok=result.ok, bytes=result.bytes,
                          transfer_seconds=result.transfer_seconds, engines=result.engines, pause_seconds=pause_s,
                          resume_seconds=resume_s, total_seconds=time.monotonic() - started,
                          resumed=tuple(resumed), skipped=skipped)

    async def _check_taking_part(self, paused: coordinator_pb2.PauseResponse, skipped: tuple[EngineResult, ...], *,
                                 version: int, min_engines: int | None, keys: dict[str, str]) -> None:
        """A partial sync is said out loud: a warning naming every engine left out and
        why; with ``min_engines`` unmet, EngineUnavailable (the paused engines resumed)."""
        why = "; ".join(f"{e.engine_id}: {e.error_message or e.error_reason}" for e in skipped)
        taking_part = len(paused.engines) - len(skipped)
        if min_engines is not None and taking_part < min_engines:
            error = EngineUnavailable(
                f"only {taking_part} engine(s) paused for version {version}, min_engines={min_engines}"
                + (f"; left out: {why}" if why else "")
                + ": start or repair the missing engines (weightsync status shows them), or lower min_engines",
                metadata={"engines": ",".join(e.engine_id for e in skipped), "min_engines": str(min_engines)})
            await self._resume_after(error, keys)
            raise error
        if skipped:
            log.warning("syncing version %d without %d of %d engine(s) (they are fenced until they catch up): %s",
                        version, len(skipped), len(paused.engines), why)

    async def _resume_after(self, primary: BaseException | None, keys: dict[str, str]) -> list[str]:
        """Resume that always runs, with at least ``resume_grace_s`` even if the sync's
        deadline is spent: engines must not stay paused because the trainer ran late."""
        left = deadline.remaining()
        budget = max(left or 0.0, self._steps.resume_grace_s)
        try:
            with deadline.fresh(budget, operation="resume"), deadline.operation("resume"):
                response = await self._steps.resume(key=keys["resume"], sync_key=keys["sync"])
        except WeightSyncError as exc:
            if primary is None:
                raise
            primary.add_note(f"resume after the failure also failed: {exc}")
            return []
        if primary is not None:
            for o in response.engines:
                if not o.ok:
                    primary.add_note(f"{o.engine_id} stays paused: {outcome_error(o.error_reason, o.error_message)}")
        return [o.engine_id for o in response.engines if o.ok]
