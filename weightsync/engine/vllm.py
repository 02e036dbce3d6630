"""VllmAdapter: drives a real ``vllm serve`` through its HTTP API (VLLM_SERVER_DEV_MODE=1).

Control: ``/pause?mode=keep|abort|wait``, ``/resume``, ``/sleep?level=1``,
``/wake_up?tags=``, ``/weight_info``, ``/update_weight_version``, ``/health``; every
call has a deadline. vLLM's ``/resume`` does not look at sleep state, so the agent
keeps its own ledger of what is asleep (``asleep``) and wakes before resuming.

Weights: vLLM runs weightsync's worker extension
(``--worker-extension-cls weightsync.engine.vllm_worker.WeightsyncWorkerExtension``).
``receive`` calls it through ``/collective_rpc``: inside vLLM's worker it
joins the weightsync transport (``shm`` or ``gloo``), receives the buckets and feeds
them to vLLM's in-place reload, tied layers re-processed. Arguments and results are
JSON; no pickle.

Attestation: ``score`` runs the probe inside the worker with vLLM's own model while
the scheduler stays paused (``vllm_probe.py``).

vLLM pairs its workers' replies with its calls by order alone: a ``collective_rpc``
that times out inside vLLM while its worker goes on (a worker frozen, swapped out or
stuck past the deadline) leaves that reply queued, and every later call, vLLM's own
steps included, would read the reply of the call before it. So the worker's own
deadline ends before the call's (``worker_deadline_s``), and once a call timed out
anyway the adapter makes no further call and reports the engine faulted until it is
restarted (``restart_needed``: the launcher relaunches it under
``--restart on-failure``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch
from google.protobuf import json_format

from weightsync.attest import Probe, check_vocab
from weightsync.dtypes import dtype_from_name
from weightsync.engine.adapter import ATTESTATION_UNSUPPORTED, Delivery, validate_tags
from weightsync.engine.http_engine import HttpEngineAdapter
from weightsync.errors import (
    DigestWithheld,
    EngineFault,
    EngineUnavailable,
    InvalidArgument,
    StepTimeoutError,
    TransferError,
    Unsupported,
)
from weightsync.v1 import common_pb2

MODES = {common_pb2.PAUSE_MODE_KEEP: "keep", common_pb2.PAUSE_MODE_ABORT: "abort",
         common_pb2.PAUSE_MODE_WAIT: "wait"}
EXTENSION = "weightsync.engine.vllm_worker.WeightsyncWorkerExtension"
# vLLM boots paused with this as its ``--scheduler-cls`` (``vllm_boot_paused.py``).
BOOT_PAUSED_SCHEDULER = "weightsync.engine.vllm_boot_paused.scheduler"
# The worker's receive ends this long before vLLM stops waiting for its reply (5 s
# plus 5% of the time left, at most half of it): time to give up its transport and
# answer, and for a load already under way to finish.
WORKER_MARGIN_S, WORKER_MARGIN_SHARE = 5.0, 0.05


def boot_paused_hint(command: Sequence[str]) -> str:
    """What to tell the user of a vLLM command that does not boot paused ("" when it
    does): once relaunched, that vLLM serves its boot weights to requests sent straight
    to it until the agent has paused it."""
    args = list(command)
    chosen = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--scheduler-cls"]
    chosen += [a.split("=", 1)[1] for a in args if a.startswith("--scheduler-cls=")]
    if BOOT_PAUSED_SCHEDULER in chosen:
        return ""
    return ("the launched vLLM does not boot paused: after a relaunch it serves its boot weights to requests "
            "sent straight to it until the agent pauses it; add --scheduler-cls " + BOOT_PAUSED_SCHEDULER)


def worker_deadline_s(left_s: float) -> float:
    """How long the worker may take when vLLM waits ``left_s`` for its reply."""
    return left_s - min(WORKER_MARGIN_S + WORKER_MARGIN_SHARE * left_s, left_s / 2)


def _owners_json(delivery: Delivery, whole: bool = True) -> str:
    """A sharded trainer's round for the worker: each sender's lane, with its parts
    (``whole``) or without (the worker has them under the owners' key); JSON, as every
    worker argument; "" for a round from one sender."""
    if delivery.owners is None:
        return ""
    senders = []
    for lane in delivery.senders:
        parts = (delivery.owners.parts_of(lane.sender).to_proto() if whole
                 else common_pb2.SenderParts(sender=lane.sender))
        parts.lane.CopyFrom(lane.rendezvous)
        senders.append(parts)
    return json_format.MessageToJson(common_pb2.Owners(senders=senders), indent=None)


class VllmAdapter(HttpEngineAdapter):
    """See the module docstring."""

    name = "vllm"
    engine_label = "vLLM"

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        super().__init__(url, timeout_s=timeout_s)
        self._asleep: set[str] = set()
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self._probe_limits: dict | None = None
        self._worker_plans: set[str] = set()  # plan ids the workers took whole
        self._worker_owners: set[str] = set()  # owners' keys the workers took whole (sharded trainers)
        self._sent_by_key: list[str] = []  # the last receive: what went by id or key ("plan", "owners")
        self._workers: int | None = None
        self._peak_target_bytes = 0
        self.last_received_digest = ""
        self._last_parts_digest = ""  # a sharded round's: the same slices of what the workers loaded
        self._out_of_step = ""  # why vLLM's replies may no longer match its calls; "" while they do

    # ----- HTTP ---------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: str, timeout_s: float) -> list:
        """Calls ``method`` of the worker extension on every worker; one result per worker.
        Refused once a call timed out (see the module docstring): its answer would be
        another call's."""
        if self._out_of_step:
            raise EngineFault(self._out_of_step)
        try:
            out = self._call("POST", "/collective_rpc", body={"method": method, "args": list(args),
                                                              "timeout": timeout_s}, timeout_s=timeout_s + 10)
        except (EngineFault, StepTimeoutError) as exc:
            # vLLM's own timeout (HTTP 500 naming it), or ours, 10 s after vLLM's: the
            # worker may still answer, into the reply queue of a later call.
            if isinstance(exc, StepTimeoutError) or f"RPC call to {method} timed out" in str(exc):
                self._out_of_step = (f"vLLM's call {method} to its workers timed out; vLLM pairs replies with "
                                     f"calls by order, so its later calls would read earlier replies: the engine "
                                     f"must be restarted ({exc})")
                raise EngineFault(self._out_of_step) from None
            raise
        return out.get("results", [])

    def restart_needed(self) -> str:
        return self._out_of_step

    def resume_awake(self):
        # vLLM's /wake_up without tags wakes whatever sleeps (nothing, without a word,
        # if nothing does) and resumes the scheduler only once all of it is resident.
        answer = self._call("POST", "/wake_up")
        if answer.get("status") != "awake":
            raise EngineFault(f"vLLM did not wake fully: {answer!r}")
        self._asleep.clear()

    def paused_now(self) -> bool | None:
        try:
            paused = self._call("GET", "/is_paused", timeout_s=5).get("is_paused")
        except (EngineUnavailable, EngineFault, StepTimeoutError):
            return None
        return paused if isinstance(paused, bool) else None

    def fault(self) -> str | None:
        return self._out_of_step or super().fault()

    # ----- control ------------------------------------------------------------------

    def pause(self, mode, *, timeout_s):
        self._call("POST", "/pause", query={"mode": MODES[mode]}, timeout_s=timeout_s)

    def resume(self):
        self._call("POST", "/resume")

    def sleep(self, tags):
        tags = validate_tags(tags)
        newly = [t for t in tags if t not in self._asleep]
        if newly:
            # vLLM sleeps weights and KV together (level 1); the ledger records both.
            newly = [t for t in ("weights", "kv_cache") if t not in self._asleep]
            try:
                self._call("POST", "/sleep", query={"level": 1, "mode": "keep"})
            except (StepTimeoutError, EngineUnavailable):
                # It may have landed, or land later (a stalled server takes it when it
                # goes on): counted asleep, so every resume wakes first. vLLM's wake of
                # memory that is awake does nothing, and a resume onto memory asleep is
                # the engine fault invariant kv-awake forbids.
                self._asleep.update(newly)
                raise
            self._asleep.update(newly)
        return newly

    def wake(self, tags):
        tags = validate_tags(tags)
        woken = [t for t in tags if t in self._asleep]
        if woken:
            self._call("POST", "/wake_up", query=[("tags", t) for t in woken])
            self._asleep.difference_update(woken)
        return woken

    def engine_restarted(self):
        self._asleep.clear()
        self._worker_plans.clear()
        self._worker_owners.clear()
        self.last_received_digest = ""
        self._out_of_step = ""

    def wake_paused(self, tags):
        # A full /wake_up resumes vLLM's scheduler by itself: nothing is woken, and
        # Resume wakes the tags first if the engine is ever allowed to run.
        validate_tags(tags)
        return []

    @property
    def asleep(self) -> list[str]:
        return sorted(self._asleep)

    # ----- weights ------------------------------------------------------------------

    def tensor_specs(self):
        if self._specs is None:
            results = self.collective_rpc("weightsync_checkpoint_specs", timeout_s=self.timeout_s)
            if not results or not isinstance(results[0], list):
                raise EngineFault(f"worker extension {EXTENSION} is not loaded in vLLM (results: {results!r})")
            self._specs = {name: (dtype_from_name(dtype), tuple(shape)) for name, dtype, shape in results[0]}
            self._workers = len(results)  # one result per worker process
        return self._specs

    def workers(self) -> int:
        """vLLM's worker processes (tensor x pipeline parallel): each receives the plan
        at its own rank and loads what its shards need."""
        if self._workers is None:
            self.tensor_specs()
        return self._workers or 1

    def load_targets(self, plan):
        return []  # bytes land inside vLLM's worker, not in this process

    def receive(self, delivery: Delivery) -> None:
        """Runs the receive inside vLLM's worker (blocking; the agent's transfer thread).
        ``skip_post_load`` is fault injection: vLLM's reload as it is (tied layers keep
        their old kernels, expert kernels are not laid out anew)."""
        rendezvous, rank, plan = delivery.rendezvous, delivery.rank, delivery.plan
        deadline_at, skip_post_load = delivery.deadline_at, delivery.skip_post_load
        # vLLM itself says its weights are moving until commit() names the new version:
        # an agent started after this one died mid-receive reads that record and keeps
        # the engine torn and paused until a round lands whole (``torn_to``).
        before = self._read_version("/weight_info")[0] or 0
        self.last_received_digest = self._last_parts_digest = ""  # until this receive has loaded every tensor
        self._call("POST", "/update_weight_version",
                   body={"new_version": self.receiving_marker(delivery.version, before)})
        # The worker remembers plans it took whole: later rounds name the plan by id (a
        # 20k-tensor plan is megabytes of JSON). A worker that forgot it (vLLM restarted)
        # answers PlanUnknown before receiving anything, and gets the whole plan. A
        # sharded trainer's owners alike, by their key (20k tensors from four ranks in
        # blocks: 3.3 MB of parts), while each round's lanes always go in full.
        whole = plan.plan_id not in self._worker_plans
        owners_key = delivery.owners.key if delivery.owners is not None else ""
        owners_whole = not owners_key or owners_key not in self._worker_owners
        while True:
            left = deadline_at - time.monotonic()
            if left <= 0:
                raise StepTimeoutError("deadline exceeded before the receive started", operation="receive")
            wire = plan.to_proto() if whole else plan.reference_proto()
            owners = _owners_json(delivery, owners_whole)
            results = self.collective_rpc(
                "weightsync_receive", json_format.MessageToJson(rendezvous), str(rank),
                json_format.MessageToJson(wire), str(worker_deadline_s(left)), "1" if skip_post_load else "",
                delivery.data_host, *([owners, owners_key, "1" if delivery.verify_parts else ""] if owners else []),
                timeout_s=left)
            errors = [str(r.get("error", "")) for r in results if isinstance(r, dict)]
            if not whole and any(e.startswith("PlanUnknown") for e in errors):
                self._worker_plans.discard(plan.plan_id)
                whole = True
                continue
            if not owners_whole and any(e.startswith("OwnersUnknown") for e in errors):
                self._worker_owners.discard(owners_key)
                owners_whole = True
                continue
            break
        self._sent_by_key = [*(["plan"] if not whole else []), *(["owners"] if owners and not owners_whole else [])]
        # Every worker must have loaded the same bytes: one torn worker is a torn engine.
        bad = [r for r in results if not isinstance(r, dict) or "error" in r or "digest" not in r]
        if not results or bad:
            raise TransferError(f"receive inside vLLM failed on {len(bad) or 'every'} of {len(results)} "
                                f"worker(s): {(bad or results)[:2]!r}")
        digests = {r["digest"] for r in results}
        parts = {r.get("parts_digest", "") for r in results}
        if len(digests) != 1 or len(parts) != 1:
            raise TransferError(f"vLLM's workers loaded different bytes: digests {sorted(digests)} {sorted(parts)}")
        self._last_parts_digest = parts.pop()
        self._worker_plans.add(plan.plan_id)
        if owners_key:
            self._worker_owners.add(owners_key)
        self.last_received_digest = digests.pop()
        self._peak_target_bytes = max(int(r.get("peak_target_bytes", 0)) for r in results)

    def receive_stats(self) -> dict[str, str]:
        """The most bytes of received tensors one worker held at once (streamed loading),
        and what the last receive named by id or key instead of sending it whole."""
        stats = {"engine_peak_bytes": str(self._peak_target_bytes)} if self._peak_target_bytes else {}
        if self._sent_by_key:
            stats["sent_by_key"] = ",".join(self._sent_by_key)
        return stats

    def check_probe(self, probe: Probe) -> None:
        if self._probe_limits is None:
            results = self.collective_rpc("weightsync_probe_limits", timeout_s=self.timeout_s)
            if not results or not isinstance(results[0], dict):
                raise EngineFault(f"worker extension {EXTENSION} is not loaded in vLLM (results: {results!r})")
            self._probe_limits = results[0]
        limits = self._probe_limits
        if limits.get("unsupported"):
            raise Unsupported(f"vLLM cannot run the attestation probe on this model: "
                              f"{limits['unsupported']}", reason=ATTESTATION_UNSUPPORTED)
        check_vocab(probe, int(limits["vocab_size"]))
        longest = max(len(s) for s in probe.sequences)
        if longest > int(limits["max_model_len"]):
            raise InvalidArgument(f"probe sequence of {longest} tokens is longer than vLLM's max_model_len "
                                  f"{limits['max_model_len']}")

    def score(self, sequences):
        results = self.collective_rpc("weightsync_score", json.dumps([list(s) for s in sequences]),
                                      timeout_s=self.timeout_s)
        # One result per worker; with tensor parallelism every rank computes the same logits.
        result = results[0] if results else None
        if not isinstance(result, dict) or "logprobs" not in result:
            raise EngineFault(f"attestation probe inside vLLM failed: {result!r}")
        return result["logprobs"]

    def commit(self, version):
        self._call("POST", "/update_weight_version", body={"new_version": str(version)})

    @property
    def weight_version(self):
        return self._version_from("/weight_info")

    def weights_digest(self):
        # vLLM repacks weights on CPU (oneDNN), so its parameters cannot be hashed back
        # into checkpoint form; the extension's digest of what it received and loaded is
        # the attestation -- only while vLLM still holds the version record weightsync
        # wrote: a vLLM restarted behind the agent's back holds its boot weights,
        # whatever this adapter received into the process before.
        version, torn_to, boot = self._read_version("/weight_info")
        if version is None:
            return ""
        if boot:
            raise DigestWithheld("vLLM serves its boot weights (weightsync has not synced it since it started): "
                                 "nothing to vouch for")
        if torn_to is not None:
            raise DigestWithheld(f"vLLM's weights are moving to version {torn_to}: a receive is under way, or "
                                 "one was cut short (torn)")
        if not self.last_received_digest:
            # The agent started after the receive (it restarted, vLLM did not): the
            # workers remember what they last loaded whole.
            self.last_received_digest = self._workers_digest()
        return self.last_received_digest

    def received_digest(self, owners=None):
        # Before commit vLLM's record still says the receive is under way.
        return self.last_received_digest if owners is None else self._last_parts_digest

    def _workers_digest(self) -> str:
        """The digest every worker says its last whole receive loaded ("" while vLLM
        cannot be asked). Called only while no receive runs (vLLM's version record is
        a plain version): a call then would wait behind the receive in the workers."""
        try:
            results = self.collective_rpc("weightsync_loaded_digest", timeout_s=30)
        except (EngineUnavailable, StepTimeoutError):
            return ""
        except EngineFault as exc:  # e.g. an extension from a weightsync release without the call
            raise DigestWithheld(f"vLLM's workers cannot say what they loaded: {exc}") from None
        digests = {r.get("digest", "") if isinstance(r, dict) else "" for r in results}
        if len(digests) != 1 or "" in digests:
            raise DigestWithheld(f"vLLM's workers do not all vouch for one set of weights: {sorted(digests)!r}")
        return digests.pop()

    def submit(self, prompt: Sequence[int], max_tokens: int) -> str:
        raise Unsupported("send generation requests to vLLM's OpenAI API directly", reason="GENERATION_UNSUPPORTED")

    def get(self, request_id: str, wait_s: float):
        raise Unsupported("send generation requests to vLLM's OpenAI API directly", reason="GENERATION_UNSUPPORTED")


__all__ = ["VllmAdapter", "EXTENSION"]
