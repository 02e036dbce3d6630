"""A process that exits right after retiring a failed gloo group exits cleanly
(``transport.collective``): a sharded trainer's rank whose driver died before any
broadcast retired its group with no op running, the retire thread was inside the
group's destructor as the process exited, and the process aborted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("retired_group_exit.py")


def test_exiting_right_after_retiring_a_group_with_no_op_running_does_not_abort():
    # Several times: the retire thread races the exit (without the fix, every run aborted here).
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(SCRIPT), "main"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
