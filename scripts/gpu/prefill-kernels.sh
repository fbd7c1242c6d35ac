#!/usr/bin/env bash
# Per-kernel times of one prefill piece on the q27b (scripts/prefill_piece.py) under Nsight Compute:
# the state filled to the depth, three pieces timed without the profiler, one inside its range; the
# table of kernel totals is printed last.
#
#   bash scripts/gpu.sh prefill-kernels                  # 64 positions at depth 4,096
#   PIECE_POSITIONS=64 PIECE_DEPTH=12224 bash scripts/gpu.sh prefill-kernels
#
# Carry: .whl/ and the native library built here (openjet_plugin/native). Output under $OUT (or
# /tmp/openjet-prefill-kernels-out): ncu.csv, run.log, kernels.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
q27b_setup prefill-kernels || exit 1
record_gpu "$OUT/gpu.txt"
timeout "${PIECE_TIMEOUT:-300}" ncu --profile-from-start off --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --log-file "$OUT/ncu.csv" \
    python3 scripts/prefill_piece.py "$M" --positions "${PIECE_POSITIONS:-64}" --depth "${PIECE_DEPTH:-4096}" >"$OUT/run.log" 2>&1
rc=$?
cat "$OUT/run.log"
python3 scripts/prefill_piece.py --summary "$OUT/ncu.csv" | tee "$OUT/kernels.txt"
exit $rc
