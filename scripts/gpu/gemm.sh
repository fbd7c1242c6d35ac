#!/usr/bin/env bash
# Builds native/tools/gemm_bench.cu (gemm_prefill.cuh, the prefill GEMM: quantised W x
# P positions on the integer tensor cores, with native/matvec.cu for the device layouts) for
# sm_${OPENJET_CUDA_ARCHS:-90} and runs it: every output checked for coverage and, on sampled
# (row, position) pairs, against a float64 host reference, then timed at
# P = 64, 256, 512, 2048; a summary table and the 27B stack's projection time / tokens/s last.
# Log, table, resource report and SASS go to $OUT (or /tmp/openjet-gemm-out).
#
#   bash scripts/gpu.sh gemm            # + Q5_K / Q8_0 / Q6_K on the big shapes (~2-3 minutes on an H200)
#   bash scripts/gpu.sh gemm --quick    # the 27B Q4_K_M map's (type, shape) pairs + one Q8_0, one Q5_K (< 2 minutes)
#   OJ_GEMM_CFG=4,2 bash scripts/gpu.sh gemm --quick   # force 128 rows x 2 stages (4,3 / 4,2 / 2,2)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-gemm-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/gemm_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o "$OUT/gemm_bench" -lgomp || exit 1
# registers / spills of the GEMM kernels: type id (8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K) / warps along M / stages
awk '/Compiling entry function/ { k = ""; if (match($0, /gemm_kernelILi[0-9]+ELi[0-9]+ELi[0-9]+/)) {
         k = substr($0, RSTART + 14, RLENGTH - 14); gsub(/ELi/, "/", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "gemm type/wm/stages %-8s %s | %s\n", k, r, sp; k = "" }' \
    "$OUT/build.log"
cuobjdump -sass "$OUT/gemm_bench" 2>/dev/null | awk '/Function : .*gemm_kernel/ {f = 1} /Function : / && !/gemm_kernel/ {f = 0} f' \
    >"$OUT/sass_gemm.txt" || true
echo "SASS of the GEMM kernels: $(grep -c IMMA "$OUT/sass_gemm.txt" 2>/dev/null || echo 0) IMMA, $(grep -c LDGSTS "$OUT/sass_gemm.txt" 2>/dev/null || echo 0) LDGSTS (cp.async), $(grep -cE 'LDL|STL' "$OUT/sass_gemm.txt" 2>/dev/null || echo 0) local loads/stores"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${GB_TIMEOUT:-540}" "$OUT/gemm_bench" --table "$OUT/table.txt" "$@" \
    >"$OUT/run.log" 2>&1
rc=$?
grep -E "^(FAIL|oj::fail)" "$OUT/run.log" | head -20
grep -E "^device|  -> " "$OUT/run.log"
sed -n '/^case /,$p' "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log, table $OUT/table.txt)"
exit $rc
