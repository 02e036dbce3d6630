"""Everything about a Receive checked before anything changes on the engine: the
deadline, the plan against the engine's own tensors (names first, with a hint where
they are a wrapper's or fused experts'), the rendezvous, a relay's lanes, a sharded
trainer's owners and lanes, the probe, and that the version is newer than the one the
engine serves. Runs on the agent's control thread (it asks the engine)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from weightsync import transport as transports
from weightsync.attest import Probe
from weightsync.dtypes import dtype_name
from weightsync.engine.adapter import EngineAdapter
from weightsync.errors import EngineUnavailable, FailedPrecondition, InvalidArgument
from weightsync.plan import BucketPlan, is_reference
from weightsync.server.agent.naming_hints import naming_hint
from weightsync.sharding import Owners
from weightsync.transport.base import Receiver
from weightsync.transport.from_senders import SenderLane
from weightsync.v1 import common_pb2
from weightsync.validate import check_port, check_timeout


@dataclass(frozen=True)
class Checked:
    """A Receive that passed every check: what it needs to run."""

    plan: BucketPlan
    receiver: Receiver
    probe: Probe | None
    senders: tuple[SenderLane, ...] = ()
    owners: Owners | None = None
    relays: tuple[Forward, ...] = ()


@dataclass(frozen=True)
class Forward:
    """A lane this agent relays: ``upstream`` (gloo, from the trainer or one of its
    ranks) re-shared as rank 0 of ``downstream`` (its host's shm lane), laid out as
    ``plan``. ``index``: which of the agent's relays (each keeps its own group and segment)."""

    index: int
    upstream: common_pb2.Rendezvous
    downstream: common_pb2.Rendezvous
    plan: BucketPlan


class ReceiveChecks:
    """The checks of one agent's Receives. ``receiver_for(kind, lane)``: the agent's
    receiver for a lane (it owns them); ``note_workers(n)``: the engine's worker
    count, read live by the check, for the agent's state."""

    def __init__(self, engine_id: str, adapter: EngineAdapter, *, receiver_for: Callable[[int, int], Receiver],
                 note_workers: Callable[[int], None]) -> None:
        self.engine_id = engine_id
        self.adapter = adapter
        self._receiver_for = receiver_for
        self._note_workers = note_workers
        self._plan_fits = ""  # plan_id of the last plan checked against the engine's tensors

    def validate(self, request) -> Checked:
        """Checks everything about a Receive before anything changes."""
        check_timeout(request.timeout_s)
        if not is_reference(request.plan):
            self._check_plan_not_larger(request.plan)
        plan = BucketPlan.from_proto(request.plan)
        probe = Probe.from_proto(request.probe) if request.HasField("probe") else None
        if plan.plan_id != self._plan_fits:  # the engine's specs never change: check a plan once
            self._check_plan_fits(plan)
            self._plan_fits = plan.plan_id
        rdzv = request.rendezvous
        if rdzv.transport not in transports.KIND_NAMES:
            raise InvalidArgument(f"unknown transport {rdzv.transport}")
        if not rdzv.group_id or not rdzv.session_id or not rdzv.store_host:
            raise InvalidArgument("rendezvous needs group_id, session_id and store_host")
        check_port(rdzv.store_port, "rendezvous store_port")
        if rdzv.world_size < 2 or not 1 <= request.rank < rdzv.world_size:
            raise InvalidArgument(f"rank {request.rank} is not a receiver rank of world {rdzv.world_size}")
        workers = self.adapter.workers()  # a live answer: this runs on the control thread
        self._note_workers(workers)
        if request.rank + workers > rdzv.world_size:
            # The round was planned before this engine's worker count was known (or it
            # changed): nothing has started; the next round uses the count reported now.
            raise FailedPrecondition(f"engine {self.engine_id} receives with {workers} workers from rank "
                                     f"{request.rank}; the round's group has {rdzv.world_size} ranks",
                                     reason="ENGINE_WORKERS_CHANGED")
        relays: tuple[Forward, ...] = ()
        if request.HasField("relay"):
            self._check_relay(request.relay, rdzv)
            relays = (Forward(0, request.relay, rdzv, plan),)
        senders, owners = self._sender_lanes(request, plan) if request.HasField("owners") else ((), None)
        if owners is not None:
            relays = self._forwarded_lanes(request, owners)
        self.adapter.check_receive(request)
        if probe is not None:
            self.adapter.check_probe(probe)
        served = self.adapter.weight_version  # a live reading: this runs on the control thread
        if served is None:
            raise EngineUnavailable(f"engine {self.engine_id}'s weight version cannot be read, so a newer one "
                                    "cannot be checked; try again when it answers", reason="VERSION_UNKNOWN")
        if request.version <= served:
            raise FailedPrecondition(f"version {request.version} is not newer than the served version "
                                     f"{served}", reason="VERSION_NOT_NEWER")
        return Checked(plan, self._receiver_for(rdzv.transport), probe, senders, owners, relays)

    def _sender_lanes(self, request, plan: BucketPlan) -> tuple[tuple[SenderLane, ...], Owners]:
        """A sharded trainer's round: who sends which parts (they must cover every tensor
        once) and the lane this engine receives each sender in (gloo or shm, each its
        own), all of one size, this engine at one rank."""
        if request.HasField("relay"):
            raise InvalidArgument("a round from several senders is not relayed")
        owners = Owners.from_proto(request.owners, plan)
        lanes = []
        for i, parts in enumerate(request.owners.senders):
            lane = parts.lane
            if lane.transport not in (common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM):
                raise InvalidArgument("a round from several senders takes gloo or shm lanes")
            # Each sender's lane may be of its own transport (shm from a rank on this host,
            # gloo from one elsewhere), but every lane holds this engine at the same rank.
            if lane.world_size != request.rendezvous.world_size:
                raise InvalidArgument(f"sender {parts.sender}'s lane differs from the round's size")
            if not lane.group_id or not lane.session_id or not lane.store_host or lane.sender != parts.sender:
                raise InvalidArgument(f"sender {parts.sender}'s lane needs group_id, session_id, store_host and "
                                      "its sender rank")
            check_port(lane.store_port, "sender lane store_port")
            lanes.append(SenderLane(lane, owners.part_plan(parts.sender), self._receiver_for(lane.transport, i),
                                    parts.sender))
        return tuple(lanes), owners

    def _forwarded_lanes(self, request, owners: Owners) -> tuple[Forward, ...]:
        """A sharded trainer's round: the senders' lanes this agent relays to its host
        (``SenderParts.relay``), each checked as a one-sender relay is."""
        relays = []
        for i, parts in enumerate(request.owners.senders):
            if parts.HasField("relay"):
                self._check_relay(parts.relay, parts.lane)
                if parts.relay.sender != parts.sender or parts.lane.relayed_by != parts.relay.relayed_by:
                    raise InvalidArgument(f"sender {parts.sender}'s relayed lane and its host lane do not match")
                relays.append(Forward(i, parts.relay, parts.lane, owners.part_plan(parts.sender)))
        return tuple(relays)

    @staticmethod
    def _check_relay(relay: common_pb2.Rendezvous, rdzv: common_pb2.Rendezvous) -> None:
        """A relay receives a two-member gloo lane and sends its host's shm lane."""
        if relay.transport != common_pb2.TRANSPORT_KIND_GLOO or relay.world_size != 2:
            raise InvalidArgument("a relay's upstream lane is gloo with 2 members")
        if rdzv.transport != common_pb2.TRANSPORT_KIND_SHM:
            raise InvalidArgument("a relay re-shares over shm")
        if not relay.group_id or not relay.session_id or not relay.store_host:
            raise InvalidArgument("the relay's rendezvous needs group_id, session_id and store_host")
        check_port(relay.store_port, "relay store_port")
        for kind in (common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM):
            reason = transports.unavailable_reason(kind)
            if reason is not None:
                raise FailedPrecondition(f"this agent cannot relay: {reason}", reason="TRANSPORT_UNAVAILABLE")

    def _check_plan_not_larger(self, wire: common_pb2.WeightPlan) -> None:
        """A plan listing more tensors than the engine has (names are unique, so some
        are not the engine's) is refused before it is parsed: its count is one length,
        and a plan may list a million tensors. The first names are read to say which."""
        count, specs = len(wire.dtypes), self.adapter.tensor_specs()
        if count <= len(specs):
            return
        blob = wire.names
        head = blob[:64 * 1024].decode("utf-8", errors="replace").split("\0")
        if len(blob) > 64 * 1024:
            head.pop()  # cut short
        unknown = list(islice((n for n in head if n not in specs), 5))
        if unknown:
            raise InvalidArgument(f"plan names tensors the engine does not have: {unknown} (it lists {count} "
                                  f"tensors; the engine has {len(specs)}){naming_hint(unknown, specs)}",
                                  metadata={"tensor": unknown[0]})
        raise InvalidArgument(f"plan lists {count} tensors; the engine has {len(specs)}")

    def _check_plan_fits(self, plan: BucketPlan) -> None:
        """The plan names exactly the engine's tensors, with their dtypes and shapes.
        Names first: a plan that is not for this engine is refused before any
        per-tensor shape is looked at."""
        specs = self.adapter.tensor_specs()
        names = plan.names
        unknown = list(islice((n for n in names if n not in specs), 5))
        if unknown:
            raise InvalidArgument(f"plan names tensors the engine does not have: {unknown}"
                                  f"{naming_hint(unknown, specs)}", metadata={"tensor": unknown[0]})
        if len(names) != len(specs):  # every name is the engine's and names are unique: some are missing
            planned = set(names)
            missing = list(islice((n for n in specs if n not in planned), 5))
            raise InvalidArgument(f"plan lacks engine tensors: {missing} (a sync must cover every weight)",
                                  metadata={"tensor": missing[0]})
        for name, planned_dtype, planned_shape in zip(names, plan.dtypes, plan.shapes, strict=True):
            dtype, shape = specs[name]
            if planned_dtype != dtype:
                raise InvalidArgument(f"tensor {name!r}: plan dtype {dtype_name(planned_dtype)} != engine "
                                      f"dtype {dtype_name(dtype)}", metadata={"tensor": name})
            if planned_shape != tuple(shape):
                raise InvalidArgument(f"tensor {name!r}: plan shape {list(planned_shape)} != engine shape "
                                      f"{list(shape)}", metadata={"tensor": name})
