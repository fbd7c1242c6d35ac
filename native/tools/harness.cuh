// harness.cuh: what a standalone harness under native/tools needs from the engine's support code.
// engine.cu defines fail() and check_cuda() in the library; a harness links only the kernel files
// it tests, so it gets these definitions instead (a failure prints and exits 2), plus CK().
// Include it once per harness executable, after engine.cuh.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine.cuh"

namespace oj {
[[noreturn]] void fail(int code, const std::string &message) {
    std::fprintf(stderr, "oj::fail(%d): %s\n", code, message.c_str());
    std::exit(2);
}
void check_cuda(cudaError_t err, const char *what) {
    if (err != cudaSuccess) fail(OJ_ERR_CUDA, std::string(what) + ": " + cudaGetErrorString(err));
}
// matvec.cu (linked by the harnesses that compare against it): Q4_K / Q6_K on the bf16-split
// reference kernels (0) or the fp16 path, the engine's (anything else)
void matvec_force_path(int path);
}  // namespace oj

#define CK(call) oj::check_cuda((call), #call)
