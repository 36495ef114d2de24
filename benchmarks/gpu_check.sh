#!/usr/bin/env bash
# The GPU check: the first thing to run when a session is lent a CUDA machine (docs/design/gpu.md, "The GPU check").
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine: under 8 minutes on one H200
#   bash benchmarks/gpu_check.sh --dry-run  # on any CPU machine: the same stages on the CPU, tiny model
#
# Stages (each bounded by `timeout`; a failed stage is reported and the next one still runs):
#   1. the `gpu`-marked tests (tests/worker/test_gpu.py): bfloat16 logits against transformers at
#      tp 1, and tp 2 over NCCL when two GPUs are visible; weights loaded onto the GPU; the
#      sampler's noise and tokens on the GPU equal the CPU's; then the Triton paged decode kernel
#      compiled on the GPU (tests/worker/test_triton_attention.py) and decode steps replayed from
#      captured CUDA graphs against transformers (tests/worker/test_cuda_graphs.py);
#   2. benchmarks/gpu_check.py: a 1B-class random Llama built from a fixed seed; which attention
#      kernel / SDPA backend ran; the embedded model and the 1B model served through the real gRPC
#      path (`tpserve serve`): decode ms/token at batch 1, output tok/s at 64 at once, the KV cache
#      the server sized, and the HBM roofline (weight bytes / 4.8 TB/s); and the TPOT / bare-step ratio at 64
#      streams on the 1B model with CUDA graphs on (the step's fixed cost around the model);
#   3. benchmarks/pd_disaggregation.py (issue 45): a KV transfer's cost against recomputing the prompt,
#      and 16 decode streams' TPOT p50/p99 while 1,500-token prompts arrive, two co-located replicas
#      behind smg against one prefill + one decode replica behind smg --pd-disaggregation, every
#      replica on the one GPU at --gpu-memory-utilization 0.2. Needs smg and openai (carried wheels
#      or the image's); without them the stage says so and is skipped (not a failure).
# The summary is printed and written to $OUT/gpu_check.json (the device tool's $OUT) or
# ./gpu_check.json; the tests' log to $OUT/gpu_tests.log.
#
# Python: $PYTHON, else .venv/bin/python for --dry-run where it exists, else python3. The H200
# image's python3 has torch 2.11+CUDA, transformers, grpcio, tokenizers, safetensors,
# prometheus-client and pyyaml; the other wheels tpserve needs travel in ./.whl (ignored by git),
# made once on the developer machine, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
#     structlog==26.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0
# (grpcio and protobuf too: the committed stubs need grpcio >= 1.85.1 and protobuf 7). Then
# run with the device tool: carry [".whl"], command `bash benchmarks/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ "$DRY_RUN" = 1 ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d /tmp/tpserve-site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY_RUN" = 1 ]; then
  export TPSERVE_TEST_DEVICE=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  CHECK_ARGS=(--dry-run)
else
  CHECK_ARGS=()
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "[gpu_check] python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')"

status=0
started=$SECONDS
echo "[gpu_check] stage 1: gpu-marked tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/worker/test_gpu.py tests/worker/test_triton_attention.py \
  tests/worker/test_cuda_graphs.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | grep -v "it/s\]"
test_status=${PIPESTATUS[0]}
[ "$test_status" = 0 ] || { echo "[gpu_check] stage 1 FAILED (exit $test_status)"; status=1; }
echo "[gpu_check] stage 1: $((SECONDS - started)) s"

echo "[gpu_check] stage 2: serving (default model, random Llama)"
timeout 300 "$PY" benchmarks/gpu_check.py "${CHECK_ARGS[@]}" --out "$OUT_DIR/gpu_check.json"
check_status=$?
[ "$check_status" = 0 ] || { echo "[gpu_check] stage 2 FAILED (exit $check_status)"; status=1; }
echo "[gpu_check] stage 3: prefill/decode disaggregation (KV transfer, TPOT under long prompts)"
if "$PY" -c "import smg, openai" 2>/dev/null; then
  PD_ARGS=(--repeats 3 --out "$OUT_DIR")
  [ "$DRY_RUN" = 1 ] || PD_ARGS+=(--gpu-memory-utilization 0.2)
  timeout 420 "$PY" benchmarks/pd_disaggregation.py "${PD_ARGS[@]}"
  pd_status=$?
  [ "$pd_status" = 0 ] || { echo "[gpu_check] stage 3 FAILED (exit $pd_status)"; status=1; }
else
  echo "[gpu_check] stage 3 skipped: smg or openai is not installed for $PY (carry their wheels in .whl)"
fi
echo "[gpu_check] done in $((SECONDS - started)) s, status $status"
exit $status
