"""A round's cost grows with its bytes, not with its tensor count (invariant cost-by-bytes).

Real processes (a coordinator, two reference-engine agents), the same payload size in
~100 and in ~20,000 tensors, rounds timed in this one run. Per-tensor work that is
quadratic, or a rebuild per round, shows as a ratio in the hundreds (20k tensors took
minutes per round before plans, specs and targets were cached), and a full garbage
collection per step or a parallel region per small copy as 3-4x; on the quiet 2-core
machine the ratio is 1.8 (128 MiB, whole update_weights), and the bound of 6 leaves room
for a busy one. Measured over shm, and over the group transport's flattened layout
(SGLang's flattened_bucket: a broadcast per run of tensors; its default layout, a
broadcast per tensor, is SGLang's classic protocol and does not scale, 11x per byte at
1 GiB). ``weightsync bench --tensors`` gives the figures at 1 GiB (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from tests.gc_watch import collections_during
from tests.test_transports import KINDS, rendezvous
from weightsync import transport as transports
from weightsync.apps.local_cluster import LocalCluster
from weightsync.client import TrainerClient
from weightsync.engine.model import ReferenceLM, config_for_size
from weightsync.errors import InvalidArgument
from weightsync.transport.cross_memory import AddressedTensors
from weightsync.transport.shm import ShmReceiver
from weightsync.transport.store import host_store

PAYLOAD = 128 << 20
MAX_RATIO = 6.0


# how each measured way is asked for: the client's transport and group layout
WAYS = {"shm": ("shm", "tensors"), "group-flat": ("group", "flattened")}


async def median_round_seconds(tmp: str, tensors: int, rounds: int = 3) -> tuple[dict[str, float], int]:
    """Median seconds of a round, per way of ``WAYS``, and the tensor count made."""
    cfg = config_for_size(PAYLOAD, tensors)
    model = ReferenceLM(cfg)
    named = list(model.named_parameters())
    with LocalCluster(tmp, engines=2, agent_args=("--model", cfg.to_json()), agent_timeout_s=240,
                      settle_s=0.5) as cluster:
        medians, version = {}, 0
        for way, (transport, layout) in WAYS.items():
            medians[way] = await _rounds(cluster.address, named, rounds, transport, layout, version)
            version += rounds + 1
        return medians, len(named)


async def _rounds(address: str, named, rounds: int, transport: str, layout: str, done: int) -> float:
    """``rounds`` timed rounds after a warm-up, versions after ``done``."""
    seconds = []
    async with TrainerClient(address, transport=transport, group_layout=layout) as client:
        await client.update_weights(named, version=done + 1, timeout_s=300)  # first round builds plan and group
        for version in range(done + 2, done + rounds + 2):
            start = time.perf_counter()
            result = await client.update_weights(named, version=version, timeout_s=300)
            seconds.append(time.perf_counter() - start)
            assert result.ok and len(result.engines) == 2
    return statistics.median(seconds)


@pytest.mark.timeout(600)
async def test_twenty_thousand_tensors_cost_a_small_multiple_of_a_hundred(tmp_path):
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    few, few_count = await median_round_seconds(str(tmp_path / "few"), 100)
    many, many_count = await median_round_seconds(str(tmp_path / "many"), 20_000)
    assert few_count < 200 and many_count > 19_000
    for way in WAYS:
        ratio = many[way] / few[way]
        print(f"{way}, {PAYLOAD >> 20} MiB: {few_count} tensors {few[way]:.3f} s, {many_count} tensors "
              f"{many[way]:.3f} s, ratio {ratio:.2f}")
        assert ratio <= MAX_RATIO, f"{way}: a round with {many_count} tensors took {ratio:.1f}x one with {few_count}"


@pytest.mark.parametrize("given", ["list", "generator"])
def test_a_step_with_the_cached_plan_keeps_no_per_tensor_objects_alive(given):
    """The trainer's per-step preparation keeps no 20k new objects alive: such objects are
    promoted by the garbage collector and soon cost a full collection of the trainer's
    heap on every few steps (117-300 ms with this model, the GIL held: the event loop
    stalled throughout). That holds for the pairs a generator makes too
    (``model.named_parameters()``, a new tuple per tensor, as the README passes it):
    they are read one by one, never listed."""
    import gc

    cfg = config_for_size(16 << 20, 20_000)
    model = ReferenceLM(cfg)
    named = list(model.named_parameters())
    client = TrainerClient("127.0.0.1:1", transport="shm")  # never connects: preparation only
    first = client._prepare(named, False)
    with collections_during() as collections:
        again = client._prepare(named if given == "list" else model.named_parameters(), False)
    assert again.plan is first.plan  # replayed, not rebuilt
    assert all(a is b for a, b in zip(again.sources, (t for _, t in named), strict=True))  # no copies
    assert len(collections) <= 1, f"{len(collections)} collections during one step's preparation"
    # Nor does the cached plan add 20k objects to every full collection of the heap:
    # its shapes are tuples of ints, which the collector stops tracking.
    gc.collect()
    cached_shapes = client.round_senders.preparer.cache.shapes
    assert len(cached_shapes) == len(named) and not any(gc.is_tracked(s) for s in cached_shapes)


def test_a_generator_that_changed_is_planned_again_from_every_pair():
    """Read as it goes, a generator whose pairs stop matching the plan halfway (or end
    early, or go on longer) is planned again from all of its pairs, those read before
    the change included."""
    model = ReferenceLM(config_for_size(1 << 20, 40))
    named = list(model.named_parameters())
    client = TrainerClient("127.0.0.1:1", transport="shm")
    plan = client._prepare(iter(named), False).plan
    renamed = named[:20] + [("renamed", named[20][1])] + named[21:]
    for pairs in (renamed, named[:-1], named + [("extra", torch.zeros(3))], named):
        prepared = client._prepare(iter(pairs), False)
        assert [s.name for s in prepared.plan.slots] == [n for n, _ in pairs]
        assert all(a is b for a, b in zip(prepared.sources, (t for _, t in pairs), strict=True))
    assert prepared.plan.plan_id == plan.plan_id
    with pytest.raises(InvalidArgument, match="no tensors"):
        client._prepare(iter(()), False)


def test_a_step_over_twenty_thousand_tensors_hands_the_gil_to_the_event_loop_as_it_goes(monkeypatch):
    """The per-step pass runs on the client's worker thread, in Python: ~20 ms at 20k
    tensors, through which a thread that does not let go of the GIL keeps the event
    loop waiting up to the interpreter's 5 ms switch interval at every wake-up. It lets
    go every ``HAND_OVER_EVERY`` tensors (``weightsync.gil``), and still replays the
    same plan and sources."""
    import weightsync.client.prepared_weights as trainer_module

    named = list(ReferenceLM(config_for_size(16 << 20, 20_000)).named_parameters())
    client = TrainerClient("127.0.0.1:1", transport="shm")  # never connects: preparation only
    first = client._prepare(named, False, addresses=True)  # plans; the pass is the next step's
    handed_over_at, looked_at = [], [0]
    real_contiguous = torch.Tensor.contiguous

    def counting_contiguous(self, *args, **kwargs):
        looked_at[0] += 1  # how far the pass is
        return real_contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting_contiguous)
    monkeypatch.setattr(trainer_module, "hand_over_gil", lambda: handed_over_at.append(looked_at[0]))
    again = client._prepare(named, False, addresses=True)
    assert again.plan is first.plan
    assert all(a is b for a, b in zip(again.sources, (t for _, t in named), strict=True))
    assert again.sources.addresses.tolist() == [t.data_ptr() for _, t in named]
    every = trainer_module.HAND_OVER_EVERY
    # Each hand-over comes right after ``every`` more tensors were looked at.
    assert len(handed_over_at) == (len(named) - 1) // every >= 19
    assert handed_over_at == [k * every for k in range(1, len(handed_over_at) + 1)]


def test_the_cached_plan_follows_a_change_of_shape_dtype_or_name():
    model = ReferenceLM(config_for_size(1 << 20, 40))
    named = list(model.named_parameters())
    client = TrainerClient("127.0.0.1:1", transport="shm")
    plan = client._prepare(named, False).plan
    name, tensor = named[3]
    tensor.data = torch.zeros(tensor.numel() + 8)  # same object, new shape
    resized = client._prepare(named, False).plan
    assert resized is not plan and resized.slots[3].shape == (tensor.numel(),)
    tensor.data = tensor.data.double()
    assert client._prepare(named, False).plan.slots[3].dtype == torch.float64
    renamed = named[:3] + [("renamed", tensor)] + named[4:]
    assert client._prepare(renamed, False).plan.slots[3].name == "renamed"
    with pytest.raises(InvalidArgument):
        client._prepare([("w", "not a tensor")], False)


def test_the_trainers_one_pass_takes_the_addresses_shm_reads():
    """A replayed step's pass also takes each source's address (shm's direct reads): the
    address of the bytes sent, a non-contiguous tensor's contiguous copy included. A
    round over shm from those sources reads them directly and is bitwise. No addresses
    where the plan casts to a wire dtype or where they were not asked for."""
    model = ReferenceLM(config_for_size(1 << 20, 40))
    named = list(model.named_parameters())
    named[5] = ("strided", torch.randn(16, 9).t())
    client = TrainerClient("127.0.0.1:1", transport="shm")
    assert type(client._prepare(named, False, addresses=True).sources) is list  # first step: planned, no pass
    prepared = client._prepare(named, False, addresses=True)
    sources = prepared.sources
    assert isinstance(sources, AddressedTensors) and sources.sizes is prepared.plan.sizes
    assert sources[5] is not named[5][1] and sources[5].is_contiguous() and torch.equal(sources[5], named[5][1])
    assert sources.addresses.tolist() == [t.data_ptr() for t in sources]
    assert type(client._prepare(named, False).sources) is list

    store = host_store("127.0.0.1", timeout_s=20)
    sender, receiver = transports.make_sender(KINDS["shm"], store), ShmReceiver()
    targets = [torch.zeros(s.shape, dtype=s.dtype) for s in prepared.plan.slots]
    rdzv = rendezvous(store, KINDS["shm"], 2)
    try:
        thread = threading.Thread(target=receiver.receive, args=(rdzv, 1, prepared.plan, targets),
                                  kwargs={"deadline_at": time.monotonic() + 20, "abort": threading.Event()})
        thread.start()
        with torch.no_grad():
            sender.send(rdzv, prepared.plan, sources, deadline_at=time.monotonic() + 20, abort=threading.Event())
        thread.join(25)
        assert receiver.last_mode == "direct"
        assert all(torch.equal(a, b) for a, b in zip(targets, (t for _, t in named), strict=True))
    finally:
        sender.close()
        receiver.close()

    cast = TrainerClient("127.0.0.1:1", transport="shm", wire_dtype=torch.bfloat16)
    cast._prepare(named, False, addresses=True)
    assert type(cast._prepare(named, False, addresses=True).sources) is list
