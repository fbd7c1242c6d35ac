#!/usr/bin/env bash
# Engine switch settings timed against the default on the q27b, and nothing else (the session's A/B
# step alone: bench/ours.py's verify_ms and projection_gbps at 1 and 5 positions, with the phase
# tables and host times, and decode at depth 0; each setting in its own process, the engine reads
# its switches once). Settings are separated by ';', a setting's variables by spaces:
#
#   AB="OJ_MVF16_CFG=4,3;OJ_MVF16_CFG=8,2" bash scripts/gpu.sh ab
#   AB="OJ_GEMMWG_CFG=2,64,4" AB_ARGS="--prefill 64:4096" bash scripts/gpu.sh ab   (AB_ARGS: more bench/ours.py rows)
#
# A setting may name another library: OPENJET_NATIVE_LIB=/path/libopenjet.so (a candidate built here
# from a branch and carried; where its ABI differs from the tree's, with its own openjet.h beside it). AB_BITS=1 also dumps each setting's logits of the q27b (bench/bits.py)
# and compares them with the default's: a candidate that changes no arithmetic must give its bits
# (the log says "bit-identical True" per row set; about 25 s a setting). AB_BITS_ARGS goes to the dump:
# "--depth 8192" compares rows after 8,192 prefilled tokens (attention in 33 splits).
#
# Carry: .whl/ (cffi, pycparser, gguf for CPython 3.12) and the native library built here
# (openjet_plugin/native: loaded as is when it loads, else rebuilt). $OUT/ab<i>.jsonl per setting
# (setting <i> in $OUT/settings.txt); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
q27b_setup ab || exit 1
: >"$OUT/settings.txt"
i=0
IFS=';' read -ra SETTINGS <<<"default;${AB:-}"
for s in "${SETTINGS[@]}"; do
    [ -z "$s" ] && continue
    env_args=(OJ_AB=1)
    [ "$s" != default ] && read -ra env_args <<<"$s"
    echo "$i $s" >>"$OUT/settings.txt"
    timeout "${AB_TIMEOUT:-120}" env "${env_args[@]}" python3 -m openjet_plugin.bench.ours --model "$M" --out "$OUT/ab$i.jsonl" \
        --verify 1,5 --decode-depths 0 --decode-tokens 64 --reps 5 ${AB_ARGS:-} >>"$OUT/log.txt" 2>&1
    echo "ab: setting $i ($s) exit $?" >>"$OUT/log.txt"
    if [ "${AB_BITS:-0}" = 1 ]; then
        timeout 120 env "${env_args[@]}" python3 -m openjet_plugin.bench.bits dump --model "$M" --out "$OUT/bits$i.npz" ${AB_BITS_ARGS:-} >>"$OUT/log.txt" 2>&1
        [ "$i" -gt 0 ] && { echo "ab: bits of setting $i against the default:"; python3 -m openjet_plugin.bench.bits compare "$OUT/bits0.npz" "$OUT/bits$i.npz"; } >>"$OUT/log.txt" 2>&1
    fi
    i=$((i + 1))
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
names = dict(line.split(" ", 1) for line in (out / "settings.txt").read_text().splitlines())
for i, setting in names.items():
    p = out / f"ab{i}.jsonl"
    if not p.exists():
        print(f"A/B {setting:<28} no results"); continue
    for line in p.read_text().splitlines():
        o = json.loads(line)
        if "metric" in o:
            print(f"A/B {setting:<28} {o['metric']:<16} {json.dumps(o['params'], sort_keys=True):<32} median {statistics.median(o['samples']):9.3f} {o['unit']}")
        elif "info" in o and "phase_tables" in o["info"]:
            for k, t in o["info"]["phase_tables"].items():
                ph = " ".join(f"{x['name'].split()[-1][:6]}={x['ms']:.2f}" for x in t["phases"] if x["calls"])
                print(f"    {k.split('|')[-1]}: span {t['span_ms']:.2f} host {t.get('host_ms_unprofiled', 0):.2f} / wall {t.get('wall_ms_unprofiled', 0):.2f} | {ph}")
        elif "error" in o or "skip" in o:
            print(f"A/B {setting:<28} {o}")
PY
