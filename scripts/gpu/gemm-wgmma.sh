#!/usr/bin/env bash
# Builds native/tools/gemm_wgmma_bench.cu (gemm_wgmma.cuh / gemm_wgmma_q6k.cuh: Q4_K / Q6_K x P
# positions on Hopper's wgmma with the dequantised weights as the register A operand, beside
# gemm_f16.cuh's kernel of the same type on the same prepared X; native/matvec.cu for the device
# layout and the all-output reference) for
# sm_90a, prints registers / spills / ptxas wgmma warnings and SASS counts, then runs the bench:
# every configuration checked (float64 on sampled pairs, matvec's bf16-split path on all outputs,
# NaN poisoning, P = 77, accumulate), then timed at P = 64 .. 2048 beside gemm_f16.
# Log, table, build log and SASS go to $OUT (or /tmp/openjet-gemm-wgmma-out). ~1-2 minutes on an H200
# per type (the build itself ~1-2 minutes).
#
#   bash scripts/gpu.sh gemm-wgmma
#   bash scripts/gpu.sh gemm-wgmma --only Q6_K              # one type's cases (Q4_K | Q6_K)
#   OJ_GEMMWG6_CFG=3,64,3 bash scripts/gpu.sh gemm-wgmma    # Q6_K default config for the timing rows
#                                                           # (2,128,2 | 3,64,3)
#   OJ_GEMMWG_CFG=2,64,4 bash scripts/gpu.sh gemm-wgmma   # default config for the timing rows
#                                                         # (2,128,2 | 2,64,4 | 3,64,3)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-gemm-wgmma-out}
mkdir -p "$OUT"
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build.log" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/gemm_wgmma_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o "$OUT/gemm_wgmma_bench" -lgomp || exit 1
# ptxas warnings that matter here: wgmma serialised (C7510 family) or setmaxnreg ignored (C7508)
grep -iE "warning|serializ|C75" "$OUT/build.log" | head -10
# registers / spills of the wgmma kernels (consumer warpgroups / positions / stages; the count is the
# entry cap: the consumers get more through setmaxnreg) and of gemm_f16's Q4_K kernels
awk '/Compiling entry function/ { k = "";
         if (match($0, /gemm_wgmma_kernelILi[0-9]+ELi[0-9]+ELi[0-9]+ELb[01]/)) { k = "wgmma " substr($0, RSTART + 20, RLENGTH - 20); gsub(/ELi|ELb/, "/", k); sub(/\/1$/, "/swiglu", k); sub(/\/0$/, "", k) }
         else if (match($0, /gemm_wgmma_q6k_kernelILi[0-9]+ELi[0-9]+ELi[0-9]+E/)) { k = "wgmma Q6_K " substr($0, RSTART + 24, RLENGTH - 25); gsub(/ELi/, "/", k) }
         else if (match($0, /gemm_f16_kernelILi12ELi[0-9]+ELi[0-9]+/)) { k = "f16 Q4_K " substr($0, RSTART + 18, RLENGTH - 18); gsub(/ELi/, "/", k) }
         else if (match($0, /gemm_f16_kernelILi14ELi[0-9]+ELi[0-9]+/)) { k = "f16 Q6_K " substr($0, RSTART + 18, RLENGTH - 18); gsub(/ELi/, "/", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "%-22s %s | %s\n", k, r, sp; k = "" }' \
    "$OUT/build.log"
cuobjdump -sass "$OUT/gemm_wgmma_bench" 2>/dev/null | awk '/Function : .*gemm_wgmma_kernel/ {f = 1} /Function : / && !/gemm_wgmma_kernel/ {f = 0} f' \
    >"$OUT/sass_gemm_wgmma.txt" || true
cuobjdump -sass "$OUT/gemm_wgmma_bench" 2>/dev/null | awk '/Function : .*gemm_wgmma_q6k_kernel/ {f = 1} /Function : / && !/gemm_wgmma_q6k_kernel/ {f = 0} f' \
    >"$OUT/sass_gemm_wgmma_q6k.txt" || true
S="$OUT/sass_gemm_wgmma.txt"
c() { grep -c "$1" "$S" 2>/dev/null || echo 0; }
echo "SASS of the Q4_K wgmma kernels (3 plain + 2 fused SwiGLU configs): $(c HGMMA) HGMMA, $(c 'WARPGROUP.ARRIVE') WARPGROUP.ARRIVE, $(c 'WARPGROUP.DEPBAR') WARPGROUP.DEPBAR, $(c WARPSYNC) WARPSYNC, $(c USETMAXREG) USETMAXREG, $(c UTMALDG) UTMALDG, $(c SYNCS) SYNCS, $(c HFMA2) HFMA2, $(c HMMA) HMMA, $(grep -cE 'LDL|STL' "$S" 2>/dev/null || echo 0) local loads/stores"
S="$OUT/sass_gemm_wgmma_q6k.txt"
echo "SASS of the Q6_K wgmma kernels (2 configs; the PTX has 16 + 16 = 32 wgmma.mma_async): $(c HGMMA) HGMMA, $(c 'WARPGROUP.ARRIVE') WARPGROUP.ARRIVE, $(c 'WARPGROUP.DEPBAR') WARPGROUP.DEPBAR, $(c WARPSYNC) WARPSYNC, $(c USETMAXREG) USETMAXREG, $(c UTMALDG) UTMALDG, $(c SYNCS) SYNCS, $(c FFMA) FFMA, $(c HMMA) HMMA, $(grep -cE 'LDL|STL' "$S" 2>/dev/null || echo 0) local loads/stores"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${GB_TIMEOUT:-400}" "$OUT/gemm_wgmma_bench" --table "$OUT/table.txt" "$@" \
    >"$OUT/run.log" 2>&1
rc=$?
grep -E "^(FAIL|oj::fail)" "$OUT/run.log" | head -20
grep -E "^device|^wgmma (Q6_K )?config|  -> " "$OUT/run.log"
grep -E "^Q[46]_K .*(wgmma .* ms|config)" "$OUT/run.log"
sed -n '/^case /,$p' "$OUT/run.log"
[ $rc -eq 124 ] && echo "TIMED OUT after ${GB_TIMEOUT:-400} s"
echo "exit $rc (full log $OUT/run.log, table $OUT/table.txt)"
exit $rc
