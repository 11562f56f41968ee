#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU host beyond its image, downloaded here
# (where pip reaches PyPI) into .whl/ (or DIR), for the image's CPython 3.12 on x86-64
# Linux, and .whl/ added to git's ignore list: carry that folder to the GPU host. The
# versions are those CI tests with (.venv); the image's own torch, cupy, numpy,
# transformers, xxhash, psutil, sortedcontainers and prometheus-client are used as they are.
#   scripts/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
WHEELS=(
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 tomli-w==1.2.0 lz4==4.4.5
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
)
PLATFORMS=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
    manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
if [[ $DEST == .whl ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi
du -sh "$DEST"
