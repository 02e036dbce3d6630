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

import json
import urllib.error
import urllib.request

from weightsync.engine.adapter import EngineAdapter
from weightsync.engine.reference import validate_tags
from weightsync.errors import EngineFault, EngineUnavailable, FailedPrecondition, StepTimeoutError
from weightsync.v1 import common_pb2

MODES = {common_pb2.PAUSE_MODE_KEEP: "in_place", common_pb2.PAUSE_MODE_ABORT: "abort"}


class SglangAdapter(EngineAdapter):
    """See the module docstring."""

    name = "sglang"
    receives_in_engine = True

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._released: set[str] = set()

    def _call(self, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        timeout = timeout_s or self.timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as exc:
            raise EngineFault(f"SGLang {path} -> HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") \
                from None
        except TimeoutError:
            raise StepTimeoutError(f"SGLang {path} took longer than {timeout:.1f}s",
                                   operation=path.strip("/")) from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineUnavailable(f"SGLang at {self.url} unreachable ({path}): {exc}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}

    def pause(self, mode, *, timeout_s):
        if mode not in MODES:
            raise FailedPrecondition("SGLang has no WAIT pause; use keep or abort", reason="PAUSE_MODE_UNSUPPORTED")
        self._call("POST", "/pause_generation", {"mode": MODES[mode]}, timeout_s=timeout_s)

    def resume(self):
        self._call("POST", "/continue_generation", {})

    def sleep(self, tags):
        newly = [t for t in validate_tags(tags) if t not in self._released]
        if newly:
            self._call("POST", "/release_memory_occupation", {"tags": newly})
            self._released.update(newly)
        return newly

    def wake(self, tags):
        # Only what the ledger says was released: anything else kills SGLang's scheduler.
        woken = [t for t in validate_tags(tags) if t in self._released]
        if woken:
            self._call("POST", "/resume_memory_occupation", {"tags": woken})
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
        try:
            return int(self._call("GET", "/model_info").get("weight_version") or 0)
        except (ValueError, EngineUnavailable, EngineFault, StepTimeoutError):
            return 0

    def fault(self):
        try:
            self._call("GET", "/health", timeout_s=5)
            return None
        except (EngineUnavailable, EngineFault, StepTimeoutError) as exc:
            return str(exc)

    def weights_digest(self):
        return ""

    def close(self):
        pass


__all__ = ["SglangAdapter"]
