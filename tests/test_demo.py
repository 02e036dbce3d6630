"""``weightsync demo`` runs end to end as a user runs it, and leaves no process behind."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import psutil


def weightsync_children_alive(tmp: str) -> list[str]:
    """The demo's servers still running: those whose files lie under ``tmp`` (this run's
    temporary folder; another demo on the same machine is not this test's)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "weightsync" in cmd and ("coordinator" in cmd or " agent " in cmd) and f"{tmp}/weightsync-demo-" in cmd:
            out.append(cmd)
    return out


def test_demo_syncs_every_step_bitwise_and_cleans_up(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--steps", "3"], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+", line)]
    assert len(rows) == 3
    for step, row in enumerate(rows, start=1):
        assert row.count("equal") == 2 and "DIFFERENT" not in row
        assert f"engine-0: v{step} equal" in row and f"engine-1: v{step} equal" in row
    assert "OK: every engine served exactly the trainer's weights" in proc.stdout
    tokens = re.search(r"tokens generated per weight version: (\{.*\})", proc.stdout)
    assert tokens and len(ast.literal_eval(tokens.group(1))) >= 3  # generation went on across syncs
    assert weightsync_children_alive(str(tmp_path)) == []


def test_demo_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--steps", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
