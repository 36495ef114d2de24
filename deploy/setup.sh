#!/usr/bin/env bash
# Sets up tpserve in ./.venv: a Python venv, torch, tpserve (editable) and the AVX2 CPU kernels.
#
#   bash deploy/setup.sh            # to serve: the runtime dependencies only
#   bash deploy/setup.sh --test     # to run the tests too: adds the `test` extra (transformers, triton, ...)
#   --cpu / --gpu                   # torch's CPU build 2.13.0 or a CUDA build (default: --gpu where
#                                   # nvidia-smi runs; a container build says which)
#
# One line per step, with its time. Idempotent and quick to re-run: pip is skipped while
# .venv/.tpserve-setup records the same pyproject.toml, torch and extras (and --test covers a
# serve-only request), and the kernels while the library built from the same sources exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=""
torch_kind=auto
for arg in "$@"; do
  case "$arg" in
    --test) extras="test" ;;
    --serve) extras="" ;;
    --cpu) torch_kind=cpu ;;
    --gpu) torch_kind=gpu ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "deploy/setup.sh: unknown option $arg (options: --serve, --test, --cpu, --gpu)" >&2; exit 2 ;;
  esac
done
if [ "$torch_kind" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then torch_kind=gpu; else torch_kind=cpu; fi
fi
if [ "$torch_kind" = gpu ]; then TORCH_SPEC='torch>=2.5'; else TORCH_SPEC='torch==2.13.0'; fi

t_all=$EPOCHREALTIME
step_start=
begin() { step_start=$EPOCHREALTIME; }
# done_step NAME WHAT: "setup: NAME: WHAT (1.2 s)"
done_step() {
  local ms=$(( (${EPOCHREALTIME/./} - ${step_start/./}) / 1000 ))
  printf 'setup: %-9s %s (%d.%d s)\n' "$1:" "$2" $((ms / 1000)) $((ms % 1000 / 100))
}

begin
if [ -x .venv/bin/python ]; then done_step venv "$(pwd)/.venv exists"
else "$PYTHON" -m venv .venv; done_step venv "created $(pwd)/.venv ($("$PYTHON" --version 2>&1))"; fi

begin
stamp=.venv/.tpserve-setup
want="pyproject $(sha256sum pyproject.toml | cut -c1-16) torch $TORCH_SPEC"
have=$(cat "$stamp" 2>/dev/null || true)
if [ -x .venv/bin/tpserve ] && { [ "$have" = "$want extras test" ] || [ "$have" = "$want extras $extras" ]; }; then
  kind=${have##* extras }
  done_step packages "up to date (${kind:-serve-only}; pyproject.toml unchanged)"
else
  # --no-compile: pip would byte-compile file by file, on one core; the bytecode step below does it in parallel.
  PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
  "${PIP[@]}" "$TORCH_SPEC"
  done_step torch "$TORCH_SPEC installed"
  begin
  # The project and its dependencies through uv where it can be had and pip's index is PyPI's: uv downloads
  # and installs in parallel (the test extra's ~100 packages in 11 s here, pip 46 s, same run, cold caches, the
  # same versions). pip otherwise, or if uv fails. uv reads no pip configuration, hence the index check; pip's
  # constraint file is passed on. torch came from pip above (its find-links may hold the CPU build), and uv
  # keeps an installed torch that fits.
  installer=pip
  if [ -z "${PIP_INDEX_URL:-}" ] && ! .venv/bin/python -m pip config get global.index-url >/dev/null 2>&1 \
      && "${PIP[@]}" uv >/dev/null 2>&1; then
    constraint=$(.venv/bin/python -m pip config get global.constraint 2>/dev/null || true)
    if .venv/bin/uv pip install --quiet --python .venv/bin/python ${constraint:+--constraint "$constraint"} \
        -e ".${extras:+[$extras]}"; then installer=uv; fi
  fi
  [ "$installer" = uv ] || "${PIP[@]}" -e ".${extras:+[$extras]}"
  done_step tpserve "installed with $installer (editable${extras:+, with the $extras extra})"
  begin
  # Bytecode. Python compiles a module on its first import and caches it, except where
  # PYTHONDONTWRITEBYTECODE is set (many container images): there every process compiles again what it
  # imports (a rank's imports, torch, the worker and grpc, cost 6.5 CPU-seconds instead of 3.0), so all
  # of site-packages is compiled now, in parallel (25-30 s on 2 cores). Elsewhere only what a rank and a
  # server import is compiled now (about 9 s), in one process rather than in every rank of the first
  # servers at once; the rest is compiled and cached by the first process that imports it.
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    # Exit status 1 names files this Python cannot parse (torch ships a 3.12-only test file); never imported.
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
    compiled="site-packages, as PYTHONDONTWRITEBYTECODE is set"
  else
    .venv/bin/python -c "import torch, grpc, worker.main, worker.server, launch.cli, launch.public_server, coordinator.engine, tpserve.client"
    compiled="what a rank and a server import; the rest on first use"
  fi
  echo "$want extras $extras" > "$stamp"
  done_step bytecode "compiled ($compiled)"
fi
# Ours too (under a second; up-to-date files are skipped): every rank, server and test process imports these.
# Only the folders present: deploy/Dockerfile copies no tests/.
ours=(); for dir in tpserve coordinator worker launch tests; do [ -d "$dir" ] && ours+=("$dir"); done
.venv/bin/python -m compileall -q -j 0 "${ours[@]}" >/dev/null

begin
# The kernels' library is named by a hash of their sources, flags and torch's version
# (worker/kernels/__init__.py); the stamp keeps the path a build gave for these sources and the cache
# directory asked for (a new TPSERVE_KERNEL_CACHE builds there).
kstamp=.venv/.tpserve-kernels
ksources="$(cat worker/kernels/*.cpp worker/kernels/*.h worker/kernels/__init__.py | sha256sum | cut -c1-16) $(cat "$stamp") cache=${TPSERVE_KERNEL_CACHE:-default}"
read -r kseen klib < <(tail -n 1 "$kstamp" 2>/dev/null || true) || true
if [ "$(head -n 1 "$kstamp" 2>/dev/null)" = "$ksources" ] && { [ "$klib" = none ] || [ -f "$klib" ]; }; then
  done_step kernels "cached ($klib)"
else
  # Compiled once now, not in the first rank that needs them; never fatal (torch's ops run instead).
  out=$(.venv/bin/python -m worker.kernels)
  dir=$(printf '%s\n' "$out" | sed -n 's/^tpserve CPU kernels ready in //p')
  printf '%s\nkernels %s\n' "$ksources" "${dir:+$dir/tpserve_cpu_kernels.so}" > "$kstamp"
  [ -n "$dir" ] || printf '%s\nkernels none\n' "$ksources" > "$kstamp"
  done_step kernels "$out"
fi
step_start=$t_all
if [ "$extras" = test ]; then
  done_step done "tpserve in $(pwd)/.venv; test with: .venv/bin/python -m pytest -q (serve with: .venv/bin/tpserve serve)"
else
  done_step done "tpserve in $(pwd)/.venv; serve with: .venv/bin/tpserve serve"
fi
