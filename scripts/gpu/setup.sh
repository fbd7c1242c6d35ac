#!/usr/bin/env bash
# What a user's setup does on a GPU host, on the GPU machine (which reaches no package index):
# `python -m openjet_plugin.setup_llama` builds llama-cpp-python with CUDA for the local GPU, then
# `openjet doctor` on the default model, on a model of another architecture (llama) and with the
# native verdict forced to "unsupported", and a greedy generation through backend="llama.cpp" and
# through backend="auto" on the llama model, each with numpy imported first. Output: the log.
#
#   bash scripts/device_carry.sh --setup    # adds .carry/pip: the sdist and its build backend
#   bash scripts/gpu.sh setup               # ~6 minutes on 16 cores, most of it nvcc
#
# Offline, pip takes the sdist from .carry/pip (PIP_FIND_LINKS, PIP_NO_INDEX) and builds it in the
# image's own environment (PIP_NO_BUILD_ISOLATION=0: that environment's cmake and ninja are
# Python-package shims, which an isolated build environment cannot run).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/common.sh
export PYTHONUNBUFFERED=1
unset LLAMA_CPP_LIB_PATH
[ -d .carry/pip ] || { echo "gpu setup: no .carry/pip (bash scripts/device_carry.sh --setup)"; exit 2; }
pip_install_carried /tmp/site .whl/*.whl .carry/pip/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
echo "=== setup"
t0=$(date +%s)
PIP_NO_BUILD_ISOLATION=0 PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.carry/pip CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    timeout 500 python3 -m openjet_plugin.setup_llama
echo "setup: exit $?, $(( $(date +%s) - t0 )) s"
python3 -c "import llama_cpp; print(llama_cpp.__file__, 'GPU offload:', llama_cpp.llama_supports_gpu_offload())"
python3 -c "from openjet_plugin.testing.foreign import write_llama_gguf; write_llama_gguf('/tmp/foreign.gguf')"
echo "=== doctor (default model)"
timeout 120 python3 -m openjet_plugin.cli doctor 2>&1 | grep -v "^ggml_cuda_init\|^  Device"
echo "=== doctor (llama-architecture model)"
timeout 120 python3 -m openjet_plugin.cli doctor --model /tmp/foreign.gguf 2>&1 | grep "native backend\|backend=auto"
echo "=== doctor (native verdict forced to unsupported)"
timeout 120 python3 -c "
from openjet_plugin import cli
from openjet_plugin.backends import select
select.native_verdict = lambda mf, n_ctx, kv_type='f16': (False, 'forced: sm_75 is too old')
raise SystemExit(cli.main(['doctor']))" 2>&1 | grep "native backend\|backend=auto"
echo "=== generate (numpy imported first): backend='llama.cpp', then auto on the llama model"
for spec in "backend='llama.cpp'" "'/tmp/foreign.gguf'"; do
    timeout 120 python3 -c "
import numpy, openjet_plugin as oj
e = oj.load($spec)
print(e.backend_name, '|', e.backend_reason)
r = e.generate('Hello', max_tokens=8, temperature=0)
print(repr(r.text), r.finish_reason)" 2>&1 | grep -v "^ggml_cuda_init\|^  Device"
done
