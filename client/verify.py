"""Asking the engines whether they hold the trainer's weights, bitwise.

The coordinator's ``GetState(include_digests=True)`` answers each engine's digest of the
weights it serves, as the engine's agent computes it from the engine's own tensors. An
engine the coordinator could not read just then (its heartbeat late, its answer slow on
a loaded machine, or gone) comes back with *no* digest, which is not a *different*
digest: a check that counts it as different reports torn weights that are not there,
and a check that skips it passes an engine nobody looked at. So ``check_engines``
asks again while an engine is unread or fewer engines are registered than expected,
up to a deadline, and then says of each engine which of the three it is.

An engine that gives no digest at all (SGLang computes none; a vLLM on its boot
weights has nothing weightsync could vouch for) says why (``digest_withheld``): that
answer is final, so it is not asked again, and it is reported apart (``withheld``),
neither as holding the trainer's bytes nor as unread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass

import torch

from weightsync.dtypes import on_wire
from weightsync.errors import InvalidArgument
from weightsync.packing import weights_digest
from weightsync.v1 import coordinator_pb2

ASK_AGAIN_EVERY_S = 0.5


@dataclass(frozen=True)
class EngineHolding:
    """What one engine was seen to hold."""

    engine_id: str
    digest: str  # "" where the coordinator could not read it, or the engine gives none
    version: int
    available: bool
    fault: str
    withheld: str = ""  # why the engine gives no digest at all (``digest`` is then "")

    def holds(self, digest: str, version: int | None) -> bool:
        return self.digest == digest and (version is None or self.version == version)

    def describe(self) -> str:
        if self.withheld:
            return f"{self.engine_id}: gives no digest at version {self.version} ({self.withheld})"
        if not self.digest:
            return f"{self.engine_id}: no digest (available={self.available}, fault={self.fault!r})"
        return f"{self.engine_id}: digest {self.digest[:12]} at version {self.version}"


@dataclass(frozen=True)
class WeightsCheck:
    """The engines against the trainer's digest (and version, where one was asked)."""

    digest: str
    version: int | None
    expected_engines: int | None
    engines: tuple[EngineHolding, ...]
    registered: int  # of the engines asked for (all, or ``engine_ids``), how many the coordinator knows

    @property
    def holding(self) -> list[str]:
        """Engines that hold exactly the trainer's bytes (at ``version``)."""
        return [e.engine_id for e in self.engines if e.holds(self.digest, self.version)]

    @property
    def unread(self) -> list[EngineHolding]:
        """Engines whose digest could not be read before the deadline."""
        return [e for e in self.engines if not e.digest and not e.withheld]

    @property
    def withheld(self) -> list[EngineHolding]:
        """Engines that give no digest at all (``EngineHolding.withheld`` says why):
        whether they hold the trainer's bytes cannot be told this way."""
        return [e for e in self.engines if e.withheld]

    @property
    def different(self) -> list[EngineHolding]:
        """Engines that were read and hold other bytes, or the same at another version."""
        return [e for e in self.engines if e.digest and not e.holds(self.digest, self.version)]

    @property
    def ok(self) -> bool:
        """Every engine holds the trainer's bytes, and there are as many as expected
        (at least one where no count was given)."""
        expected = self.expected_engines if self.expected_engines is not None else max(1, len(self.engines))
        return self.registered == expected and len(self.holding) == len(self.engines)

    def describe(self) -> str:
        """One line: how many engines, and what each engine that does not hold the
        trainer's bytes holds instead."""
        at = f" at version {self.version}" if self.version is not None else ""
        count = (f"{self.registered} of {self.expected_engines} engines registered"
                 if self.expected_engines is not None else f"{self.registered} engines registered")
        if self.ok:
            return f"{count}; every one holds the trainer's bytes (digest {self.digest[:12]}){at}"
        others = "; ".join(e.describe() for e in self.engines if not e.holds(self.digest, self.version))
        return f"{count}; not holding the trainer's bytes (digest {self.digest[:12]}){at}: {others or 'none'}"


def trainer_digest(named_tensors: Iterable[tuple[str, torch.Tensor]], wire_dtype: torch.dtype | None = None) -> str:
    """The digest an engine holds after receiving ``named_tensors`` as a trainer with
    ``wire_dtype`` sends them (floating tensors cast to it). Reads every byte: run it
    off the event loop."""
    def as_sent(t: torch.Tensor) -> torch.Tensor:
        dtype = on_wire(t.dtype, wire_dtype)
        return t.to(dtype) if t.dtype != dtype else t
    return weights_digest((name, as_sent(t)) for name, t in named_tensors)


def validate_request(*, engines: int | None, engine_ids: Collection[str] | None, within_s: float) -> None:
    """Raises InvalidArgument for a check that cannot be asked (before any tensor is
    hashed)."""
    if not within_s >= 0:
        raise InvalidArgument(f"within_s must be >= 0, got {within_s}")
    if engines is not None and engines < 1:
        raise InvalidArgument(f"engines must be >= 1, got {engines}")
    if engine_ids is not None:
        if engines is not None:
            raise InvalidArgument("check_engines takes a count of engines or their ids, not both")
        if isinstance(engine_ids, str) or not all(isinstance(i, str) and i for i in engine_ids):
            raise InvalidArgument("engine_ids must be a collection of engine ids (non-empty strings)")
        if not engine_ids:
            raise InvalidArgument("engine_ids names no engine")


async def check_engines(get_state: Callable[[], Awaitable[coordinator_pb2.GetStateResponse]], digest: str, *,
                        version: int | None = None, engines: int | None = None,
                        engine_ids: Collection[str] | None = None, within_s: float = 60.0) -> WeightsCheck:
    """Reads every engine's digest through ``get_state`` (a coordinator's GetState with
    digests) and compares it with ``digest``; asks again while an engine is unread or
    fewer than ``engines`` are registered, until ``within_s`` has passed.

    ``engine_ids``: check only these engines (e.g. those a round reported synced; the
    others are left out of the answer), each reported unread until it registers."""
    if not digest:
        raise InvalidArgument("check_engines needs the trainer's digest (or its tensors)")
    validate_request(engines=engines, engine_ids=engine_ids, within_s=within_s)
    if engine_ids is not None:
        wanted = sorted(set(engine_ids))
        engines = len(wanted)
    end = time.monotonic() + within_s
    while True:
        state = await get_state()
        seen = tuple(EngineHolding(e.engine_id, e.weights_digest, e.weight_version, e.available, e.fault,
                                   e.digest_withheld) for e in state.engines)
        if engine_ids is not None:
            by_id = {e.engine_id: e for e in seen}
            seen = tuple(by_id.get(i) or EngineHolding(i, "", 0, False, "not registered") for i in wanted)
            present = sum(1 for i in wanted if i in by_id)
        else:
            present = len(seen)
        check = WeightsCheck(digest, version, engines, seen, present)
        complete = present >= (engines or 1) and not check.unread
        if complete or time.monotonic() >= end:
            return check
        await asyncio.sleep(min(ASK_AGAIN_EVERY_S, max(0.0, end - time.monotonic())))


__all__ = ["EngineHolding", "WeightsCheck", "check_engines", "trainer_digest", "validate_request"]
