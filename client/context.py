"""The ``async with`` shape the trainer clients share."""

from __future__ import annotations

from typing import Self


class AsyncClient:
    """``async with client:`` awaits ``start()`` (and ``aclose()`` if that fails) on entry
    and ``aclose()`` on exit; subclasses define both."""

    async def start(self) -> Self:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            return await self.start()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


__all__ = ["AsyncClient"]
