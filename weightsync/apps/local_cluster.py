"""LocalCluster: a coordinator and N agents as local processes, for the demo, the bench
and the test suite.

Starts them with the same command lines a user runs, waits for each one's port file
(an agent writes it once registered), and on exit stops every process it started, in
reverse order, whatever happened in between. Each process logs to ``<name>.log`` in the
cluster's folder.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from weightsync.lifecycle import free_port, spawn, stop_process, wait_for_file, weightsync_command


@dataclass
class ServiceProcess:
    """One started coordinator or agent: ``name`` is ``coordinator`` or the engine id."""

    name: str
    address: str
    proc: subprocess.Popen
    log_path: str

    @property
    def engine_id(self) -> str:
        return self.name


@dataclass
class StartingService:
    """A coordinator or agent spawned but not yet serving; ``wait`` gives its address."""

    name: str
    port_file: str
    proc: subprocess.Popen
    log_path: str

    def wait(self, timeout_s: float) -> ServiceProcess:
        address = wait_for_file(self.port_file, timeout_s=timeout_s, proc=self.proc)
        return ServiceProcess(self.name, address, self.proc, self.log_path)


def spawn_service(tmp: str, name: str, command: str, *args: str, log_level: str | None = None,
                  env: dict[str, str] | None = None,
                  wrap: Callable[[list[str]], list[str]] | None = None) -> StartingService:
    """Spawns ``weightsync COMMAND ARGS --port-file tmp/<name>.addr`` logging to
    ``tmp/<name>.log`` (appended, so a restart keeps the earlier lines).

    The port file of an earlier process of the same name is removed first, so a restart
    never reads the previous address. ``env`` is added to this process's environment;
    ``wrap`` turns the command line into the one to run (e.g. on a simulated host).
    """
    port_file = os.path.join(tmp, f"{name}.addr")
    if os.path.exists(port_file):
        os.unlink(port_file)
    log_path = os.path.join(tmp, f"{name}.log")
    global_args = ["--log-level", log_level] if log_level else []
    with open(log_path, "a") as log:
        argv = weightsync_command(*global_args, command, *args, "--port-file", port_file)
        proc = spawn(wrap(argv) if wrap else argv,
                     stdout=log, stderr=log, env={**os.environ, **(env or {})})
    return StartingService(name, port_file, proc, log_path)


def start_service(tmp: str, name: str, command: str, *args: str, log_level: str | None = None,
                  env: dict[str, str] | None = None, timeout_s: float = 60.0,
                  wrap: Callable[[list[str]], list[str]] | None = None) -> ServiceProcess:
    """``spawn_service`` and wait until it serves; a process that does not is stopped."""
    starting = spawn_service(tmp, name, command, *args, log_level=log_level, env=env, wrap=wrap)
    try:
        return starting.wait(timeout_s)
    except BaseException:
        stop_process(starting.proc, grace_s=5.0)
        raise


def folder_logs(folder: str, tail_chars: int) -> str:
    """The end of every ``*.log`` in ``folder``, each under its name."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".log"):
            with open(os.path.join(folder, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-tail_chars:]}")
    return "\n".join(out)


class LocalCluster:
    """Context manager: a coordinator and ``engines`` agents (engine ids ``engine-0`` ...).

    Attributes: ``address`` (the coordinator's), ``coordinator`` and ``agents``
    (:class:`ServiceProcess`), ``agent_addresses``, ``state_db``, ``procs`` (every
    process started, restarts included, all stopped on exit).

    Args:
        tmp: folder for state, port files and the logs.
        engines: number of agents.
        server_args: options every server gets (TLS and token, or ``--insecure``).
        role_args: options per process, from its role and engine id (``"coordinator", ""``
            or ``"agent", "engine-0"``): each role's own certificate under mutual TLS.
        coordinator_args / agent_args: extra options for the coordinator / every agent.
        coordinator_env / agent_env: environment added for the coordinator / every agent.
        log_level: every process's ``--log-level`` (None: the command's default).
        agent_timeout_s: how long an agent may take to register (large models take a while).
        settle_s: pause after start-up, so the first heartbeats have arrived.
        metrics: give every process a ``--metrics-port`` of its own (``metrics_ports``,
            by process name: ``coordinator`` or the engine id).
    """

    def __init__(self, tmp: str, *, engines: int, server_args: Sequence[str] = ("--insecure",),
                 coordinator_args: Sequence[str] = (), agent_args: Sequence[str] = (),
                 coordinator_env: dict[str, str] | None = None, agent_env: dict[str, str] | None = None,
                 log_level: str | None = "WARNING", start_timeout_s: float = 60.0,
                 agent_timeout_s: float = 60.0, settle_s: float = 0.0,
                 role_args: Callable[[str, str], Sequence[str]] | None = None, metrics: bool = False) -> None:
        self.tmp = tmp
        self.engines = engines
        self.server_args = list(server_args)
        self.coordinator_args = list(coordinator_args)
        self.agent_args = list(agent_args)
        self.coordinator_env = coordinator_env
        self.agent_env = agent_env
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self.agent_timeout_s = agent_timeout_s
        self.settle_s = settle_s
        self.role_args = role_args or (lambda role, engine_id: ())
        self.state_db = os.path.join(tmp, "state.db")
        self.procs: list[subprocess.Popen] = []
        self.coordinator: ServiceProcess | None = None
        self.agents: list[ServiceProcess] = []
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}

    @property
    def address(self) -> str:
        return self.coordinator.address if self.coordinator else ""

    @property
    def agent_addresses(self) -> list[str]:
        return [a.address for a in self.agents]

    def agent(self, engine_id: str) -> ServiceProcess:
        return next(a for a in self.agents if a.engine_id == engine_id)

    def __enter__(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        starting = self._spawn("coordinator", "coordinator", *self.server_args, *self.role_args("coordinator", ""),
                               "--listen", "127.0.0.1:0", "--state-db", self.state_db, *self.coordinator_args,
                               env=self.coordinator_env)
        self.coordinator = starting.wait(self.start_timeout_s)
        # Agents start together (a large model loads in each at once) and are then awaited.
        pending = [self._spawn_agent(f"engine-{i}", *self.agent_args, env=self.agent_env)
                   for i in range(self.engines)]
        self.agents = [p.wait(self.agent_timeout_s) for p in pending]
        if self.settle_s:
            time.sleep(self.settle_s)

    def restart_coordinator(self, *extra: str, name: str, env: dict[str, str] | None = None) -> ServiceProcess:
        """Starts a coordinator on the stopped one's address and state database (the
        caller stops the old one first), with the cluster's options and ``extra``;
        ``name`` names its log. It becomes ``coordinator`` and is stopped with the cluster."""
        starting = self._spawn(name, "coordinator", *self.server_args, *self.role_args("coordinator", ""),
                               "--listen", self.address, "--state-db", self.state_db, *self.coordinator_args,
                               *extra, env=env)
        self.coordinator = starting.wait(self.start_timeout_s)
        return self.coordinator

    def start_agent(self, engine_id: str, *extra: str, env: dict[str, str] | None = None,
                    server_args: Sequence[str] | None = None) -> ServiceProcess:
        """Starts (or restarts, replacing the entry of the same id) an agent with this
        cluster's server options (or ``server_args``) and ``extra``; it is stopped with
        the cluster."""
        agent = self._spawn_agent(engine_id, *extra, env=env, server_args=server_args).wait(self.agent_timeout_s)
        self.agents = [a for a in self.agents if a.engine_id != engine_id] + [agent]
        return agent

    def _spawn_agent(self, engine_id: str, *extra: str, env: dict[str, str] | None = None,
                     server_args: Sequence[str] | None = None) -> StartingService:
        server_args = self.server_args if server_args is None else list(server_args)
        return self._spawn(engine_id, "agent", *server_args, *self.role_args("agent", engine_id),
                           "--coordinator", self.address, "--engine-id", engine_id, *extra, env=env)

    def _spawn(self, name: str, command: str, *args: str, env: dict[str, str] | None) -> StartingService:
        if self.metrics:  # a restarted process keeps its port
            port = self.metrics_ports.setdefault("coordinator" if command == "coordinator" else name, free_port())
            args = (*args, "--metrics-port", str(port))
        starting = spawn_service(self.tmp, name, command, *args, log_level=self.log_level, env=env)
        self.procs.append(starting.proc)
        return starting

    def logs(self, tail_chars: int = 4000) -> str:
        """The end of every process's log, for a failure message."""
        return folder_logs(self.tmp, tail_chars)

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=10.0)


__all__ = ["LocalCluster", "ServiceProcess", "StartingService", "spawn_service", "start_service", "folder_logs"]
