"""The committed generated code is exactly what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.generate(tmp_path)
    assert fresh, "generation produced nothing"
    committed = sorted((ROOT / "weightsync" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p in fresh if p.read_bytes() != (ROOT / "weightsync" / "v1" / p.name).read_bytes()]
    assert not stale, f"run 'make protos' and commit: {stale} differ from a fresh generation"


def test_every_mutating_request_has_an_idempotency_key():
    from weightsync.v1 import agent_pb2, coordinator_pb2

    mutating = {
        coordinator_pb2: ["PauseRequest", "BroadcastRequest", "ResumeRequest", "RegisterEngineRequest",
                          "DeregisterEngineRequest"],
        agent_pb2: ["AgentPauseRequest", "ReceiveRequest", "AgentResumeRequest", "SleepRequest", "WakeRequest",
                    "GenerateRequest"],
    }
    for module, names in mutating.items():
        for name in names:
            assert "idempotency_key" in module.DESCRIPTOR.message_types_by_name[name].fields_by_name, name


def test_no_top_level_server_or_client_module_is_installed():
    assert importlib.util.find_spec("weightsync.server") is not None
    assert importlib.util.find_spec("weightsync.client") is not None
    for name in ("server", "client"):
        spec = importlib.util.find_spec(name)
        assert spec is None or "weightsync" not in str(spec.origin), f"top-level {name!r} module installed"
