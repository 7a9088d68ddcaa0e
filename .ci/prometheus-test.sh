#!/usr/bin/env bash
# The Prometheus test: a real Prometheus server (Debian's `prometheus`
# package, installed when missing) scrapes a `kvlease up` cluster every
# second while an over-subscribed bench runs; once the cluster is idle, the
# figures Prometheus answers over its HTTP API (/api/v1/query: pool states,
# per-pool grants/rejects/evictions, the reject rate, rejects by reason on
# both services, finished requests, preemptions, request counts) are checked
# against the cluster's own GetStatus (`kvlease status`, whose pools are the
# cache's GetStats) by .ci/prometheus-check.py, and so is the Grafana
# dashboard's "Reject ratio" panel (its expression, evaluated over the run,
# within 1% of the requests rejected over the requests finished). The cluster
# rejects a request whose pool is exhausted (`--on-exhausted reject`), so the
# run has a known reject rate. Fails when any figure disagrees, when the bench
# caused no reject, or when a target is down.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s prometheus >/dev/null 2>&1; then
    echo "installing Debian's prometheus package"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
prom="$(command -v prometheus || echo /usr/bin/prometheus)"
"$prom" --version 2>&1 | head -1

cargo build -q -p kvlease
KV=target/debug/kvlease
work="$(mktemp -d)"
pids=()
cleanup() {
    local rc=$?
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ "$rc" -ne 0 ]; then
        echo "--- kvlease up (last 40 lines)"; tail -40 "$work/up.log" 2>/dev/null || true
        echo "--- prometheus (last 20 lines)"; tail -20 "$work/prometheus.log" 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

# four consecutive free ports for the metrics endpoints (scheduler, cache,
# two workers: `up` takes base, base + 1, ...) and one for Prometheus
read -r mbase pport < <(python3 - <<'PY'
import socket
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
s = socket.socket(); s.bind(("127.0.0.1", 0)); pport = s.getsockname()[1]; s.close()
for base in range(20000, 60000, 7):
    if all(free(base + i) for i in range(4)) and pport not in range(base, base + 4):
        print(base, pport); break
PY
)

# a small pool (32 MiB per worker leave the seeded model room for little more than its longest sequence) so the bench below
# over-subscribes it: leases and extends are refused, and a running request
# whose extend is refused is rejected (not preempted)
started="$(date +%s)"
RUST_LOG=warn "$KV" up --workers 2 --base-port 0 --metrics-base-port "$mbase" --memory-budget-mib 32 \
    --threads 1 --on-exhausted reject >"$work/up.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 600); do
    grep -q '^serving' "$work/up.log" && break
    kill -0 "${pids[0]}" 2>/dev/null || { echo "kvlease up stopped"; exit 1; }
    sleep 0.5
done
grep -q '^serving' "$work/up.log" || { echo "kvlease up did not start"; exit 1; }
sched="$(sed -n 's/^  scheduler  \([0-9.:]*\).*/\1/p' "$work/up.log")"
echo "cluster: scheduler $sched, metrics on 127.0.0.1:$mbase..$((mbase + 3))"

cat >"$work/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvlease-scheduler
    static_configs: [{ targets: ["127.0.0.1:$mbase"] }]
  - job_name: kvlease-cache
    static_configs: [{ targets: ["127.0.0.1:$((mbase + 1))"] }]
  - job_name: kvlease-worker
    static_configs: [{ targets: ["127.0.0.1:$((mbase + 2))", "127.0.0.1:$((mbase + 3))"] }]
YML
"$prom" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$pport" >"$work/prometheus.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 120); do
    curl -fsS "http://127.0.0.1:$pport/-/ready" >/dev/null 2>&1 && break
    sleep 0.5
done
curl -fsS "http://127.0.0.1:$pport/-/ready" >/dev/null || { echo "prometheus did not become ready"; exit 1; }

# the first refusals come within a second of the bench's start: the bench
# waits until Prometheus has scraped all four targets once, so each counter's
# starting 0 is in the series and rate() sees the whole rise
for _ in $(seq 1 60); do
    up="$(curl -fsS "http://127.0.0.1:$pport/api/v1/query" \
        --data-urlencode 'query=count(up{job=~"kvlease-.*"} == 1)' 2>/dev/null |
        python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)' 2>/dev/null || echo 0)"
    [ "$up" = 4 ] && break
    sleep 0.5
done
[ "$up" = 4 ] || { echo "prometheus scraped $up of 4 targets in 30 s"; exit 1; }

echo "== over-subscribed bench (2 workers, 32 MiB each)"
"$KV" bench --scheduler "$sched" --requests 96 --concurrency 64 --prefixes 2 \
    --tail-max 160 --output-min 64 --output-max 128 --no-progress --fail-on-error | tail -3

python3 .ci/prometheus-check.py "http://127.0.0.1:$pport" "$KV" "$sched" deploy/grafana/kvlease.json "$started"
