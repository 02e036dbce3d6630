"""The worker extension weightsync injects into vLLM (``--worker-extension-cls``).

Its methods run inside every vLLM worker and are called through ``/collective_rpc``
with string arguments (JSON), never pickle:

- ``weightsync_checkpoint_specs()``: name, dtype and shape of every checkpoint
  tensor, read from the safetensors headers of the served model. This is what a
  plan is checked against: on CPU, vLLM repacks Linear weights, so its own
  parameters do not show checkpoint shapes.
- ``weightsync_receive(rendezvous, rank, plan, timeout_s[, skip_post_load, data_host, owners, owners_key,
  parts_digest])``: every
  worker joins at its own rank (``rank`` plus the worker's rank in vLLM's parallel world), joins
  the weightsync transport (shm, gloo, group, nccl or cuda-ipc), and receives into checkpoint-shaped
  tensors (host memory; the worker's GPU for nccl and cuda-ipc, and when the group backend is nccl) that go to
  vLLM's in-place reload, tied layers and expert kernels included (``vllm_reload.py``), as each one
  completes (``streamed_load.py``: the worker's extra memory is a few buckets and the
  tensors being filled, not a second model). Returns the digest of what it loaded and
  the peak bytes of received tensors alive at once; network transports listen on ``data_host`` (the agent's
  address). With ``owners`` (a sharded trainer's round: who sends which rows, each sender's lane), the
  worker receives every sender's lane at once into row ranges of the same tensors, each loaded once
  its last part is in, its parts hashed only with ``parts_digest="1"`` (a round that
  asks to verify). ``skip_post_load="1"`` is fault injection only (the agent sends it
  only when started with ``--enable-fault-injection`` and a matching rule).
- ``weightsync_loaded_digest()``: the digest of the weights the worker's last receive
  loaded whole, "" when none did (or one began since): what an agent started beside a
  vLLM that outlived the agent before it vouches for.
- ``weightsync_probe_limits()``: vocabulary size and context length, to refuse a
  probe that cannot fit before anything changes.
- ``weightsync_score(sequences_json)``: the attestation probe through vLLM's own
  model while paused (``vllm_probe.py``). Returns ``{"logprobs": [[...], ...]}``.
"""

from __future__ import annotations

import json
import threading
import time

import torch
from google.protobuf import json_format

from weightsync import transport as transports
from weightsync.engine import vllm_probe
from weightsync.engine.checkpoint import checkpoint_specs
from weightsync.engine.streamed_load import receive_and_load, receive_and_load_from_senders
from weightsync.engine.vllm_reload import reload_in_place
from weightsync.errors import InvalidArgument
from weightsync.plan import BucketPlan
from weightsync.sharding import Owners
from weightsync.transport.from_senders import SenderLane
from weightsync.v1 import common_pb2


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker class by vLLM itself."""

    def weightsync_checkpoint_specs(self) -> list[list]:
        return checkpoint_specs(self.model_config.model)

    def weightsync_receive(self, rendezvous_json: str, rank: str, plan_json: str, timeout_s: str,
                           skip_post_load: str = "", data_host: str = "127.0.0.1", owners_json: str = "",
                           owners_key: str = "", parts_digest: str = "1") -> dict:
        # Forgotten until this receive has loaded every tensor: a cut one leaves no digest.
        self.__dict__["_weightsync_digest"] = ""
        try:
            rendezvous = json_format.Parse(rendezvous_json, common_pb2.Rendezvous())
            plan = BucketPlan.from_proto(json_format.Parse(plan_json, common_pb2.WeightPlan()))
            # nccl (the transport, or the group's backend) and cuda-ipc land the bytes in
            # the worker's GPU, bucket by bucket; gloo and shm in host memory.
            on_gpu = (rendezvous.group_backend == "nccl"
                      or rendezvous.transport in (common_pb2.TRANSPORT_KIND_NCCL, common_pb2.TRANSPORT_KIND_CUDA_IPC))
            device = self.device if on_gpu else torch.device("cpu")
            # The engine's ranks are rank .. rank + workers - 1: each worker takes its own
            # (vLLM's rank of this worker in its tensor x pipeline parallel world).
            # Each tensor goes to vLLM's loader as soon as its last byte is in, and is let
            # go after: never a second full copy of the model in the worker.
            my_rank = int(rank) + int(getattr(self, "rank", 0) or 0)
            deadline_at = time.monotonic() + float(timeout_s)
            load = lambda weights: reload_in_place(self.model_runner, weights,  # noqa: E731
                                                   repair=skip_post_load != "1")
            if owners_json:  # a sharded trainer: every sender's lane at once
                owners_msg = json_format.Parse(owners_json, common_pb2.Owners())
                if owners_key and not any(s.tensors for s in owners_msg.senders):  # named by key
                    owners = Owners.known(owners_key)
                    if owners is None or owners.plan.plan_id != plan.plan_id:
                        return {"error": f"OwnersUnknown: this worker keeps no owners {owners_key}"}
                    if [s.sender for s in owners_msg.senders] != owners.sender_ranks:
                        raise InvalidArgument("the round's lanes are not its owners' senders")
                else:
                    owners = Owners.from_proto(owners_msg, plan)
                lanes = [SenderLane(parts.lane, owners.part_plan(parts.sender),
                                    self._weightsync_receiver(parts.lane.transport, i, data_host), parts.sender)
                         for i, parts in enumerate(owners_msg.senders)]
                # The parts' digest only where the round asks to verify: hashing 40k parts
                # on the loader's thread, the round's slowest part, 6 % of its time.
                digest, peak, parts_digest = receive_and_load_from_senders(
                    lanes, my_rank, plan, owners, device=device, deadline_at=deadline_at, abort=threading.Event(),
                    load=load, max_ready_bytes=2 * plan.bucket_bytes, parts_digest=parts_digest == "1")
            else:
                parts_digest = ""
                digest, peak = receive_and_load(
                    self._weightsync_receiver(rendezvous.transport, 0, data_host), rendezvous, my_rank, plan,
                    device=device, deadline_at=deadline_at, abort=threading.Event(), load=load,
                    max_ready_bytes=2 * plan.bucket_bytes)
            self.__dict__["_weightsync_digest"] = digest
            return {"digest": digest, "bytes": plan.total_bytes, "peak_target_bytes": peak,
                    "parts_digest": parts_digest}
        except Exception as exc:  # reported to the agent as data; the agent marks the engine torn
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _weightsync_receiver(self, kind: int, lane: int, data_host: str):
        """This worker's receiver of ``kind`` for its ``lane``-th concurrent lane (each its
        own group and buffers, kept while the lane's group id stays)."""
        receivers = self.__dict__.setdefault("_weightsync_receivers", {})
        receiver = receivers.get((kind, lane))
        if receiver is None:
            receiver = receivers[(kind, lane)] = transports.make_receiver(kind, data_host=data_host)
        return receiver

    def weightsync_loaded_digest(self) -> dict:
        return {"digest": self.__dict__.get("_weightsync_digest", "")}

    def weightsync_probe_limits(self) -> dict:
        config = self.model_config
        try:
            vllm_probe.check_supported(self.vllm_config, 2)
            unsupported = ""
        except vllm_probe.ProbeUnsupported as exc:
            unsupported = str(exc)
        return {"vocab_size": config.get_vocab_size(), "max_model_len": config.max_model_len,
                "unsupported": unsupported}

    def weightsync_score(self, sequences_json: str) -> dict:
        try:
            sequences = [[int(t) for t in seq] for seq in json.loads(sequences_json)]
            return {"logprobs": vllm_probe.score(self.model_runner, self.vllm_config, sequences)}
        except Exception as exc:  # reported to the agent as data; the agent marks the engine torn
            return {"error": f"{type(exc).__name__}: {exc}"}


__all__ = ["WeightsyncWorkerExtension", "checkpoint_specs"]
