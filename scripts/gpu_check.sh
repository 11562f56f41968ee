#!/usr/bin/env bash
# The GPU issue's check, one prepared command on a GPU host: the `gpu` tests, then the
# figures, each against its baseline from the same run, and the engine end to end
# (benchmarks/gpu_check.py): JSON to docs/bench/<date>-gpu-check.json, the Markdown table
# for BENCHMARKS.md beside it (.md). Under 8 minutes on an H200.
#
#   scripts/gpu_check.sh [--copy-to DIR] [--size 256MiB] [--arena 16GiB] [--nvme-dir DIR]
#                        [--json FILE]
#
# --copy-to DIR: also copy the JSON, the table and the logs there (a lent machine gives
# back only what is under one folder: `scripts/gpu_check.sh --copy-to "$OUT"`).
#
# Installs nothing from a network (a GPU host may have none). Needs, beyond the image's
# torch (CUDA build), cupy, numpy, transformers, tokenizers, safetensors, xxhash, psutil,
# sortedcontainers and prometheus-client: grpcio, grpcio-health-checking,
# grpcio-reflection and protobuf at kvtier's pins (the generated code needs protobuf 7),
# pydantic with pydantic-core, annotated-types, typing-inspection and typing-extensions,
# tomli-w, lz4, cryptography with cffi and pycparser, and for the tests pytest with
# pluggy and iniconfig, pytest-asyncio and pytest-timeout. scripts/gpu_wheels.sh
# downloads them, where pip reaches PyPI, into .whl/ (git-ignored); carry that folder and
# this script installs them (--no-index) into a private directory first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
COPY_TO=""
ARGS=()
while (($#)); do
    case "$1" in
        --copy-to) COPY_TO=$2; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
WHEELS=${KVTIER_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/kvtier-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Only the plugins named here: the image's own (pytest-cov, xdist, ...) stay out.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
LOGS=$(mktemp -d /tmp/kvtier-gpu-check.XXXXXX)

# Everything it imports, and the GPU, checked first: a missing package is named now,
# not met halfway through the lease.
"$PY" - <<'EOF' || exit 1
import importlib, sys
need = ["torch", "cupy", "numpy", "transformers", "tokenizers", "safetensors", "grpc",
        "grpc_health.v1", "grpc_reflection.v1alpha", "google.protobuf", "pydantic",
        "tomli_w", "xxhash", "lz4.frame", "cryptography", "psutil", "sortedcontainers",
        "prometheus_client", "pytest", "pytest_asyncio", "pytest_timeout",
        "kvtier._proto.kvtier_pb2", "kvtier.server.daemon"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as err:  # ImportError, or a version check failing at import
        missing.append(f"{name} ({type(err).__name__}: {err})")
if missing:
    sys.exit("missing (carry them as wheels: scripts/gpu_wheels.sh):\n  " + "\n  ".join(missing))
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
EOF

# Warnings are not errors here (they are in CI): a deprecation in the image's packages
# must not cost the one run a lent GPU allows.
"$PY" -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout \
    -W default -m gpu tests/movers/test_cuda_gpu.py tests/integration/test_cuda_ipc.py \
    tests/integration/test_transformers_example.py 2>&1 | tee "$LOGS/gpu-tests.log"
TESTS_RC=${PIPESTATUS[0]}

"$PY" benchmarks/gpu_check.py --gpu-tests-rc "$TESTS_RC" ${ARGS[@]+"${ARGS[@]}"} 2>&1 \
    | tee "$LOGS/gpu-check.log"
BENCH_RC=${PIPESTATUS[0]}

if [[ -n $COPY_TO ]]; then
    mkdir -p "$COPY_TO"
    written=$(sed -n 's/.*; wrote \(.*\) and \(.*\)$/\1 \2/p' "$LOGS/gpu-check.log")
    cp $written "$LOGS"/*.log "$COPY_TO"/ 2>/dev/null || true
fi
echo "gpu tests: exit $TESTS_RC; figures: exit $BENCH_RC"
exit $((TESTS_RC != 0 ? TESTS_RC : BENCH_RC))
