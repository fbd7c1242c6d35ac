#!/usr/bin/env bash
# Builds and runs native/tools/stream_pattern_bench.cu (copy-only kernels: how fast the decode
# matvec's weight-read pattern streams without arithmetic, against other tilings and a sequential
# read; < 1 minute on an H200). Logs to $OUT (or /tmp/openjet-stream-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-stream-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -Inative native/tools/stream_pattern_bench.cu -o "$OUT/spb" || exit 1
timeout "${SPB_TIMEOUT:-120}" "$OUT/spb" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc"
exit $rc
