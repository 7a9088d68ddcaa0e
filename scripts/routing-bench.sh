#!/usr/bin/env bash
# Routing bench (issue 16, part 1): `kvlease up --workers N` for N = 1, 2, 4
# replicas of EQUAL TOTAL KV capacity, each with --routing least-committed
# and kv-aware, driven by `kvlease bench` over two traces:
#   - mooncake: ../shared/traces/mooncake-synthetic.jsonl (the first
#     --requests lines, prompts cut to --max-prompt tokens);
#   - conversations: a generated multi-turn trace (`kvlease cache-trace`).
# Prints one table: trace, replicas, policy, KV blocks (all replicas, per
# window pool), hit rate (prefix-reuse tokens / prompt tokens of the bench's
# requests, as `kvlease bench` reports it; the scheduler's warm-up leases are
# not bench requests and are excluded), TTFT p50/p90, throughput, and the
# load balance (max / mean of the sequences each replica's pools granted).
#
# Equal total capacity: a worker's memory budget holds its weights and
# activations (26.7 MiB for the seeded model at its default batch, the same
# at every N) plus its KV pools (32 blocks a MiB in each of its 2 pools), and
# budgets are whole MiB, so --budgets gives each N the budget whose total
# comes closest: 1 x 44 MiB = 554 blocks, 2 x 35 = 532 (-4%), 4 x 31 = 552 a
# pool. The table's "KV blocks" column shows what came out.
#
# Sized for a 2-core machine: the whole table in well under 15 minutes
# (--requests 200 of each trace, prompts cut to 384 tokens, outputs of at
# most 8 tokens; the debug build of kvlease serves, its worker and cache
# crates are optimised even there).
#
#   scripts/routing-bench.sh                       # release build of kvlease
#   KVLEASE_BIN=target/debug/kvlease scripts/routing-bench.sh --requests 40
#   (from a checkout beside ../shared: --trace picks another file)
#
# Targets (issue 16; README "Routing across replicas"), at the largest
# replica count run, on each trace: kv-aware keeps >= 0.9x the hit rate of the
# single pool (the better of the 1-replica rows), beats least-committed on
# TTFT p50 and p90, and no replica takes more than 1.5x the mean load. After
# the table the script judges them, a line per target, and exits 1 on a miss
# or on a target it cannot judge (a figure the bench did not print, or a run
# without 1 replica and both policies).
#   --check-table FILE  judge a table this script printed before (no run)
# A figure the bench did not print is "-" in the table, never filled in.
set -euo pipefail

# check_table FILE: the targets above against the table rows in FILE.
check_table() {
  awk -F'|' '
    function num(v) { gsub(/ |%|ms|req\/s/, "", v); return v }
    function known(v) { return v != "" && v != "-" }
    NF >= 11 && $3 ~ /^ *[0-9]+ *$/ {
      for (i = 2; i <= 10; i++) gsub(/^ +| +$/, "", $i)
      t = $2; n = $3 + 0; p = $4
      if (!(t in most)) order[++ntraces] = t
      if (n > most[t]) most[t] = n
      key = t SUBSEP n SUBSEP p; seen[key] = 1
      hit[key] = $6; p50[key] = $7; p90[key] = $8; load[key] = $10
    }
    function miss(what) { printf "MISSED %s\n", what; failed = 1 }
    function met(what) { printf "met    %s\n", what }
    END {
      if (ntraces == 0) { print "no table rows to check"; exit 1 }
      for (k = 1; k <= ntraces; k++) {
        t = order[k]
        n = most[t]; kv = t SUBSEP n SUBSEP "kv-aware"; lc = t SUBSEP n SUBSEP "least-committed"
        if (n < 2 || !(kv in seen) || !(lc in seen)) {
          miss(t ": no run of both policies on more than one replica"); continue
        }
        best = ""
        split("kv-aware least-committed", pols, " ")
        for (i = 1; i <= 2; i++) {
          one = t SUBSEP 1 SUBSEP pols[i]
          if ((one in seen) && known(hit[one]) && (best == "" || num(hit[one]) + 0 > best + 0)) best = num(hit[one])
        }
        if (best == "") miss(t ": no single-pool hit rate (run --replicas 1 too)")
        else if (!known(hit[kv])) miss(t ": no kv-aware hit rate at " n " replicas")
        else {
          what = sprintf("%s: kv-aware hit rate at %d replicas %s%% vs single pool %s%% (%.3fx, target >= 0.9x)", t, n, num(hit[kv]), best, best > 0 ? num(hit[kv]) / best : 1)
          if (best > 0 && num(hit[kv]) / best < 0.9) miss(what); else met(what)
        }
        split("p50 p90", qs, " ")
        for (i = 1; i <= 2; i++) {
          q = qs[i]; a = (q == "p50") ? p50[kv] : p90[kv]; b = (q == "p50") ? p50[lc] : p90[lc]
          if (!known(a) || !known(b)) { miss(t ": no TTFT " q " for both policies at " n " replicas"); continue }
          what = sprintf("%s: TTFT %s at %d replicas kv-aware %s ms vs least-committed %s ms (target: lower)", t, q, n, num(a), num(b))
          if (num(a) + 0 < num(b) + 0) met(what); else miss(what)
        }
        if (!known(load[kv])) miss(t ": no replica load line for kv-aware at " n " replicas")
        else {
          what = sprintf("%s: kv-aware max/mean load at %d replicas %s (target <= 1.5)", t, n, load[kv])
          if (load[kv] + 0 <= 1.5) met(what); else miss(what)
        }
      }
      exit failed
    }
  ' "$1"
}

kvlease=${KVLEASE_BIN:-target/release/kvlease}
trace=${TRACE:-../shared/traces/mooncake-synthetic.jsonl}
requests=200 max_prompt=384 max_output=8 concurrency=8 port=57051
budgets="1:44 2:35 4:31" replicas="1 2 4" policies="least-committed kv-aware"
max_context=512 sessions=80 weight=8 traces="mooncake conversations"
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --max-prompt) max_prompt=$2; shift 2 ;;
    --max-output) max_output=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --budgets) budgets=$2; shift 2 ;;
    --max-context) max_context=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;;
    --sessions) sessions=$2; shift 2 ;;
    --prefill-weight) weight=$2; shift 2 ;;
    --traces) traces=$2; shift 2 ;;
    --trace) trace=$2; shift 2 ;;
    --check-table) check_table "$2"; exit ;;
    *) echo "routing-bench: unknown flag $1" >&2; exit 64 ;;
  esac
done
[ -x "$kvlease" ] || { echo "routing-bench: no kvlease binary at $kvlease (cargo build --release -p kvlease)" >&2; exit 64; }
[ -f "$trace" ] || { echo "routing-bench: no trace at $trace" >&2; exit 64; }

work=$(mktemp -d)
up_pid=
cleanup() {
  if [ -n "$up_pid" ]; then kill "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# conversations: returning users whose next turn repeats the whole context
"$kvlease" cache-trace --out "$work/conversations.jsonl" --sessions "$sessions" \
  --think-ms 2000 --arrival-gap-ms 200 --seed 7 >/dev/null

# one run: prints "blocks|hit|ttft50|ttft90|thr|balance"
run() {
  local file=$1 n=$2 policy=$3
  local budget
  budget=$(tr ' ' '\n' <<<"$budgets" | awk -F: -v n="$n" '$1 == n { print $2 }')
  [ -n "$budget" ] || { echo "routing-bench: no budget for $n workers in --budgets" >&2; exit 64; }
  "$kvlease" up --workers "$n" --base-port "$port" --metrics-base-port 0 \
    --memory-budget-mib "$budget" --max-context "$max_context" --routing "$policy" --routing-prefill-weight "$weight" --threads 1 \
    >"$work/up.log" 2>&1 &
  up_pid=$!
  local ok=0
  for _ in $(seq 1 600); do
    if "$kvlease" health "127.0.0.1:$port" --timeout-ms 500 >/dev/null 2>&1 \
      && "$kvlease" status --scheduler "127.0.0.1:$port" 2>/dev/null | grep -q replica; then
      ok=1; break
    fi
    sleep 0.2
  done
  [ $ok = 1 ] || { echo "routing-bench: the cluster did not come up:" >&2; tail -20 "$work/up.log" >&2; exit 1; }
  local blocks
  blocks=$("$kvlease" status --scheduler "127.0.0.1:$port" \
    | awk '$1 ~ /replica/ && $3 == 0 { total += $4 } END { print total }')
  "$kvlease" bench --scheduler "127.0.0.1:$port" --trace "$file" --requests "$requests" \
    --max-prompt "$max_prompt" --max-output "$max_output" --concurrency "$concurrency" \
    --no-progress >"$work/bench.txt" 2>&1 || { cat "$work/bench.txt" >&2; exit 1; }
  kill "$up_pid"; wait "$up_pid" 2>/dev/null || true; up_pid=
  awk -v blocks="$blocks" '
    /prefix reuse/ { for (i = 1; i <= NF; i++) if ($i ~ /%\)$/) { hit = $i; gsub(/[()]/, "", hit) } }
    $1 == "TTFT" { p50 = $3 " " $4; p90 = $6 " " $7 }
    $1 == "throughput" { thr = $2 " " $3; sub(/,$/, "", thr) }
    /replica load/ { bal = $4 }
    END {
      # what the bench did not print stays "-"; one replica has no load line
      printf "%s|%s|%s|%s|%s|%s\n", or_dash(blocks), or_dash(hit), or_dash(p50), or_dash(p90), or_dash(thr), or_dash(bal)
    }
    function or_dash(v) { return v == "" ? "-" : v }
  ' "$work/bench.txt"
}

start=$(date +%s)
table=$work/table.md
{
printf '| trace | replicas | routing | KV blocks a pool (all replicas) | hit rate | TTFT p50 | TTFT p90 | throughput | max/mean load |\n'
printf '|---|---|---|---|---|---|---|---|---|\n'
for name in $traces; do
  case "$name" in
    mooncake) file=$trace ;;
    conversations) file=$work/conversations.jsonl ;;
    *) echo "routing-bench: unknown trace $name (mooncake, conversations)" >&2; exit 64 ;;
  esac
  for n in $replicas; do
    for policy in $policies; do
      IFS='|' read -r blocks hit p50 p90 thr bal < <(run "$file" "$n" "$policy")
      printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' \
        "$name" "$n" "$policy" "$blocks" "$hit" "$p50" "$p90" "$thr" "$bal"
    done
  done
done
} | tee "$table"
echo
echo "$(( $(date +%s) - start )) s; --requests $requests --max-prompt $max_prompt --max-output $max_output --concurrency $concurrency --max-context $max_context; worker budgets (N:MiB) $budgets; --prefill-weight $weight"
echo
check_table "$table"
