"""Shared fixtures: real coordinator and agent processes on ephemeral loopback ports.

``cluster_factory`` starts a coordinator and N agents as separate processes (the same
command lines a user runs), waits until every engine is registered and available,
and always stops every process it started, checking none is left behind.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import pytest

from weightsync.lifecycle import spawn, stop_process, wait_for_file, weightsync_command

START_TIMEOUT_S = 60.0


@dataclass
class AgentProc:
    engine_id: str
    address: str
    proc: subprocess.Popen
    log_path: str


@dataclass
class Cluster:
    """A running coordinator plus agents; ``address`` is the coordinator's."""

    address: str
    coordinator: subprocess.Popen
    agents: list[AgentProc]
    tmp: str
    state_db: str
    coordinator_args: list[str] = field(default_factory=list)
    started: list[subprocess.Popen] = field(default_factory=list)  # every process to stop at teardown

    def agent(self, engine_id: str) -> AgentProc:
        return next(a for a in self.agents if a.engine_id == engine_id)

    def start_agent(self, engine_id: str, *extra: str, env: dict | None = None) -> AgentProc:
        """Starts (or restarts) an agent; the fixture stops it at teardown."""
        agent = start_agent(self.tmp, self.address, engine_id, *extra, env=env)
        self.started.append(agent.proc)
        self.agents = [a for a in self.agents if a.engine_id != engine_id] + [agent]
        return agent

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(".log"):
                with open(os.path.join(self.tmp, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-4000:]}")
        return "\n".join(out)


def start_coordinator(tmp: str, *extra: str, state_db: str | None = None, name: str = "coordinator",
                      listen: str = "127.0.0.1:0", env: dict | None = None):
    """Starts a coordinator process; returns (proc, bound address, state db path)."""
    state_db = state_db or os.path.join(tmp, "state.db")
    port_file = os.path.join(tmp, f"{name}.addr")
    if os.path.exists(port_file):
        os.unlink(port_file)
    log = open(os.path.join(tmp, f"{name}.log"), "a")
    args = ["coordinator", "--insecure", "--listen", listen, "--state-db", state_db, "--port-file", port_file,
            "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", *extra]
    proc = spawn(weightsync_command(*args), stdout=log, stderr=log, env={**os.environ, **(env or {})})
    log.close()
    return proc, wait_for_file(port_file, timeout_s=START_TIMEOUT_S, proc=proc), state_db


def start_agent(tmp: str, coordinator: str, engine_id: str, *extra: str, env: dict | None = None,
                insecure: bool = True) -> AgentProc:
    port_file = os.path.join(tmp, f"{engine_id}.addr")
    if os.path.exists(port_file):  # a restart: never read the previous process's address
        os.unlink(port_file)
    log_path = os.path.join(tmp, f"{engine_id}.log")
    log = open(log_path, "a")
    mode = ["--insecure"] if insecure else []
    proc = spawn(weightsync_command("agent", *mode, "--coordinator", coordinator, "--engine-id", engine_id,
                                    "--port-file", port_file, *extra),
                 stdout=log, stderr=log, env={**os.environ, **(env or {})})
    log.close()
    address = wait_for_file(port_file, timeout_s=START_TIMEOUT_S, proc=proc)
    return AgentProc(engine_id, address, proc, log_path)


def wait_available(address: str, engine_ids: list[str], timeout_s: float = 30.0) -> None:
    """Polls the coordinator (blocking gRPC, usable from sync and async tests) until every
    engine in ``engine_ids`` is available."""
    import grpc

    from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
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
def cluster_factory(tmp_path) -> Callable[..., Cluster]:
    """Starts clusters; stops all of their processes at teardown and checks none survive."""
    started: list[subprocess.Popen] = []

    def make(engines: int = 2, *, agent_args: tuple[str, ...] = (), coordinator_args: tuple[str, ...] = (),
             agent_env: dict | None = None, coordinator_env: dict | None = None) -> Cluster:
        tmp = str(tmp_path)
        coordinator, address, state_db = start_coordinator(tmp, *coordinator_args, env=coordinator_env)
        started.append(coordinator)
        agents = []
        for i in range(engines):
            agent = start_agent(tmp, address, f"engine-{i}", *agent_args, env=agent_env)
            started.append(agent.proc)
            agents.append(agent)
        wait_available(address, [a.engine_id for a in agents])
        cluster = Cluster(address, coordinator, agents, tmp, state_db, list(coordinator_args), started)
        return cluster

    yield make
    pids = []
    for proc in started:
        try:
            pids += [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in reversed(started):
        stop_process(proc, grace_s=10.0)
    assert descendants_alive(pids) == [], "a test process outlived its cluster"


@pytest.fixture
def cluster(cluster_factory) -> Cluster:
    """Coordinator + two reference-engine agents."""
    return cluster_factory(2)
