#!/usr/bin/env bash
# One command on the GPU machine: set up (carried wheels), build the native engine for sm_90 when
# the carried library is stale, run the GPU test suite against the numpy reference, and print a
# short table last. Logs and the JSON-lines report go to $OUT (or /tmp/openjet-gpu-out).
#
#   bash scripts/gpu.sh check            # all GPU tests (pytest -m gpu)
#   OPENJET_GPU_POSITIONS=256 PYTEST_ARGS="-k tiny" bash scripts/gpu.sh check
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
OUT=${OUT:-/tmp/openjet-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2
start=$(date +%s)

# 1. packages the GPU machine lacks (cffi, pycparser, gguf) travel as wheels in .whl/
install_carried_wheels "$OUT/pip.log" || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"

# 2. the library, for this GPU only (sm_90 on the H200)
build_native_if_stale 2>&1 | tail -3 | tee "$OUT/build.log"
python3 - <<'PY' 2>&1 | tee -a "$OUT/build.log"
from openjet_plugin import _native
nl = _native.load()
ffi = nl.ffi
v = ffi.new("int32_t[2]"); free = ffi.new("uint64_t[2]"); name = ffi.new("char[128]")
rc = nl.lib.oj_device_info(0, v, v + 1, free, free + 1, name, 128)
print("device_info rc", rc, ffi.string(name).decode(), f"sm_{v[0]}{v[1]}", f"{free[0] / 2**30:.1f} GiB free",
      _native.last_error(nl))
PY

# 3. the GPU tests (a file that fails to import is an error in the log, and the others still run:
# a missing package once stopped the whole suite at collection)
export OPENJET_GPU_REPORT="$OUT/report.jsonl" OPENJET_GPU_MODELS=${OPENJET_GPU_MODELS:-$PWD/.gpumodels}
rm -f "$OPENJET_GPU_REPORT"
timeout "${PYTEST_TIMEOUT:-480}" python3 -m pytest -p no:cacheprovider -q -rs -m gpu ${PYTEST_FILES:-tests/test_native_gpu.py tests/test_native_spec_gpu.py tests/test_native_prefill_gpu.py tests/test_native_cycle_gpu.py tests/test_native_cycle_sampled_gpu.py tests/test_native_graph_gpu.py tests/test_native_tree_gpu.py tests/test_native_seqs_gpu.py tests/test_native_seqs_engine_gpu.py tests/test_constraints_gpu.py tests/test_bench_agreement.py tests/test_bench_bits.py} \
    -n "${PYTEST_WORKERS:-6}" --timeout 450 --continue-on-collection-errors ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
rc=$?
grep -E "passed|failed|error|skipped" "$OUT/pytest.log" | tail -3
# then, alone, the files whose tests read the whole device's free memory (beside other workers
# their measurement would count the others' allocations); PYTEST_SERIAL_FILES= (empty) skips them
if [ -n "${PYTEST_SERIAL_FILES-tests/test_memory_plan.py}" ]; then
    timeout "${PYTEST_SERIAL_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -rs -m gpu \
        ${PYTEST_SERIAL_FILES-tests/test_memory_plan.py} --timeout 230 --continue-on-collection-errors ${PYTEST_ARGS:-} \
        >"$OUT/pytest-serial.log" 2>&1
    rc_serial=$?
    [ "$rc" -eq 0 ] && rc=$rc_serial
    grep -E "passed|failed|error|skipped" "$OUT/pytest-serial.log" | tail -3
    grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest-serial.log" | head -10
fi
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -30

# 4. the table
python3 - "$OPENJET_GPU_REPORT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
tf = sorted((r for r in rows if r["test"] == "teacher_forced"), key=lambda r: r["model"])
print(f"\n{'model':<14} {'origin':<34} {'pos':>4} {'top1':>7} {'KL mean':>9} {'KL max':>9} {'mtp top1':>8} {'mtp KL':>9} {'worst state':>16} {'rel err':>8} {'gpu s':>6}")
for r in tf:
    print(f"{r['model']:<14} {r['origin'][:34]:<34} {r['positions']:>4} {r['top1']:>7.4f} {r['kl_mean']:>9.2e} {r['kl_max']:>9.2e} "
          f"{r['mtp_top1']:>8.4f} {r['mtp_kl_mean']:>9.2e} {r['state_worst']:>16} {r['state_rel_err']:>8.1e} {r['native_s']:>6}")
for r in rows:
    if r["test"] != "teacher_forced":
        print({k: v for k, v in r.items() if k not in ("memory", "estimate")})
PY
# 5. optional: the 27B-shaped model (16.8 GB, generated here), memory and speed
if [ "${OPENJET_Q27B:-0}" = 1 ]; then
    timeout "${Q27B_TIMEOUT:-300}" python3 scripts/native_q27b.py --out "$OUT/q27b.json" >"$OUT/q27b.log" 2>&1
    echo "q27b rc=$?"; tail -45 "$OUT/q27b.log"
fi
echo "gpu_check: pytest rc=$rc, $(( $(date +%s) - start )) s"
exit $rc
