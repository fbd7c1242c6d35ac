#!/usr/bin/env bash
# Builds and runs native/tools/launch_chain_bench.cu: what a kernel in a chain of dependent launches
# costs beyond the bytes it streams (plain, PDL, a PDL graph; empty kernels and 1-64 MB streams;
# prep -> stream pairs with 0-192 KB a block copied before the wait),
# the floor under `openjet bench`'s launch fit for the decode pass (issue 25). < 1 minute. Logs to
# $OUT (or /tmp/openjet-launch-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-launch-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -Inative native/tools/launch_chain_bench.cu -o "$OUT/lcb" || exit 1
timeout "${LCB_TIMEOUT:-120}" "$OUT/lcb" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc"
exit $rc
