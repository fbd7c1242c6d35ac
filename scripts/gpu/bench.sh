#!/usr/bin/env bash
# `openjet bench` on the GPU machine in one command: set up the carried wheels, build the native
# engine, build llama.cpp's llama-bench (CUDA) in the background, run the benchmark, and leave the
# report, the logs and the resume folder under $OUT. The table is printed last.
#
#   OPENJET_COMMIT=<sha> bash scripts/gpu.sh bench [openjet bench arguments, e.g. --quick]
#
# Carry (git-ignored): .whl/ (cffi, pycparser, gguf wheels for CPython 3.12) and .carry/ holding
#   llama_cpp_python-0.3.36-slim.tar.gz   (python -m openjet_plugin.bench.peer pack --out .carry)
#   bench-resume/                         (optional: $OUT/resume of an earlier call, to resume on a
#                                          fresh machine)
# Environment: OPENJET_COMMIT (the device copy has no .git), BENCH_BUDGET (seconds for the whole
# script, default 560, inside the 600 s per call), BENCH_MODEL (a GGUF already on the machine,
# e.g. the q27b that scripts/native_q27b.py wrote; default: generated once into the cache).
# A run that does not fit the budget exits 3; run the same command again (while the machine is
# warm, everything built and measured so far is reused from build/cache/).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
start=$(date +%s)
BUDGET=${BENCH_BUDGET:-560}
OUT=${OUT:-/tmp/openjet-bench-out}
mkdir -p "$OUT/resume"
LOG=$OUT/logs.txt
: >"$LOG"
export PYTHONUNBUFFERED=1
export OPENJET_CACHE_DIR=${OPENJET_CACHE_DIR:-$PWD/build/cache}   # build/ is git-ignored
CACHE=$OPENJET_CACHE_DIR/bench
# one resume folder per (model, arguments): a run with other settings (another --only, a generated
# model with --mtp-accuracy) starts its own instead of being refused by the earlier one's identity
RUN=$CACHE/run-$(printf '%s\n' "${BENCH_MODEL:-generated}" "$@" | sha1sum | cut -c1-12)
mkdir -p "$CACHE"

# 1. packages the GPU machine lacks travel as wheels (skipped where they import already; then a
# caller's PYTHONPATH, which may be what holds them, stays after the repository). $LOG is still
# empty: the install may replace it.
caller_pythonpath=${PYTHONPATH:-}
install_carried_wheels_if_missing "$LOG" || { tail -20 "$LOG"; exit 1; }
[ "$PYTHONPATH" = "$PWD" ] && export PYTHONPATH=$PWD${caller_pythonpath:+:$caller_pythonpath}
ARCH=$(detected_cuda_arch 2>>"$LOG")
if [ -z "$ARCH" ]; then
    echo "gpu_bench: no GPU (nvidia-smi failed; see $LOG)"; exit 1
fi

# 2. llama-bench, in the background (cached in build/cache; a killed build resumes incrementally)
SDIST=$(ls .carry/llama_cpp_python-*-slim.tar.gz .carry/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
PEER_ARGS=()
if [ -n "$SDIST" ]; then
    PEER_ARGS=(--sdist "$SDIST")
    nice -n 10 python3 -m openjet_plugin.bench.peer build --sdist "$SDIST" --cache "$CACHE" \
        --archs "$ARCH" --jobs "$(nproc)" >"$CACHE/peer-build-driver.log" 2>&1 &
else
    echo "gpu_bench: no llama-cpp-python sdist under .carry/; llama.cpp rows will say so" | tee -a "$LOG"
fi

# 3. the native engine for this GPU
build_native_if_stale "$ARCH" >>"$LOG" 2>&1 || echo "gpu_bench: native build failed; see logs.txt" | tee -a "$LOG"

# 4. the benchmark (a resume folder carried from an earlier machine seeds the run folder)
if [ -d .carry/bench-resume ] && [ ! -s "$RUN/records.jsonl" ]; then
    mkdir -p "$RUN" && cp .carry/bench-resume/* "$RUN/"
fi
LEFT=$(( BUDGET - ($(date +%s) - start) ))
MODEL_ARGS=()
[ -n "${BENCH_MODEL:-}" ] && MODEL_ARGS=(--model "$BENCH_MODEL")
python3 -m openjet_plugin.cli bench --resume "$RUN" --time-budget "$LEFT" "${PEER_ARGS[@]}" \
    "${MODEL_ARGS[@]}" --json "$OUT/bench.json" --markdown "$OUT/bench.md" --force "$@" \
    >/dev/null 2> >(tee -a "$LOG" >&2)
rc=$?
sleep 1   # let tee flush

# 5. what comes back: report, logs, resume folder
cp "$RUN"/records.jsonl "$RUN"/identity.json "$RUN"/info.json "$OUT/resume/" 2>/dev/null
for f in "$CACHE"/llama.cpp-*/build.log "$CACHE"/llama.cpp-*/SERVER_FAILED "$CACHE"/peer-build-driver.log \
         "$CACHE"/ours-*.log "$CACHE"/llama-server-*.log; do
    [ -f "$f" ] && { echo "=== tail of $f"; tail -25 "$f"; } >>"$LOG"
done
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
echo "gpu_bench: openjet bench exit $rc after $(( $(date +%s) - start )) s (0 complete, 3 out of time: run again, 4 a measurement failed)"
exit $rc
