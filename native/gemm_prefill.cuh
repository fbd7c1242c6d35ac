// gemm_prefill.cuh: quantised weights x many positions on the integer tensor cores (prefill).
//
// Y[p][m] (+)= sum_k W[m][k] * X[p][k] for P positions (any P >= 1), W in the engine's device
// layouts (quant_blocks.cuh: Q4_K / Q5_K as stored, Q6_K regrouped planes, Q8_0 planar; what
// matvec.cu's to_device_layout produces). prefill.cu runs every projection of a prefill pass
// through it; tools/gemm_bench.cu (scripts/gpu.sh gemm) checks and times it alone.
//
// Arithmetic (int8 activations per 32 values, as llama.cpp's q8_1; the int8 decode matvec it was
// written beside is gone, the comparisons with "matvec" below are with that path's rules):
//   - X is quantised once per call, per 32 values, exactly as quantize_x_kernel below does it
//     (d = amax / 127, q = __float2int_rn(x / d), the block sum by the same xor-shuffle tree), into
//     a caller-provided workspace; Q6_K takes the same in-block permutation (q6_x_pos);
//   - integer mma.sync m16n8k32 (u8 x s8 for Q4_K / Q5_K, s8 x s8 for Q8_0) and m16n8k16 for
//     Q6_K (its scale groups are 16 values) give exact per-32 (per-16) integer dots;
//   - scaling in fp32 per (row, position, 32-value block): Q4_K c * sc as one IMAD into the 2^23
//     magic, times d_x, summed over the super-block, times d; the mins times the block's fp32
//     sum of x (exact, not the quantised sum), as matvec does.
// What differs from matvec: matvec splits K over warps and sums their partials at the end; here
// one warp walks all of K, and Q6_K / Q8_0 fold the super-block / block fp16 d into the scale
// before the multiply. Integer dots identical, fp32 roundings ordered differently: ~1e-7 of
// sum |w x| apart (the harness bars 1e-5).
//
// Tiles: a block is 8 warps computing BM = 128 weight rows (4 warps x 32) x BN = 64 positions
// (2 warps x 32); each warp holds 2 m16 tiles x 4 n8 tiles. One K step is one super-block (256
// values; 8 Q8_0 blocks): its weight bytes (BM rows) and int8 X (64 positions x 256 bytes + 8 x
// 64 (d, sum)) go to shared memory with cp.async (16 bytes, L2 only), STAGES deep, so every
// weight byte fetched is unpacked once per warp and used for 32 positions, and each X byte for
// 32 rows. The weights are read once per 64 positions from L2: block x = position tile (fastest),
// so the blocks in flight share row tiles and DRAM sees each weight byte ~once per call.
// Shared-memory row strides are padded so that a warp's 8-byte fragment loads are free of bank
// conflicts (rows of 8 lanes-groups g land 8 words apart: stride = 8 or 24 words mod 32).
// Limits: K % 256 == 0 (every 27B matrix; the engine's Q8_0 K % 32 tails are left to matvec),
// M >= 1, P >= 1; rows past M / positions past P are computed on clamped / zero data and never
// written.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine.cuh"
#include "int8_mma.cuh"

namespace oj {
namespace gemm {

constexpr int BN = 64;          // positions per block
constexpr int X_STRIDE = 288;   // bytes per position row of X in shared memory (256 + 32 pad)
constexpr int KSTEP = 256;      // K values per pipeline step

// Per type: bytes copied per weight row per step (main part), its shared-memory stride, and an
// auxiliary 16-byte-per-row part (Q6_K scales, Q8_0 d).
template <int TYPE> struct WLayout;
template <> struct WLayout<TYPE_Q4_K> { static constexpr int COPY = 144, STRIDE = 160, AUX = 0; };
template <> struct WLayout<TYPE_Q5_K> { static constexpr int COPY = 176, STRIDE = 224, AUX = 0; };
template <> struct WLayout<TYPE_Q6_K> { static constexpr int COPY = 192, STRIDE = 192, AUX = 16; };
template <> struct WLayout<TYPE_Q8_0> { static constexpr int COPY = 256, STRIDE = 288, AUX = 16; };

template <int TYPE, int BM>
__host__ __device__ constexpr int stage_bytes() {
    return BM * WLayout<TYPE>::STRIDE + BM * WLayout<TYPE>::AUX + BN * X_STRIDE + 8 * BN * 8;
}

inline int64_t padded_positions(int64_t P) { return (P + BN - 1) / BN * BN; }

// Workspace for the quantised X: int8 q [P_pad][K], then (d, sum) float2 [K/32][P_pad].
inline size_t workspace_bytes(int64_t K, int64_t P) {
    const int64_t pp = padded_positions(P);
    return (size_t)pp * K + (size_t)(K / 32) * pp * 8;
}

// ---------------------------------------------------------------------------------------------
// device helpers

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(void *dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
#endif
}
__device__ __forceinline__ void cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }


// q6_x_pos: value i of a 32-value x block sits at 8 t + 4 c1 + j (i = 16 c1 + 4 t + j)
__host__ __device__ inline int q6_x_pos(int i) { return 8 * ((i >> 2) & 3) + 4 * (i >> 4) + (i & 3); }

// One warp per (position, 32-value block), positions up to P_pad (zeros past P). The arithmetic
// is the one tests/test_act_int8.py transcribes, value for value.
template <bool Q6ORDER>
__global__ void __launch_bounds__(256)
quantize_x_kernel(const float *__restrict__ x, int64_t K, int64_t P, int64_t P_pad, int8_t *__restrict__ q,
                  float2 *__restrict__ ds) {
    const int64_t nb32 = K / 32;
    const int64_t wid = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (wid >= P_pad * nb32) return;
    const int64_t v = wid / nb32;
    const int64_t b = wid - v * nb32;
    const float xv = v < P ? x[v * K + b * 32 + lane] : 0.0f;
    float amax = fabsf(xv), sum = xv;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    const float d = amax / 127.0f;
    const int qv = amax == 0.0f ? 0 : __float2int_rn(xv / d);
    q[v * K + b * 32 + (Q6ORDER ? q6_x_pos(lane) : lane)] = (int8_t)qv;
    if (lane == 0) ds[b * P_pad + v] = make_float2(d, sum);
}

// ---------------------------------------------------------------------------------------------
// The GEMM kernel.

struct Args {
    Matrix w;
    const int8_t *xq;    // [P_pad][K]
    const float2 *xds;   // [K/32][P_pad]
    float *y;            // [P][M]
    int64_t P, P_pad;
    bool accumulate;
};

// Copies step u's weight rows and X into one stage (every thread, 16-byte chunks).
template <int TYPE, int BM>
__device__ __forceinline__ void load_stage(const Args &a, uint8_t *st, int64_t m0, int64_t n0, int64_t u) {
    using L = WLayout<TYPE>;
    constexpr int WCH = L::COPY / 16, ACH = L::AUX / 16;
    constexpr int NW = BM * WCH, NA = BM * ACH, NX = BN * 16, ND = 8 * BN * 8 / 16;
    constexpr int TOTAL = NW + NA + NX + ND;
    uint8_t *ws = st, *wa = st + BM * L::STRIDE, *xs = wa + BM * L::AUX, *dss = xs + BN * X_STRIDE;
    const int64_t K = a.w.K, M = a.w.M, nb = K / QK_K;
    for (int c = threadIdx.x; c < TOTAL; c += blockDim.x) {
        if (c < NW) {
            const int row = c / WCH, ch = c - row * WCH;
            const int64_t gr = min(m0 + row, M - 1);
            const uint8_t *src;
            if constexpr (TYPE == TYPE_Q4_K) src = a.w.data + q4_K_offset(gr, u, nb);
            else if constexpr (TYPE == TYPE_Q5_K) src = a.w.data + (gr * nb + u) * L::COPY;
            else if constexpr (TYPE == TYPE_Q6_K) src = a.w.data + q6_K_planes(M, K).q + q6_K_q_offset(gr, u, nb);
            else src = a.w.data + gr * K + u * KSTEP;   // Q8_0 qs plane starts at 0
            cp16(ws + row * L::STRIDE + 16 * ch, src + 16 * ch);
        } else if (c < NW + NA) {
            const int row = c - NW;
            const int64_t gr = min(m0 + row, M - 1);
            const uint8_t *src;
            if constexpr (TYPE == TYPE_Q6_K) src = a.w.data + q6_K_planes(M, K).sc + q6_K_sc_offset(gr, u, nb);
            else src = a.w.data + q8_0_planes(M, K).d + (gr * (K / 32) + u * 8) * 2;
            cp16(wa + row * 16, src);
        } else if (c < NW + NA + NX) {
            const int cc = c - NW - NA, pos = cc >> 4, ch = cc & 15;
            cp16(xs + pos * X_STRIDE + 16 * ch, a.xq + (n0 + pos) * K + u * KSTEP + 16 * ch);
        } else {
            const int cc = c - NW - NA - NX, b = cc >> 5, ch = cc & 31;
            cp16(dss + b * (BN * 8) + 16 * ch,
                 reinterpret_cast<const uint8_t *>(a.xds + (u * 8 + b) * a.P_pad + n0) + 16 * ch);
        }
    }
}

// Per-lane state: 2 m-tiles x 4 n-tiles x 4 C values.
struct Acc {
    float v[2][4][4];
};

// Q4_K / Q5_K step: lane t reads 8 bytes at 8t of 32-byte chunk j of its rows (matvec's order);
// sub-block s = 2 j + nib uses x block s, bytes 8t..8t+7 (natural order).
template <bool Q5>
__device__ __forceinline__ void step_q4_q5(const uint8_t *ws, const uint8_t *xs, const uint8_t *dss, int wm, int wn,
                                           int g, int t, Acc &acc) {
    constexpr int STRIDE = Q5 ? 176 + 48 : 160, QS = Q5 ? 48 : 16;
    const uint8_t *wrow[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) wrow[ri] = ws + (wm * 32 + 16 * (ri >> 1) + g + 8 * (ri & 1)) * STRIDE;
    float d[4], dmin[4];
    uint32_t scw[4][2], mnw[4][2];
    uint2 qh[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        const uint4 h = *reinterpret_cast<const uint4 *>(wrow[ri]);
        d[ri] = half_bits(h.x & 0xFFFFu);
        dmin[ri] = half_bits(h.x >> 16);
        scw[ri][0] = h.y & 0x3F3F3F3Fu;
        mnw[ri][0] = h.z & 0x3F3F3F3Fu;
        scw[ri][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
        mnw[ri][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
        if constexpr (Q5) qh[ri] = *reinterpret_cast<const uint2 *>(wrow[ri] + 16 + 8 * t);
    }
    float s1[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s1[i][n][e] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint2 qv[4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) qv[ri] = *reinterpret_cast<const uint2 *>(wrow[ri] + QS + 32 * j + 8 * t);
#pragma unroll
        for (int nib = 0; nib < 2; ++nib) {
            const int s = 2 * j + nib, SB = s & 3, SW = s >> 2;
            uint2 bx[4];
            float4 dsv[4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                bx[n] = *reinterpret_cast<const uint2 *>(xs + (wn * 32 + 8 * n + g) * X_STRIDE + 32 * s + 8 * t);
                dsv[n] = *reinterpret_cast<const float4 *>(dss + (s * BN + wn * 32 + 8 * n + 2 * t) * 8);
            }
            int sci[4];
            float scf[4], dmn[4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) {
                sci[ri] = (int)__byte_perm(scw[ri][SW], 0u, 0x4440u | SB);
                scf[ri] = byte_fr(scw[ri][SW], SB);
                dmn[ri] = dmin[ri] * byte_fr(mnw[ri][SW], SB);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                uint32_t a[4];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint2 wv = qv[2 * i + r];
                    const uint32_t lo0 = nib ? (wv.x >> 4) : wv.x, lo1 = nib ? (wv.y >> 4) : wv.y;
                    if constexpr (Q5) {
                        const uint2 hv = qh[2 * i + r];
                        const uint32_t h0 = (s <= 4) ? (hv.x << (4 - s)) : (hv.x >> (s - 4));
                        const uint32_t h1 = (s <= 4) ? (hv.y << (4 - s)) : (hv.y >> (s - 4));
                        a[r] = (lo0 & 0x0F0F0F0Fu) | (h0 & 0x10101010u);
                        a[2 + r] = (lo1 & 0x0F0F0F0Fu) | (h1 & 0x10101010u);
                    } else {
                        a[r] = lo0 & 0x0F0F0F0Fu;
                        a[2 + r] = lo1 & 0x0F0F0F0Fu;
                    }
                }
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    int c[4] = {0, 0, 0, 0};
                    mma_k32(c, a[0], a[1], a[2], a[3], bx[n].x, bx[n].y, true);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int ri = 2 * i + (e >> 1);
                        const float dx = (e & 1) ? dsv[n].z : dsv[n].x, sx = (e & 1) ? dsv[n].w : dsv[n].y;
                        if constexpr (Q5) {
                            s1[i][n][e] += i2f(c[e]) * (scf[ri] * dx);
                        } else {
                            // |c| <= 32 * 15 * 127, times a 6-bit scale < 2^22: exact in the magic
                            s1[i][n][e] += (__int_as_float(c[e] * sci[ri] + (int)MAGIC_I2F) - 12582912.0f) * dx;
                        }
                        acc.v[i][n][e] = fmaf(-dmn[ri], sx, acc.v[i][n][e]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc.v[i][n][e] = fmaf(d[2 * i + (e >> 1)], s1[i][n][e], acc.v[i][n][e]);
}

// Q6_K step (regrouped planes; matvec.cu's q6_s8): half H covers groups C = 2H + c1, lane t reads
// words C of each 64-byte kind (8 bytes at 16t + 8H); x block XB = 4H + QQ, bytes 8t..8t+7 in the
// q6_x_pos order (the first word for c1 = 0, the second for c1 = 1). The super-block's fp16 d
// (dq, loaded from global by the caller) is folded into each 16-value group's scale.
template <int C, int QQ>
__device__ __forceinline__ uint32_t q6_s8(uint32_t A, uint32_t H) {
    constexpr int SH = 4 * (QQ >> 1);
    const uint32_t v = ((A >> SH) & 0x0F0F0F0Fu) | (shr<2 * QQ - 4>(H) & 0x30303030u);
    return (v + 0x60606060u) ^ 0x80808080u;   // 0..63 -> -32..31 as int8, no carries between bytes
}

template <int H, int QQ>
__device__ __forceinline__ void q6_xblock(const uint2 (&qa)[4], const uint2 (&qb)[4], const uint2 (&qhh)[4],
                                          const int8_t *const (&scrow)[4], const float (&dq)[4], const uint8_t *xs,
                                          const uint8_t *dss, int wn, int g, int t, Acc &acc) {
    constexpr int XB = 4 * H + QQ;
    uint2 bx[4];
    float4 dsv[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        bx[n] = *reinterpret_cast<const uint2 *>(xs + (wn * 32 + 8 * n + g) * X_STRIDE + 32 * XB + 8 * t);
        dsv[n] = *reinterpret_cast<const float4 *>(dss + (XB * BN + wn * 32 + 8 * n + 2 * t) * 8);
    }
    float sf0[4], sf1[4];   // d * scale of groups c1 = 0, 1 (ggml's scale index 8H + 2QQ + c1)
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        sf0[ri] = dq[ri] * (float)scrow[ri][8 * H + 2 * QQ];
        sf1[ri] = dq[ri] * (float)scrow[ri][8 * H + 2 * QQ + 1];
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint2 A0 = (QQ & 1) ? qb[2 * i] : qa[2 * i], A1 = (QQ & 1) ? qb[2 * i + 1] : qa[2 * i + 1];
        const uint32_t a00 = q6_s8<2 * H, QQ>(A0.x, qhh[2 * i].x), a01 = q6_s8<2 * H, QQ>(A1.x, qhh[2 * i + 1].x);
        const uint32_t a10 = q6_s8<2 * H + 1, QQ>(A0.y, qhh[2 * i].y);
        const uint32_t a11 = q6_s8<2 * H + 1, QQ>(A1.y, qhh[2 * i + 1].y);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
            mma_k16(c0, a00, a01, bx[n].x);
            mma_k16(c1, a10, a11, bx[n].y);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ri = 2 * i + (e >> 1);
                const float dx = (e & 1) ? dsv[n].z : dsv[n].x;
                // |c| <= 16 * 32 * 127 < 2^22: i2f exact
                const float tsum = fmaf(i2f(c1[e]), sf1[ri], i2f(c0[e]) * sf0[ri]);
                acc.v[i][n][e] = fmaf(tsum, dx, acc.v[i][n][e]);
            }
        }
    }
}

template <int H>
__device__ __forceinline__ void q6_half(const uint8_t *ws, const uint8_t *wa, const float (&dq)[4],
                                        const uint8_t *xs, const uint8_t *dss, int wm, int wn, int g, int t,
                                        Acc &acc) {
    uint2 qa[4], qb[4], qhh[4];
    const int8_t *scrow[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        const int row = wm * 32 + 16 * (ri >> 1) + g + 8 * (ri & 1);
        const uint8_t *q = ws + row * 192 + 16 * t + 8 * H;
        qa[ri] = *reinterpret_cast<const uint2 *>(q);
        qb[ri] = *reinterpret_cast<const uint2 *>(q + 64);
        qhh[ri] = *reinterpret_cast<const uint2 *>(q + 128);
        scrow[ri] = reinterpret_cast<const int8_t *>(wa + row * 16);
    }
    q6_xblock<H, 0>(qa, qb, qhh, scrow, dq, xs, dss, wn, g, t, acc);
    q6_xblock<H, 1>(qa, qb, qhh, scrow, dq, xs, dss, wn, g, t, acc);
    q6_xblock<H, 2>(qa, qb, qhh, scrow, dq, xs, dss, wn, g, t, acc);
    q6_xblock<H, 3>(qa, qb, qhh, scrow, dq, xs, dss, wn, g, t, acc);
}

// Q8_0 step: 8 blocks of 32; lane t reads 8 bytes at 32 s + 8t of its rows (the A operand as
// stored) and the block's fp16 d from the aux part.
__device__ __forceinline__ void step_q8(const uint8_t *ws, const uint8_t *wa, const uint8_t *xs, const uint8_t *dss,
                                        int wm, int wn, int g, int t, Acc &acc) {
    int rowl[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) rowl[ri] = wm * 32 + 16 * (ri >> 1) + g + 8 * (ri & 1);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        uint2 qv[4];
        float dr[4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) {
            qv[ri] = *reinterpret_cast<const uint2 *>(ws + rowl[ri] * 288 + 32 * s + 8 * t);
            dr[ri] = half_bits(*reinterpret_cast<const unsigned short *>(wa + rowl[ri] * 16 + 2 * s));
        }
        uint2 bx[4];
        float4 dsv[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            bx[n] = *reinterpret_cast<const uint2 *>(xs + (wn * 32 + 8 * n + g) * X_STRIDE + 32 * s + 8 * t);
            dsv[n] = *reinterpret_cast<const float4 *>(dss + (s * BN + wn * 32 + 8 * n + 2 * t) * 8);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                int c[4] = {0, 0, 0, 0};
                mma_k32(c, qv[2 * i].x, qv[2 * i + 1].x, qv[2 * i].y, qv[2 * i + 1].y, bx[n].x, bx[n].y, false);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float dx = (e & 1) ? dsv[n].z : dsv[n].x;
                    acc.v[i][n][e] = fmaf(i2f(c[e]), dr[2 * i + (e >> 1)] * dx, acc.v[i][n][e]);
                }
            }
        }
    }
}

// BM = 32 * WM rows (WM warps along M, 2 along N), STAGES-deep cp.async pipeline.
template <int TYPE, int WM, int STAGES>
__global__ void __launch_bounds__(64 * WM, 1) gemm_kernel(const Args a) {
    constexpr int BM = 32 * WM;
    using L = WLayout<TYPE>;
    constexpr int SB = stage_bytes<TYPE, BM>();
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp % WM, wn = warp / WM;
    const int64_t n0 = (int64_t)blockIdx.x * BN, m0 = (int64_t)blockIdx.y * BM;
    const int64_t K = a.w.K, M = a.w.M, nb = K / QK_K;
    const int64_t nsteps = K / KSTEP;

    Acc acc;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc.v[i][n][e] = 0.0f;

    // Q6_K: the super-block d is a 2-byte plane entry (not 4-byte aligned): loaded straight from
    // global one step ahead.
    const uint8_t *dplane = nullptr;
    int64_t grow[4];
    float dq[4] = {0.f, 0.f, 0.f, 0.f}, dq_next[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (TYPE == TYPE_Q6_K) {
        dplane = a.w.data + q6_K_planes(M, K).d;
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) {
            grow[ri] = min(m0 + wm * 32 + 16 * (ri >> 1) + g + 8 * (ri & 1), M - 1);
            dq_next[ri] = __half2float(__ldg(reinterpret_cast<const __half *>(dplane) + grow[ri] * nb));
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nsteps) load_stage<TYPE, BM>(a, smem + s * SB, m0, n0, s);
        cp_commit();
    }
    for (int64_t u = 0; u < nsteps; ++u) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        {
            const int64_t un = u + STAGES - 1;
            if (un < nsteps) load_stage<TYPE, BM>(a, smem + (un % STAGES) * SB, m0, n0, un);
            cp_commit();
        }
        const uint8_t *st = smem + (u % STAGES) * SB;
        const uint8_t *ws = st, *wa = st + BM * L::STRIDE, *xs = wa + BM * L::AUX, *dss = xs + BN * X_STRIDE;
        if constexpr (TYPE == TYPE_Q4_K) step_q4_q5<false>(ws, xs, dss, wm, wn, g, t, acc);
        else if constexpr (TYPE == TYPE_Q5_K) step_q4_q5<true>(ws, xs, dss, wm, wn, g, t, acc);
        else if constexpr (TYPE == TYPE_Q6_K) {
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) {
                dq[ri] = dq_next[ri];
                if (u + 1 < nsteps)
                    dq_next[ri] = __half2float(__ldg(reinterpret_cast<const __half *>(dplane) + grow[ri] * nb + u + 1));
            }
            q6_half<0>(ws, wa, dq, xs, dss, wm, wn, g, t, acc);
            q6_half<1>(ws, wa, dq, xs, dss, wm, wn, g, t, acc);
        } else step_q8(ws, wa, xs, dss, wm, wn, g, t, acc);
    }
    cp_wait<0>();

    // C value e of (i, n): row g + 8 (e >> 1) of m-tile i, position 2t + (e & 1) of n-tile n
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int64_t row = m0 + wm * 32 + 16 * i + g + 8 * (e >> 1);
            if (row >= M) continue;
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int64_t pos = n0 + wn * 32 + 8 * n + 2 * t + (e & 1);
                if (pos >= a.P) continue;
                float *dst = a.y + pos * M + row;
                *dst = a.accumulate ? *dst + acc.v[i][n][e] : acc.v[i][n][e];
            }
        }
}

// ---------------------------------------------------------------------------------------------
// host side

struct Config {
    int wm, stages;   // warps along M (BM = 32 wm), pipeline depth
};

template <int TYPE, int WM, int STAGES>
inline void launch_cfg(const Args &a, cudaStream_t st) {
    constexpr int SMEM = STAGES * stage_bytes<TYPE, 32 * WM>();
    static bool attr_set = false;   // per instance; the harness and engine use one device
    if (!attr_set) {
        check_cuda(cudaFuncSetAttribute(gemm_kernel<TYPE, WM, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
                   "gemm_prefill: shared-memory attribute");
        attr_set = true;
    }
    const dim3 grid((unsigned)(a.P_pad / BN), (unsigned)((a.w.M + 32 * WM - 1) / (32 * WM)));
    gemm_kernel<TYPE, WM, STAGES><<<grid, 64 * WM, SMEM, st>>>(a);
    check_launch("gemm_prefill: kernel");
}

template <int TYPE>
inline int smem_of(const Config &c) {
    return c.stages * (c.wm == 4 ? stage_bytes<TYPE, 128>() : stage_bytes<TYPE, 64>());
}

// The largest configuration that fits the device's per-block shared memory: 128 rows x 3 stages,
// else 128 x 2, else 64 x 2 (sm_86 / sm_120 with ~99 KB). OJ_GEMM_CFG="wm,stages" overrides: kept
// because scripts/gpu.sh gemm times each configuration through it (tools/gemm_bench.cu); users never set it.
template <int TYPE>
inline Config pick_config() {
    static Config cached = {0, 0};
    if (cached.wm) return cached;
    int dev = 0, optin = 0;
    check_cuda(cudaGetDevice(&dev), "gemm_prefill: cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "gemm_prefill: shared-memory limit");
    const Config order[3] = {{4, 3}, {4, 2}, {2, 2}};
    Config c = {0, 0};
    for (const Config &o : order)
        if (smem_of<TYPE>(o) <= optin) { c = o; break; }
    if (const char *e = std::getenv("OJ_GEMM_CFG")) {
        int wm = 0, stg = 0;
        if (std::sscanf(e, "%d,%d", &wm, &stg) == 2 && (wm == 4 || wm == 2) && (stg == 2 || stg == 3)) {
            const Config o = {wm, stg};
            if (smem_of<TYPE>(o) <= optin) c = o;
        }
    }
    if (!c.wm) fail(OJ_ERR_UNSUPPORTED, "gemm_prefill: the device's shared memory per block is too small");
    cached = c;
    return c;
}

template <int TYPE>
inline void launch_type(const Args &a, cudaStream_t st) {
    const Config c = pick_config<TYPE>();
    if (c.wm == 4 && c.stages == 3) launch_cfg<TYPE, 4, 3>(a, st);
    else if (c.wm == 4) launch_cfg<TYPE, 4, 2>(a, st);
    else launch_cfg<TYPE, 2, 2>(a, st);
}

inline void check_shape(const Matrix &w, int64_t P, const char *what) {
    const bool ok_type = w.type == TYPE_Q4_K || w.type == TYPE_Q5_K || w.type == TYPE_Q6_K || w.type == TYPE_Q8_0;
    if (!ok_type) fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": no GEMM kernel for type " + type_name(w.type));
    if (w.K % KSTEP != 0 || w.K <= 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": K must be a positive multiple of 256, got " + std::to_string(w.K));
    if (w.M <= 0) fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": M must be positive");
    if (P < 1) fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": position count must be >= 1");
}

// Quantises X [P][K] into the workspace (workspace_bytes(K, P) bytes) in the order `type` needs
// (Q6_K: q6_x_pos within each block). Matrices of other types with the same K (and, for Q6_K,
// also Q6_K) can reuse it: gemm_run.
inline void quantize_x(const float *x, int64_t K, int64_t P, int type, void *workspace, cudaStream_t st) {
    const int64_t pp = padded_positions(P);
    int8_t *q = static_cast<int8_t *>(workspace);
    float2 *ds = reinterpret_cast<float2 *>(q + (size_t)pp * K);
    const int64_t warps = pp * (K / 32);
    const unsigned grid = (unsigned)((warps + 7) / 8);
    if (type == TYPE_Q6_K) quantize_x_kernel<true><<<grid, 256, 0, st>>>(x, K, P, pp, q, ds);
    else quantize_x_kernel<false><<<grid, 256, 0, st>>>(x, K, P, pp, q, ds);
    check_launch("gemm_prefill: quantize_x");
}

// y[p][m] (+)= W[m] . x[p] from an already quantised X (quantize_x with the same K, P and a
// type of the same x order).
inline void gemm_run(const Matrix &w, const void *workspace, int64_t P, float *y, bool accumulate, cudaStream_t st) {
    check_shape(w, P, "gemm_prefill");
    Args a;
    a.w = w;
    a.P = P;
    a.P_pad = padded_positions(P);
    a.xq = static_cast<const int8_t *>(workspace);
    a.xds = reinterpret_cast<const float2 *>(a.xq + (size_t)a.P_pad * w.K);
    a.y = y;
    a.accumulate = accumulate;
    switch (w.type) {
        case TYPE_Q4_K: launch_type<TYPE_Q4_K>(a, st); break;
        case TYPE_Q5_K: launch_type<TYPE_Q5_K>(a, st); break;
        case TYPE_Q6_K: launch_type<TYPE_Q6_K>(a, st); break;
        default: launch_type<TYPE_Q8_0>(a, st); break;
    }
}

// Both steps: the workspace must hold workspace_bytes(w.K, P).
inline void gemm_prefill(const Matrix &w, const float *x, int64_t P, float *y, bool accumulate, void *workspace,
                         size_t workspace_size, cudaStream_t st) {
    check_shape(w, P, "gemm_prefill");
    if (workspace_size < workspace_bytes(w.K, P))
        fail(OJ_ERR_INVALID_ARGUMENT, "gemm_prefill: workspace of " + std::to_string(workspace_size) + " bytes, need " +
                                          std::to_string(workspace_bytes(w.K, P)));
    quantize_x(x, w.K, P, w.type, workspace, st);
    gemm_run(w, workspace, P, y, accumulate, st);
}

}  // namespace gemm
}  // namespace oj
