#!/usr/bin/env bash
# The host-memory tier on the synthetic Mooncake trace (not in CI): the same
# `kvlease bench --trace` run against `kvlease up` (one CPU worker) twice,
# once with the device pools alone (N blocks each, from --memory-budget-mib)
# and once with a host tier of 4N blocks per pool, then one table of the
# cache hit rate and TTFT p50/p90 of both.
#
#   scripts/bench-host-tier.sh --requests 2000 --memory-budget-mib 34
#
# Flags for `kvlease bench` pass through (--bench-arg=...).
set -euo pipefail

requests=2000 budget=34 concurrency=4 port=45551 metrics=47590
trace=../shared/traces/mooncake-synthetic.jsonl kvlease=${KVLEASE_BIN:-}
bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --memory-budget-mib) budget=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --trace) trace=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --bench-arg=*) bench_args+=("${1#--bench-arg=}"); shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench-host-tier.sh: unknown flag $1" >&2; exit 64 ;;
  esac
done

cd "$(dirname "$0")/.."
if [ -z "$kvlease" ]; then
  cargo build --release -q -p kvlease
  kvlease=target/release/kvlease
fi
work=$(mktemp -d)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

metric_sum() { awk -v m="$1" -v f="${2:-}" '$1 ~ "^"m"({|$)" && index($1, f) {s += $2} END {print s + 0}'; }

# run NAME HOST_BLOCKS: one cluster, one bench; leaves its output in NAME.out
run() {
  local name=$1 host=$2
  "$kvlease" up --workers 1 --base-port "$port" --metrics-base-port "$metrics" \
    --memory-budget-mib "$budget" --host-blocks "$host" >"$work/$name.up" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    "$kvlease" health "127.0.0.1:$port" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { echo "kvlease up died:"; tail -20 "$work/$name.up"; exit 1; }
    sleep 1
  done
  "$kvlease" health "127.0.0.1:$port" >/dev/null
  "$kvlease" bench --scheduler "127.0.0.1:$port" --trace "$trace" --requests "$requests" \
    --concurrency "$concurrency" --no-progress "${bench_args[@]}" >"$work/$name.out" 2>&1
  curl -sf "http://127.0.0.1:$((metrics + 1))/metrics" >"$work/$name.metrics"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
}

run device 0
# N: the blocks of the full-attention pool (window 0) of the worker.
n=$(metric_sum kvlease_pool_capacity_blocks 'window="0"' <"$work/device.metrics")
run tiered $(( 4 * n ))

row() {
  local name=$1 label=$2
  local hit ttft onboarded demoted dropped
  hit=$(grep -m1 'cache hit rate' "$work/$name.out" | sed 's/^ *cache hit rate *//')
  ttft=$(grep -m1 'TTFT' "$work/$name.out" | sed 's/^ *TTFT *//')
  onboarded=$(metric_sum kvlease_tier_copy_blocks_total 'direction="onboarded"' <"$work/$name.metrics")
  demoted=$(metric_sum kvlease_tier_copy_blocks_total 'direction="demoted"' <"$work/$name.metrics")
  dropped=$(metric_sum kvlease_tier_copy_blocks_total 'direction="demotion_dropped"' <"$work/$name.metrics")
  printf '| %s | %s | %s | %s | %s | %s |\n' "$label" "$hit" "$ttft" "$demoted" "$dropped" "$onboarded"
}
echo "trace $trace, first $requests requests, concurrency $concurrency, one CPU worker, N = $n blocks per pool"
echo "| pools | cache hit rate | TTFT | demoted | of those dropped (never published) | onboarded |"
echo "|---|---|---|---|---|---|"
row device "device N"
row tiered "device N + host 4N"
for name in device tiered; do
  echo "--- $name"; cat "$work/$name.out"
done
