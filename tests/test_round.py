"""The round's state machine in process (``server/coordinator/round.py``): phases, epochs, members
and what survives a restart, beside the real-process tests of the whole service.

The engines here are registrations at ports nothing listens on (closed sockets, as an
agent that died leaves): the calls to them really fail, so what the round does with
failed engines is what it does in production. Rounds that reach real agents are in
test_e2e.py, test_sync_safety.py and test_rounds_end.py.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch

from weightsync.errors import EngineUnavailable, FailedPrecondition
from weightsync.plan import BucketPlan
from weightsync.server.coordinator.broadcast_setup import BroadcastSetup
from weightsync.server.coordinator.lanes import LanePlan, plan_lanes, sender_lanes
from weightsync.server.coordinator.registry import EngineRegistry
from weightsync.server.coordinator.round import SyncRound
from weightsync.sharding import Owners, SenderParts
from weightsync.statedb import StateDB
from weightsync.v1 import common_pb2, coordinator_pb2


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict]] = []

    async def __call__(self, kind: str, engine_id: str = "", **fields) -> None:
        self.seen.append((kind, engine_id, fields))


def new_round(db: StateDB, registry: EngineRegistry, events: Events) -> SyncRound:
    return SyncRound(db, registry, emit=events, rejoin_window_s=0.0)


@pytest.fixture
def db(tmp_path):
    database = StateDB(str(tmp_path / "state.db"))
    yield database
    database.close()


def test_a_pause_with_no_engine_changes_nothing(db):
    events = Events()

    async def go():
        round_ = new_round(db, EngineRegistry(heartbeat_timeout_s=5.0), events)
        with pytest.raises(EngineUnavailable, match="no engine is available") as refused:
            await round_.pause(coordinator_pb2.PauseRequest(idempotency_key="p", mode=common_pb2.PAUSE_MODE_ABORT))
        return round_, refused.value

    round_, error = asyncio.run(go())
    assert error.nothing_ran
    assert (round_.phase, round_.round_id, round_.round_engines) == ("idle", 0, [])
    assert events.seen == []


def test_engines_that_cannot_be_reached_are_reported_and_the_round_stays_idle(db):
    events = Events()

    async def go():
        registry = EngineRegistry(heartbeat_timeout_s=5.0)
        for engine_id in ("e0", "e1"):
            registry.upsert(engine_id, f"127.0.0.1:{closed_port()}", "tiny", heartbeat=True)
        round_ = new_round(db, registry, events)
        response = await round_.pause(coordinator_pb2.PauseRequest(
            idempotency_key="p", mode=common_pb2.PAUSE_MODE_ABORT, timeout_s=5.0))
        resumed = await round_.resume(coordinator_pb2.ResumeRequest(idempotency_key="r"))
        for record in registry.all():
            await record.channel.close(grace=None)
        return round_, response, resumed

    round_, response, resumed = asyncio.run(go())
    assert sorted(o.engine_id for o in response.engines) == ["e0", "e1"]
    assert all(not o.ok and o.error_reason == "ENGINE_UNAVAILABLE" for o in response.engines), response
    assert (round_.phase, round_.round_id, round_.round_engines) == ("idle", 1, [])
    assert ("paused", "", {"round_id": 1, "engines": "", "failed": "e0,e1"}) in events.seen
    assert list(resumed.engines) == []  # an idle round has nobody to resume


def test_a_broadcast_needs_a_paused_round(db):
    from tests.test_plan_references import small_plan

    async def go():
        round_ = new_round(db, EngineRegistry(heartbeat_timeout_s=5.0), Events())
        with pytest.raises(FailedPrecondition, match="call Pause first") as refused:
            await round_.broadcast(coordinator_pb2.BroadcastRequest(
                idempotency_key="b", version=1, plan=small_plan().to_proto(),
                transport=common_pb2.TRANSPORT_KIND_SHM, store_host="127.0.0.1", store_port=1), progress=None)
        return round_, refused.value

    round_, error = asyncio.run(go())
    assert error.nothing_ran and round_.phase == "idle" and round_.weight_version == 0


def test_the_group_id_changes_exactly_when_the_group_does_and_survives_a_restart(tmp_path):
    path = str(tmp_path / "state.db")

    async def ids():
        db = StateDB(path)
        registry = EngineRegistry(heartbeat_timeout_s=5.0)
        a, _ = registry.upsert("a", "127.0.0.1:1", "tiny", heartbeat=True)
        b, _ = registry.upsert("b", "127.0.0.1:2", "tiny", heartbeat=True)
        round_ = new_round(db, registry, Events())
        request = coordinator_pb2.BroadcastRequest(transport=common_pb2.TRANSPORT_KIND_GLOO, store_host="h",
                                                   store_port=7)
        gloo = common_pb2.TRANSPORT_KIND_GLOO
        ONE = {"a": 1, "b": 1}  # noqa: N806  (one worker each)

        def lanes(*engines_per_lane):
            return [LanePlan(f"lane{i}", gloo, list(engines)) for i, engines in enumerate(engines_per_lane)]

        both = await round_._group_id(request, [a, b], lanes("ab"), ONE)
        again = await round_._group_id(request, [a, b], lanes("ab"), ONE)
        swapped = await round_._group_id(request, [a, b], lanes("ba"), ONE)
        alone = await round_._group_id(request, [a], lanes("a"), ONE)
        back = await round_._group_id(request, [a, b], lanes("ab"), ONE)
        split = await round_._group_id(request, [a, b], lanes("a", "b"), ONE)  # same ranks, two lanes
        wider = await round_._group_id(request, [a, b], lanes("ab"), {"a": 2, "b": 1})  # a has two workers now
        registry.upsert("a", "127.0.0.1:1", "tiny", heartbeat=True)  # a re-registration: a new incarnation
        reregistered = await round_._group_id(request, [a, b], lanes("ab"), ONE)
        epoch = round_.epoch
        for record in registry.all():
            await record.channel.close(grace=None)
        db.close()
        return both, again, swapped, alone, back, split, wider, reregistered, epoch

    both, again, swapped, alone, back, split, wider, reregistered, epoch = asyncio.run(ids())
    assert again == both  # the same group keeps its id: plan once, replay
    assert len({both, swapped, alone, back, split, wider, reregistered}) == 7  # every other group is a new id
    assert back != both  # an earlier membership that recurs is a new group too (new epoch)

    restarted = StateDB(path)
    try:
        round_ = new_round(restarted, EngineRegistry(heartbeat_timeout_s=5.0), Events())
        assert round_.epoch == epoch and round_.group_key == reregistered.split("-", 1)[1]
    finally:
        restarted.close()


def test_a_round_that_died_broadcasting_comes_back_failed_with_a_new_epoch(tmp_path):
    path = str(tmp_path / "state.db")
    db = StateDB(path)
    round_ = new_round(db, EngineRegistry(heartbeat_timeout_s=5.0), Events())
    round_.phase, round_.round_engines, round_.epoch, round_.round_id = "broadcasting", ["e0"], 4, 9
    asyncio.run(round_.save())
    db.close()

    db = StateDB(path)
    try:
        back = new_round(db, EngineRegistry(heartbeat_timeout_s=5.0), Events())
        assert (back.phase, back.epoch, back.round_engines, back.round_id) == ("failed", 5, ["e0"], 9)
        again = new_round(db, EngineRegistry(heartbeat_timeout_s=5.0), Events())
        assert (again.phase, again.epoch) == ("failed", 5)  # persisted: a second restart adds nothing
    finally:
        db.close()


def test_auto_gives_the_trainers_host_shm_and_every_other_host_a_network_lane_of_its_own(tmp_path):
    async def layout():
        registry = EngineRegistry(heartbeat_timeout_s=5.0)
        hosts = {"a0": "host-a", "b0": "host-b", "b1": "host-b", "c0": "host-c", "old": ""}
        records = []
        for engine, host in hosts.items():
            record, _ = registry.upsert(engine, "127.0.0.1:1", "tiny", heartbeat=True)
            record.state.host_id = host
            records.append(record)
        try:
            return (plan_lanes(common_pb2.TRANSPORT_KIND_AUTO, records, "host-a"),
                    plan_lanes(common_pb2.TRANSPORT_KIND_GLOO, records, "host-a"))
        finally:
            for record in registry.all():
                await record.channel.close(grace=None)

    auto, gloo = asyncio.run(layout())
    shm_kind, gloo_kind = common_pb2.TRANSPORT_KIND_SHM, common_pb2.TRANSPORT_KIND_GLOO
    assert auto == [
        LanePlan("gloo@unknown", gloo_kind, ["old"]),
        LanePlan("shm", shm_kind, ["a0"]),
        # two engines on host b: the network once, to b0, which re-shares over b's shm
        LanePlan("gloo@host-b", gloo_kind, ["b0"], relayed_by="b0", serves=["b0", "b1"]),
        LanePlan("shm@host-b", shm_kind, ["b0", "b1"], relayed_by="b0"),
        LanePlan("gloo@host-c", gloo_kind, ["c0"]),
    ]
    assert gloo == [LanePlan("gloo", gloo_kind, ["a0", "b0", "b1", "c0", "old"])]  # a named transport: one lane


def test_a_sharded_trainer_gets_one_layout_per_sending_rank_and_each_engine_its_lane_of_every_sender(tmp_path):
    async def layouts():
        registry = EngineRegistry(heartbeat_timeout_s=5.0)
        records = []
        for engine, host in {"e1": "host-a", "e0": "host-a", "b0": "host-b", "b1": "host-b", "c0": "host-c"}.items():
            record, _ = registry.upsert(engine, "127.0.0.1:1", "tiny", heartbeat=True)
            record.state.host_id = host
            records.append(record)
        local = [r for r in records if r.state.host_id == "host-a"]
        try:
            auto = common_pb2.TRANSPORT_KIND_AUTO
            return (sender_lanes(auto, local, "host-a", [0, 1, 3]),
                    sender_lanes(auto, local, "", [0, 1]),  # the ranks are on several hosts
                    sender_lanes(auto, local, "host-b", [0]),
                    sender_lanes(auto, records, "host-a", [0, 1]),
                    sender_lanes(common_pb2.TRANSPORT_KIND_GLOO, records, "host-a", [0, 1]),
                    sender_lanes(auto, records, "", [0, 1], ["host-a", "host-b"]),  # a rank on a, one on b
                    sender_lanes(auto, local, "", [0, 1], ["host-a", "host-a"]))
        finally:
            for record in registry.all():
                await record.channel.close(grace=None)

    same_host, ranks_apart, engines_apart, fleet, named, spread, told_one_host = asyncio.run(layouts())
    shm_kind, gloo_kind = common_pb2.TRANSPORT_KIND_SHM, common_pb2.TRANSPORT_KIND_GLOO
    assert same_host == [LanePlan(f"shm/sender{s}", shm_kind, ["e0", "e1"], sender=s) for s in (0, 1, 3)]
    assert ranks_apart == [LanePlan(f"gloo/sender{s}", gloo_kind, ["e0", "e1"], sender=s) for s in (0, 1)]
    # The ranks on one host, the engines on another: each rank's parts go once to a relay there.
    assert engines_apart == [
        LanePlan("gloo@host-a/sender0", gloo_kind, ["e0"], relayed_by="e0", serves=["e0", "e1"], sender=0),
        LanePlan("shm@host-a/sender0", shm_kind, ["e0", "e1"], relayed_by="e0", sender=0)]
    # Every sender's lanes laid out as one trainer's: shm on the ranks' host, a relay on
    # each other host with several engines, a plain gloo lane to a host with one.
    assert fleet == [lane for s in (0, 1) for lane in (
        LanePlan(f"shm/sender{s}", shm_kind, ["e0", "e1"], sender=s),
        LanePlan(f"gloo@host-b/sender{s}", gloo_kind, ["b0"], relayed_by="b0", serves=["b0", "b1"], sender=s),
        LanePlan(f"shm@host-b/sender{s}", shm_kind, ["b0", "b1"], relayed_by="b0", sender=s),
        LanePlan(f"gloo@host-c/sender{s}", gloo_kind, ["c0"], sender=s))]
    assert named == [LanePlan(f"gloo/sender{s}", gloo_kind, ["b0", "b1", "c0", "e0", "e1"], sender=s)
                     for s in (0, 1)]  # a named transport: one lane per sender over every engine
    # Ranks on two hosts, each host named: each rank's lanes are laid out from its own
    # host (rank 1 reads into b's engines over shm, and reaches host a through a relay).
    assert spread == fleet[:4] + [
        LanePlan("gloo@host-a/sender1", gloo_kind, ["e0"], relayed_by="e0", serves=["e0", "e1"], sender=1),
        LanePlan("shm@host-a/sender1", shm_kind, ["e0", "e1"], relayed_by="e0", sender=1),
        LanePlan("shm/sender1", shm_kind, ["b0", "b1"], sender=1),
        LanePlan("gloo@host-c/sender1", gloo_kind, ["c0"], sender=1)]
    assert told_one_host == same_host[:2]  # every rank named on the engines' host: shm, as with trainer_host_id


def test_an_engine_of_ranks_on_two_hosts_is_told_each_senders_own_transport_at_one_rank():
    """Rank 0 on host a, rank 1 on host b: a0 takes rank 0 over shm and rank 1 over
    gloo; b's engines take rank 0 through their relay b0 and rank 1 over shm; every
    engine at one rank in all its lanes, and only b0 told to forward (rank 0's lane)."""
    plan = BucketPlan.from_tensors([("w", torch.zeros(4, 2))], bucket_bytes=1 << 20)
    owners = Owners(plan, [SenderParts(s, np.array([0], dtype=np.int32), np.array([start], dtype=np.int64),
                                       np.array([2], dtype=np.int64)) for s, start in ((0, 0), (1, 2))])
    gloo, shm = common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM
    layout = ((0, "shm", shm, ["a0"], ""), (0, "gloo@b", gloo, ["b0", "b1"], "b0"), (0, "shm@b", shm, ["b0", "b1"], "b0"),
              (1, "gloo@a", gloo, ["a0"], ""), (1, "shm", shm, ["b0", "b1"], ""))
    lanes = [common_pb2.Rendezvous(lane=f"{name}/sender{s}", session_id=f"s{i}", transport=kind, engine_ids=engines,
                                   relayed_by=relay, sender=s)
             for i, (s, name, kind, engines, relay) in enumerate(layout)]
    setup = BroadcastSetup(plan, [], [], lanes, 10.0, {"a0": 1, "b0": 1, "b1": 1}, owners)
    told = {e: setup.owners_for(e) for e in ("a0", "b0", "b1")}
    assert [(p.lane.lane, p.lane.transport) for p in told["a0"].senders] == [("shm/sender0", shm),
                                                                              ("gloo@a/sender1", gloo)]
    for engine in ("b0", "b1"):
        assert [(p.lane.lane, p.lane.transport) for p in told[engine].senders] == [("shm@b/sender0", shm),
                                                                                    ("shm/sender1", shm)]
    assert setup.ranks == {"a0": 1, "b0": 1, "b1": 2}
    assert [p.relay.lane for p in told["b0"].senders if p.HasField("relay")] == ["gloo@b/sender0"]
    assert not any(p.HasField("relay") for e in ("a0", "b1") for p in told[e].senders)
    assert setup.lane_of["b1"].lane == "shm@b/sender0"  # what an engine reports: its lane of rank 0


def test_each_engine_of_a_sharded_round_is_told_its_own_lane_of_every_sender_and_a_relay_what_it_forwards():
    plan = BucketPlan.from_tensors([("w", torch.zeros(4, 2))], bucket_bytes=1 << 20)
    owners = Owners(plan, [SenderParts(s, np.array([0], dtype=np.int32), np.array([start], dtype=np.int64),
                                       np.array([2], dtype=np.int64)) for s, start in ((0, 0), (1, 2))])
    gloo, shm = common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_SHM
    lanes = [common_pb2.Rendezvous(lane=f"{name}/sender{s}", session_id=f"s{i}", transport=kind, engine_ids=engines,
                                   relayed_by=relay, sender=s)
             for i, (s, (name, kind, engines, relay)) in enumerate(
                 (s, lane) for s in (0, 1) for lane in (("shm", shm, ["a0"], ""), ("gloo@b", gloo, ["b0", "b1"], "b0"),
                                                        ("shm@b", shm, ["b0", "b1"], "b0")))]
    setup = BroadcastSetup(plan, [], [], lanes, 10.0, {"a0": 1, "b0": 1, "b1": 1}, owners)
    assert setup.relay_of == {}  # a sharded round names its relays in the senders' parts
    told = {e: setup.owners_for(e) for e in ("a0", "b0", "b1")}
    for engine, lane in (("a0", "shm"), ("b0", "shm@b"), ("b1", "shm@b")):
        assert [p.lane.lane for p in told[engine].senders] == [f"{lane}/sender0", f"{lane}/sender1"], engine
        assert [p.sender for p in told[engine].senders] == [0, 1]
        assert setup.ranks[engine] == (2 if engine == "b1" else 1)
    assert [p.relay.lane for p in told["b0"].senders] == ["gloo@b/sender0", "gloo@b/sender1"]
    assert not any(p.HasField("relay") for e in ("a0", "b1") for p in told[e].senders)
    assert told["b1"] is setup.owners_for("b1")  # built once for a set of lanes
    assert Owners.from_proto(told["b0"], plan).parts_of(1).starts.tolist() == [2]  # the parts are kept
