#!/usr/bin/env bash
# Builds native/tools/matvec_group_bench.cu (matvec.cu's matvec_group: a layer's projections of one
# normed input in one fp16 launch) for sm_90 and runs it: every check against the float64 dequant,
# each member's own matvec and the 1-vector calls, then the group against one matvec per member on
# the 27B Q4_K_M map's groups (< 2 minutes on an H200). Logs to $OUT (or /tmp/openjet-mvgroup-out).
# Exit status: the harness's (1 on any failed check). `--ncu`: one group's kernel (MVG_ONLY, default
# ffn) under Nsight Compute instead (stall reasons, occupancy, memory throughput; < 1 minute).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-mvgroup-out}
mkdir -p "$OUT"
ARCH=${OPENJET_CUDA_ARCHS:-90}
compile_harness "$OUT/build.log" -std=c++17 -O3 -arch=sm_${ARCH} -lineinfo -Xptxas -v -Xcompiler -fopenmp -Inative \
    native/tools/matvec_group_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o "$OUT/mvgroup_bench" -lgomp || exit 1
grep -A1 "mvf16.*matvec_kernel" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | head -8
if [ "${1:-}" = "--ncu-source" ]; then
    # per-SASS-instruction warp stall samples of one group's kernel: where a warp's step time goes
    MVG_ONLY=${MVG_ONLY:-ffn} MVG_PROFILE=1 timeout "${MB_TIMEOUT:-150}" ncu --kernel-name regex:matvec_kernel \
        --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "$OUT/prof" \
        "$OUT/mvgroup_bench" >"$OUT/ncu_source_run.txt" 2>&1
    rc=$?
    tail -3 "$OUT/ncu_source_run.txt"
    ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass >"$OUT/source.csv" 2>"$OUT/source.err"
    python3 scripts/ncu_source_top.py "$OUT/source.csv" 45
    exit $rc
fi
if [ "${1:-}" = "--ncu" ]; then
    # one group's kernel under Nsight Compute: where a warp's step time goes (stall reasons), the
    # occupancy and the memory throughput (MVG_ONLY: deltanet, attention, ffn, ...; default ffn)
    MVG_ONLY=${MVG_ONLY:-ffn} MVG_PROFILE=1 timeout "${MB_TIMEOUT:-150}" ncu --kernel-name regex:matvec_kernel \
        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,sm__cycles_elapsed.avg.per_second" \
        "$OUT/mvgroup_bench" >"$OUT/ncu.txt" 2>&1
    rc=$?
    cat "$OUT/ncu.txt"
    echo "exit $rc (ncu report $OUT/ncu.txt)"
    exit $rc
fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} timeout "${MB_TIMEOUT:-150}" "$OUT/mvgroup_bench" "$@" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
echo "exit $rc (full log $OUT/run.log)"
exit $rc
