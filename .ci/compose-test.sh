#!/usr/bin/env bash
# The compose test: build the static binaries and the FROM-scratch images,
# start the cluster with two schedulers on one cache (profile
# two-schedulers: scheduler with worker-1 and worker-2, scheduler-2 with
# worker-3), and drive benches through faults, one case at a time:
#   (c) the cache killed (docker kill) and started again mid-bench: both
#       schedulers re-open their sessions under the new epoch and serve;
#   (a) the cache cut off the network for longer than the schedulers'
#       session TTL mid-bench, then reconnected: each opens a new session,
#       its live requests recomputed (--on-cache-restart);
#   (b) worker-2 cut off the network mid-forward: its requests are requeued
#       on worker-1; reconnected, it serves again;
#   (d) scheduler-2 killed (docker kill) while both serve: the scheduler
#       keeps serving, scheduler-2's blocks return at its session's TTL, and
#       started again it serves;
#   then worker-2 stopped mid-bench (its requests end with a clear reason);
#   (p) disaggregated serving (profile disaggregated: scheduler-pd over
#       worker-prefill and worker-decode): a bench served whole, then
#       worker-decode killed (docker kill) mid-bench, its requests answered
#       (served, or ended with their reason), and started again it serves.
# COMPOSE_STAGES picks the stages to run: `faults` (cases c, a, b, d, e)
# and `disaggregated` (case p); both by default.
# Each case: every request ends with an answer (the bench's summary counts:
# no call that timed out or failed without one), and afterwards every pool
# is whole and the cache's leak audit reclaims nothing (`kvlease audit
# --whole`, run as admin inside the cache container). Tear down always.
#
# Prints one line `compose-test: PASS ...` or `compose-test: FAIL ...` last
# and exits non-zero on failure. SKIP_BUILD=1 reuses docker/bin and images.
set -uo pipefail
cd "$(dirname "$0")/.."

PROJECT="${KVLEASE_COMPOSE_PROJECT:-kvlease-ci-$$}"
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
export KVLEASE_WORKER_3_PORT="${KVLEASE_WORKER_3_PORT:-55055}"
export KVLEASE_SCHEDULER_2_PORT="${KVLEASE_SCHEDULER_2_PORT:-55056}"
export KVLEASE_WORKER_3_METRICS_PORT="${KVLEASE_WORKER_3_METRICS_PORT:-55094}"
export KVLEASE_SCHEDULER_2_METRICS_PORT="${KVLEASE_SCHEDULER_2_METRICS_PORT:-55095}"
export KVLEASE_WORKER_PREFILL_PORT="${KVLEASE_WORKER_PREFILL_PORT:-55058}"
export KVLEASE_WORKER_DECODE_PORT="${KVLEASE_WORKER_DECODE_PORT:-55059}"
export KVLEASE_SCHEDULER_PD_PORT="${KVLEASE_SCHEDULER_PD_PORT:-55057}"
export KVLEASE_WORKER_PREFILL_METRICS_PORT="${KVLEASE_WORKER_PREFILL_METRICS_PORT:-55096}"
export KVLEASE_WORKER_DECODE_METRICS_PORT="${KVLEASE_WORKER_DECODE_METRICS_PORT:-55097}"
export KVLEASE_SCHEDULER_PD_METRICS_PORT="${KVLEASE_SCHEDULER_PD_METRICS_PORT:-55098}"
# short session TTLs and timeouts, so that the fault cases take seconds
export KVLEASE_SCHEDULER_SESSION_TTL_MS="${KVLEASE_SCHEDULER_SESSION_TTL_MS:-2000}"
export KVLEASE_SCHEDULER_CACHE_TIMEOUT_MS="${KVLEASE_SCHEDULER_CACHE_TIMEOUT_MS:-1000}"
export KVLEASE_SCHEDULER_WORKER_KEEPALIVE_MS="${KVLEASE_SCHEDULER_WORKER_KEEPALIVE_MS:-500}"
TTL_S=$(( (KVLEASE_SCHEDULER_SESSION_TTL_MS + 999) / 1000 ))
SCHED="127.0.0.1:$KVLEASE_SCHEDULER_PORT"
SCHED2="127.0.0.1:$KVLEASE_SCHEDULER_2_PORT"
SCHEDPD="127.0.0.1:$KVLEASE_SCHEDULER_PD_PORT"
STAGES=" ${COMPOSE_STAGES:-faults disaggregated} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
KV=docker/bin/kvlease
LOGS="$(mktemp -d)"
FAILURES=()
NOTES=()

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose -p "$PROJECT" --profile two-schedulers --profile disaggregated)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose -p "$PROJECT" --profile two-schedulers --profile disaggregated)
else
  echo "compose-test: FAIL: neither 'docker compose' nor 'docker-compose' is available"
  exit 1
fi

log() { echo "[compose-test $(date -u +%H:%M:%S)] $*"; }
fail() { FAILURES+=("$*"); log "FAIL: $*"; }
# the value of key=N on the summary line of a bench log
field() { sed -n "s/^summary:.* $2=\([0-9]*\).*/\1/p" "$1" | tail -1; }
# a scheduler's cache session: `ID EPOCH` (the default scheduler, or $1)
session() { with_cert admin "$KV" status --scheduler "${1:-$SCHED}" 2>/dev/null | sed -n 's/^cache session \([0-9]*\) (epoch \([0-9]*\)).*/\1 \2/p'; }
epoch() { session "$@" | cut -d' ' -f2; }

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
if ! "$KV" certs --out "$KVLEASE_CERTS" --host worker-1 --host worker-2 --host worker-3 \
    --host worker-prefill --host worker-decode >/dev/null; then
  fail "kvlease certs failed"; finish
fi
# the images run as uid 65534; these throwaway keys live in this run's temporary directory
chmod a+rx "$LOGS" "$KVLEASE_CERTS" && chmod a+r "$KVLEASE_CERTS"/*
# host-side commands: `bench` as the principal client, `status` as admin (it shows the cache
# session's epoch only to admins)
with_cert() { KVLEASE_TLS_CERT="$KVLEASE_CERTS/$1.pem" KVLEASE_TLS_KEY="$KVLEASE_CERTS/$1.key" \
  KVLEASE_TLS_CA="$KVLEASE_CERTS/ca.pem" "${@:2}"; }

# === helpers of the fault cases ===
# bench NAME SCHEDULER ARGS...: a bench through SCHEDULER, its output in $LOGS/NAME.log
bench() {
  local name="$1" sched="$2"; shift 2
  with_cert client "$KV" bench --scheduler "$sched" --no-progress "$@" >"$LOGS/$name.log" 2>&1
}
# answered NAME N: all N requests of bench NAME ended with an answer from the
# scheduler (finished, rejected, cancelled or ended with its error message),
# none with a call that timed out or failed without one. A request that
# arrives while the scheduler knows the cache is unreachable is refused at
# once with its own UNAVAILABLE message (the documented fail-fast, tested in
# integration-tests/tests/lifecycle.rs): that is an answer.
REFUSED_ON_ARRIVAL='Unavailable: cache service unavailable: the cache service cannot be reached; try again later'
answered() {
  local log="$LOGS/$1.log" n="$2" total=0 k v
  sed 's/^/    /' "$log"
  for k in ok rejected cancelled errors; do v="$(field "$log" "$k")"; total=$((total + ${v:-0})); done
  if [ "$(field "$log" requests)" != "$n" ] || [ "$total" != "$n" ]; then
    fail "$1: $total of $n requests ended with an answer"
  elif grep '^summary:' "$log" | sed "s/$REFUSED_ON_ARRIVAL//g" \
      | grep -qE 'timed out after|no finish reason|(Unavailable|Unknown|Internal|DeadlineExceeded|Cancelled): '; then
    fail "$1: some requests ended without an answer from the scheduler ($(sed -n 's/^summary:.* error_reasons=//p' "$log" | tail -1))"
  fi
}
# all_ok NAME N: all N requests of bench NAME completed
all_ok() {
  answered "$1" "$2"
  local ok; ok="$(field "$LOGS/$1.log" ok)"
  [ "${ok:-0}" = "$2" ] || fail "$1: only ${ok:-0} of $2 requests completed"
}
# audit: `kvlease audit --whole` as admin inside the cache container (whatever
# the network does to the published port): every pool whole, nothing leaked
audit() {
  docker exec -e KVLEASE_TLS_CERT=/certs/admin.pem -e KVLEASE_TLS_KEY=/certs/admin.key \
    -e KVLEASE_TLS_CA=/certs/ca.pem "$(container cache)" \
    /usr/local/bin/kvlease audit --whole --cache 127.0.0.1:50052 >"$LOGS/audit.log" 2>&1
}
# sound WHEN: the audit passes within 15 s (fences free at the next step)
sound() {
  local deadline=$((SECONDS + 15))
  until audit; do
    if [ $SECONDS -ge $deadline ]; then
      sed 's/^/    /' "$LOGS/audit.log"
      fail "$1: pools not whole or the audit reclaimed blocks"
      return 1
    fi
    sleep 1
  done
  sed -n 's/^audit  *//p' "$LOGS/audit.log" | sed "s/^/    $1: audit /"
}
# wait_session SCHEDULER BEFORE: waits (40 s) until SCHEDULER holds a session other than BEFORE
wait_session() {
  local deadline=$((SECONDS + 40)) now=""
  while [ $SECONDS -lt $deadline ]; do
    now="$(session "$1")"
    if [ -n "$now" ] && [ "$now" != "$2" ]; then echo "$now"; return 0; fi
    sleep 1
  done
  return 1
}
network_of() { docker inspect --format '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$(container "$1")" | awk '{print $1}'; }
preemptions() { with_cert admin "$KV" status --scheduler "${1:-$SCHED}" 2>/dev/null | sed -n 's/.*; preemptions \([0-9]*\).*/\1/p'; }

# === up ===
log "starting the cluster (project $PROJECT)"
if ! "${COMPOSE[@]}" up -d >"$LOGS/up.log" 2>&1; then
  cat "$LOGS/up.log"; fail "compose up failed"; finish
fi
for s in cache worker-1 worker-2 worker-3 scheduler scheduler-2 worker-prefill worker-decode scheduler-pd; do
  if ! wait_healthy "$s" 180; then fail "$s not healthy (state: $(health "$s"))"; finish; fi
done
log "all services healthy: two schedulers on one cache"
with_cert admin "$KV" status --scheduler "$SCHED" | sed 's/^/    /'
with_cert admin "$KV" status --scheduler "$SCHED2" | sed 's/^/    /'
sound "at start" || finish
NET="$(network_of cache)"
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

# === (p) disaggregated serving: worker-decode killed mid-transfer ===
if stage disaggregated; then
log "case p: scheduler-pd (worker-prefill, worker-decode); worker-decode killed mid-bench"
with_cert admin "$KV" status --scheduler "$SCHEDPD" | sed 's/^/    /'
decoded() { curl -fsS "http://127.0.0.1:$KVLEASE_WORKER_DECODE_METRICS_PORT/metrics" 2>/dev/null \
  | sed -n 's/^kvlease_worker_forward_tokens_total \([0-9.e+]*\).*/\1/p' | awk '{ print int($1) }'; }
T0="$(decoded)"
bench p1 "$SCHEDPD" --requests 16 --concurrency 4 --output-max 24 --timeout-s 60
all_ok p1 16
T1="$(decoded)"
[ "${T1:-0}" -gt "${T0:-0}" ] || fail "p1: worker-decode computed nothing (forward tokens ${T0:-?} -> ${T1:-?})"
sound "after p1 (disaggregated)"
# long outputs, so that the kill lands while KV moves and sequences decode
P0="$(preemptions "$SCHEDPD")"
bench p2 "$SCHEDPD" --requests 24 --concurrency 8 --output-min 96 --output-max 128 --timeout-s 120 &
P2=$!
# the kill lands once the decode worker is under way (a fixed second was
# after the whole bench on an idle machine: it takes about one)
for _ in $(seq 100); do
  [ "$(decoded)" -gt $(( ${T1:-0} + 100 )) ] 2>/dev/null && break
  sleep 0.05
done
docker kill "$(container worker-decode)" >/dev/null || fail "docker kill worker-decode failed"
wait "$P2"
answered p2 24
P1="$(preemptions "$SCHEDPD")"
if [ "$(field "$LOGS/p2.log" ok)" = 24 ] && [ "${P1:-0}" = "${P0:-0}" ]; then
  fail "p2: every request completed untouched: the kill came after the bench"
fi
sound "after worker-decode was killed"
"${COMPOSE[@]}" start worker-decode >/dev/null 2>&1 || fail "compose start worker-decode failed"
if wait_healthy worker-decode 90; then
  bench p3 "$SCHEDPD" --requests 16 --concurrency 4 --output-max 16 --timeout-s 90
  answered p3 16
  sound "after worker-decode came back"
  NOTES+=("disaggregated: p1 16/16 ok (decode worker ${T0:-?} -> ${T1:-?} tokens), worker-decode killed: p2 $(field "$LOGS/p2.log" ok)/24 ok, $(field "$LOGS/p2.log" errors) errors, $(( ${P1:-0} - ${P0:-0} )) requeued; back: p3 $(field "$LOGS/p3.log" ok)/16 ok")
else
  fail "worker-decode not healthy after its restart"
fi
fi

if stage faults; then
# === (c) the cache killed and started again mid-bench: a new epoch ===
log "case c: docker kill of the cache mid-bench, then started again"
S1="$(session)"; S2="$(session "$SCHED2")"
bench c1 "$SCHED" --requests 60 --concurrency 8 --output-max 24 --timeout-s 60 &
C1=$!
bench c2 "$SCHED2" --requests 20 --concurrency 4 --output-max 24 --timeout-s 60 &
C2=$!
sleep 3
docker kill "$(container cache)" >/dev/null || fail "docker kill cache failed"
"${COMPOSE[@]}" start cache >/dev/null 2>&1 || fail "compose start cache failed"
wait "$C1"; wait "$C2"
answered c1 60; answered c2 20
wait_healthy cache 60 || fail "cache not healthy after it was killed"
if N1="$(wait_session "$SCHED" "$S1")" && N2="$(wait_session "$SCHED2" "$S2")"; then
  [ "${N1#* }" != "${S1#* }" ] || fail "the cache kept its epoch ${S1#* } after a kill"
  NOTES+=("cache killed: epoch ${S1#* } -> ${N1#* }, both schedulers re-opened")
else
  fail "a scheduler did not re-open its cache session after the kill ('$S1' -> '$(session)', '$S2' -> '$(session "$SCHED2")')"
fi
bench c3 "$SCHED" --requests 16 --concurrency 4 --output-max 16 --timeout-s 60
all_ok c3 16
sound "after the cache kill"

# === (a) the cache cut off for longer than the session TTL mid-bench ===
log "case a: the cache off the network for $((2 * TTL_S + 1)) s (session TTL ${TTL_S} s) mid-bench"
S1="$(session)"; S2="$(session "$SCHED2")"
bench a1 "$SCHED" --requests 60 --concurrency 8 --output-min 32 --output-max 64 --timeout-s 90 &
A1=$!
sleep 1
docker network disconnect "$NET" "$(container cache)" || fail "network disconnect of the cache failed"
sleep $((2 * TTL_S + 1))
docker network connect --alias cache "$NET" "$(container cache)" || fail "network connect of the cache failed"
wait "$A1"
answered a1 60
if N1="$(wait_session "$SCHED" "$S1")" && N2="$(wait_session "$SCHED2" "$S2")"; then
  NOTES+=("cache partitioned past the TTL: new sessions, a1 $(field "$LOGS/a1.log" ok)/60 ok, the rest answered")
else
  fail "a scheduler kept its expired session after the partition ('$S1', '$S2')"
fi
bench a2 "$SCHED" --requests 8 --concurrency 4 --output-max 16 --timeout-s 60
all_ok a2 8
sound "after the cache partition"

# === (b) worker-2 cut off mid-forward ===
log "case b: worker-2 off the network mid-forward"
P0="$(preemptions)"
bench b1 "$SCHED" --requests 40 --concurrency 8 --output-min 48 --output-max 96 --timeout-s 90 &
B1=$!
sleep 3
docker network disconnect "$NET" "$(container worker-2)" || fail "network disconnect of worker-2 failed"
wait "$B1"
answered b1 40
NOTES+=("worker-2 partitioned: b1 $(field "$LOGS/b1.log" ok)/40 ok, $(( $(preemptions) - P0 )) requeued")
docker network connect --alias worker-2 "$NET" "$(container worker-2)" || fail "network connect of worker-2 failed"
sound "after the worker partition"
bench b2 "$SCHED" --requests 16 --concurrency 4 --output-max 16 --timeout-s 60
all_ok b2 16

# === (d) one of two schedulers killed while both serve ===
log "case d: docker kill of scheduler-2 while both schedulers serve"
bench d1 "$SCHED" --requests 40 --concurrency 6 --output-max 24 --timeout-s 60 &
D1=$!
bench d2 "$SCHED2" --requests 40 --concurrency 6 --output-min 48 --output-max 96 --timeout-s 30 &
D2=$!
sleep 2
# the blocks scheduler-2's pools have in use or fenced (its status: pool group in column 1)
HELD="$(with_cert admin "$KV" status --scheduler "$SCHED2" 2>/dev/null | awk '$1 ~ /^scheduler-2\// { n += $7 + $8 } END { print n + 0 }')"
docker kill "$(container scheduler-2)" >/dev/null || fail "docker kill scheduler-2 failed"
KILLED=$SECONDS
wait "$D1"; wait "$D2"
all_ok d1 40
grep '^summary:' "$LOGS/d2.log" | sed 's/^/    d2 (scheduler-2, killed): /'
# the dead scheduler's session expires TTL after its last call
sleep $(( TTL_S + 1 - (SECONDS - KILLED) > 0 ? TTL_S + 1 - (SECONDS - KILLED) : 0 ))
sound "after scheduler-2's TTL" && NOTES+=("scheduler-2 killed holding $HELD blocks: scheduler served d1 40/40, pools whole at the TTL")
"${COMPOSE[@]}" start scheduler-2 >/dev/null 2>&1 || fail "compose start scheduler-2 failed"
if wait_healthy scheduler-2 90; then
  bench d3 "$SCHED2" --requests 8 --concurrency 4 --output-max 16 --timeout-s 60
  all_ok d3 8
  sound "after scheduler-2 restarted"
else
  fail "scheduler-2 not healthy after its restart"
fi

# === stop one worker in the middle of a bench ===
log "bench e1 (worker-2 stopped mid-run)"
bench e1 "$SCHED" --requests 60 --concurrency 12 --output-min 48 --output-max 96 --timeout-s 90 &
E1=$!
sleep 3
log "stopping worker-2"
"${COMPOSE[@]}" stop worker-2 >/dev/null 2>&1 || fail "compose stop worker-2 failed"
wait "$E1"
answered e1 60
ok3="$(field "$LOGS/e1.log" ok)"; err3="$(field "$LOGS/e1.log" errors)"
[ "${ok3:-0}" -gt 0 ] || fail "no request completed while a worker stopped"
# an ended request must say why: no empty messages
if grep '^summary:' "$LOGS/e1.log" | grep -qE 'error_reasons="(:|.*,:)'; then
  fail "some requests on the stopped worker ended without a clear reason"
fi
NOTES+=("worker-2 stopped: ${ok3:-0} ok, ${err3:-0} ended with a reason")
[ "$(health scheduler)" = healthy ] || fail "scheduler unhealthy after a worker stopped"

log "bench e2 (one worker left)"
bench e2 "$SCHED" --requests 16 --concurrency 4 --output-max 16 --timeout-s 60
if [ "$(field "$LOGS/e2.log" ok)" != 16 ]; then
  sed 's/^/    /' "$LOGS/e2.log"
  fail "with worker-2 stopped only $(field "$LOGS/e2.log" ok) of 16 new requests completed: the scheduler still routes new requests to the stopped worker"
else
  NOTES+=("16/16 served by the remaining worker")
fi
fi
sound "at the end"

finish
