#!/usr/bin/env bash
# Train the embedded default model on the GPU machine in one command (about 8.5 minutes).
#
# Three runs share the GPU, started together, with the same seed, batches and step count:
#   mtp         main CE + 0.3 * MTP CE (3 chained steps), MTP gradient flows into the trunk (joint)
#   mtp-frozen  the same loss, but the MTP gradient stops at the trunk, embedding and output matrix
#   nomtp       main CE only: the ablation both are compared with
# training/report.py ships the MTP run with the best estimated tokens per cycle among those that
# hurt held-out main-head perplexity by <= 2%, copying its weight shards and a summary.json to $OUT.
# Export afterwards, where gguf and llama.cpp are installed:
#   python -m training.export --weights "$OUT"/<run>-weights-*.pt --out model.gguf
#
# Environment: OUT (required), PYTHON, PRESET (default), TRAIN_SECONDS (training time per run),
# RUNS (subset of the three tags), TRAIN_ARGS (extra flags for training.train), WORK.
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${OUT:?set OUT to the folder whose files come back}"
PY=${PYTHON:-python3}
PRESET=${PRESET:-default}
BUDGET=${TRAIN_SECONDS:-420}
RUNS=${RUNS:-"mtp mtp-frozen nomtp"}
EXTRA=${TRAIN_ARGS:-}
WORK=${WORK:-/tmp/openjet-train}
SEED=${SEED:-1234}

rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
t0=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

# The corpus: a carried training/build/corpus.npz when present (exact reproduction of an earlier
# tokenization), else this interpreter's stdlib, tokenized now.
CORPUS=training/build/corpus.npz
if [ ! -f "$CORPUS" ]; then
  CORPUS=$WORK/corpus.npz
  "$PY" -m training.data build --out "$CORPUS" --workers "$(nproc)" > "$WORK/corpus.log"
fi
echo "corpus ready after $(( $(date +%s) - t0 )) s"

flags() {
  case "$1" in
    mtp)        echo "--mtp-lambda 0.3 --mtp-trunk-grad 1" ;;
    mtp-frozen) echo "--mtp-lambda 0.3 --mtp-trunk-grad 0" ;;
    nomtp)      echo "--mtp-lambda 0" ;;
    *) echo "unknown run tag $1" >&2; exit 2 ;;
  esac
}

n=$(wc -w <<< "$RUNS")
threads=$(( $(nproc) / n )); [ "$threads" -ge 1 ] || threads=1
pids=()
for r in $RUNS; do
  # shellcheck disable=SC2046
  "$PY" -m training.train --preset "$PRESET" --seed "$SEED" --corpus "$CORPUS" --run-dir "$WORK/$r" --tag "$r" \
      --time-budget "$BUDGET" --barrier "$WORK/barrier" --barrier-n "$n" --threads "$threads" \
      $(flags "$r") $EXTRA > "$WORK/$r.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for r in $RUNS; do
  cp "$WORK/$r.log" "$OUT/$r.log"
  echo "--- $r (last lines)"; tail -n 4 "$WORK/$r.log"
done
[ "$status" = 0 ] || echo "at least one run failed (see its .log in OUT)"

echo "=== summary ($(( $(date +%s) - t0 )) s)"
run_dirs=()
for r in $RUNS; do run_dirs+=("$WORK/$r"); done
"$PY" -m training.report --out "$OUT" "${run_dirs[@]}"
