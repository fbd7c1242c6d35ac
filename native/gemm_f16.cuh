// gemm_f16.cuh: quantised weights x P positions on the fp16 tensor cores (prefill), an alternative
// to gemm_prefill.cuh's int8 GEMM for every quantised type of the engine: Q4_K, Q5_K, Q6_K, Q8_0.
//
// Y[p][m] (+)= sum_k W[m][k] * X[p][k], W in the engine's device layouts (quant_blocks.cuh: Q4_K /
// Q5_K as stored, Q6_K regrouped planes, Q8_0 planar; matvec.cu's to_device_layout), X fp32
// [P][K], Y fp32 [P][M]. tools/gemm_f16_bench.cu (scripts/gpu.sh gemm-f16) checks and times it
// beside the int8 kernel.
//
// Why: the int8 kernel's activation scale changes every 32 values, so every m16n8k32 result needs
// ~4 fp32 ops per accumulator (int -> float, x d_x, mins) and the tensor cores wait on the ALU.
// Here X is fp16 with ONE power-of-two scale per position, so the per-block scales move to the
// weight side or into one FFMA per accumulator per block:
//   - B = x * 2^e_p in fp16, e_p chosen per position so that max |x| maps into [2^14, 2^15) (no
//     overflow, subnormals only 2^-28 below the row's largest value); undone exactly at the end.
//     fp16 rounding of x is the ONLY rounding before the fp32 accumulation, for every type;
//   - Q4_K / Q5_K: A = q * sc exactly in fp16 (q 0..15 / 0..31, sc 0..63 6-bit: q * sc <= 1953 <
//     2048), two at a time: (nibbles & mask) | 0x6400 read as half2 is 1024 + q (or 1024 + 16 q
//     for a Q4_K high nibble left in place; Q5_K first forms the 5-bit values in a word's bytes,
//     nibble | qh bit << 4, and takes 5 bits), and one
//     HFMA2 (1024 + q) * sc + (-1024 sc) (resp. sc / 16, -64 sc) is q * sc exactly (one rounding
//     of an exactly representable result). Per super-block (256 values, 16 k16 steps) the mma
//     accumulates into a temporary tile, then acc += d_row * tmp (one FFMA per accumulator per
//     super-block). The mins: sum_s m_s * xsum_s (xsum_s = fp32 sum of the scaled, UNROUNDED x of
//     sub-block s) is one more m16n8k16 per tile per super-block: A' = m_s (exact), B' = xsum_s *
//     2^-6 split into fp16 hi + lo (k 0..7 = hi of sub-blocks 0..7, k 8..15 = lo; the split keeps
//     ~22 bits, 2^-6 keeps |xsum| < 2^14), then acc -= 64 dmin_row * tmp;
//   - Q6_K: q * sc is NOT exact in fp16 (|q| <= 32, |sc| <= 128: up to 13 significant bits), so
//     A = q - 32 alone (exact: 1024 + q6 from the magic, minus 1056) and each 16-value scale
//     group is one m16n8k16 into a temporary, then acc += (d_row * sc_row,group) * tmp (d * sc
//     exact in fp32; one FFMA per accumulator per group). Exact splits of sc into two mma per
//     group (q * (sc >> 2) * 4 + q * (sc & 3) into one temporary) would trade those FFMAs for
//     twice the mma and dequant; with mma the scarcer pipe the FFMA form is the faster one;
//   - Q8_0: A = q (int8, exact: bytes ^ 0x80 under the 0x64 magic is 1024 + 128 + q, minus 1152);
//     the two k16 steps of each 32-value block go into a temporary, then acc += d_row,block * tmp.
//
// k order (one X layout for every type): the mma only needs A's and B's k to agree, so k is
// permuted within each 32-value block to suit the byte-per-value unpacking: for k16 step h (0, 1)
// of a block, lane t of a quad takes the 4 values 16 h + 4 t .. 16 h + 4 t + 3 of its rows (one
// 32-bit word: Q4_K / Q5_K nibble bytes 16 h + 4 t.. of the sub-block's 32-byte chunk, Q8_0 bytes
// of the int8 row, Q6_K the regrouped plane's word c = 2 half + h of lane t, which holds exactly
// values 16 h + 4 t + j of scale group h); bytes 0 and 2 of the word give the A register for mma
// k (2t, 2t+1), bytes 1 and 3 (word >> 8) the one for k (2t+8, 2t+9). Hence mma k index kk
// (0..15) of step h holds value
//   l = 16 h + 4 ((kk & 7) >> 1) + 2 (kk & 1) + (kk >> 3)       of the 32-value block,
// every k16 step covers exactly one 16-value half (= one Q6_K scale group), and the X
// preparation writes x value l of each 32-block at 16 h + kk (x_perm_dest) so that plain ldmatrix
// (non-transposed) of [position][k] rows delivers matching B fragments. One prepared X serves
// every type with the same K (prep_x once, run per matrix).
//
// Tiles: warp = 32 rows (2 m16 tiles) x 64 positions (8 n8 tiles): 64 accumulators + 64
// temporaries per lane. Block = WM warps stacked along M (BM = 32 WM rows) x the same 64
// positions (BN = 64), so every weight byte is dequantised once per 64 positions and each X
// fragment is read by all WM warps from shared memory. One pipeline step = one super-block (256
// values; 8 Q8_0 blocks): BM weight rows, 64 x 512 bytes of fp16 X (row stride 528: conflict-free
// ldmatrix), for Q4_K / Q5_K 64 x 32 bytes of xsum hi/lo, by cp.async, STAGES deep. Shared
// weight rows (bytes per row per step): Q4_K 144, Q5_K 176 (both strides = 4 words mod 8: the
// quad's 32-bit loads of 8 rows are conflict-free), Q6_K 192 (16-byte loads, conflict-free) + 16
// scale bytes in a separate region (its fp16 d is read from global one step ahead), Q8_0 256 + 16
// (the block d's in the pad: stride 272). Grid x = position tiles (fastest) so the blocks in
// flight share weight rows in L2.
// Limits: K % 256 == 0, M >= 1, P >= 1. Rows past M / positions past P are computed on clamped /
// zero data and never written.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine.cuh"
#include "gemm_prefill.cuh"   // cp.async helpers, half_bits

namespace oj {
namespace gemmf16 {

constexpr int BN = 64;            // positions per block (and per warp)
constexpr int X_STRIDE = 528;     // shared bytes per position row of X (512 + 16)
constexpr int XS_STRIDE = 32;     // shared bytes per position of xsum (8 hi + 8 lo halves)
constexpr float XSUM_SCALE = 1.0f / 64.0f;

// Shared-memory weight bytes per row per step (see the header), the separate per-row aux region
// (Q6_K scales), and whether the type has mins (needs the xsum part of X).
__host__ __device__ constexpr int w_row(int type) {
    return type == TYPE_Q4_K ? 144 : type == TYPE_Q5_K ? 176 : type == TYPE_Q6_K ? 192 : 272;
}
__host__ __device__ constexpr int w_aux(int type) { return type == TYPE_Q6_K ? 16 : 0; }
__host__ __device__ constexpr bool has_mins(int type) { return type == TYPE_Q4_K || type == TYPE_Q5_K; }
__host__ __device__ constexpr int stage_bytes(int type, int bm) {
    return bm * (w_row(type) + w_aux(type)) + BN * X_STRIDE + (has_mins(type) ? BN * XS_STRIDE : 0);
}

inline int64_t padded_positions(int64_t P) { return (P + BN - 1) / BN * BN; }

// Workspace: X fp16 [P_pad][K] (k-permuted), xsum hi/lo fp16 [K/256][P_pad][16], 2^-e_p fp32 [P_pad].
struct WsLayout { size_t xh, xs, inv, total; };
inline WsLayout ws_layout(int64_t K, int64_t P) {
    const size_t pp = (size_t)padded_positions(P);
    WsLayout l;
    l.xh = 0;
    l.xs = pp * (size_t)K * 2;
    l.inv = l.xs + (size_t)(K / QK_K) * pp * 32;
    l.total = l.inv + pp * 4;
    return l;
}

// ---------------------------------------------------------------------------------------------
// pieces shared with the host unit check (tools/gemm_f16_unit.cu)

// Where x value l (0..31) of a 32-block goes in the k-permuted X row (see the header comment):
// l = 16 h + 4 t + 2 e + up  ->  16 h + 8 up + 2 t + e.
__host__ __device__ inline int x_perm_dest(int l) {
    const int h = l >> 4, t = (l >> 2) & 3, e = (l >> 1) & 1, up = l & 1;
    return 16 * h + 8 * up + 2 * t + e;
}

// The half2 bit pattern (1024 + q0, 1024 + q1) (NIB 0: low nibbles of bytes 0 and 2 of w) or
// (1024 + 16 q0, 1024 + 16 q1) (NIB 1: high nibbles, left in place).
// One LOP3 ((w & mask) | magic, lut 0xea) on the device: written as C, ptxas emits an AND and an
// OR (a LOP3 takes one immediate), 128 extra instructions per Q4_K step of matvec_f16.
template <int NIB>
__host__ __device__ inline uint32_t nibble_pair_magic(uint32_t w) {
#if defined(__CUDA_ARCH__)
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "n"(NIB ? 0x00F000F0u : 0x000F000Fu), "n"(0x64006400u));
    return r;
#else
    return (w & (NIB ? 0x00F000F0u : 0x000F000Fu)) | 0x64006400u;
#endif
}

// Q5_K: the 4 values (0..31) of sub-block s in a word's 4 bytes: nibble s & 1 of the qs word w
// plus bit s of each qh byte as bit 4. Then q5_pair_magic: (1024 + q5) for bytes 0, 2 (w5) or
// 1, 3 (w5 >> 8); with scale sc and bias -1024 sc the HFMA2 gives q5 * sc <= 1953 exactly.
__host__ __device__ inline uint32_t q5_bytes(uint32_t w, uint32_t qh, int s) {
    const uint32_t lo = (w >> (4 * (s & 1))) & 0x0F0F0F0Fu;
    const uint32_t hi = (s <= 4 ? qh << (4 - s) : qh >> (s - 4)) & 0x10101010u;
    return lo | hi;
}
__host__ __device__ inline uint32_t q5_pair_magic(uint32_t w5) { return (w5 & 0x001F001Fu) | 0x64006400u; }

// Q6_K: the 4 bytes (0..63) of a regrouped word pair: low or high nibble (QQ >> 1) of the ql word
// A plus bits 2 QQ, 2 QQ + 1 of each qh byte as bits 4, 5.
__host__ __device__ inline uint32_t q6_bytes(uint32_t A, uint32_t H, int QQ) {
    const uint32_t lo = (A >> (4 * (QQ >> 1))) & 0x0F0F0F0Fu;
    const int sh = 4 - 2 * QQ;   // 4, 2, 0, -2
    const uint32_t hi = (sh >= 0 ? H << sh : H >> -sh) & 0x30303030u;
    return lo | hi;
}

// __byte_perm selectors over y = 0x64646464: the half2 (1024 + b0, 1024 + b2) / (1024 + b1,
// 1024 + b3) of a word's bytes.
constexpr uint32_t SEL_LO = 0x4240u, SEL_HI = 0x4341u;

// __byte_perm selector placing byte SB of a word into both halves' low bytes over 0x64 high bytes
// (with y = 0x64646464): the half2 (1024 + b, 1024 + b).
__host__ __device__ constexpr uint32_t splat_byte_sel(int sb) { return 0x4040u | (uint32_t)sb | ((uint32_t)sb << 8); }

// ---------------------------------------------------------------------------------------------
// X preparation: one block per position (P_pad blocks, zeros past P).

static __global__ void __launch_bounds__(256) prep_x_kernel(const float *__restrict__ x, int64_t K, int64_t P, int64_t P_pad,
                                                     __half *__restrict__ xh, __half *__restrict__ xs,
                                                     float *__restrict__ inv) {
    const int64_t p = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *xp = x + p * K;
    const bool live = p < P;
    float amax = 0.0f;
    if (live)
        for (int64_t k = threadIdx.x; k < K; k += 256) amax = fmaxf(amax, fabsf(xp[k]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    __shared__ float red[8];
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) amax = fmaxf(amax, red[i]);
    // scale 2^e with amax * 2^e in [2^14, 2^15); e <= 126 keeps 2^-e normal
    int e = 0;
    if (amax > 0.0f && amax <= 3.0e38f) {
        int ex;
        frexpf(amax, &ex);   // amax = f 2^ex, f in [0.5, 1)
        e = min(15 - ex, 126);
    }
    const float scale = ldexpf(1.0f, e);
    if (threadIdx.x == 0) inv[p] = ldexpf(1.0f, -e);
    const int64_t nb32 = K / 32;
    for (int64_t b = warp; b < nb32; b += 8) {
        const float v = live ? xp[b * 32 + lane] * scale : 0.0f;   // exact (power of two)
        xh[p * K + b * 32 + x_perm_dest(lane)] = __float2half_rn(v);
        float s = v;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) {
            const float vs = s * XSUM_SCALE;
            const __half hi = __float2half_rn(vs);
            const __half lo = __float2half_rn(vs - __half2float(hi));   // vs - hi exact in fp32
            __half *dst = xs + ((b >> 3) * P_pad + p) * 16 + (b & 7);
            dst[0] = hi;
            dst[8] = lo;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// device helpers

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
#endif
}

// d = A B + c (ZERO: c = 0), fp16 x fp16 -> fp32
template <bool ZERO>
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (ZERO) {
        const float z = 0.0f;
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%10,%10,%10,%10};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(z));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
#else
    __trap();
#endif
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }

// ---------------------------------------------------------------------------------------------
// The GEMM kernel.

struct Args {
    Matrix w;
    const __half *xh;     // [P_pad][K]
    const __half *xs;     // [K/256][P_pad][16]
    const float *inv;     // [P_pad]
    float *y;             // [P][M]
    int64_t P, P_pad;
    bool accumulate;
};

// Copies step u's weight rows (and Q6_K scales), X and (Q4_K / Q5_K) xsum into one stage.
template <int TYPE, int BM>
__device__ __forceinline__ void load_stage(const Args &a, uint8_t *st, int64_t m0, int64_t n0, int64_t u) {
    constexpr int ROW = w_row(TYPE), WCH = ROW / 16;   // Q8_0: 16 q chunks + the 8 d's
    constexpr int NW = BM * WCH, NA = w_aux(TYPE) ? BM : 0, NX = BN * 32;
    constexpr int NS = has_mins(TYPE) ? BN * XS_STRIDE / 16 : 0;
    constexpr int TOTAL = NW + NA + NX + NS;
    constexpr int WBYTES = BM * (ROW + w_aux(TYPE));
    uint8_t *ws = st, *xsm = st + WBYTES, *xss = xsm + BN * X_STRIDE;
    const int64_t K = a.w.K, M = a.w.M, nb = K / QK_K;
    for (int c = threadIdx.x; c < TOTAL; c += blockDim.x) {
        if (c < NW) {
            const int row = c / WCH, ch = c - row * WCH;
            const int64_t gr = min(m0 + row, M - 1);
            const uint8_t *src;
            if constexpr (TYPE == TYPE_Q4_K) src = a.w.data + q4_K_offset(gr, u, nb) + 16 * ch;
            else if constexpr (TYPE == TYPE_Q5_K) src = a.w.data + (gr * nb + u) * ROW + 16 * ch;
            else if constexpr (TYPE == TYPE_Q6_K) src = a.w.data + q6_K_planes(M, K).q + q6_K_q_offset(gr, u, nb) + 16 * ch;
            else src = ch < 16 ? a.w.data + gr * K + u * QK_K + 16 * ch   // Q8_0 qs plane starts at 0
                               : a.w.data + q8_0_planes(M, K).d + (gr * (K / QK8_0) + u * 8) * 2;
            gemm::cp16(ws + row * ROW + 16 * ch, src);
        } else if (c < NW + NA) {
            const int row = c - NW;
            const int64_t gr = min(m0 + row, M - 1);
            gemm::cp16(ws + BM * ROW + row * 16, a.w.data + q6_K_planes(M, K).sc + q6_K_sc_offset(gr, u, nb));
        } else if (c < NW + NA + NX) {
            const int cc = c - NW - NA, pos = cc >> 5, ch = cc & 31;
            gemm::cp16(xsm + pos * X_STRIDE + 16 * ch,
                       reinterpret_cast<const uint8_t *>(a.xh + (n0 + pos) * K + u * QK_K) + 16 * ch);
        } else {
            const int cc = c - NW - NA - NX;
            gemm::cp16(xss + 16 * cc, reinterpret_cast<const uint8_t *>(a.xs + (u * a.P_pad + n0) * 16) + 16 * cc);
        }
    }
}

// The B fragments of k16 step ks (0..15) for the 8 n-tiles.
__device__ __forceinline__ void load_b(uint32_t xs_lane, int ks, uint32_t (&bf)[8][2]) {
#pragma unroll
    for (int np = 0; np < 4; ++np)
        ldsm_x4(xs_lane + np * 16 * X_STRIDE + ks * 32, bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1]);
}

// acc += s[row] * tmp (row ri = 2 i + (e >> 1) of the lane's 4 rows)
__device__ __forceinline__ void scale_add(float (&acc)[2][8][4], const float (&tmp)[2][8][4], const float (&s)[4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = fmaf(s[2 * i + (e >> 1)], tmp[i][n][e], acc[i][n][e]);
}

// The lane's 4 rows in the stage: wm*32 + {16 i + g, 16 i + g + 8} (ri = 2 i + upper).
__device__ __forceinline__ int lane_row(int wm, int g, int ri) { return wm * 32 + 16 * (ri >> 1) + g + 8 * (ri & 1); }

// Q4_K / Q5_K: one super-block for one warp x the block's 64 positions (n-tile n: positions 8 n + ...).
template <bool Q5>
__device__ __forceinline__ void step_q45(const uint8_t *ws, uint32_t xs_lane, uint32_t xss_lane, int wm, int g, int t,
                                         float (&acc)[2][8][4], float (&tmp)[2][8][4]) {
    constexpr int STRIDE = w_row(Q5 ? TYPE_Q5_K : TYPE_Q4_K), QS = Q5 ? 48 : 16;
    int rowb[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) rowb[ri] = lane_row(wm, g, ri) * STRIDE;
    float d[4], dm[4];
    uint32_t scw[4][2], mA[4], qh[4][2];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        const uint4 h = *reinterpret_cast<const uint4 *>(ws + rowb[ri]);
        d[ri] = gemm::half_bits(h.x & 0xFFFFu);
        dm[ri] = -64.0f * gemm::half_bits(h.x >> 16);   // xsum carries 2^-6
        scw[ri][0] = h.y & 0x3F3F3F3Fu;
        scw[ri][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
        const uint32_t mn0 = h.z & 0x3F3F3F3Fu;
        const uint32_t mn1 = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
        // mins of sub-blocks 2t, 2t+1 as half2 (A' k = 2t, 2t+1 and 2t+8, 2t+9)
        const int b = (2 * t) & 3;
        const uint32_t mp = __byte_perm(t < 2 ? mn0 : mn1, 0x64646464u, 0x4040u | b | ((b + 1) << 8));
        mA[ri] = h2u(__hsub2(u2h(mp), __float2half2_rn(1024.0f)));
    }
    const __half2 c1024 = __float2half2_rn(1024.0f), cm1024 = __float2half2_rn(-1024.0f);
    const __half2 c16th = __float2half2_rn(0.0625f), cm64 = __float2half2_rn(-64.0f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint32_t raw[4][2];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                raw[ri][hh] = *reinterpret_cast<const uint32_t *>(ws + rowb[ri] + QS + 32 * j + 16 * hh + 4 * t);
                // Q5_K: the qh words of the same values, re-read per chunk (keeping them costs spills)
                if constexpr (Q5) qh[ri][hh] = *reinterpret_cast<const uint32_t *>(ws + rowb[ri] + 16 + 16 * hh + 4 * t);
            }
#pragma unroll
        for (int nib = 0; nib < 2; ++nib) {
            const int s = 2 * j + nib;
            __half2 scH[4], biH[4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) {
                const __half2 p = u2h(__byte_perm(scw[ri][s >> 2], 0x64646464u, splat_byte_sel(s & 3)));   // 1024 + sc
                // Q5_K unpacks both nibbles to the low bits (q5_bytes): sc for both
                scH[ri] = (nib && !Q5) ? __hfma2(p, c16th, cm64) : __hsub2(p, c1024);   // sc / 16 or sc, exact
                biH[ri] = __hmul2(scH[ri], cm1024);                            // -64 sc or -1024 sc, exact
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ks = 2 * s + h;
                uint32_t bf[8][2];
                load_b(xs_lane, ks, bf);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    uint32_t m[4];   // rows g, g+8 x k pairs (2t, 2t+1), (2t+8, 2t+9): the A registers' order
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const uint32_t w = raw[2 * i + r][h];
                        if constexpr (Q5) {
                            const uint32_t w5 = q5_bytes(w, qh[2 * i + r][h], s);   // 4 x q5 (0..31)
                            m[r] = q5_pair_magic(w5);
                            m[2 + r] = q5_pair_magic(w5 >> 8);
                        } else {
                            m[r] = nib ? nibble_pair_magic<1>(w) : nibble_pair_magic<0>(w);
                            m[2 + r] = nib ? nibble_pair_magic<1>(w >> 8) : nibble_pair_magic<0>(w >> 8);
                        }
                    }
                    const uint32_t A0 = h2u(__hfma2(u2h(m[0]), scH[2 * i], biH[2 * i]));
                    const uint32_t A1 = h2u(__hfma2(u2h(m[1]), scH[2 * i + 1], biH[2 * i + 1]));
                    const uint32_t A2 = h2u(__hfma2(u2h(m[2]), scH[2 * i], biH[2 * i]));
                    const uint32_t A3 = h2u(__hfma2(u2h(m[3]), scH[2 * i + 1], biH[2 * i + 1]));
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
                        if (ks == 0) mma_f16<true>(tmp[i][n], A0, A1, A2, A3, bf[n][0], bf[n][1]);
                        else mma_f16<false>(tmp[i][n], A0, A1, A2, A3, bf[n][0], bf[n][1]);
                    }
                }
            }
        }
    }
    // acc += d * tmp, then the mins tile into tmp, acc += (-64 dmin) * tmp
    scale_add(acc, tmp, d);
    uint32_t bs[8][2];
#pragma unroll
    for (int np = 0; np < 4; ++np)
        ldsm_x4(xss_lane + np * 16 * XS_STRIDE, bs[2 * np][0], bs[2 * np][1], bs[2 * np + 1][0], bs[2 * np + 1][1]);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 8; ++n) mma_f16<true>(tmp[i][n], mA[2 * i], mA[2 * i + 1], mA[2 * i], mA[2 * i + 1], bs[n][0], bs[n][1]);
    scale_add(acc, tmp, dm);
}

template <int C>
__device__ __forceinline__ uint32_t word_of(const uint4 &v) {
    if constexpr (C == 0) return v.x;
    else if constexpr (C == 1) return v.y;
    else if constexpr (C == 2) return v.z;
    else return v.w;
}

// Q6_K, one scale group (half H = C >> 1, quarter QQ, 16-value half c1 = C & 1 of x block 4 H + QQ):
// tmp = q x (one mma per tile), acc += d sc * tmp.
template <int C, int QQ>
__device__ __forceinline__ void q6_group(const uint4 (&qk)[4], const uint4 (&qhh)[4], const uint8_t *wsc,
                                         const int (&rowl)[4], const float (&dq)[4], uint32_t xs_lane,
                                         float (&acc)[2][8][4], float (&tmp)[2][8][4]) {
    constexpr int H = C >> 1, c1 = C & 1;
    constexpr int S = 8 * H + 2 * QQ + c1;       // ggml's scale index
    constexpr int KS = 2 * (4 * H + QQ) + c1;    // k16 step of the super-block
    uint32_t bf[8][2];
    load_b(xs_lane, KS, bf);
    float dsc[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) dsc[ri] = dq[ri] * (float)reinterpret_cast<const int8_t *>(wsc)[rowl[ri] * 16 + S];
    const __half2 c1056 = __float2half2_rn(1056.0f);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = q6_bytes(word_of<C>(qk[2 * i + r]), word_of<C>(qhh[2 * i + r]), QQ);   // q + 32
            a[r] = h2u(__hsub2(u2h(__byte_perm(v, 0x64646464u, SEL_LO)), c1056));
            a[2 + r] = h2u(__hsub2(u2h(__byte_perm(v, 0x64646464u, SEL_HI)), c1056));
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) mma_f16<true>(tmp[i][n], a[0], a[1], a[2], a[3], bf[n][0], bf[n][1]);
    }
    scale_add(acc, tmp, dsc);
}

// Q6_K super-block: kind K01 (ql bytes 0..63: quarters 0, 2; 64..127: quarters 1, 3) and the qh
// kind, 16 bytes per lane per row (the regrouped plane's lane-t run: words c = 0..3).
template <int K01>
__device__ __forceinline__ void q6_kind(const uint8_t *ws, const uint8_t *wsc, const int (&rowl)[4], const float (&dq)[4],
                                        uint32_t xs_lane, int t, float (&acc)[2][8][4], float (&tmp)[2][8][4]) {
    uint4 qk[4], qhh[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        qk[ri] = *reinterpret_cast<const uint4 *>(ws + rowl[ri] * 192 + 64 * K01 + 16 * t);
        qhh[ri] = *reinterpret_cast<const uint4 *>(ws + rowl[ri] * 192 + 128 + 16 * t);
    }
    q6_group<0, K01>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<0, K01 + 2>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<1, K01>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<1, K01 + 2>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<2, K01>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<2, K01 + 2>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<3, K01>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
    q6_group<3, K01 + 2>(qk, qhh, wsc, rowl, dq, xs_lane, acc, tmp);
}

// Q8_0 super-block: 8 blocks of 32; per block two k16 steps into tmp, acc += d * tmp.
__device__ __forceinline__ void step_q8(const uint8_t *ws, uint32_t xs_lane, int wm, int g, int t, float (&acc)[2][8][4],
                                        float (&tmp)[2][8][4]) {
    constexpr int STRIDE = w_row(TYPE_Q8_0);
    int rowb[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) rowb[ri] = lane_row(wm, g, ri) * STRIDE;
    const __half2 c1152 = __float2half2_rn(1152.0f);
#pragma unroll
    for (int s2 = 0; s2 < 4; ++s2) {
        uint32_t dw[4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) dw[ri] = *reinterpret_cast<const uint32_t *>(ws + rowb[ri] + 256 + 4 * s2);
#pragma unroll
        for (int sb = 0; sb < 2; ++sb) {
            const int s = 2 * s2 + sb;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                uint32_t bf[8][2];
                load_b(xs_lane, 2 * s + h, bf);
                uint32_t raw[4];
#pragma unroll
                for (int ri = 0; ri < 4; ++ri)
                    raw[ri] = *reinterpret_cast<const uint32_t *>(ws + rowb[ri] + 32 * s + 16 * h + 4 * t) ^ 0x80808080u;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    uint32_t a[4];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        a[r] = h2u(__hsub2(u2h(__byte_perm(raw[2 * i + r], 0x64646464u, SEL_LO)), c1152));
                        a[2 + r] = h2u(__hsub2(u2h(__byte_perm(raw[2 * i + r], 0x64646464u, SEL_HI)), c1152));
                    }
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
                        if (h == 0) mma_f16<true>(tmp[i][n], a[0], a[1], a[2], a[3], bf[n][0], bf[n][1]);
                        else mma_f16<false>(tmp[i][n], a[0], a[1], a[2], a[3], bf[n][0], bf[n][1]);
                    }
                }
            }
            float d[4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) d[ri] = gemm::half_bits(sb ? dw[ri] >> 16 : dw[ri] & 0xFFFFu);
            scale_add(acc, tmp, d);
        }
    }
}

template <int TYPE, int WM, int STAGES>
__global__ void __launch_bounds__(32 * WM, 1) gemm_f16_kernel(const Args a) {
    constexpr int BM = 32 * WM;
    constexpr int SB = stage_bytes(TYPE, BM);
    constexpr int WBYTES = BM * (w_row(TYPE) + w_aux(TYPE));
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t n0 = (int64_t)blockIdx.x * BN, m0 = (int64_t)blockIdx.y * BM;
    const int64_t nsteps = a.w.K / QK_K;
    // ldmatrix row addresses of this lane: matrix mi = lane / 8 (0: n-tile 2np, k 0..7; 1: 2np,
    // k 8..15; 2 / 3: n-tile 2np + 1), row = lane % 8 = the position within the n-tile
    const int mi = lane >> 3, r = lane & 7;
    const int lpos = 8 * (mi >> 1) + r;
    const uint32_t sbase = gemm::smem_addr(smem);
    const uint32_t xs_off = WBYTES + lpos * X_STRIDE + (mi & 1) * 16;
    const uint32_t xss_off = WBYTES + BN * X_STRIDE + lpos * XS_STRIDE + (mi & 1) * 16;

    float acc[2][8][4], tmp[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.0f;

    // Q6_K: the super-block d is a 2-byte plane entry (not 16-byte aligned): read from global one
    // step ahead.
    const __half *dplane = nullptr;
    int64_t drow[4] = {0, 0, 0, 0};
    float dq[4] = {0.f, 0.f, 0.f, 0.f}, dq_next[4] = {0.f, 0.f, 0.f, 0.f};
    int rowl[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) rowl[ri] = lane_row(warp, g, ri);
    if constexpr (TYPE == TYPE_Q6_K) {
        dplane = reinterpret_cast<const __half *>(a.w.data + q6_K_planes(a.w.M, a.w.K).d);
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) {
            drow[ri] = min(m0 + rowl[ri], a.w.M - 1) * nsteps;
            dq_next[ri] = __half2float(__ldg(dplane + drow[ri]));
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nsteps) load_stage<TYPE, BM>(a, smem + s * SB, m0, n0, s);
        gemm::cp_commit();
    }
    for (int64_t u = 0; u < nsteps; ++u) {
        gemm::cp_wait<STAGES - 2>();
        __syncthreads();
        {
            const int64_t un = u + STAGES - 1;
            if (un < nsteps) load_stage<TYPE, BM>(a, smem + (un % STAGES) * SB, m0, n0, un);
            gemm::cp_commit();
        }
        const uint32_t so = (uint32_t)(u % STAGES) * SB;
        const uint8_t *st = smem + so;
        if constexpr (TYPE == TYPE_Q4_K) step_q45<false>(st, sbase + so + xs_off, sbase + so + xss_off, warp, g, t, acc, tmp);
        else if constexpr (TYPE == TYPE_Q5_K) step_q45<true>(st, sbase + so + xs_off, sbase + so + xss_off, warp, g, t, acc, tmp);
        else if constexpr (TYPE == TYPE_Q6_K) {
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) {
                dq[ri] = dq_next[ri];
                if (u + 1 < nsteps) dq_next[ri] = __half2float(__ldg(dplane + drow[ri] + u + 1));
            }
            q6_kind<0>(st, st + BM * 192, rowl, dq, sbase + so + xs_off, t, acc, tmp);
            q6_kind<1>(st, st + BM * 192, rowl, dq, sbase + so + xs_off, t, acc, tmp);
        } else step_q8(st, sbase + so + xs_off, warp, g, t, acc, tmp);
    }
    gemm::cp_wait<0>();

    // C value e of (i, n): row 16 i + g + 8 (e >> 1), position 8 n + 2 t + (e & 1)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            const int64_t pos = n0 + 8 * n + 2 * t + e1;
            if (pos >= a.P) continue;
            const float iv = a.inv[pos];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int e2 = 0; e2 < 2; ++e2) {
                    const int64_t row = m0 + warp * 32 + 16 * i + g + 8 * e2;
                    if (row >= a.w.M) continue;
                    float *dst = a.y + pos * a.w.M + row;
                    const float v = acc[i][n][2 * e2 + e1] * iv;
                    *dst = a.accumulate ? *dst + v : v;
                }
        }
}

// ---------------------------------------------------------------------------------------------
// host side

struct Config {
    int wm, stages;   // warps along M (BM = 32 wm), pipeline depth
};

inline bool type_supported(int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K || type == TYPE_Q8_0;
}

// Candidates per type, largest tile first (the instantiated ones): 256 rows x 3 stages only where
// it fits Hopper's 227 KB (Q4_K: 213 KB; Q5_K 237, Q6_K 255, Q8_0 301 KB would not), else 256 x 2;
// 128 x 2 (two blocks per SM on Hopper for Q4_K); 64 x 2 (sm_86 / sm_120, ~99 KB); Q8_0 also
// 32 x 2 (its 64 x 2 needs 100 KB, just over sm_86's 99).
inline int configs_of(int type, Config (&out)[4]) {
    int n = 0;
    out[n++] = {8, type == TYPE_Q4_K ? 3 : 2};
    out[n++] = {4, 2};
    out[n++] = {2, 2};
    if (type == TYPE_Q8_0) out[n++] = {1, 2};
    return n;
}

inline int smem_of(int type, const Config &c) { return c.stages * stage_bytes(type, 32 * c.wm); }

template <int TYPE, int WM, int STAGES>
inline void launch_cfg(const Args &a, cudaStream_t st) {
    constexpr int SMEM = STAGES * stage_bytes(TYPE, 32 * WM);
    static bool attr_set = false;
    if (!attr_set) {
        check_cuda(cudaFuncSetAttribute(gemm_f16_kernel<TYPE, WM, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
                   "gemm_f16: shared-memory attribute");
        attr_set = true;
    }
    const dim3 grid((unsigned)(a.P_pad / BN), (unsigned)((a.w.M + 32 * WM - 1) / (32 * WM)));
    gemm_f16_kernel<TYPE, WM, STAGES><<<grid, 32 * WM, SMEM, st>>>(a);
    check_launch("gemm_f16: kernel");
}

// The first candidate that fits the device and gives at least one block per SM; else the smallest
// that fits. OJ_GEMMF16_CFG="wm,stages" (one of the type's candidates) forces one: kept because
// tools/gemm_f16_bench.cu times every candidate through it (scripts/gpu.sh gemm-f16); users never set it.
inline Config pick_config(int type, int64_t M, int64_t P_pad) {
    static int optin = 0, sms = 0;
    if (!optin) {
        int dev = 0;
        check_cuda(cudaGetDevice(&dev), "gemm_f16: cudaGetDevice");
        check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                   "gemm_f16: shared-memory limit");
        check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "gemm_f16: SM count");
    }
    Config order[4];
    const int n = configs_of(type, order);
    if (const char *e = std::getenv("OJ_GEMMF16_CFG")) {
        int wm = 0, stg = 0;
        if (std::sscanf(e, "%d,%d", &wm, &stg) == 2)
            for (int i = 0; i < n; ++i)
                if (order[i].wm == wm && order[i].stages == stg && smem_of(type, order[i]) <= optin) return order[i];
    }
    Config last = {0, 0};
    for (int i = 0; i < n; ++i) {
        const Config &o = order[i];
        if (smem_of(type, o) > optin) continue;
        last = o;
        const int64_t blocks = (P_pad / BN) * ((M + 32 * o.wm - 1) / (32 * o.wm));
        if (blocks >= sms) return o;
    }
    if (!last.wm)
        fail(OJ_ERR_UNSUPPORTED, std::string("gemm_f16: the device's shared memory per block is too small for ") + type_name(type));
    return last;
}

template <int TYPE>
inline void launch_type(const Args &a, const Config &c, cudaStream_t st) {
    if (c.wm == 8) launch_cfg<TYPE, 8, (TYPE == TYPE_Q4_K ? 3 : 2)>(a, st);
    else if (c.wm == 4) launch_cfg<TYPE, 4, 2>(a, st);
    else if (c.wm == 2 || TYPE != TYPE_Q8_0) launch_cfg<TYPE, 2, 2>(a, st);
    else launch_cfg<TYPE_Q8_0, 1, 2>(a, st);
}

inline void check_shape(const Matrix &w, int64_t P) {
    if (!type_supported(w.type))
        fail(OJ_ERR_UNSUPPORTED, std::string("gemm_f16: no fp16 GEMM kernel for weight type ") + type_name(w.type));
    if (w.K % QK_K != 0 || w.K <= 0)
        fail(OJ_ERR_UNSUPPORTED, "gemm_f16: K must be a positive multiple of 256, got " + std::to_string(w.K));
    if (w.M <= 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_f16: M must be positive");
    if (P < 1) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_f16: position count must be >= 1");
}

// X [P][K] fp32 -> the workspace (ws_layout(K, P).total bytes), for every type (one k order).
inline void prep_x(const float *x, int64_t K, int64_t P, void *workspace, cudaStream_t st) {
    if (K <= 0 || K % QK_K != 0)
        fail(OJ_ERR_UNSUPPORTED, "gemm_f16: K must be a positive multiple of 256, got " + std::to_string(K));
    if (P < 1) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_f16: position count must be >= 1");
    const WsLayout l = ws_layout(K, P);
    uint8_t *base = static_cast<uint8_t *>(workspace);
    const int64_t pp = padded_positions(P);
    prep_x_kernel<<<(unsigned)pp, 256, 0, st>>>(x, K, P, pp, reinterpret_cast<__half *>(base + l.xh),
                                                reinterpret_cast<__half *>(base + l.xs), reinterpret_cast<float *>(base + l.inv));
    check_launch("gemm_f16: prep_x");
}

// y (+)= W x from an already prepared workspace (prep_x with the same K and P), any supported type.
inline void run(const Matrix &w, const void *workspace, int64_t P, float *y, bool accumulate, cudaStream_t st) {
    check_shape(w, P);
    const WsLayout l = ws_layout(w.K, P);
    const uint8_t *base = static_cast<const uint8_t *>(workspace);
    Args a;
    a.w = w;
    a.P = P;
    a.P_pad = padded_positions(P);
    a.xh = reinterpret_cast<const __half *>(base + l.xh);
    a.xs = reinterpret_cast<const __half *>(base + l.xs);
    a.inv = reinterpret_cast<const float *>(base + l.inv);
    a.y = y;
    a.accumulate = accumulate;
    const Config c = pick_config(w.type, w.M, a.P_pad);
    switch (w.type) {
        case TYPE_Q4_K: launch_type<TYPE_Q4_K>(a, c, st); break;
        case TYPE_Q5_K: launch_type<TYPE_Q5_K>(a, c, st); break;
        case TYPE_Q6_K: launch_type<TYPE_Q6_K>(a, c, st); break;
        default: launch_type<TYPE_Q8_0>(a, c, st); break;
    }
}

}  // namespace gemmf16

inline size_t gemm_f16_workspace_bytes(int64_t K, int64_t P) { return gemmf16::ws_layout(K, P).total; }

// Whether gemm_f16 takes this matrix (else the caller keeps another path, e.g. matvec / int8).
inline bool gemm_f16_supports(const Matrix &w) {
    return gemmf16::type_supported(w.type) && w.K > 0 && w.K % QK_K == 0 && w.M > 0;
}

// y[p][m] (+)= W[m] . x[p] for Q4_K / Q5_K / Q6_K / Q8_0 W; the workspace must hold
// gemm_f16_workspace_bytes(w.K, P). (Several matrices with the same K: gemmf16::prep_x once,
// then gemmf16::run per matrix.)
inline void gemm_f16(const Matrix &w, const float *x, int64_t P, float *y, bool accumulate, void *workspace,
                     size_t workspace_size, cudaStream_t st) {
    gemmf16::check_shape(w, P);
    if (workspace_size < gemm_f16_workspace_bytes(w.K, P))
        fail(OJ_ERR_INVALID_ARGUMENT, "gemm_f16: workspace of " + std::to_string(workspace_size) + " bytes, need " +
                                          std::to_string(gemm_f16_workspace_bytes(w.K, P)));
    gemmf16::prep_x(x, w.K, P, workspace, st);
    gemmf16::run(w, workspace, P, y, accumulate, st);
}

// The Q4_K-only name prefill.cu calls today: the same as gemm_f16 (any supported type).
inline void gemm_f16_q4k(const Matrix &w, const float *x, int64_t P, float *y, bool accumulate, void *workspace,
                         size_t workspace_size, cudaStream_t st) {
    gemm_f16(w, x, P, y, accumulate, workspace, workspace_size, st);
}

}  // namespace oj
