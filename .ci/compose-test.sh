#!/usr/bin/env bash
# The compose test: build the static binaries and the FROM-scratch images,
# start the cluster, drive a bench through the scheduler, restart the cache
# mid-run (the scheduler must survive, re-open its session under the new
# epoch and keep serving), stop one worker mid-run (its requests must end
# with a clear reason, the rest keep going), tear down (always).
#
# Prints one line `compose-test: PASS ...` or `compose-test: FAIL ...` last
# and exits non-zero on failure. SKIP_BUILD=1 reuses docker/bin and images.
set -uo pipefail
cd "$(dirname "$0")/.."

PROJECT="kvlease-ci-$$"
# ports away from the defaults, so a developer's `kvlease up` does not clash
export KVLEASE_SCHEDULER_PORT="${KVLEASE_SCHEDULER_PORT:-55051}"
export KVLEASE_CACHE_PORT="${KVLEASE_CACHE_PORT:-55052}"
export KVLEASE_WORKER_1_PORT="${KVLEASE_WORKER_1_PORT:-55053}"
export KVLEASE_WORKER_2_PORT="${KVLEASE_WORKER_2_PORT:-55054}"
export KVLEASE_SCHEDULER_METRICS_PORT="${KVLEASE_SCHEDULER_METRICS_PORT:-55090}"
export KVLEASE_CACHE_METRICS_PORT="${KVLEASE_CACHE_METRICS_PORT:-55091}"
export KVLEASE_WORKER_1_METRICS_PORT="${KVLEASE_WORKER_1_METRICS_PORT:-55092}"
export KVLEASE_WORKER_2_METRICS_PORT="${KVLEASE_WORKER_2_METRICS_PORT:-55093}"
export KVLEASE_HTTP_PORT="${KVLEASE_HTTP_PORT:-55080}"
SCHED="127.0.0.1:$KVLEASE_SCHEDULER_PORT"
KV=docker/bin/kvlease
LOGS="$(mktemp -d)"
FAILURES=()
NOTES=()

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose -p "$PROJECT")
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose -p "$PROJECT")
else
  echo "compose-test: FAIL: neither 'docker compose' nor 'docker-compose' is available"
  exit 1
fi

log() { echo "[compose-test $(date -u +%H:%M:%S)] $*"; }
fail() { FAILURES+=("$*"); log "FAIL: $*"; }
# the value of key=N on the summary line of a bench log
field() { sed -n "s/^summary:.* $2=\([0-9]*\).*/\1/p" "$1" | tail -1; }
epoch() { with_cert admin "$KV" status --scheduler "$SCHED" 2>/dev/null | sed -n 's/.*(epoch \([0-9]*\)).*/\1/p'; }

teardown() {
  local rc=$?
  "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1
  rm -rf "$LOGS"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

container() { "${COMPOSE[@]}" ps -q "$1" 2>/dev/null; }
health() { docker inspect --format '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$(container "$1")" 2>/dev/null; }
wait_healthy() { # service timeout_s
  local deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    [ "$(health "$1")" = healthy ] && return 0
    sleep 1
  done
  return 1
}
finish() {
  if [ ${#FAILURES[@]} -eq 0 ]; then
    local IFS=';'
    echo "compose-test: PASS (${NOTES[*]})"
    exit 0
  fi
  # the logs first, so that the verdict is the last line a CI tail shows
  log "service logs (last 40 lines each):"
  "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | sed 's/^/    /'
  local IFS=';'
  echo "compose-test: FAIL (${FAILURES[*]})"
  exit 1
}

# === build ===
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  log "building static binaries and images"
  if ! docker/build.sh --images; then
    fail "build failed"; finish
  fi
fi

# === certificates (mTLS between every service and for this script's clients) ===
export KVLEASE_CERTS="$LOGS/certs"
if ! "$KV" certs --out "$KVLEASE_CERTS" --host worker-1 --host worker-2 >/dev/null; then
  fail "kvlease certs failed"; finish
fi
# the images run as uid 65534; these throwaway keys live in this run's temporary directory
chmod a+rx "$LOGS" "$KVLEASE_CERTS" && chmod a+r "$KVLEASE_CERTS"/*
# host-side commands: `bench` as the principal client, `status` as admin (it shows the cache
# session's epoch only to admins)
with_cert() { KVLEASE_TLS_CERT="$KVLEASE_CERTS/$1.pem" KVLEASE_TLS_KEY="$KVLEASE_CERTS/$1.key" \
  KVLEASE_TLS_CA="$KVLEASE_CERTS/ca.pem" "${@:2}"; }

# === up ===
log "starting the cluster (project $PROJECT)"
if ! "${COMPOSE[@]}" up -d >"$LOGS/up.log" 2>&1; then
  cat "$LOGS/up.log"; fail "compose up failed"; finish
fi
for s in cache worker-1 worker-2 scheduler; do
  if ! wait_healthy "$s" 180; then fail "$s not healthy (state: $(health "$s"))"; finish; fi
done
log "all four services healthy"
with_cert admin "$KV" status --scheduler "$SCHED" | sed 's/^/    /'
EPOCH0="$(epoch)"
if command -v curl >/dev/null 2>&1; then
  for probe in "$KVLEASE_CACHE_METRICS_PORT:kvlease_pool_capacity_blocks" \
               "$KVLEASE_WORKER_1_METRICS_PORT:kvlease_worker_pool_capacity_blocks" \
               "$KVLEASE_SCHEDULER_METRICS_PORT:kvlease_queue_depth"; do
    port="${probe%%:*}"; metric="${probe#*:}"
    # read the whole page first: `curl | grep -q` under pipefail fails when
    # grep stops at an early match and curl gets EPIPE
    page="$(curl -fsS "http://127.0.0.1:$port/metrics" 2>&1)"
    if ! grep -q "^$metric" <<<"$page"; then
      fail "no $metric on the metrics endpoint 127.0.0.1:$port"
    fi
  done
fi

# === bench with a cache restart in the middle ===
log "bench 1 (cache restarted mid-run)"
with_cert client "$KV" bench --scheduler "$SCHED" --requests 120 --concurrency 8 --output-max 24 \
  --timeout-s 90 --no-progress >"$LOGS/bench1.log" 2>&1 &
BENCH=$!
sleep 4
log "restarting the cache container"
"${COMPOSE[@]}" restart cache >/dev/null 2>&1 || fail "compose restart cache failed"
wait "$BENCH"; rc=$?
sed 's/^/    /' "$LOGS/bench1.log"
[ "$rc" -eq 0 ] || fail "bench 1 exited $rc"
[ "$(field "$LOGS/bench1.log" ok)" -gt 0 ] 2>/dev/null || fail "bench 1 completed no request"
wait_healthy cache 60 || fail "cache not healthy after its restart"

# the scheduler must notice the new epoch and re-open its session
deadline=$((SECONDS + 40)); EPOCH1=""
while [ $SECONDS -lt $deadline ]; do
  EPOCH1="$(epoch)"
  if [ -n "$EPOCH1" ] && [ "$EPOCH1" != "$EPOCH0" ]; then break; fi
  sleep 1
done
if [ -z "$EPOCH1" ] || [ "$EPOCH1" = "$EPOCH0" ]; then
  fail "the scheduler did not re-open its cache session after the restart (epoch before '$EPOCH0', now '$EPOCH1')"
else
  NOTES+=("cache epoch $EPOCH0 -> $EPOCH1")
fi
[ "$(health scheduler)" = healthy ] || fail "scheduler unhealthy after the cache restart"

log "bench 2 (after the cache restart)"
with_cert client "$KV" bench --scheduler "$SCHED" --requests 24 --concurrency 6 --output-max 16 \
  --timeout-s 60 --no-progress >"$LOGS/bench2.log" 2>&1
sed 's/^/    /' "$LOGS/bench2.log"
ok2="$(field "$LOGS/bench2.log" ok)"
if [ "${ok2:-0}" != 24 ]; then
  fail "after the cache restart only ${ok2:-0} of 24 requests completed"
else
  NOTES+=("24/24 served after the cache restart")
fi

# === stop one worker in the middle of a bench ===
log "bench 3 (worker-2 stopped mid-run)"
with_cert client "$KV" bench --scheduler "$SCHED" --requests 120 --concurrency 12 --output-min 48 --output-max 96 \
  --timeout-s 90 --no-progress >"$LOGS/bench3.log" 2>&1 &
BENCH=$!
sleep 4
log "stopping worker-2"
"${COMPOSE[@]}" stop worker-2 >/dev/null 2>&1 || fail "compose stop worker-2 failed"
wait "$BENCH"; rc=$?
sed 's/^/    /' "$LOGS/bench3.log"
[ "$rc" -eq 0 ] || fail "bench 3 exited $rc"
ok3="$(field "$LOGS/bench3.log" ok)"; err3="$(field "$LOGS/bench3.log" errors)"
[ "${ok3:-0}" -gt 0 ] || fail "no request completed while a worker stopped"
# an ended request must say why: no timeouts, no empty messages
if grep '^summary:' "$LOGS/bench3.log" | grep -qE 'timed out|no finish reason|error_reasons="(:|.*,:)'; then
  fail "some requests on the stopped worker ended without a clear reason"
fi
NOTES+=("worker-2 stopped: ${ok3:-0} ok, ${err3:-0} ended with a reason")
[ "$(health scheduler)" = healthy ] || fail "scheduler unhealthy after a worker stopped"

log "bench 4 (one worker left)"
with_cert client "$KV" bench --scheduler "$SCHED" --requests 16 --concurrency 4 --output-max 16 \
  --timeout-s 60 --no-progress >"$LOGS/bench4.log" 2>&1
sed 's/^/    /' "$LOGS/bench4.log"
ok4="$(field "$LOGS/bench4.log" ok)"
if [ "${ok4:-0}" != 16 ]; then
  fail "with worker-2 stopped only ${ok4:-0} of 16 new requests completed: the scheduler still routes new requests to the stopped worker"
else
  NOTES+=("16/16 served by the remaining worker")
fi

finish
