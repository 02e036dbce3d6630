"""Metrics scraped over HTTP during a sync, the event stream, and ``weightsync status``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

from prometheus_client import REGISTRY

from tests.test_sync_safety import BUCKET, fail, faulty_cluster, slow, wait_for_event
from weightsync.apps.bench.runner import parse_size
from weightsync.client import SyncFailed, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM, config_for_size
from weightsync.lifecycle import free_port
from weightsync.loop_lag import LoopLagMonitor


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_metrics_show_the_round_while_it_runs(cluster_factory):
    port = free_port()
    cluster = faulty_cluster(cluster_factory, [slow(1, 0.1)], coordinator_args=("--metrics-port", str(port)))
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET, measure_loop_lag=True) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=60))
        await wait_for_event(cluster.agents[0].address, "transfer_started")
        during = await asyncio.to_thread(scrape, port)
        result = await sync
        assert result.ok and result.loop_lag_ms is not None and result.loop_lag_ms["max"] >= 0
        # The engines' new state comes with their next heartbeat: wait for it, with a deadline.
        engines_at_1 = ['weightsync_engine_weight_version{engine="engine-0"}',
                        'weightsync_engine_weight_version{engine="engine-1"}']
        end = asyncio.get_running_loop().time() + 20
        while True:
            after = await asyncio.to_thread(scrape, port)
            if all(after.get(name) == 1.0 for name in engines_at_1) or asyncio.get_running_loop().time() > end:
                break
            await asyncio.sleep(0.1)
    assert during["weightsync_broadcast_in_progress"] == 1.0
    assert during["weightsync_round_id"] == 1.0
    assert after["weightsync_broadcast_in_progress"] == 0.0
    assert after["weightsync_broadcast_seconds_count"] == 1.0
    assert after['weightsync_rounds_total{outcome="ok",phase="broadcast"}'] == 1.0
    assert after["weightsync_weight_version"] == 1.0
    for engine in ("engine-0", "engine-1"):
        assert after[f'weightsync_engine_weight_version{{engine="{engine}"}}'] == 1.0
        assert after[f'weightsync_engine_available{{engine="{engine}"}}'] == 1.0


async def test_status_shows_a_torn_engine_and_watch_follows_events(cluster_factory):
    # slow buckets so heartbeats see progress before bucket 6 fails
    cluster = faulty_cluster(cluster_factory, [slow(1, 0.3), fail(1, 6)], engines=1)
    model = ReferenceLM(PRESETS["tiny"])
    status = [sys.executable, "-m", "weightsync", "status", "--coordinator", cluster.address]
    watcher = subprocess.Popen([*status, "--watch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read_until(marker: str) -> bool:
        for line in watcher.stdout:
            lines.append(line)
            if marker in line:
                return True
        return False

    def watcher_said() -> str:
        if watcher.poll() is None:
            return "".join(lines)
        return "".join(lines) + f"\n[watcher exited {watcher.returncode}] " + watcher.stderr.read()

    try:
        # The watcher prints its table, then follows: sync only once it is up, so a
        # slow start under load cannot be mistaken for missing events.
        assert await asyncio.wait_for(asyncio.to_thread(read_until, "engine-0"), timeout=60), watcher_said()
        async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
            try:
                await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
                raise AssertionError("the injected failure must fail the sync")
            except SyncFailed:
                pass
        table = await asyncio.to_thread(subprocess.run, status, capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if line.startswith("engine-0"))
        assert "torn" in row and "yes (v1)" in row, table.stdout
        as_json = await asyncio.to_thread(subprocess.run, [*status, "--json"], capture_output=True, text=True,
                                          timeout=60)
        engine = json.loads(as_json.stdout)["engines"][0]
        assert engine["torn"] is True and engine["torn_version"] == "1"

        assert await asyncio.wait_for(asyncio.to_thread(read_until, "broadcast_failed"), timeout=30), watcher_said()
        kinds = [line.split()[1] for line in lines if line.strip() and line.split()[0].isdigit()]
        assert {"paused", "broadcast_started", "bucket_progress", "engine_failed"} <= set(kinds), watcher_said()
        assert kinds.index("paused") < kinds.index("broadcast_started") < kinds.index("engine_failed")
        assert kinds.index("broadcast_started") < kinds.index("bucket_progress") < kinds.index("engine_failed")
    finally:
        watcher.terminate()
        watcher.wait(10)


async def test_health_turns_not_serving_while_an_agent_drains(cluster_factory):
    import signal

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster = faulty_cluster(cluster_factory, [slow(1, 0.3)], engines=1, agent_args=("--shutdown-grace", "10"))
    agent = cluster.agents[0]
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=60))
        await wait_for_event(agent.address, "transfer_started")
        agent.proc.send_signal(signal.SIGTERM)  # drain: the running receive may finish
        statuses = set()
        async with grpc.aio.insecure_channel(agent.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                try:
                    response = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.aio.AioRpcError as exc:
                    statuses.add(exc.code())
                    break
                statuses.add(response.status)
                if response.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        await asyncio.gather(sync, return_exceptions=True)
    assert await asyncio.to_thread(agent.proc.wait, 30) == 0


def test_json_logs_are_one_object_per_line(tmp_path):
    import os
    import signal
    import time

    from weightsync.lifecycle import spawn, wait_for_file
    log = tmp_path / "log"
    with open(log, "w") as f:
        child = spawn([sys.executable, "-m", "weightsync", "--log-format", "json", "coordinator", "--insecure",
                       "--listen", "127.0.0.1:0", "--state-db", str(tmp_path / "s.db"), "--port-file",
                       str(tmp_path / "c")], stdout=f, stderr=f)
    wait_for_file(str(tmp_path / "c"), timeout_s=60, proc=child)
    time.sleep(0.2)
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(30) == 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert any("serving on" in r["message"] for r in records)
    assert any(r["level"] == "WARNING" and "WITHOUT TLS" in r["message"] for r in records)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)


async def test_servers_freeze_their_startup_heap_and_time_full_collections(cluster_factory):
    # A full collection stops a server's event loop for as long as it walks the heap:
    # 125-135 ms in agents holding a 1 GiB model of 20k tensors, before the start-up heap
    # (torch, gRPC, the engine's model) was frozen. Here, a model of 4000 tensors.
    ports = {"coordinator": free_port(), "agent": free_port()}
    cfg = config_for_size(parse_size("16MiB"), 4000)
    cluster = cluster_factory(1, coordinator_args=("--metrics-port", str(ports["coordinator"])),
                              agent_args=("--metrics-port", str(ports["agent"]), "--model", cfg.to_json()))
    model = ReferenceLM(cfg)
    async with TrainerClient(cluster.address, transport="gloo") as client:
        for version in (1, 2):
            result = await client.update_weights(model.named_parameters(), version=version, timeout_s=120)
            assert result.ok
    for process, port in ports.items():
        seen = await asyncio.to_thread(scrape, port)
        frozen = seen[f'weightsync_gc_frozen_objects{{process="{process}"}}']
        # torch alone makes the agent's start-up heap that large; the coordinator's is gRPC's.
        assert frozen >= (100_000 if process == "agent" else 5_000), (process, frozen)
        assert seen[f'weightsync_gc_full_pause_ms{{process="{process}"}}'] >= 0


def test_the_round_window_of_loop_lag_starts_again_with_each_round():
    monitor = LoopLagMonitor("test-window")
    monitor.record(40.0, now=100.0)
    monitor.round_started()
    monitor.record(5.0, now=101.0)
    gauge = {w: REGISTRY.get_sample_value("weightsync_loop_lag_ms", {"process": "test-window", "window": w})
             for w in ("all", "recent", "round")}
    assert gauge == {"all": 40.0, "recent": 40.0, "round": 5.0}
    monitor.record(20.0, now=112.0)  # the 40 ms sample has left the 10 s window
    assert monitor.max_ms == 40.0 and monitor.recent_max_ms == 20.0 and monitor.round_max_ms == 20.0
    # The gauges are set only when a value changes, and then always.
    gauge = {w: REGISTRY.get_sample_value("weightsync_loop_lag_ms", {"process": "test-window", "window": w})
             for w in ("all", "recent", "round")}
    assert gauge == {"all": 40.0, "recent": 20.0, "round": 20.0}
    monitor.round_started()
    monitor.record(1.0, now=113.0)
    assert REGISTRY.get_sample_value("weightsync_loop_lag_ms", {"process": "test-window", "window": "round"}) == 1.0
