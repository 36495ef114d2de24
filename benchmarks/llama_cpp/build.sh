#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (benchmarks/quantized_peer_comparison.py makes Q4_0 and
# Q8_0 files with it) and convert the 95M benchmark model to a float32 GGUF, for
# benchmarks/peer_comparison.py's llama.cpp peer.
#
# llama.cpp comes from the llama-cpp-python source distribution on the package index (its
# vendor/llama.cpp, with the converter and its gguf-py), so no other network source is needed.
# Nothing here is committed: the build, the model and the GGUF stay under the work directory.
#
# Usage: bash benchmarks/llama_cpp/build.sh [WORK_DIR]   (default: ~/.cache/tpserve/llama_cpp)
# Prints the paths to pass on:  --llama-server WORK_DIR/build/bin/llama-server --llama-gguf WORK_DIR/m95-f32.gguf
# (and --llama-quantize WORK_DIR/build/bin/llama-quantize for quantized_peer_comparison.py)
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36, the version recorded in benchmarks/results), VOCAB32K
# (1: the 32,000-token model too, below),
# JOBS (default 2). 63 minutes on the shared 2-core host at load average 4-20, nearly all of it the C++ build
# (25 minutes at nice 12 beside other sessions' tests on 2026-12-06).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${1:-$HOME/.cache/tpserve/llama_cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$WORK"
cd "$WORK"

SRC="$WORK/llama_cpp_python-$VERSION"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$WORK"
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
LLAMA="$SRC/vendor/llama.cpp"

# The server alone (no tests, examples, curl); -march=native: the host's widest vectors (AVX-512 here).
cmake -B "$WORK/build" "$LLAMA" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$WORK/build" --target llama-server llama-quantize -j"${JOBS:-2}"

# The converter imports sentencepiece; install it beside the build, not into the project's venv.
if [ ! -d "$WORK/pydeps/sentencepiece" ]; then
  "$PY" -m pip install --quiet --target "$WORK/pydeps" "sentencepiece>=0.1.98,<0.3.0"
fi

# The benchmark's model (peer_comparison.build_model, seed 0) as a float32 GGUF.
MODEL="$WORK/m95"
if [ ! -f "$MODEL/model.safetensors" ]; then
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, '$REPO'); \
from benchmarks.peer_comparison import build_model; p = Path('$MODEL'); p.mkdir(parents=True, exist_ok=True); build_model(p, 0)"
fi
PYTHONPATH="$LLAMA/gguf-py:$WORK/pydeps" "$PY" "$REPO/benchmarks/llama_cpp/convert.py" "$LLAMA/convert_hf_to_gguf.py" "$MODEL" --outtype f32 \
  --outfile "$WORK/m95-f32.gguf"

# With VOCAB32K=1, also benchmarks/lm_head_int8.py's 0.16B model with a 32,000-token vocabulary
# (quantized_peer_comparison.py --shape vocab32k --llama-gguf WORK_DIR/v32k-f32.gguf).
if [ "${VOCAB32K:-0}" = 1 ]; then
  if [ ! -f "$WORK/v32k/model.safetensors" ]; then
    "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, '$REPO'); \
from benchmarks.lm_head_int8 import build_real_vocab_model; p = Path('$WORK/v32k'); p.mkdir(parents=True, exist_ok=True); \
build_real_vocab_model(p, 0)"
  fi
  PYTHONPATH="$LLAMA/gguf-py:$WORK/pydeps" "$PY" "$REPO/benchmarks/llama_cpp/convert.py" "$LLAMA/convert_hf_to_gguf.py" \
    "$WORK/v32k" --outtype f32 --outfile "$WORK/v32k-f32.gguf"
fi

echo "--llama-server $WORK/build/bin/llama-server --llama-gguf $WORK/m95-f32.gguf --llama-quantize $WORK/build/bin/llama-quantize"
