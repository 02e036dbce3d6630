"""``listen_on``: a listening socket bound to one host address alone.

Both rendezvous stores (torch's, ``store.py``, and weightsync's authenticated one,
``secure_store.py``) listen through it, so neither imports the other for it.
"""

from __future__ import annotations

import socket

from weightsync.errors import TransferError


def listen_on(host: str) -> socket.socket:
    """A listening socket bound to ``host`` alone, on an ephemeral port; TransferError if
    the name does not resolve or is not an address of this machine."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise TransferError(f"cannot resolve the store host {host!r}: {exc.strerror}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise TransferError(f"cannot listen on {host!r} for the rendezvous store: {exc.strerror}") from None
    return listener


__all__ = ["listen_on"]
