"""TLS, mutual TLS, token auth and per-role certificates, on real servers: strangers are
refused, the right peer is accepted, each role may make only its own calls, and an engine
id cannot be taken over by another address."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import start_agent
from weightsync.client import EngineClient, TrainerClient
from weightsync.engine.model import PRESETS, ReferenceLM
from weightsync.errors import WeightSyncError
from weightsync.lifecycle import spawn, stop_process, wait_for_file, weightsync_command
from weightsync.packing import weights_digest
from weightsync.pki import generate_dev_pki, tls_args
from weightsync.security import Security
from weightsync.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)

TOKEN = "s3cret-token-value-for-tests"


@pytest.fixture
def pki(tmp_path):
    paths = generate_dev_pki(str(tmp_path))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    paths["token"] = str(token_file)
    return paths


def role(pki, name: str, engine_id: str = "", *, token: bool = True) -> Security:
    """The Security of a process holding ``name``'s certificate."""
    key = f"agent_cert:{engine_id}" if name == "agent" else f"{name}_cert"
    return Security.from_files(cert=pki[key], key=pki[key.replace("_cert", "_key")], ca=pki["ca"],
                               token_file=pki["token"] if token else "")


@pytest.fixture
def secure_cluster(tmp_path, pki):
    """Coordinator + one agent, both with mutual TLS and a token."""
    tmp = str(tmp_path)
    log = open(os.path.join(tmp, "coordinator.log"), "w")
    coordinator = spawn(weightsync_command("coordinator", *tls_args(pki, "coordinator", token_file=pki["token"]),
                                           "--listen", "127.0.0.1:0",
                                           "--state-db", os.path.join(tmp, "s.db"), "--port-file",
                                           os.path.join(tmp, "c.addr"), "--heartbeat-interval", "0.2"),
                        stdout=log, stderr=log)
    log.close()
    procs = [coordinator]
    try:
        address = wait_for_file(os.path.join(tmp, "c.addr"), timeout_s=60, proc=coordinator)
        agent = start_agent(tmp, address, "engine-0",
                            *tls_args(pki, "agent", engine_id="engine-0", token_file=pki["token"]), insecure=False)
        procs.append(agent.proc)
        yield address, agent.address, tmp
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def good(pki) -> Security:
    return role(pki, "trainer")


async def test_mutual_tls_and_token_accept_the_right_peer(secure_cluster, pki):
    address, agent_address, tmp = secure_cluster
    model = ReferenceLM(PRESETS["tiny"])
    async with TrainerClient(address, security=good(pki)) as client:
        for _ in range(100):
            state = await client.get_state()
            if state.engines and state.engines[0].available:
                break
        result = await client.update_weights(model.named_parameters(), version=1, timeout_s=60)
        assert result.ok
        state = await client.get_state(include_digests=True)
    assert state.engines[0].weights_digest == weights_digest(model.named_parameters())
    for name in os.listdir(tmp):
        if name.endswith(".log"):
            assert TOKEN not in open(os.path.join(tmp, name)).read(), f"token leaked into {name}"


@pytest.mark.parametrize("who", ["plaintext", "no-client-cert", "stranger-cert", "wrong-ca", "no-token",
                                 "wrong-token"])
async def test_strangers_are_refused(secure_cluster, pki, tmp_path, who):
    address, agent_address, _ = secure_cluster
    wrong_token = tmp_path / "wrong"
    wrong_token.write_text("not-the-token")
    security = {
        "plaintext": Security(token=TOKEN),
        "no-client-cert": Security.from_files(ca=pki["ca"], token_file=pki["token"]),
        "stranger-cert": Security.from_files(cert=pki["stranger_cert"], key=pki["stranger_key"], ca=pki["ca"],
                                             token_file=pki["token"]),
        "wrong-ca": Security.from_files(cert=pki["trainer_cert"], key=pki["trainer_key"], ca=pki["stranger_ca"],
                                        token_file=pki["token"]),
        "no-token": role(pki, "trainer", token=False),
        "wrong-token": Security.from_files(cert=pki["trainer_cert"], key=pki["trainer_key"], ca=pki["ca"],
                                           token_file=str(wrong_token)),
    }[who]
    from weightsync.client import RetryPolicy
    # A TLS handshake the coordinator refuses fails the client's start (it cannot
    # connect: CoordinatorUnavailable); a missing or wrong token, its first call.
    with pytest.raises(WeightSyncError) as info:
        async with TrainerClient(address, security=security, retry=RetryPolicy(max_attempts=1)) as client:
            await client.pause(timeout_s=5)
    expected = "UNAUTHENTICATED" if "token" in who else "UNAVAILABLE"
    assert expected in (info.value.reason, info.value.code.name)
    if "token" not in who:
        assert info.value.reason == "COORDINATOR_UNAVAILABLE" and "TLS settings" in info.value.message
    # the agent refuses commands from anyone without the CA's certificate (and the token) too
    async with EngineClient(agent_address, security=security) as engine:
        with pytest.raises(WeightSyncError):
            await engine.state()


async def test_health_checks_stay_open_without_token(secure_cluster, pki):
    address, _, _ = secure_cluster
    security = role(pki, "trainer", token=False)  # TLS, no token
    async with security.channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc
            await coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetState(coordinator_pb2.GetStateRequest(),
                                                                         timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_servers_refuse_to_start_without_tls_or_explicit_insecure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "coordinator", "--listen", "127.0.0.1:0",
                           "--state-db", str(tmp_path / "s.db")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr


def test_bad_security_options_are_clear_errors(tmp_path, pki):
    for args, message in ((["--tls-cert", pki["coordinator_cert"]], "go together"),
                          (["--tls-cert", "/nope.pem", "--tls-key", "/nope.pem"], "cannot read"),
                          (["--insecure", "--tls-ca", pki["ca"]], "cannot be combined")):
        proc = subprocess.run([sys.executable, "-m", "weightsync", "coordinator", "--listen", "127.0.0.1:0",
                               "--state-db", str(tmp_path / "s.db"), *args], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ----- roles ---------------------------------------------------------------------------

def _denied(info) -> str:
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    return info.value.details()


async def _coordinator_state(pki, address: str) -> coordinator_pb2.GetStateResponse:
    async with role(pki, "trainer").channel(address) as channel:
        return await coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetState(coordinator_pb2.GetStateRequest(), timeout=10)


async def test_each_role_may_call_only_its_own_methods(secure_cluster, pki):
    """The agent obeys only the coordinator; the coordinator takes rounds only from a
    trainer and engine-0's registration and heartbeats only from agent:engine-0."""
    address, agent_address, _ = secure_cluster
    before = next(e for e in (await _coordinator_state(pki, address)).engines if e.engine_id == "engine-0")
    assert before.available and not before.paused and not before.torn

    # a trainer (or another engine's agent) commanding the agent directly
    for caller in (role(pki, "trainer"), role(pki, "agent", "engine-1")):
        async with caller.channel(agent_address) as channel:
            agent = agent_pb2_grpc.EngineAgentServiceStub(channel)
            for call, request in ((agent.PauseEngine, agent_pb2.PauseEngineRequest(idempotency_key="p")),
                                  (agent.Sleep, agent_pb2.SleepRequest(idempotency_key="s"))):
                with pytest.raises(grpc.RpcError) as info:
                    await call(request, timeout=10)
                assert "may be called by coordinator" in _denied(info)
            state = (await agent.GetEngineState(agent_pb2.GetEngineStateRequest(), timeout=10)).state
            assert state.engine_id == "engine-0"  # reads: any role

    # an agent, or the coordinator's own certificate, driving a round
    for caller in (role(pki, "agent", "engine-0"), role(pki, "coordinator")):
        async with caller.channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                await coordinator_pb2_grpc.CoordinatorServiceStub(channel).Pause(
                    coordinator_pb2.PauseRequest(idempotency_key="pause-by-wrong-role"), timeout=10)
            assert "may be called by trainer" in _denied(info)

    # engine-1's agent spoofing engine-0's heartbeat, or re-registering engine-0 elsewhere;
    # the trainer trying the same
    spoofed = common_pb2.EngineState(engine_id="engine-0", faulted=True, torn=True, weight_version=2**64 - 1)
    for caller in (role(pki, "agent", "engine-1"), role(pki, "trainer")):
        async with caller.channel(address) as channel:
            coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                await coordinator.Heartbeat(coordinator_pb2.HeartbeatRequest(state=spoofed), timeout=10)
            _denied(info)
            with pytest.raises(grpc.RpcError) as info:
                await coordinator.RegisterEngine(coordinator_pb2.RegisterEngineRequest(
                    idempotency_key="hijack", engine_id="engine-0", agent_address="127.0.0.1:1"), timeout=10)
            _denied(info)
            with pytest.raises(grpc.RpcError) as info:
                await coordinator.DeregisterEngine(coordinator_pb2.DeregisterEngineRequest(
                    idempotency_key="evict", engine_id="engine-0"), timeout=10)
            _denied(info)

    after = next(e for e in (await _coordinator_state(pki, address)).engines if e.engine_id == "engine-0")
    assert (after.address, after.available, after.paused, after.torn, after.faulted, after.weight_version) == \
        (before.address, True, False, False, False, before.weight_version)
    async with role(pki, "trainer").channel(agent_address) as channel:
        agent = agent_pb2_grpc.EngineAgentServiceStub(channel)
        assert not (await agent.GetEngineState(agent_pb2.GetEngineStateRequest(), timeout=10)).state.paused


async def test_a_certificate_without_a_role_is_refused(secure_cluster, pki, tmp_path):
    """Signed by the right CA, but naming no weightsync role (an old shared node
    certificate): authenticated, yet allowed nothing of weightsync's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from weightsync.pki import CertificateAuthority
    issued = CertificateAuthority(os.path.dirname(pki["ca"])).issue("trainer", name="plain")
    # Re-sign the same key and subject without the URI SAN.
    authority_key = serialization.load_pem_private_key(open(pki["ca_key"], "rb").read(), password=None)
    ca_cert = x509.load_pem_x509_certificate(open(pki["ca"], "rb").read())
    cert = x509.load_pem_x509_certificate(open(issued.cert, "rb").read())
    from cryptography.hazmat.primitives import hashes
    plain = (x509.CertificateBuilder().subject_name(cert.subject).issuer_name(ca_cert.subject)
             .public_key(cert.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(cert.not_valid_before_utc).not_valid_after(cert.not_valid_after_utc)
             .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address(
                 "127.0.0.1"))]), critical=False)
             .sign(authority_key, hashes.SHA256()))
    with open(issued.cert, "wb") as f:
        f.write(plain.public_bytes(serialization.Encoding.PEM))
    security = Security.from_files(cert=issued.cert, key=issued.key, ca=pki["ca"], token_file=pki["token"])
    address, _, _ = secure_cluster
    async with security.channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            await coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetState(coordinator_pb2.GetStateRequest(), timeout=10)
        assert "names no weightsync role" in _denied(info)


def test_a_server_started_with_another_roles_certificate_refuses_to_start(tmp_path, pki):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "coordinator", "--listen", "127.0.0.1:0",
                           "--state-db", str(tmp_path / "s.db"), *tls_args(pki, "trainer")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "names trainer, but this process is coordinator" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "weightsync", "agent", "--coordinator", "127.0.0.1:1",
                           "--engine-id", "engine-1", *tls_args(pki, "agent", engine_id="engine-0")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "names agent:engine-0, but this process is agent:engine-1" in proc.stderr, \
        proc.stderr


def test_pki_cli_makes_a_ca_and_role_certificates(tmp_path):
    from weightsync.roles import identity_from_certificate

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "weightsync", "pki", *args], capture_output=True, text=True,
                              timeout=60)

    directory = str(tmp_path / "ca")
    assert cli("init", directory).returncode == 0
    assert oct(os.stat(os.path.join(directory, "ca-key.pem")).st_mode & 0o777) == "0o600"
    refused = cli("init", directory)
    assert refused.returncode == 2 and "refusing to replace a CA" in refused.stderr
    issued = cli("issue", directory, "--role", "agent", "--engine-id", "gpu-node-3.0", "--host", "10.0.0.7")
    assert issued.returncode == 0, issued.stderr
    identity = identity_from_certificate(open(os.path.join(directory, "agent-gpu-node-3.0.pem"), "rb").read())
    assert (identity.role, identity.engine_id) == ("agent", "gpu-node-3.0")
    for bad, message in ((["--role", "agent"], "needs --engine-id"),
                         (["--role", "trainer", "--engine-id", "x"], "only for the agent role"),
                         (["--role", "agent", "--engine-id", "a/b"], "needs --engine-id")):
        proc = cli("issue", directory, *bad)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert cli("issue", str(tmp_path / "no-ca"), "--role", "trainer").returncode == 2


# ----- engine ids cannot be taken over (any security mode) -----------------------------

def _register(address: str, engine_id: str, agent_address: str, key: str):
    with grpc.insecure_channel(address) as channel:
        return coordinator_pb2_grpc.CoordinatorServiceStub(channel).RegisterEngine(
            coordinator_pb2.RegisterEngineRequest(idempotency_key=key, engine_id=engine_id,
                                                  agent_address=agent_address, model="tiny"), timeout=30)


def test_registrations_cannot_hijack_a_live_engine_or_add_phantoms(cluster):
    """Without certificates anyone with the token may call RegisterEngine: a live id stays
    where it is, an address that does not answer is refused, and a malformed one too."""
    import socket
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    live = cluster.agent("engine-0").address
    for engine_id, agent_address, code, reason in (
            ("engine-0", dead, grpc.StatusCode.FAILED_PRECONDITION, "ENGINE_ID_IN_USE"),
            ("engine-0", cluster.agent("engine-1").address, grpc.StatusCode.FAILED_PRECONDITION, "ENGINE_ID_IN_USE"),
            ("phantom", dead, grpc.StatusCode.FAILED_PRECONDITION, "AGENT_UNREACHABLE"),
            ("phantom", "127.0.0.1\x00:80", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
            ("phantom", "evil host:80", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")):
        with pytest.raises(grpc.RpcError) as info:
            _register(cluster.address, engine_id, agent_address, key=f"{engine_id}-{agent_address}")
        assert info.value.code() == code, info.value
        from weightsync.errors import from_rpc_error
        assert from_rpc_error(info.value).reason == reason
    with grpc.insecure_channel(cluster.address) as channel:
        state = coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetState(coordinator_pb2.GetStateRequest(), timeout=10)
    assert {e.engine_id: e.address for e in state.engines} == {"engine-0": live,
                                                               "engine-1": cluster.agent("engine-1").address}
    assert all(e.available for e in state.engines)
    # the same id from its own address (a restarted agent on the same port) is still welcome
    _register(cluster.address, "engine-0", live, key="same-address")


def test_an_agent_with_a_malformed_engine_id_refuses_to_start(tmp_path):
    """The id is checked where it is given, not first at registration (a coordinator is
    not even needed to see the error)."""
    proc = subprocess.run([sys.executable, "-m", "weightsync", "agent", "--insecure", "--coordinator",
                           "127.0.0.1:1", "--engine-id", "two words"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "engine_id must be" in proc.stderr, proc.stderr
