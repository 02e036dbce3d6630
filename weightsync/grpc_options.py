"""The gRPC options every weightsync server and channel uses.

Shared by the servers and the clients, so it lives in neither: the trainer's client
does not depend on the server packages.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # plans of ~1M tensors fit; tensor bytes never ride gRPC

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),  # retries are ours: keyed, bounded, transient-only
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


__all__ = ["MAX_MESSAGE_BYTES", "SERVER_OPTIONS", "CHANNEL_OPTIONS"]
