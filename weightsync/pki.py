"""Role certificates: a small CA that mints one certificate per weightsync role.

Three roles talk to each other, and each may do different things (see
``weightsync.roles``):

- ``coordinator``: runs rounds; the only caller an agent obeys.
- ``agent:<engine-id>``: one engine's sidecar; the only caller the coordinator accepts
  Register/Heartbeat/Deregister for that engine from.
- ``trainer``: drives Pause/Broadcast/Resume.

A certificate carries its role as a SPIFFE-style URI SAN
(``spiffe://weightsync/agent/engine-0``) and as its common name
(``weightsync-agent:engine-0``). ``weightsync pki init DIR`` makes the CA (``ca.pem``,
``ca-key.pem``); ``weightsync pki issue DIR --role agent --engine-id engine-0`` mints a
certificate signed by it. Keys are written 0600. This is for development and for
small fleets; a site with its own CA issues the same URI SANs from it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from weightsync.errors import InvalidArgument
from weightsync.roles import ROLES, Identity

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
_VALID_DAYS = 30


@dataclass(frozen=True)
class Issued:
    """Paths of one minted certificate and its key."""

    cert: str
    key: str


def _x509():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write(path: str, data: bytes, mode: int = 0o600) -> str:
    """Writes a key (0600) or a certificate (0644: public)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def _name(cn: str):
    x509, *_, NameOID = _x509()
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class CertificateAuthority:
    """A CA on disk: ``ca.pem`` (give it to every process) and ``ca-key.pem`` (keep it)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.ca = os.path.join(directory, "ca.pem")
        self.ca_key = os.path.join(directory, "ca-key.pem")

    @classmethod
    def init(cls, directory: str, *, common_name: str = "weightsync CA") -> CertificateAuthority:
        """Creates a new CA in ``directory`` (refuses to overwrite one)."""
        x509, hashes, serialization, ec, _, _ = _x509()
        authority = cls(directory)
        if os.path.exists(authority.ca_key):
            raise InvalidArgument(f"{authority.ca_key} exists; refusing to replace a CA")
        os.makedirs(directory, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        _write(authority.ca_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        _write(authority.ca, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return authority

    def issue(self, role: str, *, engine_id: str = "", hosts: tuple[str, ...] = DEFAULT_HOSTS,
              name: str = "") -> Issued:
        """Mints a certificate for ``role`` (and ``engine_id`` for an agent), valid as a
        server for ``hosts`` and as a client; writes ``<name>.pem`` and ``<name>-key.pem``."""
        identity = Identity.make(role, engine_id)
        x509, hashes, serialization, ec, EKU, _ = _x509()
        try:
            with open(self.ca, "rb") as f:
                ca_cert = x509.load_pem_x509_certificate(f.read())
            with open(self.ca_key, "rb") as f:
                ca_key = serialization.load_pem_private_key(f.read(), password=None)
        except OSError as exc:
            raise InvalidArgument(f"no CA in {self.directory} ({exc.strerror}); run `weightsync pki init` first") \
                from None
        sans: list = [x509.UniformResourceIdentifier(identity.uri)]
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(identity.common_name)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        base = os.path.join(self.directory, name or identity.file_stem)
        return Issued(cert=_write(f"{base}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644),
                      key=_write(f"{base}-key.pem", key.private_bytes(
                          serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption())))


def generate_dev_pki(directory: str, *, engine_ids: tuple[str, ...] = ("engine-0", "engine-1"),
                     hosts: tuple[str, ...] = DEFAULT_HOSTS) -> dict[str, str]:
    """A throwaway CA in ``directory`` and a certificate per role, for the demo and tests.

    Returns paths: ``ca``; ``coordinator_cert``/``_key``, ``trainer_cert``/``_key``,
    ``agent_cert:<id>``/``agent_key:<id>`` for each of ``engine_ids``; and a pair signed
    by another CA (``stranger_cert``, ``stranger_key``, ``stranger_ca``)."""
    authority = CertificateAuthority.init(directory)
    paths = {"ca": authority.ca, "ca_key": authority.ca_key}
    for role in ("coordinator", "trainer"):
        issued = authority.issue(role, hosts=hosts)
        paths[f"{role}_cert"], paths[f"{role}_key"] = issued.cert, issued.key
    for engine_id in engine_ids:
        issued = authority.issue("agent", engine_id=engine_id, hosts=hosts)
        paths[f"agent_cert:{engine_id}"], paths[f"agent_key:{engine_id}"] = issued.cert, issued.key
    stranger = CertificateAuthority.init(os.path.join(directory, "stranger"), common_name="stranger CA")
    issued = stranger.issue("trainer", hosts=hosts, name="stranger")
    paths.update(stranger_ca=stranger.ca, stranger_cert=issued.cert, stranger_key=issued.key)
    return paths


def tls_args(pki: dict[str, str], role: str, *, engine_id: str = "", token_file: str = "") -> list[str]:
    """Command-line options for a process of ``role`` from ``generate_dev_pki``'s paths."""
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r}")
    if role == "agent":
        cert, key = pki[f"agent_cert:{engine_id}"], pki[f"agent_key:{engine_id}"]
    else:
        cert, key = pki[f"{role}_cert"], pki[f"{role}_key"]
    args = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"]]
    return args + (["--token-file", token_file] if token_file else [])


__all__ = ["CertificateAuthority", "Issued", "generate_dev_pki", "tls_args", "DEFAULT_HOSTS"]
