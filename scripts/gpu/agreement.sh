#!/usr/bin/env bash
# Issue 25's agreement with llama.cpp on the GPU machine in one command: the `agreement` group of
# `openjet bench` (openjet_plugin/bench/agreement.py) through scripts/gpu/bench.sh, which sets up
# the carried wheels, builds the native engine and llama.cpp (CUDA, in the background) and leaves
# the report under $OUT. Rows: teacher-forced top-1 and mean KL of our engine against llama.cpp
# (native/tools/llama_logits, compiled against the same libllama) on the q27b at depth 30,720 and on
# the trained default model at depths 0 and 2,048, 2,048 positions each (--quick: 256 positions,
# q27b at depth 4,096, the default model at 0 and 3,840); the report's agreement section gives the
# thresholds (top-1 >= 0.99, mean KL <= 1e-3) and pass / fail per row, and under the default model's
# rows the numpy reference against the same llama.cpp (the floor llama.cpp's own rounding sets).
#
#   OPENJET_COMMIT=<sha> bash scripts/gpu.sh agreement [openjet bench arguments, e.g. --quick]
#
# Carry, environment, budget and exit status: as scripts/gpu/bench.sh (a run out of time exits 3:
# run the same command again, the llama.cpp build and finished rows are reused).
exec bash "$(dirname "$0")/bench.sh" --only agreement "$@"
