// matvec_v1.cuh: the first tensor-core matvec (native/matvec.cu as first measured on the H200,
// 2026-11-29: ~17% of the copy rate at one vector, n5/n1 1.15), copied verbatim into its own
// namespace so that matvec_bench.cu times it beside the current kernel in one device run. It reads
// the engine's current device layout (unchanged since). Not part of the engine.
#pragma once
#include <cuda_bf16.h>

#include <cstring>

#include "engine.cuh"

namespace oj_v1 {
using namespace oj;

namespace {

// ---------------------------------------------------------------------------------------------
// Float weights: one warp per row, fp32 FMAs (the v1 kernel).

constexpr int ROWS_PER_BLOCK = 8;   // 8 warps, one row each

__device__ __forceinline__ float half_at(const uint8_t *p) {
    return __half2float(*reinterpret_cast<const __half *>(p));
}

template <int N>
__device__ __forceinline__ void fma_run4(float (&acc)[N], const float *x, int64_t K, int64_t col,
                                         float w0, float w1, float w2, float w3) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float4 xv = __ldg(reinterpret_cast<const float4 *>(x + n * K + col));
        acc[n] += w0 * xv.x + w1 * xv.y + w2 * xv.z + w3 * xv.w;
    }
}

// Float types: 8 consecutive values per lane; K need only be a multiple of 8.
template <int TYPE, int N>
__device__ __forceinline__ void unit_float(const Matrix &w, int64_t m, int64_t u, int lane,
                                           const float *x, float (&acc)[N]) {
    const int64_t col = u * QK_K + lane * 8;
    if (col >= w.K) return;
    float v[8];
    if constexpr (TYPE == TYPE_F32) {
        const float4 *p = reinterpret_cast<const float4 *>(w.data + (m * w.K + col) * 4);
        const float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        const uint4 r = *reinterpret_cast<const uint4 *>(w.data + (m * w.K + col) * 2);
        const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint16_t lo = words[t] & 0xFFFF, hi = words[t] >> 16;
            if constexpr (TYPE == TYPE_F16) {
                v[2 * t] = __half2float(__ushort_as_half(lo));
                v[2 * t + 1] = __half2float(__ushort_as_half(hi));
            } else {
                v[2 * t] = __uint_as_float((uint32_t)lo << 16);
                v[2 * t + 1] = __uint_as_float((uint32_t)hi << 16);
            }
        }
    }
    fma_run4<N>(acc, x, w.K, col, v[0], v[1], v[2], v[3]);
    fma_run4<N>(acc, x, w.K, col + 4, v[4], v[5], v[6], v[7]);
}

// Output row o reads weight row rows[o] (rows == nullptr: row o), writes y[n * n_out + o].
template <int TYPE, int N>
__global__ void __launch_bounds__(32 * ROWS_PER_BLOCK)
float_matvec_kernel(const Matrix w, const float *__restrict__ x, float *__restrict__ y, bool accumulate,
                    const int32_t *__restrict__ rows, int64_t n_out) {
    const int64_t o = (int64_t)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (o >= n_out) return;
    const int64_t m = rows ? (int64_t)rows[o] : o;
    float acc[N];
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    const int64_t n_units = (w.K + QK_K - 1) / QK_K;
    for (int64_t u = 0; u < n_units; ++u) unit_float<TYPE, N>(w, m, u, lane, x, acc);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        float v = acc[n];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) {
            float *dst = y + n * n_out + o;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

template <int TYPE>
void launch_float(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate,
                  const int32_t *rows, int64_t n_out, cudaStream_t st) {
    const dim3 grid((unsigned)((n_out + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK));
    const dim3 block(32 * ROWS_PER_BLOCK);
    switch (n_vec) {
        case 1: float_matvec_kernel<TYPE, 1><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 2: float_matvec_kernel<TYPE, 2><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 3: float_matvec_kernel<TYPE, 3><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 4: float_matvec_kernel<TYPE, 4><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 5: float_matvec_kernel<TYPE, 5><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 6: float_matvec_kernel<TYPE, 6><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        case 7: float_matvec_kernel<TYPE, 7><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
        default: float_matvec_kernel<TYPE, 8><<<grid, block, 0, st>>>(w, x, y, accumulate, rows, n_out); break;
    }
}

// ---------------------------------------------------------------------------------------------
// Quantised weights on the tensor cores.

constexpr int MMA_WARPS = 4;                  // warps per block, splitting K by super-block
constexpr int MMA_TILES = 1;                  // 16-row tiles per block (each warp does all of them)
constexpr int MMA_ROWS = 16 * MMA_TILES;      // output rows per block
static_assert(MMA_WARPS == MMA_TILES * 4, "the final reduction gives each warp one (tile, C slot)");

constexpr uint32_t BF16_128 = 0x43004300u;    // bf16x2 (128, 128): OR a 7-bit integer into it
constexpr uint32_t BF16_160 = 0x43204320u;    // bf16x2 (160, 160) = 128 + the Q6_K offset 32
constexpr uint32_t BF16_ONE = 0x3F803F80u;    // bf16x2 (1, 1)

__device__ __forceinline__ uint4 ld16(const uint8_t *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
__device__ __forceinline__ uint2 ld8(const uint8_t *p) { return __ldg(reinterpret_cast<const uint2 *>(p)); }

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 v) {
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
}

// a - b on bf16 pairs; exact here (both operands and the result are small integers).
__device__ __forceinline__ uint32_t bf2_sub(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return bits_of(__hsub2(x, y));
}

// Logical shift by a compile-time amount that may be negative (left).
template <int S>
__device__ __forceinline__ uint32_t shr(uint32_t v) {
    if constexpr (S >= 0) return v >> S;
    else return v << (-S);
}

// Byte k of a word as a float: the byte becomes the low mantissa of 2^23, then 2^23 goes.
template <int K>
__device__ __forceinline__ float byte_f(uint32_t word) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | K)) - 8388608.0f;
}

// B fragments of one k16 step: bf16 high parts and remainders of 4 activation values, k slots
// (2t, 2t+1 | 2t+8, 2t+9) = columns (0, 2 | 1, 3) of the float4.
struct Frag {
    uint32_t hi0, hi1, lo0, lo1;
};

__device__ __forceinline__ void split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
    hi = bits_of(__floats2bfloat162_rn(a, b));   // a in the low half (the lower k)
    const float ra = a - __uint_as_float(hi << 16), rb = b - __uint_as_float(hi & 0xFFFF0000u);
    lo = bits_of(__floats2bfloat162_rn(ra, rb));
}

__device__ __forceinline__ Frag frag_of(float4 v) {
    Frag f;
    split_pair(v.x, v.z, f.hi0, f.lo0);
    split_pair(v.y, v.w, f.hi1, f.lo1);
    return f;
}

__device__ __forceinline__ float4 load_x(const float *xg, int64_t col, bool has_x) {
    return has_x ? __ldg(reinterpret_cast<const float4 *>(xg + col)) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// c += A * B on the tensor cores. A regs: (row g, k 2t..) (row g+8, k 2t..) (row g, k 2t+8..)
// (row g+8, k 2t+8..); C: (row g, col 2t, 2t+1), (row g+8, col 2t, 2t+1).
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();   // the engine builds for sm_80 and newer only
#endif
}

// Both parts of x against the same A.
__device__ __forceinline__ void mma_x(float (&c)[4], const uint32_t (&a)[4], const Frag &f) {
    mma_bf16(c, a[0], a[1], a[2], a[3], f.hi0, f.hi1);
    mma_bf16(c, a[0], a[1], a[2], a[3], f.lo0, f.lo1);
}

// Sum of x over the group's k (for the K-quant mins): C = ones * B, one value per column.
__device__ __forceinline__ void mma_ones(float (&c)[4], const Frag &f) {
    mma_bf16(c, BF16_ONE, BF16_ONE, BF16_ONE, BF16_ONE, f.hi0, f.hi1);
    mma_bf16(c, BF16_ONE, BF16_ONE, BF16_ONE, BF16_ONE, f.lo0, f.lo1);
}

using TileAcc = float[MMA_TILES][4];
using TileRows = int64_t[MMA_TILES][2];   // weight row of (tile, row g / row g+8) for this lane

// Q4_K / Q5_K (file layout). Lane t of a quad reads bytes 8t..8t+7 of each 32-byte chunk j of the
// row's quants: low nibbles are sub-block 2j, high nibbles sub-block 2j+1, columns 8t.. of each.
// Q5_K's fifth bit of value l of sub-block s is bit s of qh[l]: the same 8 qh bytes for every j.
template <bool Q5>
__device__ __forceinline__ void run_q4_q5(const Matrix &w, const TileRows &src, int warp, int t,
                                          const float *xg, bool has_x, TileAcc &acc) {
    constexpr int BYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
    const int64_t nb = w.K / QK_K;
    for (int64_t u = warp; u < nb; u += MMA_WARPS) {
        uint4 hdr[MMA_TILES][2];
        uint2 q[MMA_TILES][2][4];
        uint2 qh[MMA_TILES][2];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint8_t *b = w.data + (src[i][r] * nb + u) * BYTES;
                hdr[i][r] = ld16(b);
                if constexpr (Q5) qh[i][r] = ld8(b + 16 + 8 * t);
#pragma unroll
                for (int j = 0; j < 4; ++j) q[i][r][j] = ld8(b + QS + 32 * j + 8 * t);
            }
        }
        // 6-bit scales and mins of sub-blocks 0..3 and 4..7, one byte each (get_scale_min_k4)
        uint32_t sc[MMA_TILES][2][2], mn[MMA_TILES][2][2];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint4 h = hdr[i][r];
                sc[i][r][0] = h.y & 0x3F3F3F3Fu;
                mn[i][r][0] = h.z & 0x3F3F3F3Fu;
                sc[i][r][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
                mn[i][r][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
            }
        }
        float s1[MMA_TILES][4], s2[MMA_TILES][4];   // sum_s sc_s * (q.x)_s, sum_s m_s * (sum x)_s
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) s1[i][k] = s2[i][k] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int64_t col = u * QK_K + 64 * j + 8 * t;
            float4 xv[2][2];
            xv[0][0] = load_x(xg, col, has_x);
            xv[0][1] = load_x(xg, col + 4, has_x);
            xv[1][0] = load_x(xg, col + 32, has_x);
            xv[1][1] = load_x(xg, col + 36, has_x);
#pragma unroll
            for (int nib = 0; nib < 2; ++nib) {
                const int s = 2 * j + nib;
                const Frag f0 = frag_of(xv[nib][0]), f1 = frag_of(xv[nib][1]);
                float xs[4] = {0.f, 0.f, 0.f, 0.f};
                mma_ones(xs, f0);
                mma_ones(xs, f1);
#pragma unroll
                for (int i = 0; i < MMA_TILES; ++i) {
                    uint32_t a[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const uint32_t wv = h ? q[i][r][j].y : q[i][r][j].x;
                            uint32_t p0 = ((wv >> (4 * nib)) & 0x000F000Fu) | BF16_128;       // bytes 0, 2
                            uint32_t p1 = ((wv >> (4 * nib + 8)) & 0x000F000Fu) | BF16_128;   // bytes 1, 3
                            if constexpr (Q5) {
                                const uint32_t hv = h ? qh[i][r].y : qh[i][r].x;
                                if (s <= 4) p0 |= (hv << (4 - s)) & 0x00100010u;
                                else p0 |= (hv >> (s - 4)) & 0x00100010u;
                                p1 |= (hv >> (s + 4)) & 0x00100010u;
                            }
                            a[h][r] = bf2_sub(p0, BF16_128);
                            a[h][2 + r] = bf2_sub(p1, BF16_128);
                        }
                    }
                    float c[4] = {0.f, 0.f, 0.f, 0.f};
                    mma_x(c, a[0], f0);
                    mma_x(c, a[1], f1);
                    float scg, sc8, mng, mn8;
                    switch (s & 3) {   // compile-time after unrolling
                        case 0: scg = byte_f<0>(sc[i][0][s >> 2]); sc8 = byte_f<0>(sc[i][1][s >> 2]);
                                mng = byte_f<0>(mn[i][0][s >> 2]); mn8 = byte_f<0>(mn[i][1][s >> 2]); break;
                        case 1: scg = byte_f<1>(sc[i][0][s >> 2]); sc8 = byte_f<1>(sc[i][1][s >> 2]);
                                mng = byte_f<1>(mn[i][0][s >> 2]); mn8 = byte_f<1>(mn[i][1][s >> 2]); break;
                        case 2: scg = byte_f<2>(sc[i][0][s >> 2]); sc8 = byte_f<2>(sc[i][1][s >> 2]);
                                mng = byte_f<2>(mn[i][0][s >> 2]); mn8 = byte_f<2>(mn[i][1][s >> 2]); break;
                        default: scg = byte_f<3>(sc[i][0][s >> 2]); sc8 = byte_f<3>(sc[i][1][s >> 2]);
                                 mng = byte_f<3>(mn[i][0][s >> 2]); mn8 = byte_f<3>(mn[i][1][s >> 2]); break;
                    }
                    s1[i][0] += scg * c[0];
                    s1[i][1] += scg * c[1];
                    s1[i][2] += sc8 * c[2];
                    s1[i][3] += sc8 * c[3];
                    s2[i][0] += mng * xs[0];
                    s2[i][1] += mng * xs[1];
                    s2[i][2] += mn8 * xs[2];
                    s2[i][3] += mn8 * xs[3];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float d = __half2float(__ushort_as_half((unsigned short)(hdr[i][r].x & 0xFFFF)));
                const float dmin = __half2float(__ushort_as_half((unsigned short)(hdr[i][r].x >> 16)));
                acc[i][2 * r] += d * s1[i][2 * r] - dmin * s2[i][2 * r];
                acc[i][2 * r + 1] += d * s1[i][2 * r + 1] - dmin * s2[i][2 * r + 1];
            }
        }
    }
}

template <int C>
__device__ __forceinline__ uint32_t comp(const uint4 &v) {
    if constexpr (C == 0) return v.x;
    else if constexpr (C == 1) return v.y;
    else if constexpr (C == 2) return v.z;
    else return v.w;
}

// Q6_K, regrouped planes. Group c = 2 * half + l / 16; quarter qq; lane t owns values
// l = 16 * (c & 1) + 4t + 0..3 of each (half, quarter): one word of each kind per group.
template <int C, int QQ>
__device__ __forceinline__ void q6_group(const uint4 (&qa)[MMA_TILES][2], const uint4 (&qb)[MMA_TILES][2],
                                         const uint4 (&qhh)[MMA_TILES][2], const uint4 (&scw)[MMA_TILES][2],
                                         const Frag &f, float (&s1)[MMA_TILES][4]) {
    constexpr int S = 8 * (C >> 1) + 2 * QQ + (C & 1);   // ggml's scale index
    constexpr int SH = 4 * (QQ >> 1);                     // quarters 2, 3: high nibbles
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i) {
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t A = (QQ & 1) ? comp<C>(qb[i][r]) : comp<C>(qa[i][r]);
            const uint32_t H = comp<C>(qhh[i][r]);
            const uint32_t p0 = ((A >> SH) & 0x000F000Fu) | (shr<2 * QQ - 4>(H) & 0x00300030u) | BF16_128;
            const uint32_t p1 = ((A >> (SH + 8)) & 0x000F000Fu) | (shr<2 * QQ + 4>(H) & 0x00300030u) | BF16_128;
            a[r] = bf2_sub(p0, BF16_160);
            a[2 + r] = bf2_sub(p1, BF16_160);
        }
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        mma_x(c, a, f);
        // signed scale bytes, stored XOR 0x80: (2^23 + 128 + sc) - (2^23 + 128)
        const float scg = byte_f<S & 3>(comp<(S >> 2)>(scw[i][0])) - 128.0f;
        const float sc8 = byte_f<S & 3>(comp<(S >> 2)>(scw[i][1])) - 128.0f;
        s1[i][0] += scg * c[0];
        s1[i][1] += scg * c[1];
        s1[i][2] += sc8 * c[2];
        s1[i][3] += sc8 * c[3];
    }
}

template <int C>
__device__ __forceinline__ void q6_groups(const uint4 (&qa)[MMA_TILES][2], const uint4 (&qb)[MMA_TILES][2],
                                          const uint4 (&qhh)[MMA_TILES][2], const uint4 (&scw)[MMA_TILES][2],
                                          const float *xg, int64_t u, int t, bool has_x,
                                          float (&s1)[MMA_TILES][4]) {
    const int64_t col = u * QK_K + 128 * (C >> 1) + 16 * (C & 1) + 4 * t;
    const float4 x0 = load_x(xg, col, has_x), x1 = load_x(xg, col + 32, has_x);
    const float4 x2 = load_x(xg, col + 64, has_x), x3 = load_x(xg, col + 96, has_x);
    q6_group<C, 0>(qa, qb, qhh, scw, frag_of(x0), s1);
    q6_group<C, 1>(qa, qb, qhh, scw, frag_of(x1), s1);
    q6_group<C, 2>(qa, qb, qhh, scw, frag_of(x2), s1);
    q6_group<C, 3>(qa, qb, qhh, scw, frag_of(x3), s1);
}

__device__ __forceinline__ void run_q6(const Matrix &w, const TileRows &src, int warp, int t,
                                       const float *xg, bool has_x, TileAcc &acc) {
    const int64_t nb = w.K / QK_K;
    const Q6Planes p = q6_K_planes(w.M, w.K);
    for (int64_t u = warp; u < nb; u += MMA_WARPS) {
        uint4 qa[MMA_TILES][2], qb[MMA_TILES][2], qhh[MMA_TILES][2], scw[MMA_TILES][2];
        float d[MMA_TILES][2];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int64_t blk = src[i][r] * nb + u;
                const uint8_t *q = w.data + p.q + blk * 192 + 16 * t;
                qa[i][r] = ld16(q);
                qb[i][r] = ld16(q + 64);
                qhh[i][r] = ld16(q + 128);
                scw[i][r] = ld16(w.data + p.sc + blk * 16);
                d[i][r] = __half2float(__ldg(reinterpret_cast<const __half *>(w.data + p.d + blk * 2)));
            }
        }
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                scw[i][r].x ^= 0x80808080u;
                scw[i][r].y ^= 0x80808080u;
                scw[i][r].z ^= 0x80808080u;
                scw[i][r].w ^= 0x80808080u;
            }
        }
        float s1[MMA_TILES][4];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) s1[i][k] = 0.0f;
        q6_groups<0>(qa, qb, qhh, scw, xg, u, t, has_x, s1);
        q6_groups<1>(qa, qb, qhh, scw, xg, u, t, has_x, s1);
        q6_groups<2>(qa, qb, qhh, scw, xg, u, t, has_x, s1);
        q6_groups<3>(qa, qb, qhh, scw, xg, u, t, has_x, s1);
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
            acc[i][0] += d[i][0] * s1[i][0];
            acc[i][1] += d[i][0] * s1[i][1];
            acc[i][2] += d[i][1] * s1[i][2];
            acc[i][3] += d[i][1] * s1[i][3];
        }
    }
}

// Q8_0 planar, in units of 128 columns (4 blocks of 32). Lane t reads 8 bytes at 8t of each block.
// An int8 q = low7 - 128 * sign: (128 + low7) - (128 or 256), the sign bit landing on bf16's
// exponent LSB.
__device__ __forceinline__ void run_q8(const Matrix &w, const TileRows &src, int warp, int t,
                                       const float *xg, bool has_x, TileAcc &acc) {
    const int64_t nu = w.K / 128;
    const Q8Planes p = q8_0_planes(w.M, w.K);
    for (int64_t u = warp; u < nu; u += MMA_WARPS) {
        uint2 q[MMA_TILES][2][4], dw[MMA_TILES][2];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint8_t *row = w.data + p.qs + src[i][r] * w.K + u * 128 + 8 * t;
#pragma unroll
                for (int s = 0; s < 4; ++s) q[i][r][s] = ld8(row + 32 * s);
                dw[i][r] = ld8(w.data + p.d + (src[i][r] * (w.K / QK8_0) + u * 4) * 2);
            }
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int64_t col = u * 128 + 32 * s + 8 * t;
            const Frag f0 = frag_of(load_x(xg, col, has_x)), f1 = frag_of(load_x(xg, col + 4, has_x));
#pragma unroll
            for (int i = 0; i < MMA_TILES; ++i) {
                uint32_t a[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const uint32_t wv = h ? q[i][r][s].y : q[i][r][s].x, w8 = wv >> 8;
                        a[h][r] = bf2_sub((wv & 0x007F007Fu) | BF16_128, (wv & 0x00800080u) | BF16_128);
                        a[h][2 + r] = bf2_sub((w8 & 0x007F007Fu) | BF16_128, (w8 & 0x00800080u) | BF16_128);
                    }
                }
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                mma_x(c, a[0], f0);
                mma_x(c, a[1], f1);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint32_t dword = (s < 2) ? dw[i][r].x : dw[i][r].y;
                    const float d = __half2float(__ushort_as_half((unsigned short)((s & 1) ? dword >> 16 : dword & 0xFFFF)));
                    acc[i][2 * r] += d * c[2 * r];
                    acc[i][2 * r + 1] += d * c[2 * r + 1];
                }
            }
        }
    }
}

// One block: MMA_ROWS output rows (from blockIdx), 8 warps splitting K. Lane (g, t) of a warp
// feeds weight rows g and g+8 of each tile and activation vector g (zeros when g >= n_vec), and
// ends with C for rows (g, g+8) x vectors (2t, 2t+1).
template <int TYPE>
__global__ void __launch_bounds__(32 * MMA_WARPS)
mma_matvec_kernel(const Matrix w, const float *__restrict__ x, float *__restrict__ y, int n_vec,
                  bool accumulate, const int32_t *__restrict__ rows, int64_t n_out) {
    __shared__ float red[MMA_WARPS][MMA_TILES * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t out0 = (int64_t)blockIdx.x * MMA_ROWS;
    int64_t src[MMA_TILES][2];
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int64_t o = out0 + 16 * i + g + 8 * r;
            if (o >= n_out) o = n_out - 1;   // rows past the end compute a copy, never written
            src[i][r] = rows ? (int64_t)rows[o] : o;
        }
    }
    float acc[MMA_TILES][4];
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[i][k] = 0.0f;
    const bool has_x = g < n_vec;
    const float *xg = x + (has_x ? (int64_t)g * w.K : 0);
    if constexpr (TYPE == TYPE_Q4_K) run_q4_q5<false>(w, src, warp, t, xg, has_x, acc);
    else if constexpr (TYPE == TYPE_Q5_K) run_q4_q5<true>(w, src, warp, t, xg, has_x, acc);
    else if constexpr (TYPE == TYPE_Q6_K) run_q6(w, src, warp, t, xg, has_x, acc);
    else run_q8(w, src, warp, t, xg, has_x, acc);

#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) red[warp][4 * i + k][lane] = acc[i][k];
    __syncthreads();
    // warp w sums slot w over the 8 warps, always in the same order
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < MMA_WARPS; ++wi) v += red[wi][warp][lane];
    const int i = warp >> 2, k = warp & 3;
    const int64_t o = out0 + 16 * i + g + 8 * (k >> 1);
    const int vec = 2 * t + (k & 1);
    if (vec < n_vec && o < n_out) {
        float *dst = y + (int64_t)vec * n_out + o;
        *dst = accumulate ? *dst + v : v;
    }
}

template <int TYPE>
void launch_mma(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate,
                const int32_t *rows, int64_t n_out, cudaStream_t st) {
    const dim3 grid((unsigned)((n_out + MMA_ROWS - 1) / MMA_ROWS));
    mma_matvec_kernel<TYPE><<<grid, 32 * MMA_WARPS, 0, st>>>(w, x, y, n_vec, accumulate, rows, n_out);
}

void launch_any(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate,
                const int32_t *rows, int64_t n_out, cudaStream_t st, const char *what) {
    if (n_vec < 1 || n_vec > 8) fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": vector count must be 1..8");
    if (n_out <= 0) return;
    const bool quant = w.type == TYPE_Q8_0 || w.type == TYPE_Q4_K || w.type == TYPE_Q5_K || w.type == TYPE_Q6_K;
    if (quant && w.K % QK_K != 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": " + type_name(w.type) + " needs K a multiple of 256, got " +
                                     std::to_string(w.K));
    if (!quant && w.K % 8 != 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": K must be a multiple of 8, got " + std::to_string(w.K));
    switch (w.type) {
        case TYPE_F32: launch_float<TYPE_F32>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_F16: launch_float<TYPE_F16>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_BF16: launch_float<TYPE_BF16>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_Q8_0: launch_mma<TYPE_Q8_0>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_Q4_K: launch_mma<TYPE_Q4_K>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_Q5_K: launch_mma<TYPE_Q5_K>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        case TYPE_Q6_K: launch_mma<TYPE_Q6_K>(w, x, y, n_vec, accumulate, rows, n_out, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": no kernel for type " + type_name(w.type));
    }
    check_launch(what);
}

}  // namespace

inline void matvec(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, cudaStream_t st) {
    launch_any(w, x, y, n_vec, accumulate, nullptr, w.M, st, "v1 matvec");
}

}  // namespace oj_v1
