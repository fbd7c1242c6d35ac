#!/usr/bin/env bash
# The harnesses written without a GPU at hand (2026-11-29, third session), in as few device calls
# as their run times allow; each prints its own table and exits 1 on a failed check. Logs go to
# $OUT/<name>/ (or /tmp/openjet-first-runs/<name>/); a summary line per harness is printed last.
#
#   bash scripts/gpu_first_runs.sh kernels   # chunked DeltaNet, wgmma Q4_K GEMM, fp16 decode matvec (~6 minutes)
#   bash scripts/gpu_first_runs.sh phases    # the per-phase ncu breakdown of decode (carry .whl; ~5 minutes)
#   bash scripts/gpu_first_runs.sh agreement # q27b vs llama.cpp on tokenised text (carry .whl and .carry; ~5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/openjet-first-runs}
mkdir -p "$OUT"
what=${1:-kernels}
summary=()
run() {   # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    mkdir -p "$OUT/$name"
    local t0=$(date +%s)
    OUT="$OUT/$name" timeout "$limit" "$@" >"$OUT/$name/stdout.txt" 2>&1
    local rc=$?
    summary+=("$name: exit $rc after $(( $(date +%s) - t0 )) s")
    echo "=== $name (exit $rc)"
    tail -40 "$OUT/$name/stdout.txt"
}
case "$what" in
    kernels)
        run deltanet 150 bash scripts/gpu_deltanet.sh
        run gemm_wgmma 200 bash scripts/gpu_gemm_wgmma.sh
        run matvec_f16 200 bash scripts/gpu_matvec_f16.sh
        ;;
    phases)
        run phases 540 env PHASES_BUDGET=300 PHASES_REPS=2 bash scripts/gpu_phases.sh
        ;;
    agreement)
        run agreement 560 bash scripts/gpu_agreement.sh --text openjet_plugin/engine.py
        ;;
    *)
        echo "gpu_first_runs: unknown group '$what' (kernels, phases, agreement)"; exit 2 ;;
esac
printf '%s\n' "${summary[@]}"
