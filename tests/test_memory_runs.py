"""Small tensors moved straight from or into memory where they lie end to end as the
plan lays them out (``plan.memory_run``, ``transport.memory_runs``), and the reference
engine's arena that makes its weights lie so (``weightsync.arena``). gloo rounds here run
sender and receiver in threads of one process over real sockets."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import torch

from weightsync import transport as transports
from weightsync.arena import place_in_arena
from weightsync.engine.model import ReferenceLM, config_for_size, resolve_config
from weightsync.engine.reference import ReferenceAdapter
from weightsync.plan import ALIGN, BucketPlan
from weightsync.transport import gloo as gloo_module
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses
from weightsync.transport.memory_runs import bucket_runs, run_view
from weightsync.transport.store import host_store
from weightsync.v1 import common_pb2


def _plan(sizes_in_floats, bucket_bytes=256):
    return BucketPlan.build([(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes_in_floats)],
                            bucket_bytes=bucket_bytes)


def test_a_range_is_one_run_only_where_its_tensors_lie_as_the_stream_lays_them_out():
    # 4-byte floats: t2 (3 floats, 12 bytes) is followed by 4 bytes of alignment padding.
    plan = _plan([10, 6, 3, 0, 20, 40, 8])
    offsets = np.array(plan.offsets, dtype=np.int64)
    base = 1 << 20
    laid_out = (offsets + base).astype(np.uint64)
    laid_out[3] = 0  # an empty tensor's address is anything: it holds no byte of any range

    # t0..t1: 64 bytes at stream 0, one run, found through t0
    assert plan.memory_run(0, 0, 64, laid_out) == (0, base)
    # a range starting inside a tensor (a bucket that begins mid-tensor) still maps byte for byte
    assert plan.memory_run(0, 8, 40, laid_out) == (0, base + 8)
    # a range that takes in t2's padding is not one run: those 4 bytes are no tensor's
    assert plan.memory_run(0, 64, 80, laid_out) is None
    # ... but the range of t2's own bytes is
    assert plan.memory_run(0, 64, 76, laid_out) == (2, base + 64)
    # the empty t3 between t2's padding and t4 does not break t4..t5's run; in bucket 1 (stream 256..)
    t4 = plan.offsets[4]
    assert plan.memory_run(0, t4, 256, laid_out) == (4, base + t4)
    assert plan.memory_run(1, 0, 64, laid_out) == (5, base + 256)

    moved = laid_out.copy()
    moved[5] += 4096  # t5 elsewhere: ranges touching it are not runs, the others still are
    assert plan.memory_run(0, t4, 256, moved) is None
    assert plan.memory_run(0, 0, 64, moved) == (0, base)
    swapped = laid_out.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same bytes, another order
    assert plan.memory_run(0, 0, 64, swapped) is None
    assert plan.memory_run(0, 0, 64, laid_out[:-1]) is None  # addresses of another plan


def _flat(tensors):
    """Copies of ``tensors`` end to end in one flat buffer as a plan lays them out (each
    start aligned to 8 bytes), as a trainer that keeps its parameters in one buffer has
    them. Returns the buffer and the copies (views of it)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    flat = torch.zeros(sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes), dtype=torch.uint8)
    out, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        view = flat[at:at + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        out.append(view)
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return flat, out


def test_a_run_view_never_reaches_past_one_storage_nor_trusts_stale_addresses():
    flat, tensors = _flat([torch.randn(16) for _ in range(3)])
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(tensors)], bucket_bytes=1024)
    addressed = AddressedTensors(tensors, tensor_addresses(tensors, plan.dtypes, plan.sizes), plan.sizes)
    view = run_view(plan, 0, 0, plan.total_bytes, addressed)
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == plan.total_bytes

    # Separate tensors whose addresses are claimed to lie end to end: the run would go past
    # the first one's storage into memory that is not its own.
    separate = [torch.randn(16) for _ in range(3)]
    first = separate[0].data_ptr()
    lying = AddressedTensors(separate, np.array([first, first + 64, first + 128], dtype=np.uint64), plan.sizes)
    assert run_view(plan, 0, 0, plan.total_bytes, lying) is None

    # The tensor the run is found through has moved since its address was taken.
    moved = [t.clone() for t in tensors]
    stale = AddressedTensors(moved, addressed.addresses, plan.sizes)
    assert run_view(plan, 0, 0, plan.total_bytes, stale) is None
    # Tensors that carry no addresses are never asked for them.
    assert bucket_runs(plan, 0, list(tensors)) is None


def _one_round(plan, sources, targets, group, kind=common_pb2.TRANSPORT_KIND_GLOO, **rendezvous):
    """One round from a real sender to one real receiver (a thread), over real sockets."""
    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = transports.make_sender(kind, store), transports.make_receiver(kind)
    rdzv = common_pb2.Rendezvous(group_id=group, transport=kind, store_host="127.0.0.1", store_port=store.port,
                                 world_size=2, session_id=uuid.uuid4().hex, **rendezvous)
    errors = []

    def receive():
        try:
            receiver.receive(rdzv, 1, plan, targets, deadline_at=time.monotonic() + 20, abort=threading.Event())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sender.send(rdzv, plan, sources, deadline_at=time.monotonic() + 20, abort=threading.Event())
    finally:
        thread.join(25)
        sender.close()
        receiver.close()
    assert errors == []


def _counting_copies(monkeypatch):
    calls = {"pack": 0, "unpack": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gloo_module, "pack_bucket", counted("pack", gloo_module.pack_bucket))
    monkeypatch.setattr(gloo_module, "unpack_bucket", counted("unpack", gloo_module.unpack_bucket))
    return calls


def test_gloo_sends_small_tensors_from_a_flat_buffer_into_an_engines_arena_with_no_bucket_copy(monkeypatch):
    """The reference engine's targets are one arena; a trainer's parameters in one flat
    buffer: every bucket of small tensors goes from the one into the other as a single
    broadcast, neither side packing or unpacking; the engine's weights come out
    bitwise the trainer's, in the engine's own memory."""
    config = resolve_config("tiny")
    adapter = ReferenceAdapter(config)
    try:
        trainer = ReferenceLM(config)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p))  # a trained step: nothing like the engine's boot weights
        named = list(trainer.named_parameters())
        flat, views = _flat([p for _, p in named])
        plan = BucketPlan.from_tensors(named, bucket_bytes=4096)
        assert plan.num_buckets > 4 and max(plan.sizes) < 1 << 20  # small tensors only: all would be packed
        sources = AddressedTensors(views, tensor_addresses(views, plan.dtypes, plan.sizes), plan.sizes)
        targets = adapter.load_targets(plan)
        assert all(bucket_runs(plan, b, targets) is not None for b in range(plan.num_buckets))
        arena = targets[0].untyped_storage()
        before = [t.data_ptr() for t in targets]

        calls = _counting_copies(monkeypatch)
        _one_round(plan, sources, targets, "runs")
        assert calls == {"pack": 0, "unpack": 0}
        assert [t.data_ptr() for t in targets] == before and targets[-1].untyped_storage().data_ptr() == arena.data_ptr()
        for (name, p), t in zip(named, targets, strict=True):
            assert torch.equal(t, p.detach()), name
    finally:
        adapter.close()


def test_gloo_packs_and_unpacks_where_the_orders_differ_and_still_lands_bitwise(monkeypatch):
    """A plan that lists the engine's tensors in another order than its arena (and a
    trainer of separate tensors): no bucket of two or more tensors is one run, both
    sides copy those through the buffers as before, and the bytes are the same."""
    config = resolve_config("tiny")
    adapter = ReferenceAdapter(config)
    try:
        trainer = ReferenceLM(config)
        named = list(reversed([(n, p.detach() + 1) for n, p in trainer.named_parameters()]))
        plan = BucketPlan.from_tensors(named, bucket_bytes=4096)
        sources = AddressedTensors([t for _, t in named], tensor_addresses([t for _, t in named], plan.dtypes,
                                                                         plan.sizes), plan.sizes)
        targets = adapter.load_targets(plan)
        # A bucket inside one tensor is one run in any order; one that holds two is not.
        mixed = [b for b in range(plan.num_buckets) if len({p.tensor_index for p in plan.bucket_pieces(b)}) > 1]
        assert len(mixed) > 2
        assert not any(bucket_runs(plan, b, targets) for b in mixed)
        assert not any(bucket_runs(plan, b, sources) for b in mixed)
        calls = _counting_copies(monkeypatch)
        _one_round(plan, sources, targets, "orders")
        assert calls["pack"] > 0 and calls["unpack"] > 0
        for (name, t), got in zip(named, targets, strict=True):
            assert torch.equal(got, t), name
    finally:
        adapter.close()


def test_the_reference_engine_keeps_its_weights_in_one_arena_from_boot_and_after_wake():
    """Its boot weights are the model's own (checked against a separately built model,
    and by what it generates), laid out as a plan lays them out; sleep lets the arena
    go and wake makes a new one, zeroed."""
    config = config_for_size(4 << 20, 300)
    adapter = ReferenceAdapter(config)
    engine = adapter.engine
    try:
        fresh = ReferenceLM(config)
        named = list(engine.model.named_parameters())
        plan = BucketPlan.from_tensors(named)
        storage = named[0][1].untyped_storage()
        assert all(p.untyped_storage().data_ptr() == storage.data_ptr() for _, p in named)
        addresses = tensor_addresses([p for _, p in named], plan.dtypes, plan.sizes)
        assert (addresses - np.uint64(storage.data_ptr())).tolist() == list(plan.offsets)
        for (name, p), (_, q) in zip(named, fresh.named_parameters(), strict=True):
            assert torch.equal(p, q), name
        tokens = torch.tensor([[1, 2, 3, 4]])
        assert torch.equal(engine.model(tokens), fresh.eval()(tokens))

        engine.pause(common_pb2.PAUSE_MODE_KEEP)
        engine.sleep(["weights"])
        assert all(p.numel() == 0 for _, p in named)
        engine.wake(["weights"])
        woken = named[0][1].untyped_storage()
        assert all(p.untyped_storage().data_ptr() == woken.data_ptr() for _, p in named)
        assert woken.nbytes() == storage.nbytes() and all(not p.any() for _, p in named)
        assert [tuple(p.shape) for _, p in named] == [tuple(q.shape) for _, q in fresh.named_parameters()]
    finally:
        adapter.close()


def test_a_flattened_call_is_one_run_only_where_its_tensors_lie_end_to_end_as_it_carries_them():
    from weightsync.transport.flattened import flattened_calls

    # 2-byte elements, no padding in a call: t1 (3 bf16, 6 bytes) is followed at once by t2.
    plan = BucketPlan.build([("t0", torch.bfloat16, (4,)), ("t1", torch.bfloat16, (3,)),
                             ("t2", torch.bfloat16, (0,)), ("t3", torch.bfloat16, (5,))], bucket_bytes=1024)
    calls = flattened_calls(plan)
    assert calls.bounds == ((0, 4),)
    end_to_end = np.array([4096, 4104, 0, 4110], dtype=np.uint64)  # an empty tensor's address is anything
    assert calls.memory_run(0, end_to_end) == (0, 4096)
    # laid out with the plan's 8-byte alignment instead: t3 is 2 bytes further on, not one run
    assert calls.memory_run(0, np.array([4096, 4104, 0, 4112], dtype=np.uint64)) is None
    assert calls.memory_run(0, end_to_end[:3]) is None


def test_the_group_transports_flattened_calls_go_from_a_flat_buffer_into_an_arena_with_no_staging(monkeypatch):
    """SGLang's flattened layout over weightsync's own group receiver: each call of
    several tensors is one broadcast from the trainer's flat buffer straight into the
    reference engine's arena (no staging copy on either side), bitwise."""
    from weightsync.transport import flattened, group
    from weightsync.transport.flattened import flattened_calls

    config = resolve_config("tiny")
    adapter = ReferenceAdapter(config)
    try:
        trainer = ReferenceLM(config)
        # bf16 on the wire: every tensor a multiple of 8 bytes, so the arena's alignment adds no gap
        named = [(n, (p.detach() * 3).to(torch.bfloat16)) for n, p in trainer.named_parameters()]
        assert all(t.numel() * 2 % ALIGN == 0 for _, t in named)
        flat, views = _flat([t for _, t in named])
        plan = BucketPlan.from_tensors(named, bucket_bytes=4096)
        sources = AddressedTensors(views, tensor_addresses(views, plan.dtypes, plan.sizes), plan.sizes)
        # The engine's weights in bf16 too (an arena of the wire's dtype), in model order.
        params = adapter.engine.parameters_by_name()
        place_in_arena(list(params.values()), [(torch.bfloat16, tuple(p.shape)) for p in params.values()],
                       keep_values=False)
        engine = [params[n] for n, _ in named]
        targets = AddressedTensors(engine, tensor_addresses(engine, plan.dtypes, plan.sizes), plan.sizes)
        calls = flattened_calls(plan)
        several = [c for c, (a, b) in enumerate(calls.bounds) if b - a > 1]
        assert several and all(calls.memory_run(c, targets.addresses) for c in several)
        copies = {"n": 0}
        real = flattened.copy_all

        def counted(dsts, srcs):
            copies["n"] += 1
            real(dsts, srcs)

        monkeypatch.setattr(group, "copy_all", counted)
        _one_round(plan, sources, targets, "flat-runs", common_pb2.TRANSPORT_KIND_GROUP,
                   group_layout=flattened.FLATTENED)
        assert copies["n"] == 0
        for (name, t), got in zip(named, targets, strict=True):
            assert torch.equal(got, t), name
    finally:
        adapter.close()


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address``, from /proc/self/smaps."""
    huge, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if not head.endswith(":"):  # a mapping's first line: its address range
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                huge = int(line.split()[1]) * 1024
    return huge


def _mapping_of(address: int) -> tuple[int, int] | None:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def test_an_arena_is_a_mapping_of_its_own_on_huge_pages_where_the_kernel_gives_them_on_request():
    import gc
    from pathlib import Path

    from weightsync.arena import new_arena

    assert new_arena(0).numel() == 0
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    params = [torch.nn.Parameter(torch.full((16 << 20,), 7, dtype=torch.uint8), requires_grad=False),
              torch.nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)]
    arena = place_in_arena(params, [(torch.uint8, (16 << 20,)), (torch.float32, (3,))], keep_values=True)
    assert params[0].data_ptr() == arena.data_ptr() and bool((params[0] == 7).all()) and params[1].sum() == 3
    if setting.exists() and ("[madvise]" in setting.read_text() or "[always]" in setting.read_text()):
        assert _huge_bytes_at(arena.data_ptr()) >= 8 << 20
    # The mapping goes with the last tensor over it.
    mapping = _mapping_of(arena.data_ptr())
    assert mapping is not None and mapping[1] - mapping[0] >= 16 << 20
    del arena
    for p in params:
        p.data = torch.empty(0)
    gc.collect()
    assert _mapping_of(mapping[0]) != mapping
