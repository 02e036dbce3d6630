"""Buckets that go as one gloo broadcast each where both ends hold them as one run of
memory (``transport.whole_buckets``), agreed per round and per bucket. Real gloo groups
over real sockets, sender and receivers in threads of one process; the engine's
targets are the reference engine's own (its arena), the trainer's weights placed with
``place_on_huge_pages`` as a user's trainer would."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import torch

from tests.test_memory_runs import _counting_copies
from tests.test_transports import KINDS, _relay_round, rendezvous, run_round
from weightsync import transport as transports
from weightsync.arena import place_on_huge_pages
from weightsync.engine.model import ReferenceLM, config_for_size
from weightsync.engine.reference import ReferenceAdapter
from weightsync.plan import BucketPlan
from weightsync.transport import gloo as gloo_module
from weightsync.transport import relay as relay_module
from weightsync.transport.cross_memory import AddressedTensors, tensor_addresses
from weightsync.transport.store import host_store
from weightsync.transport.whole_buckets import whole_bucket_views

# Large matrices (pieces of 1 MiB and more, each a broadcast of its own when cut) between
# small norms and biases: the shape whose broadcasts whole buckets save.
CONFIG = config_for_size(24 << 20, 40)
BUCKET = 4 << 20


def _trained_trainer() -> tuple[ReferenceLM, list]:
    torch.manual_seed(3)
    trainer = ReferenceLM(CONFIG)
    place_on_huge_pages(trainer)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p))  # nothing like the engine's boot weights
    return trainer, list(trainer.named_parameters())


def _addressed(tensors, plan):
    return AddressedTensors(tensors, tensor_addresses(tensors, plan.dtypes, plan.sizes), plan.sizes)


def _placed_trainers_round() -> tuple[list, BucketPlan, AddressedTensors]:
    """A placed trainer's named weights, its plan and its sources with their addresses
    (as the trainer client's per-step pass makes them)."""
    _, named = _trained_trainer()
    plan = BucketPlan.from_tensors(named, bucket_bytes=BUCKET)
    return named, plan, _addressed([p.detach() for _, p in named], plan)


def _assert_holds(named, targets) -> None:
    """Every target bitwise the trainer's weight of its name."""
    for (name, p), got in zip(named, targets, strict=True):
        assert torch.equal(got, p.detach()), name


def _cut(plan: BucketPlan, buckets) -> int:
    """Broadcasts of ``buckets`` when cut (``wire_ops``): one per range, one for the gathered runs."""
    return sum(len(plan.wire_ops(b).ops) + (1 if plan.wire_ops(b).gathered else 0) for b in buckets)


def _counting_broadcasts(monkeypatch, module) -> Counter:
    """Broadcasts posted, per thread (the sender is the test's main thread)."""
    counts: Counter = Counter()
    real = module.broadcast_from_root

    def counted(pg, buf):
        counts[threading.current_thread().name] += 1
        return real(pg, buf)

    monkeypatch.setattr(module, "broadcast_from_root", counted)
    return counts


def test_a_placed_trainer_sends_each_bucket_whole_into_engines_arenas(monkeypatch):
    """Both ends hold every bucket as one run: one broadcast per bucket (against one per
    large piece and per gathered run when cut), nothing packed or unpacked, and the
    engines' weights bitwise the trainer's, in the engines' own memory."""
    named, plan, sources = _placed_trainers_round()
    assert _cut(plan, range(plan.num_buckets)) >= 2 * plan.num_buckets  # what gloo sent per round before
    adapters = [ReferenceAdapter(CONFIG) for _ in range(2)]
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["gloo"], store)
    receivers = [transports.make_receiver(KINDS["gloo"]) for _ in adapters]
    try:
        targets = [a.load_targets(plan) for a in adapters]
        assert all(v is not None for v in whole_bucket_views(plan, sources))
        where = [[t.data_ptr() for t in ts] for ts in targets]
        copies = _counting_copies(monkeypatch)
        counts = _counting_broadcasts(monkeypatch, gloo_module)
        _, errors = run_round(sender, receivers, rendezvous(store, KINDS["gloo"], 3, group="whole"), plan, sources,
                              targets=targets)
        assert errors == {}
        assert counts[threading.current_thread().name] == plan.num_buckets
        assert copies == {"pack": 0, "unpack": 0}
        for ts, before in zip(targets, where, strict=True):
            assert [t.data_ptr() for t in ts] == before
            _assert_holds(named, ts)
    finally:
        sender.close()
        for r in receivers:
            r.close()
        for a in adapters:
            a.close()


def test_buckets_go_whole_only_where_every_receiver_can_land_them(monkeypatch):
    """One engine has a weight outside its arena (the buckets that hold it are not one
    run there), another's targets carry no addresses (a vLLM worker's): with the first,
    only the other buckets go whole; with the second, none does. Every engine still
    gets the trainer's bytes exactly."""
    named, plan, sources = _placed_trainers_round()
    adapter = ReferenceAdapter(CONFIG)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["gloo"], store)
    receiver = transports.make_receiver(KINDS["gloo"])
    try:
        arena_targets = list(adapter.load_targets(plan))
        moved = len(arena_targets) // 2
        arena_targets[moved] = torch.zeros_like(arena_targets[moved])  # this one lies elsewhere
        displaced = _addressed(arena_targets, plan)
        split = {p_bucket for p_bucket in range(plan.num_buckets)
                 if any(p.tensor_index == moved for p in plan.bucket_pieces(p_bucket))}
        views = whole_bucket_views(plan, displaced)
        assert {b for b, v in enumerate(views) if v is None} == split and len(split) < plan.num_buckets

        counts = _counting_broadcasts(monkeypatch, gloo_module)
        _, errors = run_round(sender, [receiver], rendezvous(store, KINDS["gloo"], 2, group="some"), plan, sources,
                              targets=[displaced])
        assert errors == {}
        assert counts[threading.current_thread().name] == plan.num_buckets - len(split) + _cut(plan, split)
        _assert_holds(named, displaced)

        # A receiver whose targets carry no addresses: every bucket cut as before.
        plain = [torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots]
        counts.clear()
        _, errors = run_round(sender, [receiver], rendezvous(store, KINDS["gloo"], 2, group="none"), plan, sources,
                              targets=[plain])
        assert errors == {}
        assert counts[threading.current_thread().name] == _cut(plan, range(plan.num_buckets))
        _assert_holds(named, plain)
    finally:
        sender.close()
        receiver.close()
        adapter.close()


def test_a_host_relay_takes_whole_buckets_into_its_shm_slots(monkeypatch):
    """A relay lands any bucket whole (in its shm slot, as the bucket lies): from a placed
    trainer the network lane is one broadcast per bucket, and the engines behind the
    relay get the trainer's bytes exactly."""
    from weightsync.transport.relay import HostRelay

    named, plan, sources = _placed_trainers_round()
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["gloo"], store)
    relay = HostRelay("127.0.0.1")
    receivers = [transports.make_receiver(KINDS["shm"]) for _ in range(2)]
    counts = _counting_broadcasts(monkeypatch, relay_module)
    try:
        targets, errors, relay_error, send_error = _relay_round(store, sender, relay, receivers, plan, sources)
        assert errors == {} and relay_error is None and send_error is None
        assert sum(counts.values()) == plan.num_buckets  # the relay's side of the network lane
        for out in targets:
            _assert_holds(named, out)
    finally:
        sender.close()
        relay.close()
        for r in receivers:
            r.close()


def test_a_whole_bucket_choice_of_another_length_is_refused():
    from weightsync.errors import TransferError
    from weightsync.transport.whole_buckets import _mask

    assert list(_mask(np.packbits([1, 0, 1]).tobytes(), 3, "x")) == [True, False, True]
    for data in (b"", bytes(2)):
        try:
            _mask(data, 3, "the trainer's whole-bucket choice")
        except TransferError as exc:
            assert "same weightsync release" in str(exc)
        else:
            raise AssertionError("accepted")


def test_shms_ring_copies_a_bucket_that_lies_as_one_run_in_one_piece(monkeypatch):
    """Through the ring (direct reads off), a placed trainer fills each slot with one
    copy and an engine whose arena holds the bucket as one run empties it with one:
    no per-tensor pack or unpack, and the engine's weights bitwise the trainer's."""
    from weightsync.transport import shm as shm_module
    from weightsync.transport.shm import ShmReceiver

    named, plan, sources = _placed_trainers_round()
    adapter = ReferenceAdapter(CONFIG)
    store = host_store("127.0.0.1", timeout_s=20)
    sender = transports.make_sender(KINDS["shm"], store)
    receiver = ShmReceiver(direct=False)
    calls = Counter()
    for name in ("pack_bucket", "unpack_bucket"):
        real = getattr(shm_module, name)
        monkeypatch.setattr(shm_module, name, lambda *a, _real=real, _name=name, **k: (calls.update([_name]),
                                                                                      _real(*a, **k))[1])
    try:
        targets = adapter.load_targets(plan)
        _, errors = run_round(sender, [receiver], rendezvous(store, KINDS["shm"], 2, group="ring"), plan, sources,
                              targets=[targets])
        assert errors == {} and receiver.last_mode == "ring"
        assert calls == Counter()
        _assert_holds(named, targets)
        # Separate tensors on both sides: packed and unpacked per bucket, as before.
        plain_sources = [p.detach().clone() for _, p in named]
        plain = [torch.zeros(s.shape, dtype=s.dtype) for s in plan.slots]
        _, errors = run_round(sender, [receiver], rendezvous(store, KINDS["shm"], 2, group="ring2"), plan,
                              plain_sources, targets=[plain])
        assert errors == {}
        assert calls == Counter({"pack_bucket": plan.num_buckets, "unpack_bucket": plan.num_buckets})
        _assert_holds(named, plain)
    finally:
        sender.close()
        receiver.close()
        adapter.close()
