"""LocalCluster: a coordinator and N agents as local processes, for the demo and benchmarks.

Starts them with the same command lines a user runs, waits for each one's port file
(an agent writes it once registered), and on exit stops every process it started,
in reverse order, whatever happened in between.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence

from weightsync.lifecycle import spawn, stop_process, wait_for_file, weightsync_command


class LocalCluster:
    """Context manager; ``address`` is the coordinator's, ``agents`` the agents' addresses.

    Args:
        tmp: folder for state, port files and the shared ``services.log``.
        engines: number of agents (engine ids ``engine-0`` ...).
        server_args: options every server gets (TLS and token, or ``--insecure``).
        role_args: options per process, from its role and engine id (``"coordinator", ""``
            or ``"agent", "engine-0"``): each role's own certificate under mutual TLS.
        agent_args: extra options for every agent (model, step delay, ...).
        agent_timeout_s: how long an agent may take to register (large models take a while).
        settle_s: pause after start-up, so the first heartbeats have arrived.
    """

    def __init__(self, tmp: str, *, engines: int, server_args: Sequence[str] = ("--insecure",),
                 agent_args: Sequence[str] = (), start_timeout_s: float = 60.0, agent_timeout_s: float = 60.0,
                 settle_s: float = 0.0, role_args: Callable[[str, str], Sequence[str]] | None = None) -> None:
        self.tmp = tmp
        self.engines = engines
        self.server_args = list(server_args)
        self.agent_args = list(agent_args)
        self.start_timeout_s = start_timeout_s
        self.agent_timeout_s = agent_timeout_s
        self.settle_s = settle_s
        self.role_args = role_args or (lambda role, engine_id: ())
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.agents: list[str] = []
        self._logs = None

    def __enter__(self) -> LocalCluster:
        self._logs = open(os.path.join(self.tmp, "services.log"), "w")  # noqa: SIM115 - closed in __exit__
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _spawn(self, *args: str) -> subprocess.Popen:
        proc = spawn(weightsync_command("--log-level", "WARNING", *args), stdout=self._logs, stderr=self._logs)
        self.procs.append(proc)
        return proc

    def _start(self) -> None:
        port_file = os.path.join(self.tmp, "coordinator")
        coordinator = self._spawn("coordinator", *self.server_args, *self.role_args("coordinator", ""), "--listen", "127.0.0.1:0", "--state-db",
                                  os.path.join(self.tmp, "state.db"), "--port-file", port_file)
        self.address = wait_for_file(port_file, timeout_s=self.start_timeout_s, proc=coordinator)
        started = []
        for i in range(self.engines):
            port_file = os.path.join(self.tmp, f"engine-{i}")
            started.append((port_file, self._spawn("agent", *self.server_args, *self.role_args("agent", f"engine-{i}"),
                                                   "--coordinator", self.address,
                                                   "--engine-id", f"engine-{i}", "--port-file", port_file,
                                                   *self.agent_args)))
        self.agents = [wait_for_file(f, timeout_s=self.agent_timeout_s, proc=p) for f, p in started]
        if self.settle_s:
            time.sleep(self.settle_s)

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=10.0)
        self.procs.clear()
        if self._logs is not None:
            self._logs.close()
            self._logs = None


__all__ = ["LocalCluster"]
