// gemm_f16_unit.cu: CPU-only checks of gemm_f16.cuh's arithmetic tricks (no GPU needed):
//   1. the magic-number dequant: for every nibble q (0..15), 6-bit scale sc (0..63) and nibble
//      position (low / high left in place), the half bits, the scale prep (1024 + sc -> sc or
//      sc / 16, the bias -1024 sc or -64 sc) and the HFMA2 give q * sc exactly;
//   2. the __byte_perm selectors (emulated) splat the wanted scale / min bytes;
//   3. the k permutation: a quad's A pairs (from the nibble words as the kernel unpacks them)
//      times the B pairs ldmatrix delivers from the x_perm_dest-permuted X row give exactly the
//      natural-order dot of each sub-block.
//   nvcc -std=c++17 -Inative native/tools/gemm_f16_unit.cu -o gfu && ./gfu
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gemm_f16.cuh"

namespace oj {
[[noreturn]] void fail(int code, const std::string &message) {
    std::fprintf(stderr, "oj::fail(%d): %s\n", code, message.c_str());
    std::exit(2);
}
void check_cuda(cudaError_t err, const char *what) {
    if (err != cudaSuccess) fail(1, std::string(what) + ": " + cudaGetErrorString(err));
}
}  // namespace oj

using namespace oj;

static int failures = 0;
#define EXPECT(c, ...)                         \
    do {                                       \
        if (!(c)) {                            \
            ++failures;                        \
            if (failures < 20) {               \
                std::printf("FAIL: " __VA_ARGS__); \
                std::printf("\n");             \
            }                                  \
        }                                      \
    } while (0)

static double hv(uint16_t bits) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return (double)__half2float(h);
}
// round a double to fp16 and back (the one rounding of an fma / mul)
static double rh(double v) { return (double)__half2float(__float2half_rn((float)v)); }
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; ++n) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}

int main() {
    // 1. dequant
    for (int nib = 0; nib < 2; ++nib)
        for (int sc = 0; sc < 64; ++sc) {
            const uint32_t p = byte_perm((uint32_t)sc << 16, 0x64646464u, gemmf16::splat_byte_sel(2));
            const double plo = hv(p & 0xFFFF), phi = hv(p >> 16);
            EXPECT(plo == 1024 + sc && phi == 1024 + sc, "splat of sc %d gives %g %g", sc, plo, phi);
            const double scH = nib ? rh(plo * 0.0625 - 64.0) : rh(plo - 1024.0);
            EXPECT(scH == (nib ? sc / 16.0 : (double)sc), "scale prep nib %d sc %d -> %g", nib, sc, scH);
            const double biH = rh(scH * -1024.0);
            EXPECT(biH == (nib ? -64.0 * sc : -1024.0 * sc), "bias nib %d sc %d -> %g", nib, sc, biH);
            for (int q = 0; q < 16; ++q)
                for (int q2 = 0; q2 < 16; ++q2) {
                    // bytes 0 and 2 hold (q, q2) in the nibble NIB, the other nibbles random junk
                    const uint32_t junk = 0xA5C3u * (uint32_t)(q * 16 + q2 + 1);
                    const uint32_t w = nib ? ((uint32_t)q << 4 | (uint32_t)q2 << 20 | (junk & 0x0F0F0F0Fu) | 0xF000F000u)
                                           : ((uint32_t)q | (uint32_t)q2 << 16 | (junk & 0xF0F0F0F0u) | 0x0F000F00u);
                    const uint32_t m = nib ? gemmf16::nibble_pair_magic<1>(w) : gemmf16::nibble_pair_magic<0>(w);
                    const double m0 = hv(m & 0xFFFF), m1 = hv(m >> 16);
                    EXPECT(m0 == 1024 + (nib ? 16 : 1) * q && m1 == 1024 + (nib ? 16 : 1) * q2, "magic nib %d q %d %d", nib, q, q2);
                    const double a0 = rh(std::fma(m0, scH, biH)), a1 = rh(std::fma(m1, scH, biH));
                    EXPECT(a0 == (double)q * sc && a1 == (double)q2 * sc, "hfma2 nib %d q %d sc %d -> %g", nib, q, sc, a0);
                }
        }
    // 2. selectors: splat of byte SB; the mins pair (2t, 2t+1) of a word
    for (int sb = 0; sb < 4; ++sb) {
        const uint32_t w = 0x3A2B1C0Du;
        const uint32_t r = byte_perm(w, 0x64646464u, gemmf16::splat_byte_sel(sb));
        const uint32_t b = (w >> (8 * sb)) & 0xFF;
        EXPECT(r == (0x64006400u | b | b << 16), "splat_byte_sel(%d) -> %08x", sb, r);
    }
    for (int t = 0; t < 4; ++t) {
        const int b = (2 * t) & 3;
        const uint32_t w = 0x3A2B1C0Du;
        const uint32_t r = byte_perm(w, 0x64646464u, 0x4040u | b | ((b + 1) << 8));
        EXPECT(r == (0x64006400u | ((w >> (8 * b)) & 0xFF) | (((w >> (8 * (b + 1))) & 0xFF) << 16)), "mins sel t %d", t);
    }
    // 3. k permutation: one row, 4 nibble chunks (8 sub-blocks), random q and x
    {
        uint64_t s = 12345;
        auto rnd = [&] { s = s * 6364136223846793005ull + 1442695040888963407ull; return (uint32_t)(s >> 33); };
        uint8_t qs[128];
        for (auto &b : qs) b = (uint8_t)rnd();
        std::vector<int> x(256), xp(256);
        for (auto &v : x) v = (int)(rnd() % 2001) - 1000;
        // the prep kernel's placement
        std::vector<int> seen(256, 0);
        for (int blk = 0; blk < 8; ++blk)
            for (int l = 0; l < 32; ++l) {
                xp[blk * 32 + gemmf16::x_perm_dest(l)] = x[blk * 32 + l];
                seen[blk * 32 + gemmf16::x_perm_dest(l)]++;
            }
        for (int i = 0; i < 256; ++i) EXPECT(seen[i] == 1, "x_perm_dest not a bijection at %d", i);
        for (int sblk = 0; sblk < 8; ++sblk) {
            const int j = sblk / 2, nib = sblk % 2;
            int64_t direct = 0, mma = 0;
            for (int l = 0; l < 32; ++l) direct += (int64_t)((qs[32 * j + l] >> (4 * nib)) & 15) * x[32 * sblk + l];
            for (int h = 0; h < 2; ++h) {
                const int ks = 2 * sblk + h;
                for (int t = 0; t < 4; ++t) {
                    uint32_t w;
                    std::memcpy(&w, qs + 32 * j + 8 * t + 4 * h, 4);   // raw.x (h 0) / raw.y (h 1)
                    const uint32_t A0 = nib ? gemmf16::nibble_pair_magic<1>(w) : gemmf16::nibble_pair_magic<0>(w);
                    const uint32_t A2 = nib ? gemmf16::nibble_pair_magic<1>(w >> 8) : gemmf16::nibble_pair_magic<0>(w >> 8);
                    auto qv = [&](uint32_t m, int half) {
                        return ((int)((m >> (16 * half)) & 0x3FF) >> (4 * nib));   // (1024 + q or 16 q) - 1024, / 16
                    };
                    // B: ldmatrix row = position, elements 2t, 2t+1 of k 0..7 (b0) / k 8..15 (b1)
                    const int kb = 32 * sblk + 16 * h;   // 16 ks
                    (void)ks;
                    mma += (int64_t)qv(A0, 0) * xp[kb + 2 * t] + (int64_t)qv(A0, 1) * xp[kb + 2 * t + 1];
                    mma += (int64_t)qv(A2, 0) * xp[kb + 8 + 2 * t] + (int64_t)qv(A2, 1) * xp[kb + 8 + 2 * t + 1];
                }
            }
            EXPECT(mma == direct, "k permutation: sub-block %d mma-order dot %lld != natural %lld", sblk, (long long)mma,
                   (long long)direct);
        }
    }
    std::printf("%s (%d failures)\n", failures ? "gemm_f16_unit: FAILED" : "gemm_f16_unit: all checks passed", failures);
    return failures ? 1 : 0;
}
