#!/usr/bin/env bash
# Builds, checks and times the CUDA backend in one run.
#
#   worker-svc/scripts/gpu_bench.sh build [DIR]   # where cargo is: build the
#       release test and bench binaries with --features cuda into DIR
#       (default .device-carry/worker-svc)
#   worker-svc/scripts/gpu_bench.sh run [DIR]     # on the GPU machine (no Rust
#       toolchain needed): GPU correctness tests (KVLEASE_REQUIRE_GPU=1, so a
#       missing GPU fails), the worker binary starting with --backend cuda,
#       the paged decode attention and decode step bench, and PyTorch SDPA.
#   worker-svc/scripts/gpu_bench.sh all           # both, on a GPU machine with cargo
#
# Run from the repository root. Logs go to $OUT (or ./gpu-bench-out).
set -uo pipefail
mode=${1:-all}
dir=${2:-.device-carry/worker-svc}
out=${OUT:-gpu-bench-out}
mkdir -p "$out"

build() {
  set -e
  mkdir -p "$dir"
  local json
  json=$(cargo test --release -p worker-svc --features cuda --test cuda --no-run --message-format=json)
  cp "$(echo "$json" | grep -o '"executable":"[^"]*cuda-[^"]*"' | tail -1 | cut -d'"' -f4)" "$dir/cuda-tests"
  json=$(cargo bench -p worker-svc --features cuda --bench gpu --no-run --message-format=json)
  cp "$(echo "$json" | grep -o '"executable":"[^"]*gpu-[^"]*"' | tail -1 | cut -d'"' -f4)" "$dir/gpu-bench"
  cargo build --release -p worker-svc --features cuda --bin kvlease-worker
  cp target/release/kvlease-worker "$dir/kvlease-worker"
  strip "$dir"/cuda-tests "$dir"/gpu-bench "$dir"/kvlease-worker
  ls -l "$dir"
  set +e
}

run() {
  local status=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  date -u +%Y-%m-%dT%H:%MZ | tee -a "$out/gpu.txt"
  echo "== GPU correctness tests"
  KVLEASE_REQUIRE_GPU=1 timeout 240 "$dir/cuda-tests" --test-threads=1 --nocapture 2>&1 | tee "$out/tests.log" || status=1
  echo "== worker binary with --backend cuda (runs 6 s)"
  # a worker that starts serves until timeout stops it (status 124); one that
  # exits by itself within 6 s, even with 0, did not start
  local worker_status=0
  RUST_LOG=info timeout 6 "$dir/kvlease-worker" --backend cuda --gpu-memory-fraction 0.1 --listen 127.0.0.1:50953 \
    >"$out/worker.log" 2>&1 || worker_status=$?
  grep -E "cuda|arena|error" "$out/worker.log" | head -5
  if [ "$worker_status" -ne 124 ] || ! grep -q "grpc serving" "$out/worker.log"; then
    echo "FAILED: the CUDA worker did not start and serve for 6 s (exit status $worker_status; $out/worker.log):"
    tail -5 "$out/worker.log"
    status=1
  fi
  echo "== paged decode attention and decode step"
  KVLEASE_REQUIRE_GPU=1 timeout 240 "$dir/gpu-bench" 2>&1 | tee "$out/bench.log" || status=1
  echo "== PyTorch SDPA over contiguous KV"
  PYTHONUNBUFFERED=1 timeout 120 python3 worker-svc/scripts/sdpa_decode.py 2>&1 | tee "$out/sdpa.log" || status=1
  local ours theirs
  ours=$(grep -o 'time per call (attention + merge) | [0-9.]*' "$out/bench.log" | grep -o '[0-9.]*$')
  theirs=$(grep -o 'sdpa_time_us [0-9.]*' "$out/sdpa.log" | grep -o '[0-9.]*$')
  if [ -n "$ours" ] && [ -n "$theirs" ]; then
    echo "| paged decode attention | ${ours} us |"
    echo "| torch SDPA, contiguous KV | ${theirs} us |"
    echo "| SDPA time / paged time | $(python3 -c "print(f'{$theirs/$ours:.2f}')") |"
  fi
  return $status
}

case "$mode" in
  build) build ;;
  run) run ;;
  all) build && run ;;
  *) echo "usage: $0 build|run|all [DIR]" >&2; exit 64 ;;
esac
