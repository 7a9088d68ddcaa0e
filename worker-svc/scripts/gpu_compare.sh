#!/usr/bin/env bash
# An old and a new build of the GPU bench, alternately in one run on the GPU
# machine (no Rust toolchain needed there), after the new build's CUDA tests.
#
#   worker-svc/scripts/gpu_compare.sh [DIR]
#
# DIR (default .device-carry/gpu) holds gpu-bench-old, gpu-bench-new and
# cuda-tests-new, each plain or xz-compressed (`gpu_bench.sh build DIR`
# builds the new ones; build the old from the commit to compare against).
# The old bench runs the shape it has (bench-1b); the new one bench-1b too,
# then the model shapes of KVLEASE_BENCH_MODELS (default SmolLM2-135M's and
# the 1.1B Llama's), prefill also over KVLEASE_BENCH_GEMM_STREAMS product
# streams (default 8 and 16). Logs go to $OUT (or
# ./gpu-compare-out).
set -uo pipefail
dir=${1:-.device-carry/gpu}
out=${OUT:-gpu-compare-out}
mkdir -p "$out"
bin=$(mktemp -d)
for f in gpu-bench-old gpu-bench-new cuda-tests-new; do
  if [ -f "$dir/$f.xz" ]; then xz -dc "$dir/$f.xz" >"$bin/$f"; else cp "$dir/$f" "$bin/$f"; fi
  chmod +x "$bin/$f"
done
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "== CUDA tests of the new build"
KVLEASE_REQUIRE_GPU=1 timeout 300 "$bin/cuda-tests-new" --test-threads=1 2>&1 | tee "$out/tests.log" || status=1
# The attention variants are the same kernels in both builds: skip them.
export KVLEASE_ATTN_VARIANTS=none KVLEASE_MODEL_ATTN_VARIANTS=none KVLEASE_REQUIRE_GPU=1
for round in 1 2; do
  echo "== round $round: old bench (bench-1b)"
  timeout 200 "$bin/gpu-bench-old" 2>&1 | tee "$out/old-$round.log" || status=1
  echo "== round $round: new bench (bench-1b)"
  KVLEASE_BENCH_MODELS=bench-1b timeout 200 "$bin/gpu-bench-new" 2>&1 | tee "$out/new-$round.log" || status=1
done
echo "== new bench, the issue's model shapes, prefill over more product streams"
KVLEASE_BENCH_MODELS=${KVLEASE_BENCH_MODELS:-smollm2-135m,llama-1.1b} \
  KVLEASE_BENCH_GEMM_STREAMS=${KVLEASE_BENCH_GEMM_STREAMS:-8,16} \
  timeout 400 "$bin/gpu-bench-new" 2>&1 | tee "$out/new-models.log" || status=1
exit $status
