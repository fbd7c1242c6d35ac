#!/usr/bin/env bash
# The one entry point for work on the GPU machine: `bash scripts/gpu.sh COMMAND [arguments]`.
# Each command is a script under scripts/gpu/ (its header says what it takes and leaves under
# $OUT); the machine-level habits (carried wheels in .whl/, the llama-cpp-python sdist in .carry/,
# the native build for the local GPU, results under $OUT) are the same for all of them.
#
#   check          the GPU test suite against the numpy reference, a short table last
#   bench          `openjet bench` with llama.cpp's llama-bench built in the background
#   session        check, then bench, in one device call (the order a release needs); arguments go
#                  to bench; SESSION_CHECK_S / SESSION_BENCH_S split the call's time
#   agreement      teacher-forced agreement with llama.cpp on the q27b
#   sanitize       compute-sanitizer over a slice of the GPU suite
#   phases         the per-phase Nsight Compute breakdown of one decode pass
#   cluster        the multi-GPU serving check
#   train          the default model's training run
#   attn | deltanet | gemm | gemm-f16 | gemm-wgmma | matvec-f16 | matvec-group | stream-pattern
#                  the kernel harnesses (native/tools/), each against float64 with its timings
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-}
[ $# -gt 0 ] && shift
commands="check bench session agreement sanitize phases cluster train attn deltanet gemm gemm-f16 gemm-wgmma matvec-f16 matvec-group stream-pattern"
case "$cmd" in
    session)
        OUT=${OUT:-/tmp/openjet-session-out}
        mkdir -p "$OUT/check" "$OUT/bench"
        t0=$(date +%s)
        OUT=$OUT/check PYTEST_TIMEOUT=${SESSION_CHECK_S:-240} bash "$here/gpu/check.sh"
        check_rc=$?
        OUT=$OUT/bench BENCH_BUDGET=${SESSION_BENCH_S:-300} bash "$here/gpu/bench.sh" "$@"
        bench_rc=$?
        echo "gpu.sh session: check exit $check_rc, bench exit $bench_rc, $(( $(date +%s) - t0 )) s"
        [ $check_rc -eq 0 ] && exit $bench_rc
        exit $check_rc
        ;;
    "" | -h | --help)
        sed -n '2,19p' "$0"
        exit 2
        ;;
esac
if [ -f "$here/gpu/$cmd.sh" ] && [[ " $commands " == *" $cmd "* ]]; then
    exec bash "$here/gpu/$cmd.sh" "$@"
fi
echo "gpu.sh: unknown command '$cmd' (one of: $commands)"
exit 2
