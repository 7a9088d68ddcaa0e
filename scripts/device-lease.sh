#!/usr/bin/env bash
# A GPU lease in few calls: what to carry, and the stages to run there.
#
#   scripts/device-lease.sh pack          # here (cargo, network): builds and
#       stages everything under .device-carry/ (git-ignored) and prints the
#       calls to make
#   scripts/device-lease.sh run STAGE...  # there (no Rust, no network), from
#       the repository root; logs and rows go to $OUT
#
# A device call carries at most 64 MiB (the tree included), so the SmolLM2
# GGUF (98 MB) travels in four parts, beside work that does not need it:
#
#   call 1, carry .device-carry/bins .device-carry/gguf-1:
#       run unpack gguf e2e-1b         (1.1B Llama shape, 18/128)
#   call 2, carry .device-carry/gguf-2:
#       run gguf e2e-smollm2-shape     (SmolLM2's shape, random weights)
#   call 3, carry .device-carry/gguf-3 .device-carry/gguf-4:
#       run gguf tests e2e-smollm2     (GPU tests with the model; the GGUF)
#
# The machine stays warm between calls (/tmp survives); a fresh one needs
# `unpack` again (carry bins). Stages:
#   unpack             binaries to /tmp/bin, tokenizer to /tmp/tok, the gguf
#                      wheel to /tmp/pylib
#   gguf               copies the carried GGUF parts to /tmp/gguf-parts; once
#                      all four are there, joins them into $KVLEASE_HOME and
#                      checks the md5
#   tests              the CUDA tests, KVLEASE_REQUIRE_GPU=1 and (with the
#                      GGUF) KVLEASE_REQUIRE_MODEL=1
#   e2e-1b, e2e-smollm2-shape, e2e-smollm2
#                      worker-svc/scripts/e2e_vs_transformers.py, 18/128 at
#                      depths $DEPTHS (default 2,3), rows in $OUT/rows.jsonl
#                      and /tmp/rows.jsonl (every row of the lease); set
#                      WORKLOADS="18/128 512/128 shared" for more, CB=1 for
#                      continuous batching too
set -euo pipefail
cd "$(dirname "$0")/.."

carry=.device-carry
parts=4
gguf_name=smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
gguf_md5=a1231443440b107ff29f02bdb38c9d0a

pack() {
  rm -rf "$carry" && mkdir -p "$carry/bins" /tmp/kvlease-pack
  local stage=/tmp/kvlease-pack/bins
  rm -rf "$stage" && mkdir -p "$stage"
  cargo build --release --locked -p worker-svc --features cuda --bins
  cp target/release/kvlease-worker "$stage/"
  cargo build --release --locked -p scheduler-svc -p cache-svc -p kvlease --bins
  cp target/release/{kvlease,kvlease-cache,kvlease-scheduler} "$stage/"
  local json
  json=$(cargo test --release --locked -p worker-svc --features cuda --test cuda --no-run --message-format=json)
  cp "$(echo "$json" | grep -o '"executable":"[^"]*cuda-[^"]*"' | tail -1 | cut -d'"' -f4)" "$stage/cuda-tests"
  strip "$stage"/*
  # the model: the tokenizer directory for the shapes, the GGUF in parts
  cargo run -q --release -p kvlease -- model fetch smollm2
  local gguf="${KVLEASE_HOME:-$HOME/.cache/kvlease/models}/$gguf_name"
  echo "$gguf_md5  $gguf" | md5sum -c -
  target/release/kvlease model tokenizer "$gguf" --out "$stage/tok"
  python3 -m pip download -q --no-deps gguf -d "$stage/whl"
  (cd "$stage" && tar cf - . | xz -T2 -6 >"$OLDPWD/$carry/bins/bins.tar.xz")
  split -n "$parts" -d -a 1 "$gguf" /tmp/kvlease-pack/gguf.
  for i in $(seq 1 "$parts"); do
    mkdir -p "$carry/gguf-$i"
    mv "/tmp/kvlease-pack/gguf.$((i - 1))" "$carry/gguf-$i/part.$i"
  done
  du -sh "$carry"/* && du -sh --exclude=target --exclude=.git --exclude="$carry" .
  sed -n '/^# A device call/,/^# The machine/p' "$0"
}

unpack() {
  rm -rf /tmp/bin && mkdir -p /tmp/bin
  xz -dc "$carry/bins/bins.tar.xz" | tar xf - -C /tmp/bin
  rm -rf /tmp/tok /tmp/pylib && mv /tmp/bin/tok /tmp/tok
  python3 -m pip install -q --no-deps --target /tmp/pylib /tmp/bin/whl/*.whl
  ls -l /tmp/bin
}

gguf() {
  mkdir -p /tmp/gguf-parts "$(dirname "$KVLEASE_HOME/$gguf_name")"
  for d in "$carry"/gguf-*; do
    if [ -d "$d" ]; then cp "$d"/part.* /tmp/gguf-parts/; fi
  done
  local have
  have=$(find /tmp/gguf-parts -name 'part.*' | wc -l)
  echo "GGUF parts here: $have of $parts"
  if [ "$have" -eq "$parts" ] && [ ! -f "$KVLEASE_HOME/$gguf_name" ]; then
    for i in $(seq 1 "$parts"); do cat "/tmp/gguf-parts/part.$i"; done >"$KVLEASE_HOME/$gguf_name"
    (cd "$KVLEASE_HOME" && echo "$gguf_md5  $gguf_name" | md5sum -c -)
  fi
}

has_gguf() {
  [ -f "$KVLEASE_HOME/$gguf_name" ]
}

tests() {
  local model=0
  has_gguf && model=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  KVLEASE_REQUIRE_GPU=1 KVLEASE_REQUIRE_MODEL=$model timeout 400 /tmp/bin/cuda-tests \
    --test-threads=1 2>&1 | tee "$OUT/tests.log" | grep -E "^test |test result|panicked|SKIPPED"
}

e2e() {
  local args=(--bin-dir /tmp/bin --repeats 1 --pipeline-depth "${DEPTHS:-2,3}"
    --results /tmp/rows.jsonl)
  for w in ${WORKLOADS:-18/128}; do
    args+=(--workload "$w")
  done
  [ "${CB:-0}" = 1 ] || args+=(--skip-continuous-batching)
  PYTHONPATH=/tmp/pylib PYTHONUNBUFFERED=1 python3 worker-svc/scripts/e2e_vs_transformers.py \
    "${args[@]}" "$@" 2>&1 | tee -a "$OUT/e2e.log"
  cp /tmp/rows.jsonl "$OUT/rows.jsonl"
}

case "${1:-}" in
  pack) pack ;;
  run)
    shift
    export KVLEASE_HOME=/tmp/kvh OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    for stage in "$@"; do
      echo "== $stage ($(date -u +%H:%M:%S))"
      case "$stage" in
        unpack) unpack ;;
        gguf) gguf ;;
        tests) tests ;;
        e2e-1b) e2e --make-llama-1b /tmp/l --tokenizer /tmp/tok ;;
        e2e-smollm2-shape) e2e --make-smollm2-shape /tmp/s --tokenizer /tmp/tok ;;
        e2e-smollm2)
          has_gguf || { echo "no GGUF yet: carry every part first"; exit 1; }
          e2e --model "$KVLEASE_HOME/$gguf_name" --tokenizer "$KVLEASE_HOME/$gguf_name"
          ;;
        *) echo "unknown stage $stage" >&2; exit 64 ;;
      esac
    done
    ;;
  *) sed -n '2,35p' "$0" >&2; exit 64 ;;
esac
