"""What every weightsync gRPC server has: health checking, reflection, bound address.

Servers bind ``HOST:0`` for an ephemeral port; ``write_port_file`` publishes the
bound address atomically so a parent (the demo, a test) can find it without races.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightsync.faults import FaultInjector
from weightsync.grpc_options import SERVER_OPTIONS
from weightsync.security import Security
from weightsync.server.decode_guard import DecodeGuard
from weightsync.server.fault_interceptor import FaultInterceptor


async def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Adds gRPC health checking (every service SERVING) and reflection.

    The asyncio health servicer, not the thread-based one: a client that holds a
    ``Watch`` stream open (load balancers and probes do) would otherwise pin a thread
    that the server's shutdown waits for forever; the asyncio ``Watch`` is cancelled
    with the server's other calls when the grace period ends."""
    servicer = health.aio.HealthServicer()
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


__all__ = ["start_server", "add_health_and_reflection",
           "set_not_serving", "bind", "write_port_file"]
