"""Several hosts, simulated with network namespaces (``weightsync.apps.topology``).

Each host has its own address, a hostname that resolves to loopback (as on a Debian
default install: nothing may depend on it), and its own /dev/shm; agents listen on
0.0.0.0. Host a runs the coordinator, the trainer and one engine; hosts b and c run
two engines each (``HostFleet``: every process started with the normal CLI).
References are the trainer's own tensors (digest), never another engine. Needs root;
skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from weightsync.apps.host_fleet import HostFleet
from weightsync.apps.topology import SimulatedHosts, unavailable_reason
from weightsync.apps.trainer_ranks import TrainerRanks
from weightsync.engine.model import config_for_size

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated hosts unavailable: {REASON}")

LAYOUT = {"a": 1, "b": 2, "c": 2}  # engines per host; host a also runs the coordinator and the trainer
MODEL = config_for_size(32 * 2**20, 64).to_json()


@pytest.fixture
def fleet_factory(tmp_path):
    with SimulatedHosts(list(LAYOUT)) as hosts:
        yield lambda **kwargs: HostFleet(hosts, str(tmp_path), LAYOUT, model=MODEL, **kwargs)


def test_auto_syncs_three_hosts_with_shm_locally_and_one_network_copy_per_remote_host(fleet_factory):
    fleet = fleet_factory()
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
        for host in ("b", "c"):  # the network once, to the host's relay; shm from it to both engines
            assert {engines[f"{host}-{i}"]["transport"] for i in range(2)} == {"gloo"}, line
            assert {engines[f"{host}-{i}"]["relayed_by"] for i in range(2)} == {f"{host}-0"}, line
        # Each host reports its own identity; engines on one host share it.
        host_ids = {name: {e["host_id"] for engine_id, e in engines.items() if engine_id.startswith(name)}
                    for name in LAYOUT}
        assert all(len(ids) == 1 for ids in host_ids.values()) and len(set.union(*host_ids.values())) == 3
    payload = sum(line["bytes"] for line in lines)
    for host, got in zip(remote, received, strict=True):
        # Two engines per remote host, one copy over the network: about 1x the payload
        # (headers and control traffic on top), not 2x.
        assert 0.95 * payload <= got <= 1.3 * payload, (host.name, got / payload)


def test_bench_hosts_measures_auto_against_gloo_to_every_engine(tmp_path):
    # The bench fails unless every round leaves every engine equal to the trainer's
    # tensors: plain gloo across three hosts whose hostnames resolve to 127.0.1.1 too.
    report_path = tmp_path / "hosts.json"
    done = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--hosts", "3", "--size", "16MiB",
                           "--tensors", "32", "--steps", "2", "--json", str(report_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["transport"]: r for r in json.loads(report_path.read_text())["results"]}
    assert set(results) == {"auto", "gloo"} and "host b got" in done.stdout
    for host in ("b", "c"):
        assert 0.95 <= results["auto"]["received_x"][host] <= 1.3, results["auto"]  # one copy per host
        assert 1.9 <= results["gloo"]["received_x"][host] <= 2.6, results["gloo"]   # one per engine
    assert results["auto"]["engine_transports"]["b-1"] == "gloo via b-0"


def _wait_for_text(path: str, needle: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                if needle in f.read():
                    return
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in {path} after {timeout_s} s")


def test_cutting_a_hosts_link_mid_round_fails_that_host_promptly_and_no_other(fleet_factory, tmp_path):
    # Host b's engines take 0.3 s per bucket in round 2, so its link is cut mid-transfer.
    fleet = fleet_factory(faults={"b": {"op": "receive", "action": "delay", "seconds": 0.3, "version": 2,
                                        "times": 0}})
    b = fleet.hosts["b"]
    out = tmp_path / "trainer.out"
    with open(out, "w") as f:
        trainer = fleet.spawn_trainer("--rounds", "3", "--transport", "auto", "--timeout", "90",
                                      "--bucket-bytes", str(2**20), "--pause-between", "6", stdout=f)
    try:
        _wait_for_text(str(out), '"round": 1', 120)
        _wait_for_text(os.path.join(fleet.folder, "b-1.log"), "'version': 2", 60)  # round 2 reached host b
        time.sleep(1.0)
        b.set_link(False)
        cut_at = time.monotonic()
        _wait_for_text(str(out), '"round": 2', 80)
        ended_after = time.monotonic() - cut_at
        b.set_link(True)
        assert trainer.wait(timeout=150) == 0, out.read_text()[-3000:]
    finally:
        b.set_link(True)
    first, cut, after = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert first["ok"], first
    engines = cut["engines"]
    assert not cut["ok"] and not engines["b-0"]["ok"] and not engines["b-1"]["ok"], cut
    for engine in ("a-0", "c-0", "c-1"):  # other hosts' engines are not torn by b's loss
        assert engines[engine]["ok"] and engines[engine]["digest_ok"], (engine, cut)
    # Promptly: the heartbeat timeout (1.5 s here) fails b's engines, and the resume of
    # the engines b cannot be told about is bounded by keepalive, far inside the 90 s deadline.
    assert ended_after < 20, f"the round ended {ended_after:.1f} s after the cut\n{fleet.logs()}"
    # With the link back, the coordinator reaches b again and the next round heals it.
    assert after["ok"] and all(e["ok"] and e["digest_ok"] for e in after["engines"].values()), after


def test_a_relay_killed_mid_round_fails_its_hosts_engines_promptly_and_no_other(fleet_factory, tmp_path):
    # b-0 relays host b's copy to b-1 over shm; host b's engines take 0.3 s per bucket
    # in round 2; b-0's agent is killed mid-transfer. b-1 must not wait for bytes that
    # will never come until the 90 s deadline: the trainer tells it when b-0's lane stops.
    fleet = fleet_factory(faults={"b": {"op": "receive", "action": "delay", "seconds": 0.3, "version": 2,
                                        "times": 0}})
    out = tmp_path / "trainer.out"
    with open(out, "w") as f:
        trainer = fleet.spawn_trainer("--rounds", "2", "--transport", "auto", "--timeout", "90",
                                      "--bucket-bytes", str(2**20), stdout=f)
    _wait_for_text(str(out), '"round": 1', 120)
    _wait_for_text(os.path.join(fleet.folder, "b-1.log"), "'version': 2", 60)
    time.sleep(1.0)
    relay = next(p for p in fleet.hosts["b"].procs if "b-0" in " ".join(map(str, p.args)))
    relay.kill()
    killed_at = time.monotonic()
    _wait_for_text(str(out), '"round": 2', 80)
    ended_after = time.monotonic() - killed_at
    assert trainer.wait(timeout=60) == 0, out.read_text()[-3000:]
    _, killed = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    engines = killed["engines"]
    assert not killed["ok"] and not engines["b-0"]["ok"] and not engines["b-1"]["ok"], killed
    for engine in ("a-0", "c-0", "c-1"):
        assert engines[engine]["ok"] and engines[engine]["digest_ok"], (engine, killed)
    assert ended_after < 20, f"the round ended {ended_after:.1f} s after the relay died\n{fleet.logs()}"
    with open(os.path.join(fleet.folder, "b-1.log")) as f:
        assert "transfer_failed" in f.read()  # b-1's receive ended (torn), not still waiting


def test_a_sharded_trainers_ranks_on_two_hosts_each_send_from_their_own_host_and_gather_for_one_sender(tmp_path):
    """FSDP2 over two ranks on two hosts: rank 0 on host a (with the coordinator and
    engine a-0), rank 1 on host b (with engine b-0), each rank started with its host's
    address. ``auto`` is gloo (the ranks share no host), and each rank sends its own
    half of every tensor from its own host: host b's link carries rank 1's half out (to
    a-0) and rank 0's half in (to b-0), half the payload each way a round. Then the
    gathering client (``group``, one sender): rank 1's half goes to rank 0 over gloo,
    and rank 0 sends the full tensors, so host b's link carries half the payload out
    and the whole payload in. After every round both engines equal the trainer's full
    model as torch gathers it for the check, whose all-gather adds half the payload
    each way to host b's link."""
    layout = {"a": 1, "b": 1}
    model = config_for_size(8 * 2**20, 24).to_json()
    # The trainer's own process group: gloo finds its address from the hostname, which
    # means loopback on these hosts, unless told the interface (as on such real hosts).
    trainer_gloo = {"GLOO_SOCKET_IFNAME": "eth0"}
    with SimulatedHosts(list(layout)) as hosts:
        fleet = HostFleet(hosts, str(tmp_path), layout, model=model)
        b = hosts["b"]
        common = ["--model", model, "--timeout", "60", "--rounds", "2", "--check-digests"]
        check = 0.5  # the trainer's all-gather for the check: each rank sends the other its half
        for transport, first, out_per_round, in_per_round in (("auto", 1, 0.5 + check, 0.5 + check),
                                                              ("group", 3, 0.5 + check, 1.0 + check)):
            sent, received = b.sent_bytes(), b.received_bytes()
            with TrainerRanks(str(tmp_path / transport), fleet.coordinator, 2,
                              [*common, "--transport", transport, "--first-version", str(first)],
                              hosts=[hosts["a"], b], env=trainer_gloo) as ranks:
                assert ranks.wait(90) == [0, 0], ranks.tail() + fleet.logs()
                lines = [ranks.rounds(0)[v] for v in (first, first + 1)]
            assert all(line["ok"] and line["digest_ok"] for line in lines), (transport, lines)
            payload = lines[0]["bytes"]
            out, into = (b.sent_bytes() - sent) / payload / 2, (b.received_bytes() - received) / payload / 2
            # per round, in payloads (headers and control traffic on top)
            assert out_per_round * 0.95 <= out <= out_per_round * 1.3, (transport, out, into)
            assert in_per_round * 0.95 <= into <= in_per_round * 1.3, (transport, out, into)
