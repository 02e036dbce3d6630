"""TLS, mutual TLS and token auth refuse strangers and accept the right peer, on real servers."""

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
from weightsync.plan import weights_digest
from weightsync.security import Security, generate_dev_pki

TOKEN = "s3cret-token-value-for-tests"


@pytest.fixture
def pki(tmp_path):
    paths = generate_dev_pki(str(tmp_path))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    paths["token"] = str(token_file)
    return paths


def tls_args(pki, *, mutual: bool = True, token: bool = True) -> list[str]:
    args = ["--tls-cert", pki["cert"], "--tls-key", pki["key"]]
    if mutual:
        args += ["--tls-ca", pki["ca"]]
    if token:
        args += ["--token-file", pki["token"]]
    return args


@pytest.fixture
def secure_cluster(tmp_path, pki):
    """Coordinator + one agent, both with mutual TLS and a token."""
    tmp = str(tmp_path)
    log = open(os.path.join(tmp, "coordinator.log"), "w")
    coordinator = spawn(weightsync_command("coordinator", *tls_args(pki), "--listen", "127.0.0.1:0",
                                           "--state-db", os.path.join(tmp, "s.db"), "--port-file",
                                           os.path.join(tmp, "c.addr"), "--heartbeat-interval", "0.2"),
                        stdout=log, stderr=log)
    log.close()
    procs = [coordinator]
    try:
        address = wait_for_file(os.path.join(tmp, "c.addr"), timeout_s=60, proc=coordinator)
        agent = start_agent(tmp, address, "engine-0", *tls_args(pki), insecure=False)
        procs.append(agent.proc)
        yield address, agent.address, tmp
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def good(pki) -> Security:
    return Security.from_files(cert=pki["cert"], key=pki["key"], ca=pki["ca"], token_file=pki["token"])


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
        "wrong-ca": Security.from_files(cert=pki["cert"], key=pki["key"], ca=pki["stranger_ca"],
                                        token_file=pki["token"]),
        "no-token": Security.from_files(cert=pki["cert"], key=pki["key"], ca=pki["ca"]),
        "wrong-token": Security.from_files(cert=pki["cert"], key=pki["key"], ca=pki["ca"],
                                           token_file=str(wrong_token)),
    }[who]
    from weightsync.client import RetryPolicy
    async with TrainerClient(address, security=security, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(WeightSyncError) as info:
            await client.pause(timeout_s=5)
    expected = "UNAUTHENTICATED" if "token" in who else "UNAVAILABLE"
    assert expected in (info.value.reason, info.value.code.name)
    # the agent refuses commands from anyone without the CA's certificate (and the token) too
    async with EngineClient(agent_address, security=security) as engine:
        with pytest.raises(WeightSyncError):
            await engine.state()


async def test_health_checks_stay_open_without_token(secure_cluster, pki):
    address, _, _ = secure_cluster
    security = Security.from_files(cert=pki["cert"], key=pki["key"], ca=pki["ca"])  # TLS, no token
    async with security.channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc
            await coordinator_pb2_grpc.CoordinatorStub(channel).GetState(coordinator_pb2.GetStateRequest(),
                                                                         timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_servers_refuse_to_start_without_tls_or_explicit_insecure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "coordinator", "--listen", "127.0.0.1:0",
                           "--state-db", str(tmp_path / "s.db")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr


def test_bad_security_options_are_clear_errors(tmp_path, pki):
    for args, message in ((["--tls-cert", pki["cert"]], "go together"),
                          (["--tls-cert", "/nope.pem", "--tls-key", "/nope.pem"], "cannot read"),
                          (["--insecure", "--tls-ca", pki["ca"]], "cannot be combined")):
        proc = subprocess.run([sys.executable, "-m", "weightsync", "coordinator", "--listen", "127.0.0.1:0",
                               "--state-db", str(tmp_path / "s.db"), *args], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
