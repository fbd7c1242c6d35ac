#!/usr/bin/env bash
# `openjet serve --gpus` measured on nvidia-h200-x2 (issue 12), in two device calls: LiteLLM's proxy
# and the packages it needs are ~50 MB of wheels that the GPU image lacks, and with the repository
# they do not fit in one call's 64 MiB, so they travel in two halves into build/site (git-ignored,
# kept while the machine stays warm, i.e. the second call must follow the first within ~30 s).
#
#   1. bash scripts/gpu.sh cluster setup   carry: .whl .carry/cluster-a
#        cffi/gguf wheels and LiteLLM into build/site, the native engine for this GPU, the q27b
#        model (16.8 GB, generated once into build/cache/bench)
#   2. bash scripts/gpu.sh cluster run [cluster_load.py arguments]   carry: .carry/cluster-b
#        LiteLLM's dependencies into build/site, then scripts/cluster_load.py --gpus 0,1: 1 and 2
#        workers at 2 and 16 conversations, one worker killed under load; the report
#        (cluster_load.md/.json) and the logs land in $OUT
#
# Carry folders (git-ignored), made on a machine with pip (Python 3.12 wheels, manylinux x86-64):
#   .carry/cluster-a/litellm-1.110.2-slim.zip   the litellm 1.110.2 wheel without the admin UI
#                                               (litellm/proxy/_experimental/out), extracted as is
#   .carry/cluster-b/*.whl                      every other package litellm's proxy, fastapi,
#                                               uvicorn and openai need that the image lacks
#                                               (docs/CLUSTER.md lists how they were chosen)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
MODE=${1:-}
shift || true
OUT=${OUT:-/tmp/openjet-cluster-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True
export OPENJET_CACHE_DIR=${OPENJET_CACHE_DIR:-$PWD/build/cache}
SITE=$PWD/build/site
export PYTHONPATH=$SITE:$PWD

case "$MODE" in
setup)
    start=$(date +%s)
    mkdir -p "$SITE"
    [ -d .whl ] && { pip_install_carried "$SITE" .whl/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }; }
    ls .carry/cluster-a/litellm-*-slim.zip >/dev/null 2>&1 || { echo "gpu_cluster: carry .carry/cluster-a"; exit 1; }
    python3 -m zipfile -e .carry/cluster-a/litellm-*-slim.zip "$SITE" || exit 1
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv | tee "$OUT/gpus.txt"
    ARCH=$(detected_cuda_arch)
    build_native_if_stale "${OPENJET_CUDA_ARCHS:-$ARCH}" 2>&1 | tail -3 | tee "$OUT/build.log"
    python3 -c "
from pathlib import Path
from openjet_plugin.bench.runner import default_model
print('model', default_model(Path('$OPENJET_CACHE_DIR/bench'), print))" 2>&1 | tee -a "$OUT/build.log"
    echo "gpu_cluster: setup done in $(( $(date +%s) - start )) s; now, within 30 s: bash scripts/gpu.sh cluster run"
    ;;
run)
    [ -d "$SITE/litellm" ] || { echo "gpu_cluster: $SITE/litellm is missing: the machine was not kept warm" \
                                     "since 'setup' (run setup again, then run at once)"; exit 2; }
    pip_install_carried "$SITE" .carry/cluster-b/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
    python3 -c "import litellm.proxy.proxy_server, openai, openjet_plugin.cluster; print('litellm proxy imports')" \
        2>&1 | tail -5 || exit 1
    MODEL=$(ls "$OPENJET_CACHE_DIR"/bench/q27b-Q4_K_M-seed0.gguf 2>/dev/null || echo q27b)
    timeout "${CLUSTER_LOAD_TIMEOUT:-540}" python3 scripts/cluster_load.py --gpus 0,1 --model "$MODEL" \
        --backend native --cache-dir "$OPENJET_CACHE_DIR/bench" --out "$OUT" "$@"
    rc=$?
    echo "gpu_cluster: cluster_load exit $rc (0: no client request failed)"
    exit $rc
    ;;
*)
    echo "usage: bash scripts/gpu.sh cluster setup|run [cluster_load.py arguments]"; exit 2 ;;
esac
