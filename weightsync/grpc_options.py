"""The gRPC options every weightsync server and channel uses.

Shared by the servers and the clients, so it lives in neither: the trainer's client
does not depend on the server packages.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # plans of ~1M tensors fit; tensor bytes never ride gRPC
# Keepalive: a peer behind a cut link sends no RST, so without pings a call on its
# connection waits out its deadline and the channel stays "ready" on a dead socket for
# as long as TCP's retransmissions take (tens of seconds). Pings every KEEPALIVE_S with a
# KEEPALIVE_TIMEOUT_S answer close such a connection within seconds: its calls fail
# UNAVAILABLE at once and the channel reconnects as soon as the link is back.
KEEPALIVE_S = 2.0
KEEPALIVE_TIMEOUT_S = 2.0

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings (gRPC's default would answer them with GOAWAY).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000 // 2)),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),  # retries are ours: keyed, bounded, transient-only
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


__all__ = ["MAX_MESSAGE_BYTES", "KEEPALIVE_S", "KEEPALIVE_TIMEOUT_S", "SERVER_OPTIONS", "CHANNEL_OPTIONS"]
