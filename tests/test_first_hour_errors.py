"""What a new user meets when something is off: each error names the real culprit and
what to do, and a partial sync is said out loud. Real coordinator and agent processes;
a failing transfer is the agents' test-only fault injection (keyed by version and bucket).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.interrupted_trainer import model_of
from weightsync.client import EngineClient, SyncFailed, TrainerClient
from weightsync.errors import CoordinatorUnavailable, EngineUnavailable, FailedPrecondition
from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

BUCKET = 64 * 1024  # the tiny model (~560 KB) in 9 buckets


async def _event_kinds(address: str) -> list[str]:
    async with EngineClient(address) as engine:
        return [e.kind for e in await engine.events()]


async def test_a_partial_sync_is_logged_and_min_engines_makes_it_a_failure(cluster_factory, caplog):
    cluster = cluster_factory(2)
    cluster.agents[1].proc.send_signal(signal.SIGKILL)
    cluster.agents[1].proc.wait(10)
    model = model_of(1)
    async with TrainerClient(cluster.address) as client:
        # Until the coordinator sees the dead engine's heartbeats stop (1.5 s here).
        end = time.monotonic() + 10
        while any(e.available for e in (await client.get_state()).engines if e.engine_id == "engine-1"):
            assert time.monotonic() < end
            await asyncio.sleep(0.1)
        with pytest.raises(EngineUnavailable) as info:
            await client.update_weights(model.named_parameters(), version=1, min_engines=2, timeout_s=30)
        message = str(info.value)
        assert "min_engines=2" in message and "engine-1" in message and "lower min_engines" in message, message
        state = await client.get_state()
        assert state.weight_version == 0 and not any(e.paused for e in state.engines if e.available)
        assert "transfer_started" not in await _event_kinds(cluster.agents[0].address)

        with caplog.at_level(logging.WARNING, logger="weightsync.client"):
            result = await client.update_weights(model.named_parameters(), version=1, timeout_s=30)
        assert result.ok and [e.engine_id for e in result.engines] == ["engine-0"]
        assert [e.engine_id for e in result.skipped] == ["engine-1"] and result.skipped[0].error_message
        warnings = [r.getMessage() for r in caplog.records if r.name == "weightsync.client"]
        assert any("engine-1" in w and "without 1 of 2" in w for w in warnings), warnings


async def test_a_coordinator_that_is_not_there_is_named_not_blamed_on_engines(cluster_factory):
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable) as info:
        async with TrainerClient("127.0.0.1:1", connect_timeout_s=1.0):
            pass
    assert "127.0.0.1:1" in str(info.value) and "connect_timeout_s" in str(info.value)
    assert time.monotonic() - started < 10

    cluster = cluster_factory(1)
    async with TrainerClient(cluster.address) as client:
        cluster.coordinator.proc.send_signal(signal.SIGKILL)
        cluster.coordinator.proc.wait(10)
        with pytest.raises(CoordinatorUnavailable) as info:
            await client.update_weights(model_of(1).named_parameters(), version=1, timeout_s=10)
    assert cluster.address in str(info.value) and "weightsync coordinator" in str(info.value)
    assert not getattr(info.value, "__notes__", None), "no resume was tried against a coordinator that is gone"


async def test_a_version_that_is_not_newer_is_refused_before_any_engine_pauses(cluster):
    async with TrainerClient(cluster.address) as client:
        assert (await client.update_weights(model_of(1).named_parameters(), version=1, timeout_s=30)).ok
        before = {a.engine_id: (await _event_kinds(a.address)).count("paused") for a in cluster.agents}
        with pytest.raises(FailedPrecondition) as info:
            await client.update_weights(model_of(1).named_parameters(), version=1, timeout_s=30)
        assert info.value.reason == "VERSION_NOT_NEWER" and "above 1" in str(info.value)
        after = {a.engine_id: (await _event_kinds(a.address)).count("paused") for a in cluster.agents}
        assert after == before, "an engine was paused for a version that could only be refused"


async def test_a_failed_syncs_engine_results_carry_each_engines_real_state(cluster_factory):
    rules = [{"op": "receive", "action": "fail", "version": 2, "bucket": 3}]
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
        assert (await client.update_weights(model_of(1).named_parameters(), version=1, timeout_s=30)).ok
        with pytest.raises(SyncFailed) as info:
            await client.update_weights(model_of(2).named_parameters(), version=2, timeout_s=30)
        state = {e.engine_id: e for e in (await client.get_state()).engines}
    results = {e.engine_id: e for e in info.value.result.engines}
    assert set(results) == {"engine-0", "engine-1"}
    for engine_id, result in results.items():
        real = state[engine_id]
        assert not result.ok
        assert (result.weight_version, result.torn, result.paused) == (real.weight_version, real.torn, real.paused)
        assert result.torn and result.paused and result.weight_version == 1, result


def test_an_agent_without_a_coordinator_says_what_it_waits_for_and_ends_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "agent", "--insecure", "--coordinator", "127.0.0.1:1",
                           "--engine-id", "lonely", "--register-timeout-s", "2", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "registering lonely with the coordinator at 127.0.0.1:1 (trying for up to 2 s" in out, out
    assert "trying again" in out, out
    last = out.strip().splitlines()[-1]
    assert "127.0.0.1:1" in last and "--register-timeout-s" in last, last
    for noise in ("Traceback", "AioRpcError", "ExceptionGroup", "could not deregister"):
        assert noise not in out, out


def test_status_reads_the_fleet_without_torch_and_shows_each_engines_model(cluster):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "weightsync", "status", "--coordinator",
                           cluster.address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.count("|") == 2}
    assert "weightsync.apps.cli" in imported and "torch" not in imported, "weightsync status imported torch"
    header, *rows = proc.stdout.splitlines()[1:]
    assert "model" in header and len(rows) == 2 and all(" reference:tiny " in row for row in rows), proc.stdout
    as_json = subprocess.run([sys.executable, "-m", "weightsync", "status", "--coordinator", cluster.address,
                              "--json"], capture_output=True, text=True, timeout=60)
    assert {e["model"] for e in json.loads(as_json.stdout)["engines"]} == {"reference:tiny"}


def test_every_cli_default_is_shown_and_the_spellings_agree():
    def help_of(*command: str) -> str:
        return subprocess.run([sys.executable, "-m", "weightsync", *command, "--help"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout

    coordinator, agent, bench = help_of("coordinator"), help_of("agent"), help_of("bench")
    for text, shown in ((coordinator, ("--listen", "--state-db", "--heartbeat-interval-s")),
                        (agent, ("--listen", "--model", "--register-timeout-s")),
                        (bench, ("--size", "--engines", "--steps"))):
        for option in shown:
            line = next(line for line in text.splitlines() if line.strip().startswith(option))
            index = text.index(line)
            assert "default" in text[index:index + 400], f"{option}: no default in --help"
    version = subprocess.run([sys.executable, "-m", "weightsync", "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("weightsync ")
    # Sizes take units everywhere; the old duration spellings still parse.
    from weightsync.apps.cli import build_parser
    args = build_parser().parse_args(["coordinator", "--catch-up-bucket-bytes", "32MiB", "--shutdown-grace", "3",
                                      "--log-level", "debug"])
    assert (args.catch_up_bucket_bytes, args.shutdown_grace_s, args.log_level) == (32 << 20, 3.0, "DEBUG")


def test_a_coordinator_stub_call_to_nowhere_is_not_an_engine_error():
    """The classification the client uses: a call that never reached a server."""
    import grpc

    from weightsync.errors import unreachable

    async def call():
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            try:
                await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                return exc
        raise AssertionError("a call to a closed port succeeded")

    assert unreachable(asyncio.run(call()))
