"""The README's quickstart, as code: its fenced blocks, and its commands started for real.

The suite runs the README's own blocks (``tests/test_readme.py``; the vLLM one in
``tests/vllm/test_readme_vllm.py``), so the page a newcomer pastes from cannot drift
from the code. Only addresses, ports and paths are substituted.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class Block:
    """One fenced block: its language and its text."""

    language: str
    text: str


def quickstart_blocks() -> list[Block]:
    """The fenced blocks of the README's "Quickstart" section, in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return [Block(lang, text) for lang, text in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)]


def free_port() -> int:
    """A port free on loopback now (the process that binds it comes a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(block: Block) -> list[list[str]]:
    """The shell block's commands, one per line (continuations joined, ``&`` dropped);
    ``weightsync`` becomes this interpreter's ``-m weightsync``."""
    joined = block.text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip().removesuffix("&").strip()
        if line:
            out.append(shlex.split(line))
    return out


def as_process(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``VAR=value ... weightsync ARGS`` -> (the environment additions, the command)."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    if argv[:1] == ["weightsync"]:
        argv = [sys.executable, "-m", "weightsync", *argv[1:]]
    # "python" (also in a command the agent launches) is the interpreter of this venv.
    return env, [sys.executable if a == "python" else a for a in argv]


def substitute(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


def stop(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM every process (last started first), then SIGKILL what is left."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
