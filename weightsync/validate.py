"""Checks of request fields that several servers take: one definition each, one
message each. All raise ``InvalidArgument`` (nothing has changed when they do)."""

from __future__ import annotations

from weightsync.errors import InvalidArgument
from weightsync.v1 import common_pb2

MAX_TIMEOUT_S = 24 * 3600.0
MAX_ENGINE_ID_LEN = 128
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


def check_engine_id(engine_id: str) -> str:
    """An engine id: 1-128 printable ASCII characters without spaces (it names the
    engine in keys, logs, metrics labels and certificates)."""
    if not 0 < len(engine_id) <= MAX_ENGINE_ID_LEN or not all(32 < ord(c) < 127 for c in engine_id):
        raise InvalidArgument(f"engine_id must be 1-{MAX_ENGINE_ID_LEN} printable ASCII characters without spaces",
                              metadata={"field": "engine_id"})
    return engine_id


__all__ = ["MAX_TIMEOUT_S", "MAX_ENGINE_ID_LEN", "PAUSE_MODES", "check_timeout", "check_pause_mode", "check_port",
           "check_engine_id"]
