"""Static guard for invariant 5: no blocking call inside async code of the library."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_no_blocking_calls_in_async_code():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (dev extra)")
    proc = subprocess.run([ruff, "check", "--select", "ASYNC", "--no-cache", "weightsync", "server", "client",
                           "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_pickle_on_any_wire():
    offenders = [str(p) for folder in ("weightsync", "server", "client") for p in (ROOT / folder).rglob("*.py")
                 if any(line.strip().startswith(("import pickle", "from pickle", "import cloudpickle"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
