"""HostFleet: a weightsync fleet on simulated hosts, for the multi-host tests and bench.

The coordinator runs on the first host, listening on that host's address; every host
runs its share of agents (engine ids ``<host>-<i>``) listening on ``0.0.0.0`` (they
register the address on their route to the coordinator); the trainer
(``weightsync.apps.bench.host_trainer``) runs on the first host too. Every process is
started with the normal CLI on its host (``SimulatedHosts``), logs to
``<folder>/<name>.log``, and is stopped when the hosts are torn down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from weightsync.apps.local_cluster import folder_logs, start_service
from weightsync.apps.topology import Host, SimulatedHosts
from weightsync.faults import ENV as FAULTS_ENV

FAST_HEARTBEATS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")


class HostFleet:
    """A coordinator and agents on ``hosts``: ``layout`` maps a host name to its engine
    count (the first host also runs the coordinator and the trainer). ``faults`` maps a
    host name to a fault rule its agents are started with (``--enable-fault-injection``)."""

    def __init__(self, hosts: SimulatedHosts, folder: str, layout: Mapping[str, int], *, model: str,
                 faults: Mapping[str, dict] | None = None, heartbeats: Sequence[str] = FAST_HEARTBEATS,
                 timeout_s: float = 120.0) -> None:
        self.hosts, self.folder, self.model = hosts, folder, model
        self.home: Host = hosts[next(iter(layout))]
        coordinator = start_service(folder, "coordinator", "coordinator", "--insecure", "--listen",
                                    f"{self.home.address}:0", "--state-db", os.path.join(folder, "state.db"),
                                    *heartbeats, wrap=self.home.command, timeout_s=timeout_s)
        self.home.procs.append(coordinator.proc)
        self.coordinator = coordinator.address
        self.engines: dict[str, str] = {}  # engine id -> host name
        for name, count in layout.items():
            host = hosts[name]
            rule = (faults or {}).get(name)
            extra = ("--enable-fault-injection",) if rule else ()
            env = {FAULTS_ENV: json.dumps([rule])} if rule else None
            for i in range(count):
                engine_id = f"{name}-{i}"
                agent = start_service(folder, engine_id, "agent", "--insecure", "--listen", "0.0.0.0:0",
                                      "--coordinator", self.coordinator, "--engine-id", engine_id,
                                      "--model", model, *extra, env=env, wrap=host.command, timeout_s=timeout_s)
                host.procs.append(agent.proc)
                self.engines[engine_id] = name

    def trainer_command(self, *args: str) -> list[str]:
        """The trainer's command line, to run on the home host."""
        return [sys.executable, "-m", "weightsync.apps.bench.host_trainer", self.coordinator, self.home.address,
                "--model", self.model, *args]

    def sync(self, *args: str, timeout_s: float = 300.0) -> list[dict]:
        """Runs the trainer on the home host to the end; returns its per-round lines.
        RuntimeError (with its output and the fleet's logs) if it fails."""
        done = self.home.run(self.trainer_command(*args), timeout_s=timeout_s, capture_output=True, text=True)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"trainer failed ({done.returncode}): {done.stderr[-3000:]}\n{self.logs()}")
        return lines

    def spawn_trainer(self, *args: str, stdout) -> subprocess.Popen:
        """Starts the trainer on the home host (stopped with the hosts)."""
        return self.home.spawn(self.trainer_command(*args), stdout=stdout, stderr=subprocess.STDOUT)

    def logs(self, tail_chars: int = 2000) -> str:
        """The end of every process's log."""
        return folder_logs(self.folder, tail_chars)


__all__ = ["HostFleet", "FAST_HEARTBEATS"]
