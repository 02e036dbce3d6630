"""The reference engine: really generates with ``ReferenceLM``, behaves like vLLM/SGLang.

One scheduler thread runs steps; every step advances each running request by one
token (continuous batching without the batching: requests join and leave between
steps). Each request owns a slot of a preallocated KV pool, as real engines do.

Behaviour the rest of weightsync depends on, and the tests check:
- ``pause(KEEP)`` stops stepping and keeps requests; they continue after ``resume``.
  ``pause(ABORT)`` ends in-flight requests. ``pause(WAIT)`` lets them finish first.
  Requests submitted while paused are queued, not refused.
- ``sleep(["kv_cache"])`` frees the KV pool; ``wake`` reallocates it and requests
  recompute their cache (like vLLM after ``clear_cache``). ``sleep(["weights"])``
  frees the parameters; ``wake`` brings back zeroed storage that must be loaded.
  The parameters lie end to end in one arena, in model order (``weightsync.arena``), made
  again on wake: a transfer lands a bucket of small tensors there in one operation.
- ``resume`` does not look at sleep state (neither does vLLM's): a step with the KV
  cache or the weights asleep is a hard fault that kills the engine, so an ordering
  bug in the caller is loud. The agent is what makes sure it never happens.
- Every generated token carries the weight version of the weights that produced it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from weightsync.arena import place_in_arena
from weightsync.attest import check_vocab, token_logprobs
from weightsync.engine.adapter import EngineAdapter, Request, validate_tags
from weightsync.engine.model import ModelConfig, ReferenceLM
from weightsync.errors import EngineFault, FailedPrecondition, InvalidArgument, StepTimeoutError
from weightsync.packing import weights_digest
from weightsync.parts_digest import parts_digest
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses
from weightsync.v1 import common_pb2
from weightsync.validate import check_pause_mode

MAX_FINISHED_KEPT = 10_000


class ReferenceEngine:
    """See the module docstring. Thread-safe; all public methods may block briefly."""

    def __init__(self, config: ModelConfig, *, max_running: int = 8, step_delay_s: float = 0.0) -> None:
        if max_running <= 0:
            raise InvalidArgument("max_running must be positive")
        self.config = config
        self.model = ReferenceLM(config).eval().requires_grad_(False)  # an engine never trains
        self._specs = {n: (p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()}
        self._params = dict(self.model.named_parameters())
        # The weights end to end in one arena, in model order (``weightsync.arena``): a
        # transfer lands a bucket of small tensors there in one operation.
        place_in_arena(list(self._params.values()), list(self._specs.values()), keep_values=True)
        self.max_running = max_running
        self._step_delay_s = step_delay_s   # lets tests and the demo pace generation
        self._cond = threading.Condition()
        self._paused = False
        self._drain_cutoff: int | None = None  # set while a WAIT pause drains
        self._asleep: set[str] = set()
        # Bumped whenever the parameters get new storage (sleep, wake): whoever keeps
        # their addresses (the adapter, for shm's direct reads) takes them again.
        self.storage_epoch = 0
        self._kv: torch.Tensor | None = self._alloc_kv()
        self._free_slots = list(range(max_running))
        self._queue: list[Request] = []
        self._running: list[Request] = []
        self._requests: OrderedDict[str, Request] = OrderedDict()
        self._ids = itertools.count(1)
        self.weight_version = 0
        self.fault: str | None = None
        self.steps = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="reference-engine", daemon=True)
        self._thread.start()

    # ----- requests -------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_tokens: int) -> str:
        """Queues a request; returns its id. InvalidArgument on a bad prompt or length."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if any(t < 0 or t >= self.config.vocab_size for t in prompt):
            raise InvalidArgument(f"prompt tokens must be in [0, {self.config.vocab_size})")
        if max_tokens <= 0 or len(prompt) + max_tokens > self.config.max_seq_len:
            raise InvalidArgument(f"need 0 < max_tokens and prompt+max_tokens <= {self.config.max_seq_len}")
        with self._cond:
            self._raise_if_faulted()
            seq = next(self._ids)
            request = Request(f"req-{seq}", prompt, max_tokens, seq=seq)
            self._requests[request.request_id] = request
            self._queue.append(request)
            self._forget_old()
            self._cond.notify_all()
            return request.request_id

    def get(self, request_id: str, wait_s: float = 0.0) -> Request:
        """The request (waiting up to ``wait_s`` for it to end). InvalidArgument if unknown."""
        with self._cond:
            request = self._requests.get(request_id)
        if request is None:
            raise InvalidArgument(f"unknown request {request_id!r}")
        if wait_s > 0:
            request.done.wait(wait_s)
        return request

    # ----- control --------------------------------------------------------------------

    def pause(self, mode: int, *, timeout_s: float = 30.0) -> None:
        """Pauses stepping (see module docstring). Returns once no step is running."""
        check_pause_mode(mode)
        with self._cond:
            self._raise_if_faulted()
            if mode == common_pb2.PAUSE_MODE_WAIT and not self._paused:
                self._drain_cutoff = self._last_seq()
                self._cond.notify_all()
                deadline = time.monotonic() + timeout_s
                while self._running or self._admissible():
                    left = deadline - time.monotonic()
                    if left <= 0 or self.fault:
                        self._drain_cutoff = None
                        self._cond.notify_all()
                        self._raise_if_faulted()
                        raise StepTimeoutError("in-flight requests did not finish in time", operation="pause")
                    self._cond.wait(min(left, 0.1))
                self._drain_cutoff = None
            if mode == common_pb2.PAUSE_MODE_ABORT:
                for request in self._running + self._queue:
                    self._finish(request, "aborted")
                self._running.clear()
                self._queue.clear()
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Resumes stepping. Does not check sleep state, on purpose (see module docstring)."""
        with self._cond:
            self._raise_if_faulted()
            self._paused = False
            self._cond.notify_all()

    def sleep(self, tags: Sequence[str]) -> list[str]:
        """Frees the memory of ``tags``; returns the tags that were put to sleep now."""
        tags = validate_tags(tags)
        with self._cond:
            self._raise_if_faulted()
            if not self._paused:
                raise FailedPrecondition("sleep needs a paused engine")
            newly = [t for t in tags if t not in self._asleep]
            if "kv_cache" in newly:
                self._kv = None
                for request in self._running:
                    request.cached = 0  # the cache content is gone; recompute after wake
            if "weights" in newly:
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype)
                self.storage_epoch += 1
            self._asleep.update(newly)
            return newly

    def wake(self, tags: Sequence[str]) -> list[str]:
        """Reallocates the memory of ``tags``; returns the tags woken now.

        Woken weights are zeroed storage: they must be loaded before serving.
        """
        tags = validate_tags(tags)
        with self._cond:
            self._raise_if_faulted()
            woken = [t for t in tags if t in self._asleep]
            if "kv_cache" in woken:
                self._kv = self._alloc_kv()
            if "weights" in woken:
                place_in_arena(list(self._params.values()), list(self._specs.values()), keep_values=False)
                self.storage_epoch += 1
            self._asleep.difference_update(woken)
            return woken

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the scheduler thread (bounded wait). Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ----- weights --------------------------------------------------------------------

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The live parameter tensors, in model order (writes go straight into the model)."""
        return [(n, p.data) for n, p in self.model.named_parameters()]

    def parameters_by_name(self) -> dict[str, torch.nn.Parameter]:
        """name -> live Parameter (the same objects for the engine's lifetime: sleep and
        wake swap their storage, not the Parameters). Writes land in the model."""
        return self._params

    def tensor_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) of every parameter, valid even while weights sleep.
        Computed once: the model's names, dtypes and shapes never change."""
        return self._specs

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence, computed the way the engine serves a
        prompt: one prefill through ``forward_cached`` on a scratch KV cache (not the
        trainer's batched ``forward``), with the weights the engine holds now.

        The request pool and its KV cache are untouched; only allowed while paused.
        """
        with self._cond:
            self._raise_if_faulted()
            if not self._paused:
                raise FailedPrecondition("scoring a probe needs a paused engine")
            if "weights" in self._asleep:
                raise FailedPrecondition("scoring a probe needs the weights awake")
            out = []
            for seq in sequences:
                tokens = torch.tensor([int(t) for t in seq])
                if len(tokens) > self.config.max_seq_len or int(tokens.max()) >= self.config.vocab_size:
                    raise InvalidArgument("probe sequence does not fit the engine's context or vocabulary")
                logits = self.model.forward_cached(tokens, torch.zeros(self.model.kv_shape()), 0, all_logits=True)
                out.append(token_logprobs(logits, tokens).tolist())
            return out

    # ----- state ----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> list[str]:
        return sorted(self._asleep)

    def counts(self) -> tuple[int, int]:
        """(running, queued) request counts.

        Without the engine's lock: a step (the forward pass) holds it, and the agent
        reads counts for every heartbeat on its event loop. Each ``len`` is atomic; a
        count one step old is what a status report needs."""
        return len(self._running), len(self._queue)

    def kv_bytes(self) -> int:
        """Bytes held by the KV pool (0 while asleep)."""
        kv = self._kv
        return 0 if kv is None else kv.numel() * kv.element_size()

    # ----- scheduler ------------------------------------------------------------------

    def _alloc_kv(self) -> torch.Tensor:
        return torch.zeros((self.max_running, *self.model.kv_shape()))

    def _admissible(self) -> list[Request]:
        """Queued requests that may start now: while draining, only those that were in
        flight when the WAIT pause began."""
        if self._drain_cutoff is None:
            return list(self._queue)
        return [r for r in self._queue if r.seq <= self._drain_cutoff]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._paused or self.fault or not (self._running or self._admissible())):
                    self._cond.wait(0.5)
                if self._stop:
                    return
                try:
                    self._step()
                except EngineFault as exc:
                    self._crash(str(exc))
                except Exception as exc:  # any other error in a step is a fault too
                    self._crash(f"step failed: {exc!r}")
                self._cond.notify_all()
            if self._step_delay_s:
                time.sleep(self._step_delay_s)

    def _step(self) -> None:
        # A step with anything asleep is what crashes a GPU engine; crash here too.
        if "kv_cache" in self._asleep or self._kv is None:
            raise EngineFault("engine stepped with its KV cache asleep")
        if "weights" in self._asleep:
            raise EngineFault("engine stepped with its weights asleep")
        for request in self._admissible():
            if not self._free_slots:
                break
            self._queue.remove(request)
            request.slot = self._free_slots.pop()
            request.status = "running"
            self._running.append(request)
        version = self.weight_version
        for request in list(self._running):
            seq = request.sequence()
            cache = self._kv[request.slot]
            logits = self.model.forward_cached(torch.tensor(seq[request.cached:]), cache, request.cached)
            request.cached = len(seq)
            request.tokens.append(int(torch.argmax(logits)))
            request.versions.append(version)
            if len(request.tokens) >= request.max_tokens:
                self._running.remove(request)
                self._finish(request, "finished")
        self.steps += 1

    def _last_seq(self) -> int:
        return max((r.seq for r in self._requests.values()), default=0)

    def _finish(self, request: Request, status: str, error: str = "") -> None:
        request.status = status
        request.error = error
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        request.done.set()

    def _crash(self, reason: str) -> None:
        self.fault = reason
        for request in self._running + self._queue:
            self._finish(request, "failed", reason)
        self._running.clear()
        self._queue.clear()

    def _raise_if_faulted(self) -> None:
        if self.fault:
            raise EngineFault(f"engine is dead: {self.fault}")

    def _forget_old(self) -> None:
        while len(self._requests) > MAX_FINISHED_KEPT:
            oldest_id, oldest = next(iter(self._requests.items()))
            if not oldest.done.is_set():
                break
            del self._requests[oldest_id]


__all__ = ["ReferenceEngine", "ReferenceAdapter"]


class ReferenceAdapter(EngineAdapter):
    """Hosts a ``ReferenceEngine`` in the agent process."""

    name = "reference"
    state_is_local = True

    def __init__(self, config: ModelConfig, *, step_delay_s: float = 0.0, max_running: int = 8) -> None:
        self.engine = ReferenceEngine(config, step_delay_s=step_delay_s, max_running=max_running)
        self._targets: tuple[tuple[str, int], AddressedTensors] | None = None

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

    can_export_weights = True

    def export_weights(self):
        return self.engine.named_tensors()

    def load_targets(self, plan):
        # The Parameters themselves (not ``.data``, a new tensor each time): one dict
        # lookup per tensor, and the list is reused while the plan stays the same. So
        # are their addresses (shm's direct reads write there; 20k parameters take
        # about 13 ms to list), until sleep or wake gives the parameters new storage.
        key = (plan.plan_id, self.engine.storage_epoch)
        if self._targets is None or self._targets[0] != key or self._targets[1].sizes is not plan.sizes:
            live = self.engine.parameters_by_name()
            targets = [live[name] for name in plan.names]
            self._targets = (key, AddressedTensors(targets, tensor_addresses(targets, plan.dtypes, plan.sizes),
                                                   plan.sizes))
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

    def received_digest(self, owners=None):
        if owners is None:
            return self.weights_digest()
        return parts_digest(owners.plan, owners, self.engine.named_tensors())

    def submit(self, prompt, max_tokens):
        return self.engine.submit(prompt, max_tokens)

    def get(self, request_id, wait_s):
        return self.engine.get(request_id, wait_s)

    def counts(self):
        return self.engine.counts()

    def close(self):
        self.engine.close()
