"""Data-plane transports and their availability probes.

``auto`` is not a backend: the coordinator turns it into lanes of shm and gloo.
``available(kind)`` says whether a backend can run here; a missing library makes a
backend unavailable, never an import error. nccl and cuda-ipc need a GPU (nccl:
NCCL's library and one GPU per rank; cuda-ipc: cupy and engines on the trainer's
host).
``group`` (SGLang's update-group protocol) needs gloo; its nccl backend needs CUDA,
checked when a group with that backend is opened.

This module imports no torch (its probes import it when asked about a backend that
needs it): the coordinator plans lanes with the names, layouts and lane kinds here and
never moves a byte. ``make_sender`` and ``make_receiver`` import the submodule of the
kind asked for, and torch with it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.v1 import common_pb2

if TYPE_CHECKING:
    import torch.distributed as dist

    from weightsync.transport.base import Receiver, Sender

SHM_DIR = os.environ.get("WEIGHTSYNC_SHM_DIR", "/dev/shm")  # where the shm transport's segments live

# The group transport's layouts on the wire (``weightsync.transport.flattened``): a
# broadcast per tensor (SGLang's default protocol), or runs of tensors end to end.
TENSORS = "tensors"
FLATTENED = "flattened"
LAYOUTS = (TENSORS, FLATTENED)
# What a trainer may ask for instead: the coordinator picks FLATTENED for a round when
# every engine in it takes that layout (``EngineState.group_layouts``), else TENSORS;
# the rendezvous always names the layout picked.
AUTO_LAYOUT = "auto"

NAMES: dict[str, common_pb2.TransportKind.ValueType] = {
    "gloo": common_pb2.TRANSPORT_KIND_GLOO,
    "shm": common_pb2.TRANSPORT_KIND_SHM,
    "nccl": common_pb2.TRANSPORT_KIND_NCCL,
    "cuda-ipc": common_pb2.TRANSPORT_KIND_CUDA_IPC,
    "group": common_pb2.TRANSPORT_KIND_GROUP,
    # Not a transport of its own: per engine, shm on the trainer's host, gloo elsewhere
    # (the coordinator splits the round into lanes; see server/coordinator/round.py::plan_lanes).
    "auto": common_pb2.TRANSPORT_KIND_AUTO,
}
KIND_NAMES = {v: k for k, v in NAMES.items()}


def kind_from_name(name: str) -> common_pb2.TransportKind.ValueType:
    """``"gloo"`` -> TRANSPORT_KIND_GLOO; InvalidArgument for unknown names."""
    try:
        return NAMES[name]
    except KeyError:
        raise InvalidArgument(f"unknown transport {name!r}; choose from {sorted(NAMES)}") from None


def is_relay_upstream(lane: common_pb2.Rendezvous) -> bool:
    """The network lane from the trainer to a host's relay (the relay is its one
    receiver; it is not the lane the relay's own engine receives in). See
    ``weightsync.transport.relay``."""
    return lane.transport == common_pb2.TRANSPORT_KIND_GLOO and bool(lane.relayed_by)


def is_relayed(lane: common_pb2.Rendezvous) -> bool:
    """A host's shm lane whose sender is the host's relay, not the trainer."""
    return lane.transport == common_pb2.TRANSPORT_KIND_SHM and bool(lane.relayed_by)


def unavailable_reason(kind: common_pb2.TransportKind.ValueType) -> str | None:
    """None when ``kind`` can run on this machine, else why not."""
    if kind in (common_pb2.TRANSPORT_KIND_GLOO, common_pb2.TRANSPORT_KIND_GROUP):
        import torch.distributed as dist
        return None if dist.is_available() and dist.is_gloo_available() else "torch has no gloo backend"
    if kind == common_pb2.TRANSPORT_KIND_SHM:
        return None if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else f"{SHM_DIR} is not writable"
    if kind in (common_pb2.TRANSPORT_KIND_NCCL, common_pb2.TRANSPORT_KIND_CUDA_IPC):
        return _gpu_unavailable_reason(kind)
    if kind == common_pb2.TRANSPORT_KIND_AUTO:
        return unavailable_reason(common_pb2.TRANSPORT_KIND_GLOO)
    if kind == common_pb2.TRANSPORT_KIND_UNSPECIFIED:
        return "transport not specified"
    return f"unknown transport kind {kind}"


def _gpu_unavailable_reason(kind: common_pb2.TransportKind.ValueType) -> str | None:
    """Both need torch with CUDA and a GPU. nccl needs NCCL's library (torch's CUDA
    builds bring it); cuda-ipc needs cupy (any CUDA build of it: ``weightsync[cuda12]``,
    ``weightsync[cuda13]`` or one preinstalled)."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if kind == common_pb2.TRANSPORT_KIND_NCCL:
        from weightsync.errors import TransferError
        from weightsync.transport.nccl_lib import library
        try:
            library()
        except TransferError as exc:
            return exc.message
        return None
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'weightsync[cuda12]' or 'weightsync[cuda13]', to match CUDA)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"CUDA unavailable: {exc}"
    return None


def available(kind: common_pb2.TransportKind.ValueType) -> bool:
    """Whether ``kind`` can run here."""
    return unavailable_reason(kind) is None


def _require(kind) -> None:
    if kind == common_pb2.TRANSPORT_KIND_AUTO:
        raise InvalidArgument("auto is a choice per engine, not a data-plane group: a rendezvous names "
                              "the transport of its lane")
    reason = unavailable_reason(kind)
    if reason is not None:
        raise FailedPrecondition(f"transport {KIND_NAMES.get(kind, kind)} unavailable: {reason}",
                                 reason="TRANSPORT_UNAVAILABLE")


def make_sender(kind: common_pb2.TransportKind.ValueType, store: dist.Store, *,
                data_host: str = "127.0.0.1") -> Sender:
    """A sender for ``kind`` on the trainer's store. ``data_host``: the address its
    receivers reach this side at; network transports listen there (explicitly: never
    wherever this machine's hostname happens to resolve)."""
    _require(kind)
    if kind == common_pb2.TRANSPORT_KIND_GLOO:
        from weightsync.transport.gloo import GlooSender
        return GlooSender(store, data_host)
    if kind == common_pb2.TRANSPORT_KIND_GROUP:
        from weightsync.transport.group import GroupSender
        return GroupSender(store, data_host)
    if kind == common_pb2.TRANSPORT_KIND_NCCL:
        from weightsync.transport.nccl import NcclSender
        return NcclSender(store)
    if kind == common_pb2.TRANSPORT_KIND_CUDA_IPC:
        from weightsync.transport.cuda_ipc import CudaIpcSender
        return CudaIpcSender(store)
    from weightsync.transport.shm import ShmSender
    return ShmSender(store)


def make_receiver(kind: common_pb2.TransportKind.ValueType, *, data_host: str = "127.0.0.1") -> Receiver:
    """A receiver for ``kind``; network transports listen on ``data_host`` (the address
    the sender reaches this side at)."""
    _require(kind)
    if kind == common_pb2.TRANSPORT_KIND_GLOO:
        from weightsync.transport.gloo import GlooReceiver
        return GlooReceiver(data_host)
    if kind == common_pb2.TRANSPORT_KIND_GROUP:
        from weightsync.transport.group import GroupReceiver
        return GroupReceiver(data_host)
    if kind == common_pb2.TRANSPORT_KIND_NCCL:
        from weightsync.transport.nccl import NcclReceiver
        return NcclReceiver()
    if kind == common_pb2.TRANSPORT_KIND_CUDA_IPC:
        from weightsync.transport.cuda_ipc import CudaIpcReceiver
        return CudaIpcReceiver()
    from weightsync.transport.shm import ShmReceiver
    return ShmReceiver()


__all__ = ["NAMES", "KIND_NAMES", "kind_from_name", "SHM_DIR", "TENSORS", "FLATTENED", "LAYOUTS", "AUTO_LAYOUT",
           "is_relay_upstream", "is_relayed", "available", "unavailable_reason", "make_sender", "make_receiver"]
