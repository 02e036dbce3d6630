"""Where one sender's parts land in an engine's full tensors: ``PartViews``, made
lazily and kept with the targets they view. See ``Owners.part_views``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the coordinator checks owners without torch; the ranks hold tensors
    import torch


class PartLayout(NamedTuple):
    """One sender's parts as Python lists, made once per sender (``Owners._layout``)."""

    tensors: list[int]  # index into the plan's tensors
    starts: list[int]   # first slice along the part's dimension
    rows: list[int]     # number of slices
    whole: list[bool]   # the part is its whole tensor
    dims: list[int]     # the dimension each part slices
    extras: list        # each part's further slices (a block) or None; [] where no part is a block


def kept_views(targets, layout: PartLayout) -> list:
    """The list of part views kept on ``targets`` (an ``AddressedTensors``) for the
    sender whose parts ``layout`` lists, made empty on first use. Keyed by the layout's
    identity, the layout kept beside the list so that the key is never another's."""
    kept = targets.__dict__.setdefault("part_views", {})
    entry = kept.get(id(layout))
    if entry is None or entry[0] is not layout:
        entry = kept[id(layout)] = (layout, [None] * len(layout.tensors))
    return entry[1]


def has_staged_parts(layout: PartLayout) -> bool:
    """Whether some part is no contiguous view of its tensor: a slice along a dimension
    other than 0, or a block."""
    return any(layout.dims) or bool(layout.extras)


class PartViews(Sequence):
    """One sender's part views of a set of full tensors (see ``Owners.part_views``):
    a sequence whose items are made on first access and kept until ``done``.

    A part that slices a dimension other than 0, or a block, is no contiguous view of
    its tensor: its item is a tensor of its own (``staged``), copied into place by
    ``done``, which the receive calls for each part once its last byte is in.

    ``addresses`` (uint64, one per part) and ``sizes`` (the part plan's byte sizes),
    where the targets carried their addresses: as ``cross_memory.AddressedTensors``
    has them, for ``cross_memory.addresses_for``. ``made``: a list of views kept from
    an earlier round of the same targets (no staged part), filled here and kept."""

    def __init__(self, layout: PartLayout, targets: Sequence[torch.Tensor], *, addresses: np.ndarray | None = None,
                 sizes: Sequence[int] | None = None, made: list | None = None) -> None:
        self._tensors, self._starts, self._rows, self._whole, self._dims, extras = layout
        self._extras = extras or [None] * len(self._tensors)
        self._targets = targets
        self.staged = has_staged_parts(layout)  # some part lands in a tensor of its own first
        if made is not None and self.staged:
            raise ValueError("staged parts are copied into place: their views are not kept")
        self._keep = made is not None
        self._made: list[torch.Tensor | None] = made if made is not None else [None] * len(self._tensors)
        self.addresses, self.sizes = addresses, sizes

    def _place(self, i: int) -> torch.Tensor:
        """Part ``i``'s place in its full tensor: a view, contiguous only for a row range."""
        view = self._targets[self._tensors[i]].narrow(self._dims[i], self._starts[i], self._rows[i])
        for dim, start, rows in self._extras[i] or ():
            view = view.narrow(dim, start, rows)
        return view

    def __len__(self) -> int:
        return len(self._tensors)

    def done(self, i: int) -> None:
        """Part ``i``'s bytes are all in: a staged part is copied into its tensor, and
        the view is let go (kept, it would keep its full tensor alive after the
        engine's loader let that go) -- unless the views are kept on the targets
        themselves (``made``), which live no longer than their tensors."""
        if self._keep:  # views of the targets' own memory, kept with them
            return
        made = self._made[i]
        self._made[i] = None
        if made is not None and (self._dims[i] or self._extras[i]) and not self._whole[i]:
            self._place(i).copy_(made)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self._made[i]
        if view is None:
            target = self._targets[self._tensors[i]]
            dim = self._dims[i]
            if self._whole[i]:
                view = target
            elif dim == 0 and not self._extras[i]:
                view = target.narrow(0, self._starts[i], self._rows[i])
            else:
                view = target.new_empty(self._place(i).shape)
            self._made[i] = view
        return view

