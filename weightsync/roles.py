"""Who may call what: the three roles, how a peer's role is read from its certificate,
and the policy both servers enforce under mutual TLS.

| service | method | allowed callers |
|---|---|---|
| CoordinatorService | Pause, Broadcast, Resume | ``trainer`` |
| CoordinatorService | RegisterEngine, Heartbeat, DeregisterEngine for engine X | ``agent:X`` only |
| CoordinatorService | GetState, WatchEvents | any role |
| EngineAgentService | PauseEngine, Receive, ResumeEngine, Sleep, Wake, Export | ``coordinator`` |
| EngineAgentService | GetEngineState, GetEvents, Generate, GetGeneration | any role |

A peer's role is its certificate's ``spiffe://weightsync/...`` URI SAN (see
``weightsync.pki``). Without mutual TLS there is no certificate to read, and this
policy cannot apply: docs/guides/security.md says what is then left unprotected.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from weightsync.errors import InvalidArgument

ROLES = ("coordinator", "agent", "trainer")
URI_PREFIX = "spiffe://weightsync/"
ANY_ROLE = frozenset(ROLES)
# Engine ids as the coordinator accepts them (errors.py/validation bound them the same way).
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class Identity:
    """A role, and for an agent the engine it speaks for."""

    role: str
    engine_id: str = ""

    @classmethod
    def make(cls, role: str, engine_id: str = "") -> Identity:
        """Checked constructor: InvalidArgument for an unknown role or a bad engine id."""
        if role not in ROLES:
            raise InvalidArgument(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        if role == "agent":
            if not _ENGINE_ID.fullmatch(engine_id or ""):
                raise InvalidArgument("an agent's certificate needs --engine-id "
                                      "(letters, digits, '.', '_', ':', '-'; at most 128)")
        elif engine_id:
            raise InvalidArgument(f"--engine-id is only for the agent role, not {role}")
        return cls(role, engine_id)

    @property
    def uri(self) -> str:
        return URI_PREFIX + (f"agent/{self.engine_id}" if self.role == "agent" else self.role)

    @property
    def common_name(self) -> str:
        return f"weightsync-agent:{self.engine_id}" if self.role == "agent" else f"weightsync-{self.role}"

    @property
    def file_stem(self) -> str:
        return f"agent-{self.engine_id}" if self.role == "agent" else self.role

    def __str__(self) -> str:
        return f"agent:{self.engine_id}" if self.role == "agent" else self.role

    @classmethod
    def from_uri(cls, uri: str) -> Identity | None:
        if not uri.startswith(URI_PREFIX):
            return None
        rest = uri[len(URI_PREFIX):]
        if rest.startswith("agent/"):
            engine_id = rest[len("agent/"):]
            return cls("agent", engine_id) if _ENGINE_ID.fullmatch(engine_id) else None
        return cls(rest) if rest in ("coordinator", "trainer") else None


@functools.lru_cache(maxsize=256)
def identity_from_certificate(pem: bytes) -> Identity | None:
    """The role a PEM certificate carries in its URI SANs, or None (no weightsync role,
    or more than one: a certificate must name exactly one). Remembered per certificate:
    every call of a peer (heartbeats twice a second) presents the same one."""
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    found = {i for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
             if (i := Identity.from_uri(uri)) is not None}
    return found.pop() if len(found) == 1 else None


def peer_identity(auth_context: dict) -> Identity | None:
    """The calling peer's role from grpc's auth context (its verified certificate)."""
    pems = auth_context.get("x509_pem_cert") or []
    return identity_from_certificate(pems[0]) if pems else None


_TRAINER = frozenset({"trainer"})
_COORDINATOR = frozenset({"coordinator"})
_AGENT = frozenset({"agent"})

# Full method name -> roles allowed. A weightsync method missing here is refused.
POLICY: dict[str, frozenset[str]] = {
    "/weightsync.v1.CoordinatorService/Pause": _TRAINER,
    "/weightsync.v1.CoordinatorService/Broadcast": _TRAINER,
    "/weightsync.v1.CoordinatorService/Resume": _TRAINER,
    "/weightsync.v1.CoordinatorService/RegisterEngine": _AGENT,
    "/weightsync.v1.CoordinatorService/Heartbeat": _AGENT,
    "/weightsync.v1.CoordinatorService/DeregisterEngine": _AGENT,
    "/weightsync.v1.CoordinatorService/GetState": ANY_ROLE,
    "/weightsync.v1.CoordinatorService/WatchEvents": ANY_ROLE,
    "/weightsync.v1.EngineAgentService/PauseEngine": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/Receive": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/ResumeEngine": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/Sleep": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/Wake": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/Export": _COORDINATOR,
    "/weightsync.v1.EngineAgentService/GetEngineState": ANY_ROLE,
    "/weightsync.v1.EngineAgentService/GetEvents": ANY_ROLE,
    "/weightsync.v1.EngineAgentService/Generate": ANY_ROLE,
    "/weightsync.v1.EngineAgentService/GetGeneration": ANY_ROLE,
}


def _engine_of(method: str, request) -> str | None:
    """The engine an agent-only call speaks for (None: the method names none)."""
    if method.endswith("/Heartbeat"):
        return request.state.engine_id
    if method.endswith(("/RegisterEngine", "/DeregisterEngine")):
        return request.engine_id
    return None


def refusal(method: str, request, identity: Identity | None) -> str:
    """Why ``identity`` may not make this call ("" when it may)."""
    if not method.startswith("/weightsync."):
        return ""  # health and reflection: read-only, open to every authenticated peer
    allowed = POLICY.get(method)
    short = method.rsplit("/", 1)[-1]
    if allowed is None:
        return f"{short} is not in the role policy"
    if identity is None:
        return f"{short}: the caller's certificate names no weightsync role (spiffe://weightsync/...)"
    if identity.role not in allowed:
        return f"{short} may be called by {' or '.join(sorted(allowed))}, not by {identity}"
    engine_id = _engine_of(method, request)
    if engine_id is not None and engine_id != identity.engine_id:
        return f"{short} for engine {engine_id[:128]!r} may come only from agent:{engine_id[:128]}, not {identity}"
    return ""


__all__ = ["ROLES", "Identity", "POLICY", "identity_from_certificate", "peer_identity", "refusal"]
