#!/usr/bin/env bash
# gpu_attn_decode.sh: build and run native/tools/attn_decode_bench.cu on the GPU machine: the
# chunked decode-attention partial kernel (attention.cu, OJ_ATTN_CHUNK=1) checked against the
# one-position kernel and a float64 CPU reference, then both timed at depths 1024 / 8192 / 30000.
#   bash scripts/gpu_attn_decode.sh            # every case (~1 minute)
#   bash scripts/gpu_attn_decode.sh --quick    # no depth-30000 cases
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/openjet-attn-decode-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
nvidia-smi --query-gpu=name,compute_cap,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
nvcc -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Inative native/tools/attn_decode_bench.cu \
    native/attention.cu -o "$OUT/attn_decode_bench" >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
# registers / spills of the partial kernels: head_dim / q8_0 (b1) or f16 (b0) [/ chunk]
awk '/Compiling entry function/ { k = ""; if (match($0, /attention_partial_(chunked_)?kernelILi[0-9]+ELb[01](ELi[0-9]+)?/)) {
         k = substr($0, RSTART + 18, RLENGTH - 18); sub(/^kernelILi/, "old D", k); sub(/^chunked_kernelILi/, "chunked D", k); sub(/ELb/, " q8 ", k); sub(/ELi/, " C ", k) } }
     k != "" && /spill/ { sp = $0; sub(/.*info *: */, "", sp); sub(/^ */, "", sp) }
     k != "" && /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); printf "partial %-24s %s | %s\n", k, r, sp; k = "" }' \
    "$OUT/build.log"
if command -v cuobjdump >/dev/null 2>&1; then
    cuobjdump -sass "$OUT/attn_decode_bench" 2>/dev/null >"$OUT/sass.txt" || true
    # loads in flight per warp: the chunked kernels' 128-bit K/V loads (fp16, D = 256) come in groups
    echo "SASS: $(grep -c 'LDG.E.128' "$OUT/sass.txt" 2>/dev/null || echo 0) LDG.128, $(grep -cE 'LDL|STL' "$OUT/sass.txt" 2>/dev/null || echo 0) local loads/stores"
fi
timeout "${AB_TIMEOUT:-540}" "$OUT/attn_decode_bench" "$@" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log, build log $OUT/build.log)"
exit $rc
