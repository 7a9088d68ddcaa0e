#!/usr/bin/env bash
# Builds static kvlease binaries on the host and stages them in docker/bin/
# for the FROM-scratch images of compose.yaml (nothing is pulled).
#
#   docker/build.sh            # cargo build + stage
#   docker/build.sh --images   # ... and build the compose images too
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=x86_64-unknown-linux-gnu
if [ ! -e /usr/lib/x86_64-linux-gnu/libc.a ] && [ ! -e /usr/lib64/libc.a ]; then
  echo "docker/build.sh: static glibc (libc.a) not found; install libc6-dev (Debian) or glibc-static" >&2
  exit 1
fi
# +crt-static links glibc statically: the binaries run in a scratch image.
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --release --target "$TARGET" \
  -p kvlease -p cache-svc -p scheduler-svc -p worker-svc -p kvlease-gateway

mkdir -p docker/bin
for b in kvlease kvlease-cache kvlease-scheduler kvlease-worker kvlease-gateway; do
  # the release profile keeps line tables for backtraces; images do not need them
  if command -v strip >/dev/null 2>&1; then
    strip --strip-debug -o "docker/bin/$b" "${CARGO_TARGET_DIR:-target}/$TARGET/release/$b"
    chmod 0755 "docker/bin/$b"
  else
    install -m 0755 "${CARGO_TARGET_DIR:-target}/$TARGET/release/$b" "docker/bin/$b"
  fi
done
echo "docker/build.sh: staged $(ls docker/bin | tr '\n' ' ')in docker/bin/"

if [ "${1:-}" = "--images" ]; then
  if docker compose version >/dev/null 2>&1; then
    docker compose build
  else
    docker-compose build
  fi
fi
