"""gRPC health checking whose ``Watch`` streams end when the server shuts down.

Load balancers and probes hold ``Health/Watch`` streams open for as long as a server
lives. grpc's asyncio servicer keeps each one open until it is cancelled, and a
server's ``stop(grace)`` waits for its open calls: so every shutdown with a watcher
attached took the whole grace period (10 s by default) before the process could
exit, and the watcher saw its stream cancelled rather than ended. Here a watch, once
its server is shutting down and it has been told NOT_SERVING, ends (status OK): the
shutdown waits only for the calls that are still doing work.

``Check`` and ``List`` are grpc's own; this class tracks the statuses it was given
(through the public ``set`` and ``enter_graceful_shutdown``) to wake its watchers.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health.aio.HealthServicer):
    """grpc's asyncio health servicer, with watches that end at shutdown (above)."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._closing = False

    async def set(self, service: str, status: int) -> None:
        """Sets ``service``'s status (ignored once shutting down) and tells its watchers."""
        if self._closing:
            return
        await super().set(service, status)
        async with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; each watcher is told, and its stream ends."""
        await super().enter_graceful_shutdown()
        async with self._changed:
            self._closing = True
            self._statuses = dict.fromkeys(self._statuses, _NOT_SERVING)
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:  # noqa: N802 (gRPC's name)
        service, told = request.service, None
        while True:
            status = self._statuses.get(service, _UNKNOWN)
            if status != told:
                # Written outside the lock: a watcher slow to read holds up no one else.
                await context.write(health_pb2.HealthCheckResponse(status=status))
                told = status
            elif self._closing:
                return
            else:
                async with self._changed:
                    await self._changed.wait_for(lambda was=told: self._closing
                                                 or self._statuses.get(service, _UNKNOWN) != was)


__all__ = ["HealthServicer"]
