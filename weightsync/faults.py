"""Deterministic fault injection for tests: off by default, hard to turn on by accident.

An agent honours ``WEIGHTSYNC_FAULTS`` (a JSON list of rules) only when it was also
started with the ``--enable-fault-injection`` flag; the variable alone is ignored
with a warning, and an enabled injector logs loudly at start. Rules are keyed by
(operation, version, bucket), like torchft's EventInjector, and every firing is
counted so tests can check what actually happened.

Rule fields: ``op``, ``action``, optional matchers, ``seconds`` for delays, and
``times`` (how often it may fire; default 1, 0 = always), ``engine`` (only the agent
of that engine id honours the rule; the others drop it).

- ``op: "receive"`` (agents' data plane), matched by ``version`` and ``bucket``:
  ``delay`` or ``fail`` after that bucket is loaded; ``stale_tensor`` keeps the
  tensor named ``tensor`` (default: the plan's first) at its old contents after the
  receive, and ``skip_post_load`` has vLLM's worker reload as vLLM does by itself
  (tied layers not re-processed, expert kernels not laid out anew): two broken
  loads that attestation must catch.
- ``op: "rpc"`` (any server, see ``server/common/fault_interceptor.py``), matched by
  ``method`` (e.g. "Broadcast"): ``drop_response`` (the handler runs, the caller
  gets UNAVAILABLE instead of the answer), ``duplicate`` (the request is delivered
  twice, concurrently), ``delay`` (the hop takes ``seconds`` longer), ``drop_stream``
  (a server stream breaks with UNAVAILABLE before its first message; what it started
  goes on), ``cancel`` (a unary call is answered CANCELLED without running, as a
  server that is stopping does to the calls in flight).
- ``op: "shutdown"``, matched by ``method`` (a shutdown step's name): ``fail``
  makes that cleanup step raise, to prove the other steps still run.
- ``op: "round"`` (the coordinator), matched by ``method`` (a step of a round, e.g.
  "transfer"): ``fail`` raises an unexpected exception there, as a bug would.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass

from weightsync.errors import InvalidArgument, StepTimeoutError, TransferError

log = logging.getLogger("weightsync.faults")
ENV = "WEIGHTSYNC_FAULTS"


@dataclass
class FaultRule:
    op: str
    action: str
    version: int | None = None
    bucket: int | None = None
    method: str | None = None
    seconds: float = 0.0
    tensor: str | None = None   # stale_tensor: which tensor keeps its old contents
    engine: str | None = None   # only this engine's agent applies the rule
    times: int = 1
    fired: int = 0

    def matches(self, op: str, version: int | None = None, bucket: int | None = None,
                method: str | None = None) -> bool:
        return (self.op == op and (self.version is None or self.version == version)
                and (self.bucket is None or self.bucket == bucket)
                and (self.method is None or self.method == method)
                and (self.times == 0 or self.fired < self.times))


class FaultInjector:
    """Applies matching rules at hook points (see ``on_bucket``)."""

    def __init__(self, rules: list[FaultRule]) -> None:
        self.rules = rules

    @classmethod
    def from_env(cls, *, enabled: bool, engine_id: str | None = None,
                 rpc_methods: Collection[str] = ()) -> FaultInjector | None:
        """The injector described by ``WEIGHTSYNC_FAULTS``, or None. ``engine_id``: the
        agent's engine (rules naming another engine are dropped; a process that is no
        agent drops every rule that names one). ``rpc_methods``: the RPCs this server
        serves; an ``rpc`` rule naming another is refused, so that a misspelt (or
        renamed) method cannot leave a test injecting nothing.

        Raises:
            InvalidArgument: the variable is set, enabled, and malformed.
        """
        text = os.environ.get(ENV, "")
        if not text:
            return None
        if not enabled:
            log.warning("%s is set but fault injection is not enabled; ignoring it", ENV)
            return None
        try:
            raw = json.loads(text)
            rules = [FaultRule(**r) for r in raw]
        except (json.JSONDecodeError, TypeError) as exc:
            raise InvalidArgument(f"{ENV} must be a JSON list of rules: {exc}") from None
        for rule in rules:
            allowed = {"receive": ("delay", "fail", "stale_tensor", "skip_post_load"), "rpc": ("drop_response", "drop_stream", "duplicate", "delay", "cancel"),
                       "shutdown": ("fail",), "round": ("fail",)}
            if rule.action not in allowed.get(rule.op, ()):
                raise InvalidArgument(f"unsupported fault rule {rule}")
            if rule.op == "rpc" and rpc_methods and rule.method is not None and rule.method not in rpc_methods:
                raise InvalidArgument(f"fault rule {rule} names no RPC of this server "
                                      f"(it serves {', '.join(sorted(rpc_methods))})")
        rules = [r for r in rules if r.engine is None or r.engine == engine_id]
        log.warning("FAULT INJECTION ENABLED: %s", rules)
        return cls(rules)

    def take(self, op: str, *, action: str | None = None, **match) -> FaultRule | None:
        """The first matching rule (of ``action``, if given), counted as fired; None if none."""
        for rule in self.rules:
            if (action is None or rule.action == action) and rule.matches(op, **match):
                rule.fired += 1
                return rule
        return None

    def on_bucket(self, op: str, version: int, bucket: int, *, deadline_at: float) -> None:
        """Hook called after bucket ``bucket`` of ``version`` was loaded."""
        for rule in self.rules:
            if rule.action not in ("delay", "fail") or not rule.matches(op, version=version, bucket=bucket):
                continue
            rule.fired += 1
            if rule.action == "delay":
                left = deadline_at - time.monotonic()
                time.sleep(max(0.0, min(rule.seconds, left)))
                if time.monotonic() >= deadline_at:
                    raise StepTimeoutError(f"deadline exceeded during {op} (injected delay)", operation=op)
            else:
                raise TransferError(f"injected failure in {op} of version {version} at bucket {bucket}")


__all__ = ["FaultInjector", "FaultRule", "ENV"]
