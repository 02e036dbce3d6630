"""Test-only fault rules (``WEIGHTSYNC_FAULTS``) are checked when a server starts: a
rule that could never fire would leave a test injecting nothing and passing anyway."""

from __future__ import annotations

import json

import pytest

from weightsync.errors import InvalidArgument
from weightsync.faults import ENV, FaultInjector
from weightsync.server.agent.main import RPC_METHODS as AGENT_RPCS
from weightsync.server.coordinator.main import RPC_METHODS as COORDINATOR_RPCS


def test_an_rpc_rule_must_name_an_rpc_of_the_server(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps([{"op": "rpc", "action": "delay", "method": "Pause", "seconds": 1}]))
    with pytest.raises(InvalidArgument, match="names no RPC of this server.*PauseEngine"):
        FaultInjector.from_env(enabled=True, engine_id="engine-0", rpc_methods=AGENT_RPCS)
    injector = FaultInjector.from_env(enabled=True, rpc_methods=COORDINATOR_RPCS)
    assert injector.take("rpc", method="Pause") is not None


def test_rules_of_other_kinds_and_other_engines_are_kept_apart(monkeypatch):
    rules = [{"op": "rpc", "action": "cancel", "method": "ResumeEngine", "engine": "engine-1"},
             {"op": "receive", "action": "delay", "seconds": 0.1, "version": 1, "bucket": 0}]
    monkeypatch.setenv(ENV, json.dumps(rules))
    injector = FaultInjector.from_env(enabled=True, engine_id="engine-0", rpc_methods=AGENT_RPCS)
    assert injector.take("rpc", method="ResumeEngine") is None  # engine-1's rule
    assert injector.take("receive", version=1, bucket=0) is not None
    assert FaultInjector.from_env(enabled=False, engine_id="engine-0", rpc_methods=AGENT_RPCS) is None


def test_an_unknown_action_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps([{"op": "rpc", "action": "explode", "method": "Receive"}]))
    with pytest.raises(InvalidArgument, match="unsupported fault rule"):
        FaultInjector.from_env(enabled=True, rpc_methods=AGENT_RPCS)
