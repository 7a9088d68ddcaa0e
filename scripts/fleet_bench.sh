#!/usr/bin/env bash
# KV across the fleet (issue 26, point 5): real services as plain processes
# on loopback ports, driven by `kvlease bench`, ONE markdown table on stdout.
#
#   scripts/fleet_bench.sh --bin-dir target/release                      # CPU, seeded model
#   scripts/fleet_bench.sh --bin-dir /opt/kvlease/bin --backend cuda \
#     --model /models/SmolLM2-135M-Instruct.Q4_1.gguf                    # the H200
#
# Phases (--phases, default "pull routing peer pd disk"):
#   pull     peer pull TTFT against recompute, per prompt length: one cache,
#            scheduler A over worker A (--pool-group-prefix a), scheduler B
#            over worker B (prefix b, --peer-pull, --peer-workers naming A's
#            group), one salt secret for both (the same prompt must hash
#            alike in both). Per length L: "recompute" sends --requests
#            unique prompts of L tokens (1 output token, one at a time) to B,
#            nothing cached anywhere; "pull" sends other unique prompts to A
#            (A publishes them), then the same prompts to B, which pulls the
#            prefix from A's worker. Once per --pull-modes entry: "model"
#            (the cost model decides per grant, at the --peer-* rates given,
#            or else at the rates scheduler B measures) and
#            "force" (rates that make a pull always cheaper: link 2^64-1 B/s,
#            prefill 1 token/s, overhead 0), scheduler B restarted between
#            them. B's prefix reuse in a pull run is what it pulled (B never
#            saw those prompts); a forced run that pulled nothing fails.
#   routing  (a) the Mooncake trace, one scheduler over two workers, kv-aware
#   peer     (b) the same with --peer-pull (the --peer-* rates)
#   pd       (c) disaggregated prefill/decode: worker A prefills (role
#            prefill), worker B decodes (role decode), one scheduler
#   disk     (d) (b) plus a host tier and a disk tier on each worker
# Every trace phase starts fresh services. Each row has the rejects beside
# its latencies; "vs" is TTFT p50 over the row's baseline (recompute of the
# same length; phase (a) for the trace).
#
# Flags (env fallback in brackets; defaults differ for cpu and cuda):
#   --bin-dir DIR           kvlease, kvlease-cache, kvlease-scheduler, kvlease-worker
#                           (or cache-svc, scheduler-svc, worker-svc) [FLEET_BIN_DIR; target/release]
#   --backend cpu|cuda      [FLEET_BACKEND; cpu]
#   --model PATH            GGUF file or Hugging Face directory; none: the seeded model [FLEET_MODEL]
#   --worker-args "ARGS"    more flags for every worker, word-split [FLEET_WORKER_ARGS;
#                           cpu: "--threads 1"]
#   --gpu-kv-mib N          cuda: --gpu-max-kv-mib of each worker, so two fit on one GPU
#                           [FLEET_GPU_KV_MIB; 16384]
#   --lengths "L ..."       prompt lengths of the pull phase [FLEET_LENGTHS; cpu "256 512",
#                           cuda "2048 4096 8000": 8192 + 1 output token overflows an
#                           8K-context model]
#   --requests N            prompts per length and case [FLEET_REQUESTS; cpu 4, cuda 8]
#   --pull-modes "M ..."    model, force [FLEET_PULL_MODES; "model force"]
#   --peer-link-bytes-per-s, --peer-prefill-tokens-per-s, --peer-pull-overhead-us
#                           the cost model's rates in "model" mode and in phases (b), (d)
#                           [FLEET_PEER_LINK_BYTES_PER_S, FLEET_PEER_PREFILL_TOKENS_PER_S: unset,
#                           measured by the scheduler; FLEET_PEER_PULL_OVERHEAD_US 1000]
#   --trace FILE            Mooncake-format trace [FLEET_TRACE; ../shared/traces/mooncake-synthetic.jsonl];
#                           "conversations": a multi-turn trace that `kvlease cache-trace`
#                           generates (80 sessions, seed 7, as scripts/routing-bench.sh)
#   --trace-requests N      its first N lines [FLEET_TRACE_REQUESTS; cpu 200, cuda 200]
#   --trace-scale S, --trace-max-prompt N, --trace-max-output N, --trace-concurrency N
#                           as kvlease bench's --scale, --max-prompt, --max-output,
#                           --concurrency [FLEET_TRACE_SCALE cpu 32 cuda 4, FLEET_TRACE_MAX_PROMPT
#                           cpu 384 cuda 4096, FLEET_TRACE_MAX_OUTPUT 8, FLEET_TRACE_CONCURRENCY 8]
#   --trace-worker-args "ARGS"  the trace phases' worker flags instead of --worker-args, e.g.
#                           a smaller pool so that blocks are evicted [FLEET_TRACE_WORKER_ARGS;
#                           --worker-args, on cpu plus "--memory-budget-mib 35" unless they
#                           set a budget]
#   --host-blocks N, --disk-bytes N  phase (d)'s tiers per worker [FLEET_HOST_BLOCKS 64,
#                           FLEET_DISK_BYTES 268435456]
#   --phases "P ..."        [FLEET_PHASES; "pull routing peer pd disk"]
#   --base-port P           services listen on P.. (10 ports a phase) [FLEET_BASE_PORT; 58200]
#   --up-timeout-s N        a service not serving by then fails the run [FLEET_UP_TIMEOUT_S; 180]
#   --keep DIR              keep the services' logs and bench outputs in DIR [FLEET_KEEP]
# Exit: 0 with the table; 1 when a service did not come up, a bench request
# ended in an error, a pull run pulled nothing where it must, or a recompute
# run reused anything; 64 on a usage error.
set -euo pipefail

die() { echo "fleet_bench: $*" >&2; exit 1; }
usage_error() { echo "fleet_bench: $*" >&2; exit 64; }

bin_dir=${FLEET_BIN_DIR:-target/release}
backend=${FLEET_BACKEND:-cpu}
model=${FLEET_MODEL:-}
worker_args=${FLEET_WORKER_ARGS-unset}
gpu_kv_mib=${FLEET_GPU_KV_MIB:-16384}
lengths=${FLEET_LENGTHS:-}
requests=${FLEET_REQUESTS:-}
pull_modes=${FLEET_PULL_MODES:-model force}
link=${FLEET_PEER_LINK_BYTES_PER_S:-}
prefill=${FLEET_PEER_PREFILL_TOKENS_PER_S:-}
overhead=${FLEET_PEER_PULL_OVERHEAD_US:-1000}
trace=${FLEET_TRACE:-}
trace_requests=${FLEET_TRACE_REQUESTS:-}
trace_scale=${FLEET_TRACE_SCALE:-}
trace_max_prompt=${FLEET_TRACE_MAX_PROMPT:-}
trace_max_output=${FLEET_TRACE_MAX_OUTPUT:-8}
trace_concurrency=${FLEET_TRACE_CONCURRENCY:-8}
trace_worker_args=${FLEET_TRACE_WORKER_ARGS-unset}
host_blocks=${FLEET_HOST_BLOCKS:-64}
disk_bytes=${FLEET_DISK_BYTES:-268435456}
phases=${FLEET_PHASES:-pull routing peer pd disk}
base_port=${FLEET_BASE_PORT:-58200}
up_timeout=${FLEET_UP_TIMEOUT_S:-180}
keep=${FLEET_KEEP:-}

while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || case "$1" in -h|--help) ;; *) usage_error "$1 needs a value" ;; esac
  case "$1" in
    --bin-dir) bin_dir=$2 ;;
    --backend) backend=$2 ;;
    --model) model=$2 ;;
    --worker-args) worker_args=$2 ;;
    --gpu-kv-mib) gpu_kv_mib=$2 ;;
    --lengths) lengths=$2 ;;
    --requests) requests=$2 ;;
    --pull-modes) pull_modes=$2 ;;
    --peer-link-bytes-per-s) link=$2 ;;
    --peer-prefill-tokens-per-s) prefill=$2 ;;
    --peer-pull-overhead-us) overhead=$2 ;;
    --trace) trace=$2 ;;
    --trace-requests) trace_requests=$2 ;;
    --trace-scale) trace_scale=$2 ;;
    --trace-max-prompt) trace_max_prompt=$2 ;;
    --trace-max-output) trace_max_output=$2 ;;
    --trace-concurrency) trace_concurrency=$2 ;;
    --trace-worker-args) trace_worker_args=$2 ;;
    --host-blocks) host_blocks=$2 ;;
    --disk-bytes) disk_bytes=$2 ;;
    --phases) phases=$2 ;;
    --base-port) base_port=$2 ;;
    --up-timeout-s) up_timeout=$2 ;;
    --keep) keep=$2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown flag $1 (--help lists them)" ;;
  esac
  shift 2
done

case "$backend" in
  cpu)
    : "${lengths:=256 512}" "${requests:=4}" "${trace_requests:=200}" "${trace_scale:=32}"
    : "${trace_max_prompt:=384}"
    [ "$worker_args" = unset ] && worker_args="--threads 1"
    if [ "$trace_worker_args" = unset ]; then
      trace_worker_args=$worker_args
      [[ "$worker_args" == *--memory-budget-mib* ]] || trace_worker_args+=" --memory-budget-mib 35"
    fi
    ;;
  cuda)
    : "${lengths:=2048 4096 8000}" "${requests:=8}" "${trace_requests:=200}" "${trace_scale:=4}"
    : "${trace_max_prompt:=4096}"
    [ "$worker_args" = unset ] && worker_args=""
    [ "$trace_worker_args" = unset ] && trace_worker_args=$worker_args
    ;;
  *) usage_error "--backend is cpu or cuda, not $backend" ;;
esac
for n in "$requests" "$trace_requests" "$trace_scale" "$trace_max_prompt" "$trace_max_output" \
  "$trace_concurrency" "$host_blocks" "$disk_bytes" "$base_port" "$up_timeout" "$gpu_kv_mib" \
  "${link:-0}" "${prefill:-0}" "$overhead" $lengths; do
  [[ "$n" =~ ^[0-9]+$ ]] || usage_error "not a whole number: $n"
done
for m in $pull_modes; do
  case "$m" in model|force) ;; *) usage_error "--pull-modes takes model and force, not $m" ;; esac
done
for p in $phases; do
  case "$p" in pull|routing|peer|pd|disk) ;; *) usage_error "unknown phase $p (pull routing peer pd disk)" ;; esac
done

# the binaries: the names cargo gives them, or the crate names
bin() {
  local b
  for b in "$@"; do
    [ -x "$bin_dir/$b" ] && { echo "$bin_dir/$b"; return; }
  done
  usage_error "no $1 in $bin_dir (--bin-dir)"
}
kvlease=$(bin kvlease)
cache_bin=$(bin kvlease-cache cache-svc)
scheduler_bin=$(bin kvlease-scheduler scheduler-svc)
worker_bin=$(bin kvlease-worker worker-svc)
if [ -z "$trace" ]; then
  trace=$(cd "$(dirname "$0")/.." && pwd)/../shared/traces/mooncake-synthetic.jsonl
fi
case " $phases " in
  *" routing "*|*" peer "*|*" disk "*)
    [ "$trace" = conversations ] || [ -f "$trace" ] || usage_error "no trace at $trace (--trace)" ;;
esac
[ -z "$model" ] || [ -e "$model" ] || usage_error "no model at $model (--model)"

# every worker's flags: backend, model, context, and what the caller adds
longest=0
for l in $lengths; do [ "$l" -gt "$longest" ] && longest=$l; done
context=$(( longest + 64 > trace_max_prompt + trace_max_output + 64 ? longest + 64 : trace_max_prompt + trace_max_output + 64 ))
[ "$context" -lt 2048 ] && context=2048
common_worker=(--backend "$backend" --max-context "$context")
[ -n "$model" ] && common_worker+=(--model "$model")
[ "$backend" = cuda ] && common_worker+=(--gpu-max-kv-mib "$gpu_kv_mib")
read -r -a extra_worker <<<"$worker_args"
read -r -a extra_trace_worker <<<"$trace_worker_args"

work=$(mktemp -d "${TMPDIR:-/tmp}/fleet-bench.XXXXXX")
head -c 32 /dev/urandom >"$work/salt.key"

# === services ===

pids=() names=()
# stops every service, the last started first (schedulers before their
# workers and the cache, so that each closes its cache session)
stop_all() {
  local i pid
  for (( i = ${#pids[@]} - 1; i >= 0; i-- )); do
    pid=${pids[$i]}
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "fleet_bench: ${names[$i]} (pid $pid) did not stop on SIGTERM within 10 s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  pids=() names=()
}
on_exit() {
  local rc=$?
  if [ -n "${bench_pid:-}" ]; then
    kill -TERM "$bench_pid" 2>/dev/null || true
    wait "$bench_pid" 2>/dev/null || true
  fi
  stop_all
  if [ -n "$keep" ]; then
    mkdir -p "$keep" && cp -r "$work"/. "$keep"/ && echo "fleet_bench: logs in $keep" >&2
  elif [ "$rc" -ne 0 ]; then
    echo "fleet_bench: failed; rerun with --keep DIR to keep every log" >&2
  fi
  rm -rf "$work"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# start NAME ADDR CMD...: runs CMD in the background (its log: NAME.log) and
# waits until ADDR answers gRPC health SERVING; dies with the log's tail if
# the process exits or the time runs out first.
start() {
  local name=$1 addr=$2; shift 2
  "$@" >"$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid") names+=("$name")
  local deadline=$(( $(date +%s) + up_timeout ))
  until "$kvlease" health "$addr" --timeout-ms 1000 >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -20 "$work/$name.log" >&2
      die "$name ($*) exited before serving on $addr"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -20 "$work/$name.log" >&2
      die "$name did not serve on $addr within ${up_timeout}s (--up-timeout-s)"
    fi
    sleep 0.2
  done
}

# stop_one NAME: stops one service started by `start`
stop_one() {
  local i
  for i in "${!names[@]}"; do
    if [ "${names[$i]}" = "$1" ]; then
      kill -TERM "${pids[$i]}" 2>/dev/null || true
      wait "${pids[$i]}" 2>/dev/null || true
      unset 'pids[i]' 'names[i]'
      pids=("${pids[@]}") names=("${names[@]}")
      return
    fi
  done
}

# port N of phase PHASE_INDEX
port() { echo $(( base_port + 10 * phase_index + $1 )); }

# cache NAME: the phase's cache service
cache() { start "$1" "127.0.0.1:$(port 0)" "$cache_bin" --listen "127.0.0.1:$(port 0)"; }

# worker NAME N [FLAGS...]: the Nth worker of the phase, with FLAGS after
# the common ones (FLAGS carry --worker-args or --trace-worker-args)
worker() {
  local name=$1 n=$2; shift 2
  start "$name" "127.0.0.1:$(port "$n")" "$worker_bin" --listen "127.0.0.1:$(port "$n")" \
    "${common_worker[@]}" "$@"
}

# scheduler NAME N WORKER_PORTS FLAGS...: the scheduler on port N over the
# workers on the comma-separated ports; waits until its status lists pools
scheduler() {
  local name=$1 n=$2 ports=$3; shift 3
  local addrs
  addrs=$(tr ',' '\n' <<<"$ports" | sed "s/^/127.0.0.1:/" | paste -sd, -)
  start "$name" "127.0.0.1:$(port "$n")" "$scheduler_bin" --listen "127.0.0.1:$(port "$n")" \
    --cache-addr "127.0.0.1:$(port 0)" --worker-addrs "$addrs" --holder "fleet-$name" \
    --salt-secret-file "$work/salt.key" "$@"
  local deadline=$(( $(date +%s) + up_timeout ))
  until "$kvlease" status --scheduler "127.0.0.1:$(port "$n")" >"$work/$name.status" 2>&1 \
    && [ -n "$(groups "$name")" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { cat "$work/$name.status" >&2; die "$name lists no pool group within ${up_timeout}s"; }
    sleep 0.2
  done
}

# groups NAME: the pool groups scheduler NAME registered, one a line
groups() { awk '/^pool group/ { on = 1; next } on && NF { print $1 }' "$work/$1.status" | sort -u; }

# === bench ===

# bench OUT SCHEDULER_PORT ARGS...: one `kvlease bench`; its output in OUT.
# A request that ended in an error fails the run.
# (In the background, so that a signal's trap runs at once, not after it.)
bench_pid=
bench() {
  local out=$1 p=$2; shift 2
  "$kvlease" bench --scheduler "127.0.0.1:$p" --no-progress --fail-on-error "$@" >"$work/$out" 2>&1 &
  bench_pid=$!
  if ! wait "$bench_pid"; then
    bench_pid=
    cat "$work/$out" >&2
    die "kvlease bench $* failed (see above)"
  fi
  bench_pid=
}

# figures OUT: "sent|ok|rejected|errors|reused|prompt|hit|p50|p90|thr|evictions" of a
# bench output; what it did not print is "-"
figures() {
  awk '
    $1 == "summary:" {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); s[kv[1]] = kv[2] }
    }
    /prefix reuse/ { reused = $3; prompt = $5 }
    /cache hit rate/ { hit = $4 }
    $1 == "cache" && $3 == "grants," { evictions = $6 }
    $1 == "TTFT" { p50 = $3; p90 = $6 }
    $1 == "throughput" { thr = $2 " " $3; sub(/,$/, "", thr) }
    function d(v) { return v == "" ? "-" : v }
    END {
      printf "%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s\n", d(s["requests"]), d(s["ok"]), d(s["rejected"]),
        d(s["errors"]), d(reused), d(prompt), d(hit), d(p50), d(p90), d(thr), d(evictions)
    }
  ' "$work/$1"
}

# row KEY PHASE CASE OUT [BASELINE_P50]: one table row of a bench output;
# the table lists rows by KEY, those of one KEY in the order they came
row() {
  local key=$1 phase=$2 case=$3 out=$4 base=${5:-}
  local sent ok rej reused prompt hit p50 p90 thr evictions
  IFS="|" read -r sent ok rej _ reused prompt hit p50 p90 thr evictions < <(figures "$out")
  local shed=- ratio=- reuse=-
  [[ "$sent" =~ ^[0-9]+$ && "$rej" =~ ^[0-9]+$ && "$sent" -gt 0 ]] \
    && shed=$(awk -v r="$rej" -v n="$sent" 'BEGIN { printf "%d (%.1f%%)", r, 100 * r / n }')
  [[ "$reused" =~ ^[0-9]+$ ]] && reuse="$reused of $prompt"
  [[ -n "$base" && "$base" != - && "$p50" != - ]] \
    && ratio=$(awk -v a="$p50" -v b="$base" 'BEGIN { printf "%.2fx", a / b }')
  printf '%s\t| %s | %s | %s of %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$key" "$phase" "$case" \
    "$ok" "$sent" "$shed" "$reuse" "$hit" "$evictions" "$(ms "$p50")" "$(ms "$p90")" "$ratio" "$thr" \
    >>"$work/rows.tsv"
}
ms() { [ "$1" = - ] && echo - || echo "$1 ms"; }
p50_of() { figures "$1" | cut -d'|' -f8; }
reused_of() { figures "$1" | cut -d'|' -f5; }
note() { echo "- $*" >>"$work/notes.md"; }

# === phases ===

# a rate not given is the scheduler's to measure (from 1 GB/s and 4,000
# tokens/s until its workers' answers say otherwise)
rates_model=(--peer-pull-overhead-us "$overhead")
[ -n "$link" ] && rates_model+=(--peer-link-bytes-per-s "$link")
[ -n "$prefill" ] && rates_model+=(--peer-prefill-tokens-per-s "$prefill")
# a pull of any size costs 1 us; computing one block >= 16 s at 1 token/s
rates_force=(--peer-link-bytes-per-s 18446744073709551615 --peer-prefill-tokens-per-s 1
  --peer-pull-overhead-us 0)

# unique L: the workload of one prompt length, unique prompts of exactly L
# tokens (`--prefixes 0`: every tail keyed by the seed and the request's
# index), 1 output token, one request at a time
unique() { uargs=(--prefixes 0 --tail-min "$1" --tail-max "$1" --output-min 1 --output-max 1 --concurrency 1); }
uargs=()

phase_pull() {
  cache pull-cache
  worker worker-a 1 "${extra_worker[@]}"
  worker worker-b 2 "${extra_worker[@]}"
  # each scheduler its own pool groups: a group's blocks live in one worker
  scheduler sched-a 3 "$(port 1)" --pool-group-prefix a
  local group_a
  group_a=$(groups sched-a)
  [ "$(wc -l <<<"$group_a")" = 1 ] || die "scheduler A registered groups I cannot tell apart: $group_a"
  # warm both paths (first passes, kernels, connections) off the record
  unique "$longest"
  bench warm-a.out "$(port 3)" "${uargs[@]}" --requests 2 --seed 9001
  local mode seed l
  local -A recompute_p50=()
  local first=1
  for mode in $pull_modes; do
    local rates=("${rates_model[@]}")
    [ "$mode" = force ] && rates=("${rates_force[@]}")
    [ $first = 1 ] || stop_one sched-b
    scheduler sched-b 4 "$(port 2)" --pool-group-prefix b --peer-pull "${rates[@]}" --peer-workers "$group_a=127.0.0.1:$(port 1)"
    unique "$longest"
    bench "warm-b-$mode.out" "$(port 4)" "${uargs[@]}" --requests 2 --seed 9002
    for l in $lengths; do
      unique "$l"
      if [ $first = 1 ]; then
        # recompute: prompts no group has seen (seed 1000+L)
        bench "recompute-$l.out" "$(port 4)" "${uargs[@]}" --requests "$requests" --seed $(( 1000 + l ))
        [ "$(reused_of "recompute-$l.out")" = 0 ] \
          || die "recompute of $l tokens reused $(reused_of "recompute-$l.out") tokens: not a recompute"
        recompute_p50[$l]=$(p50_of "recompute-$l.out")
        row "1 $(printf %08d "$l")" "peer pull" "$l tokens: recompute in B" "recompute-$l.out"
      fi
      # the same fresh prompts to A, then to B (seed 2000+L, 3000+L forced)
      seed=$(( 2000 + l ))
      [ "$mode" = force ] && seed=$(( 3000 + l ))
      bench "publish-$mode-$l.out" "$(port 3)" "${uargs[@]}" --requests "$requests" --seed "$seed"
      bench "pull-$mode-$l.out" "$(port 4)" "${uargs[@]}" --requests "$requests" --seed "$seed"
      local pulled
      pulled=$(reused_of "pull-$mode-$l.out")
      if [ "$pulled" = 0 ] || [ "$pulled" = - ]; then
        if [ "$mode" = force ]; then
          die "the forced pull of $l-token prompts pulled nothing (B reused $pulled tokens): see $work/sched-b.log"
        fi
        note "$l tokens, model rates: nothing pulled (the cost model chose to recompute at these rates)"
      fi
      row "1 $(printf %08d "$l")" "peer pull" "$l tokens: pull from A ($mode rates)" "pull-$mode-$l.out" \
        "${recompute_p50[$l]}"
    done
    first=0
  done
  note "peer pull rates, model: ${rates_model[*]} (a rate not given there is measured by scheduler B); force: ${rates_force[*]}"
  note "peer pull: $requests prompts per row, 1 output token, one request at a time; B's prefix reuse in a pull row is what it pulled from A (B never served those prompts): every full block but the one holding the last prompt token"
  stop_all
}

# trace_phase NAME LABEL SCHEDULER_FLAGS -- WORKER_FLAGS: one trace run on a
# fresh cache, two workers, one kv-aware scheduler
trace_phase() {
  local name=$1 label=$2; shift 2
  local sflags=() wflags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sflags+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  wflags=("$@")
  cache "$name-cache"
  local wa=() wb=()
  # a flag ending in "{}" names a directory of each worker's own
  local f
  for f in "${wflags[@]}"; do wa+=("${f//\{\}/$work/$name-a}"); wb+=("${f//\{\}/$work/$name-b}"); done
  case "${wflags[*]}" in *"{}"*) mkdir -p "$work/$name-a" "$work/$name-b" ;; esac
  worker "$name-worker-a" 1 "${extra_trace_worker[@]}" "${wa[@]}"
  worker "$name-worker-b" 2 "${extra_trace_worker[@]}" "${wb[@]}"
  scheduler "$name-sched" 3 "$(port 1)${role_a:-},$(port 2)${role_b:-}" --routing kv-aware "${sflags[@]}"
  bench "$name.out" "$(port 3)" --trace "$trace" --requests "$trace_requests" \
    --scale "$trace_scale" --max-prompt "$trace_max_prompt" --max-output "$trace_max_output" \
    --concurrency "$trace_concurrency"
  row "2 $label" "trace" "$label" "$name.out" "${trace_base_p50:-}"
  stop_all
}

phase_routing() {
  trace_phase routing "(a) routing only (kv-aware, 2 groups)" --
  trace_base_p50=$(p50_of routing.out)
}

phase_peer() {
  trace_phase peer "(b) + peer pull (model rates)" --peer-pull "${rates_model[@]}" --
}

# (c) Disaggregated prefill/decode: worker A prefills, worker B decodes;
# every request's prompt KV moves from A to B after its first token.
phase_pd() {
  role_a="#role=prefill" role_b="#role=decode" \
    trace_phase pd "(c) disaggregated prefill/decode (A prefills, B decodes)" --
}

phase_disk() {
  trace_phase disk "(d) + peer pull + host $host_blocks blocks + disk tier" --peer-pull "${rates_model[@]}" -- \
    --host-blocks "$host_blocks" --disk-tier-dir "{}" --disk-tier-bytes "$disk_bytes"
}

# === run ===

started=$(date +%s)
if [ "$trace" = conversations ]; then
  # returning users whose next turn repeats the whole context
  "$kvlease" cache-trace --out "$work/conversations.jsonl" --sessions 80 \
    --think-ms 2000 --arrival-gap-ms 200 --seed 7 >/dev/null
  trace=$work/conversations.jsonl
fi
: >"$work/notes.md"
{
  printf '| phase | case | ok of sent | rejected (shed) | prompt tokens reused | cache hit rate | evictions | TTFT p50 | TTFT p90 | p50 vs baseline | throughput |\n'
  printf '|---|---|---|---|---|---|---|---|---|---|---|\n'
} >"$work/table.md"
: >"$work/rows.tsv"
trace_base_p50=
phase_index=0
for p in $phases; do
  "phase_$p"
  phase_index=$(( phase_index + 1 ))
done

sort -s -t "$(printf '\t')" -k1,1 "$work/rows.tsv" | cut -f2- >>"$work/table.md"
cat "$work/table.md"
echo
case " $phases " in
  *" routing "*|*" peer "*|*" disk "*)
    note "trace: first $trace_requests requests of $(basename "$trace"), --scale $trace_scale --max-prompt $trace_max_prompt --max-output $trace_max_output --concurrency $trace_concurrency; trace workers: ${common_worker[*]} ${trace_worker_args}; baseline: (a)" ;;
esac
note "backend $backend, model ${model:-seeded}; peer pull workers: ${common_worker[*]} ${worker_args}; $(( $(date +%s) - started )) s"
cat "$work/notes.md"
