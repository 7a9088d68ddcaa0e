#!/usr/bin/env bash
# Soak test (not in CI): an over-subscribed `kvlease bench` workload against
# `kvlease up` for --minutes (default 20). Every minute it samples the RSS of
# the cluster process (cache, scheduler and workers share it: `kvlease up`
# runs every service in one process) and of the gateway when --http is given,
# then prints a table and checks:
#   - RSS flat within 10% after warm-up (the first --warmup minutes, default 3,
#     are left out; the check compares every later sample with the first one);
#   - 0 leaked blocks: the cache's leak audit (run every minute here,
#     --audit-interval-ms) reclaimed nothing, and every pool is whole
#     (nothing in use or fenced) once the load stops;
#   - no errors: every bench round reports errors=0 (REJECTED answers are
#     expected under over-subscription and are counted, not failed).
# Flags for `kvlease up` and `kvlease bench` pass through (--up-arg=...,
# --bench-arg=...).
#
# --mtls runs the services as separate processes over mTLS instead (`kvlease
# up` serves plaintext loopback only): certificates from `kvlease certs`, the
# cache, one worker (owned by the scheduler's principal) and the scheduler
# each with its own certificate, the bench as the `client` principal; the RSS
# of each process is sampled. The service binaries are taken from beside
# KVLEASE_BIN (or target/release).
#
#   scripts/soak.sh --minutes 2
#   scripts/soak.sh --mtls --minutes 20
set -euo pipefail

minutes=20 warmup=3 port=56051 metrics=59090 concurrency=48 requests=150 budget=40
# outputs long enough that decodes outgrow the pools: the cache refuses
# extends (POOL_EXHAUSTED) and the scheduler preempts and recomputes
output_min=48 output_max=160
up_args=() bench_args=() kvlease=${KVLEASE_BIN:-} mtls=0
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --metrics-port) metrics=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --output-min) output_min=$2; shift 2 ;;
    --output-max) output_max=$2; shift 2 ;;
    --requests-per-round) requests=$2; shift 2 ;;
    --memory-budget-mib) budget=$2; shift 2 ;;
    --up-arg=*) up_args+=("${1#--up-arg=}"); shift ;;
    --bench-arg=*) bench_args+=("${1#--bench-arg=}"); shift ;;
    --mtls) mtls=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown flag $1" >&2; exit 64 ;;
  esac
done
if [ "$warmup" -ge "$minutes" ]; then warmup=$(( minutes / 2 )); fi

cd "$(dirname "$0")/.."
if [ -z "$kvlease" ]; then
  cargo build --release -q -p kvlease -p cache-svc -p scheduler-svc -p worker-svc
  kvlease=target/release/kvlease
fi
bin=$(dirname "$kvlease")
work=$(mktemp -d)
names=() pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# start NAME COMMAND...: runs one process in the background, logged to NAME.log
start() {
  local name=$1; shift
  "$@" >"$work/$name.log" 2>&1 &
  names+=("$name") pids+=($!)
}

# A small KV budget so the bench over-subscribes the pools: requests wait,
# get preempted and recomputed, some end REJECTED.
client=("$kvlease")
if [ "$mtls" -eq 1 ]; then
  "$kvlease" certs --out "$work/certs" >/dev/null
  c=$work/certs
  export KVLEASE_TLS_CA=$c/ca.pem
  start cache env KVLEASE_TLS_CERT="$c/cache.pem" KVLEASE_TLS_KEY="$c/cache.key" \
    "$bin/kvlease-cache" --listen "127.0.0.1:$((port + 1))" --metrics-listen "127.0.0.1:$((metrics + 1))" \
    --audit-interval-ms 60000
  start worker env KVLEASE_TLS_CERT="$c/worker.pem" KVLEASE_TLS_KEY="$c/worker.key" \
    "$bin/kvlease-worker" --listen "127.0.0.1:$((port + 2))" --owner scheduler --memory-budget-mib "$budget" --threads 1
  sleep 2
  start scheduler env KVLEASE_TLS_CERT="$c/scheduler.pem" KVLEASE_TLS_KEY="$c/scheduler.key" \
    "$bin/kvlease-scheduler" --listen "127.0.0.1:$port" --cache-addr "127.0.0.1:$((port + 1))" \
    --worker-addrs "127.0.0.1:$((port + 2))"
  client=("$kvlease" --tls-cert "$c/client.pem" --tls-key "$c/client.key" --tls-ca "$c/ca.pem")
else
  start up env KVLEASE_CACHE_AUDIT_INTERVAL_MS=60000 "$kvlease" up --base-port "$port" \
    --metrics-base-port "$metrics" --memory-budget-mib "$budget" "${up_args[@]}"
fi
for _ in $(seq 1 120); do
  "${client[@]}" health "127.0.0.1:$port" >/dev/null 2>&1 && break
  for i in "${!pids[@]}"; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "${names[$i]} died:"; tail -20 "$work/${names[$i]}.log"; exit 1; }
  done
  sleep 1
done
"${client[@]}" health "127.0.0.1:$port" >/dev/null

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
cache_metrics() { curl -sf "http://127.0.0.1:$((metrics + 1))/metrics" >"$work/metrics" && cat "$work/metrics"; }
metric_sum() { awk -v m="$1" -v f="${2:-}" '$1 ~ "^"m"({|$)" && index($1, f) {s += $2} END {print s + 0}'; }

start=$(date +%s) end=$(( start + minutes * 60 )) next_sample=$start minute=0
rounds=0 errors=0 requests_total=0 rejected_total=0
printf 'minute | rss_mib (%s) | leaked_total | in_use | fenced | rounds | requests | rejected | errors\n' "${names[*]}" | tee "$work/table"
while :; do
  now=$(date +%s)
  if [ "$now" -ge "$next_sample" ]; then
    m=$(cache_metrics)
    leaked=$(metric_sum kvlease_leaked_blocks_reclaimed_total <<<"$m")
    in_use=$(metric_sum kvlease_pool_blocks 'state="in_use"' <<<"$m")
    fenced=$(metric_sum kvlease_pool_blocks 'state="fenced"' <<<"$m")
    rss_mib=""
    for i in "${!pids[@]}"; do
      rss=$(rss_kib "${pids[$i]}")
      echo "$minute $rss" >>"$work/rss.${names[$i]}"
      rss_mib+=$(printf '%7.1f ' "$(echo "$rss / 1024" | bc -l)")
    done
    printf '%6d | %s | %12d | %6d | %6d | %6d | %8d | %8d | %6d\n' "$minute" "$rss_mib" \
      "$leaked" "$in_use" "$fenced" "$rounds" "$requests_total" "$rejected_total" "$errors" | tee -a "$work/table"
    minute=$(( minute + 1 )) next_sample=$(( start + minute * 60 ))
    [ "$now" -ge "$end" ] && break
  fi
  # one bench round, cut short so samples stay on the minute
  left=$(( next_sample - $(date +%s) ))
  [ "$left" -lt 5 ] && { sleep "$(( left > 0 ? left : 0 ))"; continue; }
  set +e
  timeout "$left" "${client[@]}" bench --scheduler "127.0.0.1:$port" --requests "$requests" --no-progress \
    --concurrency "$concurrency" --output-min "$output_min" --output-max "$output_max" "${bench_args[@]}" >"$work/bench.out" 2>&1
  rc=$?
  set -e
  summary=$(grep -m1 '^summary:' "$work/bench.out" || true)
  if [ -z "$summary" ]; then
    [ "$rc" -eq 124 ] && continue   # cut at the minute: not an error
    echo "bench round failed (exit $rc):"; tail -20 "$work/bench.out"; errors=$(( errors + 1 )); continue
  fi
  rounds=$(( rounds + 1 ))
  requests_total=$(( requests_total + $(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$summary") ))
  rejected_total=$(( rejected_total + $(sed -E 's/.*rejected=([0-9]+).*/\1/' <<<"$summary") ))
  round_errors=$(sed -E 's/.* errors=([0-9]+).*/\1/' <<<"$summary")
  if [ "$round_errors" -gt 0 ]; then echo "round $rounds: $summary"; fi
  errors=$(( errors + round_errors ))
done

# drained: every pool whole, and one more audit pass finds nothing
sleep 2
m=$(cache_metrics)
in_use=$(metric_sum kvlease_pool_blocks 'state="in_use"' <<<"$m")
fenced=$(metric_sum kvlease_pool_blocks 'state="fenced"' <<<"$m")
leaked=$(metric_sum kvlease_leaked_blocks_reclaimed_total <<<"$m")
refused=$(metric_sum kvlease_rejects_total 'reason="POOL_EXHAUSTED"' <<<"$m")
capacity=$(metric_sum kvlease_pool_capacity_blocks <<<"$m")

fail=0
for name in "${names[@]}"; do
  f=$work/rss.$name
  base=$(awk -v w="$warmup" '$1 == w {print $2}' "$f")
  max=$(awk -v w="$warmup" '$1 >= w && $2 > m {m = $2} END {print m}' "$f")
  min=$(awk -v w="$warmup" 'BEGIN {m = -1} $1 >= w && (m < 0 || $2 < m) {m = $2} END {print m}' "$f")
  spread=$(echo "($max - $min) * 100 / $base" | bc -l)
  printf '%s rss after warm-up (minute %d on): %.1f..%.1f MiB, spread %.1f%% of minute %d (limit 10%%)\n' \
    "$name" "$warmup" "$(echo "$min / 1024" | bc -l)" "$(echo "$max / 1024" | bc -l)" "$spread" "$warmup"
  if (( $(echo "$spread > 10" | bc -l) )); then echo "FAIL: $name RSS not flat"; fail=1; fi
done
echo "leaked blocks reclaimed by the audit: $leaked; after the load: in_use=$in_use fenced=$fenced"
if [ "$leaked" -ne 0 ] || [ "$in_use" -ne 0 ] || [ "$fenced" -ne 0 ]; then echo "FAIL: blocks leaked or held"; fail=1; fi
echo "bench rounds: $rounds, requests: $requests_total, rejected: $rejected_total, errors: $errors"
# over-subscription shows as the cache refusing leases and extends for lack
# of blocks (the scheduler then queues or preempts)
echo "pool capacity: $capacity blocks; leases and extends the cache refused POOL_EXHAUSTED: $refused"
if [ "$refused" -eq 0 ]; then echo "FAIL: the load never over-subscribed the pools (raise --concurrency or lower --memory-budget-mib)"; fail=1; fi
if [ "$errors" -ne 0 ] || [ "$rounds" -eq 0 ]; then echo "FAIL: errors (or no round finished)"; fail=1; fi
[ "$fail" -eq 0 ] && echo "soak: PASS" || echo "soak: FAIL"
exit "$fail"
