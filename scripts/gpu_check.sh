#!/usr/bin/env bash
# The GPU issue's check, one command on a GPU host: the `gpu` tests, then the figures,
# each against its baseline from the same run (benchmarks/gpu_check.py; the table is
# printed last). Under 8 minutes on an H200. Installs nothing: a GPU host may have no
# network. Needs, beyond torch (CUDA build): grpcio, protobuf, pydantic, xxhash, lz4,
# psutil, sortedcontainers, prometheus-client, cryptography, tomli-w (kvtier's runtime),
# cupy (the daemon opens CUDA IPC handles with it), and pytest, pytest-asyncio,
# pytest-timeout (the tests). The workplace's H200 image lacks pydantic (with
# pydantic-core, annotated-types, typing-inspection), lz4, tomli-w, cryptography,
# grpcio-health-checking, grpcio-reflection and pytest-asyncio: carry them as wheels.
#   scripts/gpu_check.sh [--size 256MiB] [--arena 16GiB] [--nvme-dir DIR] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/movers/test_cuda_gpu.py \
    tests/integration/test_cuda_ipc.py
"$PY" benchmarks/gpu_check.py "$@"
