#!/usr/bin/env bash
# Optional, benchmark-only: build llama-cpp-python (with its OpenAI server) into
# .venv so `fastdecode bench` and `fastdecode bench-serve` can compare against
# llama.cpp on the same GGUF file. Run scripts/setup.sh first. About 10 minutes
# on 2 cores; do not time anything while it compiles.
#
# The flags pin AVX2/FMA/F16C and turn off AVX-512 and AMX: a native build
# (-march=native) crashed on an earlier machine of this project, and the same
# build must run on every machine CI may hand us.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
if "$VPY" -c "import llama_cpp.server" >/dev/null 2>&1; then
    echo "setup_peer: llama-cpp-python already installed ($("$VPY" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
    exit 0
fi
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "setup_peer: building llama-cpp-python[server] with CMAKE_ARGS=$CMAKE_ARGS"
"$VPY" -m pip install --disable-pip-version-check -q --no-binary llama-cpp-python "llama-cpp-python[server]"
echo "setup_peer: ready ($("$VPY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'))"
