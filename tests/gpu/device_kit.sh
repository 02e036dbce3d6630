#!/usr/bin/env bash
# The GPU checks on a machine with no package registry (the project's GPU test
# machine: one GPU, Python 3.12, torch with CUDA, cupy and NCCL preinstalled).
#
#   bash tests/gpu/device_kit.sh download   # here, with the registry: the wheels that
#                                           # machine lacks, for Python 3.12, into .whl-gpu/
#   bash tests/gpu/device_kit.sh run [OUT]  # there, offline: installs them and this
#                                           # checkout (editable) into that machine's
#                                           # python3, runs `pytest -m gpu tests/gpu` and
#                                           # the cuda-ipc benchmark; logs and JSON into OUT
#
# `run` changes the python3 environment it finds: it is meant for a machine that is
# thrown away after the check. The install is editable because the tests import this
# checkout's `weightsync` (the repository root is first on sys.path) and only the
# editable install maps `weightsync.server` and `weightsync.client` onto server/ and
# client/ (a copy in another folder leaves them missing).
#
# torch, cupy and NCCL are never carried: the machine's own builds match its driver.
# The versions below are the ones the suite runs with here (tests/test_device_kit.py
# checks they agree with pyproject.toml's pins).
set -euo pipefail
cd "$(dirname "$0")/../.."

KIT=${WEIGHTSYNC_KIT_DIR:-.whl-gpu}
WHEELS=(
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1
  protobuf==7.36.2 googleapis-common-protos==1.76.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
  xxhash==4.1.0
)

download() {
  local python=${PYTHON:-python3}
  rm -rf "$KIT" && mkdir -p "$KIT"
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d "$KIT" "${WHEELS[@]}"
  local got
  got=$(ls "$KIT"/*.whl | wc -l)
  if [ "$got" -ne "${#WHEELS[@]}" ]; then
    echo "device_kit: ${#WHEELS[@]} wheels asked for, $got downloaded" >&2
    exit 1
  fi
  du -sh "$KIT"
}

run() {
  local out=${1:-${OUT:-/tmp/weightsync-gpu}}
  mkdir -p "$out"
  [ -d "$KIT" ] || { echo "device_kit: no $KIT here: run 'device_kit.sh download' first and carry it" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$KIT"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
  export PYTHONUNBUFFERED=1
  python3 - <<'EOF' 2>&1 | tee "$out/versions.txt"
import sys, torch, grpc, google.protobuf
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), "grpc", grpc.__version__, "protobuf", google.protobuf.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "nccl", cupy.cuda.nccl.get_version() if cupy.cuda.nccl.available else "absent")
except Exception as exc:
    print("cupy unavailable:", exc)
EOF
  local status=0
  # Each GPU test takes seconds (a spawned engine, a small cluster); one that hangs
  # gives up after 90 s, so the others and the benchmark still run in the window.
  timeout 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs --timeout 90 \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" || status=$?
  timeout 150 python3 benchmarks/gpu_ipc.py --json "$out/gpu_ipc.json" 2>&1 | tee "$out/gpu_ipc.log" || status=$?
  return "$status"
}

case "${1:-}" in
  download) download ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 download | run [OUT]" >&2; exit 2 ;;
esac
