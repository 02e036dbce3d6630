"""``weightsync coordinator``: runs the Coordinator until SIGTERM/SIGINT.

Shutdown (first signal; later ones are ignored): health NOT_SERVING, refuse new
calls, let in-flight RPCs finish within the grace period (then they fail with
UNAVAILABLE), close engine channels and the state database. All failures are
reported together; any failure makes the exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from weightsync import metrics
from weightsync.faults import FaultInjector
from weightsync.heap import GcPauseMonitor, freeze_startup_heap
from weightsync.options import CoordinatorOptions
from weightsync.server.common.serving import (
    Shutdown,
    set_not_serving,
    start_server,
    stop_on_signals,
    write_port_file,
)
from weightsync.server.coordinator.catch_up import CatchUp
from weightsync.server.coordinator.service import CoordinatorCore
from weightsync.statedb import StateDB
from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("weightsync.coordinator")
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
RPC_METHODS = frozenset(m.name for m in coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].methods)


@dataclass
class _RunningCoordinator:
    """What a running coordinator holds; the shutdown stops whatever of it was started."""

    db: StateDB | None = None
    core: CoordinatorCore | None = None
    faults: FaultInjector | None = None
    server: grpc.aio.Server | None = None
    health: object | None = None
    liveness: asyncio.Task | None = None
    lag: asyncio.Task | None = None
    catch_up: asyncio.Task | None = None


async def run_coordinator(options: CoordinatorOptions) -> int:
    """Runs the coordinator until a signal; returns the process exit code."""
    stop = stop_on_signals(log)
    coordinator = _RunningCoordinator()
    errors: list[BaseException] = []
    try:
        await _start(coordinator, options, stop)
        await stop.wait()
    except Exception as exc:
        log.error("coordinator failed: %r", exc)
        errors.append(exc)
    finally:
        stop.set()  # the liveness watch ends with it
        shutdown = Shutdown(log, errors=errors, faults=coordinator.faults)
        await _shutdown(coordinator, shutdown, options.shutdown_grace_s)
    return shutdown.exit_code("coordinator")


async def _start(coordinator: _RunningCoordinator, options: CoordinatorOptions, stop: asyncio.Event) -> None:
    """State database, round state restored from it, gRPC server, liveness watch."""
    options.security.require_server_mode()
    options.security.require_role("coordinator")
    coordinator.db = StateDB(options.state_db)
    coordinator.faults = FaultInjector.from_env(enabled=options.enable_fault_injection, rpc_methods=RPC_METHODS)
    core = coordinator.core = CoordinatorCore(
        coordinator.db, faults=coordinator.faults, heartbeat_interval_s=options.heartbeat_interval_s,
        heartbeat_timeout_s=options.heartbeat_timeout_s, idempotency_retention_s=options.idempotency_retention_s,
        idempotency_max_records=options.idempotency_max_records, security=options.security)
    core.restore_engines()
    freeze_startup_heap(log)  # before it serves
    GcPauseMonitor("coordinator").install()
    metrics.WEIGHT_VERSION.set(core.round.weight_version)
    if options.metrics_port:
        metrics.serve(options.metrics_port, host=options.listen.rpartition(":")[0] or "127.0.0.1")
    coordinator.server, coordinator.health, address = await start_server(
        security=options.security, faults=coordinator.faults, service=SERVICE, listen=options.listen,
        add_servicer=lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(core, s))
    if options.port_file:
        write_port_file(options.port_file, address)
    log.info("coordinator serving on %s (state %s, weight version %d)", address, options.state_db,
             core.round.weight_version)
    coordinator.liveness = asyncio.create_task(core.watch_liveness(stop))
    coordinator.lag = asyncio.create_task(core.loop_lag.run())
    if options.catch_up:
        coordinator.catch_up = asyncio.create_task(CatchUp(
            core.round, core.registry, emit=core.emit, bucket_bytes=options.catch_up_bucket_bytes,
            transport=options.catch_up_transport).run(stop))


async def _shutdown(coordinator: _RunningCoordinator, shutdown: Shutdown, grace: float) -> None:
    """Health NOT_SERVING, refuse new calls, stop the tasks, stop the server (calls in
    flight get the grace period), close the engine channels and the state database."""
    if coordinator.health is not None:
        await set_not_serving(coordinator.health)
    if coordinator.core is not None:
        coordinator.core.accepting = False
    if coordinator.lag is not None:
        coordinator.lag.cancel()
    if coordinator.catch_up is not None:  # an attempt in flight ends with its calls cancelled
        coordinator.catch_up.cancel()
        await shutdown.step("catch-up", lambda: asyncio.wait({coordinator.catch_up}, timeout=grace),
                            timeout_s=grace + 1)
    if coordinator.liveness is not None:  # it ends by itself once ``stop`` is set
        await shutdown.step("liveness", lambda: asyncio.wait({coordinator.liveness}, timeout=grace),
                            timeout_s=grace + 1)
    if coordinator.server is not None:
        await shutdown.step("server", lambda: coordinator.server.stop(grace), timeout_s=grace + 1)
    if coordinator.core is not None:
        await shutdown.step("channels", coordinator.core.registry.close, timeout_s=grace + 1)
    if coordinator.db is not None:
        await shutdown.step("state", lambda: asyncio.to_thread(coordinator.db.close), timeout_s=grace + 1)


__all__ = ["run_coordinator"]
