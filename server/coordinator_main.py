"""``weightsync coordinator``: runs the Coordinator until SIGTERM/SIGINT.

Shutdown (first signal; later ones are ignored): health NOT_SERVING, refuse new
calls, let in-flight RPCs finish within the grace period (then they fail with
UNAVAILABLE), close engine channels and the state database. All failures are
reported together; any failure makes the exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from weightsync import metrics
from weightsync.faults import FaultInjector
from weightsync.loop_lag import LoopLagMonitor
from weightsync.options import CoordinatorOptions
from weightsync.server.coordinator import CoordinatorCore
from weightsync.server.serving import (
    set_not_serving,
    start_server,
    write_port_file,
)
from weightsync.statedb import StateDB
from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("weightsync.coordinator")
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


async def run_coordinator(options: CoordinatorOptions) -> int:
    """Runs the coordinator until a signal; returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # a second signal only sets it again
    db = core = server = health = liveness = lag = None
    errors: list[BaseException] = []
    try:
        options.security.require_server_mode()
        options.security.require_role("coordinator")
        db = StateDB(options.state_db)
        faults = FaultInjector.from_env(enabled=options.enable_fault_injection)
        core = CoordinatorCore(db, faults=faults, heartbeat_interval_s=options.heartbeat_interval_s,
                               heartbeat_timeout_s=options.heartbeat_timeout_s,
                               idempotency_retention_s=options.idempotency_retention_s,
                               idempotency_max_records=options.idempotency_max_records,
                               security=options.security)
        core.restore_engines()
        metrics.WEIGHT_VERSION.set(core.round.weight_version)
        if options.metrics_port:
            metrics.serve(options.metrics_port, host=options.listen.rpartition(":")[0] or "127.0.0.1")
        server, health, address = await start_server(
            security=options.security, faults=faults, service=SERVICE, listen=options.listen,
            add_servicer=lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(core, s))
        if options.port_file:
            write_port_file(options.port_file, address)
        log.info("coordinator serving on %s (state %s, weight version %d)", address, options.state_db,
                 core.round.weight_version)
        liveness = asyncio.create_task(core.watch_liveness(stop))
        lag = asyncio.create_task(LoopLagMonitor("coordinator").run())
        await stop.wait()
    except Exception as exc:
        errors.append(exc)
    finally:
        grace = options.shutdown_grace_s
        if health is not None:
            await set_not_serving(health)
        if core is not None:
            core.accepting = False
        stop.set()
        if lag is not None:
            lag.cancel()
        for name, coro_fn in (("liveness", lambda: asyncio.wait({liveness}, timeout=grace) if liveness else None),
                              ("server", lambda: server.stop(grace) if server else None),
                              ("channels", lambda: core.registry.close() if core else None)):
            try:
                coro = coro_fn()
                if coro is not None:
                    await asyncio.wait_for(coro, timeout=grace + 1)
            except Exception as exc:
                log.error("shutdown step %s failed: %r", name, exc)
                errors.append(exc)
        if db is not None:
            try:
                await asyncio.to_thread(db.close)
            except Exception as exc:
                errors.append(exc)
    if errors:
        log.error("coordinator stopped with errors: %r", ExceptionGroup("coordinator shutdown", errors))
        return 1
    return 0


__all__ = ["run_coordinator"]
