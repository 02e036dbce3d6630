"""What the agent holds true of its engine, in one place, and the few engine commands
the agent's helpers may give.

``EngineLedger`` is the state the engine-side invariants are decided on: held paused by
a round's Pause, torn (and the version it failed to reach), the KV cache offloaded for
a sync, a receive running. The agent writes it; the version fence, the pause keeper and
the weight exporter read it. ``EngineCommands`` is what those helpers may do with the
engine (pause it, release it, call it on its control thread, record an event) and what
they may read of it (its watched state, its fault): never the agent's other fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from weightsync.engine.adapter import EngineAdapter
    from weightsync.server.agent.engine_watch import EngineWatch

T = TypeVar("T")


@dataclass
class EngineLedger:
    """The agent's own record of its engine (see the module docstring)."""

    paused: bool = False                 # a round's Pause holds the engine
    torn: bool = False                   # partly updated weights: never served (invariant no-torn-serving)
    torn_version: int = 0                # the version a failed receive was moving to
    kv_offloaded_for_sync: bool = False  # a Pause slept the KV cache; woken when the receive ends
    receive: asyncio.Future | None = None  # the receive in flight, settlement included

    def receiving(self) -> bool:
        """A receive is running (its settlement included)."""
        return self.receive is not None and not self.receive.done()


class EngineCommands(Protocol):
    """What the agent's helpers may do with its engine (``AgentCore`` provides it)."""

    engine_id: str
    adapter: EngineAdapter
    watch: EngineWatch

    @property
    def data_host(self) -> str: ...  # where this agent's data plane listens

    def fault(self) -> str: ...

    def record(self, kind: str, **fields: object) -> None: ...

    async def pause_engine(self, mode: int, *, timeout_s: float) -> None: ...

    async def release_engine(self) -> None: ...

    async def run_on_engine(self, fn: Callable[..., T], *args, **kwargs) -> T: ...


__all__ = ["EngineLedger", "EngineCommands"]
