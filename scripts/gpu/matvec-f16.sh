#!/usr/bin/env bash
# Builds native/tools/matvec_f16_bench.cu (matvec_f16.cuh + native/matvec.cu for the bf16-split
# and int8 paths beside it) for sm_90, prints registers / spills and per-kernel SASS instruction
# counts by class, then checks and times on the 27B Q4_K_M map (< 3 minutes on an H200). Logs to
# $OUT (or /tmp/openjet-mvf16-out). Exit status: the harness's (1 on any failed check).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-mvf16-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/matvec_f16_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o "$OUT/mvf16_bench" -lgomp || exit 1
# registers / spills: f16 kernels (type 12 Q4_K, 14 Q6_K / warps / stages), bf16-split, int8
awk '/Compiling entry function/ { k = ""
         if (match($0, /mvf16[0-9]+matvec_kernelILi[0-9]+ELi[0-9]+ELi[0-9]+/)) { k = "f16  " substr($0, RSTART, RLENGTH); sub(/.*kernelILi/, "f16  type ", k); gsub(/ELi/, "/", k) }
         else if (match($0, /mma_matvec_kernelILi[0-9]+/)) { k = "bf16 type " substr($0, RSTART + 20, RLENGTH - 20) }
         else if (match($0, /i8_matvec_kernelILi[0-9]+ELi[0-9]+/)) { k = "int8 type " substr($0, RSTART + 19, RLENGTH - 19); sub(/ELi/, "/", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "%-22s %s | %s\n", k, r, sp; k = "" }' "$OUT/build.log"
cuobjdump -sass "$OUT/mvf16_bench" >"$OUT/sass.txt" 2>/dev/null || true
# static SASS instruction counts per kernel by class (the unrolled super-block step is the bulk)
awk '/Function : / { f = $3; next }
     f != "" && /^ +\/\*[0-9a-f]+\*\/ / {
         line = $0; sub(/^ +\/\*[0-9a-f]+\*\/ +/, "", line); sub(/^@!?U?P[0-9T] +/, "", line)
         split(line, w, /[ .;]/); op = w[1]
         c = "other"
         if (op ~ /^HMMA/) c = "hmma"; else if (op ~ /^(HFMA2|HADD2|HMUL2)/) c = "half2"
         else if (op ~ /^(FFMA|FMUL|FADD|FMNMX)/) c = "fp32"
         else if (op ~ /^(LOP3|SHF|PRMT|IADD3|IMAD|LEA|SEL|ISETP|MOV|IABS|UIADD3|ULOP3|UMOV|USHF|UIMAD|ULEA)/) c = "int/logic"
         else if (op ~ /^LDS/) c = "lds"; else if (op ~ /^LDGSTS/) c = "cp.async"; else if (op ~ /^(LDG|LD)$/ || op ~ /^LDG/) c = "ldg"
         else if (op ~ /^(BRA|BAR|EXIT|NOP|DEPBAR|WARPSYNC|BSSY|BSYNC|RET|CALL)/) c = "ctrl"
         n[f, c]++; tot[f]++; fs[f] = 1 }
     END { for (f in fs) if (f ~ /mvf16.*matvec_kernel|mma_matvec_kernel|i8_matvec_kernel/) {
             printf "%-60s total %5d", substr(f, 1, 60), tot[f]
             split("hmma half2 fp32 int/logic lds cp.async ldg ctrl other", cs, " ")
             for (i = 1; i <= 9; i++) printf " %s %d", cs[i], n[f, cs[i]]
             printf "\n" } }' "$OUT/sass.txt" | sort | tee "$OUT/sass_counts.txt"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${MB_TIMEOUT:-170}" "$OUT/mvf16_bench" "$@" >"$OUT/run.log" 2>&1
rc=$?
grep -E "^(FAIL|oj::fail)" "$OUT/run.log" | head -20
grep -E "^  -> " "$OUT/run.log"
sed -n '/^device/,/^device-to-device/p' "$OUT/run.log"
sed -n '/^case /,$p' "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log)"
exit $rc
