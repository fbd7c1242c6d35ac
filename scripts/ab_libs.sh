#!/usr/bin/env bash
# The native libraries of several commits for one A/B call on the GPU machine, built here (sm_90) and
# packed for `carry`: each commit's sources from a git worktree, its libopenjet.so, .so.sources and
# openjet.h (a library of another ABI needs its own header beside it) as <name>/, xz-packed to
# .carry/ab/<name>.txz (~4 MB each, 26 MB unpacked; the carry limit is 64 MiB in all).
#
#   bash scripts/ab_libs.sh base=main q6=139de88 deep=98be5a2
#
# On the device, unpack and name each as a setting of `scripts/gpu.sh ab`:
#   for f in .carry/ab/*.txz; do tar xJf $f -C /tmp; done
#   AB="OPENJET_NATIVE_LIB=/tmp/base/libopenjet.so;OPENJET_NATIVE_LIB=/tmp/q6/libopenjet.so" bash scripts/gpu.sh ab
# (the tree's own library, built from its sources, is the default setting.)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '2,12p' "$0"; exit 2; }
PY=${PYTHON:-$PWD/.venv/bin/python}
for spec in "$@"; do   # every setting checked before the first build (minutes each)
    name=${spec%%=*}; rev=${spec#*=}
    [[ "$spec" == *=* && "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "ab_libs: expected NAME=COMMIT, got '$spec'"; exit 2; }
    git rev-parse -q --verify "$rev^{commit}" >/dev/null || { echo "ab_libs: no commit '$rev' (in '$spec')"; exit 2; }
done
mkdir -p .carry/ab
for spec in "$@"; do
    name=${spec%%=*}; rev=${spec#*=}
    sha=$(git rev-parse --verify "$rev^{commit}")
    wt=$(mktemp -d /tmp/ab-wt-XXXXXX)
    out=$(mktemp -d /tmp/ab-lib-XXXXXX)
    git worktree add -q --detach "$wt" "$sha"
    (cd "$wt" && OPENJET_CUDA_ARCHS=90 "$PY" -m openjet_plugin.build_native --out-dir "$out/$name") ||
        { git worktree remove --force "$wt"; rm -rf "$out"; echo "ab_libs: the build of $name ($sha) failed"; exit 1; }
    git worktree remove --force "$wt"
    echo "$sha" >"$out/$name/commit"
    tar cJf ".carry/ab/$name.txz" -C "$out" "$name"
    rm -rf "$out"
    echo "ab_libs: $name = $sha -> .carry/ab/$name.txz ($(du -h ".carry/ab/$name.txz" | cut -f1))"
done
