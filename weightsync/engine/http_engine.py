"""HttpEngineAdapter: what the adapters of HTTP-controlled engines (vLLM, SGLang) share.

One blocking JSON-over-HTTP call with a deadline, failures mapped to typed errors
(unreachable -> EngineUnavailable, HTTP error -> EngineFault, slow -> StepTimeoutError),
a health check, and reading an integer weight version from a JSON endpoint. The
agent calls adapters from its worker threads only, so blocking here is fine.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

from weightsync.engine.adapter import EngineAdapter
from weightsync.errors import EngineFault, EngineUnavailable, StepTimeoutError


class HttpEngineAdapter(EngineAdapter):
    """Base of adapters that drive an engine's HTTP control API."""

    engine_label = "engine"
    health_path = "/health"

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._torn_to: int | None = None
        self._boot: bool | None = None  # the last version reading found the engine's boot record

    def _call(self, method: str, path: str, *, query: dict | list | None = None, body: dict | None = None,
              timeout_s: float | None = None) -> dict:
        """One JSON call; the typed error says whether the engine is gone, broken or slow."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        timeout = timeout_s or self.timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EngineFault(f"{self.engine_label} {method} {path} -> HTTP {exc.code}: {detail}") from None
        except TimeoutError:
            raise StepTimeoutError(f"{self.engine_label} {method} {path} took longer than {timeout:.1f}s",
                                   operation=path.strip("/")) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            # HTTPException: the connection broke mid-answer (IncompleteRead: an engine
            # killed while it wrote its reply), which is no OSError.
            raise EngineUnavailable(f"{self.engine_label} at {self.url} unreachable ({method} {path}): {exc}") \
                from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}

    # What an engine's version says while weights are moving into it
    # ("weightsync-receiving-NEW-from-OLD"): its weights are torn until the agent commits
    # NEW, whoever reads it (a restarted agent knows nothing of the receive its
    # predecessor began). Read back as OLD, with ``torn_to`` NEW.
    RECEIVING = "weightsync-receiving-"

    def receiving_marker(self, new: int, old: int) -> str:
        return f"{self.RECEIVING}{new}-from-{old}"

    def torn_to(self) -> int | None:
        """The version a receive was moving the engine to when the last version reading
        found it unfinished (see ``RECEIVING``); None when it was not."""
        return self._torn_to

    def _version_from(self, path: str) -> int | None:
        """The integer ``weight_version`` at ``path``: 0 when the engine never set one,
        or a non-number; None (unknown) when the engine cannot be asked (unreachable,
        HTTP error, slow) -- never a made-up 0, which would make versions go backwards.
        An unfinished receive's marker reads as the version it started from."""
        version, self._torn_to, self._boot = self._read_version(path)
        return version

    def version_is_boot(self) -> bool | None:
        return self._boot

    def _read_version(self, path: str) -> tuple[int | None, int | None, bool | None]:
        """``_version_from``'s reading, the unfinished receive's target, and whether the
        record is the engine's boot one (a name such as vLLM's and SGLang's "default":
        nothing weightsync writes; None where there is no record to judge), without
        keeping any of them (the transfer thread reads too, beside the watch's poller)."""
        try:
            value = self._call("GET", path).get("weight_version")
        except (EngineUnavailable, EngineFault, StepTimeoutError):
            return None, None, None
        if value is None:
            return 0, None, None
        torn_to = None
        if isinstance(value, str) and value.startswith(self.RECEIVING):
            new, _, old = value[len(self.RECEIVING):].partition("-from-")
            try:
                torn_to, value = int(new), int(old)
            except ValueError:
                return 0, None, True
        try:  # an engine that answers but never set a numeric version (vLLM boots with a name)
            return int(value), torn_to, False
        except (TypeError, ValueError):
            return 0, torn_to, True

    def fault(self) -> str | None:
        try:
            self._call("GET", self.health_path, timeout_s=5)
            return None
        except (EngineUnavailable, EngineFault, StepTimeoutError) as exc:
            return str(exc)

    def close(self) -> None:
        """The engine process is owned by the launcher (if any), not by the adapter."""


__all__ = ["HttpEngineAdapter"]
