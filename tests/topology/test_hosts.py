"""Several hosts, simulated with network namespaces (``weightsync.apps.topology``).

Each host has its own address, a hostname that resolves to loopback (as on a Debian
default install), and its own /dev/shm; agents listen on 0.0.0.0. The trainer runs on
host A with the coordinator and one engine; hosts B and C run two engines each. Every
process is started with the normal CLI. References are the trainer's own tensors
(digest), never another engine. Needs root; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from weightsync.apps.local_cluster import start_service
from weightsync.apps.topology import SimulatedHosts, unavailable_reason
from weightsync.engine.model import config_for_size
from weightsync.faults import ENV as FAULTS_ENV

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated hosts unavailable: {REASON}")

LAYOUT = {"a": 1, "b": 2, "c": 2}  # engines per host; the trainer and coordinator are on a
MODEL = config_for_size(32 * 2**20, 64).to_json()
ROUNDS_SCRIPT = os.path.join(os.path.dirname(__file__), "sync_rounds.py")


class Fleet:
    def __init__(self, hosts: SimulatedHosts, tmp: str, *, slow_hosts: dict[str, dict] | None = None) -> None:
        self.hosts, self.tmp = hosts, tmp
        a = hosts["a"]
        coordinator = start_service(tmp, "coordinator", "coordinator", "--insecure", "--listen", f"{a.address}:0",
                                    "--state-db", os.path.join(tmp, "state.db"), "--heartbeat-interval", "0.2",
                                    "--heartbeat-timeout", "1.5", wrap=a.command)
        a.procs.append(coordinator.proc)
        self.coordinator = coordinator.address
        for name, count in LAYOUT.items():
            host = hosts[name]
            for i in range(count):
                slow = (slow_hosts or {}).get(name)
                faults = ("--enable-fault-injection",) if slow else ()
                env = {FAULTS_ENV: json.dumps([slow])} if slow else None
                agent = start_service(tmp, f"{name}-{i}", "agent", "--insecure", "--listen", "0.0.0.0:0",
                                      "--coordinator", self.coordinator, "--engine-id", f"{name}-{i}",
                                      "--model", MODEL, *faults, env=env, wrap=host.command)
                host.procs.append(agent.proc)

    def trainer(self, *args: str) -> list[str]:
        a = self.hosts["a"]
        return [sys.executable, ROUNDS_SCRIPT, self.coordinator, a.address, "--model", MODEL, *args]

    def sync(self, *args: str, timeout_s: float = 240) -> list[dict]:
        """Runs the trainer on host A; returns its per-round lines."""
        done = self.hosts["a"].run(self.trainer(*args), timeout_s=timeout_s, capture_output=True, text=True)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, f"trainer failed: {done.stderr[-3000:]}\n{self.logs()}"
        return lines

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(".log"):
                with open(os.path.join(self.tmp, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-2000:]}")
        return "\n".join(out)


@pytest.fixture
def fleet_factory(tmp_path):
    with SimulatedHosts(list(LAYOUT)) as hosts:
        yield lambda **kwargs: Fleet(hosts, str(tmp_path), **kwargs)


@pytest.fixture
def fleet(fleet_factory):
    return fleet_factory()


def test_auto_syncs_three_hosts_with_shm_locally_and_one_network_copy_per_remote_host(fleet):
    remote = [fleet.hosts[name] for name in ("b", "c")]
    before = [h.received_bytes() for h in remote]
    lines = fleet.sync("--rounds", "3", "--transport", "auto")
    received = [h.received_bytes() - b for h, b in zip(remote, before, strict=True)]
    for line in lines:
        assert line["ok"], line
        engines = line["engines"]
        assert sorted(engines) == ["a-0", "b-0", "b-1", "c-0", "c-1"]
        assert all(e["digest_ok"] for e in engines.values()), line  # bitwise equal to the trainer's tensors
        assert engines["a-0"]["transport"] == "shm"  # on the trainer's host
        assert all(engines[e]["transport"] == "gloo" for e in ("b-0", "b-1", "c-0", "c-1")), line
    payload = sum(line["bytes"] for line in lines)
    for host, got in zip(remote, received, strict=True):
        # Two engines per remote host, one copy over the network: about 1x the payload
        # (headers and control traffic on top), not 2x.
        assert 0.95 * payload <= got <= 1.3 * payload, (host.name, got / payload)


def _wait_for_line(path: str, needle: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                if needle in f.read():
                    return
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in {path} after {timeout_s} s")


def test_cutting_a_hosts_link_mid_round_fails_that_host_promptly_and_no_other(fleet_factory, tmp_path):
    # Host B's engines take 0.3 s per bucket in round 2, so its link is cut mid-transfer.
    fleet = fleet_factory(slow_hosts={"b": {"op": "receive", "action": "delay", "seconds": 0.3, "version": 2,
                                            "times": 0}})
    out = tmp_path / "trainer.out"
    with open(out, "w") as f:
        trainer = fleet.hosts["a"].spawn(fleet.trainer("--rounds", "3", "--transport", "auto", "--timeout", "90",
                                                       "--bucket-bytes", str(2**20), "--pause-between", "6"),
                                         stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_for_line(str(out), '"round": 1', 120)
        _wait_for_line(os.path.join(fleet.tmp, "b-1.log"), "'version': 2", 60)  # round 2 reached host B
        time.sleep(1.0)
        fleet.hosts["b"].set_link(False)
        cut_at = time.monotonic()
        _wait_for_line(str(out), '"round": 2', 80)
        ended_after = time.monotonic() - cut_at
        fleet.hosts["b"].set_link(True)
        assert trainer.wait(timeout=150) == 0, out.read_text()[-3000:]
    finally:
        fleet.hosts["b"].set_link(True)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    first, cut, after = lines
    assert first["ok"], first
    engines = cut["engines"]
    assert not cut["ok"] and not engines["b-0"]["ok"] and not engines["b-1"]["ok"], cut
    for engine in ("a-0", "c-0", "c-1"):  # other hosts' engines are not torn by B's loss
        assert engines[engine]["ok"] and engines[engine]["digest_ok"], (engine, cut)
    # Promptly: keepalives notice the dead link within seconds, well inside the 90 s deadline.
    assert ended_after < 20, f"the round ended {ended_after:.1f} s after the cut\n{fleet.logs()}"
    # With the link back, the coordinator reaches B again and the next round heals it.
    assert after["ok"] and all(e["ok"] and e["digest_ok"] for e in after["engines"].values()), after
