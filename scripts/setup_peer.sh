#!/usr/bin/env bash
# Optional, benchmark-only peers. Nothing here is a dependency of fastdecode.
#
#   scripts/setup_peer.sh                 llama.cpp (default): its binaries (llama-bench,
#                                         llama-batched-bench, llama-server) in .peer/llama.cpp,
#                                         and llama-cpp-python (with its OpenAI server) in .venv
#   scripts/setup_peer.sh llama.cpp-bin   the binaries only
#   scripts/setup_peer.sh llmcompressor   llm-compressor in its own venv, .venv-llmc
#
# llama.cpp: `fastdecode bench`, `bench-serve` and `bench-scale` compare against it on the
# same GGUF file. Run scripts/setup.sh first. One compile serves both: the llama.cpp tree
# vendored in llama-cpp-python's sdist (so the Python bindings and the binaries are one
# version) is built with CMake into .peer/llama.cpp/build, and the Python package is installed
# without a compile of its own (LLAMA_BUILD=OFF) and given that build's shared libraries.
# About 10-15 minutes on 2 idle cores (90 on a host shared by six builds); do not time anything
# while it compiles.
#
# The build is native (-DGGML_NATIVE=ON: -march=native, every SIMD extension this CPU has),
# as fastdecode's kernels are: a peer pinned to AVX2 on an AVX-512 machine is an unfair peer.
# Only if the native build fails to compile or its binary does not run (an earlier machine of
# this project crashed on one) is it rebuilt with pinned flags (AVX2/FMA/F16C, no AVX-512 or
# AMX); .peer/llama.cpp/BUILD says which build is in place and with which flags.
#
#   LLAMA_CPP_PYTHON_VERSION   the sdist to build (default below)
#   PEER_DIR                   where it goes (default .peer/llama.cpp)
#   PEER_PYTHON                the Python that gets llama-cpp-python (default .venv/bin/python)
#   PEER_CMAKE_ARGS            extra CMake options for the binaries' build
#
# llmcompressor: scripts/peer_llmcompressor.py writes its AWQ, GPTQ and W8A8
# checkpoints (docs/peers.md). It gets a venv of its own because it pins an older
# transformers than fastdecode's. torch==2.13.0 goes in first (the CPU wheel this
# machine keeps on disk) so llm-compressor's torch range is already met and pip
# never reaches for a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-llama.cpp}"

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEER_DIR="${PEER_DIR:-.peer/llama.cpp}"
PEER_PYTHON="${PEER_PYTHON:-.venv/bin/python}"
PINNED_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
BINARIES="llama-bench llama-batched-bench llama-server"

llama_cpp_source() {
    # The sdist, unpacked once; its vendor/llama.cpp is the tree the binaries are built from.
    local src="$PEER_DIR/src" sdist="$PEER_DIR/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        mkdir -p "$PEER_DIR/sdist"
        "$PEER_PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
            -d "$PEER_DIR/sdist" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
    fi
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        rm -rf "$src" && mkdir -p "$src"
        tar -xzf "$sdist" -C "$src" --strip-components=1
    fi
    echo "$src"
}

try_build() { # try_build BUILD_DIR FLAGS...: configure and build the binaries; 0 if they run
    local dir="$1"
    shift
    # No web UI (it would be fetched or built with npm), no curl, no tests or examples.
    cmake -S "$src/vendor/llama.cpp" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF "$@" ${PEER_CMAKE_ARGS:-} >"$dir.log" 2>&1 &&
        cmake --build "$dir" --config Release -j "$(nproc)" --target $BINARIES >>"$dir.log" 2>&1 &&
        "$dir/bin/llama-bench" --help >/dev/null 2>&1
}

build_llama_cpp() {
    if [ -f "$PEER_DIR/BUILD" ] && [ -x "$PEER_DIR/build/bin/llama-bench" ]; then
        echo "setup_peer: llama.cpp already built ($(head -1 "$PEER_DIR/BUILD"))"
        return 0
    fi
    src=$(llama_cpp_source)
    mkdir -p "$PEER_DIR"
    echo "setup_peer: building llama.cpp $LLAMA_CPP_PYTHON_VERSION natively into $PEER_DIR/build (log: $PEER_DIR/build.log)"
    local kind=native flags="-DGGML_NATIVE=ON"
    if ! try_build "$PEER_DIR/build" $flags; then
        echo "setup_peer: the native build failed (tail of $PEER_DIR/build.log below); rebuilding with pinned AVX2 flags" >&2
        tail -20 "$PEER_DIR/build.log" >&2 || true
        rm -rf "$PEER_DIR/build"
        kind=pinned-avx2 flags="$PINNED_FLAGS"
        try_build "$PEER_DIR/build" $flags || {
            echo "setup_peer: the pinned build failed too; see $PEER_DIR/build.log" >&2
            exit 1
        }
    fi
    {
        echo "$kind llama.cpp from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION"
        echo "flags: $flags ${PEER_CMAKE_ARGS:-}"
        echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
        grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' ' | sed 's/^/isa: /'
        echo
    } >"$PEER_DIR/BUILD"
    echo "setup_peer: llama.cpp ready ($kind): $PEER_DIR/build/bin/{${BINARIES// /,}}"
}

install_llama_cpp_python() {
    # The package's own compile is skipped (LLAMA_BUILD=OFF, LLAVA_BUILD=OFF): it gets the
    # shared libraries built above, from the same llama.cpp tree, in its llama_cpp/lib.
    if "$PEER_PYTHON" -c "import llama_cpp.server" >/dev/null 2>&1; then
        echo "setup_peer: llama-cpp-python already installed ($("$PEER_PYTHON" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
        return 0
    fi
    local sdist="$PEER_DIR/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PEER_PYTHON" -m pip install --disable-pip-version-check -q \
        "llama-cpp-python[server] @ file://$(realpath "$sdist")"
    local lib
    lib="$("$PEER_PYTHON" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')"
    mkdir -p "$lib"
    cp -a "$PEER_DIR"/build/bin/lib*.so* "$lib/"
    echo "setup_peer: ready ($("$PEER_PYTHON" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'), libraries from $PEER_DIR/build)"
}

case "$target" in
llama.cpp | llamacpp | llama.cpp-bin)
    build_llama_cpp
    if [ "$target" != llama.cpp-bin ]; then
        install_llama_cpp_python
    fi
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
    echo "usage: scripts/setup_peer.sh [llama.cpp|llama.cpp-bin|llmcompressor]" >&2
    exit 2
    ;;
esac
