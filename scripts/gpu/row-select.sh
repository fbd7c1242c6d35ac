#!/usr/bin/env bash
# Builds and runs native/tools/row_select_bench.cu: argmax_rows and oj_cycle_sampled's kernels
# (sample_top, sample_draft, sample_verify) against the host on random rows with ties, NaN and
# infinities, the draws by chi-square, and the row kernels' times against the one-block argmax they
# replaced (< 2 minutes). Logs to $OUT (or /tmp/openjet-row-select-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-row-select-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
compile_harness "$OUT/build.log" -std=c++17 -O3 -gencode arch=compute_${ARCH},code=sm_${ARCH} -Inative native/tools/row_select_bench.cu \
    native/sample.cu native/elementwise.cu -o "$OUT/rsb" || exit 1
timeout "${RSB_TIMEOUT:-240}" "$OUT/rsb" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc"
exit $rc
