"""Regenerates weightsync/v1/*_pb2*.py and .pyi from proto/weightsync/v1/*.proto.

The one script that produces the committed generated code (pinned grpcio-tools and
mypy-protobuf in pyproject's dev extra). tests/test_protos.py runs it into a temporary
folder and fails when the committed files differ.

Usage: python proto/generate.py [OUT_DIR]   (default: the repository root)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc over every .proto; returns the generated files."""
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "weightsync" / "v1").glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # protoc-gen-mypy is a console script installed beside this interpreter.
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "weightsync" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path.relative_to(target))
