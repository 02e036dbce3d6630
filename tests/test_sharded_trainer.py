"""Sharded trainers (FSDP2 over gloo, on CPU) syncing through DistributedTrainerClient:
every rank a real process started as torchrun starts it, a real coordinator and real
agents (reference engines), real signals. Checked against the trainer's own full,
unsharded state dict (gathered by the trainer script for the check only), never
against another engine."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from tests.test_idempotency import transfer_counts
from tests.test_rounds_end import coordinator_events
from weightsync.apps.trainer_ranks import TrainerRanks
from weightsync.client import TrainerClient
from weightsync.engine.model import ModelConfig

MODEL = ModelConfig().to_json()   # the reference model, 0.56 MB in 26 tensors
# Round 2 slowed (engines wait 0.5 s a bucket): ~17 buckets a lane with 16 KiB buckets,
# lanes received at once, so ~8 s unless something ends it; round 1 is not slowed.
SLOW_ROUND_2 = {"WEIGHTSYNC_FAULTS": json.dumps([{"op": "receive", "action": "delay", "seconds": 0.5, "times": 0,
                                                  "version": 2}])}
SMALL_BUCKETS = ["--bucket-bytes", str(16 * 1024)]


def rank_args(*extra: str) -> list[str]:
    return ["--model", MODEL, "--timeout", "60", *extra]


def settled_states(address: str, timeout_s: float = 30.0):
    """The engines' states once no engine is receiving (a receive whose sender died ends
    when its connections close or its deadline passes; the coordinator hears at the
    next heartbeat)."""
    until = time.monotonic() + timeout_s
    while True:
        states = asyncio.run(engine_states(address))
        if not any(s.receiving for s in states.values()) or time.monotonic() >= until:
            return states
        time.sleep(0.2)


async def engine_states(address: str):
    async with TrainerClient(address) as client:
        state = await client.get_state()
    return {e.engine_id: e for e in state.engines}


def wait_until_bytes_move(address: str, timeout_s: float = 60.0) -> None:
    """Returns once an engine is receiving and has taken a bucket (the round is mid-transfer)."""
    async def poll() -> bool:
        async with TrainerClient(address) as client:
            until = time.monotonic() + timeout_s
            while time.monotonic() < until:
                state = await client.get_state()
                # this round's progress: the last round's stays at (total, total) until the
                # new transfer starts
                if any(e.receiving and 1 <= e.buckets_done < e.buckets_total for e in state.engines):
                    return True
                await asyncio.sleep(0.05)
        return False
    assert asyncio.run(poll()), "no engine started receiving"


def assert_two_good_rounds(ranks: TrainerRanks, world: int) -> None:
    """Every rank ended two rounds, both good, and after each every engine held the
    trainer's full model (rank 0's check of the digests)."""
    for rank in range(world):
        assert all(r["ok"] for r in ranks.rounds(rank).values()) and len(ranks.rounds(rank)) == 2, ranks.tail()
    assert [ranks.rounds(0)[v]["digest_ok"] for v in (1, 2)] == [True, True], ranks.tail()


def last_rounds_lanes(address: str) -> list[str]:
    """The lanes (``name:engines``) of the last round the coordinator started."""
    events = asyncio.run(coordinator_events(address))
    return [e for e in events if e.kind == "broadcast_started"][-1].fields["lanes"].split(";")


@pytest.mark.parametrize("transport", ["shm", "group"])
def test_tensor_parallel_ranks_send_their_column_and_row_slices_and_engines_match_the_full_model(
        cluster_factory, tmp_path, transport):
    """torch's tensor parallel over two ranks: column-wise layers hold Shard(0) slices,
    row-wise layers Shard(1) slices (no view of the full tensor lays those out end to
    end), the rest whole on every rank. Each rank sends what it holds; every engine
    ends bitwise equal to the full model the trainer gathers for the check only.
    ``group`` (one sender, as SGLang's update group): the parts are gathered into rank
    0 first, and with ``verify_digest`` checked there against each rank's hashes of
    what it holds, then the engines check the full tensors' digest."""
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    verify = ["--verify-digest"] if transport == "group" else []
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "2", "--check-digests", "--transport", transport,
                                "--parallel", "tp", *verify)) as ranks:
        assert ranks.wait(240) == [0, 0], ranks.tail()
        assert_two_good_rounds(ranks, 2)


@pytest.mark.parametrize("parallel", ["hsdp", "fsdp-tp"])
def test_four_ranks_on_a_2d_mesh_send_each_slice_once_and_engines_match_the_full_model(cluster_factory, tmp_path,
                                                                                       parallel):
    """Four ranks on a 2-D mesh. ``hsdp``: FSDP2 over two replica groups of two ranks,
    so two ranks hold each shard (placements Replicate(), Shard(0)). ``fsdp-tp``:
    torchtitan's composition, tensor parallel within pairs and FSDP2 across them:
    column-wise weights are row ranges (``_StridedShard``: the pair's chunk, then
    FSDP's chunk of it), row-wise weights blocks of rows and columns, the rest row
    ranges both ranks of a pair hold. Each slice is sent once, by one of its holders,
    every rank sending on its own lane, and every engine ends bitwise equal to the full
    model the trainer gathers (torch's own redistribution) for the check only. (No
    attestation for fsdp-tp: the reference model's forward is not written for tensor
    parallel's local outputs.)"""
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 4,
                      rank_args("--rounds", "2", "--check-digests", "--transport", "shm",
                                "--parallel", parallel)) as ranks:
        assert ranks.wait(240) == [0] * 4, ranks.tail()
        assert_two_good_rounds(ranks, 4)
    lanes = last_rounds_lanes(cluster.address)
    assert sorted(lane.split(":")[0] for lane in lanes) == [f"shm/sender{r}" for r in range(4)], lanes


def test_expert_parallel_ranks_each_send_their_own_experts_and_the_shared_tensors_once(cluster_factory, tmp_path):
    """Expert parallelism: two ranks, each offering the shared tensors and only its
    own experts (plain tensors, whole; expert e on rank e mod 2), so rank 0 lists
    tensors the other does not and the other tensors rank 0 never saw. The plan has
    every tensor; each expert comes from the rank that holds it and each shared tensor
    from one rank; every engine ends bitwise equal to the full model."""
    moe = ModelConfig(n_experts=6, n_layers=2, d_ff=64).to_json()
    cluster = cluster_factory(2, agent_args=("--model", moe))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      ["--model", moe, "--timeout", "60", "--rounds", "2", "--check-digests", "--transport", "shm",
                       "--parallel", "ep"]) as ranks:
        assert ranks.wait(240) == [0, 0], ranks.tail()
        assert_two_good_rounds(ranks, 2)
    lanes = last_rounds_lanes(cluster.address)
    assert sorted(lane.split(":")[0] for lane in lanes) == [f"shm/sender{r}" for r in range(2)], lanes


@pytest.mark.parametrize("world, transport", [(2, "auto"), (4, "gloo")])
def test_fsdp2_ranks_each_send_their_shards_and_engines_match_the_full_model(cluster_factory, tmp_path, world,
                                                                             transport):
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, world,
                      rank_args("--rounds", "3", "--check-digests", "--transport", transport)) as ranks:
        codes = ranks.wait(240)
        assert codes == [0] * world, ranks.tail()
        for rank in range(world):
            rounds = ranks.rounds(rank)
            assert sorted(rounds) == [1, 2, 3], ranks.tail()
            assert all(r["ok"] for r in rounds.values()), ranks.tail()
        assert [ranks.rounds(0)[v]["digest_ok"] for v in (1, 2, 3)] == [True, True, True]
    events = asyncio.run(coordinator_events(cluster.address))
    started = [e for e in events if e.kind == "broadcast_started"]
    assert len(started) == 3
    # one lane per rank, both engines in each (FSDP2 gives every rank rows of every tensor)
    kind = "shm" if transport == "auto" else "gloo"
    lanes = started[-1].fields["lanes"].split(";")
    assert sorted(lane.split(":")[0] for lane in lanes) == sorted(f"{kind}/sender{r}" for r in range(world))
    assert all(lane.split(":")[1] == "engine-0,engine-1" for lane in lanes)


@pytest.mark.parametrize("killed, survivors_see", [
    (1, "SyncFailed"),
    # The engines' state is read once none is still receiving: their lanes end when the
    # killed driver's connections close, which can come after the survivors have exited.
    (0, "TransferError"),
])
def test_a_rank_killed_mid_send_fails_the_round_on_every_rank_and_the_next_job_heals(cluster_factory, tmp_path,
                                                                                     killed, survivors_see):
    """Rank 1 killed: rank 0 ends the round (its engines failed) and every survivor gets
    the same SyncFailed. Rank 0 (the driver) killed: the others lose its store at once."""
    cluster = cluster_factory(2, agent_args=("--model", MODEL, "--enable-fault-injection"), agent_env=SLOW_ROUND_2)
    survivors = [r for r in range(3) if r != killed]
    with TrainerRanks(str(tmp_path / "job1"), cluster.address, 3,
                      rank_args("--rounds", "2", "--transport", "gloo", *SMALL_BUCKETS)) as ranks:
        ranks.wait_for(killed, lambda line: line.get("starting") == 2, 120)
        assert ranks.rounds(killed)[1]["ok"], ranks.tail()
        wait_until_bytes_move(cluster.address)  # round 2 is mid-transfer (it takes ~8 s)
        killed_at = time.monotonic()
        ranks.signal(killed, signal.SIGKILL)
        codes = ranks.wait(60, ranks=survivors)
        assert codes == [0, 0], ranks.tail()
        for rank in survivors:
            line = ranks.rounds(rank)[2]
            assert not line["ok"] and line["error_type"] == survivors_see, ranks.tail()
        # every survivor heard within the silence window plus the engines' stop, not the 60 s deadline
        assert time.monotonic() - killed_at < 30, ranks.tail()
    states = settled_states(cluster.address)
    # Bytes had moved into at least one engine: it is torn. Every engine stays paused;
    # one whose transfer had not written a byte yet (under load its receive can start
    # late) keeps version 1, untorn -- the same weights it had.
    assert all(s.paused and not s.receiving and (s.torn or s.weight_version == 1) for s in states.values()), states
    assert any(s.torn for s in states.values()), states
    # torchrun restarts the whole job: a new set of ranks, the next version, heals both engines
    with TrainerRanks(str(tmp_path / "job2"), cluster.address, 3,
                      rank_args("--rounds", "1", "--first-version", "3", "--check-digests")) as ranks:
        assert ranks.wait(120) == [0, 0, 0], ranks.tail()
        line = ranks.rounds(0)[3]
        assert line["ok"] and line["digest_ok"], ranks.tail()
    states = asyncio.run(engine_states(cluster.address))
    assert all(not s.torn and not s.paused and s.weight_version == 3 for s in states.values()), states


def test_a_rank_cancelled_mid_round_ends_it_for_every_rank_and_no_engine_resumes(cluster_factory, tmp_path):
    cluster = cluster_factory(2, agent_args=("--model", MODEL, "--enable-fault-injection"), agent_env=SLOW_ROUND_2)
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "2", "--transport", "gloo", *SMALL_BUCKETS)) as ranks:
        ranks.wait_for(1, lambda line: line.get("starting") == 2, 120)
        wait_until_bytes_move(cluster.address)
        cancelled_at, signalled = time.monotonic(), time.time()
        ranks.signal(1, signal.SIGINT)  # asyncio.run cancels the rank's main task
        ranks.wait(60)
        line0, line1 = ranks.rounds(0).get(2), ranks.rounds(1).get(2)
        assert line0 is not None and line1 is not None, ranks.tail()
        assert line1["ended"] > signalled, f"round 2 ended before the signal was sent:\n{ranks.tail()}"
        assert line1["error_type"] == "CancelledError", f"signalled at {signalled}\n{ranks.tail()}"
        assert not line0["ok"] and line0["error_type"] in ("SyncFailed", "TransferError"), ranks.tail()
        assert time.monotonic() - cancelled_at < 30, ranks.tail()
        # the cancelled rank returned only after the round had ended for rank 0 as well
        assert line1["ended"] >= line0["ended"] - 0.5, ranks.tail()
    states = settled_states(cluster.address)
    assert all(s.paused and s.torn for s in states.values()), "no engine may resume onto a half-sent round"
    assert all(s.weight_version == 1 for s in states.values())


def test_the_same_key_again_replays_the_rounds_without_a_second_transfer(cluster_factory, tmp_path):
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    args = rank_args("--rounds", "2", "--key", "job-a", "--transport", "gloo")
    with TrainerRanks(str(tmp_path / "first"), cluster.address, 2, args) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail()
        first = {r: ranks.rounds(r) for r in (0, 1)}
    before = asyncio.run(transfer_counts(cluster))
    assert before == {"engine-0": 2, "engine-1": 2}
    # the same job restarted with the same keys and the same weights: every rank gets
    # the first run's results, and no engine receives anything again
    with TrainerRanks(str(tmp_path / "again"), cluster.address, 2, args) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail()
        for rank in (0, 1):
            assert all(ranks.rounds(rank)[v]["ok"] == first[rank][v]["ok"] is True for v in (1, 2)), ranks.tail()
    assert asyncio.run(transfer_counts(cluster)) == before


def test_a_rank_that_leaves_a_shard_out_gets_the_same_typed_error_everywhere_and_nothing_changes(
        cluster_factory, tmp_path):
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "1", "--drop-on-rank", "1")) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail()
        lines = [ranks.rounds(r)[1] for r in (0, 1)]
        assert [line["error_type"] for line in lines] == ["InvalidArgument", "InvalidArgument"], ranks.tail()
        assert "embed.weight" in lines[0]["error"] and "do not cover" in lines[0]["error"], ranks.tail()
        assert lines[0]["error"] == lines[1]["error"]
    states = asyncio.run(engine_states(cluster.address))
    assert all(s.weight_version == 0 and not s.paused and not s.torn for s in states.values()), states
    assert asyncio.run(transfer_counts(cluster)) == {"engine-0": 0, "engine-1": 0}


def test_a_sharded_trainers_digest_is_checked_by_every_engine_and_a_stale_block_fails_the_round(cluster_factory,
                                                                                                   tmp_path):
    """``verify_digest`` from two tensor-parallel ranks: every rank hashes the slices
    it holds (rows, and columns of the row-wise weights), rank 0 combines them, and
    every engine hashes the same slices of what it loaded before committing (blocks:
    tests/test_sharding.py, tests/test_streamed_load.py). Round 1 passes on both
    engines. In round 2 engine-1 keeps its old bytes of a row-wise weight (columns
    from each rank) after they arrived: its digest differs, the round fails on every
    rank, and engine-1 stays torn; engine-0 is not blamed."""
    rules = [{"op": "receive", "action": "stale_tensor", "version": 2, "tensor": "blocks.0.proj.weight",
              "engine": "engine-1"}]
    cluster = cluster_factory(2, agent_args=("--model", MODEL, "--enable-fault-injection"),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "2", "--verify-digest", "--transport", "shm",
                                "--parallel", "tp")) as ranks:
        assert ranks.wait(240) == [0, 0], ranks.tail()
        for rank in range(2):
            rounds = ranks.rounds(rank)
            assert rounds[1]["ok"], ranks.tail()
            assert not rounds[2]["ok"] and rounds[2]["error_type"] == "SyncFailed", ranks.tail()
            assert "engine-1" in rounds[2]["error"] and "do not match the trainer's digest" in rounds[2]["error"], \
                ranks.tail()
    states = settled_states(cluster.address)
    assert states["engine-1"].torn and states["engine-1"].torn_version == 2, states
    assert not states["engine-0"].torn, states


def test_a_sharded_trainers_probe_attests_every_engine_and_a_stale_one_is_refused(cluster_factory, tmp_path):
    """FSDP2 ranks score the probe sequences together (a collective forward) before the
    round and pass the probe: every engine scores it after loading and the round is ok
    within the tolerance. A probe scored before the weights moved (the trainer's model
    is not what was sent) fails the round on every rank as EngineOutputMismatch, and
    every engine stays torn and paused, whatever its bytes."""
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "2", "--attest", "--stale-from", "2", "--check-digests")) as ranks:
        assert ranks.wait(240) == [0, 0], ranks.tail()
        line = ranks.rounds(0)[1]
        assert line["ok"] and line["digest_ok"] and 0.0 <= line["attest_max_diff"] <= 1e-3, ranks.tail()
        for rank in (0, 1):
            line = ranks.rounds(rank)[2]
            assert not line["ok"] and line["error_type"] == "EngineOutputMismatch", ranks.tail()
    states = settled_states(cluster.address)
    assert all(s.torn and s.paused and not s.ready for s in states.values()), states


def test_a_rank_killed_mid_gather_fails_the_call_and_changes_no_engine(cluster_factory, tmp_path):
    """Two ranks gathering into rank 0 (``gather=True``) before each round. Round 1
    lands: rank 0 sends the full tensors as one trainer, over shm (every rank and engine
    on this host), and both engines equal the trainer's full model. In round 2 rank 1,
    handed its gather lane, stalls (its heartbeat going on) and is killed there: rank 0
    hears its silence and fails the call with a TransferError within seconds, before
    any Pause: both engines still serve version 1, unpaused and untorn."""
    cluster = cluster_factory(2, agent_args=("--model", MODEL))
    with TrainerRanks(str(tmp_path / "ranks"), cluster.address, 2,
                      rank_args("--rounds", "2", "--transport", "auto", "--gather", "--check-digests",
                                "--stall-send", "1:2")) as ranks:
        ranks.wait_for(1, lambda line: line.get("stalling") == 2, 120)
        first = ranks.rounds(0)[1]
        assert first["ok"] and first["digest_ok"], ranks.tail()
        assert {e["transport"] for e in first["engines"].values()} == {"shm"}, first
        killed_at = time.monotonic()
        ranks.signal(1, signal.SIGKILL)
        assert ranks.wait(60, ranks=[0]) == [0], ranks.tail()
        line = ranks.rounds(0)[2]
        assert not line["ok"] and line["error_type"] == "TransferError", ranks.tail()
        assert "trainer rank 1 stopped answering" in line["error"], ranks.tail()
        assert time.monotonic() - killed_at < 20, ranks.tail()
    states = asyncio.run(engine_states(cluster.address))
    assert all(s.weight_version == 1 and not s.paused and not s.torn for s in states.values()), states
    started = [e for e in asyncio.run(coordinator_events(cluster.address)) if e.kind == "broadcast_started"]
    assert len(started) == 1, started  # round 1's only


def test_a_sharded_job_killed_mid_round_and_restarted_with_its_keys_ends_the_round_once(cluster_factory, tmp_path):
    """The whole job SIGKILLed while round 2's bytes move (torchrun's restart kills every
    rank), then started again with the same keys and weights: round 1 replays, round 2
    runs again (its first attempt failed with nobody to finish it) and lands whole, once."""
    cluster = cluster_factory(2, agent_args=("--model", MODEL, "--enable-fault-injection"), agent_env=SLOW_ROUND_2)
    args = rank_args("--rounds", "2", "--key", "job-k", "--transport", "gloo", *SMALL_BUCKETS)
    with TrainerRanks(str(tmp_path / "job1"), cluster.address, 2, args) as ranks:
        ranks.wait_for(0, lambda line: line.get("starting") == 2, 120)
        wait_until_bytes_move(cluster.address)
        for rank in (0, 1):
            ranks.signal(rank, signal.SIGKILL)
        ranks.wait(30)
    with TrainerRanks(str(tmp_path / "job2"), cluster.address, 2, [*args, "--check-digests"]) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail()
        assert all(ranks.rounds(r)[v]["ok"] for r in (0, 1) for v in (1, 2)), ranks.tail()
        assert ranks.rounds(0)[2]["digest_ok"], ranks.tail()
    states = asyncio.run(engine_states(cluster.address))
    assert all(not s.torn and not s.paused and s.weight_version == 2 for s in states.values()), states

    async def done_per_engine() -> dict[str, int]:
        from weightsync.client import EngineClient
        counts = {}
        for agent in cluster.agents:
            async with EngineClient(agent.address) as engine:
                counts[agent.engine_id] = sum(e.kind == "transfer_done" and e.fields.get("version") == "2"
                                              for e in await engine.events())
        return counts

    assert asyncio.run(done_per_engine()) == {"engine-0": 1, "engine-1": 1}
