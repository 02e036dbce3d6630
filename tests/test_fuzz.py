"""Malformed and random requests to every RPC: a typed error, no crash, state unchanged,
servers still serving (hypothesis, bounded example counts, real servers)."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)

# What a malformed request may get back. Never UNKNOWN or INTERNAL (a crash), never OK.
TYPED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
         grpc.StatusCode.UNAVAILABLE}

bad_keys = st.one_of(st.just(""), st.text(min_size=129, max_size=200), st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=31), min_size=1, max_size=5),
    st.text(alphabet="äöü€\u2028", min_size=1, max_size=5))
good_keys = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64)
bad_timeouts = st.sampled_from([-1.0, math.nan, math.inf, -math.inf, 1e12])
junk_text = st.text(max_size=40)


@st.composite
def junk_plan(draw):
    """Columns that disagree, names that are not names, codes past the table, dims that
    overflow: anything a careless or hostile sender could put in a plan."""
    names = draw(st.lists(junk_text, max_size=5))
    count = draw(st.sampled_from([len(names), len(names) + 1, max(0, len(names) - 1)]))
    ranks = draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))
    dims = draw(st.lists(st.integers(-5, 2**62), max_size=sum(ranks) + 1))
    return common_pb2.WeightPlan(
        names=draw(st.one_of(st.just("\0".join(names).encode()), st.binary(max_size=40))),
        dtypes=bytes(draw(st.lists(st.integers(0, 12), min_size=count, max_size=count))),
        ranks=bytes(ranks), dims=b"".join(d.to_bytes(8, "little", signed=True) for d in dims),
        bucket_bytes=draw(st.integers(0, 2**64 - 1)), total_bytes=draw(st.integers(0, 2**63)),
        plan_id=draw(junk_text))


@st.composite
def poisoned(draw, make, *, key_field=True, timeout_field=True, extra=()):
    """A request with at least one field surely invalid (so nothing may change)."""
    poisons = (["key"] if key_field else []) + (["timeout"] if timeout_field else []) + list(extra)
    poison = draw(st.sampled_from(poisons))
    msg = draw(make)
    if key_field:
        msg.idempotency_key = draw(bad_keys) if poison == "key" else draw(good_keys)
    if poison == "timeout":
        msg.timeout_s = draw(bad_timeouts)
    return msg, poison


coordinator_requests = st.one_of(
    poisoned(st.builds(coordinator_pb2.PauseRequest, mode=st.integers(0, 2**31 - 1), offload_kv=st.booleans()),
             extra=("mode",)).map(lambda m: ("Pause", m)),
    poisoned(st.builds(coordinator_pb2.BroadcastRequest, version=st.integers(0, 2**64 - 1), plan=junk_plan(),
                       transport=st.integers(0, 2**31 - 1), store_host=junk_text,
                       store_port=st.integers(0, 2**32 - 1), trainer_host_id=junk_text,
                       sender_host_ids=st.lists(junk_text, max_size=3))).map(lambda m: ("Broadcast", m)),
    poisoned(st.builds(coordinator_pb2.ResumeRequest, allow_torn=st.booleans())).map(lambda m: ("Resume", m)),
    poisoned(st.builds(coordinator_pb2.RegisterEngineRequest, engine_id=st.just(""), agent_address=junk_text,
                       model=junk_text), timeout_field=False).map(lambda m: ("RegisterEngine", m)),
)

agent_requests = st.one_of(
    poisoned(st.builds(agent_pb2.PauseEngineRequest, mode=st.integers(0, 2**31 - 1)), extra=("mode",)).map(
        lambda m: ("PauseEngine", m)),
    poisoned(st.builds(agent_pb2.ReceiveRequest, version=st.integers(0, 2**64 - 1), plan=junk_plan(),
                       rank=st.integers(0, 2**32 - 1), validate_only=st.booleans())).map(lambda m: ("Receive", m)),
    poisoned(st.builds(agent_pb2.ResumeEngineRequest)).map(lambda m: ("ResumeEngine", m)),
    poisoned(st.builds(agent_pb2.SleepRequest, tags=st.lists(junk_text, max_size=3)), timeout_field=False).map(
        lambda m: ("Sleep", m)),
    poisoned(st.builds(agent_pb2.WakeRequest, tags=st.lists(junk_text, max_size=3)), timeout_field=False).map(
        lambda m: ("Wake", m)),
    poisoned(st.builds(agent_pb2.GenerateRequest, prompt=st.lists(st.integers(-2**31, 2**31 - 1), max_size=5),
                       max_tokens=st.integers(0, 2**32 - 1)), timeout_field=False).map(lambda m: ("Generate", m)),
    st.builds(agent_pb2.GetGenerationRequest, request_id=junk_text, wait_s=bad_timeouts).map(
        lambda m: ("GetGeneration", (m, "wait"))),
)


def fix_poison(method: str, msg, poison: str):
    """Makes the chosen poison certain (e.g. a mode outside KEEP/ABORT/WAIT)."""
    if poison == "mode" and msg.mode in (1, 2, 3):
        msg.mode = 0
    if method in ("Sleep", "Wake") and poison != "key":
        msg.idempotency_key = ""
    if method == "Generate" and poison != "key":
        msg.idempotency_key = ""
    return msg


async def call(stub, method: str, msg):
    rpc = getattr(stub, method)
    if method == "Broadcast":
        async for _ in rpc(msg, timeout=10):
            pass
    else:
        await rpc(msg, timeout=10)


async def snapshot(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        state = await coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetState(
            coordinator_pb2.GetStateRequest(include_digests=True), timeout=30)
    return (state.weight_version, state.round.phase,
            tuple((e.engine_id, e.paused, e.weight_version, e.torn, e.weights_digest, tuple(e.asleep_tags))
                  for e in state.engines))


async def still_serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def fuzz_cluster(cluster_factory):
    return cluster_factory(1)


def test_fuzz_every_rpc(fuzz_cluster):
    cluster = fuzz_cluster
    agent = cluster.agents[0].address
    before = asyncio.run(snapshot(cluster.address))
    seen: dict[str, set] = {}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(target=st.sampled_from(["coordinator", "agent"]), coordinator_req=coordinator_requests,
           agent_req=agent_requests)
    def run(target, coordinator_req, agent_req):
        method, (msg, poison) = coordinator_req if target == "coordinator" else agent_req
        msg = fix_poison(method, msg, poison)
        address = cluster.address if target == "coordinator" else agent

        async def go():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = (coordinator_pb2_grpc.CoordinatorServiceStub(channel) if target == "coordinator"
                        else agent_pb2_grpc.EngineAgentServiceStub(channel))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(stub, method, msg)
                return info.value.code()

        code = asyncio.run(go())
        assert code in TYPED, (target, method, poison, code, msg)
        seen.setdefault(f"{target}.{method}", set()).add(code.name)

    run()
    asyncio.run(still_serving(cluster.address))
    asyncio.run(still_serving(agent))
    assert asyncio.run(snapshot(cluster.address)) == before, "a malformed request changed state"
    assert len(seen) >= 8, seen  # the strategies reached most RPCs


# Bytes that are no valid message of any request type: an invalid wire type, and a
# length-delimited field cut short. Invalid UTF-8 is added where field 1 is a string.
UNDECODABLE = [b"\xff" * 5, b"\x0a\x10abc"]
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def every_rpc() -> list[tuple[str, str, bool, list[bytes]]]:
    """(service, method, server-streaming, undecodable payloads) for every RPC of both services."""
    from google.protobuf.descriptor import FieldDescriptor

    out = []
    for module, service in ((coordinator_pb2, "CoordinatorService"), (agent_pb2, "EngineAgentService")):
        for m in module.DESCRIPTOR.services_by_name[service].methods:
            first = m.input_type.fields_by_number.get(1)
            string_first = first is not None and first.type == FieldDescriptor.TYPE_STRING
            out.append((module.DESCRIPTOR.package + "." + service, m.name, m.server_streaming,
                        UNDECODABLE + ([BAD_UTF8] if string_first else [])))
    return out


def test_undecodable_requests_are_invalid_argument_on_every_rpc(fuzz_cluster):
    from weightsync.errors import from_rpc_error

    cluster = fuzz_cluster
    agent = cluster.agents[0].address
    before = asyncio.run(snapshot(cluster.address))
    rpcs = every_rpc()
    assert len(rpcs) >= 17

    async def go():
        answers = {}
        for service, method, streaming, payloads in rpcs:
            address = cluster.address if service.endswith("CoordinatorService") else agent
            async with grpc.aio.insecure_channel(address) as channel:
                path = f"/{service}/{method}"
                for payload in payloads:
                    if streaming:
                        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            async for _ in call(payload, timeout=10):
                                pass
                    else:
                        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await call(payload, timeout=10)
                    error = from_rpc_error(info.value)
                    answers[(method, payload)] = (info.value.code(), error.reason)
        return answers

    answers = asyncio.run(go())
    wrong = {k: v for k, v in answers.items() if v != (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")}
    assert not wrong, wrong
    asyncio.run(still_serving(cluster.address))
    asyncio.run(still_serving(agent))
    assert asyncio.run(snapshot(cluster.address)) == before, "an undecodable request changed state"


def test_errors_about_huge_fields_are_bounded_and_keep_their_status(fuzz_cluster):
    # A message echoing a 10k-character field went into the status's trailing metadata
    # twice (message and ErrorInfo): grpc answered RESOURCE_EXHAUSTED instead.
    from weightsync.errors import from_rpc_error

    cluster = fuzz_cluster
    huge = "e" * 10_000
    calls = [
        ("coordinator", "DeregisterEngine", coordinator_pb2.DeregisterEngineRequest(idempotency_key="k",
                                                                                    engine_id=huge)),
        ("coordinator", "RegisterEngine", coordinator_pb2.RegisterEngineRequest(
            idempotency_key="k2", engine_id=huge, agent_address="127.0.0.1:1", model="tiny")),
        ("coordinator", "Pause", coordinator_pb2.PauseRequest(idempotency_key=huge)),
        ("agent", "Receive", agent_pb2.ReceiveRequest(idempotency_key="k3", plan=common_pb2.WeightPlan(
            names=huge.encode(), dtypes=b"\0", ranks=b"\1", dims=(1).to_bytes(8, "little"), bucket_bytes=1024))),
    ]

    async def go():
        seen = []
        for target, method, msg in calls:
            address = cluster.address if target == "coordinator" else cluster.agents[0].address
            async with grpc.aio.insecure_channel(address) as channel:
                stub = (coordinator_pb2_grpc.CoordinatorServiceStub(channel) if target == "coordinator"
                        else agent_pb2_grpc.EngineAgentServiceStub(channel))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(stub, method, msg)
            error = from_rpc_error(info.value)
            seen.append((method, info.value.code(), error.reason, len(info.value.details().encode())))
        return seen

    for method, code, reason, message_bytes in asyncio.run(go()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "INVALID_ARGUMENT", (method, code, reason)
        assert message_bytes <= 1024, (method, message_bytes)
    asyncio.run(still_serving(cluster.address))
