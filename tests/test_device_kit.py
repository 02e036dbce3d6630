"""tests/gpu/device_kit.sh, the part that runs here: the wheels the GPU machine lacks
are pinned as pyproject.toml pins them, and they download for Python 3.12."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "tests" / "gpu" / "device_kit.sh"


def kit_pins() -> dict[str, str]:
    body = re.search(r"WHEELS=\((.*?)\)", KIT.read_text(), re.S).group(1)
    pins = dict(item.split("==") for item in body.split())
    assert pins, "device_kit.sh lists no wheels"
    return {name.lower(): version for name, version in pins.items()}


def test_the_kit_carries_what_pyproject_asks_for_at_versions_it_allows():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    pins = kit_pins()
    checked = 0
    for req in requirements:
        version = pins.get(req.name.lower())
        if version is not None:
            assert req.specifier.contains(version), f"the kit carries {req.name}=={version}; pyproject asks {req}"
            checked += 1
    # gRPC and protobuf at least: the generated code and the image's own builds must not mix.
    assert {"grpcio", "grpcio-health-checking", "grpcio-status", "protobuf", "pytest-asyncio"} <= set(pins)
    assert checked >= 8
    # torch, cupy and NCCL come from the machine: builds that match its driver.
    assert not {"torch", "cupy-cuda12x", "cupy-cuda13x", "nvidia-nccl-cu13"} & set(pins)


def test_the_kit_downloads_every_wheel_for_python_3_12(tmp_path):
    env = dict(os.environ, WEIGHTSYNC_KIT_DIR=str(tmp_path / "kit"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(KIT), "download"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(p.name for p in (tmp_path / "kit").iterdir())
    assert len(wheels) == len(kit_pins())
    binary = [w for w in wheels if not w.endswith("-none-any.whl")]
    assert binary and all(("cp312" in w or "abi3" in w) and "x86_64" in w for w in binary), binary
