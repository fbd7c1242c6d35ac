#!/usr/bin/env bash
# The one entry point for work on the GPU machine: `bash scripts/gpu.sh COMMAND [arguments]`.
# Each command is a script under scripts/gpu/ (its header says what it takes and leaves under $OUT);
# the habits (wheels in .whl/ and the llama-cpp-python sdist in .carry/, both from scripts/device_carry.sh,
# the native build for the local GPU, results under $OUT) are the same for all of them.
#
#   check          the GPU test suite against the numpy reference, a short table last
#   bench          `openjet bench` with llama.cpp's llama-bench built in the background
#   session        one device call: llama.cpp builds in the background while the suite runs, then
#                  switch settings in $AB timed against the default, then bench (arguments go to it)
#   ab             only the session's A/B: switch settings in $AB against the default (q27b)
#   setup          openjet's llama-cpp-python CUDA build, doctor and the fallback as a user meets them
#   agreement      teacher-forced agreement with llama.cpp on the q27b
#   sanitize       compute-sanitizer over a slice of the GPU suite
#   phases         the per-phase Nsight Compute breakdown of one decode pass
#   prefill-kernels  the per-kernel Nsight Compute times of one prefill piece (64 positions at depth 4,096)
#   cluster        the multi-GPU serving check
#   train          the default model's training run
#   sampled        sampled against greedy requests through the Engine, with and without speculation
#   attn | deltanet | gemm | gemm-f16 | gemm-wgmma | matvec-f16 | matvec-group | stream-layout | row-select
#                  the kernel harnesses (native/tools/), each against float64 with its timings
#   launch-chain   what a dependent launch costs beyond its bytes (plain, PDL, graph)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-}
[ $# -gt 0 ] && shift
commands="check bench session ab setup agreement sanitize phases prefill-kernels cluster train sampled attn deltanet gemm gemm-f16 gemm-wgmma matvec-f16 matvec-group launch-chain stream-layout row-select"
case "$cmd" in
    "" | -h | --help)
        sed -n '2,22p' "$0"
        exit 2
        ;;
esac
if [ -f "$here/gpu/$cmd.sh" ] && [[ " $commands " == *" $cmd "* ]]; then
    exec bash "$here/gpu/$cmd.sh" "$@"
fi
echo "gpu.sh: unknown command '$cmd' (one of: $commands)"
exit 2
