#!/usr/bin/env bash
# gpu.sh attn: build and run native/tools/attn_prefill_bench.cu (causal flash-attention prefill,
# native/attention_prefill.cu) on the GPU machine: checks against the decode path and an fp32
# reference, then times it.
#   bash scripts/gpu.sh attn            # all cases, the deep ones (pos0 29500) included (~1 minute)
#   bash scripts/gpu.sh attn --quick    # the correctness cases + one deep timing case
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-attn-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
record_gpu "$OUT/gpu.txt"
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Inative native/tools/attn_prefill_bench.cu \
    native/attention_prefill.cu native/attention.cu -o "$OUT/attn_bench" || exit 1
# registers / spills / shared memory of the prefill kernels: head_dim / q8_0 (b1) or f16 (b0)
awk '/Compiling entry function/ { k = ""; if (match($0, /attention_prefill_kernelILi[0-9]+ELb[01]ELb[01]/)) {
         k = substr($0, RSTART + 27, RLENGTH - 27); gsub(/ELb/, "/", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "prefill D/q8/split %-8s %s | %s\n", k, r, sp; k = "" }' \
    "$OUT/build.log"
cuobjdump -sass "$OUT/attn_bench" 2>/dev/null | awk '/Function : .*attention_prefill_kernel/ {f = 1} /Function : / && !/attention_prefill_kernel/ {f = 0} f' \
    >"$OUT/sass_prefill.txt" || true
echo "SASS of the prefill kernels: $(grep -c HMMA "$OUT/sass_prefill.txt" 2>/dev/null || echo 0) HMMA, $(grep -c LDSM "$OUT/sass_prefill.txt" 2>/dev/null || echo 0) LDSM, $(grep -c LDGSTS "$OUT/sass_prefill.txt" 2>/dev/null || echo 0) LDGSTS (cp.async), $(grep -cE 'LDL|STL' "$OUT/sass_prefill.txt" 2>/dev/null || echo 0) local loads/stores"
timeout "${AB_TIMEOUT:-540}" "$OUT/attn_bench" "$@" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log, build log $OUT/build.log)"
exit $rc
