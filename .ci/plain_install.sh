#!/usr/bin/env bash
# CI: the package installed WITHOUT extras must serve. Installs tpserve with a plain
# `pip install .` (what deploy/Dockerfile and users do) into a clean venv outside the
# checkout, serves the embedded model at tp 1 and checks one greedy completion against
# the README's text. Catches runtime imports that only the test extra brings (numpy was one).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d)
port=${TPSERVE_PLAIN_PORT:-50091}
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then
    kill -INT "$server_pid" 2>/dev/null || true; t0=$(date +%s); wait "$server_pid" 2>/dev/null || true
    echo "plain install: server stopped in $(( $(date +%s) - t0 )) s"
  fi
  rm -rf "$work"
}
trap cleanup EXIT
start=$(date +%s)
python3 -m venv "$work/venv"
# --no-compile: no byte-compiling of every installed file (torch alone has thousands); Python compiles what it imports.
PIP=("$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
if command -v nvidia-smi >/dev/null 2>&1; then "${PIP[@]}" 'torch>=2.5'; else "${PIP[@]}" 'torch==2.13.0'; fi
# From a copy of the tracked and unignored files: building in the checkout would leave a
# build/ whose stale files a later install would package.
mkdir "$work/src"
(cd "$repo" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$work/src"
"${PIP[@]}" "$work/src"
echo "plain install: $(( $(date +%s) - start )) s"
cd "$work"  # nothing from the checkout is importable from here
for mod in transformers pytest; do
  if "$work/venv/bin/python" -c "import $mod" 2>/dev/null; then echo "plain install: $mod is present : a test-only dependency in a plain install"; fi
done
"$work/venv/bin/tpserve" serve --tensor-parallel-size 1 --port "$port" >"$work/serve.log" 2>&1 &
server_pid=$!
expected=', there was a clever girl named Ella. Ella and her big sister went to the park. Ella was very excited. In the park, she saw a big slide and a little pond. She also saw many ducks.'
for _ in $(seq 1 120); do
  if ! kill -0 "$server_pid" 2>/dev/null; then echo "plain install: the server exited"; cat "$work/serve.log"; exit 1; fi
  if grep -q '"serving"\|serving' "$work/serve.log"; then break; fi
  sleep 1
done
got=$("$work/venv/bin/tpserve" generate --target "127.0.0.1:$port" --temperature 0 --max-tokens 48 "Once upon a time") || {
  echo "plain install: generate failed"; cat "$work/serve.log"; exit 1; }
if [ "$got" != "$expected" ]; then
  printf 'plain install: unexpected completion\n got: %s\nwant: %s\n' "$got" "$expected"; cat "$work/serve.log"; exit 1
fi
echo "plain install: served one request in $(( $(date +%s) - start )) s"
