#!/usr/bin/env bash
# The harnesses of kernels written without a GPU at hand, in as few device calls as their run times
# allow; each prints its own table and exits 1 on a failed check. Logs go to $OUT/<name>/ (or
# /tmp/openjet-first-runs/<name>/); a summary line per harness is printed last.
#
#   bash scripts/gpu_first_runs.sh kernels   # Q6_K wgmma GEMM (+ Q4_K again), fp16 decode matvec with
#                                            # split-K across blocks (written 2026-11-30; ~8 minutes)
#   bash scripts/gpu_first_runs.sh f16       # the GPU suite under OPENJET_MATVEC=f16 (carry .whl; ~3
#                                            # minutes): green -> make f16 the decode default
#   bash scripts/gpu_first_runs.sh phases    # the per-phase ncu breakdown of decode (carry .whl; ~5 minutes)
#   bash scripts/gpu_first_runs.sh agreement # q27b vs llama.cpp on tokenised text (carry .whl and the sdist; ~5 minutes)
#   bash scripts/gpu_first_runs.sh opt-in    # written 2026-11-30 without a GPU: chunked decode attention
#                                            # (OJ_ATTN_CHUNK) and Q6_K matvecs on the copy engine
#                                            # (OJ_MVF16_TMA=all), their harnesses (~6 minutes)
#   bash scripts/gpu_first_runs.sh opt-in-suite  # the GPU suite with both switches on (carry .whl; ~3 minutes)
#   bash scripts/gpu_first_runs.sh persistent    # the whole GPU suite under OJ_PERSISTENT=1 with 6 workers (green
#                                                # since 5f9e375), then the q27b A/B with its profile: default,
#                                                # OJ_PERSISTENT_SPLIT=model, OJ_PERSISTENT_PREFETCH=1 (carry .whl;
#                                                # ~8 minutes); scripts/cycle_time.py times oj_cycle on both paths
#   bash scripts/gpu_first_runs.sh attn-group    # written 2026-11-30 without a GPU: OJ_ATTN_CHUNK=group (the KV-group
#                                                # decode partial): its harness against old / c4 / c8 and float64,
#                                                # then the GPU suite with it (carry .whl; ~6 minutes)
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
        run gemm_wgmma 300 env GB_TIMEOUT=230 bash scripts/gpu_gemm_wgmma.sh
        run matvec_f16 260 env MB_TIMEOUT=200 bash scripts/gpu_matvec_f16.sh
        ;;
    f16)
        run f16 300 env OPENJET_MATVEC=f16 PYTEST_TIMEOUT=240 OPENJET_GPU_POSITIONS=256 bash scripts/gpu_check.sh
        ;;
    phases)
        run phases 540 env PHASES_BUDGET=300 PHASES_REPS=2 bash scripts/gpu_phases.sh
        ;;
    agreement)
        run agreement 560 bash scripts/gpu_agreement.sh --text openjet_plugin/engine.py
        ;;
    opt-in)
        run attn_decode 200 env AB_TIMEOUT=170 bash scripts/gpu_attn_decode.sh
        run matvec_group_tma_all 170 env OJ_MVF16_TMA=all MB_TIMEOUT=140 bash scripts/gpu_matvec_group.sh
        run matvec_f16_tma_all 260 env OJ_MVF16_TMA=all MB_TIMEOUT=200 bash scripts/gpu_matvec_f16.sh
        ;;
    opt-in-suite)
        run opt_in_suite 300 env OJ_MVF16_TMA=all OJ_ATTN_CHUNK=1 PYTEST_TIMEOUT=240 OPENJET_GPU_POSITIONS=256 \
            bash scripts/gpu_check.sh
        ;;
    persistent)
        run persistent_suite 300 env OJ_PERSISTENT=1 PYTEST_TIMEOUT=240 OPENJET_GPU_POSITIONS=256 bash scripts/gpu_check.sh
        q27b=build/cache/bench/q27b-Q4_K_M-seed0.gguf
        [ -f "$q27b" ] || python3 -c "from pathlib import Path; from openjet_plugin.bench.runner import default_model; default_model(Path('build/cache/bench'), print)"
        run persistent_time 150 env OJ_PERSISTENT_PROFILE="$OUT/profile.jsonl" python3 scripts/persistent_time.py "$q27b"
        python3 scripts/persistent_profile.py "$OUT/profile.jsonl" > "$OUT/profile.md" 2>&1
        run persistent_time_split 150 env OJ_PERSISTENT_SPLIT=model OJ_PERSISTENT_PROFILE="$OUT/profile_split.jsonl" \
            python3 scripts/persistent_time.py "$q27b"
        python3 scripts/persistent_profile.py "$OUT/profile_split.jsonl" > "$OUT/profile_split.md" 2>&1
        run persistent_time_prefetch 150 env OJ_PERSISTENT_PREFETCH=1 OJ_PERSISTENT_PROFILE="$OUT/profile_prefetch.jsonl" \
            python3 scripts/persistent_time.py "$q27b"
        python3 scripts/persistent_profile.py "$OUT/profile_prefetch.jsonl" > "$OUT/profile_prefetch.md" 2>&1
        ;;
    attn-group)
        run attn_decode 200 env AB_TIMEOUT=170 bash scripts/gpu_attn_decode.sh
        run attn_group_suite 300 env OJ_ATTN_CHUNK=group PYTEST_TIMEOUT=240 OPENJET_GPU_POSITIONS=256 bash scripts/gpu_check.sh
        ;;
    *)
        echo "gpu_first_runs: unknown group '$what' (kernels, f16, phases, agreement, opt-in, opt-in-suite, persistent, attn-group)"; exit 2 ;;
esac
printf '%s\n' "${summary[@]}"
