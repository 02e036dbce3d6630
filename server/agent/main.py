"""``weightsync agent``: runs one EngineAgent process until SIGTERM/SIGINT.

Start-up: engine, gRPC server (EngineAgent + health + reflection), port file,
registration with the coordinator (retried until a deadline), heartbeats.
With ``launch``, the engine command is started first (under the reaper, see
``server/agent/launcher.py``) and must become healthy before the agent registers.
Shutdown (first signal; later ones are ignored so they cannot cut cleanup short):
health NOT_SERVING, stop taking work, let a running receive finish within the grace
period (else abandon it: the engine stays paused and torn), deregister, stop the
server, close the engine, stop the launched process tree. Every step runs even if
an earlier one failed; all failures are reported together and the exit code is 1.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from weightsync import metrics
from weightsync.engine import check_engine_choice, make_adapter
from weightsync.engine.vllm import boot_paused_hint
from weightsync.errors import CoordinatorUnavailable, WeightSyncError, from_rpc_error
from weightsync.faults import FaultInjector
from weightsync.grpc_options import CHANNEL_OPTIONS
from weightsync.heap import GcPauseMonitor, freeze_startup_heap
from weightsync.options import AgentOptions
from weightsync.retry import RetryPolicy, retry
from weightsync.security import Security
from weightsync.server.agent.launcher import EngineLauncher
from weightsync.server.agent.readiness import publish_readiness, serve_ready_http
from weightsync.server.agent.service import AgentCore
from weightsync.server.common.serving import (
    Shutdown,
    advertised_address,
    set_not_serving,
    start_server,
    stop_on_signals,
    write_port_file,
)
from weightsync.v1 import agent_pb2, agent_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc
from weightsync.validate import check_engine_id

WORKERS_QUERY_TIMEOUT_S = 60.0
log = logging.getLogger("weightsync.agent")
# Bounded by --register-timeout, not by a count.
REGISTER_RETRY = RetryPolicy(max_attempts=1_000_000, initial_backoff_s=0.1, max_backoff_s=1.0, jitter=0.0)
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["EngineAgentService"].full_name
RPC_METHODS = frozenset(m.name for m in agent_pb2.DESCRIPTOR.services_by_name["EngineAgentService"].methods)


async def _register(stub, core: AgentCore, options: AgentOptions) -> float:
    """Registers (one key for all attempts) and applies the fleet's version it is told
    (the engine stays fenced if it is behind); returns the heartbeat interval."""
    request = coordinator_pb2.RegisterEngineRequest(
        idempotency_key=f"register-{core.engine_id}-{uuid.uuid4().hex}", engine_id=core.engine_id,
        agent_address=core.address, model=options.model)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + options.register_timeout_s
    where = options.coordinator
    log.info("registering %s with the coordinator at %s (trying for up to %g s: --register-timeout-s)",
             core.engine_id, where, options.register_timeout_s)

    def retryable(exc: grpc.aio.AioRpcError) -> bool:
        # ENGINE_ID_IN_USE: our previous incarnation's registration has not expired yet
        # (a restart within the heartbeat timeout); it will.
        again = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
            from_rpc_error(exc).reason == "ENGINE_ID_IN_USE"
        if again and deadline - loop.time() > 0:
            why = (exc.details() or "").rsplit(": ", 1)[-1][:200]  # "Connection refused", not the channel's story
            log.info("the coordinator at %s did not take the registration (%s%s); trying again, %.0f s left",
                     where, exc.code().name, f": {why}" if why else "", deadline - loop.time())
        return again

    try:
        response = await retry(lambda: stub.RegisterEngine(request, timeout=max(0.1, deadline - loop.time())),
                               policy=REGISTER_RETRY, retryable=retryable, time_left=lambda: deadline - loop.time())
    except grpc.aio.AioRpcError as exc:
        error = from_rpc_error(exc, operation="register")
        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise error from None  # refused: the coordinator's own words say why
        raise CoordinatorUnavailable(
            f"could not register with the coordinator at {where} within {options.register_timeout_s:g} s "
            f"({exc.code().name}): check --coordinator and that the coordinator is running, or wait longer "
            "with --register-timeout-s", metadata={"coordinator": where}) from None
    core.registered = True
    await core.fence.learn(response.weight_version)
    return response.heartbeat_interval_s or 0.5


async def _heartbeats(stub, core: AgentCore, options: AgentOptions, interval_s: float) -> None:
    """Reports state every ``interval_s``; re-registers if the coordinator forgot us."""
    while True:
        try:
            response = await stub.Heartbeat(coordinator_pb2.HeartbeatRequest(state=core.state()),
                                            timeout=max(interval_s * 4, 1.0))
            core.coordinator_heard()
            if not response.registered:
                interval_s = await _register(stub, core, options)
            else:
                core.fence.heard(response.weight_version)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat failed: %s", exc.code().name)
            core.coordinator_silent()
        await asyncio.sleep(interval_s)


def _engine_id_from_certificate(security: Security) -> str:
    """Under mutual TLS an agent's certificate names its engine: the id to use when
    ``--engine-id`` is not given."""
    if not security.mutual:
        return ""
    from weightsync.roles import identity_from_certificate
    identity = identity_from_certificate(security.cert)
    return identity.engine_id if identity is not None and identity.role == "agent" else ""


@dataclass
class _RunningAgent:
    """What a running agent holds; the shutdown stops whatever of it was started."""

    engine_id: str
    core: AgentCore | None = None
    faults: FaultInjector | None = None
    launcher: EngineLauncher | None = None
    server: grpc.aio.Server | None = None
    health: object | None = None
    channel: grpc.aio.Channel | None = None
    ready_http: asyncio.Server | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


async def run_agent(options: AgentOptions) -> int:
    """Runs the agent until a signal; returns the process exit code."""
    check_engine_choice(options.engine, options.engine_url)
    agent = _RunningAgent(options.engine_id or _engine_id_from_certificate(options.security)
                          or f"engine-{uuid.uuid4().hex[:8]}")
    stop = stop_on_signals(log)
    errors: list[BaseException] = []
    try:
        await _start(agent, options)
        await stop.wait()
    except WeightSyncError as exc:
        errors.append(exc)  # expected (a coordinator not there, a refusal): one line, below
    except Exception as exc:
        log.error("agent failed: %r", exc)
        errors.append(exc)
    finally:
        shutdown = Shutdown(log, errors=errors, faults=agent.faults)
        await _shutdown(agent, shutdown, options.shutdown_grace_s)
    return shutdown.exit_code(f"agent {agent.engine_id}")


async def _start(agent: _RunningAgent, options: AgentOptions) -> None:
    """Engine (launched first if asked), gRPC server, registration, heartbeats; each part
    is kept in ``agent`` as soon as it exists, so the shutdown stops it."""
    check_engine_id(agent.engine_id)  # before anything starts, not at registration
    options.security.require_server_mode()
    options.security.require_role("agent", agent.engine_id)
    agent.faults = FaultInjector.from_env(enabled=options.enable_fault_injection, engine_id=agent.engine_id,
                                          rpc_methods=RPC_METHODS)
    if options.launch:
        if options.engine == "vllm" and (hint := boot_paused_hint(options.launch)):
            log.warning(hint)
        agent.launcher = EngineLauncher(options.launch, health_url=options.health_url,
                                        ready_timeout_s=options.launch_timeout_s, grace_s=options.shutdown_grace_s,
                                        restart=options.restart, max_restarts=options.max_restarts)
        agent.launcher.start()
        await agent.launcher.wait_ready()
        agent.tasks.append(asyncio.create_task(agent.launcher.monitor()))
    # On a worker thread: the reference engine builds its model here (2 s for 1 GiB),
    # and a launched engine's monitor already runs on this loop.
    adapter = await asyncio.to_thread(
        make_adapter, options.engine, url=options.engine_url, checkpoint_dir=options.checkpoint_dir,
        model=options.model, step_delay_s=options.step_delay_s, sglang_flattened=options.sglang_flattened)
    core = agent.core = AgentCore(engine_id=agent.engine_id, adapter=adapter, injected_faults=agent.faults,
                                  launcher=agent.launcher)
    if agent.launcher is not None:
        agent.launcher.on_relaunch = core.engine_relaunched
        agent.launcher.restart_needed = adapter.restart_needed
    freeze_startup_heap(log)  # the engine and its model exist; nothing is served yet
    GcPauseMonitor("agent").install()
    agent.tasks.append(asyncio.create_task(core.loop_lag.run()))
    if options.metrics_port:
        metrics.serve(options.metrics_port, host=options.listen.rpartition(":")[0] or "127.0.0.1")
    # The engine is asked how it is on the watch's own thread, never on this loop; the
    # first answer is in before the coordinator hears of us.
    first = await core.watch.refresh()
    if first.torn_to is not None:
        core.found_torn(first.torn_to)  # a receive began before this agent and never finished
    agent.tasks.append(asyncio.create_task(core.watch.run()))
    try:  # reported in every heartbeat: a round gives each of the engine's workers a rank
        core.workers = await asyncio.wait_for(core.run_on_engine(adapter.workers), WORKERS_QUERY_TIMEOUT_S)
    except Exception as exc:
        log.warning("could not ask the engine how many workers receive (%r); a receive asks again", exc)
    agent.server, agent.health, bound = await start_server(
        security=options.security, faults=agent.faults, service=SERVICE, listen=options.listen,
        add_servicer=lambda s: agent_pb2_grpc.add_EngineAgentServiceServicer_to_server(core, s))
    # What the coordinator (and a catch-up peer) can reach: never a wildcard address.
    core.address = await asyncio.to_thread(advertised_address, bound, advertise=options.advertise,
                                           toward=options.coordinator)
    agent.tasks.append(asyncio.create_task(publish_readiness(core, agent.health)))
    if options.ready_port:
        agent.ready_http = await serve_ready_http(core, options.listen.rpartition(":")[0] or "127.0.0.1",
                                                  options.ready_port)
    # Until the coordinator says the fleet's version, the engine may hold older weights.
    await core.fence.raise_now(why="fleet version not known yet")
    agent.channel = options.security.channel(options.coordinator, options=CHANNEL_OPTIONS)
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(agent.channel)
    interval = await _register(stub, core, options)
    if options.port_file:
        write_port_file(options.port_file, core.address)
    log.info("agent %s serving on %s, registered with %s", agent.engine_id, core.address, options.coordinator)
    agent.tasks.append(asyncio.create_task(_heartbeats(stub, core, options, interval)))
    # From here on the agent's pause state is settled (fenced above, then the fleet's
    # version): an engine found otherwise is put back.
    agent.tasks.append(asyncio.create_task(core.pause_keeper.run()))


async def _shutdown(agent: _RunningAgent, shutdown: Shutdown, grace: float) -> None:
    """Health NOT_SERVING, drain, stop the tasks, deregister, stop the server, close the
    engine, stop the launched engine, close the channel. Each step is bounded, so a
    stuck component cannot hang the shutdown."""
    bound = 3 * grace + 5
    core = agent.core
    if agent.health is not None:
        await set_not_serving(agent.health)
    if agent.ready_http is not None:
        agent.ready_http.close()  # a probe now finds the port closed: not ready
    if core is not None:
        await core.fence.stop()
        await shutdown.step("drain", lambda: core.drain(grace), timeout_s=bound)
    for task in reversed(agent.tasks):  # heartbeats first: no heartbeat after deregistering
        task.cancel()
        await asyncio.wait({task}, timeout=grace)
    if agent.channel is not None and core is not None and core.registered:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(agent.channel)
        await shutdown.step("deregister", lambda: _deregister(stub, core), timeout_s=bound)
    if agent.server is not None:
        await shutdown.step("server", lambda: agent.server.stop(grace), timeout_s=bound)
    if core is not None:
        async def close_core() -> None:
            failures = await asyncio.to_thread(core.close)
            if failures:
                raise ExceptionGroup("closing the engine", failures)
        await shutdown.step("engine", close_core, timeout_s=bound)
    if agent.launcher is not None:
        await shutdown.step("launched-engine", lambda: asyncio.to_thread(agent.launcher.stop), timeout_s=bound)
    if agent.channel is not None:
        await shutdown.step("channel", lambda: agent.channel.close(grace=None), timeout_s=bound)


async def _deregister(stub, core: AgentCore) -> None:
    try:
        await stub.DeregisterEngine(coordinator_pb2.DeregisterEngineRequest(
            idempotency_key=f"deregister-{core.engine_id}-{uuid.uuid4().hex}", engine_id=core.engine_id), timeout=5.0)
    except grpc.aio.AioRpcError as exc:
        # A coordinator that is gone, shutting down (it cancels the calls in flight when
        # it is stopped together with us) or stuck cannot be told; that is not this
        # agent's failure, and the coordinator drops it when its heartbeats stop.
        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise
        log.warning("could not deregister from the coordinator (%s): %s", exc.code().name, exc.details())


__all__ = ["run_agent"]
