"""TrainerRanks: a sharded trainer's ranks as real processes, started as torchrun starts
them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each running
``weightsync.apps.bench.sharded_trainer``. For the sharded-trainer tests and
``weightsync bench --trainer-ranks``. Every process is stopped on exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from weightsync.lifecycle import free_port


def _interruptible() -> None:
    """In the child, before exec: SIGINT back to its default. A process started in the
    background by a non-interactive shell (a CI job, ``cmd &``) inherits SIGINT ignored,
    and Python then never turns it into a cancellation of the rank's round."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class TrainerRanks:
    """Context manager: ``world`` rank processes syncing to ``coordinator``.

    Args:
        folder: where each rank's output goes (``rank-N.log``, JSON lines and warnings).
        args: the rank script's options after the coordinator (``--model``, ...).
        module: the rank script (run with ``python -m``; it prints JSON lines).
        hosts: where each rank runs, one per rank (simulated hosts,
            ``weightsync.apps.topology.Host``): rank r runs on ``hosts[r]`` with
            ``--host`` its address, and rank 0's host is the torch.distributed master.
            None: every rank here, on loopback.
    """

    def __init__(self, folder: str, coordinator: str, world: int, args: Sequence[str], *,
                 env: dict[str, str] | None = None, module: str = "weightsync.apps.bench.sharded_trainer",
                 hosts: Sequence | None = None) -> None:
        if hosts is not None and len(hosts) != world:
            raise ValueError(f"hosts names one host per rank: {len(hosts)} for {world} ranks")
        self.folder, self.coordinator, self.world = folder, coordinator, world
        self.args = list(args)
        self.module = module
        self.env = env or {}
        self.hosts = hosts
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> TrainerRanks:
        port = str(free_port())
        master = self.hosts[0].address if self.hosts is not None else "127.0.0.1"
        os.makedirs(self.folder, exist_ok=True)
        for rank in range(self.world):
            env = dict(os.environ, **self.env, RANK=str(rank), WORLD_SIZE=str(self.world), MASTER_ADDR=master,
                       MASTER_PORT=port, LOCAL_RANK=str(rank))
            argv = [sys.executable, "-m", self.module, self.coordinator, *self.args]
            if self.hosts is not None:
                argv = self.hosts[rank].command([*argv, "--host", self.hosts[rank].address])
            with open(self.log(rank), "w") as out:
                self.procs.append(subprocess.Popen(
                    argv, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0,  # not a session: see spawn()
                    preexec_fn=_interruptible))
        return self

    def log(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.log")

    def lines(self, rank: int) -> list[dict]:
        """The JSON lines rank ``rank`` printed so far."""
        found = []
        with open(self.log(rank), errors="replace") as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        found.append(json.loads(line))
                    except ValueError:
                        pass
        return found

    def rounds(self, rank: int) -> dict[int, dict]:
        """Rank ``rank``'s finished rounds, by version."""
        return {line["round"]: line for line in self.lines(rank) if "round" in line}

    def wait_for(self, rank: int, predicate, timeout_s: float) -> dict:
        """The first line of ``rank`` that satisfies ``predicate``; TimeoutError after ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for line in self.lines(rank):
                if predicate(line):
                    return line
            time.sleep(0.05)
        raise TimeoutError(f"rank {rank} printed no such line in {timeout_s}s:\n{self.tail()}")

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def wait(self, timeout_s: float, ranks: Sequence[int] | None = None) -> list[int | None]:
        """Waits for the ranks to exit; their return codes (None: still running at the deadline)."""
        until = time.monotonic() + timeout_s
        chosen = range(self.world) if ranks is None else ranks
        for rank in chosen:
            try:
                self.procs[rank].wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [self.procs[r].poll() for r in chosen]

    def tail(self, chars: int = 3000) -> str:
        parts = []
        for rank in range(self.world):
            with open(self.log(rank), errors="replace") as f:
                parts.append(f"--- rank {rank}\n{f.read()[-chars:]}")
        return "\n".join(parts)

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


__all__ = ["TrainerRanks"]
