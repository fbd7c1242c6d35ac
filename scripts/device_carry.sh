#!/usr/bin/env bash
# What every device call carries (`carry: [".whl", ".carry", ...]`): the GPU machine reaches no
# package registry and runs Python 3.12, and its image (.library/device/KINDS.md) lacks these.
#
#   bash scripts/device_carry.sh           # -> .whl/ (~4 MB of wheels), .carry/llama_cpp_python-*-slim.tar.gz
#   bash scripts/device_carry.sh --setup   # and .carry/pip/ for `gpu.sh setup` (~6 MB)
#
# .whl: what the GPU suite and `openjet bench` import beyond the image: cffi + pycparser (the
# native binding), gguf (model files), llguidance and jsonschema with its own dependencies
# (tests/test_constraints_gpu.py; without them its import failed at collection, and pytest then ran
# no GPU test at all), diskcache (llama-cpp-python's Python package imports it: the fallback rows).
# The versions are those CI installs (pyproject.toml's pins, the venv's
# resolution of the rest on 2026-12-05). scripts/gpu/common.sh installs them with --no-deps into
# /tmp/site. .carry: the llama-cpp-python sdist without the parts its build never reads
# (openjet_plugin/bench/peer.py pack), from which the bench builds llama.cpp with CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl \
    cffi==2.1.1 pycparser==3.12 gguf==0.19.0 llguidance==1.9.1 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    diskcache==5.6.3 \
    2>&1 | grep -v "^WARNING: Location" || true
n=$(ls .whl/*.whl 2>/dev/null | wc -l)
[ "$n" -eq 9 ] || { echo "device_carry: $n wheels in .whl, expected 9"; exit 1; }
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
ls .carry/llama_cpp_python-*-slim.tar.gz >/dev/null 2>&1 || "$PY" -m openjet_plugin.bench.peer pack --out .carry
if [ "${1:-}" = --setup ]; then
    # what `openjet setup` needs offline: the sdist under the name pip looks for (the slim one
    # builds the package: it drops only what no build reads) and its build backend; cmake and
    # ninja are the image's own
    rm -rf .carry/pip
    mkdir -p .carry/pip
    cp .carry/llama_cpp_python-*-slim.tar.gz .carry/pip/llama_cpp_python-0.3.36.tar.gz
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d .carry/pip \
        scikit-build-core==1.1.2 pathspec==1.1.1 packaging==26.4 2>&1 | grep -v "^WARNING: Location" || true
fi
du -sh .whl .carry
