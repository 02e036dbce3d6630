"""Prometheus metrics (``--metrics-port``). Names and meanings are listed in docs/guides/operations.md.

Metrics live in the process's default registry; each process exposes its own:
the coordinator its rounds and engines, an agent its loop lag, a trainer its
client-side timings.
"""

from __future__ import annotations

import urllib.request

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.parser import text_string_to_metric_families

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BYTES = tuple(float(2**k) for k in range(20, 42, 2))  # 1 MiB .. 2 TiB

SYNC_SECONDS = Histogram("weightsync_broadcast_seconds", "Broadcast duration (coordinator: rendezvous to result)",
                         buckets=_SECONDS)
SYNC_BYTES = Histogram("weightsync_broadcast_bytes", "Bytes delivered to each engine per broadcast", buckets=_BYTES)
ROUNDS = Counter("weightsync_rounds_total", "Sync round steps by phase and outcome", ["phase", "outcome"])
FAILURES = Counter("weightsync_failures_total", "Engine failures in rounds, by reason", ["operation", "reason"])
ENGINE_TRANSFERS = Counter("weightsync_engine_transfers_total",
                           "Engine receives in broadcasts, by engine, the transport it received over, and outcome",
                           ["engine", "transport", "outcome"])
STATE_UNSAVED = Counter("weightsync_state_unsaved_total",
                        "Changes the coordinator made but could not write to its state database (kept in memory)")
REPLAYS = Counter("weightsync_idempotent_replays_total", "Calls answered from the idempotency store")
ROUND_ID = Gauge("weightsync_round_id", "Id of the current (or last) sync round")
BROADCAST_IN_PROGRESS = Gauge("weightsync_broadcast_in_progress", "1 while a broadcast is moving bytes")
WEIGHT_VERSION = Gauge("weightsync_weight_version", "Current weight version of the coordinator")
ENGINE_VERSION = Gauge("weightsync_engine_weight_version", "Weight version each engine serves", ["engine"])
ENGINE_AVAILABLE = Gauge("weightsync_engine_available", "1 while the engine heartbeats and is healthy", ["engine"])
ENGINE_PAUSED = Gauge("weightsync_engine_paused", "1 while the engine is paused", ["engine"])
ENGINE_TORN = Gauge("weightsync_engine_torn", "1 while the engine holds torn weights", ["engine"])
ENGINE_READY = Gauge("weightsync_engine_ready", "1 while the engine serves the fleet's version (what routers follow)",
                     ["engine"])
ENGINE_VERSIONS_BEHIND = Gauge("weightsync_engine_versions_behind",
                               "the fleet's version minus the engine's (0: current)", ["engine"])
CLIENT_SYNC_SECONDS = Histogram("weightsync_client_sync_seconds", "update_weights duration seen by the trainer",
                                buckets=_SECONDS)
LOOP_LAG_MS = Gauge("weightsync_loop_lag_ms", "Largest event-loop lag of this server process (window: all = since "
                    "start, recent = the last 10 s, round = since its last round began)", ["process", "window"])
GC_FULL_PAUSE_MS = Gauge("weightsync_gc_full_pause_ms", "Longest full garbage collection (generation 2) of this "
                         "server process since start; it stops the event loop for that long", ["process"])
GC_FROZEN_OBJECTS = Gauge("weightsync_gc_frozen_objects", "Objects of the server's start-up heap that full "
                          "collections no longer walk (gc.freeze)", ["process"])
CLIENT_LOOP_LAG_MS = Gauge("weightsync_trainer_loop_lag_ms", "Trainer event-loop lag during the last sync",
                           ["stat"])


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics on ``host:port`` from a background thread."""
    start_http_server(port, addr=host)


def sample(port: int, name: str, *, host: str = "127.0.0.1", timeout_s: float = 10.0, **labels: str) -> float:
    """One sample of a metric that a process serves on ``host:port`` (``serve``);
    LookupError if it exports none with those labels."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise LookupError(f"{name}{labels} is not exported on port {port}")


__all__ = ["serve", "sample", "SYNC_SECONDS", "SYNC_BYTES", "ENGINE_TRANSFERS", "ROUNDS", "ROUND_ID", "BROADCAST_IN_PROGRESS", "FAILURES", "REPLAYS", "WEIGHT_VERSION",
           "ENGINE_VERSION", "ENGINE_AVAILABLE", "ENGINE_PAUSED", "ENGINE_TORN", "ENGINE_READY",
           "ENGINE_VERSIONS_BEHIND", "CLIENT_SYNC_SECONDS",
           "CLIENT_LOOP_LAG_MS"]
