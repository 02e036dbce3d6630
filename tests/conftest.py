"""Shared fixtures: real coordinator and agent processes on ephemeral loopback ports.

``cluster_factory`` starts a coordinator and N agents as separate processes (the same
command lines a user runs), waits until every engine is registered and available,
and always stops every process it started, checking none is left behind.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil
import pytest

from weightsync.apps.local_cluster import LocalCluster, ServiceProcess, start_service

START_TIMEOUT_S = 60.0
# Heartbeats fast enough that a test sees a dead agent within a couple of seconds.
TEST_HEARTBEATS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")

Cluster = LocalCluster  # what the cluster fixtures give a test
AgentProc = ServiceProcess


def start_coordinator(tmp: str, *extra: str, state_db: str | None = None, name: str = "coordinator",
                      listen: str = "127.0.0.1:0", env: dict | None = None):
    """Starts a coordinator process outside any cluster (insecure, test heartbeats);
    returns (proc, bound address, state db path). The caller stops it."""
    state_db = state_db or os.path.join(tmp, "state.db")
    service = start_service(tmp, name, "coordinator", "--insecure", "--listen", listen, "--state-db", state_db,
                            *TEST_HEARTBEATS, *extra, env=env, timeout_s=START_TIMEOUT_S)
    return service.proc, service.address, state_db


def start_agent(tmp: str, coordinator: str, engine_id: str, *extra: str, env: dict | None = None,
                insecure: bool = True) -> ServiceProcess:
    """Starts an agent process outside any cluster; the caller stops it."""
    mode = ["--insecure"] if insecure else []
    return start_service(tmp, engine_id, "agent", *mode, "--coordinator", coordinator, "--engine-id", engine_id,
                         *extra, env=env, timeout_s=START_TIMEOUT_S)


def wait_available(address: str, engine_ids: list[str], timeout_s: float = 30.0) -> None:
    """Polls the coordinator (blocking gRPC, usable from sync and async tests) until every
    engine in ``engine_ids`` is available."""
    import grpc

    from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        end = time.monotonic() + timeout_s
        while True:
            try:
                state = stub.GetState(coordinator_pb2.GetStateRequest(), timeout=5)
                up = {e.engine_id for e in state.engines if e.available}
                if set(engine_ids) <= up:
                    return
            except grpc.RpcError:
                up = set()
            if time.monotonic() > end:
                raise TimeoutError(f"engines {engine_ids} not available; have {up}")
            time.sleep(0.05)


def descendants_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def cluster_factory(tmp_path) -> Callable[..., LocalCluster]:
    """Starts LocalClusters (insecure, test heartbeats, default log level) and waits until
    every engine is available; stops all of their processes at teardown and checks that
    none, nor any of their children, survives."""
    clusters: list[LocalCluster] = []

    def make(engines: int = 2, *, agent_args: tuple[str, ...] = (), coordinator_args: tuple[str, ...] = (),
             agent_env: dict | None = None, coordinator_env: dict | None = None) -> LocalCluster:
        cluster = LocalCluster(str(tmp_path), engines=engines, coordinator_args=(*TEST_HEARTBEATS, *coordinator_args),
                               agent_args=agent_args, coordinator_env=coordinator_env, agent_env=agent_env,
                               log_level=None, start_timeout_s=START_TIMEOUT_S, agent_timeout_s=START_TIMEOUT_S)
        clusters.append(cluster)
        cluster.__enter__()
        wait_available(cluster.address, [a.engine_id for a in cluster.agents])
        return cluster

    yield make
    started = [proc for cluster in clusters for proc in cluster.procs]
    pids = []
    for proc in started:
        try:
            pids += [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for cluster in reversed(clusters):
        cluster.__exit__(None, None, None)
    assert descendants_alive(pids) == [], "a test process outlived its cluster"


@pytest.fixture
def cluster(cluster_factory) -> Cluster:
    """Coordinator + two reference-engine agents."""
    return cluster_factory(2)


VLLM_TIER = "tests/vllm/"


def _in_vllm_tier(item) -> bool:
    return item.nodeid.startswith(VLLM_TIER) or "/vllm/" in str(item.path)


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``), the
    vLLM tier is one unit of work on one worker: its tests share module-scoped vLLM
    servers (a test split off to the other worker would boot its own, without what the
    earlier tests synced), and two vLLMs at once on two cores only slow each other
    down. Every other test is a unit of its own. The scheduler groups by node id itself:
    xdist's ``xdist_group`` marker works by rewriting a private pytest attribute that
    pytest 9.2 no longer reads, so the marker silently grouped nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmTierOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return VLLM_TIER if nodeid.startswith(VLLM_TIER) else nodeid

    return VllmTierOnOneWorker(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """The vLLM tier is scheduled first: it is the longest unit (about 8 minutes), and
    collected last it ran alone at the end while the other worker had nothing left."""
    items.sort(key=lambda item: not _in_vllm_tier(item))  # stable: each tier keeps its order
