#!/usr/bin/env bash
# Per-phase time of one decode pass / one speculative cycle of the native engine on the 27B-shaped
# model (issue 8), on the GPU machine in one command: set up (carried wheels), build the native
# library when stale, find or generate the q27b model, time the passes without ncu, profile them
# with Nsight Compute (one ncu run per group), and print the table last (scripts/phase_breakdown.py).
#
#   bash scripts/gpu.sh phases
#   PHASES_REPS=2 PHASES_GROUPS="decode1 mtp" bash scripts/gpu.sh phases
#
# Environment: PHASES_MODEL (a GGUF already on the machine; default: the bench's or
# native_q27b.py's q27b, generated once into build/cache/bench when neither exists),
# PHASES_REPS (passes per group under ncu, default 3), PHASES_TIME (timed passes per group
# without ncu, default 20), PHASES_BUDGET (seconds for the ncu runs together, default 300),
# NCU_CACHE_CONTROL (all: caches flushed before each kernel, ncu's default; none: as they are).
# Output under $OUT (or /tmp/openjet-phases-out): ncu_<group>.csv, timing.json, phases.md,
# phases.json and the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-phases-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2
export OPENJET_CACHE_DIR=${OPENJET_CACHE_DIR:-$PWD/build/cache}
start=$(date +%s)
REPS=${PHASES_REPS:-3}
NTIME=${PHASES_TIME:-20}
BUDGET=${PHASES_BUDGET:-300}
PH_GROUPS=${PHASES_GROUPS:-mtp decode1 verify5}
PROMPT=512
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size

# 1. packages the GPU machine lacks (cffi, pycparser, gguf) travel as wheels in .whl/
install_carried_wheels "$OUT/pip.log" || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then
    echo "gpu_phases: ncu (Nsight Compute) not found"; exit 1
fi
"$NCU" --version | tail -1 | tee "$OUT/ncu_version.txt"

# 2. the library, for this GPU only (sm_90 on the H200)
build_native_if_stale >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; echo "gpu_phases: native build failed"; exit 1; }

# 3. the model
MODEL=${PHASES_MODEL:-$(python3 scripts/phase_probe.py --print-model 2>"$OUT/model.log" | tail -1)}
if [ ! -f "$MODEL" ]; then
    cat "$OUT/model.log"; echo "gpu_phases: no model ($MODEL)"; exit 1
fi
echo "model: $MODEL ($(( $(stat -c %s "$MODEL") / 1000000 )) MB), $(( $(date +%s) - start )) s so far"

# 4. wall time per pass without ncu (host clock around each synchronous call)
timeout 240 python3 scripts/phase_probe.py --model "$MODEL" --prompt $PROMPT --time "$NTIME" \
    --out "$OUT/timing.json" >"$OUT/timing.log" 2>&1 \
    || { tail -20 "$OUT/timing.log"; echo "gpu_phases: timing run failed"; }
grep -E "median|loaded|prompt" "$OUT/timing.log"

# 5. one ncu run per group; each gets what is left of the budget
ncu_start=$(date +%s)
CSVS=()
for g in $PH_GROUPS; do
    left=$(( BUDGET - ($(date +%s) - ncu_start) ))
    if [ "$left" -lt 30 ]; then
        echo "gpu_phases: ncu budget spent before group $g (PHASES_BUDGET=$BUDGET)"; break
    fi
    t0=$(date +%s)
    timeout "$left" "$NCU" --clock-control none --profile-from-start off \
        --cache-control "${NCU_CACHE_CONTROL:-all}" --metrics "$METRICS" \
        --csv --page raw --print-units base --log-file "$OUT/ncu_$g.csv" \
        python3 scripts/phase_probe.py --model "$MODEL" --prompt $PROMPT --group "$g" --reps "$REPS" \
        >"$OUT/ncu_$g.log" 2>&1
    rc=$?
    echo "ncu $g: rc=$rc, $(( $(date +%s) - t0 )) s, $(grep -c '^"[0-9]' "$OUT/ncu_$g.csv" 2>/dev/null || echo 0) kernels"
    if [ $rc -ne 0 ]; then tail -8 "$OUT/ncu_$g.log"; fi
    if grep -q '^"ID"' "$OUT/ncu_$g.csv" 2>/dev/null; then CSVS+=(--csv "$OUT/ncu_$g.csv")
    elif grep -q '^"ID"' "$OUT/ncu_$g.log" 2>/dev/null; then CSVS+=(--csv "$OUT/ncu_$g.log")   # CSV went to stdout
    fi
done

# 6. the table
if [ ${#CSVS[@]} -eq 0 ]; then
    echo "gpu_phases: no ncu CSV to summarise"; exit 1
fi
TIMING=()
[ -s "$OUT/timing.json" ] && TIMING=(--timing "$OUT/timing.json")
python3 scripts/phase_breakdown.py --model "$MODEL" "${CSVS[@]}" "${TIMING[@]}" --depth $PROMPT \
    --json "$OUT/phases.json" >"$OUT/phases.md" 2>"$OUT/breakdown.log"
rc=$?
cat "$OUT/breakdown.log"
cat "$OUT/phases.md"
echo "gpu_phases: breakdown rc=$rc, $(( $(date +%s) - start )) s"
exit $rc
