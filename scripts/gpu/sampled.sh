#!/usr/bin/env bash
# What a sampled request costs against a greedy one on the GPU machine (issue 28): the carried
# wheels, the native library (the carried one when it loads, else built for sm_90), the bench's
# q27b (generated once into build/cache), then `python -m openjet_plugin.bench.sampled` through the
# Engine at each depth: greedy and temperature 0.7, without speculation and at D = 3 (one engine
# each). $OUT/sampled-<depth>.jsonl per depth; the tables are printed last.
#
#   bash scripts/gpu.sh sampled                  # depths 0 and 8192
#   SAMPLED_DEPTHS=0 SAMPLED_ARGS="--drafts 0,1,3 --tokens 256" bash scripts/gpu.sh sampled
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
q27b_setup sampled || exit 1
rc=0
for d in ${SAMPLED_DEPTHS:-0 8192}; do
    echo "== depth $d"
    python3 -m openjet_plugin.bench.sampled --model "$M" --backend native --depth "$d" \
        --out "$OUT/sampled-$d.jsonl" ${SAMPLED_ARGS:-} 2>>"$OUT/log.txt" || rc=$?
done
exit $rc
