"""``weightsync bench`` runs the real stack and every baseline, and reports as documented.
(Its numbers are measured, never asserted: performance is the benchmark's job.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from weightsync.apps.bench import cpu as cpu_module
from weightsync.apps.bench import returned_memory
from weightsync.apps.bench.baselines import Baselines
from weightsync.apps.bench.count_sweep import sweep_counts, sweep_lines
from weightsync.apps.bench.cpu import CpuMeter, machine_steal_s
from weightsync.apps.bench.returned_memory import returned_kib, settle
from weightsync.apps.bench.runner import (
    _worst_where_nothing_stolen,
    bar_figure,
    check_engines_hold,
    how_much,
    parse_size,
)
from weightsync.client import TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.packing import weights_digest
from weightsync.transport.cross_memory import hugepage_advice

METHODS = {"weightsync", "per-tensor-gloo", "flat-gloo", "disk", "grpc-stream", "memcpy"}


def test_parse_size():
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1.5KiB") == 1536
    assert parse_size("1000") == 1000
    for bad in ("0", "-1MiB", "lots", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_bench_small_run_reports_every_method(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--size", "4MiB", "--tensors", "12",
                           "--engines", "2", "--steps", "1", "--bucket-bytes", "1MiB", "--json", str(out),
                           "--plot", str(png), "--attest", "--transport", "gloo", "--transport", "shm",
                           "--transport", "shm-ring"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert {"platform", "cpus", "torch"} <= set(report["machine"])
    # Before the weightsync transports and before the baselines, the default wait for
    # the machine to stop handing freed memory back (where the kernel counts it).
    counted = returned_kib()
    assert report["config"]["settle_s"] == returned_memory.QUIET_S
    if counted is None:
        assert report["settles"] == []
    else:
        assert [(s["phase"], s["pass"]) for s in report["settles"]] == [("weightsync", 0), ("baselines", 0)]
        for seen in report["settles"]:
            assert seen["seconds"] >= returned_memory.QUIET_S or not seen["quiet"], seen
            assert seen["returned_mib"] >= 0 and seen["tensors"] == report["results"][0]["tensors"]
    results = report["results"]
    assert {r["method"] for r in results} == METHODS | {"weightsync+attest"}
    assert {r["transport"] for r in results if r["method"] == "weightsync"} == {"gloo", "shm", "shm-ring"}
    assert {r["transport"] for r in results if r["method"] == "weightsync+attest"} == {"gloo", "shm", "shm-ring"}
    # How the engines got their bytes: shm straight between the trainer's memory and
    # theirs (same user, here; the bench's trainer is on small pages unless the machine
    # puts every allocation on huge pages: then it writes into the engines' arenas),
    # shm-ring through the shared-memory ring; gloo does not say.
    pushed = "push" if hugepage_advice() is not None else "direct"
    assert {r["transport"]: r["read"] for r in results if r["method"] == "weightsync"} == {
        "gloo": None, "shm": [pushed], "shm-ring": ["ring"]}
    for r in results:
        assert set(r) == {"method", "transport", "bytes", "tensors", "engines", "seconds", "gbps", "loop_lag_ms",
                          "server_loop_lag_ms", "read", "cpu_seconds", "machine_stolen_ms", "rounds"}
        # Each timed step as measured (one here), the figures above taken from them.
        assert [x["seconds"] for x in r["rounds"]] == [r["seconds"]["median"]]
        assert [x["stolen_ms"] for x in r["rounds"]] == [r["machine_stolen_ms"]["max"]]
        # and the memory the machine handed back to its host meanwhile, where it says
        returned = r["rounds"][0]["returned_mib"]
        assert returned is None if counted is None else returned >= 0, r
        if r["method"].startswith("weightsync"):
            assert [x["loop_lag_max_ms"] for x in r["rounds"]] == [r["loop_lag_ms"]["max"]]
            assert set(r["rounds"][0]["server_loop_lag_ms"]) == {"coordinator", "engine-0", "engine-1"}
        # The time the machine lost to its hypervisor in each step (Linux counts it).
        assert 0 <= r["machine_stolen_ms"]["median"] <= r["machine_stolen_ms"]["max"], r
        assert r["engines"] == 2 and r["bytes"] > 3 * 2**20
        assert 0 < r["seconds"]["min"] <= r["seconds"]["median"] <= r["seconds"]["max"]
        assert r["gbps"] > 0
        assert (r["loop_lag_ms"] is None) == (not r["method"].startswith("weightsync"))
        # Each server's own gauge, over the rounds it took part in (the baselines have none).
        if r["method"].startswith("weightsync"):
            servers = r["server_loop_lag_ms"]
            assert set(servers) == {"coordinator", "engines", "engines_nothing_stolen"}
            assert servers["coordinator"] >= 0 and servers["engines"] >= 0
            # one step each: the worst of the steps that lost nothing is that step's or none
            stolen = r["machine_stolen_ms"]["max"]
            assert servers["engines_nothing_stolen"] == (servers["engines"] if stolen == 0 else None), r
            assert r["loop_lag_ms"]["max_nothing_stolen"] == (r["loop_lag_ms"]["max"] if stolen == 0 else None), r
        else:
            assert r["server_loop_lag_ms"] is None
        roles = ({"trainer", "coordinator", "engines"} if r["method"].startswith("weightsync")
                 else {"sender", "receivers"})
        assert set(r["cpu_seconds"]) == roles | {"total"}, r
        assert all(v >= 0 for v in r["cpu_seconds"].values())
        assert r["cpu_seconds"]["total"] >= max(r["cpu_seconds"][role] for role in roles) - 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "weightsync" in proc.stdout and "memcpy" in proc.stdout
    # The comparison with the baselines, printed from the same medians as the JSON.
    median = {(r["method"], r["transport"]): r["seconds"]["median"] for r in results}
    best = min((t for m, t in median if m == "weightsync"), key=lambda t: median[("weightsync", t)])
    ours = median[("weightsync", best)]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{results[0]['tensors']} tensors: weightsync"))
    assert f"weightsync {best} ({ours:.3f} s)" in line
    assert f"{how_much(median[('disk', None)] / ours)} than disk" in line
    assert f"{ours / (2 * median[('memcpy', None)]):.2f}x two memcpys" in line
    assert f"weightsync gloo / flat-gloo {median[('weightsync', 'gloo')] / median[('flat-gloo', None)]:.2f}x" in line


@pytest.mark.parametrize("args", [["--size", "0"], ["--transport", "nccl"], ["--engines", "0"],
                                  ["--transport", "shm-ring", "--trainer-ranks", "2"],
                                  ["--transport", "group-flat", "--trainer-ranks", "2"],
                                  ["--trainer-memory", "huge-pages", "--trainer-ranks", "2"],
                                  ["--passes", "0"], ["--passes", "2", "--trainer-ranks", "2"],
                                  ["--settle-s", "-1"], ["--settle-s", "31"],
                                  ["--settle-s", "0", "--trainer-ranks", "2"]])
def test_bench_bad_arguments_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", *args, "--no-baselines"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "weightsync bench:" in proc.stderr


def test_passes_run_every_method_again_on_fresh_processes_the_baselines_first_in_odd_passes(tmp_path):
    """``--passes 2``: each method's row takes its steps from both passes (the median of
    all of them), each step saying its pass; the first pass runs the weightsync
    transports before the baselines, the second the baselines before the transports."""
    out = tmp_path / "passes.json"
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--size", "2MiB", "--tensors", "12",
                           "--engines", "1", "--steps", "2", "--passes", "2", "--bucket-bytes", "1MiB",
                           "--transport", "shm", "--settle-s", "0", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["passes"] == 2
    assert report["config"]["settle_s"] == 0 and report["settles"] == []  # asked not to wait
    results = report["results"]
    assert [r["method"] for r in results] == ["weightsync", "per-tensor-gloo", "flat-gloo", "disk", "grpc-stream",
                                              "memcpy"]
    started: dict[tuple[str, int], list[float]] = {}
    for r in results:
        assert [x["pass"] for x in r["rounds"]] == [0, 0, 1, 1], r["method"]
        seconds = sorted(x["seconds"] for x in r["rounds"])
        assert r["seconds"]["median"] == pytest.approx((seconds[1] + seconds[2]) / 2)
        assert (r["seconds"]["min"], r["seconds"]["max"]) == (seconds[0], seconds[-1])
        side = "weightsync" if r["method"] == "weightsync" else "baselines"
        for x in r["rounds"]:
            started.setdefault((side, x["pass"]), []).append(x["started_at"])
    assert max(started["weightsync", 0]) < min(started["baselines", 0])
    assert max(started["baselines", 1]) < min(started["weightsync", 1])
    assert min(started["baselines", 0]) < min(started["baselines", 1])
    # the weightsync row's lag figures come from all four steps
    row = results[0]
    assert row["loop_lag_ms"]["max"] == max(x["loop_lag_max_ms"] for x in row["rounds"])
    assert row["read"] and len(row["rounds"]) == 4


def test_bench_sweeps_tensor_counts_of_a_moe_shape_in_one_run(tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--size", "2MiB", "--tensors", "30,300",
                           "--shape-profile", "moe", "--engines", "1", "--steps", "1", "--bucket-bytes", "1MiB",
                           "--transport", "shm", "--transport", "group-flat", "--no-baselines", "--json", str(out),
                           "--plot", str(png), "--trainer-memory", "huge-pages", "--settle-s", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["shape_profile"] == "moe" and report["config"]["tensors_requested"] == [30, 300]
    # The trainer's weights on huge pages in each count's process (place_on_huge_pages).
    assert report["config"]["trainer_memory"] == "huge-pages"
    counts = sorted({r["tensors"] for r in report["results"]})
    assert len(counts) == 2 and 25 <= counts[0] <= 35 and 270 <= counts[1] <= 330
    # group-flat: the group transport with the flattened layout (the bench checks every
    # engine's digest against the trainer's after the runs)
    assert sorted(r["transport"] for r in report["results"]) == ["group-flat", "group-flat", "shm", "shm"]
    assert "time per byte at" in proc.stdout and "CPU per byte" in proc.stdout  # the sweep's ratio lines
    # each count's process waited before its weightsync transports, and said so
    if returned_kib() is not None:
        assert [(s["tensors"], s["phase"]) for s in report["settles"]] == [(n, "weightsync") for n in counts]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("baselines, transport", [(True, "shm"), (False, "group")],
                         ids=["with-gather", "no-baselines-group-two-counts"])
def test_sharded_bench_reports_the_sharded_rounds_and_the_gather_only_when_asked(tmp_path, baselines, transport):
    """``weightsync bench --trainer-ranks 2`` end to end at a toy size: two FSDP2 rank
    processes, one engine; the bench itself fails unless the engine ends bitwise equal
    to the trainer's full state dict. ``--no-baselines`` leaves the all-gather out;
    ``group``: the ranks' parts gathered into rank 0, which sends them whole; that run
    sweeps two tensor counts of the mixture-of-experts shapes (a fleet booted for each)
    and reports the time per byte at the second against the first."""
    out = tmp_path / "ranks.json"
    sweep = [] if baselines else ["--no-baselines", "--shape-profile", "moe"]
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--trainer-ranks", "2", "--size", "1MiB",
                           "--tensors", "12" if baselines else "12,30", "--engines", "1", "--steps", "1",
                           "--transport", transport, "--json", str(out), *sweep],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    if not baselines:  # the sweep: each count's report, and the ratio from their medians
        assert report["tensor_counts"] == [12, 30]
        first, second = report["reports"]
        assert (first["tensors"], second["tensors"]) == (12, 30)
        assert first["shape_profile"] == second["shape_profile"] == "moe"
        assert first["model"]["n_experts"] > 0  # the fleet's model has the shapes asked for
        per_byte = [r["results"][0]["median_s"] / r["results"][0]["payload_bytes"] for r in (first, second)]
        assert report["per_byte_vs_first"]["sharded"] == pytest.approx([1.0, per_byte[1] / per_byte[0]])
        assert "sharded: time per byte against 12 tensors: " in proc.stdout
        report = second
    assert [r["mode"] for r in report["results"]] == (["sharded", "gather"] if baselines else ["sharded"])
    assert all(r["median_s"] > 0 and len(r["rounds_s"]) == 1 for r in report["results"])
    sharded = report["results"][0]
    assert 0 < sharded["median_transfer_s"] < sharded["median_s"]  # the data plane, inside the round
    assert ("gather / sharded" in proc.stdout) == baselines
    assert ("gather_over_sharded" in report) == baselines
    assert report["transport"] == transport


def test_a_count_sweep_compares_each_row_per_byte_with_the_first_count_where_every_count_has_it(tmp_path):
    """``count_sweep`` on reports as the sharded bench writes them: per byte, because one
    ``--size`` split into more tensors totals other bytes; a row that one count lacks
    (a mode left out there) gets no ratio rather than a wrong one."""
    reports = {89: {"results": [{"mode": "sharded", "median_s": 0.2, "payload_bytes": 200},
                                {"mode": "gather", "median_s": 1.0, "payload_bytes": 200}]},
               20000: {"results": [{"mode": "sharded", "median_s": 0.3, "payload_bytes": 100}]}}
    seen = []
    out = tmp_path / "sweep.json"
    report = sweep_counts(reports.__getitem__, [89, 20000], row_key="mode", json_path=str(out),
                          on_report=lambda count, one: seen.append(count))
    assert seen == [89, 20000]  # each count reported as it ends
    assert report["per_byte_vs_first"] == {"sharded": pytest.approx([1.0, 3.0])}
    assert json.loads(out.read_text())["reports"] == [reports[89], reports[20000]]
    assert sweep_lines(report) == ["sharded: time per byte against 89 tensors: 3.00x at 20000"]


@pytest.mark.parametrize("value", ["0", "12,x", ""])
def test_bench_bad_tensor_counts_exit_2(value):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "bench", "--tensors", value, "--no-baselines"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tensor count" in proc.stderr


def test_cpu_meter_counts_each_roles_processes_apart():
    """A process that spins for 0.4 CPU seconds is charged to its role; one that waits
    is not. (Both have started before the meter does; the suite's timeout bounds the reads.)"""
    busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\n"
                             "sys.stdin.readline()\nend = time.process_time() + 0.4\n"
                             "while time.process_time() < end: pass\nprint('done', flush=True)\n"
                             "sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import sys\nprint('ready', flush=True)\nsys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline().strip() == "ready" and idle.stdout.readline().strip() == "ready"
        meter = CpuMeter({"busy": [busy.pid], "idle": [idle.pid]})
        meter.start()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline().strip() == "done"
        meter.stop()
        got = meter.summary()
        assert 0.35 <= got["busy"] < 5, got
        assert got["idle"] < 0.05, got
        assert got["total"] == pytest.approx(got["busy"] + got["idle"])
        assert len(meter.steps) == 1
    finally:
        for proc in (busy, idle):
            proc.stdin.close()
            proc.wait(timeout=30)


def test_a_failed_sync_survives_the_trip_from_a_sweeps_child_process():
    # A sweep runs each count in a child process, which raises its failure to the parent.
    import pickle

    from weightsync.client import SyncFailed
    from weightsync.client.trainer import EngineResult, SyncResult

    failed = EngineResult(engine_id="engine-1", ok=False, weight_version=0, torn=True, seconds=0.1,
                          error_reason="TRANSFER_FAILED", error_message="connection closed")
    error = SyncFailed("1 engine failed: engine-1", result=SyncResult(version=3, ok=False, bytes=0,
                                                                    transfer_seconds=0.1, engines=(failed,)))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is SyncFailed and str(again) == str(error)
    assert again.result == error.result and again.metadata == {"failed": "engine-1"}


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="steal time is read from Linux's /proc/stat")
def test_machine_steal_is_proc_stats_steal_column():
    """The steal the meter reads is /proc/stat's eighth column, all CPUs together, in
    seconds (read here straight from the file, between two reads through psutil)."""
    before = machine_steal_s()
    with open("/proc/stat") as f:
        ticks = int(f.readline().split()[8])
    after = machine_steal_s()
    assert before <= ticks / os.sysconf("SC_CLK_TCK") <= after


def test_cpu_meter_reports_the_time_stolen_per_step_per_cpu(monkeypatch):
    """Steal is summed over CPUs: 0.2 s stolen on a 2-CPU machine is 100 ms the machine
    was away; the worst loop lag of the steps that lost nothing is the one kept."""
    readings = iter([10.0, 10.0, 10.0, 10.2, 10.2, 10.3])
    monkeypatch.setattr(cpu_module, "machine_steal_s", lambda: next(readings))
    monkeypatch.setattr(cpu_module.psutil, "cpu_count", lambda: 2)
    meter = CpuMeter({"me": [os.getpid()]})
    for _ in range(3):
        meter.start()
        meter.stop()
    assert meter.stolen_ms == pytest.approx([0.0, 100.0, 50.0])
    assert meter.stolen() == {"median": 50.0, "max": 100.0}
    assert _worst_where_nothing_stolen([4.0, 35.0, 31.0], meter.stolen_ms) == 4.0
    assert _worst_where_nothing_stolen([35.0, 31.0], [5.0, 5.0]) is None
    assert _worst_where_nothing_stolen([35.0], []) is None  # no steal counted at all


def test_cpu_meter_records_the_memory_handed_back_to_the_host_per_step(monkeypatch):
    """KiB from the kernel's counter, per step in MiB; nothing where it does not count."""
    readings = iter([1000, 1000, 1000, 1000 + 700 * 1024, 5000, 5000 + 512])
    monkeypatch.setattr(cpu_module, "returned_kib", lambda: next(readings))
    meter = CpuMeter({"me": [os.getpid()]})
    for _ in range(3):
        meter.start()
        meter.stop()
    assert meter.returned_mib == [0.0, 700.0, 0.5]
    monkeypatch.setattr(cpu_module, "returned_kib", lambda: None)
    meter = CpuMeter({"me": [os.getpid()]})
    meter.start()
    meter.stop()
    assert meter.returned_mib == []


def _counter(path, kib: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{kib}\n")
    os.replace(tmp, path)  # a reader never sees a half-written number


def test_settle_waits_until_the_machine_stops_handing_back_batches(tmp_path):
    """A counter that grows by 200 MiB batches for a while: the wait ends only once a
    whole quiet window has passed after the last batch, and says how much went back."""
    path = tmp_path / "reported_kib"
    _counter(path, 10_000)
    last_batch_at = []

    def batches() -> None:
        for i in range(1, 6):
            time.sleep(0.3)
            _counter(path, 10_000 + i * 200 * 1024)
            last_batch_at.append(time.monotonic())

    feeder = threading.Thread(target=batches)
    feeder.start()
    seen = settle(quiet_s=1.5, poll_s=0.02, max_s=30, path=str(path))
    ended_at = time.monotonic()
    feeder.join()
    assert seen["quiet"] and seen["returned_mib"] == 1000.0, seen
    assert ended_at - last_batch_at[-1] >= 1.5 - 0.05  # a full window after the last batch
    assert seen["seconds"] >= 1.5 + 1.5 - 0.1


def test_settle_lets_small_returns_pass_and_gives_up_at_its_limit(tmp_path):
    """A few MiB at a time is what an idle machine hands back: no reason to wait longer
    than one window. Batches that never stop: the wait ends at ``max_s``, not quiet."""
    path = tmp_path / "reported_kib"
    _counter(path, 0)
    stop = threading.Event()

    def trickle(step_kib: int) -> None:
        kib = 0
        while not stop.wait(0.05):
            kib += step_kib
            _counter(path, kib)

    # (the second's window spans 20 of the feeder's beats: a busy machine that holds
    # the feeder back a while does not make it look quiet)
    for step_kib, quiet, quiet_s in [(1024, True, 0.5), (100 * 1024, False, 1.0)]:
        stop.clear()
        feeder = threading.Thread(target=trickle, args=(step_kib,))
        feeder.start()
        try:
            seen = settle(quiet_s=quiet_s, batch_mib=64, max_s=2.0, poll_s=0.02, path=str(path))
        finally:
            stop.set()
            feeder.join()
        assert seen["quiet"] is quiet, (step_kib, seen)
        assert seen["returned_mib"] > 0
        if quiet:
            assert seen["seconds"] < 2.0
        else:
            assert seen["seconds"] >= 2.0


def test_settle_does_not_wait_where_the_kernel_does_not_count(tmp_path):
    assert returned_kib(str(tmp_path / "absent")) is None
    assert settle(path=str(tmp_path / "absent")) is None
    (tmp_path / "garbled").write_text("many\n")
    assert returned_kib(str(tmp_path / "garbled")) is None
    _counter(tmp_path / "there", 5)
    assert returned_kib(str(tmp_path / "there")) == 5
    assert settle(quiet_s=0, path=str(tmp_path / "there")) is None  # asked not to wait


def test_cpu_meter_without_steal_counting_reports_none(monkeypatch):
    monkeypatch.setattr(cpu_module, "machine_steal_s", lambda: None)
    meter = CpuMeter({"me": [os.getpid()]})
    meter.start()
    meter.stop()
    assert meter.stolen() is None and meter.stolen_ms == []


async def test_the_benchs_final_check_tells_other_bytes_from_a_missing_engine(cluster_factory):
    """The check a bench run ends with, against a real coordinator and agent: it passes
    when the engine holds the trainer's bytes, and otherwise says which engine holds
    what (its digest and version), or how many engines were there at all."""
    cluster = cluster_factory(1)
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(cluster.address) as client:
        await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        sent = weights_digest(model.named_parameters())
        await check_engines_hold(client, sent, engines=1, version=1, transport="gloo")
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        with pytest.raises(RuntimeError, match=r"engine-0: digest [0-9a-f]{12} at version 1") as info:
            await check_engines_hold(client, weights_digest(model.named_parameters()), engines=1, version=1,
                                      transport="gloo", within_s=1)
        assert sent[:12] in str(info.value)  # what the engine holds: what was sent before the change
        with pytest.raises(RuntimeError, match="1 of 2 engines registered"):
            await check_engines_hold(client, sent, engines=2, version=1, transport="gloo", within_s=1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_bench_that_is_stopped_leaves_no_process_behind(sig):
    """A sweep runs each count in a child process with a cluster of its own. Whether the
    bench is sent SIGTERM (it unwinds as Ctrl-C does and exits 143) or SIGKILLed (its
    child gets SIGTERM as its parent dies), the child and its cluster stop; a process
    pool's worker used to outlive it, waiting for work forever."""
    bench = subprocess.Popen([sys.executable, "-m", "weightsync", "bench", "--size", "16MiB", "--tensors", "12,40",
                              "--engines", "2", "--steps", "100000", "--transport", "gloo", "--no-baselines"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        root, deadline = psutil.Process(bench.pid), time.monotonic() + 120
        while True:  # until the child's cluster is up: a coordinator and two agents
            started = root.children(recursive=True)
            lines = [" ".join(p.cmdline()) for p in started if p.is_running()]
            if sum(" coordinator " in c for c in lines) == 1 and sum(" agent " in c for c in lines) == 2:
                break
            assert bench.poll() is None and time.monotonic() < deadline, "the bench's cluster never came up"
            time.sleep(0.2)
        bench.send_signal(sig)
        code = bench.wait(timeout=60)
        assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        _, alive = psutil.wait_procs(started, timeout=60)
        assert alive == [], f"left running: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def test_gloo_rounds_benchmark_runs_every_variant_and_refuses_an_unknown_one():
    """``benchmarks/gloo_rounds.py`` (gloo variants alternated in the same processes),
    at a toy size: a row per variant, its receivers stopped; a bad variant is refused."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gloo_rounds.py")
    done = subprocess.run([sys.executable, script, "--size", "8MiB", "--tensors", "40", "--rounds", "1",
                           "--variants", "threads:2,threads:8,posted,flat,placed"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["threads:2", "threads:8", "posted", "flat", "placed"]
    bad = subprocess.run([sys.executable, script, "--variants", "threads:0,flat"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown variant 'threads:0'" in bad.stderr


def test_each_baseline_runs_one_untimed_warm_up_step_before_its_timed_steps(tmp_path):
    """As every weightsync transport gets a warm-up round, every baseline gets one
    untimed step first (a first step also pays for first-touch page faults and first
    connections): two timed steps mean three steps served by the real receiver
    process, the first of them outside the times and the CPU meter."""
    named = [(f"w{i}", torch.randn(64, 64)) for i in range(3)]
    steps_timed: list[int] = []
    with Baselines(named, engines=1, steps=2, tmp=str(tmp_path), methods=("flat-gloo", "memcpy")) as runs:
        for method in ("flat-gloo", "memcpy"):
            cpu = CpuMeter(runs.processes(method))
            steps = runs.run(method, progress=steps_timed.append, cpu=cpu)
            assert len(steps) == 2 and all(seconds > 0 for _, seconds in steps)
            assert steps[0][0] + steps[0][1] <= steps[1][0]  # (wall-clock start, seconds), in order
            assert len(cpu.steps) == 2
        # The receiver served the warm-up and both timed steps of flat-gloo.
        assert all(runs.store.check([f"done/flat-gloo/{step}/1"]) for step in range(3))
    assert steps_timed == [0, 1, 0, 1]


def test_paired_rounds_benchmark_alternates_weightsync_with_a_baseline(tmp_path):
    """``benchmarks/paired_rounds.py`` at a toy size: a real cluster and the baseline's
    receivers up at once, each pair a weightsync round then a baseline step; the
    engines end bitwise equal to the trainer (the script checks, and fails otherwise),
    the baseline's receivers too; every pair reported."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "paired_rounds.py")
    out = tmp_path / "pairs.json"
    done = subprocess.run([sys.executable, script, "--size", "8MiB", "--tensors", "40", "--rounds", "3",
                           "--engines", "1", "--baseline", "flat-gloo", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert len(report["weightsync_s"]) == len(report["baseline_s"]) == 3
    assert all(s > 0 for s in report["weightsync_s"] + report["baseline_s"])
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3
    assert f"{report['ratio_of_medians']:.2f}x" in done.stdout.splitlines()[-1]


def test_the_bench_says_slower_when_it_is_and_its_plot_keeps_memcpy_off_the_bars():
    assert how_much(2.5) == "2.50x faster" and how_much(0.8) == "1.25x slower"
    rows = [{"method": "weightsync", "transport": "shm", "gbps": 20.0}, {"method": "disk", "transport": None,
                                                                        "gbps": 5.0},
            {"method": "memcpy", "transport": None, "gbps": 400.0}]
    report = {"results": [{**r, "bytes": 1 << 20, "tensors": 89, "engines": 2} for r in rows],
              "config": {"size": "1MiB"}}
    figure = bar_figure(report)
    try:
        axes = figure.axes[0]
        assert [t.get_text() for t in axes.get_xticklabels()] == ["weightsync\nshm", "disk"]  # no memcpy bar
        assert axes.get_ylim()[1] < 400.0  # the axis is the methods' scale
        legend = [t.get_text() for t in axes.get_legend().get_texts()]
        assert legend[:2] == ["weightsync", "baseline"] and "memcpy bound: 400.0 (off the scale)" in legend
    finally:
        import matplotlib.pyplot as plt
        plt.close(figure)


def test_catch_up_benchmark_times_a_late_engines_catch_up_against_a_broadcast():
    """``benchmarks/catch_up.py`` at a toy size: a late engine caught up over shm, its
    transfer timed from the coordinator's own events against the round's broadcast."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "catch_up.py")
    done = subprocess.run([sys.executable, script, "--size", "4MiB", "--transports", "shm"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout)["runs"]["shm"]
    assert run["catch_up_transfer_s"] > 0 and run["broadcast_s"] > 0 and run["bytes"] > 0
    assert run["catch_up_over_broadcast"] == round(run["catch_up_transfer_s"] / run["broadcast_s"], 2)
