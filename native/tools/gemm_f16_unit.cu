// gemm_f16_unit.cu: CPU-only checks of gemm_f16.cuh's arithmetic tricks (no GPU needed):
//   1. the Q4_K magic-number dequant: for every nibble q (0..15), 6-bit scale sc (0..63) and nibble
//      position (low / high left in place), the half bits, the scale prep (1024 + sc -> sc or
//      sc / 16, the bias -1024 sc or -64 sc) and the HFMA2 give q * sc exactly;
//   2. the __byte_perm selectors (emulated) splat the wanted scale / min bytes and pick the byte
//      pairs (0, 2) / (1, 3);
//   3. the k permutation (one X order for every type): a quad's A pairs, unpacked from the words
//      each type's kernel reads, times the B pairs ldmatrix delivers from the x_perm_dest-permuted
//      X row give exactly the natural-order dot of each Q4_K / Q5_K sub-block, each Q6_K scale
//      group (from ggml's ql / qh, regrouped as quant_blocks.cuh says) and each Q8_0 block, and
//      every k16 step of a 32-block covers one 16-value half;
//   4. Q5_K: q5_bytes + q5_pair_magic + HFMA2 give q5 * sc exactly for every q5 (0..31), sc;
//      Q6_K: q6_bytes + the pair selectors + (- 1056) give q - 32 exactly for every 6-bit q;
//      Q8_0: (byte ^ 0x80) under 0x64 minus 1152 gives the int8 exactly for every byte.
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
    // the selectors SEL_LO / SEL_HI: bytes (0, 2) / (1, 3) under 0x64
    {
        const uint32_t w = 0x3A2B1C0Du;
        EXPECT(byte_perm(w, 0x64646464u, gemmf16::SEL_LO) == 0x642B640Du, "SEL_LO");
        EXPECT(byte_perm(w, 0x64646464u, gemmf16::SEL_HI) == 0x643A641Cu, "SEL_HI");
    }
    // 4. the other types' dequant, exhaustively
    for (int sc = 0; sc < 64; ++sc)
        for (int q = 0; q < 32; ++q)
            for (int s5 = 0; s5 < 8; ++s5) {
                // a qs word with q's nibble s5 & 1 in byte 2 and junk elsewhere; qh byte 2 has bit s5 = q >> 4
                const uint32_t junk = 0x9E3779B9u * (uint32_t)(q * 64 + sc + 1);
                uint32_t w = junk & ~(0xFu << (16 + 4 * (s5 & 1)));
                w |= (uint32_t)(q & 15) << (16 + 4 * (s5 & 1));
                uint32_t qh = (junk >> 3) & ~(1u << (16 + s5));
                qh |= (uint32_t)(q >> 4) << (16 + s5);
                const uint32_t w5 = gemmf16::q5_bytes(w, qh, s5);
                const uint32_t m = gemmf16::q5_pair_magic(w5);
                const double mv = hv(m >> 16);
                EXPECT(mv == 1024 + q, "q5 magic q %d s %d -> %g", q, s5, mv);
                const double a = rh(std::fma(mv, (double)sc, -1024.0 * sc));
                EXPECT(a == (double)q * sc, "q5 hfma2 q %d sc %d -> %g", q, sc, a);
            }
    for (int QQ = 0; QQ < 4; ++QQ)
        for (int q = 0; q < 64; ++q) {
            const uint32_t junk = 0x85EBCA6Bu * (uint32_t)(q + 64 * QQ + 1);
            // byte 1 of the ql word holds q's low 4 bits in nibble QQ >> 1; byte 1 of qh bits 2QQ.. = q >> 4
            uint32_t A = junk & ~(0xFu << (8 + 4 * (QQ >> 1)));
            A |= (uint32_t)(q & 15) << (8 + 4 * (QQ >> 1));
            uint32_t H = (junk * 3u) & ~(3u << (8 + 2 * QQ));
            H |= (uint32_t)(q >> 4) << (8 + 2 * QQ);
            const uint32_t v = gemmf16::q6_bytes(A, H, QQ);
            EXPECT(((v >> 8) & 0xFF) == (uint32_t)q, "q6_bytes QQ %d q %d -> %u", QQ, q, (v >> 8) & 0xFF);
            const uint32_t hi = byte_perm(v, 0x64646464u, gemmf16::SEL_HI);
            EXPECT(rh(hv(hi & 0xFFFF) - 1056.0) == q - 32, "q6 magic QQ %d q %d", QQ, q);
        }
    for (int b = 0; b < 256; ++b) {
        const uint32_t w = ((uint32_t)b << 16) ^ 0x80808080u;
        const uint32_t lo = byte_perm(w, 0x64646464u, gemmf16::SEL_LO);
        EXPECT(rh(hv(lo >> 16) - 1152.0) == (double)(int8_t)(uint8_t)b, "q8 magic byte %d", b);
    }

    // 3. k permutation, every type: random quants, random integer x; the mma-order dot (A pairs
    // from the kernel's words x the B pairs ldmatrix gives from the permuted X row) against the
    // natural-order dot of each scale group.
    {
        uint64_t s = 12345;
        auto rnd = [&] { s = s * 6364136223846793005ull + 1442695040888963407ull; return (uint32_t)(s >> 33); };
        std::vector<int> x(256), xp(256);
        for (auto &v : x) v = (int)(rnd() % 2001) - 1000;
        std::vector<int> seen(256, 0);
        for (int blk = 0; blk < 8; ++blk)
            for (int l = 0; l < 32; ++l) {
                xp[blk * 32 + gemmf16::x_perm_dest(l)] = x[blk * 32 + l];
                seen[blk * 32 + gemmf16::x_perm_dest(l)]++;
            }
        for (int i = 0; i < 256; ++i) EXPECT(seen[i] == 1, "x_perm_dest not a bijection at %d", i);
        for (int l = 0; l < 32; ++l)
            EXPECT((gemmf16::x_perm_dest(l) >> 4) == (l >> 4), "x_perm_dest(%d) leaves its 16-value half", l);
        // one k16 step ks of the super-block: lane t's word (4 values as the kernel unpacks them
        // into the (2t, 2t+1) / (2t+8, 2t+9) pairs) times the permuted X
        auto step_dot = [&](int ks, const int (&val)[4][4]) {   // val[t][byte j] = A value of lane t
            int64_t d = 0;
            const int kb = 16 * ks;
            for (int t = 0; t < 4; ++t) {
                d += (int64_t)val[t][0] * xp[kb + 2 * t] + (int64_t)val[t][2] * xp[kb + 2 * t + 1];       // bytes 0, 2
                d += (int64_t)val[t][1] * xp[kb + 8 + 2 * t] + (int64_t)val[t][3] * xp[kb + 8 + 2 * t + 1];   // bytes 1, 3
            }
            return d;
        };
        // Q4_K / Q5_K: qs chunk j (32 bytes), sub-block s = 2 j + nib; Q5 adds qh bit s << 4
        uint8_t qs[128], qhb[32];
        for (auto &b : qs) b = (uint8_t)rnd();
        for (auto &b : qhb) b = (uint8_t)rnd();
        for (int q5 = 0; q5 < 2; ++q5)
            for (int sblk = 0; sblk < 8; ++sblk) {
                const int j = sblk / 2, nib = sblk % 2;
                int64_t direct = 0, mma = 0;
                for (int l = 0; l < 32; ++l) {
                    const int q = ((qs[32 * j + l] >> (4 * nib)) & 15) + (q5 ? ((qhb[l] >> sblk) & 1) * 16 : 0);
                    direct += (int64_t)q * x[32 * sblk + l];
                }
                for (int h = 0; h < 2; ++h) {
                    int val[4][4];
                    for (int t = 0; t < 4; ++t) {
                        uint32_t w, qh;
                        std::memcpy(&w, qs + 32 * j + 16 * h + 4 * t, 4);
                        std::memcpy(&qh, qhb + 16 * h + 4 * t, 4);
                        uint32_t m02, m13;
                        if (q5) {
                            const uint32_t w5 = gemmf16::q5_bytes(w, qh, sblk);
                            m02 = gemmf16::q5_pair_magic(w5);
                            m13 = gemmf16::q5_pair_magic(w5 >> 8);
                        } else {
                            m02 = nib ? gemmf16::nibble_pair_magic<1>(w) : gemmf16::nibble_pair_magic<0>(w);
                            m13 = nib ? gemmf16::nibble_pair_magic<1>(w >> 8) : gemmf16::nibble_pair_magic<0>(w >> 8);
                        }
                        auto qv = [&](uint32_t m, int half) {   // (1024 + q or 1024 + 16 q) - 1024 (/ 16)
                            return ((int)((m >> (16 * half)) & 0x3FF)) >> (q5 ? 0 : 4 * nib);
                        };
                        val[t][0] = qv(m02, 0); val[t][2] = qv(m02, 1);
                        val[t][1] = qv(m13, 0); val[t][3] = qv(m13, 1);
                    }
                    mma += step_dot(2 * sblk + h, val);
                }
                EXPECT(mma == direct, "%s k order: sub-block %d mma-order dot %lld != natural %lld", q5 ? "Q5_K" : "Q4_K",
                       sblk, (long long)mma, (long long)direct);
            }
        // Q6_K: ggml's ql[128] / qh[64], regrouped (quant_blocks.cuh): byte 64 i + 16 t + 4 c + j,
        // c = 2 half + l / 16, l = 16 (l / 16) + 4 t + j
        uint8_t ql[128], qh6[64], reg[192];
        for (auto &b : ql) b = (uint8_t)rnd();
        for (auto &b : qh6) b = (uint8_t)rnd();
        for (int half = 0; half < 2; ++half)
            for (int l = 0; l < 32; ++l) {
                const int t = (l & 15) >> 2, c = 2 * half + (l >> 4), j = l & 3, off = 16 * t + 4 * c + j;
                reg[off] = ql[64 * half + l];
                reg[64 + off] = ql[64 * half + 32 + l];
                reg[128 + off] = qh6[32 * half + l];
            }
        for (int H = 0; H < 2; ++H)
            for (int QQ = 0; QQ < 4; ++QQ)
                for (int c1 = 0; c1 < 2; ++c1) {
                    // ggml: value 128 H + 32 QQ + l (l = 16 c1 + 0..15), scale index 8 H + 2 QQ + c1
                    int64_t direct = 0;
                    for (int l = 16 * c1; l < 16 * c1 + 16; ++l) {
                        const uint8_t L = ql[64 * H + l + 32 * (QQ & 1)];
                        const int q = ((QQ < 2 ? L & 0xF : L >> 4) | (((qh6[32 * H + l] >> (2 * QQ)) & 3) << 4)) - 32;
                        direct += (int64_t)q * x[128 * H + 32 * QQ + l];
                    }
                    const int C = 2 * H + c1, ks = 2 * (4 * H + QQ) + c1;
                    int val[4][4];
                    for (int t = 0; t < 4; ++t) {
                        uint32_t A, Hw;
                        std::memcpy(&A, reg + 64 * (QQ & 1) + 16 * t + 4 * C, 4);
                        std::memcpy(&Hw, reg + 128 + 16 * t + 4 * C, 4);
                        const uint32_t v = gemmf16::q6_bytes(A, Hw, QQ);
                        const uint32_t lo = byte_perm(v, 0x64646464u, gemmf16::SEL_LO), hi = byte_perm(v, 0x64646464u, gemmf16::SEL_HI);
                        val[t][0] = (int)rh(hv(lo & 0xFFFF) - 1056.0); val[t][2] = (int)rh(hv(lo >> 16) - 1056.0);
                        val[t][1] = (int)rh(hv(hi & 0xFFFF) - 1056.0); val[t][3] = (int)rh(hv(hi >> 16) - 1056.0);
                    }
                    const int64_t mma = step_dot(ks, val);
                    EXPECT(mma == direct, "Q6_K k order: half %d quarter %d group %d mma-order dot %lld != natural %lld", H, QQ,
                           c1, (long long)mma, (long long)direct);
                }
        // Q8_0: the int8 row, block s, step h: lane t's word at 32 s + 16 h + 4 t
        int8_t q8[256];
        for (auto &b : q8) b = (int8_t)rnd();
        for (int sb = 0; sb < 8; ++sb) {
            int64_t direct = 0, mma = 0;
            for (int l = 0; l < 32; ++l) direct += (int64_t)q8[32 * sb + l] * x[32 * sb + l];
            for (int h = 0; h < 2; ++h) {
                int val[4][4];
                for (int t = 0; t < 4; ++t) {
                    uint32_t w;
                    std::memcpy(&w, q8 + 32 * sb + 16 * h + 4 * t, 4);
                    w ^= 0x80808080u;
                    const uint32_t lo = byte_perm(w, 0x64646464u, gemmf16::SEL_LO), hi = byte_perm(w, 0x64646464u, gemmf16::SEL_HI);
                    val[t][0] = (int)rh(hv(lo & 0xFFFF) - 1152.0); val[t][2] = (int)rh(hv(lo >> 16) - 1152.0);
                    val[t][1] = (int)rh(hv(hi & 0xFFFF) - 1152.0); val[t][3] = (int)rh(hv(hi >> 16) - 1152.0);
                }
                mma += step_dot(2 * sb + h, val);
            }
            EXPECT(mma == direct, "Q8_0 k order: block %d mma-order dot %lld != natural %lld", sb, (long long)mma, (long long)direct);
        }
    }
    std::printf("%s (%d failures)\n", failures ? "gemm_f16_unit: FAILED" : "gemm_f16_unit: all checks passed", failures);
    return failures ? 1 : 0;
}
