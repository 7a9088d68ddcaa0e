#!/usr/bin/env bash
# A load generator people already point at OpenAI-compatible servers, run
# unmodified against `kvlease up` on SmolLM2: inference-perf (Kubernetes
# SIG's benchmark), streaming completions of synthetic prompts made with the
# model's own tokenizer, a short closed-loop run at fixed concurrency. It
# fails when any request errored or none completed, and prints its figures.
#
# Why inference-perf: of the three the issue names, it is the lightest from
# PyPI here: guidellm needs torch (CUDA wheels, several GB); AIPerf 0.13 is
# 138 packages, 1.2 GB installed, about 105 s; inference-perf 0.7 is 78
# packages, 0.8 GB, about 70 s, no torch. It needs Python >= 3.12 (this
# machine's image has it under pyenv beside the default 3.11). Every package
# is pinned (.ci/loadgen-requirements.txt); the venv is cached
# (KVLEASE_LOADGEN_VENV), so a run installs nothing once it exists.
#
# The tokenizer comes from `kvlease model tokenizer smollm2` (the one the
# scheduler uses, as a Hugging Face tokenizer directory): there is no hub to
# download one from. The requests name the model `smollm2`, one of the names
# `kvlease up --model smollm2` serves (its GGUF name first).
#
# Knobs: LOADGEN_REQUESTS (default 48), LOADGEN_CONCURRENCY (16).
set -euo pipefail
cd "$(dirname "$0")/.."

requests="${LOADGEN_REQUESTS:-48}"
concurrency="${LOADGEN_CONCURRENCY:-16}"
target="${CARGO_TARGET_DIR:-target}"
kvlease="$target/debug/kvlease"

# a Python of at least 3.12, 3.12 first (the pins were resolved on it): on
# PATH, else one of pyenv's
python=""
pyenv_versions="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions"
for candidate in python3.12 "$pyenv_versions"/3.12*/bin/python3 \
    python3.13 "$pyenv_versions"/3.1[3-9]*/bin/python3 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [ -z "$python" ]; then
    echo "no Python >= 3.12 found (inference-perf needs one)"; exit 1
fi

venv="${KVLEASE_LOADGEN_VENV:-$HOME/.cache/kvlease/loadgen-venv}"
requirements=.ci/loadgen-requirements.txt
stamp="$venv/.requirements"
if ! cmp -s "$requirements" "$stamp" 2>/dev/null || [ ! -x "$venv/bin/inference-perf" ]; then
    echo "-- installing inference-perf into $venv (pinned: $requirements)"
    start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$requirements"
    # every dependency is pinned above: check nothing is missing or clashing
    "$venv/bin/pip" check
    cp "$requirements" "$stamp"
    echo "   installed in $((SECONDS - start)) s, $(du -sm "$venv" | cut -f1) MiB"
fi

cargo build -q -p kvlease
"$kvlease" model fetch smollm2 >/dev/null
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; }; rm -rf "$work"' EXIT
"$kvlease" model tokenizer smollm2 --out "$work/tokenizer" >/dev/null

port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$work/up.log"
# a context of 512 holds the longest prompt (192) and output (48) with room
"$kvlease" up --model smollm2 --workers 1 --max-context 512 --base-port 0 \
    --metrics-base-port 0 --http-listen "127.0.0.1:$port" >"$log" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
    grep -q '^serving;' "$log" && break
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "kvlease up stopped:"; cat "$log"; exit 1
    fi
    sleep 0.25
done
grep -q '^serving;' "$log" || { echo "kvlease up did not serve within 300 s:"; cat "$log"; exit 1; }
scheduler="$(awk '$1 == "scheduler" { print $2; exit }' "$log")"
cache="$(awk '$1 == "cache" { print $2; exit }' "$log")"
base="http://127.0.0.1:$port"
curl -fsS "$base/v1/models" | grep -q '"id":"smollm2"' \
    || { echo "/v1/models does not list smollm2:"; curl -sS "$base/v1/models"; exit 1; }

cat >"$work/config.yml" <<EOF
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: smollm2
  base_url: $base
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: $work/tokenizer
data:
  type: random
  input_distribution: {min: 32, max: 192, mean: 96, std_dev: 32}
  output_distribution: {min: 16, max: 48, mean: 32, std_dev: 8}
load:
  type: concurrent
  num_workers: 2
  stages:
    - {num_requests: $requests, concurrency_level: $concurrency}
report:
  request_lifecycle:
    summary: true
    per_stage: false
    per_request: false
storage:
  local_storage:
    path: $work/reports
EOF

echo "-- inference-perf: $requests streaming completions, $concurrency at a time"
start=$SECONDS
# bounded: a hang fails the run after 10 minutes
# HF_HUB_OFFLINE: the tokenizer is local, and no hub is reachable here
if ! (cd "$work" && HF_HUB_OFFLINE=1 timeout 600 "$venv/bin/inference-perf" --config_file "$work/config.yml" \
    >"$work/inference-perf.log" 2>&1); then
    echo "inference-perf failed:"; tail -50 "$work/inference-perf.log"
    echo "kvlease up's log:"; tail -50 "$log"; exit 1
fi
echo "   ran in $((SECONDS - start)) s"

"$venv/bin/python" - "$work/reports" <<'EOF'
import glob, json, sys

found = glob.glob(f"{sys.argv[1]}/**/summary_lifecycle_metrics.json", recursive=True)
if not found:
    sys.exit(f"no summary_lifecycle_metrics.json under {sys.argv[1]}")
s = json.load(open(found[0]))
ok, failed = s["successes"]["count"], s["failures"]["count"]
lat, thr = s["successes"].get("latency") or {}, s["successes"].get("throughput") or {}
ttft = lat.get("time_to_first_token") or {}
ms = lambda v: f"{v * 1000:.0f} ms" if isinstance(v, (int, float)) else "-"
rows = [
    ("requests completed", ok),
    ("requests failed", failed),
    ("output tokens/s", f"{thr.get('output_tokens_per_sec', 0):.1f}"),
    ("requests/s", f"{thr.get('requests_per_sec', 0):.2f}"),
    ("TTFT p50 / p90", f"{ms(ttft.get('median'))} / {ms(ttft.get('p90'))}"),
]
for name, value in rows:
    print(f"   {name:<20} {value}")
if failed:
    print(json.dumps(s["failures"], indent=1)[:4000])
    sys.exit(f"{failed} request(s) failed")
if ok == 0:
    sys.exit("no request completed")
if not ttft:
    sys.exit("no time to first token: the answers did not stream")
EOF

# what the cluster saw, and its pools whole with nothing leaked once the load
# is over
"$kvlease" status --scheduler "$scheduler" | sed 's/^/   /'
"$kvlease" audit --cache "$cache" --whole >"$work/audit.txt" 2>&1 \
    || { echo "kvlease audit --whole failed after the load:"; cat "$work/audit.txt"; exit 1; }
echo "   kvlease audit --whole: pools whole, nothing leaked"
