"""The engine adapter interface the agent drives, and the types it speaks in.

It depends on no engine: each engine's adapter lives with that engine
(``reference.py``, ``vllm.py``, ``sglang.py``) and ``weightsync.engine.make_adapter``
picks one by name.

Adapters are synchronous: the agent calls them from its engine-control thread (and
the load path from its transfer thread), never from the event loop.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weightsync.attest import Probe
from weightsync.errors import InvalidArgument, Unsupported
from weightsync.plan import BucketPlan
from weightsync.transport import LAYOUTS
from weightsync.transport.from_senders import SenderLane, part_targets, receive_from_senders
from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    from weightsync.sharding import Owners
    from weightsync.transport.base import Receiver

ATTESTATION_UNSUPPORTED = "ATTESTATION_UNSUPPORTED"

TAGS = ("weights", "kv_cache")  # what an engine can put to sleep and wake


@dataclass
class Request:
    """One generation request and what it produced so far (``EngineAdapter.get``). The
    last fields are the reference engine's scheduling state; other engines leave them."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    status: str = "queued"          # queued | running | finished | aborted | failed
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    error: str = ""
    seq: int = 0
    slot: int | None = None
    cached: int = 0                 # positions already in this request's KV cache
    done: threading.Event = field(default_factory=threading.Event)

    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def validate_tags(tags: Sequence[str]) -> list[str]:
    """Empty means all tags; unknown tags are an InvalidArgument."""
    if not tags:
        return list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise InvalidArgument(f"unknown sleep tags {unknown}; known: {list(TAGS)}")
    return list(dict.fromkeys(tags))




@dataclass(frozen=True, kw_only=True)
class Delivery:
    """One receive, as the agent hands it to its engine's adapter."""

    rendezvous: common_pb2.Rendezvous
    rank: int
    plan: BucketPlan
    receiver: Receiver                  # the agent's transport receiver (engines whose tensors it holds)
    deadline_at: float
    abort: threading.Event
    on_bucket: Callable[[int], None] | None = None
    skip_post_load: bool = False        # fault injection (vLLM): tied layers keep their old kernels
    data_host: str = "127.0.0.1"        # the agent's address: where network receivers listen
    # A sharded trainer: every sender's lane (``rendezvous`` is sender 0's) and who sends what.
    senders: tuple[SenderLane, ...] = ()
    owners: Owners | None = None
    version: int = 0                    # the weight version this receive moves the engine to
    verify_parts: bool = False          # a sharded round that asks to verify: hash the parts as they land


class EngineAdapter(abc.ABC):
    """What an agent needs from an engine."""

    name: str = "engine"
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

    # Whether ``export_weights`` works: such an engine can be a catch-up source.
    can_export_weights = False
    # The transports (``common_pb2.TransportKind``) this engine receives over; empty:
    # every one weightsync has (reported in its state: a catch-up skips an engine that
    # cannot take its transport, rather than failing an attempt on it).
    receives: tuple[int, ...] = ()

    @property
    def group_layouts(self) -> tuple[str, ...]:
        """The group transport's layouts this engine takes (reported in its state, so a
        round whose trainer asks for ``auto`` can pick one every engine takes). An
        engine fed by weightsync's own group receiver takes both."""
        return LAYOUTS

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The engine's live weight tensors, by name, in the names ``tensor_specs`` uses
        (read-only: a catch-up sends them to a lagging peer). Blocking: the agent's
        control thread."""
        raise Unsupported(f"{self.name} engines cannot export their weights", reason="EXPORT_UNSUPPORTED")

    def engine_restarted(self) -> None:
        """The engine's process was relaunched: forget what this adapter remembered of
        the old one (sleep ledger, joined groups, plans its workers held). By default
        there is nothing to forget."""
        return None

    def paused_now(self) -> bool | None:
        """Whether the engine itself says it is paused, asked now (blocking: the agent
        calls it on its watch's thread); None when the engine cannot say, or cannot be
        asked now. The agent puts a differing engine back (``server/agent/pause_keeper.py``).
        By default the engine cannot say."""
        return None

    def resume_awake(self) -> None:
        """Resumes the engine with all of its memory awake, whatever the ledger says (the
        pause keeper's repair of an engine found paused: a sleep may have landed
        unseen, and a resume onto memory asleep is what invariant kv-awake forbids). By
        default: wake what the ledger says is asleep, then resume."""
        self.wake(self.asleep)
        self.resume()

    def torn_to(self) -> int | None:
        """Where the engine itself records that a receive into it began and never
        finished: the version it was moving to (read with ``weight_version``, on the
        watch's thread); None otherwise, or where the engine keeps no such record (the
        default). An agent started after its predecessor died mid-receive learns from it
        that the engine is torn."""
        return None

    def version_is_boot(self) -> bool | None:
        """Whether the last version reading (``weight_version``, on the watch's thread)
        found the version record the engine boots with rather than one weightsync
        writes: after the agent had recorded a version, the engine was started again
        (by whatever runs it) and holds its boot weights. None where the engine keeps
        no such record or could not be read (the default)."""
        return None

    def restart_needed(self) -> str:
        """Why the engine can only be trusted again after a restart ("" when it can):
        the launcher relaunches it then, under ``--restart on-failure``. By default
        nothing the adapter sees calls for one."""
        return ""

    def wake_paused(self, tags: Sequence[str]) -> list[str]:
        """Wakes ``tags`` only where the engine stays paused (after a failed receive it
        must not run); returns the tags woken. Waking memory does not resume an engine,
        so by default this is ``wake``; an engine whose wake resumes it overrides this."""
        return self.wake(tags)

    @property
    @abc.abstractmethod
    def asleep(self) -> list[str]:
        """The tags currently asleep (the agent's ledger of record)."""

    @abc.abstractmethod
    def tensor_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) of every weight the engine serves."""

    def receive_stats(self) -> dict[str, str]:
        """What the last receive cost inside the engine, for the agent's transfer_done
        event (local memory: read on the agent's loop)."""
        return {}

    def workers(self) -> int:
        """How many ranks of a data-plane group this engine takes: one per process that
        receives the weights (each tensor-parallel worker loads its own shards from the
        full tensors). May ask the engine (blocking; the agent calls it off its loop)."""
        return 1

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
        """The tensors to receive into, in plan order (already validated); empty for
        an engine whose weights live in its own processes."""

    def receive(self, delivery: Delivery) -> None:
        """Receives a round's bytes into the engine's weights (blocking: the agent's
        transfer thread; bounded by ``delivery.deadline_at``). By default into
        ``load_targets`` through the agent's transport receiver; an engine that
        receives in its own processes (vLLM's workers, SGLang's update group)
        overrides this. Raises on any failure (the agent then marks the engine torn,
        unless the transport says nothing was written)."""
        d = delivery
        if d.senders:  # a sharded trainer: every rank's lane at once, into row ranges of the targets
            receive_from_senders(d.senders, d.rank, part_targets(d.owners, self.load_targets(d.plan)),
                                 deadline_at=d.deadline_at, abort=d.abort, on_bucket=d.on_bucket)
            return
        d.receiver.receive(d.rendezvous, d.rank, d.plan, self.load_targets(d.plan), deadline_at=d.deadline_at,
                           abort=d.abort, on_bucket=d.on_bucket)

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
    def weights_digest(self) -> str:
        """The digest of the weights the engine serves (``weightsync.packing``'s), or ""
        when it cannot be read just now (blocking).

        Raises:
            DigestWithheld: the engine gives none, and asking again will not change
                that (it cannot compute one, or holds weights weightsync did not send).
        """

    def received_digest(self, owners: Owners | None = None) -> str:
        """The digest of what the receive that just ended loaded, read before the
        version is committed (the agent checks it against the trainer's). For a
        sharded trainer's round (``owners``), the parts' digest
        (``weightsync/parts_digest.py``): the same slices of the loaded tensors.

        Raises:
            Unsupported: this engine cannot hash a sharded round's parts."""
        if owners is not None:
            raise Unsupported(f"{self.name} cannot check a sharded trainer's round against its digest",
                              reason="DIGEST_UNSUPPORTED")
        return self.weights_digest()

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


__all__ = ["EngineAdapter", "Delivery", "Request", "TAGS", "validate_tags", "ATTESTATION_UNSUPPORTED"]
