"""``weightsync bench --trainer-ranks N``: a sharded trainer's round, every rank sending
its own shards, against all-gather to rank 0 then one sender, in one run.

A coordinator and ``engines`` reference engines (agent processes); the trainer is N
FSDP2 ranks (``parallel="tp"``: tensor parallel, its row-wise layers' weights sliced
along dimension 1; ``"hsdp"``: FSDP2 over two replica groups; ``"fsdp-tp"``: FSDP2 over
tensor parallel, row-wise weights in blocks of rows and columns) over gloo (``weightsync.apps.bench.sharded_trainer``, started as
torchrun starts ranks). For each mode, one warm-up round (groups and plans are set up once),
then ``rounds`` timed rounds; reported: the median round time on rank 0 (pause,
broadcast, resume; for ``gather`` the all-gather too, also reported on its own; for
``sharded`` the transfer alone too: at 20k tensors much of a round is outside it) and
gather / sharded. The last
round of each mode must leave every engine bitwise equal to the trainer's full state
dict, or the bench fails.
"""

from __future__ import annotations

import json
import statistics
import tempfile

from weightsync.apps.bench.runner import parse_size
from weightsync.apps.local_cluster import LocalCluster
from weightsync.apps.trainer_ranks import TrainerRanks
from weightsync.engine.model import config_for_size

MODES = ("sharded", "gather")
PARALLEL = ("fsdp", "hsdp", "tp", "fsdp-tp")  # the layouts the bench measures (sharded_trainer --parallel)


def run_sharded_bench(*, ranks: int, engines: int, size: str, tensors: int, rounds: int, transport: str,
                      bucket_bytes: int, json_path: str = "", timeout_s: float = 600.0,
                      baselines: bool = True, parallel: str = "fsdp", shape_profile: str = "dense") -> dict:
    """Runs it; returns (and optionally writes) the report. ValueError for bad options.
    ``baselines``: also the all-gather to rank 0 (``gather``), one collective per
    parameter, which at tens of thousands of tensors takes 20-30 s a round here."""
    if not 2 <= ranks <= 64 or engines < 1 or rounds < 1:
        raise ValueError("--trainer-ranks takes 2 to 64 ranks, with at least 1 engine and 1 round")
    if transport not in ("auto", "gloo", "shm", "group"):
        raise ValueError("--trainer-ranks measures auto, gloo, shm or group (gathered into rank 0, which sends)")
    if parallel not in PARALLEL:
        raise ValueError(f"--trainer-parallel is one of {', '.join(PARALLEL)}")
    if parallel == "hsdp" and ranks % 2:
        raise ValueError("--trainer-parallel hsdp takes an even number of ranks (two replica groups)")
    if parallel == "fsdp-tp" and (ranks % 2 or ranks < 4):
        raise ValueError("--trainer-parallel fsdp-tp takes an even number of ranks, 4 or more (pairs of "
                         "tensor-parallel ranks)")
    model = config_for_size(parse_size(size), tensors, profile=shape_profile).to_json()
    report: dict = {"trainer_ranks": ranks, "engines": engines, "size": size, "tensors": tensors,
                    "shape_profile": shape_profile, "model": json.loads(model), "rounds": rounds,
                    "transport": transport, "parallel": parallel, "results": []}
    with tempfile.TemporaryDirectory(prefix="ws-bench-ranks-") as folder, \
            LocalCluster(folder, engines=engines, agent_args=("--model", model), agent_timeout_s=timeout_s) as cluster:
        version = 1
        for mode in MODES if baselines else MODES[:1]:
            args = ["--model", model, "--mode", mode, "--rounds", str(rounds + 1), "--first-version", str(version),
                    "--transport", transport, "--bucket-bytes", str(bucket_bytes), "--timeout", str(timeout_s),
                    "--check-digests-last", "--parallel", parallel]
            with TrainerRanks(f"{folder}/{mode}", cluster.address, ranks, args) as job:
                codes = job.wait(timeout_s * (rounds + 2))
                if codes != [0] * ranks:
                    raise RuntimeError(f"{mode}: a rank failed (exit codes {codes}):\n{job.tail()}")
                lines = [job.rounds(0)[v] for v in range(version, version + rounds + 1)]
            bad = [line for line in lines if not line["ok"]]
            if bad or lines[-1]["digest_ok"] is not True:
                raise RuntimeError(f"{mode}: a round failed or left an engine unequal: {(bad or lines)[-1]}")
            timed = lines[1:]  # the first round sets up groups and plans
            report["results"].append({"mode": mode, "payload_bytes": lines[0]["bytes"],
                                      "median_s": statistics.median(line["seconds"] for line in timed),
                                      "median_gather_s": statistics.median(line.get("gather_s", 0.0)
                                                                           for line in timed),
                                      # the data plane alone (sharded: rank 0's lanes, first part packed
                                      # to last acknowledged); the rest is planning, control calls and
                                      # each rank's pass over its tensors
                                      "median_transfer_s": (statistics.median(line["phases_s"]["transfer"]
                                                                              for line in timed)
                                                            if all("phases_s" in line for line in timed) else None),
                                      "rounds_s": [line["seconds"] for line in timed]})
            version += rounds + 1
    by_mode = {r["mode"]: r["median_s"] for r in report["results"]}
    if "gather" in by_mode:
        report["gather_over_sharded"] = by_mode["gather"] / by_mode["sharded"]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def sharded_table(report: dict) -> str:
    """The report as a fixed-width table and the ratio."""
    rows = [f"{'mode':<8} {'median s':>9} {'of which gather':>16} {'transfer':>9} {'GB/s':>7}"]
    for r in report["results"]:
        transfer = "-" if r.get("median_transfer_s") is None else f"{r['median_transfer_s']:.3f}"
        rows.append(f"{r['mode']:<8} {r['median_s']:>9.3f} {r['median_gather_s']:>16.3f} {transfer:>9} "
                    f"{r['payload_bytes'] / r['median_s'] / 1e9:>7.2f}")
    if "gather_over_sharded" in report:
        rows.append(f"gather / sharded: {report['gather_over_sharded']:.2f}x ({report['trainer_ranks']} ranks, "
                    f"{report['engines']} engines, {report['transport']}, {report.get('parallel', 'fsdp')})")
    return "\n".join(rows)


__all__ = ["run_sharded_bench", "sharded_table"]
