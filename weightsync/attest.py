"""Behavioural attestation: an engine proves it *computes* with the trainer's weights.

A digest of the received bytes says the bytes arrived; it cannot say the engine uses
them. vLLM, for one, repacks weights after loading, and a reload that skips that step
(a tied output layer, say) serves a mix of old and new weights while every byte
check passes. So after loading, and before anything resumes, each engine runs a small
probe through its own forward path: a few fixed token sequences, scored by teacher
forcing. The trainer supplies the log-probabilities its own model assigns to the same
tokens; an engine whose answers differ by more than the tolerance is torn and stays
paused (``EngineOutputMismatch``).

A probe is data (``Probe``): the sequences and, per sequence, the log-probability of
each token after the first given the tokens before it. ``Probe.from_model`` computes
it from any ``tokens [B, T] -> logits [B, T, V]`` callable; the trainer client runs
that on its worker thread, never on the event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.errors import InvalidArgument
from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    import torch

# Log-probabilities (nats) two correct implementations may differ by. fp32 engines
# differ from the trainer only by kernel order (1e-5 .. 1e-4 seen on CPU); bf16 and
# fp16 engines round every activation. A torn layer moves log-probs by whole nats.
# By dtype name: the coordinator checks probes without importing torch.
DEFAULT_TOLERANCE = {"float32": 1e-3, "float64": 1e-3, "bfloat16": 0.15, "float16": 0.05}

MAX_SEQUENCES = 64
MAX_SEQUENCE_TOKENS = 512
MAX_TOTAL_TOKENS = 4096
MAX_TOKEN_ID = 1 << 31


def default_tolerance(dtype: torch.dtype) -> float:
    """The stated tolerance for engines that serve ``dtype`` weights."""
    return DEFAULT_TOLERANCE.get(str(dtype).removeprefix("torch."), DEFAULT_TOLERANCE["bfloat16"])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probs: ``logits [T, V]`` for ``tokens [T]`` -> ``[T - 1]``,
    entry i being log p(tokens[i + 1] | tokens[: i + 1])."""
    import torch
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logprobs.gather(-1, tokens[1:].long().unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class Probe:
    """Token sequences and the log-probs the trainer's model gives them.

    Attributes:
        sequences: token ids, each sequence at least 2 tokens long.
        logprobs: per sequence, ``len(sequence) - 1`` expected log-probs.
        tolerance: largest allowed absolute difference, in nats.
    """

    sequences: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    tolerance: float

    def __post_init__(self) -> None:
        check_probe(self.sequences, self.logprobs, self.tolerance)

    @classmethod
    def from_model(cls, model: Callable[[torch.Tensor], torch.Tensor], sequences: Sequence[Sequence[int]], *,
                   tolerance: float | None = None, dtype: torch.dtype | None = None) -> Probe:
        """Scores ``sequences`` with ``model`` (``tokens [B, T] -> logits [B, T, V]``).

        Blocking: the trainer client calls it on its worker thread. ``tolerance``
        defaults to the stated one for engines serving ``dtype`` (float32 if None).
        """
        import torch
        sequences = [[int(t) for t in s] for s in sequences]
        expected: list[tuple[float, ...]] = [()] * len(sequences)
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_length.setdefault(len(seq), []).append(i)
        with torch.no_grad():
            for indices in by_length.values():  # one forward per length: a batch without padding
                tokens = torch.tensor([sequences[i] for i in indices], dtype=torch.long)
                logits = model(tokens).detach().float().cpu()
                for row, i in enumerate(indices):
                    expected[i] = tuple(token_logprobs(logits[row], tokens[row]).tolist())
        return cls(tuple(tuple(s) for s in sequences), tuple(expected),
                   default_tolerance(dtype or torch.float32) if tolerance is None else tolerance)

    def to_proto(self) -> common_pb2.AttestationProbe:
        """The wire form (protobuf)."""
        return common_pb2.AttestationProbe(
            sequences=[common_pb2.ProbeSequence(tokens=list(s), logprobs=list(lp))
                       for s, lp in zip(self.sequences, self.logprobs, strict=True)],
            tolerance=self.tolerance)

    @classmethod
    def from_proto(cls, msg: common_pb2.AttestationProbe) -> Probe:
        """Rebuilds and validates a probe received over the wire (InvalidArgument)."""
        return cls(tuple(tuple(s.tokens) for s in msg.sequences), tuple(tuple(s.logprobs) for s in msg.sequences),
                   msg.tolerance)

    def compare(self, got: Sequence[Sequence[float]]) -> Comparison:
        """How far an engine's log-probs ``got`` are from the expected ones."""
        if len(got) != len(self.sequences):
            raise InvalidArgument(f"engine scored {len(got)} sequences, the probe has {len(self.sequences)}")
        worst: Comparison | None = None
        for i, (want, have) in enumerate(zip(self.logprobs, got, strict=True)):
            if len(have) != len(want):
                raise InvalidArgument(f"engine scored {len(have)} positions of sequence {i}, expected {len(want)}")
            for j, (w, h) in enumerate(zip(want, have, strict=True)):
                diff = abs(w - h) if math.isfinite(h) else math.inf  # a NaN from the engine is a mismatch
                if worst is None or diff > worst.max_diff:
                    worst = Comparison(diff, i, j + 1, w, h)
        assert worst is not None  # a valid probe has at least one position
        return worst


@dataclass(frozen=True)
class Comparison:
    """The largest difference between expected and engine log-probs, and where."""

    max_diff: float
    sequence: int     # which probe sequence
    position: int     # which token of it (>= 1)
    expected: float
    got: float

    def describe(self) -> str:
        return (f"max |log-prob difference| {self.max_diff:.6g} at sequence {self.sequence}, token "
                f"{self.position} (trainer {self.expected:.6g}, engine {self.got:.6g})")


def check_probe(sequences: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], tolerance: float) -> None:
    """Bounds and consistency of a probe; InvalidArgument naming the first problem."""
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0):
        raise InvalidArgument(f"probe tolerance must be a positive finite number of nats, got {tolerance!r}")
    if not sequences:
        raise InvalidArgument("probe has no sequences")
    if len(sequences) > MAX_SEQUENCES:
        raise InvalidArgument(f"probe has {len(sequences)} sequences; at most {MAX_SEQUENCES}")
    if len(logprobs) != len(sequences):
        raise InvalidArgument(f"probe has {len(sequences)} sequences but {len(logprobs)} log-prob lists")
    total = 0
    for i, (seq, lps) in enumerate(zip(sequences, logprobs, strict=True)):
        if not 2 <= len(seq) <= MAX_SEQUENCE_TOKENS:
            raise InvalidArgument(f"probe sequence {i} has {len(seq)} tokens; need 2..{MAX_SEQUENCE_TOKENS}")
        total += len(seq)
        if any(not 0 <= t < MAX_TOKEN_ID for t in seq):
            raise InvalidArgument(f"probe sequence {i} has a negative or huge token id")
        if len(lps) != len(seq) - 1:
            raise InvalidArgument(f"probe sequence {i}: {len(lps)} log-probs for {len(seq)} tokens "
                                  f"(need one per token after the first)")
        if any(not (math.isfinite(x) and x <= 0.0) for x in lps):
            raise InvalidArgument(f"probe sequence {i}: log-probs must be finite and <= 0")
    if total > MAX_TOTAL_TOKENS:
        raise InvalidArgument(f"probe has {total} tokens in all; at most {MAX_TOTAL_TOKENS}")


def check_vocab(probe: Probe, vocab_size: int) -> None:
    """InvalidArgument if a probe token is outside the engine's vocabulary."""
    for i, seq in enumerate(probe.sequences):
        bad = [t for t in seq if t >= vocab_size]
        if bad:
            raise InvalidArgument(f"probe sequence {i} has token {bad[0]} outside the engine's vocabulary "
                                  f"of {vocab_size}")


__all__ = ["Probe", "Comparison", "DEFAULT_TOLERANCE", "default_tolerance", "token_logprobs", "check_probe",
           "check_vocab", "MAX_SEQUENCES", "MAX_SEQUENCE_TOKENS", "MAX_TOTAL_TOKENS"]
