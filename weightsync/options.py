"""The options of ``weightsync coordinator`` and ``weightsync agent``, with their
defaults, defined once: the CLI takes its defaults from here, and the servers take
these objects. Light to import (the CLI reads it before deciding what to start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightsync.security import Security


@dataclass(frozen=True)
class CoordinatorOptions:
    """Options of ``weightsync coordinator``."""

    listen: str = "127.0.0.1:50051"
    state_db: str = "weightsync-state.db"
    port_file: str = ""
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    shutdown_grace_s: float = 10.0
    idempotency_retention_s: float = 24 * 3600.0
    idempotency_max_records: int = 100_000
    enable_fault_injection: bool = False
    security: Security = field(default_factory=Security)
    metrics_port: int = 0
    catch_up: bool = True                    # bring fenced engines up from a ready peer
    catch_up_bucket_bytes: int = 32 << 20
    catch_up_transport: str = "auto"         # auto: shm between agents on one host, else gloo


@dataclass(frozen=True)
class AgentOptions:
    """Options of ``weightsync agent``."""

    coordinator: str
    engine: str = "reference"
    model: str = "tiny"
    listen: str = "127.0.0.1:0"
    engine_id: str = ""
    port_file: str = ""
    register_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0
    step_delay_s: float = 0.0
    enable_fault_injection: bool = False
    launch: tuple[str, ...] = ()
    health_url: str = ""
    launch_timeout_s: float = 120.0
    engine_url: str = ""
    checkpoint_dir: str = ""
    sglang_flattened: bool = False  # the SGLang engine takes the group transport's flattened layout
    security: Security = field(default_factory=Security)
    metrics_port: int = 0
    ready_port: int = 0
    advertise: str = ""          # the host peers reach this agent at (default: the bound one, or for a
                                 # wildcard bind, this host's address toward the coordinator)
    restart: str = "no"          # a launched engine that fails: "no" or "on-failure" (relaunched)
    max_restarts: int = 3


COORDINATOR_DEFAULTS = CoordinatorOptions()
AGENT_DEFAULTS = AgentOptions(coordinator="")

__all__ = ["CoordinatorOptions", "AgentOptions", "COORDINATOR_DEFAULTS", "AGENT_DEFAULTS"]
