// gemm_wgmma_split_check.cu: gemm_wgmma.cuh's split-K decision on the CPU (no GPU needed): the split
// split_for gives the 27B's Q4_K projection shapes at 64, 77, 128 and 2,048 positions on 132 SMs
// under the default configuration, and how many partial slices fit a workspace past the prepared X.
// Prints one JSON object per case; tests/test_gemm_wgmma_split.py runs it and checks the rules.
// With an argument it calls gemmwg::run with a bad split instead ("range": 9, "room": 3 splits in a
// workspace that holds only the prepared X), whose refusal comes before any device call: the
// harness's fail() prints it and exits 2.
//
//   nvcc -std=c++17 -arch=sm_90 -Inative native/tools/gemm_wgmma_split_check.cu -o gwsplit [range|room]
#include <cstdio>
#include <cstring>

#include "engine.cuh"
#include "gemm_wgmma.cuh"

#include "tools/harness.cuh"

using namespace oj;

int main(int argc, char **argv) {
    if (argc > 1) {
        Matrix w;
        w.type = TYPE_Q4_K;
        w.K = 17408;
        w.M = 5120;
        w.data = reinterpret_cast<uint8_t *>(uintptr_t(256));   // never read: the call is refused first
        const int64_t P = 64;
        const bool range = std::strcmp(argv[1], "range") == 0;
        gemmwg::run(w, nullptr, P, nullptr, false, 0, gemmwg::Config{0, 0, 0}, range ? 0 : gemm_f16_workspace_bytes(w.K, P),
                    range ? 9 : 3);
        std::printf("not refused\n");
        return 0;
    }
    const gemmwg::Config c = gemmwg::CONFIGS[0];
    // (K, M): ffn_down, ssm_out / attention output, attn_qkv, ffn_gate, attn k / v, ssm_a / b, one super-block
    const long long shapes[][2] = {{17408, 5120}, {6144, 5120}, {5120, 10240}, {5120, 17408}, {5120, 1024}, {5120, 48}, {256, 72}};
    for (const auto &sh : shapes)
        for (long long P : {64LL, 77LL, 128LL, 2048LL}) {
            const long long blocks = gemmwg::grid_blocks(sh[1], P, c);
            const int S = gemmwg::split_for(blocks, sh[0] / QK_K, 132, c.stages);
            std::printf("{\"what\": \"split\", \"K\": %lld, \"M\": %lld, \"P\": %lld, \"blocks\": %lld, \"stages\": %d, \"S\": %d}\n",
                        sh[0], sh[1], P, blocks, c.stages, S);
        }
    // a prefill workspace (widest K 17408, a 2,048-position chunk) at 64 positions
    const size_t capacity = gemm_f16_workspace_bytes(17408, 2048);
    for (const auto &sh : shapes) {
        const long long P = 64;
        std::printf("{\"what\": \"fit\", \"K\": %lld, \"M\": %lld, \"P\": %lld, \"capacity\": %zu, \"x_bytes\": %zu, \"offset\": %zu, "
                    "\"slices\": %lld}\n",
                    sh[0], sh[1], P, capacity, gemm_f16_workspace_bytes(sh[0], P), gemmwg::part_offset(sh[0], P),
                    (long long)gemmwg::parts_that_fit(sh[0], P, sh[1], capacity));
    }
    std::printf("{\"what\": \"max\", \"max_split\": %d}\n", gemmwg::MAX_SPLIT);
    return 0;
}
