"""SglangAdapter: drives an SGLang server through its HTTP API.

Control: ``/pause_generation`` (KEEP -> ``in_place``, ABORT -> ``abort``; SGLang has
no drain-then-pause mode, so WAIT is refused), ``/continue_generation``,
``/release_memory_occupation`` and ``/resume_memory_occupation``, ``/model_info`` for
the version, ``/health``. Every call has a deadline.

SGLang's ``/resume_memory_occupation`` must name exactly tags that were released (a
tag that was not released raises KeyError and kills the scheduler), and
``/continue_generation`` does not check memory state. So the agent keeps a ledger
(``asleep``) and only ever resumes what the ledger says is released.

Weights: SGLang receives through its own weight update group, which is weightsync's
``group`` transport (see ``weightsync.transport.group``): the adapter asks SGLang to
join the trainer's group (``/init_weights_update_group``, once per group, reused
every step) and then to receive the plan's tensors
(``/update_weights_from_distributed``, with ``flush_cache=false`` under an in-place
pause, because flushing with requests held in place fails SGLang's scheduler). After
a verified receive, ``/update_weight_version`` records the version. A plan is checked
against the served checkpoint's safetensors headers (``/model_info``'s
``model_path``, or ``checkpoint_dir``) before SGLang is touched.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.engine.adapter import Delivery, validate_tags
from weightsync.engine.checkpoint import checkpoint_specs
from weightsync.engine.http_engine import HttpEngineAdapter
from weightsync.errors import (
    DigestWithheld,
    EngineFault,
    EngineUnavailable,
    FailedPrecondition,
    StepTimeoutError,
    TransferError,
    Unsupported,
)
from weightsync.transport.flattened import FLATTENED, TENSORS, flattened_calls
from weightsync.transport.group import group_backend, group_layout, group_name
from weightsync.v1 import common_pb2

log = logging.getLogger("weightsync.sglang")

MODES = {common_pb2.PAUSE_MODE_KEEP: "in_place", common_pb2.PAUSE_MODE_ABORT: "abort"}
DESTROY_TIMEOUT_S = 5.0


class SglangAdapter(HttpEngineAdapter):
    """See the module docstring."""

    name = "sglang"
    engine_label = "SGLang"
    receives = (common_pb2.TRANSPORT_KIND_GROUP,)  # its update group (check_receive)

    @property
    def group_layouts(self) -> tuple[str, ...]:
        return (TENSORS, FLATTENED) if self.flattened else (TENSORS,)

    def __init__(self, url: str, *, timeout_s: float = 30.0, checkpoint_dir: str = "",
                 flattened: bool = False) -> None:
        """``flattened``: this SGLang takes ``load_format="flattened_bucket"`` in
        ``/update_weights_from_distributed`` (the group transport's flattened layout);
        an SGLang without it ignores the field and would expect a broadcast per tensor
        (over gloo the first mismatched broadcast aborts its process; over NCCL the
        result is undefined), so rounds with that layout are refused unless the
        operator says so."""
        super().__init__(url, timeout_s=timeout_s)
        self.checkpoint_dir = checkpoint_dir
        self.flattened = flattened
        self._released: set[str] = set()
        self._pause_mode = ""
        self._group = ""        # the update group SGLang has joined, reused while the rendezvous' stays
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self._workers: int | None = None

    # ----- control ------------------------------------------------------------------

    def engine_restarted(self):
        self._pause_mode = ""
        self._group = ""

    def pause(self, mode, *, timeout_s):
        if mode not in MODES:
            raise Unsupported("SGLang has no WAIT pause; use keep or abort", reason="PAUSE_MODE_UNSUPPORTED")
        self._call("POST", "/pause_generation", body={"mode": MODES[mode]}, timeout_s=timeout_s)
        self._pause_mode = MODES[mode]

    def resume(self):
        self._call("POST", "/continue_generation", body={})
        self._pause_mode = ""

    def sleep(self, tags):
        newly = [t for t in validate_tags(tags) if t not in self._released]
        if newly:
            self._call("POST", "/release_memory_occupation", body={"tags": newly})
            self._released.update(newly)
        return newly

    def wake(self, tags):
        # Only what the ledger says was released: anything else kills SGLang's scheduler.
        woken = [t for t in validate_tags(tags) if t in self._released]
        if woken:
            self._call("POST", "/resume_memory_occupation", body={"tags": woken})
            self._released.difference_update(woken)
        return woken

    @property
    def asleep(self):
        return sorted(self._released)

    # ----- weights ------------------------------------------------------------------

    def tensor_specs(self):
        if self._specs is None:
            model_dir = self.checkpoint_dir or str(self._call("GET", "/model_info").get("model_path") or "")
            if not model_dir or not os.path.isdir(model_dir):
                raise FailedPrecondition(
                    f"cannot read the served checkpoint to check plans against: {model_dir!r} is not a local "
                    "directory (start the agent with --checkpoint-dir)", reason="ENGINE_CANNOT_RECEIVE")
            specs = checkpoint_specs(model_dir)
            if not specs:
                raise FailedPrecondition(f"no safetensors files in {model_dir}", reason="ENGINE_CANNOT_RECEIVE")
            self._specs = {name: (dtype_from_name(dtype), tuple(shape)) for name, dtype, shape in specs}
        return self._specs

    def check_receive(self, request) -> None:
        """What SGLang cannot do, refused before anything changes."""
        if request.HasField("owners"):
            raise Unsupported("SGLang's update group takes one sender: a sharded trainer's round (several senders) "
                              "reaches reference and vLLM engines", reason="SHARDED_UNSUPPORTED")
        if request.rendezvous.transport != common_pb2.TRANSPORT_KIND_GROUP:
            raise Unsupported("SGLang receives weights only through its update group: broadcast with "
                              "transport='group'", reason="TRANSPORT_UNSUPPORTED")
        group_backend(request.rendezvous)
        if group_layout(request.rendezvous) not in self.group_layouts:
            raise Unsupported("this agent's SGLang is not known to take the flattened group layout: start the "
                              "agent with --sglang-flattened-bucket (SGLang releases that accept "
                              "load_format='flattened_bucket'), or broadcast with group_layout='tensors'",
                              reason="GROUP_LAYOUT_UNSUPPORTED")
        if request.weights_digest:
            raise Unsupported("SGLang cannot attest a digest of its weights: broadcast without "
                              "verify_digest", reason="DIGEST_UNSUPPORTED")
        workers, ranks = self.workers(), request.rendezvous.world_size - request.rank
        if workers > ranks:
            raise FailedPrecondition(f"SGLang joins its update group as {workers} ranks (tp x pp); the round "
                                     f"left it {ranks}", reason="ENGINE_WORKERS_CHANGED")

    def workers(self) -> int:
        """SGLang joins an update group as tp x pp ranks (rank_offset + its rank)."""
        if self._workers is None:
            info = self._call("GET", "/get_server_info")
            self._workers = int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)
        return self._workers

    def load_targets(self, plan):
        return []  # the bytes land inside SGLang, not in this process

    def receive(self, delivery: Delivery) -> None:
        """Joins SGLang to the trainer's group (once) and has it receive the plan (blocking)."""
        rendezvous, rank, plan, deadline_at = delivery.rendezvous, delivery.rank, delivery.plan, delivery.deadline_at
        name = group_name(rendezvous)
        try:
            if self._group != name:
                self._leave_group()
                self._post_timed("/init_weights_update_group", {
                    "master_address": rendezvous.store_host, "master_port": rendezvous.store_port,
                    "rank_offset": rank, "world_size": rendezvous.world_size, "group_name": name,
                    "backend": group_backend(rendezvous)}, deadline_at)
                self._group = name
            # A cache flush with requests held in place fails SGLang's scheduler.
            flush = self._pause_mode != "in_place"
            if group_layout(rendezvous) == FLATTENED:
                self._receive_flattened(plan, name, flush, deadline_at)
            else:
                self._post_timed("/update_weights_from_distributed", {
                    "names": list(plan.names), "dtypes": [dtype_name(d) for d in plan.dtypes],
                    "shapes": [list(s) for s in plan.shapes], "group_name": name, "flush_cache": flush},
                    deadline_at)
        except BaseException:
            # SGLang's side of a failed group may still wait for tensors: never reuse it.
            self._leave_group()
            raise

    def _receive_flattened(self, plan, name: str, flush: bool, deadline_at: float) -> None:
        """One ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``
        per flattened call, in order (each answers once its broadcast has landed), so
        SGLang holds one call's bytes at a time, never a second copy of the model. The
        cache is flushed after the last call only."""
        names, dtypes, shapes = plan.names, plan.dtypes, plan.shapes
        bounds = flattened_calls(plan).bounds
        for call, (first, end) in enumerate(bounds):
            self._post_timed("/update_weights_from_distributed", {
                "names": list(names[first:end]), "dtypes": [dtype_name(d) for d in dtypes[first:end]],
                "shapes": [list(s) for s in shapes[first:end]], "group_name": name,
                "load_format": "flattened_bucket", "flush_cache": flush and call == len(bounds) - 1},
                deadline_at)

    def _post_timed(self, path: str, body: dict, deadline_at: float) -> dict:
        """POST within what is left of the deadline; SGLang's refusal (HTTP 400 or
        ``success: false``, e.g. "partially updated") becomes a TransferError."""
        left = deadline_at - time.monotonic()
        if left <= 0:
            raise StepTimeoutError(f"deadline exceeded before {path}", operation="receive")
        try:
            result = self._call("POST", path, body=body, timeout_s=left)
        except EngineFault as exc:  # SGLang answers a failed update with HTTP 400 and a message
            raise TransferError(f"SGLang {path} failed: {exc}") from None
        if result.get("success") is False:
            raise TransferError(f"SGLang {path} failed: {result.get('message')}")
        return result

    def _leave_group(self) -> None:
        """Best effort: SGLang destroys the group (bounded; a wedged group is left to SGLang)."""
        name, self._group = self._group, ""
        if name:
            try:
                self._call("POST", "/destroy_weights_update_group", body={"group_name": name},
                           timeout_s=DESTROY_TIMEOUT_S)
            except (EngineFault, EngineUnavailable, StepTimeoutError) as exc:
                log.warning("could not destroy SGLang update group %s: %s", name, exc)

    def commit(self, version):
        self._call("POST", "/update_weight_version", body={"new_version": str(version),
                                                            "abort_all_requests": False})

    @property
    def weight_version(self):
        return self._version_from("/model_info")

    def weights_digest(self):
        # check_receive refuses verify_digest for the same reason
        raise DigestWithheld("SGLang exposes no digest of its weights")

    def close(self) -> None:
        self._leave_group()


__all__ = ["SglangAdapter"]
