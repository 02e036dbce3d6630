"""``weightsync bench``: runs weightsync on the real stack, then the baselines, and reports.

weightsync runs: a coordinator and N agents as processes, whose reference engines
hold a model of ``--size`` bytes in ``--tensors`` tensors; the trainer client does
real Pause/Broadcast/Resume rounds. The first round per transport is a warm-up (it
builds the group and the plan); the timed figure is the Broadcast, from the
trainer's call to every engine having loaded the bytes. After the last step every
engine's digest must equal the trainer's. Loop lag is sampled during each Broadcast,
the CPU seconds it cost every process of the run, and the time the machine lost
to its hypervisor meanwhile (``cpu.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

import psutil
import torch

from weightsync import metrics
from weightsync.apps.bench.baselines import METHODS, Baselines
from weightsync.apps.bench.cpu import CpuMeter
from weightsync.apps.bench.returned_memory import QUIET_S, settle
from weightsync.apps.local_cluster import LocalCluster
from weightsync.arena import place_on_huge_pages
from weightsync.client import EngineClient, LoopLagProbe, Probe, TrainerClient
from weightsync.engine.model import SHAPE_PROFILES, ModelConfig, ReferenceLM, config_for_size
from weightsync.lifecycle import die_with_parent, interrupt_on_sigterm
from weightsync.packing import weights_digest
from weightsync.plan import DEFAULT_BUCKET_BYTES
from weightsync.sizes import parse_size
from weightsync.transport import AUTO_LAYOUT, FLATTENED, TENSORS


class Progress:
    """The bench's progress bar on stderr (tqdm). Log lines written while it runs are
    printed above it (``logging_redirect_tqdm`` in ``run_bench``), never into it."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
        self._bar = tqdm(total=total, file=sys.stderr, leave=True, dynamic_ncols=True, unit="step",
                         bar_format="{l_bar}{bar:30}| {n_fmt}/{total_fmt} {postfix}")
        # This process's log lines go through tqdm.write while the bar is up.
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def step(self, label: str) -> None:
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(1)
        if self._bar.n >= self._bar.total:
            self.close()

    def close(self) -> None:
        """Ends the bar and hands the log lines back to their handlers (idempotent)."""
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        self._bar.close()


def _summary(method: str, transport: str | None, nbytes: int, tensors: int, engines: int, seconds: list[float],
             lag: dict | None, read: list[str] | None = None, cpu: CpuMeter | None = None,
             server_lag: dict | None = None, rounds: list[dict] | None = None) -> dict:
    """One method's row of the report. ``rounds``: per timed step, what the row's
    aggregates were taken from (its seconds; for weightsync, the loops' lag), plus the
    ms the machine lost in that step and the MiB it handed back to its host meanwhile
    (``returned_memory``; None where the kernel does not say), so a slow or stalled
    step can be told apart."""
    median = statistics.median(seconds)
    stolen = cpu.stolen_ms if cpu is not None and len(cpu.stolen_ms) == len(seconds) else [None] * len(seconds)
    returned = (cpu.returned_mib if cpu is not None and len(cpu.returned_mib) == len(seconds)
                else [None] * len(seconds))
    rounds = rounds or [{"seconds": s} for s in seconds]
    rounds = [{**r, "stolen_ms": ms, "returned_mib": mib} for r, ms, mib in zip(rounds, stolen, returned, strict=True)]
    return {"method": method, "transport": transport, "bytes": nbytes, "tensors": tensors, "engines": engines,
            "seconds": {"min": min(seconds), "median": median, "max": max(seconds)},
            "gbps": nbytes * 8 / 1e9 / median, "loop_lag_ms": lag, "server_loop_lag_ms": server_lag, "read": read,
            "cpu_seconds": cpu.summary() if cpu is not None and cpu.steps else None,
            "machine_stolen_ms": cpu.stolen() if cpu is not None else None, "rounds": rounds}


class Samples:
    """One method's timed steps (one transport's, for weightsync), gathered over every
    pass of a run and summarised once at the end (``summary``: a row of the report)."""

    def __init__(self, method: str, transport: str | None, tensors: int, engines: int) -> None:
        self.method, self.transport, self.tensors, self.engines = method, transport, tensors, engines
        self.nbytes = 0
        self.seconds: list[float] = []
        self.rounds: list[dict] = []  # per step: what the row's aggregates come from
        self.meters: list[CpuMeter] = []  # one per pass
        self.lags: list[tuple[float, float]] = []  # weightsync: the trainer loop's (p99, max) per step
        self.server_lags: list[dict[str, float]] = []
        self.read: set[str] = set()

    def summary(self) -> dict:
        cpu = CpuMeter.merged(self.meters)
        lag = server_lag = None
        if self.lags:
            worst = [high for _, high in self.lags]
            lag = {"p99": max(p99 for p99, _ in self.lags), "max": max(worst),
                   "max_nothing_stolen": _worst_where_nothing_stolen(worst, cpu.stolen_ms)}
        if self.server_lags:
            per_step = [max(v for k, v in x.items() if k != "coordinator") for x in self.server_lags]
            server_lag = {"coordinator": max(x["coordinator"] for x in self.server_lags), "engines": max(per_step),
                          "engines_nothing_stolen": _worst_where_nothing_stolen(per_step, cpu.stolen_ms)}
        return _summary(self.method, self.transport, self.nbytes, self.tensors, self.engines, self.seconds, lag,
                        sorted(self.read) if self.transport and self.transport.startswith("shm") else None, cpu,
                        server_lag, self.rounds)


def _worst_where_nothing_stolen(per_step: list[float], stolen_ms: list[float]) -> float | None:
    """The largest of ``per_step`` over the steps in which the machine lost no time to
    its hypervisor (None if it lost some in every step, or the OS does not say)."""
    if len(stolen_ms) != len(per_step):
        return None
    kept = [value for value, stolen in zip(per_step, stolen_ms, strict=True) if stolen == 0]
    return max(kept) if kept else None


def _server_round_lags(metrics_ports: dict[str, int]) -> dict[str, float]:
    """Each server's largest loop lag since its last round began (the agents' Receive,
    the coordinator's Broadcast), from its own gauge; read after a round."""
    return {name: metrics.sample(port, "weightsync_loop_lag_ms", window="round",
                                 process="coordinator" if name == "coordinator" else "agent")
            for name, port in metrics_ports.items()}


async def _reads(agents: list[str], rounds: int) -> list[str]:
    """How the engines read their last ``rounds`` shm transfers ("direct", "ring"), from
    their agents' transfer_done events."""
    seen: set[str] = set()
    for address in agents:
        async with EngineClient(address) as engine:
            done = [e for e in await engine.events() if e.kind == "transfer_done"][-rounds:]
        seen.update(e.fields["read"] for e in done if "read" in e.fields)
    return sorted(seen)


def _perturb(model: ReferenceLM) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


def probe_sequences(model: ReferenceLM, count: int = 4, length: int = 16) -> list[list[int]]:
    """Fixed token sequences for the attestation probe (seeded; inside the model's vocabulary)."""
    g = torch.Generator().manual_seed(1234)
    length = min(length, model.cfg.max_seq_len)
    return torch.randint(0, model.cfg.vocab_size, (count, length), generator=g).tolist()


@contextlib.asynccontextmanager
async def _shm_variant(transport: str):
    """The transport's name for the client; for ``shm-ring``, shm with this trainer
    offering no direct reads for the duration (the engines then take the ring)."""
    if transport != "shm-ring":
        yield transport
        return
    before = os.environ.get("WEIGHTSYNC_SHM_DIRECT")
    os.environ["WEIGHTSYNC_SHM_DIRECT"] = "0"
    try:
        yield "shm"
    finally:
        if before is None:
            os.environ.pop("WEIGHTSYNC_SHM_DIRECT", None)
        else:
            os.environ["WEIGHTSYNC_SHM_DIRECT"] = before


# Where the bench's trainer keeps its weights (``--trainer-memory``).
TRAINER_MEMORY = ("plain", "huge-pages")


# The bench's names for the group transport with a layout asked for (plain "group"
# takes the default, auto).
GROUP_LAYOUTS = {"group-flat": FLATTENED, "group-tensors": TENSORS}


async def _weightsync_runs(address: str, model: ReferenceLM, *, transports: list[str], steps: int,
                           bucket_bytes: int, engines: int, progress: Progress, attest: bool,
                           agents: list[str], processes: dict[str, list[int]],
                           metrics_ports: dict[str, int], samples: dict[tuple, Samples], pass_index: int) -> None:
    """One pass of every transport on one cluster; each timed step goes into ``samples``."""
    version = 0
    tensors = sum(1 for _ in model.parameters())
    sequences = probe_sequences(model)
    # Listed once, as a trainer that syncs every step does: walking the module tree
    # (torch's named_parameters) costs ~10 us per tensor, outside weightsync.
    named = list(model.named_parameters())
    for transport in transports:
        layout = GROUP_LAYOUTS.get(transport, AUTO_LAYOUT)
        async with _shm_variant(transport) as name, TrainerClient(
                address, transport="group" if transport in GROUP_LAYOUTS else name, bucket_bytes=bucket_bytes,
                group_layout=layout) as client:
            version += 1
            await client.update_weights(named, version=version, timeout_s=600)  # warm-up
            progress.step(f"weightsync/{transport} warm-up")
            # With --attest the same rounds run again with the probe, in this run: the
            # ratio of the two is attestation's cost (the trainer's scoring included).
            for method, probe in [("weightsync", None)] + ([("weightsync+attest", sequences)] if attest else []):
                row = samples.setdefault((method, transport), Samples(method, transport, tensors, engines))
                cpu = CpuMeter(processes)
                row.meters.append(cpu)
                for _ in range(steps):
                    await asyncio.to_thread(_perturb, model)
                    version += 1
                    await client.pause()
                    started_at = time.time()
                    cpu.start()  # outside the lag probe's window: it reads /proc on this loop
                    async with LoopLagProbe(interval_s=0.002) as lag:
                        start = time.perf_counter()
                        result = await client.broadcast(
                            named, version=version, timeout_s=600,
                            attest=(lambda s=probe: Probe.from_model(model, s)) if probe else None)
                        seconds = time.perf_counter() - start
                    cpu.stop()
                    servers = await asyncio.to_thread(_server_round_lags, metrics_ports)
                    await client.resume()
                    row.nbytes = result.bytes
                    row.seconds.append(seconds)
                    # A loop stalls with the whole machine when the hypervisor takes its
                    # CPUs (see cpu.py); the worst lag of the steps that lost no time is
                    # where weightsync's own stalls show (cpu.py says how exact that is).
                    row.lags.append((lag.p99_ms, lag.max_ms))
                    row.server_lags.append(servers)
                    row.rounds.append({"seconds": seconds, "loop_lag_max_ms": lag.max_ms,
                                       "server_loop_lag_ms": servers, "pass": pass_index, "started_at": started_at})
                    progress.step(f"{method}/{transport}")
                if transport.startswith("shm"):
                    row.read.update(await _reads(agents, steps))
            local = await asyncio.to_thread(weights_digest, model.named_parameters())
            await check_engines_hold(client, local, engines=engines, version=version, transport=transport)


async def check_engines_hold(client: TrainerClient, digest: str, *, engines: int, version: int, transport: str,
                              within_s: float = 60.0) -> None:
    """Raises unless every engine holds exactly the trainer's bytes (``digest``) at
    ``version``, naming what each other engine holds (``TrainerClient.check_engines``:
    an engine the coordinator could not read is asked again for up to ``within_s``)."""
    check = await client.check_engines(digest=digest, version=version, engines=engines, within_s=within_s)
    if not check.ok:
        raise RuntimeError(f"weightsync/{transport}: after version {version}, {check.describe()}")


def run_bench(*, size: str, tensors: int | list[int], engines: int, transports: list[str], steps: int,
              baselines: bool, json_path: str = "", plot_path: str = "", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              attest: bool = False, shape_profile: str = "dense", trainer_memory: str = "plain",
              passes: int = 1, settle_s: float = QUIET_S) -> dict:
    """Runs the benchmark; returns (and optionally writes) the JSON report.

    ``tensors``: one count, or several for a sweep -- the same payload split into each
    count in turn, every method at every count, all in this one run (so the ratios
    between counts compare like with like). ``shape_profile``: ``dense`` layers, or
    ``moe`` (most tensors are small expert matrices). ``trainer_memory``: ``plain`` (the
    trainer's weights as torch allocates them) or ``huge-pages`` (end to end on huge
    pages, ``place_on_huge_pages``; the baselines' flat buffers on huge pages too).
    ``passes``: every method runs ``steps`` timed steps that many times, on fresh
    processes each pass, the weightsync transports and the baselines taking turns to
    go first; each row is the median of all its steps. On a machine whose speed moves
    from one minute to the next, the ratios between methods then compare the same
    minutes more nearly. ``settle_s``: before each pass's weightsync transports and
    before its baselines, once their processes are up, wait until the machine has gone
    that long without handing a batch of freed memory back to its host (at most a
    minute; see ``returned_memory``; 0: do not wait); the report's ``settles`` says
    what each wait saw.
    """
    counts = [tensors] if isinstance(tensors, int) else list(tensors)
    if engines < 1 or steps < 1 or passes < 1 or not counts or any(n < 1 for n in counts):
        raise ValueError("engines, steps, passes and tensors must be >= 1")
    if not 0 <= settle_s <= 30:
        raise ValueError(f"settle seconds must be between 0 and 30, got {settle_s}")
    if shape_profile not in SHAPE_PROFILES:
        raise ValueError(f"unknown shape profile {shape_profile!r}; known: {', '.join(SHAPE_PROFILES)}")
    if trainer_memory not in TRAINER_MEMORY:
        raise ValueError(f"unknown trainer memory {trainer_memory!r}; known: {', '.join(TRAINER_MEMORY)}")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'weightsync[bench]'") from None
    nbytes_requested = parse_size(size)
    per_count = passes * (len(transports) * (steps * (2 if attest else 1) + 1) + (len(METHODS) * steps if baselines
                                                                                 else 0))
    results: list[dict] = []
    settles: list[dict] = []
    shape_args = {"engines": engines, "transports": transports, "steps": steps, "baselines": baselines,
                  "bucket_bytes": bucket_bytes, "attest": attest, "huge_pages": trainer_memory == "huge-pages",
                  "passes": passes, "settle_s": settle_s}
    if len(counts) == 1:
        cfg = config_for_size(nbytes_requested, counts[0], profile=shape_profile)
        progress = Progress(per_count)
        try:
            shape = _run_one_shape(cfg, progress=progress, **shape_args)
        finally:
            progress.close()
        results += shape["rows"]
        settles += shape["settles"]
    else:
        # Each count in a fresh trainer process (still one run, one report): the
        # previous shape's freed gigabyte leaves this process's heap fragmented, and
        # the next shape measured 15-20 % slower in it than in a process of its own.
        # A trainer holds one model per process, as each count does here.
        for count in counts:
            cfg = config_for_size(nbytes_requested, count, profile=shape_profile)
            shape = _run_shape_in_child(cfg, per_count, shape_args, label=f"--tensors {count}")
            results += shape["rows"]
            settles += shape["settles"]
    report = {"machine": machine(), "results": results, "settles": settles,
              "config": {"size": size, "tensors_requested": counts if len(counts) > 1 else counts[0],
                         "shape_profile": shape_profile, "bucket_bytes": bucket_bytes, "steps": steps,
                         "attest": attest, "trainer_memory": trainer_memory, "passes": passes,
                         "settle_s": settle_s}}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    if plot_path:
        plot(report, plot_path)
    return report


def _run_shape_in_child(cfg: ModelConfig, steps_total: int, shape_args: dict, *, label: str) -> dict:
    """``_run_one_shape`` in a fresh process (spawned), whose errors are raised here.

    That process dies with this one (parent-death signal, SIGTERM) and is stopped if
    this one is interrupted while it runs; either way it stops its own cluster first.
    (A process pool's worker outlived a bench that was sent SIGTERM: it waited for
    work forever, and the pool's semaphores stayed in /dev/shm.)"""
    context = multiprocessing.get_context("spawn")
    outcome, sent = context.Pipe(duplex=False)
    child = context.Process(target=_shape_process, name="weightsync-bench-shape",
                            args=(sent, os.getpid(), cfg.to_json(), steps_total, shape_args))
    child.start()
    sent.close()
    try:
        while not outcome.poll(0.5):
            if not child.is_alive() and not outcome.poll(0):
                raise RuntimeError(f"the bench's process for {label} exited with code {child.exitcode} "
                                   "before it reported")
        kind, value = outcome.recv()
    except BaseException:
        _stop_child(child)
        raise
    finally:
        outcome.close()
    child.join(timeout=60)  # it exits once it has reported
    _stop_child(child)
    if kind == "error":
        raise value
    return value


def _stop_child(child: multiprocessing.process.BaseProcess) -> None:
    if child.is_alive():
        child.terminate()  # SIGTERM: it stops its cluster (interrupt_on_sigterm)
        child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join(timeout=10)


def _shape_process(report, parent_pid: int, cfg_json: str, steps_total: int, shape_args: dict) -> None:
    """The body of ``_run_shape_in_child``'s process: reports ("ok", results) or
    ("error", exception) through ``report``."""
    die_with_parent(signal.SIGTERM)
    interrupt_on_sigterm()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        return
    try:
        progress = Progress(steps_total)
        try:
            results = _run_one_shape(ModelConfig.from_json(cfg_json), progress=progress, **shape_args)
        finally:
            progress.close()
    except KeyboardInterrupt:
        return
    except Exception as exc:
        try:
            report.send(("error", exc))
        except Exception:  # an exception that does not pickle
            report.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    report.send(("ok", results))


def _run_one_shape(cfg, *, engines: int, transports: list[str], steps: int, baselines: bool, bucket_bytes: int,
                   attest: bool, huge_pages: bool, progress: Progress, passes: int = 1,
                   settle_s: float = QUIET_S) -> dict:
    """Every method at one model shape, ``passes`` times: the weightsync transports on a
    fresh local cluster whose engines hold that shape, and the baselines on receivers
    of their own. Returns ``rows`` (each method's row summarises its steps of every
    pass) and ``settles`` (what each wait before a phase saw, ``run_bench``)."""
    model = ReferenceLM(cfg)
    if huge_pages:
        place_on_huge_pages(model)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    samples: dict[tuple, Samples] = {}
    settles: list[dict] = []

    def settled(phase: str, index: int) -> None:
        # The processes the last phase stopped freed gigabytes; a step timed while the
        # host takes them back measures the host (returned_memory.py).
        seen = settle(quiet_s=settle_s)
        if seen is not None:
            settles.append({"tensors": len(named), "pass": index, "phase": phase, **seen})

    def weightsync_pass(tmp: str, index: int) -> None:
        with LocalCluster(tmp, engines=engines, agent_args=("--model", cfg.to_json()), agent_timeout_s=600,
                          settle_s=1.0, metrics=True) as cluster:
            settled("weightsync", index)
            asyncio.run(_weightsync_runs(cluster.address, model, transports=transports, steps=steps,
                                         bucket_bytes=bucket_bytes, engines=engines, progress=progress,
                                         attest=attest, agents=[a.address for a in cluster.agents],
                                         processes={"trainer": [os.getpid()],
                                                    "coordinator": [cluster.coordinator.proc.pid],
                                                    "engines": [a.proc.pid for a in cluster.agents]},
                                         metrics_ports=cluster.metrics_ports, samples=samples, pass_index=index))

    def baselines_pass(tmp: str, index: int) -> None:
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        with Baselines(named, engines=engines, steps=steps, tmp=tmp, huge_pages=huge_pages) as runs:
            settled("baselines", index)
            for method in METHODS:
                row = samples.setdefault((method, None), Samples(method, None, len(named), engines))
                row.nbytes = nbytes
                cpu = CpuMeter(runs.processes(method))
                row.meters.append(cpu)
                for started_at, seconds in runs.run(method, progress=lambda _s, m=method: progress.step(m), cpu=cpu):
                    row.seconds.append(seconds)
                    row.rounds.append({"seconds": seconds, "pass": index, "started_at": started_at})

    phases = [weightsync_pass] + ([baselines_pass] if baselines else [])
    for index in range(passes):
        # Odd passes run the baselines first (A B, B A, ...): a machine whose speed
        # drifts during the run then weighs on both sides alike.
        with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
            for phase in phases if index % 2 == 0 else phases[::-1]:
                phase(tmp, index)
    return {"rows": [row.summary() for row in samples.values()], "settles": settles}


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "processor": platform.processor() or platform.machine()}


def table(report: dict) -> str:
    """The report as a fixed-width table."""
    rows = [f"{'method':<18} {'transport':<13} {'MiB':>8} {'tensors':>7} {'engines':>7} {'median s':>9} "
            f"{'min s':>8} {'Gbit/s':>7} {'cpu s':>6} {'lag p99/max ms':>15} {'srv lag ms':>10} {'stolen ms':>9}  read"]
    for r in report["results"]:
        lag = f"{r['loop_lag_ms']['p99']:.1f}/{r['loop_lag_ms']['max']:.1f}" if r["loop_lag_ms"] else "-"
        cpu = f"{r['cpu_seconds']['total']:.2f}" if r.get("cpu_seconds") else "-"
        servers = r.get("server_loop_lag_ms")
        srv = f"{servers['coordinator']:.1f}/{servers['engines']:.1f}" if servers else "-"
        stolen = f"{r['machine_stolen_ms']['max']:.0f}" if r.get("machine_stolen_ms") else "-"
        rows.append(f"{r['method']:<18} {r['transport'] or '-':<13} {r['bytes'] / 2**20:>8.1f} {r['tensors']:>7} "
                    f"{r['engines']:>7} {r['seconds']['median']:>9.3f} {r['seconds']['min']:>8.3f} "
                    f"{r['gbps']:>7.2f} {cpu:>6} {lag:>15} {srv:>10} {stolen:>9}  {'+'.join(r.get('read') or []) or '-'}")
    return "\n".join(rows)


def ratios(report: dict) -> list[str]:
    """For a sweep: each method's median time per byte at the largest tensor count over
    the same at the smallest (1.0 = the tensor count costs nothing), and the same for
    CPU seconds (the work, apart from waiting). Per byte, because the shapes of one
    ``--size`` total slightly different byte counts."""
    by_method: dict[tuple, dict[int, tuple[float, float | None]]] = {}
    for r in report["results"]:
        cpu = r["cpu_seconds"]["total"] / r["bytes"] if r.get("cpu_seconds") else None
        by_method.setdefault((r["method"], r["transport"]), {})[r["tensors"]] = (r["seconds"]["median"] / r["bytes"],
                                                                                  cpu)
    lines = []
    for (method, transport), per_byte in by_method.items():
        if len(per_byte) > 1:
            low, high = min(per_byte), max(per_byte)
            line = (f"{method}{'/' + transport if transport else ''}: time per byte at {high} tensors / "
                    f"at {low} tensors = {per_byte[high][0] / per_byte[low][0]:.2f}x")
            if per_byte[high][1] and per_byte[low][1]:
                line += f", CPU per byte {per_byte[high][1] / per_byte[low][1]:.2f}x"
            else:  # a round shorter than /proc's 10 ms tick in every process counts 0
                line += ", CPU per byte - (too little to count)"
            lines.append(line)
    return lines


def how_much(speedup: float) -> str:
    """``2.50x faster`` for a speed-up of 2.5, ``1.16x slower`` for one of 0.86."""
    if speedup >= 1.0:
        return f"{speedup:.2f}x faster"
    return f"{1 / speedup:.2f}x slower" if speedup > 0 else "infinitely slower"


def against_baselines(report: dict) -> list[str]:
    """Per tensor count run with the baselines: how the fastest weightsync transport
    compares with each baseline (how many times faster), with two copies of the
    payload at memcpy speed (how many times slower: a sync copies at least twice), and
    weightsync gloo with one broadcast of a pre-flattened buffer (flat-gloo), all
    from median seconds of this one run."""
    lines = []
    for count in sorted({r["tensors"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["tensors"] == count]
        median = {(r["method"], r["transport"]): r["seconds"]["median"] for r in rows}
        ours = {t: s for (m, t), s in median.items() if m == "weightsync"}
        base = {m: s for (m, t), s in median.items() if t is None}
        if not ours or not base:
            continue
        best = min(ours, key=ours.get)
        parts = [f"{how_much(base[m] / ours[best])} than {m}" for m in base if m != "memcpy"]
        if "memcpy" in base:
            parts.append(f"{ours[best] / (2 * base['memcpy']):.2f}x two memcpys")
        line = f"{count} tensors: weightsync {best} ({ours[best]:.3f} s) " + ", ".join(parts)
        if "gloo" in ours and "flat-gloo" in base:
            line += f"; weightsync gloo / flat-gloo {ours['gloo'] / base['flat-gloo']:.2f}x"
        lines.append(line)
    return lines


def plot(report: dict, path: str) -> None:
    """One count: throughput per method (bars). A sweep: median seconds against tensor
    count, a line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    r0 = report["results"][0]
    counts = sorted({r["tensors"] for r in report["results"]})
    if len(counts) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in report["results"]:
            label = r["method"] + (f"/{r['transport']}" if r["transport"] else "")
            lines.setdefault(label, []).append((r["tensors"], r["seconds"]["median"]))
        for label, points in lines.items():
            points.sort()
            style = "-o" if label.startswith("weightsync") else "--x"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tensors in the payload")
        ax.set_ylabel("median seconds to every engine")
        ax.set_title(f"{report['config']['size']} ({report['config'].get('shape_profile', 'dense')}), "
                     f"{r0['engines']} engines")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    fig = bar_figure(report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bar_figure(report: dict):
    """One tensor count's throughput per method as bars (matplotlib figure; the caller
    closes it). memcpy is a bound, not a method: a dashed line, and the axis is sized
    to the methods (at 5-50x their speed, a memcpy bar would flatten every other bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.lines
    import matplotlib.patches
    import matplotlib.pyplot as plt

    r0 = report["results"][0]
    rows = [r for r in report["results"] if r["method"] != "memcpy"]
    bound = next((r["gbps"] for r in report["results"] if r["method"] == "memcpy"), None)
    labels = [r["method"] + (f"\n{r['transport']}" if r["transport"] else "") for r in rows]
    values = [r["gbps"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.3), 4.5))
    ours = [r["method"].startswith("weightsync") for r in rows]
    bars = ax.bar(labels, values, color=["tab:blue" if o else "tab:gray" for o in ours])
    ax.bar_label(bars, fmt="%.2f")
    top = max(values, default=1.0) * 1.25
    handles = [matplotlib.patches.Patch(color="tab:blue", label="weightsync"),
               matplotlib.patches.Patch(color="tab:gray", label="baseline")]
    if bound is not None:
        if bound <= top:
            handles.append(ax.axhline(bound, color="tab:red", linestyle="--", label=f"memcpy bound ({bound:.1f})"))
        else:
            handles.append(matplotlib.lines.Line2D([], [], color="tab:red", linestyle="--",
                                                   label=f"memcpy bound: {bound:.1f} (off the scale)"))
    ax.set_ylim(0, top)
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_ylabel("Gbit/s of payload to every engine")
    ax.set_title(f"{r0['bytes'] / 2**20:.0f} MiB, {r0['tensors']} tensors, {r0['engines']} engines")
    return fig


__all__ = ["run_bench", "check_engines_hold", "parse_size", "table", "ratios", "against_baselines", "how_much", "plot", "bar_figure",
           "machine"]
