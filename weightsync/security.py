"""Transport security and authentication for every weightsync channel and server.

- TLS: ``--tls-cert``/``--tls-key`` on a server; with ``--tls-ca`` the server also
  demands a client certificate signed by that CA (mutual TLS), so an agent obeys
  only a coordinator holding such a certificate. Clients use the same three files:
  the CA to check the server, cert and key to present themselves.
- Token: an optional shared secret (``--token-file`` or ``WEIGHTSYNC_TOKEN``) sent as
  ``authorization: Bearer <token>`` on every call and checked by a server
  interceptor in constant time; health checks stay open. Tokens are never logged.
- Roles: under mutual TLS each certificate names one role (``weightsync.pki``), and
  both servers enforce ``weightsync.roles``' policy on it.
- Plaintext only when asked for (``--insecure``), with a warning.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass

import grpc

from weightsync.errors import InvalidArgument

log = logging.getLogger("weightsync.security")
TOKEN_ENV = "WEIGHTSYNC_TOKEN"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


_WARNED_PLAINTEXT: list[bool] = []  # the plaintext warning was logged (once per process)


@dataclass(frozen=True)
class Security:
    """How one process talks and listens: TLS material, token, or explicit plaintext."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None
    insecure: bool = False

    def __repr__(self) -> str:  # never print the token or the key
        return (f"Security(tls={self.tls}, mutual={self.ca is not None and self.cert is not None}, "
                f"token={'set' if self.token else 'none'}, insecure={self.insecure})")

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual(self) -> bool:
        """Both sides present certificates: the peer's role can be read and enforced."""
        return self.cert is not None and self.ca is not None

    def require_role(self, role: str, engine_id: str = "") -> None:
        """Under mutual TLS, this process's own certificate must carry ``role`` (and
        ``engine_id``): started with another role's certificate, every peer would refuse
        it, so refuse to start with a clear error instead."""
        if not self.mutual:
            return
        from weightsync.roles import Identity, identity_from_certificate
        mine = identity_from_certificate(self.cert)
        wanted = Identity(role, engine_id)
        if mine != wanted:
            raise InvalidArgument(f"--tls-cert names {mine or 'no weightsync role'}, but this process is {wanted}; "
                                  f"mint one with `weightsync pki issue --role {role}"
                                  f"{' --engine-id ' + engine_id if engine_id else ''}`")

    @classmethod
    def from_files(cls, *, cert: str = "", key: str = "", ca: str = "", token_file: str = "",
                   insecure: bool = False) -> Security:
        """Reads the files named on the command line; InvalidArgument on bad combinations."""
        if bool(cert) != bool(key):
            raise InvalidArgument("--tls-cert and --tls-key go together")
        if insecure and (cert or ca):
            raise InvalidArgument("--insecure cannot be combined with TLS options")

        def read(path: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None

        token = None
        if token_file:
            token = (read(token_file) or b"").decode().strip()
        elif os.environ.get(TOKEN_ENV):
            token = os.environ[TOKEN_ENV].strip()
        if token == "":
            raise InvalidArgument("the token is empty")
        return cls(read(cert), read(key), read(ca), token, insecure)

    def require_server_mode(self) -> None:
        """A server must be told TLS or plaintext explicitly."""
        if self.cert is None and not self.insecure:
            raise InvalidArgument("a server needs --tls-cert/--tls-key, or --insecure to serve plaintext")
        if self.insecure and not _WARNED_PLAINTEXT:
            # Once per process: the command line checks this, and so does the server it starts.
            _WARNED_PLAINTEXT.append(True)
            log.warning("serving WITHOUT TLS (--insecure): anyone who can reach this port can talk to it%s",
                        "" if self.token else " and no token is required")

    # ----- servers ------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        """Binds ``listen`` with TLS (mutual when a CA is set) or plaintext."""
        if self.cert is not None:
            creds = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                                require_client_auth=self.ca is not None)
            return server.add_secure_port(listen, creds)
        return server.add_insecure_port(listen)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenAuthInterceptor(self.token)] if self.token else []

    # ----- clients ------------------------------------------------------------------

    def channel(self, address: str, *, options=None) -> grpc.aio.Channel:
        """An aio channel to ``address`` with this process's credentials."""
        interceptors = [_TokenUnary(self.token), _TokenStream(self.token)] if self.token else None
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                 certificate_chain=self.cert)
            return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


INSECURE = Security(insecure=True)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC without the right bearer token (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return await continuation(handler_call_details)
        return _deny(await continuation(handler_call_details))


def _deny(handler):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                 handler.response_serializer)


def _with_token(details, token: str):
    metadata = list(details.metadata or ())
    metadata.append(("authorization", f"Bearer {token}"))
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else \
        grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                   details.wait_for_ready)


class _TokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _TokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


__all__ = ["Security", "INSECURE", "TokenAuthInterceptor", "TOKEN_ENV"]
