#!/usr/bin/env bash
# The official `openai` Python package against `kvlease up --http-listen`:
# clients/openai/check.py (completions and chat, streamed and whole, usage,
# errors). The package lives in a cached venv.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVLEASE_CI_VENV:-$HOME/.cache/kvlease/ci-venv}"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q openai
fi

cargo build -q -p kvlease
port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp)"
target/debug/kvlease up --workers 1 --base-port 0 --metrics-base-port 0 \
    --http-listen "127.0.0.1:$port" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT

# the front answers /health 200 once the scheduler serves (warm-up included)
for _ in $(seq 1 600); do
    if "$venv/bin/python" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2).status != 200)" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "kvlease up stopped:"; cat "$log"; exit 1
    fi
    sleep 0.5
done
"$venv/bin/python" clients/openai/check.py "http://127.0.0.1:$port/v1" || { echo "kvlease up's log:"; cat "$log"; exit 1; }
