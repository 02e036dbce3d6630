"""Readiness for routers: is this agent's engine serving the fleet's weights?

Published two ways, both following ``VersionFence.not_ready_reason``:
- the agent's gRPC health service ``weightsync.ready`` (SERVING / NOT_SERVING), for
  gRPC-aware load balancers and ``grpc_health_probe``;
- optionally plain HTTP ``GET /ready`` on ``--ready-port``: 200 when ready, 503 when
  not, with a small JSON body saying why; what a Kubernetes readiness probe points at.

The gRPC status is refreshed every ``interval_s`` (a change is seen within it); the HTTP
answer is computed per request. Both read the agent's state on its loop without asking
the engine (the engine's version comes from the polled snapshot).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from weightsync.server.agent.service import AgentCore

log = logging.getLogger("weightsync.agent")
READY_SERVICE = "weightsync.ready"
REQUEST_TIMEOUT_S = 5.0   # a client that sends no complete request in this time is dropped
MAX_HEADER_LINES = 100


def _status(ready: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING


async def publish_readiness(core: AgentCore, servicer: health.aio.HealthServicer, *, interval_s: float = 0.1) -> None:
    """Keeps ``weightsync.ready`` equal to the engine's readiness (runs until cancelled;
    the server's graceful shutdown turns every service NOT_SERVING for good)."""
    last = None
    while True:
        ready = not core.fence.not_ready_reason()
        if ready != last:
            await servicer.set(READY_SERVICE, _status(ready))
            last = ready
        await asyncio.sleep(interval_s)


def readiness_body(core: AgentCore) -> tuple[int, bytes]:
    """The HTTP status and JSON body of ``GET /ready``."""
    why = core.fence.not_ready_reason()
    engine = core.watch.current()
    body = {"ready": not why, "engine_id": core.engine_id, "weight_version": engine.weight_version,
            "fleet_version": core.fence.fleet_version, "why": why}
    return (200 if not why else 503), json.dumps(body).encode() + b"\n"


async def serve_ready_http(core: AgentCore, host: str, port: int) -> asyncio.Server:
    """Serves ``GET /ready`` (and ``HEAD``) on ``host:port``; anything else is 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
            for _ in range(MAX_HEADER_LINES):  # the headers are read and ignored
                if await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S) in (b"\r\n", b"\n", b""):
                    break
            method, _, rest = request_line.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method in ("GET", "HEAD") and path == "/ready":
                status, body = readiness_body(core)
            else:
                status, body = 404, b'{"error": "only GET /ready is served here"}\n'
            reason = {200: "OK", 503: "Service Unavailable", 404: "Not Found"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if method != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError, ValueError):
            pass  # a slow, vanished or garbled client: nothing to answer
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


__all__ = ["READY_SERVICE", "publish_readiness", "serve_ready_http", "readiness_body"]
