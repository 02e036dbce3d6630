"""What every weightsync server process has: health checking, reflection, a bound
address, stop signals and a bounded shutdown.

Servers bind ``HOST:0`` for an ephemeral port; ``write_port_file`` publishes the
bound address atomically so a parent (the demo, a test) can find it without races.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import tempfile
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightsync.errors import InvalidArgument, WeightSyncError
from weightsync.faults import FaultInjector
from weightsync.grpc_options import SERVER_OPTIONS
from weightsync.security import Security
from weightsync.server.common.decode_guard import DecodeGuard
from weightsync.server.common.fault_interceptor import FaultInterceptor
from weightsync.server.common.health_service import HealthServicer


async def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Adds gRPC health checking (every service SERVING) and reflection.

    An asyncio health servicer, not the thread-based one: a client that holds a
    ``Watch`` stream open (load balancers and probes do) would otherwise pin a thread
    that the server's shutdown waits for forever; and one whose watches end once the
    server shuts down (``server/common/health_service.py``), so they do not hold the shutdown
    for its whole grace period."""
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in [*service_names, ""]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return servicer


async def set_not_serving(servicer: health.aio.HealthServicer) -> None:
    """Marks every service NOT_SERVING for good (called when shutdown starts); watchers
    are told at once."""
    await servicer.enter_graceful_shutdown()


def bind(server: grpc.aio.Server, listen: str, security: Security) -> str:
    """Binds ``listen`` (``HOST:PORT``, port 0 = ephemeral) with ``security``; returns
    ``HOST:bound_port``."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    bound = security.add_port(server, listen)
    if bound == 0:
        raise OSError(f"cannot bind {listen}")
    return f"{host}:{bound}"


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def check_advertise(host: str) -> str:
    """A host to advertise: a name or address peers can reach (not a wildcard, no
    port: the port is the bound one); InvalidArgument otherwise."""
    if not host or not all(32 < ord(c) < 127 for c in host) or host in WILDCARD_HOSTS or \
            (host.count(":") == 1 and host.rpartition(":")[2].isdigit()):
        raise InvalidArgument(f"--advertise takes a host name or address that peers can reach, without a port "
                              f"(the port is the bound one), got {host[:100]!r}")
    return host


def advertised_address(bound: str, *, advertise: str = "", toward: str = "") -> str:
    """The address peers use to reach a server bound at ``bound`` (``HOST:PORT``):
    ``advertise:PORT`` when a host to advertise is given; for a wildcard bind
    (``0.0.0.0``, ``::``), the local address of this host's route toward ``toward`` (a
    peer's ``HOST:PORT``; no packet is sent); otherwise ``bound`` itself. Blocking (it
    may resolve a name): call it off the event loop."""
    host, _, port = bound.rpartition(":")
    if advertise:
        return f"{check_advertise(advertise)}:{port}"
    if host not in WILDCARD_HOSTS or not toward:
        return bound
    peer_host, _, peer_port = toward.rpartition(":")
    family, _, _, _, sockaddr = socket.getaddrinfo(peer_host.strip("[]"), int(peer_port or 1),
                                                   type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # a UDP "connect" picks the route and sends nothing
        local = probe.getsockname()[0]
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"


def write_port_file(path: str, address: str) -> None:
    """Writes ``address`` to ``path`` atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(address)
    os.replace(tmp, path)


async def start_server(*, security: Security, faults: FaultInjector | None,
                       add_servicer: Callable[[grpc.aio.Server], None], service: str,
                       listen: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """A started weightsync server, the same for the coordinator and every agent:
    authentication (``security``), then request decoding and the role policy
    (``DecodeGuard``), then injected faults where enabled; the service that
    ``add_servicer`` adds, health and reflection; bound to ``listen``. Returns the
    server, its health servicer and the bound address."""
    interceptors = [*security.server_interceptors(), DecodeGuard(enforce_roles=security.mutual)]
    if faults is not None:
        interceptors.append(FaultInterceptor(faults))
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    add_servicer(server)
    health_servicer = await add_health_and_reflection(server, [service])
    address = bind(server, listen, security)
    await server.start()
    return server, health_servicer, address


def stop_on_signals(log: logging.Logger) -> asyncio.Event:
    """An event the first SIGTERM or SIGINT sets; later ones are logged and ignored, so
    they cannot cut the cleanup short."""
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("signal %d during shutdown ignored; cleanup continues", signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


class Shutdown:
    """A server process's shutdown: named steps, each bounded, each run whatever failed
    before it; every failure is kept and makes the exit code 1.

    ``faults`` (where enabled) can fail a named step, to test that the rest still runs.
    """

    def __init__(self, log: logging.Logger, *, errors: list[BaseException] | None = None,
                 faults: FaultInjector | None = None) -> None:
        self.log = log
        self.errors: list[BaseException] = list(errors or [])
        self.faults = faults

    async def step(self, name: str, make_coro: Callable[[], Awaitable[object]], *, timeout_s: float) -> None:
        try:
            if self.faults is not None and self.faults.take("shutdown", method=name) is not None:
                raise RuntimeError(f"injected failure in shutdown step {name!r}")
            await asyncio.wait_for(make_coro(), timeout=timeout_s)
        except Exception as exc:
            self.log.error("shutdown step %s failed: %r", name, exc)
            self.errors.append(exc)

    def exit_code(self, what: str) -> int:
        """0, or 1 after logging every failure of ``what`` together."""
        if not self.errors:
            return 0
        if all(isinstance(e, WeightSyncError) for e in self.errors):
            # Expected failures (a refusal, a peer not there): their messages say what to do.
            for error in self.errors:
                self.log.error("%s stopped: %s", what, error.message)
            return 1
        self.log.error("%s stopped with errors: %r", what, ExceptionGroup(f"{what} shutdown", self.errors))
        return 1


__all__ = ["start_server", "add_health_and_reflection", "set_not_serving", "bind", "write_port_file",
           "advertised_address", "check_advertise", "WILDCARD_HOSTS",
           "stop_on_signals", "Shutdown"]
