#!/usr/bin/env bash
# Optional, benchmark-only peers. Nothing here is a dependency of fastdecode.
#
#   scripts/setup_peer.sh                 llama.cpp (default): build llama-cpp-python
#                                         (with its OpenAI server) into .venv
#   scripts/setup_peer.sh llmcompressor   llm-compressor in its own venv, .venv-llmc
#
# llama.cpp: `fastdecode bench` and `fastdecode bench-serve` compare against it on
# the same GGUF file. Run scripts/setup.sh first. About 10 minutes on 2 cores; do
# not time anything while it compiles. The flags pin AVX2/FMA/F16C and turn off
# AVX-512 and AMX: a native build (-march=native) crashed on an earlier machine of
# this project, and the same build must run on every machine CI may hand us.
#
# llmcompressor: scripts/peer_llmcompressor.py writes its AWQ, GPTQ and W8A8
# checkpoints (docs/peers.md). It gets a venv of its own because it pins an older
# transformers than fastdecode's. torch==2.13.0 goes in first (the CPU wheel this
# machine keeps on disk) so llm-compressor's torch range is already met and pip
# never reaches for a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-llama.cpp}"

case "$target" in
llama.cpp | llamacpp)
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
    ;;
llmcompressor | llm-compressor)
    VENV="${LLMC_VENV:-.venv-llmc}"
    VPY=$VENV/bin/python
    TORCH=2.13.0
    LLMC="${LLMC_VERSION:-0.14.0.1}"
    if "$VPY" -c "import llmcompressor, gguf" >/dev/null 2>&1; then
        echo "setup_peer: llm-compressor already installed in $VENV ($("$VPY" -c 'import llmcompressor, torch; print("llmcompressor", llmcompressor.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
        exit 0
    fi
    [ -x "$VPY" ] || python3 -m venv "$VENV"
    pip_() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
    pip_ "torch==$TORCH"
    # Refuse before installing anything if the resolver would swap torch or bring CUDA.
    plan=$("$VPY" -m pip install --disable-pip-version-check --dry-run "llmcompressor==$LLMC" "torch==$TORCH" 2>&1 | grep '^Would install' || true)
    if echo "$plan" | tr ' ' '\n' | grep -E '^(torch-|triton-|nvidia-(cu|nccl|nvjit|nvtx|cusparse|cufile))' >/dev/null; then
        echo "setup_peer: llmcompressor $LLMC would pull a CUDA stack or another torch; not installing:" >&2
        echo "$plan" >&2
        exit 1
    fi
    # gguf: transformers needs it to dequantize the embedded SmolLM2 GGUF (--from-gguf).
    pip_ "llmcompressor==$LLMC" "torch==$TORCH" "gguf==0.19.0"
    "$VPY" -c 'import torch; assert not torch.version.cuda, torch.version.cuda'
    echo "setup_peer: ready in $VENV ($("$VPY" -c 'import llmcompressor, compressed_tensors, transformers, torch; print("llmcompressor", llmcompressor.__version__, "compressed-tensors", compressed_tensors.__version__, "transformers", transformers.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
    ;;
*)
    echo "usage: scripts/setup_peer.sh [llama.cpp|llmcompressor]" >&2
    exit 2
    ;;
esac
