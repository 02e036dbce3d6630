"""CPU seconds a measured step costs, per role of process (trainer, coordinator,
engines; for the baselines, sender and receivers).

Wall time on a machine whose processes share cores says how long a step took; CPU
time says how much work it was. Where the trainer, the engines and the wire (loopback
TCP is CPU too) share two cores, a step that does more work cannot help taking
longer, and one that waits more (for a core, a lock, a peer) shows it as wall time
without CPU. The bench reports both, so a tensor count that costs more can be told
apart: more work (copies that more tensors need) or more waiting.

User plus system time of each whole process, from ``/proc`` (psutil), read before
and after the step: every thread of a process counts, its transfer threads and
gloo's included; children of a process do not (the reference engine runs inside its
agent's process).

The meter also counts the time the machine itself lost during each step: Linux's
*steal* time, what a hypervisor took from this virtual machine's CPUs to run
something else. On the 2-core VM this project is measured on, both CPUs are taken
together for 25-35 ms at a time, in bursts: every process stalls at once, and the
stall is no process's doing. The bursts come when the host takes back memory the VM
reported free (``returned_memory.py``), so the meter also records, per step, how much
memory went back meanwhile where the kernel counts it. The worst loop lag of the steps
that lost nothing is where weightsync's own stalls show; the kernel accounts steal at
its ticks, so a burst can now and then be counted in a neighbouring step instead.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

import psutil

from weightsync.apps.bench.returned_memory import returned_kib


def machine_steal_s() -> float | None:
    """CPU seconds taken from this machine by its hypervisor since boot, summed over
    its CPUs (``/proc/stat``'s steal column, counted in 10 ms ticks); None where the
    OS does not count it."""
    return getattr(psutil.cpu_times(), "steal", None)


class CpuMeter:
    """CPU seconds of groups of processes between ``start`` and ``stop``, step after step."""

    def __init__(self, roles: Mapping[str, Iterable[int]]) -> None:
        """``roles``: a role's name -> the pids whose CPU time counts for it."""
        self._roles = {role: [psutil.Process(pid) for pid in pids] for role, pids in roles.items()}
        self._started: dict[str, float] | None = None
        self._steal_started: float | None = None
        self.steps: list[dict[str, float]] = []
        # Per step: ms the machine lost, per CPU (the steal of all CPUs / their count);
        # empty where the OS does not count steal.
        self.stolen_ms: list[float] = []
        # Per step: MiB of free memory the machine handed back to its host; empty where
        # the kernel does not count it.
        self.returned_mib: list[float] = []
        self._returned_started: int | None = None

    @classmethod
    def merged(cls, meters: Sequence[CpuMeter]) -> CpuMeter:
        """The steps of ``meters`` (the same roles, measured one after the other) as one
        meter's, for ``summary`` and ``stolen``; it measures nothing itself."""
        out = cls({})
        out._roles = {role: [] for meter in meters for role in meter._roles}
        for meter in meters:
            out.steps += meter.steps
            out.stolen_ms += meter.stolen_ms
            out.returned_mib += meter.returned_mib
        return out

    def _now(self) -> dict[str, float]:
        totals = {}
        for role, procs in self._roles.items():
            seconds = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except psutil.Error:  # a process that ended has no more time to count
                    continue
                seconds += times.user + times.system
            totals[role] = seconds
        return totals

    def start(self) -> None:
        self._started = self._now()
        self._steal_started = machine_steal_s()
        self._returned_started = returned_kib()

    def stop(self) -> None:
        """Records the step since ``start``."""
        if self._started is None:
            raise RuntimeError("CpuMeter.stop without start")
        now = self._now()
        steal = machine_steal_s()
        returned = returned_kib()
        self.steps.append({role: max(0.0, now[role] - self._started[role]) for role in now})
        if steal is not None and self._steal_started is not None:
            self.stolen_ms.append(round(max(0.0, steal - self._steal_started) * 1000 / (psutil.cpu_count() or 1), 1))
        if returned is not None and self._returned_started is not None:
            self.returned_mib.append(round(max(0, returned - self._returned_started) / 1024, 1))
        self._started = None

    def summary(self) -> dict[str, float]:
        """Median CPU seconds per step: each role's, and ``total`` (the median of the
        steps' totals, not the sum of the roles' medians)."""
        if not self.steps:
            return {}
        out = {role: statistics.median(step[role] for step in self.steps) for role in self._roles}
        out["total"] = statistics.median(sum(step.values()) for step in self.steps)
        return {role: round(seconds, 3) for role, seconds in out.items()}  # /proc counts in 10 ms ticks

    def stolen(self) -> dict[str, float] | None:
        """The ms per CPU the machine lost to its hypervisor: the median step's and the
        worst step's; None where the OS does not count it."""
        if not self.stolen_ms or len(self.stolen_ms) != len(self.steps):
            return None
        return {"median": round(statistics.median(self.stolen_ms), 1), "max": round(max(self.stolen_ms), 1)}


__all__ = ["CpuMeter", "machine_steal_s"]
