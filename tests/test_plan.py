"""BucketPlan layout, wire round-trip and packing (unit + property-based)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.dtypes import DTYPE_CODES, DTYPES, dtype_name
from weightsync.errors import InvalidArgument
from weightsync.packing import pack_bucket, unpack_bucket, weights_digest
from weightsync.plan import MAX_DIMS, MAX_NAME_LEN, MAX_PLAN_BYTES, BucketPlan
from weightsync.v1 import common_pb2


def roundtrip(plan: BucketPlan, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in plan.slots]
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    for b in range(plan.num_buckets):
        buf.zero_()
        pack_bucket(plan, b, sources, buf)
        unpack_bucket(plan, b, buf, targets)
    return targets


def test_layout_spans_buckets_and_aligns():
    plan = BucketPlan.build([("a", torch.float32, (3,)), ("b", torch.float64, (10,)), ("c", torch.int8, (5,))],
                            bucket_bytes=32)
    assert [s.offset for s in plan.slots] == [0, 16, 96]
    assert plan.total_bytes == 104 and plan.num_buckets == 4
    assert sum(p.length for ps in plan.pieces for p in ps) == plan.payload_bytes == 12 + 80 + 5
    b_pieces = [p for ps in plan.pieces for p in ps if p.tensor_index == 1]
    assert len(b_pieces) == 3  # 80 bytes from offset 16 across 32-byte buckets


def test_proto_roundtrip_and_tamper_detection():
    plan = BucketPlan.build([("w", torch.float32, (4, 4)), ("b", torch.bfloat16, (4,))], bucket_bytes=64)
    again = BucketPlan.from_proto(plan.to_proto())
    assert again == plan and again.plan_id == plan.plan_id
    msg = plan.to_proto()
    msg.total_bytes += 8
    with pytest.raises(InvalidArgument, match="total_bytes"):
        BucketPlan.from_proto(msg)
    msg = plan.to_proto()
    msg.dtypes = bytes([0, len(DTYPE_CODES)])
    with pytest.raises(InvalidArgument, match="unknown dtype code"):
        BucketPlan.from_proto(msg)
    msg = plan.to_proto()
    msg.dims = msg.dims[:-8]
    with pytest.raises(InvalidArgument, match="dims"):
        BucketPlan.from_proto(msg)
    msg = plan.to_proto()
    msg.dims = msg.dims.replace((4).to_bytes(8, "little"), (5).to_bytes(8, "little"), 1)
    with pytest.raises(InvalidArgument):  # the shape changed, so the layout or the fingerprint disagrees
        BucketPlan.from_proto(msg)
    msg = plan.to_proto()
    msg.plan_id = "0" * 32
    with pytest.raises(InvalidArgument, match="plan_id"):
        BucketPlan.from_proto(msg)


def test_a_plan_too_large_for_a_message_is_refused_where_it_is_built():
    from weightsync.grpc_options import MAX_MESSAGE_BYTES
    assert MAX_PLAN_BYTES < MAX_MESSAGE_BYTES - 64 * 1024  # room for the rest of a Receive or Broadcast
    long_names = ((f"{'x' * 500}.{i}", torch.float32, (1,)) for i in range(MAX_PLAN_BYTES // 500 + 1))
    with pytest.raises(InvalidArgument, match="MiB on the wire"):
        BucketPlan.build(long_names)


def test_the_wire_dtype_codes_never_move():
    # proto/weightsync/v1/common.proto documents the codes; a plan from an older sender
    # must mean the same tensors to a newer receiver.
    assert [dtype_name(d) for d in DTYPE_CODES] == ["float32", "float64", "float16", "bfloat16", "int64", "int32",
                                                    "int16", "int8", "uint8", "bool"]


@pytest.mark.parametrize("columns,match", [
    (dict(names=b"a\0b", dtypes=b"\0", ranks=b"\0"), "names"),
    (dict(names=b"a", dtypes=b"\0", ranks=b""), "ranks"),
    (dict(names=b"a", dtypes=b"\0", ranks=bytes([MAX_DIMS + 1])), "dimensions"),
    (dict(names=b"a", dtypes=b"\0", ranks=b"\1", dims=b"\0" * 4), "dims"),
    (dict(names=b"a", dtypes=b"\0", ranks=b"\1", dims=(-1).to_bytes(8, "little", signed=True)), "negative"),
    (dict(names=b"a", dtypes=b"\0", ranks=b"\2", dims=(2**40).to_bytes(8, "little") * 2), "bytes"),
    (dict(names=b"a\0a", dtypes=b"\0\0", ranks=b"\0\0"), "duplicate"),
    (dict(names=b"a\0", dtypes=b"\0\0", ranks=b"\0\0"), "bad tensor name"),
    (dict(names=b"a\x07", dtypes=b"\0", ranks=b"\0"), "bad tensor name"),
    (dict(names=b"\xff", dtypes=b"\0", ranks=b"\0"), "UTF-8"),
    (dict(names="\u00e9\u2028".encode(), dtypes=b"\0", ranks=b"\0"), "bad tensor name"),  # not ASCII, not printable
    (dict(names=b"x" * (MAX_NAME_LEN + 1), dtypes=b"\0", ranks=b"\0"), "bad tensor name"),
])
def test_inconsistent_columns_are_refused_with_what_is_wrong(columns, match):
    msg = common_pb2.WeightPlan(bucket_bytes=64, total_bytes=8, **columns)
    with pytest.raises(InvalidArgument, match=match):
        BucketPlan.from_proto(msg)


def test_a_plan_with_non_ascii_names_and_scalars_round_trips():
    plan = BucketPlan.build([("gewicht.\u00e4", torch.float32, ()), ("b", torch.int8, (0, 3)), ("c", torch.bool, (2,))],
                            bucket_bytes=64)
    again = BucketPlan.from_proto(plan.to_proto())
    assert again == plan and again.names == plan.names
    assert again.shapes == ((), (0, 3), (2,)) and again.sizes == (4, 0, 2) and again.offsets == (0, 8, 8)


@pytest.mark.parametrize("specs,match", [
    ([("a", torch.float32, (1,)), ("a", torch.float32, (1,))], "duplicate"),
    ([("", torch.float32, (1,))], "bad tensor name"),
    ([("a", torch.float32, (-1,))], "negative"),
    ([("a", torch.complex64, (1,))], "unsupported dtype"),
])
def test_bad_specs_are_rejected(specs, match):
    with pytest.raises(InvalidArgument, match=match):
        BucketPlan.build(specs, bucket_bytes=64)


def test_bad_bucket_size():
    with pytest.raises(InvalidArgument):
        BucketPlan.build([("a", torch.float32, (1,))], bucket_bytes=12)


def test_cast_on_the_sender():
    src = [torch.randn(7, 3), torch.arange(5)]
    plan = BucketPlan.from_tensors([("w", src[0]), ("i", src[1])], bucket_bytes=16, wire_dtype=torch.bfloat16)
    assert plan.slots[0].dtype == torch.bfloat16 and plan.slots[1].dtype == torch.int64
    out = roundtrip(plan, src)
    assert torch.equal(out[0], src[0].to(torch.bfloat16))
    assert torch.equal(out[1], src[1])


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from(sorted(DTYPES))


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(dtypes, shapes), min_size=1, max_size=8),
       bucket=st.integers(1, 40).map(lambda n: n * 8), seed=st.integers(0, 2**16))
def test_pack_unpack_roundtrip_is_bitwise(specs, bucket, seed):
    g = torch.Generator().manual_seed(seed)
    sources = []
    for wire_name, shape in specs:
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), generator=g, dtype=torch.uint8)
        dtype = DTYPES[wire_name]
        size = torch.empty((), dtype=dtype).element_size()
        t = raw[: torch.Size(shape).numel() * size].view(dtype).reshape(shape) if dtype != torch.bool else \
            (raw[: torch.Size(shape).numel()] % 2).bool().reshape(shape)
        sources.append(t.clone())
    named = [(f"t{i}", t) for i, t in enumerate(sources)]
    plan = BucketPlan.from_tensors(named, bucket_bytes=bucket)
    out = roundtrip(plan, sources)
    assert weights_digest(zip([n for n, _ in named], out, strict=True)) == weights_digest(named)
    assert BucketPlan.from_proto(plan.to_proto()) == plan


def test_many_small_tensors_round_after_round_through_reused_buffers():
    """Whole tensors go through views of the bucket buffer that are built once and then
    reused: values from an earlier round, another buffer or a cast must never leak."""
    g = torch.Generator().manual_seed(7)
    shapes = [(3,), (5, 2), (1,), (7, 3), (4,)] * 40 + [(300, 17)]  # many small ones and one that spans buckets
    named = [(f"t{i}", torch.empty(s)) for i, s in enumerate(shapes)]
    plan = BucketPlan.from_tensors(named, bucket_bytes=4096, wire_dtype=torch.bfloat16)
    buffers = [torch.empty(plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    targets = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    for _ in range(3):
        sources = [torch.randn(s, generator=g) for s in shapes]
        for bucket in range(plan.num_buckets):
            buf = buffers[bucket % 2][:plan.bucket_size(bucket)]
            pack_bucket(plan, bucket, sources, buf)
            unpack_bucket(plan, bucket, buf, targets)
        for src, dst in zip(sources, targets, strict=True):
            assert torch.equal(src.to(torch.bfloat16), dst)


def test_serial_copies_affect_only_the_calling_thread_and_only_inside():
    import threading

    import torch

    from weightsync.serial_copy import _openmp, serial_copies

    if _openmp() is None or torch.get_num_threads() < 2:
        pytest.skip("needs torch's OpenMP runtime and at least 2 threads")
    before = torch.get_num_threads()
    seen = {}

    def other_thread():
        seen["other"] = torch.get_num_threads()

    with serial_copies():
        seen["inside"] = torch.get_num_threads()
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == {"inside": 1, "other": before}
    assert torch.get_num_threads() == before


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3 << 20), min_size=1, max_size=12),
       st.sampled_from([1 << 20, 3 << 20, 8 << 20]))
def test_bucket_ops_cut_each_bucket_into_ranges_with_every_large_piece_on_its_own(sizes, bucket_bytes):
    """The ranges a network transport moves one by one: they tile the bucket, every
    piece of at least 1 MiB is exactly one range, and the ranges between hold only small
    pieces; packing the small ones and copying the large ones by hand makes the bucket
    that ``pack_bucket`` makes."""
    from weightsync.packing import gather_ranges, pack_piece, scatter_ranges
    from weightsync.plan import SERIAL_COPY_BYTES

    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=bucket_bytes)
    for bucket in range(plan.num_buckets):
        ops = plan.bucket_ops(bucket)
        if plan.bucket_size(bucket) == 0:  # a plan of empty tensors: nothing to move
            assert ops == ()
            continue
        assert ops[0][0] == 0 and ops[-1][1] == plan.bucket_size(bucket)
        assert all(a[1] == b[0] for a, b in zip(ops, ops[1:], strict=False))
        large = {(p.tensor_index, p.tensor_start) for p in plan.bucket_pieces(bucket) if p.length >= SERIAL_COPY_BYTES}
        assert {(p.tensor_index, p.tensor_start) for _, _, p in ops if p is not None} == large
        for start, end, piece in ops:
            if piece is not None:
                assert (start, end) == (piece.bucket_start, piece.bucket_start + piece.length)
        expected, built = torch.zeros(bucket_bytes, dtype=torch.uint8), torch.zeros(bucket_bytes, dtype=torch.uint8)
        pack_bucket(plan, bucket, sources, expected)
        pack_bucket(plan, bucket, sources, built, small_only=True)
        for _, _, piece in ops:
            if piece is not None:
                pack_piece(plan, piece, sources, built)
        assert torch.equal(built, expected)

        # On the wire: two or more small ranges go as one gathered operation; what the
        # receiver scatters back is the bucket the sender packed.
        wire = plan.wire_ops(bucket)
        small = tuple((a, b) for a, b, piece in ops if piece is None)
        if len(small) >= 2:
            assert wire.gathered == small and wire.ops == tuple(op for op in ops if op[2] is not None)
            assert wire.gathered_bytes == sum(b - a for a, b in small) <= plan.gathered_bytes
            staging = torch.empty(plan.gathered_bytes, dtype=torch.uint8)
            gather_ranges(expected, wire.gathered, staging)
            landed = torch.zeros(bucket_bytes, dtype=torch.uint8)
            scatter_ranges(staging[:wire.gathered_bytes], wire.gathered, landed)
            for a, b in small:
                assert torch.equal(landed[a:b], expected[a:b])
        else:
            assert wire == ((), 0, ops)


def test_small_pieces_are_copied_without_openmp_regions_where_a_large_piece_shares_their_bucket(monkeypatch):
    """gloo packs only the pieces under 1 MiB (``small_only``); those are all small, so
    they go without a parallel region each even in a bucket that a large tensor's piece
    also crosses (with regions, a gloo round of 1 GiB in 509 tensors spent 25 ms of CPU
    per round packing what takes 2 ms, and its receivers likewise)."""
    import weightsync.packing as packing
    from weightsync.plan import SERIAL_COPY_BYTES
    from weightsync.serial_copy import _openmp

    if _openmp() is None or torch.get_num_threads() < 2:
        pytest.skip("needs torch's OpenMP runtime and at least 2 threads")
    mib = 1 << 20
    # bucket 1 holds t0's 0.5 MiB tail, t1 whole and t2's 1.5 MiB head
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (5 * mib // 2, 1024, 2 * mib)]
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(sources)], bucket_bytes=2 * mib)
    pieces = plan.bucket_pieces(1)
    assert {p.length < SERIAL_COPY_BYTES for p in pieces if p.length != plan.sizes[p.tensor_index]} == {True, False}

    threads_seen = []

    def recording(copy):
        def record(plan_, split_or_piece, *args):
            copied = split_or_piece if isinstance(split_or_piece, list) else [split_or_piece]
            threads_seen.extend(torch.get_num_threads() for p in copied if p.length < SERIAL_COPY_BYTES)
            return copy(plan_, split_or_piece, *args)
        return record

    monkeypatch.setattr(packing, "_pack_split", recording(packing._pack_split))
    monkeypatch.setattr(packing, "unpack_piece", recording(packing.unpack_piece))
    buf = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)
    targets = [torch.zeros_like(t) for t in sources]
    pack_bucket(plan, 1, sources, buf, small_only=True)
    unpack_bucket(plan, 1, buf, targets, small_only=True)
    assert threads_seen and set(threads_seen) == {1}
    assert torch.equal(targets[0][2 * mib:], sources[0][2 * mib:])  # the small tail landed
    assert torch.equal(targets[1], sources[1])
