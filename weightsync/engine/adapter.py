"""The engine adapter interface the agent drives, and the reference engine's adapter.

Adapters are synchronous: the agent calls them from its engine-control thread (and
the load path from its transfer thread), never from the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from weightsync.attest import Probe, check_vocab
from weightsync.engine.model import ModelConfig
from weightsync.engine.reference import ReferenceEngine, Request
from weightsync.errors import InvalidArgument, Unsupported
from weightsync.plan import BucketPlan, weights_digest

ATTESTATION_UNSUPPORTED = "ATTESTATION_UNSUPPORTED"


class EngineAdapter(abc.ABC):
    """What an agent needs from an engine."""

    name: str = "engine"
    receives_in_engine = False  # True: the engine process receives (receive_in_engine), not the agent
    wake_resumes = False        # True: waking the last sleeping tag resumes the engine by itself
    # True: fault(), weight_version and counts() read local memory (never block), so
    # the agent may read them live on its loop instead of from the polled snapshot.
    state_is_local = False

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

    def check_probe(self, probe: Probe) -> None:
        """Refuses (typed error) an attestation probe this engine cannot run, before
        anything changes: tokens outside its vocabulary, sequences too long, or no way
        to score while paused (FAILED_PRECONDITION, reason ATTESTATION_UNSUPPORTED)."""
        raise Unsupported(f"{self.name} engines cannot run an attestation probe while paused",
                          reason=ATTESTATION_UNSUPPORTED)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence (``len - 1`` per sequence) computed
        by the engine's own forward path with the weights it now holds, while paused.
        Blocking; runs on the agent's transfer thread after a load."""
        raise Unsupported(f"{self.name} engines cannot run an attestation probe while paused",
                          reason=ATTESTATION_UNSUPPORTED)

    @abc.abstractmethod
    def load_targets(self, plan: BucketPlan) -> list[torch.Tensor]:
        """The tensors to receive into, in plan order (already validated)."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Called after a complete, verified load: the engine now serves ``version``."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int | None:
        """The version the engine serves; None when it cannot be read now (blocking)."""

    @abc.abstractmethod
    def fault(self) -> str | None:
        """Why the engine is dead, or None when healthy."""

    @abc.abstractmethod
    def weights_digest(self) -> str: ...

    def submit(self, prompt: Sequence[int], max_tokens: int) -> str:
        raise Unsupported(f"{self.name} does not take generation requests through the agent; send them to the "
                          "engine's own API", reason="GENERATION_UNSUPPORTED")

    def get(self, request_id: str, wait_s: float) -> Request:
        raise Unsupported(f"{self.name} does not take generation requests through the agent; send them to the "
                          "engine's own API", reason="GENERATION_UNSUPPORTED")

    def counts(self) -> tuple[int, int]:
        return 0, 0

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the engine (bounded). Idempotent."""


class ReferenceAdapter(EngineAdapter):
    """Hosts a ``ReferenceEngine`` in the agent process."""

    name = "reference"
    state_is_local = True

    def __init__(self, config: ModelConfig, *, step_delay_s: float = 0.0, max_running: int = 8) -> None:
        self.engine = ReferenceEngine(config, step_delay_s=step_delay_s, max_running=max_running)
        self._targets: tuple[str, list[torch.Tensor]] | None = None

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

    def check_probe(self, probe):
        check_vocab(probe, self.engine.config.vocab_size)
        longest = max(len(s) for s in probe.sequences)
        if longest > self.engine.config.max_seq_len:
            raise InvalidArgument(f"probe sequence of {longest} tokens is longer than the engine's context "
                                  f"of {self.engine.config.max_seq_len}")

    def score(self, sequences):
        return self.engine.score(sequences)

    def load_targets(self, plan):
        # The Parameters themselves (not ``.data``, a new tensor each time): one dict
        # lookup per tensor, and the list is reused while the plan stays the same.
        if self._targets is None or self._targets[0] != plan.plan_id:
            live = self.engine.parameters_by_name()
            self._targets = (plan.plan_id, [live[name] for name in plan.names])
        return self._targets[1]

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


__all__ = ["EngineAdapter", "ReferenceAdapter", "ATTESTATION_UNSUPPORTED"]
