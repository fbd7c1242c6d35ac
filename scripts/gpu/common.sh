# shellcheck shell=bash
# The setup steps the scripts under scripts/gpu/ share, sourced by them (`. scripts/gpu/common.sh`
# after their `cd` to the repository root: the paths here are relative to it). Not a command:
# scripts/gpu.sh runs only the names in its list. The functions return a status and never exit:
# the script does, after showing as much of the log as it wants.

# pip_install_carried TARGET WHEEL...
#   Wheels carried onto the GPU machine (scripts/device_carry.sh, scripts/cluster_carry.sh) into
#   the folder TARGET, which the caller puts on PYTHONPATH: no index (the machine reaches none), no
#   dependencies (the carrying side resolved them).
pip_install_carried() {
    local target=$1
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}

# install_carried_wheels LOG
#   The packages the GPU image lacks (cffi, pycparser, gguf, ...) travel as wheels in .whl/: where
#   there is a .whl/, they go into /tmp/site (pip's output replaces LOG) and PYTHONPATH becomes
#   /tmp/site:$PWD; without one, PYTHONPATH is $PWD. Returns 1 when pip fails.
install_carried_wheels() {
    if [ -d .whl ]; then
        pip_install_carried /tmp/site .whl/*.whl >"$1" 2>&1 || return 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
}

# install_carried_wheels_if_missing LOG
#   install_carried_wheels, skipped (LOG untouched) where cffi and gguf import already; the import
#   is not tried where there is no .whl/. Skipped, PYTHONPATH becomes $PWD followed by what it held:
#   a caller that installed the wheels itself (PYTHONPATH=/tmp/site:...) keeps them (dropping it
#   once cost a device call its whole A/B: "No module named 'gguf'").
install_carried_wheels_if_missing() {
    if [ -d .whl ] && ! python3 -c "import cffi, gguf" 2>/dev/null; then
        install_carried_wheels "$1"
    else
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
}

# record_gpu FILE [FIELDS]
#   nvidia-smi's CSV of every GPU, printed and kept in FILE (its error too, where it fails). FIELDS
#   are --query-gpu's names; the default is what a kernel timing is read against: the card, its
#   memory in use and its SM and memory clocks.
record_gpu() {
    nvidia-smi --query-gpu="${2:-name,compute_cap,memory.used,clocks.sm,clocks.mem}" --format=csv 2>&1 | tee "$1"
}

# detected_cuda_arch
#   The first GPU's compute capability as nvcc's architecture number (9.0 -> 90); empty where
#   nvidia-smi fails (its error on stderr).
detected_cuda_arch() {
    nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i 0 | head -1 | tr -d '. '
}

# build_native_if_stale [ARCHS]
#   The native library (openjet_plugin/native) built for ARCHS, unless the one there was built
#   from the same sources for the same architectures. ARCHS defaults to $OPENJET_CUDA_ARCHS, else
#   90 (the H100 / H200 of the device machines); an ARCHS given empty is passed on empty.
build_native_if_stale() {
    OPENJET_CUDA_ARCHS=${1-${OPENJET_CUDA_ARCHS:-90}} python3 -m openjet_plugin.build_native --if-stale
}

# load_or_build_native LOG
#   The carried native library as is when it loads, else a full build for sm_90 (OPENJET_CUDA_ARCHS
#   is not read); both outputs in LOG (replaced). Returns the build's status.
load_or_build_native() {
    python3 -c "from openjet_plugin import _native; _native.load()" >"$1" 2>&1 \
        || OPENJET_CUDA_ARCHS=90 python3 -m openjet_plugin.build_native >>"$1" 2>&1
}

# bench_q27b LOG
#   The bench's generated q27b (bench/runner.py default_model, with the bench's MTP head: made once
#   into $OPENJET_CACHE_DIR/bench) as a path on stdout; the generation's output in LOG (replaced).
#   Returns 1, naming the problem on stderr with LOG's tail, where there is no such file.
bench_q27b() {
    local m
    m=$(python3 -c "import sys; from pathlib import Path; from openjet_plugin.bench.runner import default_model; print(default_model(Path(sys.argv[1]), print))" \
        "$OPENJET_CACHE_DIR/bench" 2>"$1" | tail -1)
    [ -f "$m" ] || { echo "no q27b model ($m)" >&2; tail -5 "$1" >&2; return 1; }
    echo "$m"
}

# q27b_setup NAME
#   The start of a script that runs the bench's q27b: OUT (default /tmp/openjet-NAME-out) made, the
#   bench cache under OPENJET_CACHE_DIR, the carried wheels, the native library, and M set to the
#   q27b's path; logs pip.log, native-load.log and model.log under OUT. Returns 1 (the failing
#   log's tail shown) where a step fails.
q27b_setup() {
    OUT=${OUT:-/tmp/openjet-$1-out}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1 OPENJET_CACHE_DIR=${OPENJET_CACHE_DIR:-$PWD/build/cache}
    mkdir -p "$OPENJET_CACHE_DIR/bench"
    install_carried_wheels_if_missing "$OUT/pip.log" || { tail -5 "$OUT/pip.log"; return 1; }
    load_or_build_native "$OUT/native-load.log" || { tail -20 "$OUT/native-load.log"; return 1; }
    M=$(bench_q27b "$OUT/model.log") || return 1
}

# compile_harness LOG NVCC_ARGUMENT...
#   A kernel harness (native/tools/) compiled by nvcc, its output in LOG (replaced: with -Xptxas -v
#   it holds the register report the scripts read). On failure shows LOG's last 30 lines and returns 1.
compile_harness() {
    local log=$1
    shift
    nvcc "$@" >"$log" 2>&1 || { tail -30 "$log"; return 1; }
}
