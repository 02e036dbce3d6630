"""A round's lanes: which engines receive over which transport from which trainer rank
(shm on the trainer's host, a gloo lane per remote host, a relay where a host has
several engines), and the group transport's layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync import transport as transports
from weightsync.plan import BucketPlan
from weightsync.server.coordinator.registry import EngineRecord
from weightsync.transport import AUTO_LAYOUT, FLATTENED, TENSORS
from weightsync.v1 import common_pb2


@dataclass
class LanePlan:
    """One lane of a round: ``receivers`` in rank order (1, 2, ...). A host relay's
    upstream lane has the relay as its one receiver and ``serves`` its host's engines
    (the trainer stops it when any of them fails); its host's shm lane is
    ``relayed_by`` the relay."""

    name: str
    transport: int
    receivers: list[str]
    relayed_by: str = ""
    serves: list[str] | None = None
    sender: int = 0  # the trainer rank that sends it (a sharded trainer)


def sender_lanes(transport: int, members: list[EngineRecord], trainer_host_id: str,
                 senders: list[int], sender_host_ids: Sequence[str] = ()) -> list[LanePlan]:
    """A sharded trainer's lanes, each member at the same rank in its lane of every
    sender. ``auto`` is one shm lane per sender when every sender and every member share
    one host. Otherwise, where every sender's host is known (``sender_host_ids``, by
    rank; without them ``trainer_host_id``, which the trainer sets only when all its
    ranks share a host), each sender's lanes are one trainer's from its own host
    (``plan_lanes``): shm to the engines there, and on every other host with several
    engines a gloo lane to a relay there that re-shares over the host's shm, so each
    rank's parts cross a remote host's link once, not once per engine there. Each lane
    holds one host's engines in engine-id order, so an engine's rank is the same in
    every sender's lane. A sender of unknown host, or a named transport: one lane per
    sender over every member."""
    if transport == common_pb2.TRANSPORT_KIND_AUTO:
        hosts = {s: sender_host_ids[s] if sender_host_ids else trainer_host_id for s in senders}
        shm = common_pb2.TRANSPORT_KIND_SHM
        one_host = next(iter(hosts.values())) if len(set(hosts.values())) == 1 else ""
        same_host = bool(one_host) and all(r.state.host_id == one_host for r in members)
        if all(hosts.values()) and not same_host:
            layouts = {host: plan_lanes(transport, members, host) for host in set(hosts.values())}
            return [LanePlan(f"{lane.name}/sender{s}", lane.transport, lane.receivers, relayed_by=lane.relayed_by,
                             serves=lane.serves, sender=s)
                    for s in senders for lane in layouts[hosts[s]]]
        transport = shm if same_host and transports.available(shm) else common_pb2.TRANSPORT_KIND_GLOO
    receivers = [r.engine_id for r in sorted(members, key=lambda r: r.engine_id)]
    name = transports.KIND_NAMES[transport]
    return [LanePlan(f"{name}/sender{s}", transport, receivers, sender=s) for s in senders]


def plan_lanes(transport: int, members: list[EngineRecord], trainer_host_id: str) -> list[LanePlan]:
    """The round's lanes. A named transport: one lane for every member. ``auto``: shm
    for the engines on the trainer's host; for every other host its own gloo lane (no
    host's engines carry another host's bytes, and a host that fails takes only its
    own lanes down), and where that host has several engines, the bytes cross the
    network once, to a relay there that re-shares them over the host's shm. Engines
    that report no host id (older agents) share one plain gloo lane."""
    if transport != common_pb2.TRANSPORT_KIND_AUTO:
        return [LanePlan(transports.KIND_NAMES[transport], transport, [r.engine_id for r in members])]
    gloo, shm = common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM
    by_host: dict[str, list[str]] = {}
    for record in sorted(members, key=lambda r: r.engine_id):
        by_host.setdefault(record.state.host_id, []).append(record.engine_id)
    lanes = []
    for host, engines in sorted(by_host.items()):
        if host and host == trainer_host_id and transports.available(shm):
            lanes.append(LanePlan("shm", shm, engines))
        elif host and len(engines) > 1:
            relay = engines[0]
            lanes.append(LanePlan(f"gloo@{host}", gloo, [relay], relayed_by=relay, serves=engines))
            lanes.append(LanePlan(f"shm@{host}", shm, engines, relayed_by=relay))
        else:
            lanes.append(LanePlan(f"gloo@{host or 'unknown'}", gloo, engines))
    return lanes


# ``auto`` flattens a plan whose mean tensor is smaller than this. Measured on CPU (1
# GiB, two engines, one sweep): with a broadcast per tensor at about 0.3 ms each
# against packing and unpacking every byte of the flattened runs, 509 tensors (2 MiB
# on average) went faster one by one (0.70 s against 0.91), 2045 (0.5 MiB) flattened
# (0.65 against 1.13 s), 20k (50 KB) flattened by 8.7x; 89 tensors tied.
FLATTEN_BELOW_MEAN_BYTES = 1 << 20


def pick_group_layout(asked: str, members: list[EngineRecord], plan: BucketPlan) -> str:
    """The group transport's layout for a round: what the trainer asked for, or for
    ``auto`` the flattened layout (a broadcast per run of tensors) when the plan's
    tensors are small on average and every engine of the round takes that layout,
    else a broadcast per tensor."""
    if asked != AUTO_LAYOUT:
        return asked
    small = plan.total_bytes < len(plan) * FLATTEN_BELOW_MEAN_BYTES
    return FLATTENED if small and all(FLATTENED in r.state.group_layouts for r in members) else TENSORS
