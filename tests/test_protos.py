"""The committed generated code is exactly what proto/generate.py produces."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

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
        agent_pb2: ["PauseEngineRequest", "ReceiveRequest", "ResumeEngineRequest", "SleepRequest", "WakeRequest",
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


def _contract():
    spec = importlib.util.spec_from_file_location("contract", ROOT / "proto" / "contract.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_contract_holds_and_is_recorded():
    """Every message, field, enum value and RPC of proto/contract.json is still on the
    wire as it was, and nothing was added without being recorded."""
    contract = _contract()
    recorded = json.loads((ROOT / "proto" / "contract.json").read_text())
    current = contract.describe()
    assert contract.breaking_changes(recorded, current) == []
    assert contract.naming_problems(current) == []
    assert recorded == current, "the contract grew: run 'make protos' and commit proto/contract.json"


def test_the_compatibility_check_sees_each_kind_of_break():
    """The check above can fail: each change a peer on the old contract would trip on
    is reported, and the compatible ones (a new field, a reserved removal) are not."""
    contract = _contract()
    old = contract.describe()
    receive = "weightsync.v1.ReceiveRequest"
    version = next(n for n, f in old["messages"][receive]["fields"].items() if f[0] == "version")

    def changed(edit) -> list[str]:
        new = copy.deepcopy(old)
        edit(new)
        return contract.breaking_changes(old, new)

    assert changed(lambda c: c["messages"][receive]["fields"].pop(version))[0].startswith(
        f"{receive}: field {version} (version) was removed")
    assert changed(lambda c: c["messages"][receive]["fields"][version].__setitem__(1, "TYPE_UINT32"))
    assert changed(lambda c: c["messages"][receive]["fields"][version].__setitem__(0, "target_version"))
    assert changed(lambda c: c["messages"][receive]["fields"][version].__setitem__(2, "repeated"))
    assert changed(lambda c: c["messages"].pop(receive)) == [f"message {receive} was removed"]
    assert changed(lambda c: c["enums"]["weightsync.v1.PauseMode"].pop("3"))
    assert changed(lambda c: c["services"]["weightsync.v1.EngineAgentService"].pop("Receive"))
    assert changed(lambda c: c["services"]["weightsync.v1.CoordinatorService"]["Broadcast"].__setitem__(3, False))
    assert changed(lambda c: c["services"].pop("weightsync.v1.CoordinatorService"))
    oneof_message = "weightsync.v1.BroadcastResponse"
    assert changed(lambda c: c["messages"][oneof_message]["oneofs"]["event"].pop())

    def reserve_and_drop(c):
        c["messages"][receive]["fields"].pop(version)
        c["messages"][receive]["reserved"].append(int(version))
    assert changed(reserve_and_drop) == []
    assert changed(lambda c: c["messages"][receive]["fields"].__setitem__("99", ["new", "TYPE_BOOL", "singular", ""])) == []


def test_the_naming_check_refuses_shared_and_misnamed_messages():
    contract = _contract()
    old_style = {"services": {
        "weightsync.v1.EngineAgent": {"Pause": ["weightsync.v1.AgentPauseRequest", "weightsync.v1.EngineOutcome",
                                                False, False],
                                      "Resume": ["weightsync.v1.ResumeRequest", "weightsync.v1.EngineOutcome",
                                                 False, False]}}}
    problems = contract.naming_problems(old_style)
    assert "service weightsync.v1.EngineAgent is not named ...Service" in problems
    assert "EngineAgent.Pause takes weightsync.v1.AgentPauseRequest, not PauseRequest" in problems
    assert "weightsync.v1.EngineOutcome serves both EngineAgent.Pause and EngineAgent.Resume" in problems


def test_buf_lint_standard_is_clean():
    """buf's own STANDARD lint over proto/ (buf.yaml). The buf CLI is an npm package
    (``@bufbuild/buf``); ``make setup`` installs it under .tools/ where npm exists."""
    buf = shutil.which("buf") or str(ROOT / ".tools" / "node_modules" / ".bin" / "buf")
    if not os.path.exists(buf):
        pytest.skip("the buf CLI is not installed (npm is needed for it); the naming and compatibility "
                    "checks above still ran")
    done = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
