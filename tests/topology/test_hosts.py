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


def test_bench_hosts_with_a_sharded_trainer_measures_its_ranks_sharded_and_gathered_into_rank_0(tmp_path):
    """Two FSDP2 ranks on host a, two engines on host b. Sharded ``auto``, every rank's
    half crosses b's link once, to b's relay, which re-shares it over b's shm (the whole
    payload once); sharded ``gloo``, once per engine there (twice); gathered into rank 0
    (``gather=True``), rank 0's round is one trainer's: the whole payload once, to b's
    relay. The bench fails unless every round leaves every engine equal to the digest
    of the trainer's full model."""
    report_path = tmp_path / "hosts.json"
    done = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--hosts", "2", "--trainer-ranks", "2",
                           "--size", "8MiB", "--tensors", "24", "--steps", "1", "--transport", "auto",
                           "--transport", "gloo", "--json", str(report_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["transport"]: r for r in json.loads(report_path.read_text())["results"]}
    assert set(results) == {"auto", "auto gathered", "gloo", "gloo gathered"}, done.stdout
    assert "auto gathered" in done.stdout, done.stdout
    assert 0.95 <= results["auto"]["received_x"]["b"] <= 1.3, results["auto"]  # each half once, to the relay
    assert results["auto"]["engine_transports"]["b-1"] == "gloo via b-0", results["auto"]
    assert results["auto"]["engine_transports"]["a-0"] == "shm", results["auto"]
    assert 1.9 <= results["gloo"]["received_x"]["b"] <= 2.6, results["gloo"]  # each half, to each engine
    assert results["gloo"]["engine_transports"]["b-1"] == "gloo", results["gloo"]
    gathered = results["auto gathered"]
    assert 0.95 <= gathered["received_x"]["b"] <= 1.3, gathered  # one copy, to the relay
    assert gathered["engine_transports"]["a-0"] == "shm" and gathered["engine_transports"]["b-1"] == "gloo via b-0", gathered


def test_what_a_killed_process_left_of_its_hosts_goes_when_the_next_hosts_are_made():
    """A SimulatedHosts whose process is SIGKILLed (a test's timeout) cannot remove its
    namespaces, bridge, /dev/shm mounts and folder; the next SimulatedHosts does, as
    its folder names an owner that is gone. A live owner's are left alone."""
    made = ("import sys, time\nfrom weightsync.apps.topology import SimulatedHosts\n"
            "hosts = SimulatedHosts(['x']).__enter__()\nprint(hosts.tag, hosts.dir, flush=True)\ntime.sleep(120)")

    def start():
        proc = subprocess.Popen([sys.executable, "-c", made], stdout=subprocess.PIPE, text=True)
        tag, folder = proc.stdout.readline().split()
        return proc, tag, folder

    def left(tag: str, folder: str) -> list[str]:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        with open("/proc/mounts") as f:
            mounts = [line for line in f if f" {folder}/" in line]
        return ([f"ws{tag}-x"] if f"ws{tag}-x" in namespaces else []) + mounts + (
            [folder] if os.path.exists(folder) else []) + (
            [f"wsbr{tag}"] if os.path.exists(f"/sys/class/net/wsbr{tag}") else [])

    killed, killed_tag, killed_folder = start()
    running, running_tag, running_folder = start()
    try:
        killed.kill()
        killed.wait(10)
        assert len(left(killed_tag, killed_folder)) == 4  # its namespace, mount, folder and bridge
        with SimulatedHosts(["y"]):
            assert left(killed_tag, killed_folder) == []
            assert len(left(running_tag, running_folder)) == 4
    finally:
        running.terminate()  # SIGTERM's default: it dies without closing, as killed did
        running.wait(10)
        with SimulatedHosts(["z"]):
            pass
    assert left(running_tag, running_folder) == []


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


def test_a_sharded_trainers_ranks_on_one_host_send_each_part_once_to_every_other_host(fleet_factory, tmp_path):
    """Two FSDP2 ranks on host a (engine a-0), two engines on each of hosts b and c,
    ``auto``: every rank sends its own parts on lanes laid out as one trainer's, shm to
    a-0 and gloo to each other host's relay (b-0, c-0), which re-shares them over its
    host's shm. Each host's link carries the payload once a round (each rank's half
    once), not once per engine there, and every engine equals the trainer's full model
    (its digest, as torch gathers it on host a: no link bytes)."""
    fleet = fleet_factory()
    remote = [fleet.hosts[name] for name in ("b", "c")]
    a = fleet.hosts["a"]
    with TrainerRanks(str(tmp_path / "warm-up"), fleet.coordinator, 2,
                      ["--model", MODEL, "--rounds", "1", "--transport", "auto"], hosts=[a, a]) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail() + fleet.logs()  # plans and groups set up once
    before = [h.received_bytes() for h in remote]
    with TrainerRanks(str(tmp_path / "ranks"), fleet.coordinator, 2,
                      ["--model", MODEL, "--rounds", "2", "--first-version", "2", "--transport", "auto",
                       "--check-digests"], hosts=[a, a]) as ranks:
        assert ranks.wait(120) == [0, 0], ranks.tail() + fleet.logs()
        lines = [ranks.rounds(0)[v] for v in (2, 3)]
    received = [h.received_bytes() - b for h, b in zip(remote, before, strict=True)]
    for line in lines:
        assert line["ok"] and line["digest_ok"], line
        engines = line["engines"]
        assert engines["a-0"] == {"transport": "shm", "relayed_by": "", "ok": True}, line
        for host in ("b", "c"):
            for i in range(2):
                assert engines[f"{host}-{i}"] == {"transport": "gloo", "relayed_by": f"{host}-0", "ok": True}, line
    payload = sum(line["bytes"] for line in lines)
    for host, got in zip(remote, received, strict=True):
        assert 0.95 * payload <= got <= 1.3 * payload, (host.name, got / payload)


@pytest.mark.parametrize("ranks_on", ["a,a", "a,b"])
def test_a_relay_killed_mid_round_of_a_sharded_trainer_fails_its_hosts_engines_promptly_and_no_other(
        fleet_factory, tmp_path, ranks_on):
    """As above, with host b's engines taking 0.3 s per bucket in round 2 and b-0's
    agent killed mid-transfer: b-0 and b-1 fail (torn, b-1 not left waiting for its
    deadline), a-0, c-0 and c-1 end equal to the trainer's model, and both ranks return
    the same failed result within seconds. Ranks on a and a: b-0 is b's relay for both
    ranks' lanes. Ranks on a and b: b-0 relays rank 0's lane, and rank 1 on b itself
    reads into b-0 and b-1 over shm, while its lanes to a-0 and c's relay go on."""
    fleet = fleet_factory(faults={"b": {"op": "receive", "action": "delay", "seconds": 0.3, "version": 2,
                                        "times": 0}})
    hosts = [fleet.hosts[name] for name in ranks_on.split(",")]
    with TrainerRanks(str(tmp_path / "ranks"), fleet.coordinator, 2,
                      ["--model", MODEL, "--rounds", "2", "--transport", "auto", "--timeout", "90",
                       "--bucket-bytes", str(2**20), "--check-digests", "--verify-digest"], hosts=hosts,
                      env={"GLOO_SOCKET_IFNAME": "eth0"}) as ranks:
        first = ranks.wait_for(0, lambda line: line.get("round") == 1, 120)
        assert first["ok"] and first["digest_ok"], ranks.tail()
        _wait_for_text(os.path.join(fleet.folder, "b-1.log"), "'version': 2", 60)
        time.sleep(1.0)
        relay = next(p for p in fleet.hosts["b"].procs if "b-0" in " ".join(map(str, p.args)))
        relay.kill()
        killed_at = time.monotonic()
        assert ranks.wait(80) == [0, 0], ranks.tail() + fleet.logs()
        killed = [ranks.rounds(r)[2] for r in (0, 1)]
    ended_after = max(line["ended"] for line in killed) - (time.time() - (time.monotonic() - killed_at))
    assert killed[0]["engines"] == killed[1]["engines"], killed  # every rank returns the same result
    engines = killed[0]["engines"]
    for line in killed:
        assert not line["ok"] and line["error_type"] == "SyncFailed", line
    assert not engines["b-0"]["ok"] and not engines["b-1"]["ok"], engines
    # The others took the round, their parts' digest checked against the ranks' own
    # hashes of what they hold (--verify-digest) before they committed it.
    for engine in ("a-0", "c-0", "c-1"):
        assert engines[engine]["ok"], (engine, engines)
    assert ended_after < 20, f"the round ended {ended_after:.1f} s after the relay died\n{fleet.logs()}"
    with open(os.path.join(fleet.folder, "b-1.log")) as f:
        assert "transfer_failed" in f.read()  # b-1's receive ended (torn), not still waiting


def test_a_sharded_trainers_ranks_on_two_hosts_each_send_from_their_own_host_and_gather_for_one_sender(tmp_path):
    """FSDP2 over two ranks; host a runs the coordinator and engine a-0, host b engines
    b-0 and b-1. One round each; host b's link bytes, in payloads:

    - ranks on a and b (each started with its host's address), ``auto``: each rank's
      lanes are laid out from its own host. Rank 0 (on a): shm to a-0 and gloo to b's
      relay b-0, which re-shares over b's shm; rank 1 (on b): shm to b-0 and b-1, gloo
      to a-0. So rank 0's half comes into b once (not once per engine there) and rank
      1's half goes out once;
    - the same ranks, ``group`` (one sender): rank 1's half goes to rank 0 over gloo
      and rank 0 sends the full tensors into the group, once for each of b's engines
      (gloo's broadcast is a binomial tree over sender, a-0, b-0, b-1: the sender sends
      to a-0 and b-0, and a-0 forwards to b-1).

    After each round all engines equal the trainer's full model as torch gathers it
    for the check, whose all-gather adds half the payload each way to b's link. (Both
    ranks on host a, sharded and gathered into rank 0: the bench test above.)"""
    layout = {"a": 1, "b": 2}
    model = config_for_size(8 * 2**20, 24).to_json()
    # The trainer's own process group: gloo finds its address from the hostname, which
    # means loopback on these hosts, unless told the interface (as on such real hosts).
    trainer_gloo = {"GLOO_SOCKET_IFNAME": "eth0"}
    with SimulatedHosts(list(layout)) as hosts:
        fleet = HostFleet(hosts, str(tmp_path), layout, model=model)
        a, b = hosts["a"], hosts["b"]
        common = ["--model", model, "--timeout", "60", "--rounds", "1", "--check-digests"]
        check = 0.5  # the trainer's all-gather for the check, with a rank on b: each rank sends the other its half
        for i, (name, ranks_on, args, out_per_round, in_per_round) in enumerate((
                ("two hosts, auto", [a, b], ["--transport", "auto"], 0.5 + check, 0.5 + check),
                ("two hosts, group", [a, b], ["--transport", "group"], 0.5 + check, 2 * 1.0 + check))):
            first = 1 + i
            sent, received = b.sent_bytes(), b.received_bytes()
            with TrainerRanks(str(tmp_path / name.replace(" ", "-").replace(",", "")), fleet.coordinator, 2,
                              [*common, *args, "--first-version", str(first)],
                              hosts=ranks_on, env=trainer_gloo) as ranks:
                assert ranks.wait(90) == [0, 0], ranks.tail() + fleet.logs()
                line = ranks.rounds(0)[first]
            assert line["ok"] and line["digest_ok"], (name, line)
            payload = line["bytes"]
            out, into = (b.sent_bytes() - sent) / payload, (b.received_bytes() - received) / payload
            # in payloads (headers and control traffic on top)
            assert out_per_round * 0.95 <= out <= out_per_round * 1.3 + 0.05, (name, out, into)
            assert in_per_round * 0.95 <= into <= in_per_round * 1.3 + 0.05, (name, out, into)
            if name == "two hosts, auto":
                # Each engine reports its lane of rank 0; the coordinator's log names every lane.
                engines = line["engines"]
                assert engines["a-0"] == {"transport": "shm", "relayed_by": "", "ok": True}, line
                for e in ("b-0", "b-1"):
                    assert engines[e] == {"transport": "gloo", "relayed_by": "b-0", "ok": True}, line
                assert _lanes_of_last_round(fleet.folder) == {
                    "shm/sender0:a-0", "gloo@b/sender0:b-0,b-1", "shm@b/sender0:b-0,b-1",
                    "shm/sender1:b-0,b-1", "gloo@a/sender1:a-0"}, fleet.logs()


def _lanes_of_last_round(folder: str) -> set[str]:
    """The lanes of the coordinator's last broadcast, as ``name:engines``, each host id
    in a name written as the name of the host whose engines the lane holds."""
    with open(os.path.join(folder, "coordinator.log")) as f:
        started = [line for line in f if "broadcast_started" in line]
    lanes = started[-1].split("'lanes': '")[1].split("'")[0].split(";")
    named = set()
    for lane in lanes:
        name, engines = lane.split(":")
        if "@" in name:
            kind, rest = name.split("@", 1)
            name = f"{kind}@{engines.split(',')[0].split('-')[0]}/{rest.split('/', 1)[1]}"
        named.add(f"{name}:{engines}")
    return named
