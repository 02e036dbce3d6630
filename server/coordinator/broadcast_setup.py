"""What a Broadcast settles before anything changes: the request checked
(``check_broadcast_request``) and who takes part, in which lane at which rank
(``BroadcastSetup``)."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync import transport as transports
from weightsync.attest import Probe
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.plan import BucketPlan
from weightsync.server.coordinator.registry import EngineRecord
from weightsync.sharding import Owners
from weightsync.transport import AUTO_LAYOUT, LAYOUTS, is_relay_upstream
from weightsync.v1 import common_pb2, coordinator_pb2
from weightsync.validate import check_port, check_timeout

SENDER_TRANSPORTS = (common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM, common_pb2.TRANSPORT_KIND_AUTO)


def check_broadcast_request(request: coordinator_pb2.BroadcastRequest,
                            weight_version: int) -> tuple[BucketPlan, Owners | None]:
    """A Broadcast's plan and owners, or the typed error that refuses it before any
    engine is asked. Runs on a worker thread: a plan may hold a million tensors."""
    plan = BucketPlan.from_proto(request.plan)
    if request.transport not in transports.KIND_NAMES:
        raise InvalidArgument(f"unknown transport {request.transport}")
    if request.transport == common_pb2.TRANSPORT_KIND_AUTO and not (request.trainer_host_id
                                                                    or request.sender_host_ids):
        raise InvalidArgument("the auto transport needs trainer_host_id (the trainer's host id), or a "
                              "sharded trainer's sender_host_ids")
    if len(request.trainer_host_id) > 64:
        raise InvalidArgument("trainer_host_id is at most 64 characters")
    if request.sender_host_ids:
        if not request.HasField("owners"):
            raise InvalidArgument("sender_host_ids apply to a sharded trainer's round (owners) only")
        if any(not h or len(h) > 64 for h in request.sender_host_ids):
            raise InvalidArgument("every sender_host_ids entry is a host id of 1 to 64 characters")
    if request.group_backend not in ("", "gloo", "nccl"):
        raise InvalidArgument(f"group_backend must be gloo or nccl, got {request.group_backend!r}")
    if request.group_backend and request.transport != common_pb2.TRANSPORT_KIND_GROUP:
        raise InvalidArgument("group_backend applies to the group transport only")
    if request.group_layout not in ("", AUTO_LAYOUT, *LAYOUTS):
        raise InvalidArgument(f"group_layout must be one of {(*LAYOUTS, AUTO_LAYOUT)}, "
                              f"got {request.group_layout!r}")
    if request.group_layout and request.transport != common_pb2.TRANSPORT_KIND_GROUP:
        raise InvalidArgument("group_layout applies to the group transport only")
    if not request.store_host:
        raise InvalidArgument("store_host is required")
    check_port(request.store_port, "store_port")
    if len(request.store_secret) > 128 or any(c not in "0123456789abcdef" for c in request.store_secret):
        raise InvalidArgument("store_secret must be at most 128 lowercase hex characters")
    check_timeout(request.timeout_s)
    if request.HasField("probe"):
        Probe.from_proto(request.probe)  # InvalidArgument before any engine is asked
    owners = None
    if request.HasField("owners"):
        if request.transport not in SENDER_TRANSPORTS:
            raise InvalidArgument("a sharded trainer's round (owners) takes transport gloo, shm or auto")
        owners = Owners.from_proto(request.owners, plan)
        if request.sender_host_ids and len(request.sender_host_ids) <= max(owners.sender_ranks):
            raise InvalidArgument(f"sender_host_ids lists {len(request.sender_host_ids)} ranks' hosts; the "
                                  f"owners name sender rank {max(owners.sender_ranks)}")
    if request.version <= weight_version:
        raise FailedPrecondition(f"version {request.version} is not newer than the current version "
                                 f"{weight_version}", reason="VERSION_NOT_NEWER")
    return plan, owners


@dataclass
class BroadcastSetup:
    """What a Broadcast settles before anything changes: the plan, who takes part, in
    which lane (a data-plane group with its own transport and rendezvous) at which
    rank, and by when."""

    plan: BucketPlan
    members: list[EngineRecord]
    gone: list[str]                 # round members no longer available: reported as failed
    lanes: list[common_pb2.Rendezvous]
    timeout_s: float
    widths: dict[str, int]          # ranks each engine takes in its lane (its worker processes)

    owners: Owners | None = None    # a sharded trainer: one lane per sending rank

    def __post_init__(self) -> None:
        # Each engine receives in exactly one lane (a relay's upstream lane is not its own),
        # from its first rank; its workers take the ranks after it. With several senders
        # it receives in one lane of every sender, at the same rank in each (every lane
        # holds one host's engines in engine-id order, or all of them); the transports
        # may differ (shm from a rank on its host, gloo or a relay from one on another);
        # lane_of is sender 0's.
        receiving = [lane for lane in self.lanes if not is_relay_upstream(lane)]
        self.lane_of = {}
        self.lane_by_sender: dict[str, dict[int, common_pb2.Rendezvous]] = {}
        for lane in receiving:
            for e in lane.engine_ids:
                self.lane_of.setdefault(e, lane)
                self.lane_by_sender.setdefault(e, {})[lane.sender] = lane
        self.ranks = {}
        for lane in receiving:
            rank = 1
            for e in lane.engine_ids:
                self.ranks[e], rank = rank, rank + self.widths[e]
        upstream = [lane for lane in self.lanes if is_relay_upstream(lane)]
        # One sender: the relay's upstream lane goes in ReceiveRequest.relay. Several: in
        # each sender's parts (SenderParts.relay), beside the host's lane of that sender.
        self.relay_of = {lane.relayed_by: lane for lane in upstream} if self.owners is None else {}
        self.relays_by_sender: dict[str, dict[int, common_pb2.Rendezvous]] = {}
        if self.owners is not None:
            for lane in upstream:
                self.relays_by_sender.setdefault(lane.relayed_by, {})[lane.sender] = lane
        self.owners_proto = self.owners.to_proto() if self.owners is not None else None
        self._owners_for: dict[tuple, common_pb2.Owners] = {}

    def owners_for(self, engine_id: str) -> common_pb2.Owners | None:
        """What ``engine_id`` is told of a sharded trainer's round: each sender's parts,
        the lane it receives that sender in and, for a host's relay, the sender's lane
        it forwards. Built once per distinct set of lanes (the engines of a host share one)."""
        if self.owners_proto is None:
            return None
        lanes = self.lane_by_sender[engine_id]
        relays = self.relays_by_sender.get(engine_id, {})
        key = tuple((s, lanes[s].session_id, relays[s].session_id if s in relays else "") for s in sorted(lanes))
        told = self._owners_for.get(key)
        if told is None:
            told = common_pb2.Owners()
            told.CopyFrom(self.owners_proto)
            for parts in told.senders:
                parts.lane.CopyFrom(lanes[parts.sender])
                if parts.sender in relays:
                    parts.relay.CopyFrom(relays[parts.sender])
            self._owners_for[key] = told
        return told
