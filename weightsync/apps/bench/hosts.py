"""``weightsync bench --hosts N``: rounds across simulated hosts, auto against gloo.

Host 1 runs the coordinator, the trainer and one engine; every other host runs
``engines_per_host`` engines (network namespaces with their own address and /dev/shm,
see ``weightsync.apps.topology``). For each transport, after a warm-up round (groups
and plans are set up once), ``rounds`` timed rounds; reported per transport: the
median round time (pause, broadcast, resume), and the bytes each host's link carried
per round as a multiple of the payload (what the trainer's host sent; what each other
host received). Every round must end with every engine bitwise equal to the trainer's
tensors, or the bench fails. Needs root.

``trainer_ranks`` (``--hosts N --trainer-ranks R``): the trainer is a sharded one, R
ranks on host a (FSDP2, or ``trainer_parallel``; ``weightsync.apps.bench.sharded_trainer``,
one job per transport, which waits after its warm-up round while the links' counters
are read), and every transport is measured twice: every rank sending its own shards,
and gathered into rank 0 first (``DistributedTrainerClient(gather=True)``), which
sends as one trainer does. The check is then the digest of the trainer's full model
(gathered for it, not timed).
"""

from __future__ import annotations

import json
import os
import statistics
import string
import tempfile
from collections.abc import Callable

from weightsync.apps.bench.runner import parse_size
from weightsync.apps.host_fleet import HostFleet
from weightsync.apps.topology import SimulatedHosts, unavailable_reason
from weightsync.apps.trainer_ranks import TrainerRanks
from weightsync.engine.model import config_for_size


def run_hosts_bench(*, hosts: int, engines_per_host: int, size: str, tensors: int, rounds: int,
                    transports: list[str], json_path: str = "", trainer_ranks: int = 0,
                    trainer_parallel: str = "fsdp", shape_profile: str = "dense") -> dict:
    """Runs it; returns (and optionally writes) the report. ValueError for bad options or
    where simulated hosts cannot be made (with the reason)."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"--hosts needs simulated hosts: {reason}")
    if not 2 <= hosts <= 26 or engines_per_host < 1 or rounds < 1:
        raise ValueError("--hosts takes 2 to 26 hosts, with at least 1 engine per host and 1 round")
    if trainer_ranks == 1 or trainer_ranks < 0:
        raise ValueError("--trainer-ranks takes 2 ranks or more")
    if trainer_ranks and set(transports) - {"auto", "gloo", "shm", "group"}:
        raise ValueError("a sharded trainer sends over auto, gloo, shm or group")
    names = list(string.ascii_lowercase[:hosts])
    layout = {name: (1 if i == 0 else engines_per_host) for i, name in enumerate(names)}
    model = config_for_size(parse_size(size), tensors, profile=shape_profile).to_json()
    report: dict = {"hosts": layout, "size": size, "tensors": tensors, "shape_profile": shape_profile,
                    "model": json.loads(model), "rounds": rounds,
                    "trainer_ranks": trainer_ranks, "results": []}
    with tempfile.TemporaryDirectory(prefix="ws-bench-hosts-") as folder, SimulatedHosts(names) as sim:
        fleet = HostFleet(sim, folder, layout, model=model)

        def link_counts() -> tuple[int, dict[str, int]]:  # what host a sent, what each other host received
            return fleet.home.sent_bytes(), {n: sim[n].received_bytes() for n in names[1:]}

        version = 1
        for name, transport, gathered in _variants(transports, sharded=bool(trainer_ranks)):
            if trainer_ranks:  # one job: its warm-up round, then the counted ones
                (sent, received), lines = _sync_ranks(
                    fleet, folder, trainer_ranks, model, rounds, version, link_counts, "--transport", transport,
                    "--parallel", trainer_parallel, *(["--gather"] if gathered else []))
            else:
                fleet.sync("--transport", transport, "--rounds", "1", "--first-version", str(version))  # warm-up
                sent, received = link_counts()
                lines = fleet.sync("--transport", transport, "--rounds", str(rounds), "--first-version",
                                   str(version + 1))
            version += rounds + 1
            bad = [line for line in lines if not line["ok"] or not all(e["digest_ok"] for e in line["engines"].values())]
            if bad:
                raise RuntimeError(f"{name}: a round failed or left an engine unequal: {bad[0]}")
            payload = lines[0]["bytes"] * rounds
            report["results"].append({
                "transport": name, "payload_bytes": lines[0]["bytes"],
                "median_s": statistics.median(line["seconds"] for line in lines),
                "trainer_host_sent_x": (fleet.home.sent_bytes() - sent) / payload,
                "received_x": {n: (sim[n].received_bytes() - received[n]) / payload for n in names[1:]},
                "engine_transports": {e: f"{o['transport']}" + (f" via {o['relayed_by']}" if o["relayed_by"] else "")
                                      for e, o in sorted(lines[-1]["engines"].items())},
            })
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _variants(transports: list[str], *, sharded: bool) -> list[tuple[str, str, bool]]:
    """(row name, transport, gathered into rank 0) for each row: a single trainer's
    transports once; a sharded trainer's each sharded and gathered, but ``group``
    once (it always gathers: it has one sender)."""
    rows = []
    for transport in transports:
        if sharded and transport != "group":
            rows.append((transport, transport, False))
            rows.append((transport + " gathered", transport, True))
        else:
            rows.append((transport, transport, sharded))
    return rows


def _sync_ranks(fleet: HostFleet, folder: str, world: int, model: str, rounds: int, first: int,
                link_counts: Callable[[], tuple], *args: str) -> tuple[tuple, list[dict]]:
    """A sharded trainer's ranks on the home host: a warm-up round (version ``first``),
    then ``link_counts()`` while the ranks wait, then ``rounds`` rounds. Returns those
    counts and rank 0's lines of the counted rounds, each engine's ``digest_ok`` that of
    the trainer's full model (its check runs on the home host, between rounds).
    RuntimeError (with the ranks' output and the fleet's logs) if a rank fails, the
    warm-up round fails, or the deadline passes."""
    out = tempfile.mkdtemp(prefix="ranks-", dir=folder)
    go = os.path.join(out, "go")
    os.makedirs(go)
    # The ranks' own process group finds its address from the hostname, which means
    # loopback on a simulated host, unless told the interface.
    with TrainerRanks(out, fleet.coordinator, world,
                      ["--model", model, "--check-digests", "--timeout", "300", "--rounds", str(rounds + 1),
                       "--first-version", str(first), "--go", go, *args],
                      hosts=[fleet.home] * world, env={"GLOO_SOCKET_IFNAME": "eth0"}) as ranks:
        try:
            warm_up = ranks.wait_for(0, lambda line: line.get("round") == first, 600)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{fleet.logs()}") from None
        if not warm_up["ok"]:
            raise RuntimeError(f"the warm-up round failed: {warm_up}\n{ranks.tail()}\n{fleet.logs()}")
        counts = link_counts()
        for version in range(first + 1, first + rounds + 1):
            with open(os.path.join(go, f"go-{version}"), "w") as f:
                f.write("go")  # wait_for_file waits for content
        codes = ranks.wait(600)
        if codes != [0] * world:
            raise RuntimeError(f"trainer ranks ended {codes}:\n{ranks.tail()}\n{fleet.logs()}")
        lines = sorted((line for line in ranks.rounds(0).values() if line["round"] > first),
                       key=lambda line: line["round"])
    for line in lines:
        line["engines"] = {e: {**o, "digest_ok": line["digest_ok"]} for e, o in line.get("engines", {}).items()}
    return counts, lines


def hosts_table(report: dict) -> str:
    """The report as a fixed-width table."""
    remote = list(report["hosts"])[1:]
    rows = [f"{'transport':<14} {'median s':>9} {'host a sent':>12} " + " ".join(f"{'host ' + n + ' got':>11}"
                                                                             for n in remote)]
    for r in report["results"]:
        rows.append(f"{r['transport']:<14} {r['median_s']:>9.3f} {r['trainer_host_sent_x']:>11.2f}x "
                    + " ".join(f"{r['received_x'][n]:>10.2f}x" for n in remote))
    return "\n".join(rows)


__all__ = ["run_hosts_bench", "hosts_table"]
