// persistent_settings_check.cu: the persistent kernel's switches (persistent_settings.h) on the CPU:
// prints what the environment gives as one JSON line; a refused value exits 2 with the message
// (harness.cuh's fail). tests/test_persistent_settings.py runs it.
//
//   nvcc -std=c++17 -arch=sm_90 -Inative native/tools/persistent_settings_check.cu -o pss
#include <cstdio>

#include "engine.cuh"
#include "persistent_settings.h"

#include "tools/harness.cuh"

int main() {
    const oj::PersistentSettings s = oj::persistent_settings();
    std::printf("{\"mode\": %d, \"stages\": %d, \"split_model\": %s, \"prefetch\": %s, \"profile\": \"%s\"}\n", s.mode, s.stages,
                s.split_model ? "true" : "false", s.prefetch ? "true" : "false", s.profile.c_str());
    return 0;
}
