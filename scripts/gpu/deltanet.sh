#!/usr/bin/env bash
# Builds native/tools/deltanet_chunked_bench.cu (deltanet_chunked.cuh: the chunked WY / UT-transform
# Gated DeltaNet recurrence of a prefill pass on the fp16 tensor cores, against a copy of the
# engine's sequential deltanet_recurrence_kernel) for sm_${OPENJET_CUDA_ARCHS:-90} and runs it on
# the 27B shapes (48 value heads, 16 key heads, d = 128) at P = 1, 70, 64, 512, 777, 2048: output
# and final-state errors, time of both kernels (median of 10), positions/s, time per 48 layers.
# Log, resource report and SASS go to $OUT (or /tmp/openjet-deltanet-out). Exit 1 on a failed check.
#
#   bash scripts/gpu.sh deltanet        # < 1 minute on an H200
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-deltanet-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Inative \
    native/tools/deltanet_chunked_bench.cu -o "$OUT/deltanet_bench" || exit 1
# registers / spills per kernel (prep and scan per d_state; the sequential copy)
awk '/Compiling entry function/ { k = $0; sub(/.*function .?/, "", k); sub(/.? for .*/, "", k) }
     /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "%-72s %s | %s\n", k, r, sp }' "$OUT/build.log"
cuobjdump -sass "$OUT/deltanet_bench" >"$OUT/sass.txt" 2>/dev/null || true
echo "SASS: $(grep -c HMMA "$OUT/sass.txt" 2>/dev/null || echo 0) HMMA, $(grep -cE 'LDL|STL' "$OUT/sass.txt" 2>/dev/null || echo 0) local loads/stores"
if [ "${DN_SANITIZE:-0}" = 1 ]; then   # optional: memcheck of every kernel (slower)
    timeout 300 compute-sanitizer --tool memcheck "$OUT/deltanet_bench" >"$OUT/memcheck.log" 2>&1
    tail -3 "$OUT/memcheck.log"
fi
timeout "${DN_TIMEOUT:-300}" "$OUT/deltanet_bench" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log)"
exit $rc
