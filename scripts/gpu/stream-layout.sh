#!/usr/bin/env bash
# Builds and runs native/tools/stream_layout_bench.cu (copy-only kernels on the copy engine: the decode
# matvec's TMA ring over Q4_K rows (2-D boxes) against tiles of contiguous 4,608-byte steps (bulk
# copies), alone and in a PDL chain; < 1 minute). Logs to $OUT (or /tmp/openjet-stream-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-stream-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
compile_harness "$OUT/build.log" -std=c++17 -O3 -gencode arch=compute_${ARCH}a,code=sm_${ARCH}a -Inative native/tools/stream_layout_bench.cu -o "$OUT/slb" || exit 1
timeout "${SLB_TIMEOUT:-120}" "$OUT/slb" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc"
exit $rc
