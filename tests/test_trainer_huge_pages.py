"""A trainer's weights moved onto huge pages (``weightsync.arena.place_on_huge_pages``):
the same tensors, the same values, end to end in one arena in model order; training
still updates them there; weights tied through views of one storage are refused with
nothing moved; shm's trainer side stops advising huge pages for tensors placed so."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync.arena import in_arenas, place_on_huge_pages
from weightsync.plan import ALIGN


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.proj = torch.nn.Linear(16, 7, bias=True)  # 7 outputs: a bias of 28 bytes, padded in the arena
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: one shared parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)) + self.proj(self.embed(ids)).sum(-1, keepdim=True))


def test_a_modules_weights_move_end_to_end_into_one_arena_same_objects_same_values():
    torch.manual_seed(0)
    model = _Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, 50, (3, 5))
    expected = model(ids).detach()

    placed = place_on_huge_pages(model)

    params = list(model.parameters())
    assert len(params) == 5  # the tied weight once
    assert placed >= sum(p.nbytes for p in params)
    for name, p in model.named_parameters():
        assert p is objects[name] and torch.equal(p.detach(), before[name]), name
    assert model.head.weight is model.embed.weight  # still tied
    # End to end in model order, each at the plan's alignment after the one before.
    at = params[0].data_ptr()
    for p in params:
        assert p.data_ptr() == at
        at += (p.nbytes + ALIGN - 1) // ALIGN * ALIGN
    assert in_arenas(np.array([p.data_ptr() for p in params], np.uint64))
    assert not in_arenas(np.array([torch.ones(4).data_ptr()], np.uint64))
    assert torch.equal(model(ids).detach(), expected)

    # Training goes on in the arena: the optimizer updates the same memory.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    where = [p.data_ptr() for p in params]
    model(ids).square().mean().backward()
    opt.step()
    assert [p.data_ptr() for p in params] == where
    assert not torch.equal(model.embed.weight.detach(), before["embed.weight"])


def test_weights_tied_through_views_of_one_storage_are_refused_and_nothing_moves():
    storage = torch.zeros(10)
    a = torch.nn.Parameter(storage[:5])
    b = torch.nn.Parameter(storage[5:])
    other = torch.nn.Parameter(torch.ones(3))
    where = [t.data_ptr() for t in (a, b, other)]
    with pytest.raises(ValueError, match="share memory"):
        place_on_huge_pages([other, a, b])
    assert [t.data_ptr() for t in (a, b, other)] == where


def test_weights_off_the_cpu_and_empty_ones_are_left_where_they_are():
    off = torch.nn.Parameter(torch.empty(4, device="meta"))
    empty = torch.nn.Parameter(torch.empty(0))
    assert place_on_huge_pages([off, empty]) == 0
    assert off.device.type == "meta"
    kept = torch.nn.Parameter(torch.arange(6.0))
    assert place_on_huge_pages([off, kept]) == 24 and off.device.type == "meta"
    assert torch.equal(kept.detach(), torch.arange(6.0))


def test_shm_advises_huge_pages_only_for_tensors_that_are_not_placed(monkeypatch, caplog):
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[madvise]" not in setting.read_text():
        pytest.skip("the advice applies where the kernel gives huge pages on request only (THP 'madvise')")
    from weightsync.transport import cross_memory

    for var in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES"):
        monkeypatch.delenv(var, raising=False)
    placed = [torch.nn.Parameter(torch.ones(1000)), torch.nn.Parameter(torch.ones(10))]
    place_on_huge_pages(placed)
    plain = torch.ones(1000)
    with caplog.at_level(logging.INFO, logger="weightsync.transport.shm"):
        monkeypatch.setattr(cross_memory, "_advised", False)
        cross_memory.advise_hugepages_once(np.array([p.data_ptr() for p in placed], np.uint64))
        assert "4 KiB pages" not in caplog.text
        monkeypatch.setattr(cross_memory, "_advised", False)
        cross_memory.advise_hugepages_once(np.array([placed[0].data_ptr(), plain.data_ptr()], np.uint64))
        assert "4 KiB pages" in caplog.text and "place_on_huge_pages" in caplog.text


def test_direct_reads_merge_segments_that_follow_one_another_on_both_sides(monkeypatch):
    """shm's direct reads of tensors that lie end to end in the trainer and in the engine
    go as one segment per run (split only at the per-call cap), and the bytes are the
    same; segments with padding, or another order, between them on either side stay
    apart. Read from this process itself (the kernel allows a process its own memory)."""
    import os

    from weightsync.arena import new_arena
    from weightsync.transport import cross_memory

    def merged(local, remote, lengths):
        return [a.tolist() for a in cross_memory._coalesce(np.array(local, np.uint64), np.array(remote, np.uint64),
                                                            np.array(lengths, np.uint64))]

    assert merged([100, 110, 120], [1000, 1010, 1020], [10, 10, 5]) == [[100], [1000], [25]]
    assert merged([100, 112, 122], [1000, 1010, 1020], [10, 10, 5]) == [[100, 112], [1000, 1010], [10, 15]]
    assert merged([100, 110, 120], [1000, 1020, 1010], [10, 10, 10]) == [[100, 110, 120], [1000, 1020, 1010],
                                                                         [10, 10, 10]]
    assert merged([100], [1000], [10]) == [[100], [1000], [10]]

    sizes = [4096 * (i % 5 + 1) for i in range(2000)]  # 2000 small tensors, 24 MiB in all
    source, target = new_arena(sum(sizes)), new_arena(sum(sizes))
    source.copy_(torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
    calls = []
    real = cross_memory._process_vm("readv")

    def counted(*args):
        calls.append(args[2])  # segments in the call
        return real(*args)

    monkeypatch.setitem(cross_memory._calls, "readv", counted)
    memory = cross_memory.RemoteMemory(os.getpid(), 0, b"")
    memory.read(starts + np.uint64(target.data_ptr()), starts + np.uint64(source.data_ptr()),
                np.array(sizes, np.uint64))
    assert torch.equal(target, source)
    assert len(calls) == -(-sum(sizes) // cross_memory._MAX_CALL_BYTES) and max(calls) == 1
