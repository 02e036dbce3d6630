"""SglangAdapter: drives an SGLang server through its HTTP API.

Control: ``/pause_generation`` (KEEP -> ``in_place``, ABORT -> ``abort``; SGLang has
no drain-then-pause mode, so WAIT is refused), ``/continue_generation``,
``/release_memory_occupation`` and ``/resume_memory_occupation``, ``/model_info`` for
the version, ``/health``. Every call has a deadline.

SGLang's ``/resume_memory_occupation`` must name exactly tags that were released (a
tag that was not released raises KeyError and kills the scheduler), and
``/continue_generation`` does not check memory state. So the agent keeps a ledger
(``asleep``) and only ever resumes what the ledger says is released.

Weights: SGLang receives through its own distributed group
(``/init_weights_update_group`` + ``/update_weights_from_distributed``, NCCL on GPU),
which weightsync's trainer side does not speak yet; a Broadcast to an SGLang engine is
refused up front with FAILED_PRECONDITION, so nothing changes anywhere.
"""

from __future__ import annotations

from weightsync.engine.http_engine import HttpEngineAdapter
from weightsync.engine.reference import validate_tags
from weightsync.errors import FailedPrecondition
from weightsync.v1 import common_pb2

MODES = {common_pb2.PAUSE_MODE_KEEP: "in_place", common_pb2.PAUSE_MODE_ABORT: "abort"}


class SglangAdapter(HttpEngineAdapter):
    """See the module docstring."""

    name = "sglang"
    engine_label = "SGLang"
    receives_in_engine = True

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        super().__init__(url, timeout_s=timeout_s)
        self._released: set[str] = set()

    def pause(self, mode, *, timeout_s):
        if mode not in MODES:
            raise FailedPrecondition("SGLang has no WAIT pause; use keep or abort", reason="PAUSE_MODE_UNSUPPORTED")
        self._call("POST", "/pause_generation", body={"mode": MODES[mode]}, timeout_s=timeout_s)

    def resume(self):
        self._call("POST", "/continue_generation", body={})

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

    def tensor_specs(self):
        raise FailedPrecondition("weight transfer into SGLang (its NCCL update group) is not supported by this "
                                 "release; the engine was not touched", reason="ENGINE_CANNOT_RECEIVE")

    def load_targets(self, plan):
        return []

    def receive_in_engine(self, rendezvous, rank, plan, *, deadline_at):
        self.tensor_specs()

    def commit(self, version):
        raise FailedPrecondition("SGLang weight versions follow its own updates")

    @property
    def weight_version(self):
        return self._version_from("/model_info")

    def weights_digest(self):
        return ""


__all__ = ["SglangAdapter"]
