// matvec.cu: quantised matrix x (1..8 activation vectors), and embedding rows.
//
// y[n][m] = sum_k W[m][k] * x[n][k] for every vector n < N, every weight byte read once per call
// whatever N is (the layout of a verification pass).
//
// Quantised types (Q4_K, Q5_K, Q6_K, Q8_0) run on the tensor cores: mma.m16n8k16 with bf16
// operands and fp32 accumulation. A (16 rows x 16 k) holds the block's integer quants, which bf16
// represents exactly (0..15, 16..31, -32..31, -128..127); B (16 k x 8 columns) holds the 1..8
// activation vectors, each split into a bf16 high part and a bf16 remainder, so x keeps ~16
// significant bits (relative error ~4e-6) and fp32's range.
// The block scales multiply the fp32 partial sum of each scale group (32 values for the K-quants'
// sub-blocks and Q8_0, 16 for Q6_K); the K-quant mins multiply the group's sum of x, taken by one
// extra mma with A = 1 that every row tile of the warp shares. Nothing is rounded but x.
//
// The k order inside one mma is free as long as A and B agree, so each lane reads its weight
// bytes as stored (8 or 16 contiguous bytes, a quad of lanes covering whole 32-byte sectors of a
// row) and takes the matching activation columns: lane t of a quad holds columns (0,2 | 1,3) of
// each group of 4 it owns, which is what the nibble-pair extraction (bits 0-3 and 16-19 of a word)
// yields. A block is 4 warps over the same 16 rows (one tile); the warps split K by
// super-block and their partial sums meet in shared memory in a fixed order, so the result for a
// vector does not depend on N or on timing (2..8 vectors per call bit-identical to one).
// Each warp loads its next super-block's bytes into a second register set before computing the
// current one (software prefetch), so a warp's DRAM latency overlaps its own math; the arithmetic
// and its order are unchanged from the first version (tools/matvec_v1.cuh), results bit-identical.
// Q8_0 needs K a multiple of 32 only (a partial last 128-column unit); the K-quants need 256.
//
// Q4_K and Q6_K take matvec_f16.cuh (fp16 activations, the weights dequantised exactly in fp16; a
// 27B pass 13.1 ms against the bf16-split kernels' 21.4 on the H200), Q5_K and Q8_0 the bf16-split
// kernels below; their Q4_K / Q6_K instances are tools/matvec_f16_bench.cu's reference.
//
// Float weights (F32/F16/BF16) keep the fp32 CUDA-core kernel: one warp per row, 8 values per lane.
// The numpy twin is `W.astype(float64) @ x` with W dequantised by gguf.quants
// (openjet_plugin.testing.reference).
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "dequant.cuh"
#include "engine.cuh"
#include "matvec_f16.cuh"
#include "pdl.cuh"

namespace oj {

namespace {

// ---------------------------------------------------------------------------------------------
// Float weights: one warp per row, fp32 FMAs (the v1 kernel).

constexpr int MAX_VECTORS = OJ_MAX_POSITIONS;   // a call's vectors: the fp16 path 16, the others 8 a launch
constexpr int ROWS_PER_BLOCK = 8;   // 8 warps, one row each

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
    pdl_launch_dependents();
    pdl_wait();
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
    cudaError_t e = cudaSuccess;
    switch (n_vec) {
        case 1: e = launch(float_matvec_kernel<TYPE, 1>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 2: e = launch(float_matvec_kernel<TYPE, 2>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 3: e = launch(float_matvec_kernel<TYPE, 3>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 4: e = launch(float_matvec_kernel<TYPE, 4>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 5: e = launch(float_matvec_kernel<TYPE, 5>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 6: e = launch(float_matvec_kernel<TYPE, 6>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        case 7: e = launch(float_matvec_kernel<TYPE, 7>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
        default: e = launch(float_matvec_kernel<TYPE, 8>, grid, block, 0, st, w, x, y, accumulate, rows, n_out); break;
    }
    check_cuda(e, "matvec");
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

// One step's bytes of a Q4_K / Q5_K tile: super-block u of the lane's two rows (see run_q4_q5).
template <bool Q5>
__device__ __forceinline__ void load_q4_q5(const Matrix &w, const TileRows &src, int64_t u, int64_t nb, int t,
                                           uint4 (&hdr)[MMA_TILES][2], uint2 (&q)[MMA_TILES][2][4],
                                           uint2 (&qh)[MMA_TILES][2]) {
    constexpr int BYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint8_t *b = w.data + (Q5 ? (src[i][r] * nb + u) * BYTES : q4_K_offset(src[i][r], u, nb));
            hdr[i][r] = ld16(b);
            if constexpr (Q5) qh[i][r] = ld8(b + 16 + 8 * t);
#pragma unroll
            for (int j = 0; j < 4; ++j) q[i][r][j] = ld8(b + QS + 32 * j + 8 * t);
        }
    }
}

// Q4_K / Q5_K (file layout). Lane t of a quad reads bytes 8t..8t+7 of each 32-byte chunk j of the
// row's quants: low nibbles are sub-block 2j, high nibbles sub-block 2j+1, columns 8t.. of each.
// Q5_K's fifth bit of value l of sub-block s is bit s of qh[l]: the same 8 qh bytes for every j.
template <bool Q5>
__device__ __forceinline__ void run_q4_q5(const Matrix &w, const TileRows &src, int warp, int t,
                                          const float *xg, bool has_x, TileAcc &acc) {
    const int64_t nb = w.K / QK_K;
    if (warp >= nb) return;
    uint4 hdr[MMA_TILES][2];
    uint2 q[MMA_TILES][2][4];
    uint2 qh[MMA_TILES][2];
    load_q4_q5<Q5>(w, src, warp, nb, t, hdr, q, qh);
    for (int64_t u = warp; u < nb; u += MMA_WARPS) {
        // Prefetch: the next step's bytes are in flight while this one computes (the last step
        // re-reads its own block, an L1 hit, rather than branch).
        uint4 hdr_n[MMA_TILES][2];
        uint2 q_n[MMA_TILES][2][4];
        uint2 qh_n[MMA_TILES][2];
        load_q4_q5<Q5>(w, src, u + MMA_WARPS < nb ? u + MMA_WARPS : u, nb, t, hdr_n, q_n, qh_n);
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
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                hdr[i][r] = hdr_n[i][r];
                if constexpr (Q5) qh[i][r] = qh_n[i][r];
#pragma unroll
                for (int j = 0; j < 4; ++j) q[i][r][j] = q_n[i][r][j];
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

// One step's bytes of a Q6_K tile: super-block u of the lane's two rows (regrouped planes).
__device__ __forceinline__ void load_q6(const Matrix &w, const Q6Planes &p, const TileRows &src, int64_t u,
                                        int64_t nb, int t, uint4 (&qa)[MMA_TILES][2], uint4 (&qb)[MMA_TILES][2],
                                        uint4 (&qhh)[MMA_TILES][2], uint4 (&scw)[MMA_TILES][2],
                                        unsigned short (&dh)[MMA_TILES][2]) {
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int64_t blk = src[i][r] * nb + u;
            const uint8_t *q = w.data + p.q + q6_K_q_offset(src[i][r], u, nb) + 16 * t;
            qa[i][r] = ld16(q);
            qb[i][r] = ld16(q + 64);
            qhh[i][r] = ld16(q + 128);
            scw[i][r] = ld16(w.data + p.sc + q6_K_sc_offset(src[i][r], u, nb));
            dh[i][r] = __ldg(reinterpret_cast<const unsigned short *>(w.data + p.d + blk * 2));
        }
    }
}

__device__ __forceinline__ void run_q6(const Matrix &w, const TileRows &src, int warp, int t,
                                       const float *xg, bool has_x, TileAcc &acc) {
    const int64_t nb = w.K / QK_K;
    if (warp >= nb) return;
    const Q6Planes p = q6_K_planes(w.M, w.K);
    uint4 qa[MMA_TILES][2], qb[MMA_TILES][2], qhh[MMA_TILES][2], scw[MMA_TILES][2];
    unsigned short dh[MMA_TILES][2];
    load_q6(w, p, src, warp, nb, t, qa, qb, qhh, scw, dh);
    for (int64_t u = warp; u < nb; u += MMA_WARPS) {
        // Prefetch the next step (the last step re-reads its own block: an L1 hit, no branch).
        uint4 qa_n[MMA_TILES][2], qb_n[MMA_TILES][2], qhh_n[MMA_TILES][2], scw_n[MMA_TILES][2];
        unsigned short dh_n[MMA_TILES][2];
        load_q6(w, p, src, u + MMA_WARPS < nb ? u + MMA_WARPS : u, nb, t, qa_n, qb_n, qhh_n, scw_n, dh_n);
        float d[MMA_TILES][2];
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                d[i][r] = __half2float(__ushort_as_half(dh[i][r]));
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
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                qa[i][r] = qa_n[i][r];
                qb[i][r] = qb_n[i][r];
                qhh[i][r] = qhh_n[i][r];
                scw[i][r] = scw_n[i][r];
                dh[i][r] = dh_n[i][r];
            }
        }
    }
}

// Q8_0 planar, in units of 128 columns (4 blocks of 32). Lane t reads 8 bytes at 8t of each block.
// An int8 q = low7 - 128 * sign: (128 + low7) - (128 or 256), the sign bit landing on bf16's
// exponent LSB. K need only be a multiple of 32: when K % 128 != 0 the last unit holds
// nlast = (K % 128) / 32 blocks, and its missing blocks are neither loaded nor computed. The
// scales are then read one fp16 at a time (a row's d run, (K/32) * 2 bytes, is 8-byte aligned
// only when K % 128 == 0).
__device__ __forceinline__ void load_q8(const Matrix &w, const Q8Planes &p, const TileRows &src, int64_t u,
                                        int nblk, bool full, int t, uint2 (&q)[MMA_TILES][2][4],
                                        uint2 (&dw)[MMA_TILES][2]) {
    const int64_t nb32 = w.K / QK8_0;
#pragma unroll
    for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint8_t *row = w.data + p.qs + src[i][r] * w.K + u * 128 + 8 * t;
            const uint8_t *dp = w.data + p.d + (src[i][r] * nb32 + u * 4) * 2;
            if (full) {
#pragma unroll
                for (int s = 0; s < 4; ++s) q[i][r][s] = ld8(row + 32 * s);
                dw[i][r] = ld8(dp);
            } else {
                uint32_t dh[4];
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    q[i][r][s] = s < nblk ? ld8(row + 32 * s) : make_uint2(0u, 0u);
                    dh[s] = s < nblk ? __ldg(reinterpret_cast<const unsigned short *>(dp + 2 * s)) : 0u;
                }
                dw[i][r] = make_uint2(dh[0] | (dh[1] << 16), dh[2] | (dh[3] << 16));
            }
        }
    }
}

__device__ __forceinline__ void run_q8(const Matrix &w, const TileRows &src, int warp, int t,
                                       const float *xg, bool has_x, TileAcc &acc) {
    const int64_t nu = (w.K + 127) / 128;
    if (warp >= nu) return;
    const int nlast = (int)((w.K % 128) / 32);   // blocks in the last unit, 0: it is full
    const Q8Planes p = q8_0_planes(w.M, w.K);
    auto blocks_of = [&](int64_t u) { return (nlast != 0 && u == nu - 1) ? nlast : 4; };
    uint2 q[MMA_TILES][2][4], dw[MMA_TILES][2];
    {
        const int nblk = blocks_of(warp);
        load_q8(w, p, src, warp, nblk, nblk == 4 && nlast == 0, t, q, dw);
    }
    for (int64_t u = warp; u < nu; u += MMA_WARPS) {
        const int nblk = blocks_of(u);
        // Prefetch the next step (the last step re-reads its own unit: an L1 hit, no branch).
        const int64_t un = u + MMA_WARPS < nu ? u + MMA_WARPS : u;
        const int nblk_n = blocks_of(un);
        uint2 q_n[MMA_TILES][2][4], dw_n[MMA_TILES][2];
        load_q8(w, p, src, un, nblk_n, nblk_n == 4 && nlast == 0, t, q_n, dw_n);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            if (s >= nblk) break;   // only in the last unit when K % 128 != 0
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
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                dw[i][r] = dw_n[i][r];
#pragma unroll
                for (int s = 0; s < 4; ++s) q[i][r][s] = q_n[i][r][s];
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
    pdl_launch_dependents();
    pdl_wait();
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
    check_cuda(launch(mma_matvec_kernel<TYPE>, grid, 32 * MMA_WARPS, 0, st, w, x, y, n_vec, accumulate, rows, n_out), "matvec");
}

// 2: Q4_K and Q6_K on the fp16 path (matvec_f16.cuh), the engine's only setting; 0: on the
// bf16-split kernels above, the reference tools/matvec_f16_bench.cu checks the fp16 path against
// (matvec_force_path below; the engine never calls it).
int g_path = 2;

int path() { return g_path; }

// The fp16 path (matvec_f16.cuh: x in fp16 under a power-of-two scale per vector and super-block,
// the weights dequantised exactly in fp16) for Q4_K and Q6_K; its workspace per (device, stream),
// grown on demand.
std::atomic<uint64_t> g_workspace_generation{0};

void *f16_workspace(int64_t K, cudaStream_t st) {
    struct Buf {
        void *p = nullptr;
        size_t cap = 0;
    };
    static std::mutex mu;
    static std::map<std::pair<int, cudaStream_t>, Buf> bufs;
    int dev = 0;
    check_cuda(cudaGetDevice(&dev), "matvec f16: cudaGetDevice");
    void *ws = nullptr;
    {
        std::lock_guard<std::mutex> lock(mu);
        Buf &b = bufs[{dev, st}];
        const size_t need = matvec_f16_workspace_bytes(K);
        if (need > b.cap) {
            if (b.p) {   // the old buffer may still be in use on the stream
                check_cuda(cudaStreamSynchronize(st), "matvec f16: sync before growing the workspace");
                check_cuda(cudaFree(b.p), "matvec f16: cudaFree");
                ++g_workspace_generation;
            }
            b.p = nullptr;
            check_cuda(cudaMalloc(&b.p, std::max<size_t>(need, matvec_f16_workspace_bytes(32768))), "matvec f16: workspace");
            b.cap = std::max<size_t>(need, matvec_f16_workspace_bytes(32768));
        }
        ws = b.p;
    }
    return ws;
}

void launch_f16(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, const int32_t *rows,
                int64_t n_out, cudaStream_t st) {
    void *ws = f16_workspace(w.K, st);
    mvf16::prep(w.type, x, w.K, n_vec, ws, st);
    mvf16::run(w, ws, y, n_vec, accumulate, rows, n_out, true, st);
}

bool f16_fits(const Matrix &w) { return path() == 2 && mvf16::supports(w.type) && w.K > 0 && w.K % QK_K == 0; }

void launch_any(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate,
                const int32_t *rows, int64_t n_out, cudaStream_t st, const char *what) {
    if (n_vec < 1 || n_vec > MAX_VECTORS)
        fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": vector count must be 1.." + std::to_string(MAX_VECTORS));
    if (n_out <= 0) return;
    if (n_vec > 8 && !f16_fits(w)) {   // the other kernels take 8 vectors a launch: 8 at a time
        for (int v0 = 0; v0 < n_vec; v0 += 8)
            launch_any(w, x + (int64_t)v0 * w.K, y + (int64_t)v0 * n_out, std::min(8, n_vec - v0), accumulate, rows, n_out, st, what);
        return;
    }
    const bool kquant = w.type == TYPE_Q4_K || w.type == TYPE_Q5_K || w.type == TYPE_Q6_K;
    const bool quant = kquant || w.type == TYPE_Q8_0;
    if (kquant && w.K % QK_K != 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": " + type_name(w.type) + " needs K a multiple of 256, got " +
                                     std::to_string(w.K));
    if (w.type == TYPE_Q8_0 && w.K % QK8_0 != 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": Q8_0 needs K a multiple of 32, got " + std::to_string(w.K));
    if (!quant && w.K % 8 != 0)
        fail(OJ_ERR_UNSUPPORTED, std::string(what) + ": K must be a multiple of 8, got " + std::to_string(w.K));
    if (f16_fits(w)) {
        launch_f16(w, x, y, n_vec, accumulate, rows, n_out, st);
        check_launch(what);
        return;
    }
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

// ---------------------------------------------------------------------------------------------
// Embedding rows.

__global__ void embed_kernel(const Matrix w, const int32_t *__restrict__ tokens, float *__restrict__ y) {
    pdl_launch_dependents();
    pdl_wait();
    const int n = blockIdx.x;
    const int64_t row = tokens[n];
    for (int64_t k = threadIdx.x; k < w.K; k += blockDim.x) y[n * w.K + k] = dequant_one(w, row, k);
}

}  // namespace

uint64_t matvec_workspace_generation() { return g_workspace_generation.load(); }

void matvec(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, cudaStream_t st) {
    launch_any(w, x, y, n_vec, accumulate, nullptr, w.M, st, "matvec");
}

namespace {

constexpr int MAX_MEMBERS = 8;

// Whether every member with rows takes the fp16 path, so that its prep computes the input (norm,
// SwiGLU, gated norm) on the way instead of a kernel of its own before it (773 launches a 27B pass
// instead of 1,013). Measured on H100s, q27b, plain launches, against the unfused kernels: one pass
// over 1 position 11.70 -> 10.47 ms (a13fc39), 11.82 -> 10.70 ms (43d7cd9). The unfused kernels
// stay for the members the fp16 path does not take.
bool fused_prep(const Matrix *const *w, int n, int n_vec) {
    if (n_vec < 1 || n_vec > MAX_VECTORS) return false;
    for (int i = 0; i < n; ++i)
        if (w[i]->M > 0 && !f16_fits(*w[i])) return false;
    return true;
}

// matvec_group with the prep's input `in` (in.x alone, unless every member takes the fp16 path).
void group_in(const Matrix *const *w, float *const *y, int n, const mvf16::PrepIn &in, int n_vec, cudaStream_t st) {
    if (n < 1 || n > MAX_MEMBERS) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_group: 1..8 matrices");
    for (int i = 0; i < n; ++i)
        if (w[i]->K != w[0]->K) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_group: the matrices read one x, so share K");
    const float *x = in.x;
    // members of one type (the prepared x's order is the type's), up to GROUP_MAX, in one fp16
    // launch; everything else one matvec each. Where the members take both fp16 types (a Q4_K_M
    // layer whose qkv or v is Q6_K), the first type's prep also writes x in the other's order, and
    // the other type's launch follows the first's with no prep of its own between them.
    bool done[MAX_MEMBERS] = {};
    int prepped = -1;   // the type of the prep in the workspace (-1: none yet); region 1 holds the other's
    bool both = false;
    for (int i = 0; i < n; ++i) {
        if (done[i] || w[i]->M <= 0) continue;   // no rows: nothing to compute
        Matrix ws[mvf16::GROUP_MAX];
        float *ys[mvf16::GROUP_MAX];
        int m = 0;
        if (f16_fits(*w[i]) && n_vec >= 1 && n_vec <= MAX_VECTORS)
            for (int k = i; k < n && m < mvf16::GROUP_MAX; ++k)
                if (!done[k] && w[k]->type == w[i]->type && w[k]->M > 0) ws[m] = *w[k], ys[m] = y[k], done[k] = true, ++m;
        if (m >= 1) {
            void *buf = f16_workspace(w[i]->K, st);
            int region = 0;
            if (prepped >= 0 && both && w[i]->type != prepped) {
                region = 1;   // prepared by the first type's prep
            } else {
                both = false;   // another fp16 type among the members left: prep its order too
                for (int k = i + 1; k < n; ++k)
                    both |= !done[k] && w[k]->M > 0 && f16_fits(*w[k]) && w[k]->type != w[i]->type;
                mvf16::prep(w[i]->type, in, w[i]->K, n_vec, buf, st, both);
                prepped = w[i]->type;
            }
            if (m >= 2) mvf16::run_group(ws, ys, m, buf, n_vec, true, st, region);
            else mvf16::run(*w[i], buf, y[i], n_vec, false, nullptr, w[i]->M, true, st, region);
            check_launch("matvec_group");
        } else {
            done[i] = true;
            launch_any(*w[i], x, y[i], n_vec, false, nullptr, w[i]->M, st, "matvec_group");
        }
    }
}

}  // namespace

void matvec_group(const Matrix *const *w, float *const *y, int n, const float *x, int n_vec, cudaStream_t st) {
    mvf16::PrepIn in;
    in.x = x;
    group_in(w, y, n, in, n_vec, st);
}

namespace {

// The sums of squares of the residual's row tiles ([tiles][16]) that a residual writer leaves for the
// next norm prep on its stream (residual_sums), per (device, stream).
constexpr int64_t SSQ_TILES = mvf16::MAX_TILES;
float *ssq_buffer(cudaStream_t st) {
    static std::mutex mu;
    static std::map<std::pair<int, cudaStream_t>, float *> bufs;
    int dev = 0;
    check_cuda(cudaGetDevice(&dev), "residual sums: cudaGetDevice");
    std::lock_guard<std::mutex> lock(mu);
    float *&p = bufs[{dev, st}];
    if (!p) check_cuda(cudaMalloc(&p, (size_t)SSQ_TILES * mvf16::SSQ_VEC * sizeof(float)), "residual sums: buffer");
    return p;
}

// Whether a residual writer of n_out rows leaves its row tiles' sums (the fp16 path, whole tiles).
bool leaves_sums(const Matrix &w, int n_vec) {
    const Matrix *ws[] = {&w};
    return fused_prep(ws, 1, n_vec) && w.M > 0 && w.M % mvf16::ROWS == 0 && w.M / mvf16::ROWS <= SSQ_TILES;
}

}  // namespace

void matvec_group_norm(const Matrix *const *w, float *const *y, int n, const float *x, const float *norm, float eps,
                       float *xn, int n_vec, cudaStream_t st, bool sums) {
    const int64_t K = n > 0 ? w[0]->K : 0;
    if (!fused_prep(w, n, n_vec)) {
        rms_norm(x, norm, xn, n_vec, (int)K, eps, (int)K, st);
        return matvec_group(w, y, n, xn, n_vec, st);
    }
    mvf16::PrepIn in;
    in.x = x;
    in.norm = norm;
    in.eps = eps;
    if (sums && K % mvf16::ROWS == 0 && K / mvf16::ROWS <= SSQ_TILES) in.ssq = ssq_buffer(st);
    group_in(w, y, n, in, n_vec, st);
}

bool matvec_residual(const Matrix &w, const float *x, float *y, int n_vec, cudaStream_t st) {
    if (!leaves_sums(w, n_vec)) {
        matvec(w, x, y, n_vec, true, st);
        return false;
    }
    void *ws = f16_workspace(w.K, st);
    mvf16::prep(w.type, x, w.K, n_vec, ws, st);
    mvf16::run(w, ws, y, n_vec, true, nullptr, w.M, true, st, 0, ssq_buffer(st));
    check_launch("matvec_residual");
    return true;
}

bool matvec_gated_norm(const Matrix &w, float *o, const float *z, const float *norm, int n_heads, int S, float eps, float *y,
                       int n_vec, bool accumulate, cudaStream_t st) {
    const Matrix *ws[] = {&w};
    if (!fused_prep(ws, 1, n_vec) || w.M <= 0 || (S != 32 && S != 64 && S != 128)) {
        deltanet_gated_norm(o, z, norm, n_vec, n_heads, S, eps, st);
        matvec(w, o, y, n_vec, accumulate, st);
        return false;
    }
    mvf16::PrepIn in;
    in.x = o;
    in.head_norm = norm;
    in.z = z;
    in.S = S;
    in.eps = eps;
    void *buf = f16_workspace(w.K, st);
    const bool sums = accumulate && leaves_sums(w, n_vec);
    mvf16::prep(w.type, in, w.K, n_vec, buf, st);
    mvf16::run(w, buf, y, n_vec, accumulate, nullptr, w.M, true, st, 0, sums ? ssq_buffer(st) : nullptr);
    check_launch("matvec_gated_norm");
    return sums;
}

bool matvec_swiglu(const Matrix &w, float *gate, const float *up, float *y, int n_vec, bool accumulate, cudaStream_t st) {
    const Matrix *ws[] = {&w};
    if (!fused_prep(ws, 1, n_vec) || w.M <= 0) {
        swiglu(gate, up, (int64_t)n_vec * w.K, st);
        matvec(w, gate, y, n_vec, accumulate, st);
        return false;
    }
    mvf16::PrepIn in;
    in.x = gate;
    in.up = up;
    void *buf = f16_workspace(w.K, st);
    const bool sums = accumulate && leaves_sums(w, n_vec);
    mvf16::prep(w.type, in, w.K, n_vec, buf, st);
    mvf16::run(w, buf, y, n_vec, accumulate, nullptr, w.M, true, st, 0, sums ? ssq_buffer(st) : nullptr);
    check_launch("matvec_swiglu");
    return sums;
}

void matvec_rows(const Matrix &w, const int32_t *rows, int n_rows, const float *x, float *y, int n_vec,
                 cudaStream_t st) {
    if (n_rows < 0) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_rows: negative row count");
    launch_any(w, x, y, n_vec, false, rows, n_rows, st, "matvec_rows");
}

// Q4_K / Q6_K on the bf16-split reference kernels (0) or the fp16 path (2, the engine's); for
// tools/matvec_f16_bench.cu, which checks the fp16 path against the reference. The engine never calls it.
void matvec_force_path(int p) { g_path = p == 0 ? 0 : 2; }

void embed_rows(const Matrix &w, const int32_t *tokens, float *y, int n, cudaStream_t st) {
    check_cuda(launch(embed_kernel, n, 256, 0, st, w, tokens, y), "embed_rows");
}

size_t device_layout_bytes(int type, int64_t K, int64_t M) {
    switch (type) {
        case TYPE_Q8_0: return q8_0_planes(M, K).total;
        case TYPE_Q6_K: return q6_K_planes(M, K).total;
        case TYPE_Q4_K: return q4_K_tiled_bytes(M, K);
        default: return (size_t)(K / type_block_values(type)) * type_block_bytes(type) * (size_t)M;
    }
}

std::vector<uint8_t> to_device_layout(int type, int64_t K, int64_t M, const uint8_t *src) {
    std::vector<uint8_t> out(device_layout_bytes(type, K, M));
    if (type == TYPE_Q8_0) {
        const Q8Planes p = q8_0_planes(M, K);
        const int64_t nb = K / QK8_0;
        const block_q8_0 *blocks = reinterpret_cast<const block_q8_0 *>(src);
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t b = 0; b < nb; ++b) {
                const block_q8_0 &blk = blocks[m * nb + b];
                std::memcpy(out.data() + p.qs + m * K + b * QK8_0, blk.qs, QK8_0);
                std::memcpy(out.data() + p.d + (m * nb + b) * 2, &blk.d, 2);
            }
        }
    } else if (type == TYPE_Q6_K) {
        const Q6Planes p = q6_K_planes(M, K);
        const int64_t nblk = M * (K / QK_K);
        const block_q6_K *blocks = reinterpret_cast<const block_q6_K *>(src);
        for (int64_t i = 0; i < nblk; ++i) {   // out is zeroed: the last tile's rows past M stay zero
            const int64_t m = i / (K / QK_K), u = i % (K / QK_K);
            uint8_t *q = out.data() + p.q + q6_K_q_offset(m, u, K / QK_K);
            for (int half = 0; half < 2; ++half) {
                for (int l = 0; l < 32; ++l) {
                    const int off = q6_K_byte(half, l);
                    q[off] = blocks[i].ql[64 * half + l];
                    q[64 + off] = blocks[i].ql[64 * half + 32 + l];
                    q[128 + off] = blocks[i].qh[32 * half + l];
                }
            }
            std::memcpy(out.data() + p.sc + q6_K_sc_offset(m, u, K / QK_K), blocks[i].scales, 16);
            std::memcpy(out.data() + p.d + i * 2, &blocks[i].d, 2);
        }
    } else if (type == TYPE_Q4_K) {   // out is zeroed: the last tile's rows past M stay zero blocks
        const int64_t nb = K / QK_K;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t u = 0; u < nb; ++u) std::memcpy(out.data() + q4_K_offset(m, u, nb), src + (m * nb + u) * 144, 144);
    } else {
        std::memcpy(out.data(), src, out.size());
    }
    return out;
}

}  // namespace oj
