#!/usr/bin/env bash
# Builds native/tools/gemm_f16_bench.cu (gemm_f16.cuh: Q4_K / Q5_K / Q6_K / Q8_0 x P positions on
# the fp16 tensor cores, beside gemm_prefill.cuh's int8 GEMM on the same data; native/matvec.cu for the device
# layout and the all-output reference) for sm_${OPENJET_CUDA_ARCHS:-90}, runs the CPU unit check
# of the dequant tricks (tools/gemm_f16_unit.cu) and the bench: every output checked (float64 on
# sampled pairs, matvec's bf16-split path on all), then both kernels timed at P = 64 .. 2048.
# Log, table, resource report and SASS go to $OUT (or /tmp/openjet-gemm-f16-out). ~2-3 minutes
# (8 cases; GB_RUNS=10 timing runs each).
#
#   bash scripts/gpu.sh gemm-f16
#   OJ_GEMMF16_CFG=4,2 bash scripts/gpu.sh gemm-f16    # force 128 rows x 2 stages (Q4_K 8,3 / others
#                                                      # 8,2; 4,2; 2,2; Q8_0 also 1,2)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-gemm-f16-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build_unit.log" -std=c++17 -O2 -Inative native/tools/gemm_f16_unit.cu -o "$OUT/gemm_f16_unit" || exit 1
"$OUT/gemm_f16_unit" || exit 1
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/gemm_f16_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o "$OUT/gemm_f16_bench" -lgomp || exit 1
# registers / spills: the fp16 kernels (type id / warps along M / stages: 12 Q4_K, 13 Q5_K, 14 Q6_K,
# 8 Q8_0), the X preparation, the int8 Q4_K kernels
awk '/Compiling entry function/ { k = "";
         if (match($0, /gemm_f16_kernelILi[0-9]+ELi[0-9]+ELi[0-9]+/)) { k = "f16 " substr($0, RSTART + 18, RLENGTH - 18); gsub(/ELi/, "/", k) }
         else if (match($0, /prep_x_kernel/)) k = "f16 prep_x"
         else if (match($0, /gemm_kernelILi12ELi[0-9]+ELi[0-9]+/)) { k = "int8 Q4_K " substr($0, RSTART + 19, RLENGTH - 19); gsub(/ELi/, "/", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "%-22s %s | %s\n", k, r, sp; k = "" }' \
    "$OUT/build.log"
cuobjdump -sass "$OUT/gemm_f16_bench" 2>/dev/null | awk '/Function : .*gemm_f16_kernel/ {f = 1} /Function : / && !/gemm_f16_kernel/ {f = 0} f' \
    >"$OUT/sass_gemm_f16.txt" || true
echo "SASS of the f16 kernels: $(grep -c HMMA "$OUT/sass_gemm_f16.txt" 2>/dev/null || echo 0) HMMA, $(grep -c HFMA2 "$OUT/sass_gemm_f16.txt" 2>/dev/null || echo 0) HFMA2, $(grep -c LDSM "$OUT/sass_gemm_f16.txt" 2>/dev/null || echo 0) LDSM, $(grep -c LDGSTS "$OUT/sass_gemm_f16.txt" 2>/dev/null || echo 0) LDGSTS, $(grep -cE 'LDL|STL' "$OUT/sass_gemm_f16.txt" 2>/dev/null || echo 0) local loads/stores"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${GB_TIMEOUT:-170}" "$OUT/gemm_f16_bench" --table "$OUT/table.txt" "$@" \
    >"$OUT/run.log" 2>&1
rc=$?
grep -E "^(FAIL|oj::fail)" "$OUT/run.log" | head -20
grep -E "^device|  -> |^  Q[4568]_[K0] " "$OUT/run.log"
grep -E "^Q[4568]_[K0] " "$OUT/run.log"
sed -n '/^case /,$p' "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log, table $OUT/table.txt)"
exit $rc
