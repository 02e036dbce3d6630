"""``weightsync demo``: the embedded default, end to end on one machine.

Starts a coordinator and N agents hosting reference engines as local processes,
trains the tiny LM on a synthetic task (continue an arithmetic sequence) while the
engines keep serving generation requests, and syncs after every step. Per step it
prints the loss, the sync time, the bytes moved, and for each engine the version it
serves and whether its weights are bitwise equal to the trainer's. Exits 1 if any
engine ever differs or a generation fails; stops every process it started, on
Ctrl-C too.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
from collections import Counter

import torch

from weightsync.apps.local_cluster import LocalCluster
from weightsync.client import EngineClient, LoopLagProbe, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.pki import generate_dev_pki, tls_args
from weightsync.security import Security

START_TIMEOUT_S = 60.0


def _batch(generator: torch.Generator, batch: int = 32, length: int = 24) -> torch.Tensor:
    """Arithmetic sequences mod 64 over printable bytes: start a, step k."""
    a = torch.randint(0, 64, (batch, 1), generator=generator)
    k = torch.randint(1, 5, (batch, 1), generator=generator)
    return 32 + (a + k * torch.arange(length)) % 64


def run_demo(*, steps: int = 8, engines: int = 2, transport: str = "auto") -> int:
    """Runs the demo; returns the exit code."""
    if steps < 1 or engines < 1:
        print("steps and engines must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as tmp:
        try:
            # Secure by default, even on loopback: a throwaway CA, a certificate per role
            # (coordinator, each agent, the trainer), mutual TLS on every channel, and a
            # shared token.
            pki = generate_dev_pki(tmp, engine_ids=tuple(f"engine-{i}" for i in range(engines)))
            token_file = os.path.join(tmp, "token")
            with open(token_file, "w") as f:
                f.write(secrets.token_urlsafe(32))
            os.chmod(token_file, 0o600)
            security = Security.from_files(cert=pki["trainer_cert"], key=pki["trainer_key"], ca=pki["ca"],
                                           token_file=token_file)
            with LocalCluster(tmp, engines=engines, server_args=(),
                              role_args=lambda role, engine_id: tls_args(pki, role, engine_id=engine_id,
                                                                         token_file=token_file),
                              start_timeout_s=START_TIMEOUT_S,
                              agent_timeout_s=START_TIMEOUT_S,
                              agent_args=("--engine", "reference", "--model", "tiny", "--step-delay", "0.002")
                              ) as cluster:
                print(f"coordinator {cluster.address}; engines {', '.join(cluster.agent_addresses)}; transport {transport}; "
                      "mutual TLS with a certificate per role + token")
                return asyncio.run(_train(cluster.address, cluster.agent_addresses, steps=steps, transport=transport,
                                          security=security))
        except KeyboardInterrupt:  # the cluster has already stopped every process
            print("\ninterrupted; stopping every process", file=sys.stderr)
            return 130


async def _generate_forever(engine: EngineClient, stop: asyncio.Event, seen: Counter, spans: list,
                            failures: list) -> None:
    """Keeps one engine busy: a request of 24 tokens at a time, forever."""
    prompt = [ord(c) for c in "0246"]
    while not stop.is_set():
        rid = await engine.generate(prompt, 24)
        while True:
            gen = await engine.get(rid, wait_s=0.5)
            if gen.status not in ("queued", "running"):
                break
        if gen.status != "finished":
            failures.append(f"{engine.address} {rid}: {gen.status} {gen.error}")
            return
        seen.update(gen.versions)
        if len(set(gen.versions)) > 1:
            spans.append(sorted(set(gen.versions)))


async def _train(address: str, agents: list[str], *, steps: int, transport: str, security: Security) -> int:
    config = PRESETS["tiny"]
    model = ReferenceLM(config)  # same config + seed as the engines: version 0 agrees bitwise
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)

    def train_step() -> float:
        batch = _batch(generator)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    engines = [EngineClient(a, security=security) for a in agents]
    seen: Counter = Counter()
    spans: list = []
    failures: list = []
    stop = asyncio.Event()
    all_equal = True
    async with TrainerClient(address, transport=transport, security=security) as client, LoopLagProbe() as lag:
        generators = [asyncio.create_task(_generate_forever(e, stop, seen, spans, failures)) for e in engines]
        try:
            print(f"{'step':>4} {'loss':>7} {'sync ms':>8} {'bytes':>9}  engines (version, bitwise equal to trainer)")
            for step in range(1, steps + 1):
                loss = await asyncio.to_thread(train_step)  # the loop keeps serving the generators
                result = await client.update_weights(model.named_parameters(), version=step, timeout_s=60)
                check = await client.check_engines(model.named_parameters(), version=step, engines=len(engines))
                all_equal &= check.ok
                holding = set(check.holding)
                cells = [f"{e.engine_id}: v{e.version} " + ("equal" if e.engine_id in holding
                                                            else "NO DIGEST" if e.withheld
                                                            else "UNREAD" if not e.digest else "DIFFERENT")
                         for e in check.engines]
                if len(check.engines) != len(engines):
                    cells.append(check.describe())
                print(f"{step:>4} {loss:>7.3f} {1000 * result.total_seconds:>8.1f} {result.bytes:>9}  "
                      + "; ".join(cells), flush=True)
                await asyncio.sleep(0.05)  # let the engines generate a little with the new weights
        finally:
            stop.set()
            done, pending = await asyncio.wait(generators, timeout=30)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    failures.append(repr(task.exception()))
            for e in engines:
                await e.aclose()
    print(f"tokens generated per weight version: {dict(sorted(seen.items()))}")
    print(f"requests whose tokens span a sync (KEEP pause, continued after resume): {len(spans)}")
    print(f"trainer event-loop lag during the run: max {lag.max_ms:.1f} ms, p99 {lag.p99_ms:.1f} ms")
    if failures:
        print("generation failures:\n  " + "\n  ".join(failures), file=sys.stderr)
    if not all_equal:
        print("FAILED: some engine's weights differed from the trainer's", file=sys.stderr)
    ok = all_equal and not failures
    print("OK: every engine served exactly the trainer's weights after every step" if ok else "FAILED")
    return 0 if ok else 1


__all__ = ["run_demo"]
