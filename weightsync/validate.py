"""Checks of request fields that several servers take: one definition each, one
message each. All raise ``InvalidArgument`` (nothing has changed when they do)."""

from __future__ import annotations

from weightsync.errors import InvalidArgument
from weightsync.v1 import common_pb2

MAX_TIMEOUT_S = 24 * 3600.0
PAUSE_MODES = (common_pb2.PAUSE_MODE_KEEP, common_pb2.PAUSE_MODE_ABORT, common_pb2.PAUSE_MODE_WAIT)


def check_timeout(value: float, field: str = "timeout_s") -> float:
    """A request's timeout: finite, 0 (server default) .. 24 h."""
    if not (0.0 <= value <= MAX_TIMEOUT_S):  # also false for NaN
        raise InvalidArgument(f"{field} must be between 0 and {MAX_TIMEOUT_S:.0f} seconds, got {value!r}",
                              metadata={"field": field})
    return value


def check_pause_mode(mode: int) -> int:
    """A ``PauseMode`` a server acts on: KEEP, ABORT or WAIT (not UNSPECIFIED)."""
    if mode not in PAUSE_MODES:
        raise InvalidArgument(f"pause mode must be KEEP, ABORT or WAIT, got {mode}")
    return mode


def check_port(port: int, what: str) -> int:
    """A TCP port to connect to: 1..65535."""
    if not 0 < port < 65536:
        raise InvalidArgument(f"{what} must be a port in 1..65535, got {port}")
    return port


__all__ = ["MAX_TIMEOUT_S", "PAUSE_MODES", "check_timeout", "check_pause_mode", "check_port"]
