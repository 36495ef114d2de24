#!/usr/bin/env bash
# Sets up tpserve in ./.venv on a fresh machine: Python venv, torch, tpserve and its test extra.
# On a machine without an NVIDIA GPU it pins torch 2.13.0, whose CPU build needs no CUDA download.
# It also builds the AVX2 CPU kernels (worker/kernels/), where a compiler is present.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1; then
  "${PIP[@]}" 'torch>=2.5'
else
  "${PIP[@]}" 'torch==2.13.0'
fi
"${PIP[@]}" -e '.[test]'
.venv/bin/python -m worker.kernels  # compile the CPU kernels once now, not in the first rank that needs them
echo "tpserve installed in $(pwd)/.venv: $(.venv/bin/tpserve --version)"
