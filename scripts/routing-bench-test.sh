#!/usr/bin/env bash
# Tests scripts/routing-bench.sh's judgement of its targets without a
# cluster: a stand-in `kvlease` answers `up`, `health`, `status`,
# `cache-trace` and `bench`, its bench printing the figures asked for in
# $STUB_DIR. Checks that a run meeting every target exits 0, that a missed
# target exits 1 naming it, and that a load line the bench did not print is
# "-" in the table (never a made-up 1.00) and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
stub=$dir/kvlease
cat >"$stub" <<'STUB'
#!/usr/bin/env bash
# `up` remembers its routing policy for the bench that follows
case "$1" in
  up)
    while [ $# -gt 0 ]; do
      [ "$1" = --routing ] && echo "$2" >"$STUB_DIR/policy"
      shift
    done
    exec sleep 600 ;;
  health) exit 0 ;;
  status) echo "  replica-0 127.0.0.1:1 0 552" ;;
  cache-trace)
    while [ $# -gt 0 ]; do
      [ "$1" = --out ] && : >"$2"
      shift
    done ;;
  bench)
    policy=$(cat "$STUB_DIR/policy")
    # kv-aware is faster unless $STUB_DIR/slow says otherwise
    if [ "$policy" = kv-aware ] && [ ! -f "$STUB_DIR/slow" ]; then p50=50.0; else p50=90.0; fi
    # the lines of `kvlease bench`'s report (cli/src/report.rs) the script reads
    echo "  throughput           30.00 req/s, 240.0 output tok/s"
    echo "  TTFT                 p50 $p50 ms  p90 $p50 ms  p99 200.0 ms"
    echo "  prefix reuse         100 of 1000 prompt tokens from cached blocks (10.0%)"
    [ -f "$STUB_DIR/no-load" ] || echo "  replica load         max/mean 1.10 (sequences granted: g0 10, g1 12)"
    ;;
  *) echo "stub kvlease: $*" >&2; exit 2 ;;
esac
STUB
chmod +x "$stub"
: >"$dir/trace.jsonl"

bench() {
  STUB_DIR=$dir KVLEASE_BIN=$stub scripts/routing-bench.sh --trace "$dir/trace.jsonl" \
    --replicas "1 2" --budgets "1:44 2:35" --traces mooncake --port 1 >"$dir/out" 2>&1
}
failed=0
expect() {
  local want=$1 what=$2 got=0
  bench || got=$?
  if [ "$got" != "$want" ]; then
    echo "FAILED: $what: exit $got, expected $want"; cat "$dir/out"; failed=1
  else
    echo "ok: $what (exit $got)"
  fi
}

expect 0 "every target met"
touch "$dir/slow"
expect 1 "kv-aware no faster than least-committed"
grep -q "^MISSED mooncake: TTFT p50" "$dir/out" || { echo "FAILED: the miss is not named"; cat "$dir/out"; failed=1; }
rm "$dir/slow"
touch "$dir/no-load"
expect 1 "no replica load line"
grep -q "| 1\.00 |" "$dir/out" && { echo "FAILED: a load of 1.00 was made up"; cat "$dir/out"; failed=1; }
grep -q "^MISSED mooncake: no replica load line" "$dir/out" || { echo "FAILED: the missing load is not named"; failed=1; }
exit "$failed"
