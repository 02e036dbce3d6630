"""gloo, shm and group transports: sender and receivers in threads of one process, real
sockets and real shared memory (the cross-process path is covered by test_e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from weightsync import transport as transports
from weightsync.errors import StepTimeoutError, TransferError
from weightsync.plan import BucketPlan
from weightsync.transport.shm import SHM_DIR
from weightsync.transport.store import host_store, session_key
from weightsync.v1 import common_pb2

KINDS = {"gloo": common_pb2.TRANSPORT_KIND_GLOO, "shm": common_pb2.TRANSPORT_KIND_SHM,
         "group": common_pb2.TRANSPORT_KIND_GROUP}
STATE = {"gloo": lambda s: s._group, "shm": lambda s: s._segment, "group": lambda s: s._joined}


def rendezvous(store, kind, world, group="g1"):
    return common_pb2.Rendezvous(group_id=group, transport=kind, store_host="127.0.0.1", store_port=store.port,
                                 world_size=world, session_id=uuid.uuid4().hex)


def run_round(sender, receivers, rdzv, plan, sources, *, timeout_s=20.0, fail_rank=None, targets=None):
    """One round in threads; returns (each receiver's targets, errors by rank). ``targets``:
    each receiver's own (default: zeros shaped like the plan). Every end that finishes
    must report how long it took (``TransferStats.seconds``) within the round's wall time."""
    if targets is None:
        targets = [[torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots] for _ in receivers]
    errors: dict[int, BaseException] = {}
    stats = {}

    def receive(rank):
        try:
            if rank == fail_rank:
                raise RuntimeError("injected receiver failure")
            stats[rank] = receivers[rank - 1].receive(rdzv, rank, plan, targets[rank - 1],
                                                      deadline_at=time.monotonic() + timeout_s,
                                                      abort=threading.Event())
        except BaseException as exc:
            errors[rank] = exc

    began = time.monotonic()
    threads = [threading.Thread(target=receive, args=(r,)) for r in range(1, len(receivers) + 1)]
    for t in threads:
        t.start()
    try:
        stats[0] = sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + timeout_s,
                               abort=threading.Event())
    finally:
        for t in threads:
            t.join(timeout_s + 5)
    took = time.monotonic() - began
    for rank, stat in stats.items():
        if stat is not None:
            assert 0.0 <= stat.seconds <= took, f"rank {rank} reports {stat.seconds} s of a {took:.3f} s round"
    return targets, errors


@pytest.mark.parametrize("name", ["gloo", "shm", "group"])
def test_rounds_are_bitwise_and_reuse_the_group(name):
    kind = KINDS[name]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receivers = [transports.make_receiver(kind) for _ in range(2)]
    sources = [torch.randn(33, 17), torch.randn(1000), torch.arange(77, dtype=torch.int64)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=1024)
    assert plan.num_buckets > 4
    try:
        first_state = None
        for step in range(3):
            for s in sources:
                s.add_(1) if s.dtype != torch.int64 else s.add_(step)
            targets, errors = run_round(sender, receivers, rendezvous(store, kind, 3), plan, sources)
            assert errors == {}
            for out in targets:
                for a, b in zip(out, sources, strict=True):
                    assert torch.equal(a, b)
            state = STATE[name](sender)
            first_state = first_state or state
            assert state is first_state, "the group/segment must be set up once and reused"
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.parametrize("name", ["gloo", "shm", "group"])
def test_missing_receiver_times_out_with_named_operation(name):
    kind = KINDS[name]
    store = host_store("127.0.0.1", timeout_s=5)
    sender = transports.make_sender(kind, store)
    plan = BucketPlan.from_tensors([("t", torch.randn(4096))], bucket_bytes=1024)
    rdzv = rendezvous(store, kind, 2, group=f"lonely-{name}")
    started = time.monotonic()
    with pytest.raises((StepTimeoutError, TransferError)) as info:
        sender.send(rdzv, plan, [torch.randn(4096)], deadline_at=time.monotonic() + 1.0, abort=threading.Event())
    assert time.monotonic() - started < 15, "a dead peer must become an error within the deadline"
    if isinstance(info.value, StepTimeoutError):
        assert info.value.operation in ("broadcast", "gloo group setup")
    sender.close()


def test_shm_receiver_failure_stops_the_sender_at_once():
    kind = KINDS["shm"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receivers = [transports.make_receiver(kind) for _ in range(2)]
    sources = [torch.randn(64 * 1024)]
    plan = BucketPlan.from_tensors([("t", sources[0])], bucket_bytes=4096)
    started = time.monotonic()

    class Failing:
        def receive(self, rdzv, rank, plan, targets, *, deadline_at, abort):
            # acknowledge nothing and report failure, as a crashing engine's agent would
            from weightsync.transport.store import connect_store
            s = connect_store(rdzv.store_host, rdzv.store_port, deadline_at=time.monotonic() + 5)
            s.set(f"ws/{rdzv.group_id}/{rdzv.session_id}/err/{rank}", "boom")

        def close(self):
            pass

    with pytest.raises(TransferError, match="boom"):
        run_round(sender, [receivers[0], Failing()], rendezvous(store, kind, 3), plan, sources, timeout_s=30)
    assert time.monotonic() - started < 10
    sender.close()
    receivers[0].close()


def test_shm_segment_is_removed_on_close():
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["shm"], store)
    receiver = transports.make_receiver(KINDS["shm"])
    sources = [torch.randn(100)]
    plan = BucketPlan.from_tensors([("t", sources[0])], bucket_bytes=128)
    run_round(sender, [receiver], rendezvous(store, KINDS["shm"], 2), plan, sources)
    path = sender._segment.path
    assert os.path.exists(path) and path.startswith(SHM_DIR)
    sender.close()
    receiver.close()
    assert not os.path.exists(path)


def test_availability_probes():
    assert transports.available(common_pb2.TRANSPORT_KIND_GLOO)
    assert transports.available(common_pb2.TRANSPORT_KIND_SHM)
    reason = transports.unavailable_reason(common_pb2.TRANSPORT_KIND_NCCL)
    if reason is not None:
        assert isinstance(reason, str) and reason
    with pytest.raises(Exception, match="unknown transport"):
        transports.kind_from_name("carrier-pigeon")


def _pieces_of(plan, bucket, index):
    return [p for _, _, p in plan.bucket_ops(bucket) if p is not None and p.tensor_index == index]


def test_gloo_sends_large_tensors_from_and_into_the_tensors_and_packs_only_small_ones():
    """Every piece of 1 MiB or more is a broadcast of its own, from the trainer's tensor
    into the engine's (no bucket copy on either side); small tensors go packed; a cast
    (the sender packs) or a target that cannot take bytes (non-contiguous: staged, then
    copied) still lands bitwise, on the same wire ranges."""
    from weightsync.transport.gloo import _wire_bytes

    kind = KINDS["gloo"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receiver = transports.make_receiver(kind)
    # small, large whole in bucket 0, small, large spanning buckets 0-2, small
    sources = [torch.randn(3), torch.randn(512, 768), torch.randn(5), torch.randn(1536 * 1024), torch.randn(7)]
    named = [(f"t{i}", t) for i, t in enumerate(sources)]
    try:
        plan = BucketPlan.from_tensors(named, bucket_bytes=4 << 20)
        assert _pieces_of(plan, 0, 1) and all(_pieces_of(plan, b, 3) for b in range(plan.num_buckets))
        # bucket 0's two small runs (t0 before t1, t2 between t1 and t3) go as one broadcast
        assert len(plan.wire_ops(0).gathered) == 2 and len(plan.wire_ops(0).ops) == 2
        assert not any(_pieces_of(plan, b, i) for b in range(plan.num_buckets) for i in (0, 2, 4))
        piece = _pieces_of(plan, 0, 1)[0]
        view = _wire_bytes(sources[1], plan.dtypes[1], piece)
        assert view is not None and view.data_ptr() == sources[1].data_ptr()  # no copy: the tensor itself
        targets = [torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots]
        # a transposed target cannot take the wire's bytes: staged and copied
        targets[1] = torch.zeros(768, 512).t()
        assert not targets[1].is_contiguous() and _wire_bytes(targets[1], plan.dtypes[1], piece) is None
        before = [t.data_ptr() for t in targets]
        got, errors = run_round(sender, [receiver], rendezvous(store, kind, 2, group="large"), plan, sources,
                                targets=[targets])
        assert errors == {}
        assert [t.data_ptr() for t in got[0]] == before  # landed in the engine's own tensors
        for t, src in zip(got[0], sources, strict=True):
            assert torch.equal(t, src)

        # Cast on the wire: fp32 sources are packed as bf16, bf16 targets take bytes directly.
        cast = BucketPlan.from_tensors(named, bucket_bytes=4 << 20, wire_dtype=torch.bfloat16)
        assert _wire_bytes(sources[3], cast.dtypes[3], _pieces_of(cast, 0, 3)[0]) is None
        got, errors = run_round(sender, [receiver], rendezvous(store, kind, 2, group="cast"), cast, sources)
        assert errors == {}
        for t, src in zip(got[0], sources, strict=True):
            assert torch.equal(t, src.to(torch.bfloat16))
    finally:
        sender.close()
        receiver.close()


def test_a_trainer_that_cuts_buckets_differently_is_refused_before_any_byte(monkeypatch):
    """gloo pairs the n-th broadcast of each side whatever their lengths, so a trainer of
    another release (another cut of the buckets) would move wrong bytes silently. The
    receiver checks the trainer's named wire format first: a typed error naming both,
    the targets untouched, and the trainer stopped at once (not at its deadline)."""
    from weightsync.transport import gloo

    monkeypatch.setattr(gloo, "announce_wire_format",
                        lambda store, rdzv: store.set(session_key(rdzv, "gloo-wire"), b"buckets-v0"))
    kind = KINDS["gloo"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receiver = transports.make_receiver(kind)
    sources = [torch.randn(300_000), torch.randn(7)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=1 << 20)
    targets = [[torch.full(s.shape, 5.0) for s in plan.slots]]
    rdzv = rendezvous(store, kind, 2, group="wire")
    try:
        start = time.monotonic()
        with pytest.raises(TransferError):
            run_round(sender, [receiver], rdzv, plan, sources, targets=targets, timeout_s=30)
        assert time.monotonic() - start < 15
    finally:
        sender.close()
        receiver.close()
    error = store.get(session_key(rdzv, "err", 1)).decode()
    assert "buckets-v0" in error and gloo.WIRE_FORMAT.decode() in error
    assert all(torch.all(t == 5.0) for t in targets[0])


def _two_rounds_against_the_sglang_recipe(prefix: str, sources, layout: str, receive_round) -> None:
    """The group sender, two rounds (every source changed each time) against a
    receiver that joins as SGLang does (torch's rendezvous and group helper, see
    tests/sglang_standin.py) and runs ``receive_round(plan, pg)`` per round; then every
    tensor the stand-in loaded must equal the trainer's."""
    from tests.sglang_standin import join_update_group, params
    from weightsync.transport.group import group_name

    kind = KINDS["group"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    named = [(f"{prefix}{i}", t) for i, t in enumerate(sources)]
    plan = BucketPlan.from_tensors(named, bucket_bytes=1024)
    rdzv = rendezvous(store, kind, 2, group=f"{prefix}-{uuid.uuid4().hex[:6]}")
    rdzv.group_layout = layout
    for name, t in named:
        params[name] = torch.zeros_like(t)
    errors: list[BaseException] = []
    steps = threading.Semaphore(0)

    def engine():
        try:
            pg = join_update_group("127.0.0.1", store.port, 1, 2, group_name(rdzv), "gloo")
            for _ in range(2):
                steps.acquire(timeout=20)
                receive_round(plan, pg)
        except BaseException as exc:
            errors.append(exc)
            store.set(f"ws/{rdzv.group_id}/{rdzv.session_id}/err/1", repr(exc))  # the sender stops at once

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for _ in range(2):
            for s in sources:
                s.logical_not_() if s.dtype == torch.bool else s.add_(1)
            steps.release()
            sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 20, abort=threading.Event())
    finally:
        thread.join(30)
        sender.close()
    assert errors == []
    for name, source in named:
        assert torch.equal(params[name], source)


def _sglang_specs(slots) -> tuple[list, list, list]:
    """What an update call names: the tensors' names, dtypes (SGLang's strings), shapes."""
    return [s.name for s in slots], [str(s.dtype).removeprefix("torch.") for s in slots], [list(s.shape) for s in slots]


def test_group_sender_speaks_the_recipe_sglang_joins_with():
    """The group transport's sender against SGLang's recipe, a broadcast per tensor: two
    rounds on one group, bitwise, with a bfloat16 tensor among them."""
    from tests.sglang_standin import receive_and_load

    _two_rounds_against_the_sglang_recipe(
        "recipe", [torch.randn(33, 17), torch.randn(1000).to(torch.bfloat16), torch.arange(77)], "tensors",
        lambda plan, pg: receive_and_load(*_sglang_specs(plan.slots), [pg]))  # one tp worker


def _mixed_sources():
    """Tensors whose bytes end to end put some at offsets their element size does not
    divide (an odd count of bfloat16 before float32 and int64), one larger than the
    test's bucket, empty ones, a bool one; the last call is one empty tensor (a
    broadcast of no bytes)."""
    return [torch.randn(33, 17), torch.randn(1001).to(torch.bfloat16), torch.arange(77, dtype=torch.int64),
            torch.randn(3).to(torch.bfloat16), torch.randn(5), torch.randn(700), torch.empty(0),
            torch.tensor([True, False, True]), torch.randn(2, 3), torch.randn(3).to(torch.bfloat16),
            torch.empty(0, 4)]


def test_the_flattened_layout_cuts_runs_sglang_can_view():
    """Calls are runs of consecutive tensors of at most a bucket (a larger tensor alone),
    and every tensor starts in its call at a multiple of its element size."""
    from weightsync.dtypes import ITEMSIZE
    from weightsync.transport.flattened import flattened_calls

    sources = _mixed_sources()
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=1024)
    calls = flattened_calls(plan)
    assert [i for first, end in calls.bounds for i in range(first, end)] == list(range(len(sources)))
    assert len(calls.bounds) < len(sources)
    for call, (first, end) in enumerate(calls.bounds):
        assert end - first == 1 or calls.nbytes(call) <= plan.bucket_bytes
        for i in range(first, end):
            assert (calls.starts[i] - calls.starts[first]) % ITEMSIZE[plan.dtypes[i]] == 0
    assert any(end - first == 1 and calls.nbytes(c) > 1024 for c, (first, end) in enumerate(calls.bounds))
    assert calls.bounds[-1] == (len(sources) - 1, len(sources)) and calls.nbytes(len(calls.bounds) - 1) == 0
    # cut for alignment, not size: t1 (2002 bytes) leaves t2 (int64) misaligned
    assert (2, 3) in calls.bounds or any(first == 2 for first, _ in calls.bounds)


def test_the_flattened_layout_is_bitwise_with_casts_and_staged_targets():
    """The group transport's flattened layout: three rounds on one group to two
    receivers, bitwise; one receiver's targets include a transposed tensor (staged,
    copied after); then the same plan cast on the wire (fp32 -> bf16)."""
    kind = KINDS["group"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receivers = [transports.make_receiver(kind) for _ in range(2)]
    sources = _mixed_sources()
    named = [(f"t{i}", t) for i, t in enumerate(sources)]
    plan = BucketPlan.from_tensors(named, bucket_bytes=1024)
    try:
        for _ in range(3):
            for s in sources:
                if s.is_floating_point():
                    s.add_(1)
            rdzv = rendezvous(store, kind, 3, group="flat")
            rdzv.group_layout = "flattened"
            targets = [[torch.zeros(sl.shape, dtype=sl.dtype) for sl in plan.slots] for _ in receivers]
            targets[1][0] = torch.zeros(17, 33).t()  # cannot take the wire's bytes: staged
            got, errors = run_round(sender, receivers, rdzv, plan, sources, targets=targets)
            assert errors == {}
            for out in got:
                for a, b in zip(out, sources, strict=True):
                    assert torch.equal(a, b)
        cast = BucketPlan.from_tensors(named, bucket_bytes=1024, wire_dtype=torch.bfloat16)
        rdzv = rendezvous(store, kind, 3, group="flat")
        rdzv.group_layout = "flattened"
        got, errors = run_round(sender, receivers, rdzv, cast, sources)
        assert errors == {}
        for out in got:
            for a, b in zip(out, sources, strict=True):
                assert torch.equal(a, b.to(torch.bfloat16) if b.is_floating_point() else b)
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_the_flattened_layout_is_what_sglangs_flattened_bucket_receives():
    """The sender's flattened layout against a receiver that does what SGLang's
    ``load_format="flattened_bucket"`` does (tests/sglang_standin.py: its bytes end to
    end in one uint8 broadcast per call, each tensor viewed back as its dtype), one call
    after another as the SGLang agent posts them: two rounds, bitwise, mixed dtypes."""
    from tests.sglang_standin import receive_and_load
    from weightsync.transport.flattened import flattened_calls

    def receive_round(plan, pg):
        for first, end in flattened_calls(plan).bounds:
            receive_and_load(*_sglang_specs(plan.slots[first:end]), [pg], "flattened_bucket")

    _two_rounds_against_the_sglang_recipe("flat", _mixed_sources(), "flattened", receive_round)


@pytest.mark.parametrize("name", ["gloo", "group"])
def test_failure_before_joining_stops_the_sender_and_peers_at_once(name):
    """A receiver that fails before joining reports it in the store (as an agent's
    receiver does); the sender, blocked in group setup, and the other receiver stop
    at once instead of waiting out the 30 s deadline."""
    kind = KINDS[name]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    healthy = transports.make_receiver(kind)
    sources = [torch.randn(64 * 1024), torch.randn(10)]
    plan = BucketPlan.from_tensors([(f"t{i}", s) for i, s in enumerate(sources)], bucket_bytes=4096)

    class Failing:
        def receive(self, rdzv, rank, plan, targets, *, deadline_at, abort):
            from weightsync.transport.store import connect_store
            time.sleep(0.5)  # everyone else is waiting in group setup by now
            connect_store(rdzv.store_host, rdzv.store_port, deadline_at=time.monotonic() + 5).set(
                f"ws/{rdzv.group_id}/{rdzv.session_id}/err/{rank}", "boom")

        def close(self):
            pass

    started = time.monotonic()
    with pytest.raises(TransferError, match="boom"):
        run_round(sender, [healthy, Failing()], rendezvous(store, kind, 3, group=f"g-fail-{name}"), plan, sources,
                  timeout_s=30)
    assert time.monotonic() - started < 10
    sender.close()
    healthy.close()


def test_closing_an_shm_receiver_under_a_running_receive_is_memory_safe():
    # A real process: before the fix the unmap under unpack_bucket was a SIGSEGV
    # (the agent died with signal 11 at SIGTERM and skipped its other shutdown steps).
    script = os.path.join(os.path.dirname(__file__), "shm_close_race.py")
    done = subprocess.run([sys.executable, script, "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split("\n")[-2] == "survived 2"


def test_the_store_listens_only_on_the_host_the_trainer_names():
    """torch's store server alone would listen on every interface; a trainer that names
    127.0.0.1 must not be reachable at any other address (127.0.0.2 is loopback too, so
    this runs anywhere)."""
    import socket

    store = host_store("127.0.0.1", timeout_s=5)
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=5).close()
    with pytest.raises(TransferError, match="cannot listen"):
        host_store("192.0.2.1", timeout_s=5)  # TEST-NET-1: not an address of this machine


def test_a_receiver_that_cannot_listen_on_its_data_address_fails_at_once_naming_it():
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: gloo cannot listen there.
    # The receiver says so at once, and the sender stops on its failure report.
    kind = KINDS["gloo"]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(kind, store)
    receiver = transports.make_receiver(kind, data_host="192.0.2.1")
    sources = [torch.randn(1000)]
    plan = BucketPlan.from_tensors([("t0", sources[0])], bucket_bytes=1024)
    started = time.monotonic()
    try:
        with pytest.raises(TransferError) as sent:
            run_round(sender, [receiver], rendezvous(store, kind, 2), plan, sources, timeout_s=20)
    finally:
        sender.close()
        receiver.close()
    assert time.monotonic() - started < 10, "a wrong address must fail fast, not at the deadline"
    assert "192.0.2.1" in str(sent.value), sent.value


def _relay_round(store, sender, relay, receivers, plan, sources, *, fail_rank=None, timeout_s=20.0):
    """One round through a host relay: the trainer's ``sender`` sends an upstream gloo
    lane (world 2) to ``relay``, which re-shares it as rank 0 of a downstream shm lane
    that ``receivers`` take. Returns (targets, receiver errors, relay error, sender error)."""
    session = uuid.uuid4().hex
    upstream = common_pb2.Rendezvous(group_id="up", transport=KINDS["gloo"], store_host="127.0.0.1",
                                     store_port=store.port, world_size=2, session_id=f"{session}-0")
    downstream = common_pb2.Rendezvous(group_id="down", transport=KINDS["shm"], store_host="127.0.0.1",
                                       store_port=store.port, world_size=len(receivers) + 1,
                                       session_id=f"{session}-1")
    outcome: dict[str, BaseException] = {}

    def forward():
        try:
            relay.forward(upstream, downstream, plan, deadline_at=time.monotonic() + timeout_s,
                          abort=threading.Event())
        except BaseException as exc:
            outcome["relay"] = exc

    def send():
        try:
            sender.send(upstream, plan, sources, deadline_at=time.monotonic() + timeout_s, abort=threading.Event())
        except BaseException as exc:
            outcome["sender"] = exc

    threads = [threading.Thread(target=forward), threading.Thread(target=send)]
    for t in threads:
        t.start()
    targets = [[torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots] for _ in receivers]
    errors: dict[int, BaseException] = {}

    def receive(rank):
        try:
            if rank == fail_rank:
                raise RuntimeError("injected receiver failure")
            receivers[rank - 1].receive(downstream, rank, plan, targets[rank - 1],
                                        deadline_at=time.monotonic() + timeout_s, abort=threading.Event())
        except BaseException as exc:
            errors[rank] = exc
            # what an agent does for its own engine's failure: the lane's err key
            store.set(session_key(downstream, "err", rank), str(exc))

    receiving = [threading.Thread(target=receive, args=(r,)) for r in range(1, len(receivers) + 1)]
    for t in receiving:
        t.start()
    for t in threads + receiving:
        t.join(timeout_s + 5)
    return targets, errors, outcome.get("relay"), outcome.get("sender")


def test_a_host_relay_re_shares_one_network_copy_over_shm_and_a_failure_stops_the_trainer():
    from weightsync.transport.relay import HostRelay

    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["gloo"], store)
    relay = HostRelay("127.0.0.1")
    receivers = [transports.make_receiver(KINDS["shm"]) for _ in range(2)]
    sources = [torch.randn(33, 17), torch.randn(1000), torch.arange(77, dtype=torch.int64)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=1024)
    assert plan.num_buckets > 4
    try:
        for step in range(2):
            for s in sources:
                s.add_(1) if s.dtype != torch.int64 else s.add_(step)
            targets, errors, relay_error, send_error = _relay_round(store, sender, relay, receivers, plan, sources)
            assert errors == {} and relay_error is None and send_error is None
            for out in targets:
                for a, b in zip(out, sources, strict=True):
                    assert torch.equal(a, b)
        # An engine behind the relay fails: the relay stops, and tells the trainer.
        started = time.monotonic()
        _, errors, relay_error, send_error = _relay_round(store, sender, relay, receivers, plan, sources,
                                                          fail_rank=2)
        assert set(errors) == {2} or set(errors) == {1, 2}
        assert isinstance(relay_error, TransferError) and isinstance(send_error, TransferError), (relay_error,
                                                                                                   send_error)
        assert "relay" in str(send_error), send_error
        assert time.monotonic() - started < 10, "a failure behind the relay must stop the trainer promptly"
    finally:
        sender.close()
        relay.close()
        for r in receivers:
            r.close()


_HOLD_SEGMENT = """
import sys
from weightsync.transport.shm import _Segment
segment = _Segment(sys.argv[1], 4096, create=True)
print("made", flush=True)
sys.stdin.readline()
segment.close()
"""


def _hold_segment(path: str) -> subprocess.Popen:
    """A process that makes an shm segment at ``path`` (as a sender does) and keeps it
    until its stdin gets a line."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_SEGMENT, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "made"
    return proc


def test_segments_of_senders_that_died_are_removed_and_no_live_one(tmp_path):
    """A SIGKILLed sender cannot unlink its segment (two buckets of memory in /dev/shm).
    The next sender removes it: no process holds its lock and its pid is gone. A live
    sender's segment stays, even under a name whose pid is not alive here (a sender in
    another pid namespace sharing /dev/shm), and so does an unlocked one whose pid is
    alive (a sender of a release before the lock)."""
    from weightsync.transport.shm import ShmSender, remove_stale_segments

    hex12 = lambda: uuid.uuid4().hex[:12]  # noqa: E731
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(timeout=30)
    dead = killed.pid
    stale = tmp_path / f"weightsync-{dead}-{hex12()}"
    victim = _hold_segment(str(stale))
    victim.kill()  # dies holding its segment: the file stays, the lock goes
    victim.wait(timeout=30)
    foreign = tmp_path / f"weightsync-{dead}-{hex12()}"
    foreign_owner = _hold_segment(str(foreign))
    old_release = tmp_path / f"weightsync-{os.getpid()}-{hex12()}"
    old_release.write_bytes(b"\0" * 4096)
    unrelated = tmp_path / "weightsync-bench-1.safetensors"
    unrelated.write_bytes(b"x")
    young = tmp_path / f"weightsync-{dead}-{hex12()}"
    young.write_bytes(b"\0" * 4096)
    try:
        everything = [p for p in tmp_path.iterdir() if p != young]
        for path in everything:
            os.utime(path, (time.time() - 60, time.time() - 60))
        assert stale.exists()
        assert remove_stale_segments(str(tmp_path)) == [str(stale)]
        assert not stale.exists()
        assert foreign.exists() and old_release.exists() and unrelated.exists() and young.exists()
        # ...and every new sender does it in the real directory.
        planted = os.path.join(SHM_DIR, f"weightsync-{dead}-{hex12()}")
        with open(planted, "wb") as f:
            f.write(b"\0" * 4096)
        os.utime(planted, (time.time() - 60, time.time() - 60))
        sender = ShmSender(host_store("127.0.0.1", timeout_s=20))
        try:
            sender._ensure_segment(4096)
            assert not os.path.exists(planted)
        finally:
            sender.close()
    finally:
        foreign_owner.stdin.close()
        foreign_owner.wait(timeout=30)
    assert not foreign.exists()  # its owner unlinked it on close


def test_auto_flattens_a_plan_of_small_tensors_that_every_engine_takes():
    from weightsync.server.coordinator.lanes import FLATTEN_BELOW_MEAN_BYTES, pick_group_layout
    from weightsync.server.coordinator.registry import EngineRecord

    def engine(*layouts: str) -> EngineRecord:
        return EngineRecord("e", "127.0.0.1:1", "reference", channel=None, stub=None,
                            state=common_pb2.EngineState(group_layouts=layouts))

    def plan(count: int, elements: int) -> BucketPlan:
        return BucketPlan.build([(f"t{i}", torch.float32, (elements,)) for i in range(count)])

    small = plan(64, FLATTEN_BELOW_MEAN_BYTES // 4 // 2)  # half a MiB each
    large = plan(8, FLATTEN_BELOW_MEAN_BYTES // 4 * 2)
    both, old = engine("tensors", "flattened"), engine()  # an older agent reports none
    assert pick_group_layout("auto", [both, both], small) == "flattened"
    assert pick_group_layout("auto", [both, engine("tensors")], small) == "tensors"
    assert pick_group_layout("auto", [both, old], small) == "tensors"
    assert pick_group_layout("auto", [both], large) == "tensors"
    assert pick_group_layout("flattened", [old], large) == "flattened"  # asked for: the agent decides
    assert pick_group_layout("", [both], small) == ""  # empty means tensors on the wire, as before
