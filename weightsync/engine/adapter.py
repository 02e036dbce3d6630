"""The engine adapter interface the agent drives, and the reference engine's adapter.

Adapters are synchronous: the agent calls them from its engine-control thread (and
the load path from its transfer thread), never from the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from weightsync.engine.model import ModelConfig
from weightsync.engine.reference import ReferenceEngine, Request
from weightsync.plan import BucketPlan, weights_digest


class EngineAdapter(abc.ABC):
    """What an agent needs from an engine."""

    name: str = "engine"
    receives_in_engine = False  # True: the engine process receives (receive_in_engine), not the agent
    wake_resumes = False        # True: waking the last sleeping tag resumes the engine by itself

    @abc.abstractmethod
    def pause(self, mode: int, *, timeout_s: float) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def sleep(self, tags: Sequence[str]) -> list[str]: ...

    @abc.abstractmethod
    def wake(self, tags: Sequence[str]) -> list[str]: ...

    @property
    @abc.abstractmethod
    def asleep(self) -> list[str]:
        """The tags currently asleep (the agent's ledger of record)."""

    @abc.abstractmethod
    def tensor_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) of every weight the engine serves."""

    def check_receive(self, request) -> None:
        """Refuses (typed error) a ReceiveRequest this engine cannot take, before anything
        changes. The plan itself is checked against ``tensor_specs`` by the agent."""
        del request  # the default engine can take any request whose plan fits

    @abc.abstractmethod
    def load_targets(self, plan: BucketPlan) -> list[torch.Tensor]:
        """The tensors to receive into, in plan order (already validated)."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Called after a complete, verified load: the engine now serves ``version``."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    @abc.abstractmethod
    def fault(self) -> str | None:
        """Why the engine is dead, or None when healthy."""

    @abc.abstractmethod
    def weights_digest(self) -> str: ...

    def submit(self, prompt: Sequence[int], max_tokens: int) -> str:
        raise NotImplementedError(f"{self.name} does not take generation requests through the agent")

    def get(self, request_id: str, wait_s: float) -> Request:
        raise NotImplementedError(f"{self.name} does not take generation requests through the agent")

    def counts(self) -> tuple[int, int]:
        return 0, 0

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the engine (bounded). Idempotent."""


class ReferenceAdapter(EngineAdapter):
    """Hosts a ``ReferenceEngine`` in the agent process."""

    name = "reference"

    def __init__(self, config: ModelConfig, *, step_delay_s: float = 0.0, max_running: int = 8) -> None:
        self.engine = ReferenceEngine(config, step_delay_s=step_delay_s, max_running=max_running)

    def pause(self, mode, *, timeout_s):
        self.engine.pause(mode, timeout_s=timeout_s)

    def resume(self):
        self.engine.resume()

    def sleep(self, tags):
        return self.engine.sleep(tags)

    def wake(self, tags):
        return self.engine.wake(tags)

    @property
    def asleep(self):
        return self.engine.asleep

    def tensor_specs(self):
        return self.engine.tensor_specs()

    def load_targets(self, plan):
        live = dict(self.engine.named_tensors())
        return [live[slot.name] for slot in plan.slots]

    def commit(self, version):
        self.engine.weight_version = version

    @property
    def weight_version(self):
        return self.engine.weight_version

    def fault(self):
        return self.engine.fault

    def weights_digest(self):
        return weights_digest(self.engine.named_tensors())

    def submit(self, prompt, max_tokens):
        return self.engine.submit(prompt, max_tokens)

    def get(self, request_id, wait_s):
        return self.engine.get(request_id, wait_s)

    def counts(self):
        return self.engine.counts()

    def close(self):
        self.engine.close()


__all__ = ["EngineAdapter", "ReferenceAdapter"]
