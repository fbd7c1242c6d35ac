// matvec_f16_config_check.cu: matvec_f16.cuh's host-side configuration on the CPU (no GPU needed):
// which types stream on the copy engine, the stage count stages_for picks for
// each type, vector count and device, the stages' 128-byte rounding and the shared-memory size with
// its barriers, and where Q6_K's swizzled x is stored and loaded. Prints one JSON object per case; tests/test_matvec_f16_config.py runs it and
// checks the rules.
//
//   nvcc -std=c++17 -arch=sm_90 -Inative native/tools/matvec_f16_config_check.cu -o mvcfg
#include <cstdio>

#include "engine.cuh"
#include "matvec_f16.cuh"

#include "tools/harness.cuh"

using namespace oj;

template <int TYPE, int WARPS, int STAGES>
static void smem_line(int n_vec) {
    std::printf("{\"what\": \"smem\", \"type\": %d, \"warps\": %d, \"stages\": %d, \"n_vec\": %d, \"stage_bytes\": %d, "
                "\"smem\": %zu}\n",
                TYPE, WARPS, STAGES, n_vec, mvf16::stage_bytes(TYPE, n_vec), mvf16::smem_bytes<TYPE, WARPS, STAGES>(n_vec));
}

int main() {
    for (int type : {TYPE_Q4_K, TYPE_Q6_K})
        std::printf("{\"what\": \"tma_for\", \"type\": %d, \"on\": %s}\n", type, mvf16::tma_for(type) ? "true" : "false");
    // an H200 (cc 9.0: 227 KB per block, 228 KB per SM) and a cc 8.6 card (99 KB, 100 KB)
    mvf16::Device h200, a6000;
    h200.n_sm = 132, h200.smem_sm = 233472, h200.optin = 232448, h200.pdl = true;
    a6000.n_sm = 84, a6000.smem_sm = 102400, a6000.optin = 101376, a6000.pdl = false;
    for (const auto &[name, d] : {std::make_pair("h200", h200), std::make_pair("cc86", a6000)})
        for (int type : {TYPE_Q4_K, TYPE_Q6_K})
            for (int warps : {4, 8})
                for (int n_vec : {1, 5, 8})
                    for (int forced : {0, 2, 3}) {
                        const size_t sb = (size_t)mvf16::stage_bytes(type, n_vec);
                        std::printf("{\"what\": \"stages\", \"device\": \"%s\", \"type\": %d, \"warps\": %d, \"n_vec\": %d, "
                                    "\"forced\": %d, \"stage_bytes\": %zu, \"stages\": %d, \"optin\": %d, \"smem_sm\": %d}\n",
                                    name, type, warps, n_vec, forced, sb,
                                    mvf16::stages_for(d, type, warps, sb, forced), d.optin, d.smem_sm);
                    }
    // Q6_K's swizzled x: where the prep stores each vector's columns, the unswizzled order, and
    // each lane's two loads (tests/test_matvec_f16_config.py composes them)
    std::printf("{\"what\": \"q6_x\", \"dest\": [");
    for (int c = 0; c < 256; ++c) std::printf("%s%d", c ? ", " : "", mvf16::x_dest(TYPE_Q6_K, c));
    std::printf("], \"store\": [");
    for (int v = 0; v < 8; ++v) {
        std::printf("%s[", v ? ", " : "");
        for (int c = 0; c < 256; ++c) std::printf("%s%d", c ? ", " : "", mvf16::q6_x_store(v, c));
        std::printf("]");
    }
    std::printf("], \"load\": [");
    for (int g = 0; g < 8; ++g)
        for (int t = 0; t < 4; ++t)
            std::printf("%s[%d, %d]", g + t ? ", " : "", mvf16::q6_x_load(g, t, 0), mvf16::q6_x_load(g, t, 1));
    std::printf("], \"vec_bytes\": %d}\n", mvf16::vec_bytes(TYPE_Q6_K));
    for (int n_vec = 1; n_vec <= 8; ++n_vec) {
        smem_line<TYPE_Q4_K, 4, 2>(n_vec);
        smem_line<TYPE_Q4_K, 4, 3>(n_vec);
        smem_line<TYPE_Q6_K, 4, 2>(n_vec);
        smem_line<TYPE_Q6_K, 8, 2>(n_vec);
    }
    return 0;
}
