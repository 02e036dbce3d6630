"""The README's quickstart runs as written: its shell block starts a real coordinator and
two real agents, its status command answers, and its trainer block syncs three steps and
checks every engine against the trainer's own model (its ``check_engines`` assertion).
Only the port, and the state file's folder, are substituted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import wait_available
from tests.readme_blocks import (
    README_ADDRESS,
    Block,
    as_process,
    commands,
    free_port,
    quickstart_blocks,
    stop,
    substitute,
)

pytestmark = pytest.mark.timeout(240)


def test_the_readme_quickstart_runs_against_a_real_cluster(tmp_path):
    blocks = quickstart_blocks()
    shell = next(b for b in blocks if b.language == "bash")
    trainer = next(b for b in blocks if b.language == "python")
    address = f"127.0.0.1:{free_port()}"
    swap = {README_ADDRESS: address}
    lines = [as_process(argv) for argv in commands(Block(shell.language, substitute(shell.text, swap)))]
    servers = [(env, argv) for env, argv in lines if argv[3] in ("coordinator", "agent")]
    status = [argv for _, argv in lines if argv[3] == "status"]
    assert len(servers) == 3 and len(status) == 1, "the quickstart starts a coordinator, two agents, asks status"
    procs = []
    try:
        for env, argv in servers:
            procs.append(subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, **env},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_available(address, ["engine-0", "engine-1"], timeout_s=60)
        shown = subprocess.run(status[0], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "engine-0" in shown.stdout and "engine-1" in shown.stdout, shown.stderr
        run = subprocess.run([sys.executable, "-c", substitute(trainer.text, swap)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        printed = run.stdout.splitlines()
        assert [line.split(":")[0] for line in printed] == ["step 1", "step 2", "step 3"], run.stdout
        assert all("on 2 engines" in line and "skipped []" in line for line in printed), run.stdout
    finally:
        stop(procs)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]

