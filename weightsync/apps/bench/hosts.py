"""``weightsync bench --hosts N``: rounds across simulated hosts, auto against gloo.

Host 1 runs the coordinator, the trainer and one engine; every other host runs
``engines_per_host`` engines (network namespaces with their own address and /dev/shm,
see ``weightsync.apps.topology``). For each transport, after a warm-up round (groups
and plans are set up once), ``rounds`` timed rounds; reported per transport: the
median round time (pause, broadcast, resume), and the bytes each host's link carried
per round as a multiple of the payload (what the trainer's host sent; what each other
host received). Every round must end with every engine bitwise equal to the trainer's
tensors, or the bench fails. Needs root.
"""

from __future__ import annotations

import json
import statistics
import string
import tempfile

from weightsync.apps.bench.runner import parse_size
from weightsync.apps.host_fleet import HostFleet
from weightsync.apps.topology import SimulatedHosts, unavailable_reason
from weightsync.engine.model import config_for_size


def run_hosts_bench(*, hosts: int, engines_per_host: int, size: str, tensors: int, rounds: int,
                    transports: list[str], json_path: str = "") -> dict:
    """Runs it; returns (and optionally writes) the report. ValueError for bad options or
    where simulated hosts cannot be made (with the reason)."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"--hosts needs simulated hosts: {reason}")
    if not 2 <= hosts <= 26 or engines_per_host < 1 or rounds < 1:
        raise ValueError("--hosts takes 2 to 26 hosts, with at least 1 engine per host and 1 round")
    names = list(string.ascii_lowercase[:hosts])
    layout = {name: (1 if i == 0 else engines_per_host) for i, name in enumerate(names)}
    model = config_for_size(parse_size(size), tensors).to_json()
    report: dict = {"hosts": layout, "size": size, "tensors": tensors, "rounds": rounds, "results": []}
    with tempfile.TemporaryDirectory(prefix="ws-bench-hosts-") as folder, SimulatedHosts(names) as sim:
        fleet = HostFleet(sim, folder, layout, model=model)
        version = 1
        for transport in transports:
            fleet.sync("--rounds", "1", "--first-version", str(version), "--transport", transport)  # warm-up
            version += 1
            sent, received = fleet.home.sent_bytes(), {n: sim[n].received_bytes() for n in names[1:]}
            lines = fleet.sync("--rounds", str(rounds), "--first-version", str(version), "--transport", transport)
            version += rounds
            bad = [line for line in lines if not line["ok"] or not all(e["digest_ok"] for e in line["engines"].values())]
            if bad:
                raise RuntimeError(f"{transport}: a round failed or left an engine unequal: {bad[0]}")
            payload = lines[0]["bytes"] * rounds
            report["results"].append({
                "transport": transport, "payload_bytes": lines[0]["bytes"],
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


def hosts_table(report: dict) -> str:
    """The report as a fixed-width table."""
    remote = list(report["hosts"])[1:]
    rows = [f"{'transport':<10} {'median s':>9} {'host a sent':>12} " + " ".join(f"{'host ' + n + ' got':>11}"
                                                                             for n in remote)]
    for r in report["results"]:
        rows.append(f"{r['transport']:<10} {r['median_s']:>9.3f} {r['trainer_host_sent_x']:>11.2f}x "
                    + " ".join(f"{r['received_x'][n]:>10.2f}x" for n in remote))
    return "\n".join(rows)


__all__ = ["run_hosts_bench", "hosts_table"]
