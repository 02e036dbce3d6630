"""How long a coordinator and an agent take to start serving, and the memory each holds.

Starts each server --repeat times, one at a time, with the command line a user runs
(``weightsync coordinator`` / ``weightsync agent`` with the reference engine's tiny
model), and measures from spawn to its port file (the coordinator writes it once it
serves, an agent once it has registered), then the process's resident memory (RSS)
after a second of idling, and whether torch's library is mapped into it. Prints the
medians as JSON.

    python benchmarks/startup.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.apps.local_cluster import spawn_service  # noqa: E402
from weightsync.lifecycle import stop_process  # noqa: E402


def torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch" in line for line in maps)


def measure(tmp: str, name: str, command: str, *args: str) -> dict:
    started = time.monotonic()
    service = spawn_service(tmp, name, command, *args, log_level="WARNING")
    try:
        address = service.wait(120).address
        serving_s = time.monotonic() - started
        time.sleep(1.0)
        rss = psutil.Process(service.proc.pid).memory_info().rss
        return {"address": address, "serving_s": serving_s, "rss_mib": rss / 2**20,
                "torch_loaded": torch_loaded(service.proc.pid)}
    finally:
        stop_process(service.proc, grace_s=10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"coordinator": [], "agent": []}
    with tempfile.TemporaryDirectory(prefix="weightsync-startup-") as tmp:
        # One coordinator for the agents to register with, measured separately.
        hub = spawn_service(tmp, "hub", "coordinator", "--insecure", "--listen", "127.0.0.1:0",
                            "--state-db", f"{tmp}/hub.db", log_level="WARNING")
        try:
            hub_address = hub.wait(120).address
            for i in range(args.repeat):
                runs["coordinator"].append(measure(tmp, f"coordinator-{i}", "coordinator", "--insecure", "--listen",
                                                   "127.0.0.1:0", "--state-db", f"{tmp}/c{i}.db"))
                runs["agent"].append(measure(tmp, f"agent-{i}", "agent", "--insecure", "--coordinator", hub_address,
                                             "--engine-id", f"engine-{i}"))
        finally:
            stop_process(hub.proc, grace_s=10.0)
    report = {role: {"serving_s_median": round(statistics.median(r["serving_s"] for r in rs), 3),
                     "rss_mib_median": round(statistics.median(r["rss_mib"] for r in rs), 1),
                     "torch_loaded": sorted({r["torch_loaded"] for r in rs}), "repeat": len(rs)}
              for role, rs in runs.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
