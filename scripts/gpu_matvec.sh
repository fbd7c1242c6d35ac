#!/usr/bin/env bash
# Builds native/tools/matvec_bench.cu (with native/matvec.cu and the pre-rewrite kernel copy in
# native/tools/matvec_old.cuh) for sm_90 and runs it: correctness against a float64 host
# reference, speed on the 27B shapes of both quantised paths of matvec.cu (the bf16-split
# kernels, "new", and int8 activations, "int8" = OPENJET_MATVEC=int8), plus old beside them
# in the full run; a summary table last. Full table, resource report and log go to $OUT (or
# /tmp/openjet-matvec-out).
#
#   bash scripts/gpu_matvec.sh            # all types and shapes, with old (~2-4 minutes on an H200)
#   bash scripts/gpu_matvec.sh --quick    # the Q4_K_M model's (type, shape) pairs + Q8_0 K % 256 != 0,
#                                         # new and int8 only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/openjet-matvec-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
nvidia-smi --query-gpu=name,compute_cap,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
nvcc -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/matvec_bench.cu native/matvec.cu -o "$OUT/matvec_bench" -lgomp >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
# registers / spills of the engine's tensor-core kernels (type id 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K;
# int8 path: type/warps per block)
awk '/Compiling entry function/ { k = ($0 ~ /oj_old/) ? "" : "new"; t = ""
         if (match($0, /mma_matvec_kernelILi[0-9]+/)) t = substr($0, RSTART + 20, RLENGTH - 20)
         else if (match($0, /i8_matvec_kernelILi[0-9]+ELi[0-9]+/)) {
             t = substr($0, RSTART + 19, RLENGTH - 19); sub(/ELi/, "/", t); k = "i8 " }
         else k = "" }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "%s type %-2s %s | %s\n", k, t, r, sp }' \
    "$OUT/build.log"
# SASS for checking that the prefetch loads (LDG) stay ahead of the previous step's HMMAs
cuobjdump -sass "$OUT/matvec_bench" >"$OUT/sass.txt" 2>/dev/null || true
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${MB_TIMEOUT:-540}" "$OUT/matvec_bench" --table "$OUT/table.txt" "$@" \
    >"$OUT/run.log" 2>&1
rc=$?
grep -E "^(FAIL|oj::fail)" "$OUT/run.log" | head -20
# the summary (everything after the per-case lines)
sed -n '/^device/,/^device-to-device/p' "$OUT/run.log"
sed -n '/^case /,$p' "$OUT/run.log"
grep -E "matvec_rows .* ms" "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log, table $OUT/table.txt)"
exit $rc
