// pass_shape_check.cu: engine.cuh's host-side rule for a captured pass's attention grid on the CPU
// (no GPU needed): attention_split_bucket for every needed split count up to 300 under two
// allocations. Prints one JSON object per case; tests/test_pass_shapes.py runs it and checks the rule.
//
//   nvcc -std=c++17 -arch=sm_90 -Inative native/tools/pass_shape_check.cu -o passcheck
#include <cstdio>

#include "engine.cuh"

int main() {
    for (int max_splits : {128, 300})
        for (int splits = 1; splits <= max_splits; ++splits)
            std::printf("{\"splits\": %d, \"max_splits\": %d, \"bucket\": %d}\n", splits, max_splits,
                        oj::attention_split_bucket(splits, max_splits));
    return 0;
}
