"""Process lifecycle with real processes and real signals (invariants
every-wait-has-a-deadline, children-die-with-sidecar, teardown-reports-all).

The launched "engine" is ``tests/engine_tree.py``: a real multi-process tree (workers,
grandchildren, one that ignores SIGTERM) with an HTTP health check.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import start_coordinator, wait_available
from tests.test_sync_safety import BUCKET, slow, wait_for_event
from weightsync.client import RetryPolicy, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import EngineUnavailable, WeightSyncError
from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file, weightsync_command
from weightsync.packing import weights_digest

TREE = str(Path(__file__).with_name("engine_tree.py"))
GRACE = "1.5"


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    end = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.05)
    return alive(pids)


@pytest.fixture
def launched(tmp_path):
    """A coordinator plus one agent that launched engine_tree.py; yields (agent proc, pids, address, tmp)."""
    tmp = str(tmp_path)
    procs = []
    coordinator, address, _ = start_coordinator(tmp)
    procs.append(coordinator)
    pids_file, port_file = os.path.join(tmp, "pids"), os.path.join(tmp, "engine.port")

    def make(*agent_flags: str, env: dict | None = None):
        log = open(os.path.join(tmp, "agent.log"), "a")
        port = free_port()
        agent = spawn(weightsync_command(
            "agent", "--insecure", "--coordinator", address, "--engine-id", "engine-0", "--port-file",
            os.path.join(tmp, "agent.addr"), "--shutdown-grace", GRACE, "--health-url",
            f"http://127.0.0.1:{port}/health", "--launch-timeout", "30", *agent_flags,
            "--launch", "--", sys.executable, TREE, pids_file, port_file, str(port)),
            env={**os.environ, **(env or {})}, stdout=log, stderr=log)
        log.close()
        procs.append(agent)
        wait_for_file(os.path.join(tmp, "agent.addr"), timeout_s=60, proc=agent)
        wait_for_file(port_file, timeout_s=30)
        end = time.monotonic() + 10
        while True:  # 1 top + 2 workers + 2 grandchildren
            pids = [int(x) for x in Path(pids_file).read_text().split()]
            if len(pids) >= 5 or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert len(pids) == 5, pids
        reaper = psutil.Process(agent.pid).children()[0].pid
        return agent, pids + [reaper], address

    yield make, tmp
    for proc in reversed(procs):
        stop_process(proc, grace_s=10)


def test_sigterm_reaps_the_whole_engine_tree(launched):
    make, tmp = launched
    agent, pids, address = make()
    assert alive(pids) == pids
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, Path(tmp, "agent.log").read_text()[-3000:]
    assert wait_gone(pids, 5) == []


def test_started_processes_stay_in_this_session_and_lead_their_own_process_groups(launched):
    """Every process weightsync starts (here: an agent, its reaper and the engine tree
    under it) stays in its starter's session -- and so, where the kernel groups CPU
    time by session (autogroup), in its starter's CPU group -- while leading a process
    group of its own, which is what stopping a tree relies on (``os.killpg``).

    Each in a session of its own, on a loaded two-core machine an agent's and the
    coordinator's threads waited up to 0.6 s for a CPU, heartbeats lapsed and a KEEP
    Pause took 3.4 s (``docs/benchmarks.md``, "A CPU group per started process")."""
    make, _ = launched
    agent, pids, _ = make()
    engine_tree, reaper = pids[:-1], pids[-1]
    for pid in [agent.pid, *pids]:
        assert os.getsid(pid) == os.getsid(0), f"pid {pid} started a session of its own"
    assert os.getpgid(agent.pid) == agent.pid
    assert os.getpgid(reaper) == reaper
    assert [os.getpgid(pid) for pid in engine_tree] == [reaper] * len(engine_tree)
    ours = Path("/proc/self/autogroup")
    if ours.exists():  # kernels built with autogroup
        for pid in [agent.pid, *pids]:
            assert Path(f"/proc/{pid}/autogroup").read_text() == ours.read_text(), pid


def test_sigkill_of_the_agent_still_takes_the_tree_down(launched):
    """The reaper gets its parent-death signal, TERMs, waits the grace, KILLs the stuck
    one. The engine's named semaphore goes too: its resource tracker (which ignores
    SIGTERM, and whose pipe the stuck process holds) is killed only after the others,
    when it has unlinked what they registered; killed with them, it left the semaphore
    in /dev/shm (as a frozen vLLM killed by the reaper did)."""
    make, tmp = launched
    sem_file = os.path.join(tmp, "semaphore")
    agent, pids, _ = make(env={"ENGINE_TREE_SEM": sem_file})
    semaphore = wait_for_file(sem_file, timeout_s=10)
    assert os.path.exists(semaphore)
    agent.send_signal(signal.SIGKILL)
    agent.wait(timeout=10)
    assert wait_gone(pids, 10) == []
    end = time.monotonic() + 10
    while os.path.exists(semaphore) and time.monotonic() < end:  # the reaper's last step
        time.sleep(0.05)
    assert not os.path.exists(semaphore), "the stopped engine's semaphore stayed in /dev/shm"


def test_second_sigterm_does_not_cut_cleanup_short(launched):
    make, tmp = launched
    agent, pids, _ = make()
    agent.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # cleanup is now waiting out the stuck grandchild's grace period
    agent.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    agent.send_signal(signal.SIGINT)
    assert agent.wait(timeout=30) == 0, Path(tmp, "agent.log").read_text()[-3000:]
    assert wait_gone(pids, 5) == []
    assert "ignored; cleanup continues" in Path(tmp, "agent.log").read_text()


def test_failing_cleanup_step_does_not_stop_the_others(launched):
    make, tmp = launched
    rules = [{"op": "shutdown", "action": "fail", "method": "deregister"}]
    agent, pids, address = make("--enable-fault-injection", env={"WEIGHTSYNC_FAULTS": json.dumps(rules)})
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 1
    assert wait_gone(pids, 5) == [], "the engine tree must be stopped even though deregister failed"
    log = Path(tmp, "agent.log").read_text()
    assert "injected failure in shutdown step 'deregister'" in log
    assert "stopped with errors" in log


def test_engine_that_crashes_is_reported_unavailable(launched):
    make, tmp = launched
    agent, pids, address = make()
    wait_available(address, ["engine-0"])
    os.kill(pids[0], signal.SIGKILL)  # the engine's top process dies on its own

    async def check():
        async with TrainerClient(address) as client:
            end = time.monotonic() + 10
            while True:
                state = await client.get_state()
                engine = state.engines[0]
                if not engine.available:
                    break
                assert time.monotonic() < end, engine
                await asyncio.sleep(0.1)
            assert "exited" in engine.fault
            with pytest.raises(EngineUnavailable):
                await client.pause(required_engines=["engine-0"])

    asyncio.run(check())
    assert wait_gone(pids[1:5], 10) == [], "the rest of the crashed engine's tree is reaped"
    assert agent.poll() is None, "the agent stays up and reports the fault"


async def test_dead_agent_is_left_out_and_reported(cluster_factory):
    cluster = cluster_factory(2)
    os.kill(cluster.agents[1].proc.pid, signal.SIGKILL)
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        end = time.monotonic() + 10
        while any(e.available for e in (await client.get_state()).engines if e.engine_id == "engine-1"):
            assert time.monotonic() < end
            await asyncio.sleep(0.1)
        result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        assert [e.engine_id for e in result.engines] == ["engine-0"]
        assert [(e.engine_id, e.error_reason) for e in result.skipped] == [("engine-1", "ENGINE_UNAVAILABLE")]
        with pytest.raises(EngineUnavailable, match="engine-1"):
            await client.update_weights(model.named_parameters(), version=2, required_engines=["engine-1"])


async def test_coordinator_sigterm_during_a_sync_then_restart(cluster_factory):
    cluster = cluster_factory(2, agent_args=("--enable-fault-injection",),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps([slow(1, 0.2)])},
                              coordinator_args=("--shutdown-grace", "1"))
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address, bucket_bytes=BUCKET,
                             retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.1)) as client:
        sync = asyncio.create_task(client.update_weights(model.named_parameters(), version=1, timeout_s=30))
        await wait_for_event(cluster.agents[0].address, "transfer_started")
        started = time.monotonic()
        cluster.coordinator.proc.send_signal(signal.SIGTERM)
        try:
            await sync
        except WeightSyncError as exc:  # a typed error, not a hang
            assert exc.reason in ("UNAVAILABLE", "SHUTTING_DOWN", "ENGINE_UNAVAILABLE", "COORDINATOR_UNAVAILABLE",
                                  "DEADLINE_EXCEEDED",
                                  "OPERATION_ABORTED", "TRANSFER_FAILED"), exc
        assert time.monotonic() - started < 30
        assert await asyncio.to_thread(cluster.coordinator.proc.wait, 30) == 0
    restarted = cluster.restart_coordinator(name="coordinator2").proc
    try:
        await asyncio.to_thread(wait_available, cluster.address, ["engine-0", "engine-1"])
        async with TrainerClient(cluster.address) as client:
            result = await client.update_weights(model.named_parameters(), version=2, timeout_s=60)
            assert result.ok
            state = await client.get_state(include_digests=True)
        assert state.weight_version == 2
        assert {e.weights_digest for e in state.engines} == {weights_digest(model.named_parameters())}
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(restarted.wait, 30) == 0


async def test_health_and_reflection_on_both_servers(cluster):
    from weightsync.v1 import agent_pb2, coordinator_pb2
    targets = [(cluster.address, coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name),
               (cluster.agents[0].address, agent_pb2.DESCRIPTOR.services_by_name["EngineAgentService"].full_name)]
    for address, service in targets:
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                response = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert response.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for response in stub.ServerReflectionInfo(requests(), timeout=5):
                names = {s.name for s in response.list_services_response.service}
                assert service in names and "grpc.health.v1.Health" in names
                break


async def test_a_health_watcher_sees_not_serving_and_does_not_keep_servers_alive(cluster):
    """Load balancers hold ``Health/Watch`` streams open. On SIGTERM each server tells its
    watchers NOT_SERVING, ends their streams (status OK: not cancelled when its shutdown
    grace ran out, which held every shutdown with a watcher for the whole 10 s grace),
    and exits 0 (a thread-based health servicer kept both servers running after SIGTERM)."""
    servers = [(cluster.agents[0].address, cluster.agents[0].proc), (cluster.address, cluster.coordinator.proc)]
    for address, proc in servers:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            seen = []
            while (response := await watch.read()) is not grpc.aio.EOF:
                seen.append(response.status)
            assert await watch.code() == grpc.StatusCode.OK
            assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING], seen
            assert await asyncio.to_thread(proc.wait, 30) == 0
            assert time.monotonic() - started < 9, "a watcher held the server for its whole shutdown grace (10 s)"


def test_an_agent_whose_deregistration_is_cancelled_exits_0(cluster_factory):
    # A coordinator stopped together with its agents cancels their DeregisterEngine
    # calls in flight (seen as exit 1 in 2 runs of 5). Being unable to tell a
    # coordinator that is going away is not the agent's failure.
    cancelled = [{"op": "rpc", "action": "cancel", "method": "DeregisterEngine"}]
    cluster = cluster_factory(1, coordinator_args=("--enable-fault-injection",),
                              coordinator_env={"WEIGHTSYNC_FAULTS": json.dumps(cancelled)})
    agent = cluster.agents[0]
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0, open(agent.log_path).read()[-2000:]
    assert "could not deregister from the coordinator (CANCELLED)" in open(agent.log_path).read()


def test_shared_memory_the_engine_left_is_removed_and_another_processs_is_not(launched):
    """The stuck grandchild makes a /dev/shm segment and maps it; it also maps one this
    test makes after the launch and keeps mapped, and one made before the launch that
    nothing else maps. It is SIGKILLed at the end of the grace period and unlinks
    nothing. Once the tree is gone its own segment is removed; the one this test still
    maps stays, and so does the one that was there before the engine."""
    import mmap
    import uuid

    make, tmp = launched
    tag = uuid.uuid4().hex[:8]
    own, held, before = f"/dev/shm/engine-tree-{tag}", f"/dev/shm/test-held-{tag}", f"/dev/shm/test-before-{tag}"
    Path(before).write_bytes(b"\0" * 4096)
    time.sleep(2.0)  # well before the launch: file times are coarser than the clock
    try:
        agent, pids, _ = make(env={"ENGINE_TREE_SHM": os.path.basename(own), "ENGINE_TREE_SHM_MAP": f"{held}:{before}"})
        Path(held).write_bytes(b"\0" * 4096)
        with open(held, "r+b") as f, mmap.mmap(f.fileno(), 0):
            end = time.monotonic() + 10
            while not os.path.exists(own) and time.monotonic() < end:
                time.sleep(0.05)
            assert os.path.exists(own)
            time.sleep(2.5)  # the grandchild maps them all; the reaper looks every 2 s
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=30) == 0, Path(tmp, "agent.log").read_text()[-3000:]
            assert wait_gone(pids, 5) == []
            assert not os.path.exists(own), "the engine's segment was left in shared memory"
            assert os.path.exists(held), "a segment another live process maps was removed"
        assert os.path.exists(before), "a segment made before the engine started was removed"
        assert f"removed {own}" in Path(tmp, "agent.log").read_text()
    finally:
        for path in (own, held, before):
            if os.path.exists(path):
                os.unlink(path)


def test_free_ports_come_from_outside_the_kernels_ephemeral_range_and_are_never_handed_out_twice():
    """A port a test hands to a child is one neither a server bound to port 0 nor an
    outgoing connection can take before the child binds it: the kernel gives those from
    its ephemeral range only (a ready port taken by such a socket failed an agent's
    start once under load)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    if low < 11000:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it")
    busy = [free_port() for _ in range(50)]
    assert all(port < low for port in busy), busy
    assert len(set(busy)) == len(busy)
    for port in busy[:5]:  # each one binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
