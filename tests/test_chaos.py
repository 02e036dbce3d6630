"""Chaos: seeded schedules of real signals, restarts, duplicate and retried syncs.

Real coordinator and agent processes. Each step starts a sync (its own key) and,
at a random moment, does one of: nothing, SIGTERM or SIGKILL an agent, SIGTERM or
SIGKILL the coordinator, a concurrent duplicate of the same call, or a sequential
retry of it. Then the system is healed (what was stopped is restarted) and the
step's key is retried. Checked throughout:
- no hang: every call ends within its deadline plus the resume grace;
- no crash: every SIGTERMed process exits 0, every other process stays up;
- no duplicate transfer: each agent saw at most one ``transfer_started`` per key;
- no key stays failed once healthy: a retry either succeeds or replays the outcome
  of a round that really ran (never a "try again" such as "no engine is available");
- afterwards a sync with a new key succeeds and every engine's digest is the trainer's.

``WEIGHTSYNC_CHAOS_SEED`` picks the schedule (printed, so a failure can be replayed);
``WEIGHTSYNC_CHAOS_TRANSPORT`` the data plane (default ``auto``: shm on this host), so
a soak can run many seeds over gloo and group too.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter

import pytest

from tests.conftest import wait_available
from tests.test_attestation import perturbed
from tests.test_rounds_end import agent_events
from tests.test_sync_safety import BUCKET
from weightsync.client import RetryPolicy, TrainerClient
from weightsync.errors import WeightSyncError
from weightsync.packing import weights_digest

SEED = int(os.environ.get("WEIGHTSYNC_CHAOS_SEED", "20261130"))
TRANSPORT = os.environ.get("WEIGHTSYNC_CHAOS_TRANSPORT", "auto")
STEPS = 8
SYNC_TIMEOUT_S = 20.0
HANG_LIMIT_S = SYNC_TIMEOUT_S + 25.0  # the deadline, the resume grace and retries' backoff
ACTIONS = ["none", "sigterm_agent", "sigkill_agent", "sigterm_coordinator", "sigkill_coordinator",
           "duplicate", "retry"]
# Outcomes that say "nothing ran, try again": never acceptable once the system is healthy.
TRY_AGAIN = ("no engine is available", "no engine of the paused round is available",
             "required engines unavailable")
# Every transfer is slowed a little, so signals land mid-round.
SLOW_RECEIVE = [{"op": "receive", "action": "delay", "seconds": 0.08, "times": 0}]  # 9 buckets: ~0.7 s


class Chaos:
    """The cluster under test plus what it takes to break and heal it."""

    def __init__(self, cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.restarts = 0
        self.exit_codes: list[tuple[str, int | None]] = []  # (who, code) of SIGTERMed processes

    async def act(self, action: str) -> None:
        cluster = self.cluster
        if action in ("sigterm_agent", "sigkill_agent"):
            agent = self.rng.choice(cluster.agents)
            if action == "sigterm_agent":
                agent.proc.send_signal(signal.SIGTERM)
                self.exit_codes.append((agent.engine_id, await asyncio.to_thread(agent.proc.wait, 30)))
            else:
                agent.proc.kill()
                await asyncio.to_thread(agent.proc.wait, 30)
        elif action in ("sigterm_coordinator", "sigkill_coordinator"):
            if action == "sigterm_coordinator":
                cluster.coordinator.proc.send_signal(signal.SIGTERM)
                self.exit_codes.append(("coordinator", await asyncio.to_thread(cluster.coordinator.proc.wait, 30)))
            else:
                cluster.coordinator.proc.kill()
                await asyncio.to_thread(cluster.coordinator.proc.wait, 30)

    async def heal(self) -> None:
        """Restarts whatever is down; returns when every engine is available again."""
        cluster = self.cluster
        if cluster.coordinator.proc.poll() is not None:
            self.restarts += 1
            await asyncio.to_thread(cluster.restart_coordinator, name=f"coordinator-{self.restarts}")
        for agent in list(cluster.agents):
            if agent.proc.poll() is not None:
                await asyncio.to_thread(cluster.start_agent, agent.engine_id, "--enable-fault-injection",
                                        "--shutdown-grace", "0.5", env={"WEIGHTSYNC_FAULTS": json.dumps(SLOW_RECEIVE)})
        await asyncio.to_thread(wait_available, cluster.address, [a.engine_id for a in cluster.agents], 60)


async def bounded(coro):
    """Runs a call; returns (ok, error). A call that outlives HANG_LIMIT_S fails the test."""
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(coro, timeout=HANG_LIMIT_S)
        return result.ok, None
    except TimeoutError:
        pytest.fail(f"a call hung for {time.monotonic() - started:.0f}s (seed {SEED})")
    except WeightSyncError as exc:  # a typed error is an acceptable outcome under chaos
        return False, exc


async def test_seeded_chaos_around_sync_rounds(cluster_factory):
    print(f"chaos seed {SEED}, transport {TRANSPORT}")
    rng = random.Random(SEED)
    cluster = cluster_factory(3, agent_args=("--enable-fault-injection", "--shutdown-grace", "0.5"),
                              agent_env={"WEIGHTSYNC_FAULTS": json.dumps(SLOW_RECEIVE)},
                              coordinator_args=("--shutdown-grace", "1"))
    chaos = Chaos(cluster, rng)
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.2)
    schedule = [rng.choice(ACTIONS) for _ in range(STEPS)]
    # Every kind of fault at least once, whatever the seed.
    for i, action in enumerate(rng.sample(ACTIONS[1:], len(ACTIONS) - 1)):
        schedule[i] = action
    version = 0
    async with TrainerClient(cluster.address, retry=retry, bucket_bytes=BUCKET, transport=TRANSPORT) as client:
        for step, action in enumerate(schedule):
            version += 1
            model = perturbed(100 + step)
            key = f"chaos-{SEED}-{step}"

            def sync(client=client, model=model, version=version, key=key):
                return client.update_weights(model.named_parameters(), version=version, key=key,
                                             timeout_s=SYNC_TIMEOUT_S)

            first = asyncio.create_task(bounded(sync()))
            extra = None
            await asyncio.sleep(rng.uniform(0.1, 1.2))
            if action == "duplicate":
                async with TrainerClient(cluster.address, retry=retry, bucket_bytes=BUCKET, transport=TRANSPORT) as twin:
                    extra = await bounded(sync(client=twin))
            else:
                await chaos.act(action)
            ok, error = await first
            if action == "retry":
                extra = await bounded(sync())
            await chaos.heal()
            # The same key again, now that everything is up: success, or the replayed
            # outcome of a round that really ran -- never "try again".
            again_ok, again_error = await bounded(sync())
            for outcome in (error, again_error, extra[1] if extra else None):
                if outcome is not None:
                    assert not any(s in str(outcome) for s in TRY_AGAIN), \
                        f"step {step} ({action}): a 'try again' outcome was final for {key}: {outcome} (seed {SEED})"
            if not again_ok:
                # That key's round ran and failed (or was cut off: OPERATION_ABORTED; the
                # engines may even hold its version). A new key, with the next version as
                # a trainer would use, must now succeed.
                version += 1
                fresh_ok, fresh_error = await bounded(client.update_weights(
                    model.named_parameters(), version=version, key=f"{key}-fresh", timeout_s=SYNC_TIMEOUT_S))
                assert fresh_ok, f"step {step} ({action}): a new key failed once healthy: {fresh_error} (seed {SEED})"
            print(f"step {step}: {action}: first ok={ok} ({error and error.reason}), retry ok={again_ok}")

        final = perturbed(999)
        version += 1
        result = await client.update_weights(final.named_parameters(), version=version, key=f"chaos-{SEED}-final",
                                             timeout_s=60)
        assert result.ok and len(result.engines) == 3, result
        state = await client.get_state(include_digests=True)
    assert {e.weights_digest for e in state.engines} == {weights_digest(final.named_parameters())}
    assert all(code == 0 for _, code in chaos.exit_codes), f"a SIGTERMed process failed: {chaos.exit_codes}"
    for agent in cluster.agents:
        assert agent.proc.poll() is None, f"{agent.engine_id} died"
        started = Counter(e.idempotency_key for e in await agent_events(agent.address) if e.kind == "transfer_started")
        duplicated = {k: n for k, n in started.items() if n > 1}
        assert not duplicated, f"{agent.engine_id} ran a key's transfer twice: {duplicated} (seed {SEED})"
    assert cluster.coordinator.proc.poll() is None
