#!/usr/bin/env bash
# compute-sanitizer over the GPU test suite on the small models (issue 10 item 2), on the GPU
# machine: memcheck (with --leak-check full), racecheck, synccheck and initcheck, each running
# tests/test_native_gpu.py at 16 positions on tiny-F32, tiny-Q4_K_M and w256-Q4_K_M (plus the
# multi-position, draft-chain, greedy-decode and memory-report tests). The out-of-memory and
# kernel-fault tests are left out: they fault on purpose.
#
#   bash scripts/gpu.sh sanitize        # carry .whl (cffi, pycparser, gguf wheels)
#
# Environment: SANITIZE_BUDGET (seconds for the whole script, default 330), SANITIZE_TOOLS
# (default "memcheck racecheck synccheck initcheck"), SANITIZE_K (the pytest -k selection),
# OPENJET_GPU_POSITIONS (default 16). Each tool gets a share of what is left (weights 3/4/1.5/1.5,
# time a tool does not use goes to the next); tests not started when its share runs out are
# skipped ("time budget", counted in the table) so the sanitizer still prints its summary.
# $OUT gets sanitize.md (the table, also printed last), sanitize.json, build.log and one log per tool.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
start=$(date +%s)
BUDGET=${SANITIZE_BUDGET:-330}
TOOLS=$(echo ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck})   # words, single spaces
OUT=${OUT:-/tmp/openjet-sanitize-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2
export OPENJET_GPU_POSITIONS=${OPENJET_GPU_POSITIONS:-16}
unset OPENJET_GPU_REPORT
K=${SANITIZE_K:-"(teacher_forced and (tiny-F32 or tiny-Q4_K_M or w256-Q4_K_M)) or (multi_position and tiny-Q4_K_M) or draft_chain or greedy_decode or status_and_memory"}

# 1. packages the GPU machine lacks (cffi, pycparser, gguf) travel as wheels in .whl/
install_carried_wheels_if_missing "$OUT/build.log" || { cat "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PYTHONPATH:$PWD/scripts    # scripts/: the sanitize_deadline pytest plugin

# 2. the library, for this GPU only (sm_90 on the H200); -lineinfo is in its flags, so reports name lines
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader >>"$OUT/build.log" 2>&1
build_native_if_stale >>"$OUT/build.log" 2>&1 || { echo "gpu_sanitize: native build failed:"; tail -30 "$OUT/build.log"; exit 1; }
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if ! "$SAN" --version >>"$OUT/build.log" 2>&1; then
    echo "gpu_sanitize: compute-sanitizer not found ($SAN)"; exit 1
fi

# 3. one pytest run per tool, inside the sanitizer
weight() { case $1 in memcheck) echo 30;; racecheck) echo 40;; *) echo 15;; esac; }
remaining_weight() { local w=0 t; for t in $1; do w=$(( w + $(weight "$t") )); done; echo "$w"; }
runs=()
todo=$TOOLS
for tool in $TOOLS; do
    todo=${todo#"$tool"}; todo=${todo# }
    left=$(( BUDGET - ($(date +%s) - start) ))
    share=$(( left * $(weight "$tool") / ($(weight "$tool") + $(remaining_weight "$todo")) ))
    if [ "$share" -lt 30 ]; then
        echo "gpu_sanitize: $tool skipped, ${share} s of the budget left" | tee "$OUT/$tool.log"
        runs+=(--run "$tool" "$OUT/$tool.log" - 0)
        continue
    fi
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check full)
    t0=$(date +%s)
    echo "gpu_sanitize: $tool, ${share} s"
    # the soft deadline stops starting tests 20 s before the share ends; the hard one is a backstop
    OPENJET_TEST_DEADLINE=$(( t0 + share - 20 )) timeout -k 15 $(( share + 60 )) \
        "$SAN" --tool "$tool" --target-processes all --print-limit 200 --show-backtrace device "${extra[@]}" \
        python3 -m pytest -p no:cacheprovider -p no:xdist -p sanitize_deadline -q -rfEs \
        --timeout $(( share + 30 )) tests/test_native_gpu.py -k "$K" >"$OUT/$tool.log" 2>&1
    rc=$?
    runs+=(--run "$tool" "$OUT/$tool.log" "$rc" "$(( $(date +%s) - t0 ))")
    grep -E "(ERROR|RACECHECK|LEAK) SUMMARY|passed|failed" "$OUT/$tool.log" | tail -4
done

# 4. the table
echo
python3 scripts/sanitize_summary.py "${runs[@]}" --markdown "$OUT/sanitize.md" --json "$OUT/sanitize.json" \
    --command "compute-sanitizer --tool TOOL --target-processes all python3 -m pytest tests/test_native_gpu.py -k '$K' (OPENJET_GPU_POSITIONS=$OPENJET_GPU_POSITIONS)"
rc=$?
echo "gpu_sanitize: $(( $(date +%s) - start )) s, exit $rc (0: every tool finished clean)"
exit $rc
