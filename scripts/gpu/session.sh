#!/usr/bin/env bash
# A release's device session in one call: llama.cpp's llama-bench builds in the background from
# the start; meanwhile the GPU suite runs (pytest -m gpu), then the engine switch settings in $AB
# are timed against the default on the q27b (bench/ours.py: verify_ms and projection_gbps at 1 and
# 5 positions, decode at depth 0), then `openjet bench` runs with llama.cpp in what time is left.
#
#   OPENJET_COMMIT=<sha> bash scripts/gpu.sh session [openjet bench arguments, e.g. --quick]
#   AB="OPENJET_PREFILL_GEMM=f16" SESSION_S=550 bash scripts/gpu.sh session --quick
#   SESSION_AB=0 PYTEST_FILES=tests/test_native_seqs_gpu.py SESSION_S=380 bash scripts/gpu.sh session --quick
#       (a short call: only those GPU tests, no A/B)
#   bash scripts/gpu.sh session --quick --mtp-accuracy 0.75 --only 'card,openjet=,llama.cpp spec'
#       (the model of that MTP head is generated while the suite runs, and the A/B and bench use it)
#
# Carry: .whl/ (cffi, pycparser, gguf for CPython 3.12), .carry/llama_cpp_python-*-slim.tar.gz and
# the native library built here (openjet_plugin/native: loaded as is when it loads, else rebuilt).
# $OUT/session.tgz holds everything (check/, ab/, bench/: the work folder $SESSION_WORK); the summary
# is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
start=$(date +%s)
BUDGET=${SESSION_S:-560}
OUT=${OUT:-/tmp/openjet-session-out}
W=${SESSION_WORK:-/tmp/openjet-session-work}   # outside $OUT: only the archive comes back
mkdir -p "$W/check" "$W/ab" "$W/bench"
export PYTHONUNBUFFERED=1 OPENJET_CACHE_DIR=${OPENJET_CACHE_DIR:-$PWD/build/cache}
CACHE=$OPENJET_CACHE_DIR/bench
mkdir -p "$CACHE"
left() { echo $(( BUDGET - ($(date +%s) - start) )); }

install_carried_wheels_if_missing "$W/pip.log" || { tail -5 "$W/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv >"$W/gpu.txt" 2>&1

# 1. llama-bench in the background (nice: the measurements keep their cores)
SDIST=$(ls .carry/llama_cpp_python-*-slim.tar.gz .carry/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
if [ -n "$SDIST" ]; then
    nice -n 19 python3 -m openjet_plugin.bench.peer build --sdist "$SDIST" --cache "$CACHE" --archs 90 \
        --jobs "$(( $(nproc) - 2 ))" >"$W/peer-build.log" 2>&1 &
fi
# 2. the native library: the carried one when it loads, else built here
load_or_build_native "$W/native-load.log"
# 3. the q27b (once per machine), in the background while the suite runs
# (the one the bench will read: with --mtp-accuracy / --mtp-runner-up among the arguments, the
# generated model of that head, which the bench then finds made)
python3 - "$CACHE" "$@" >"$W/model.log" 2>&1 <<'PY' &
import sys
from pathlib import Path
from openjet_plugin.bench.runner import default_model, head_of_args, parser
a, _ = parser().parse_known_args(sys.argv[2:])
print(default_model(Path(sys.argv[1]), print, *head_of_args(a)))
PY
model_pid=$!
# 4. the GPU suite
# (not the memory-plan files check.sh runs alone afterwards: the bench's 'openjet memory' group
# measures the same plan on the q27b, and the session's minutes go to the bench)
OUT=$W/check OPENJET_GPU_POSITIONS=${OPENJET_GPU_POSITIONS:-256} PYTEST_TIMEOUT=${SESSION_CHECK_S:-210} \
    PYTEST_WORKERS=${PYTEST_WORKERS:-8} PYTEST_SERIAL_FILES= bash scripts/gpu/check.sh >"$W/check/stdout.txt" 2>&1
check_rc=$?
wait $model_pid
M=$(tail -1 "$W/model.log")
# 5. the switch settings against the default, each in its own process (the engine reads them once)
i=0
IFS=';' read -ra SETTINGS <<<"default;${AB:-}"
for s in "${SETTINGS[@]}"; do
    [ -z "$s" ] && continue
    [ "${SESSION_AB:-1}" = 0 ] && break   # SESSION_AB=0: no A/B (a short call keeps its minutes for the bench)
    [ "$(left)" -lt 200 ] && { echo "session: no time left for A/B '$s'" >>"$W/ab/log.txt"; break; }
    env_args=(OJ_AB=1)
    [ "$s" != default ] && read -ra env_args <<<"$s"
    echo "$s" >"$W/ab/setting$i.txt"
    timeout 90 env "${env_args[@]}" python3 -m openjet_plugin.bench.ours --model "$M" --out "$W/ab/ab$i.jsonl" \
        --verify 1,5 --decode-depths 0 --decode-tokens 64 --reps 5 >>"$W/ab/log.txt" 2>&1
    i=$((i + 1))
done
# 6. openjet bench with llama.cpp in the time left
# (the q27b made above, unless the arguments ask the bench for a generated model of its own)
BM=$M
[[ " $* " == *" --mtp-accuracy "* || " $* " == *" --mtp-runner-up "* ]] && BM=
OUT=$W/bench BENCH_MODEL=$BM BENCH_BUDGET=$(( $(left) - 15 )) bash scripts/gpu/bench.sh "$@" >"$W/bench/stdout.txt" 2>&1
bench_rc=$?

# what comes back: one archive, then the summary
tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null
python3 - "$W" <<'PY'
import json, statistics, sys
from pathlib import Path
w = Path(sys.argv[1])
print("=== GPU suite:", *[l for l in (w / "check/pytest.log").read_text().splitlines()[-3:]] if (w / "check/pytest.log").exists() else ["no log"], sep="\n")
for p in sorted((w / "ab").glob("ab*.jsonl")):
    setting = (w / "ab" / f"setting{p.stem[2:]}.txt").read_text().strip()
    for line in p.read_text().splitlines():
        o = json.loads(line)
        if "metric" in o:
            print(f"A/B {setting:<28} {o['metric']:<16} {json.dumps(o['params'], sort_keys=True):<32} median {statistics.median(o['samples']):9.3f} {o['unit']}")
        elif "error" in o or "skip" in o:
            print(f"A/B {setting:<28} {o}")
PY
grep -E "^(FAILED|ERROR)" "$W/check/pytest.log" | head -20
[ -f "$W/bench/bench.md" ] && sed -n '1,40p' "$W/bench/bench.md" | grep -E "^\| (read|decode|verify|projection|roofline|peak)" 
echo "session: suite exit $check_rc, bench exit $bench_rc, $(( $(date +%s) - start )) s"
