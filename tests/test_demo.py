"""``weightsync demo`` runs end to end as a user runs it, and leaves no process behind."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import psutil


def weightsync_children_alive() -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "weightsync" in cmd and ("coordinator" in cmd or " agent " in cmd) and "weightsync-demo-" in cmd:
            out.append(cmd)
    return out


def test_demo_syncs_every_step_bitwise_and_cleans_up():
    proc = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--steps", "3"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+", line)]
    assert len(rows) == 3
    for step, row in enumerate(rows, start=1):
        assert row.count("equal") == 2 and "DIFFERENT" not in row
        assert f"engine-0: v{step} equal" in row and f"engine-1: v{step} equal" in row
    assert "OK: every engine served exactly the trainer's weights" in proc.stdout
    tokens = re.search(r"tokens generated per weight version: (\{.*\})", proc.stdout)
    assert tokens and len(ast.literal_eval(tokens.group(1))) >= 3  # generation went on across syncs
    assert weightsync_children_alive() == []


def test_demo_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--steps", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
