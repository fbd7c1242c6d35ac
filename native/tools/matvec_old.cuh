// matvec_old.cuh: the engine's matvec kernels before the tensor-core rewrite (copied from
// native/matvec.cu at the commit the rewrite started from), with their own Q6_K planar layout
// (ql/qh/sc/d planes). Included by matvec_bench.cu only, so one device run shows old and new side
// by side. Not part of the engine.
#pragma once
#include <cuda_bf16.h>

#include <cstring>

#include "engine.cuh"

namespace oj_old {
using namespace oj;

struct OldQ6Planes { size_t ql, qh, sc, d, total; };
__host__ __device__ inline OldQ6Planes old_q6_planes(int64_t M, int64_t K) {
    const size_t nblk = (size_t)M * (K / QK_K);
    OldQ6Planes p;
    p.ql = 0;
    p.qh = nblk * 128;
    p.sc = p.qh + nblk * 64;
    p.d = p.sc + nblk * 16;
    p.total = p.d + nblk * 2;
    return p;
}


namespace {

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

template <int N>
__device__ __forceinline__ void fma_run2(float (&acc)[N], const float *x, int64_t K, int64_t col,
                                         float w0, float w1) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float2 xv = __ldg(reinterpret_cast<const float2 *>(x + n * K + col));
        acc[n] += w0 * xv.x + w1 * xv.y;
    }
}

// One lane's 8 values of super-block u of row m. Lane l of a Q4_K block: chunk j = l/8 of the
// 128 quant bytes, 4 bytes at (l%8)*4; low nibbles are values 64j + .., high nibbles 64j + 32 + ..
template <int N>
__device__ __forceinline__ void unit_q4_K(const Matrix &w, int64_t m, int64_t u, int lane,
                                          const float *x, float (&acc)[N]) {
    const int64_t nb = w.K / QK_K;
    const uint8_t *b = w.data + (m * nb + u) * 144;
    const float d = half_at(b), dmin = half_at(b + 2);
    const int j = lane >> 3, off = (lane & 7) * 4;
    const uint32_t q = *reinterpret_cast<const uint32_t *>(b + 16 + 32 * j + off);
    int s1, m1, s2, m2;
    scale_min_k4(2 * j, b + 4, s1, m1);
    scale_min_k4(2 * j + 1, b + 4, s2, m2);
    const float d1 = d * s1, c1 = dmin * m1, d2 = d * s2, c2 = dmin * m2;
    const int64_t col = u * QK_K + 64 * j + off;
    fma_run4<N>(acc, x, w.K, col, d1 * (q & 15) - c1, d1 * ((q >> 8) & 15) - c1,
                d1 * ((q >> 16) & 15) - c1, d1 * ((q >> 24) & 15) - c1);
    fma_run4<N>(acc, x, w.K, col + 32, d2 * ((q >> 4) & 15) - c2, d2 * ((q >> 12) & 15) - c2,
                d2 * ((q >> 20) & 15) - c2, d2 * ((q >> 28) & 15) - c2);
}

// Q5_K: as Q4_K plus a fifth bit: bit 2j (low nibble) / 2j+1 (high) of qh[value % 32].
template <int N>
__device__ __forceinline__ void unit_q5_K(const Matrix &w, int64_t m, int64_t u, int lane,
                                          const float *x, float (&acc)[N]) {
    const int64_t nb = w.K / QK_K;
    const uint8_t *b = w.data + (m * nb + u) * 176;
    const float d = half_at(b), dmin = half_at(b + 2);
    const int j = lane >> 3, off = (lane & 7) * 4;
    const uint32_t h = *reinterpret_cast<const uint32_t *>(b + 16 + off);
    const uint32_t q = *reinterpret_cast<const uint32_t *>(b + 48 + 32 * j + off);
    int s1, m1, s2, m2;
    scale_min_k4(2 * j, b + 4, s1, m1);
    scale_min_k4(2 * j + 1, b + 4, s2, m2);
    const float d1 = d * s1, c1 = dmin * m1, d2 = d * s2, c2 = dmin * m2;
    float lo[4], hi[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int ql = (q >> (8 * t)) & 15, qhv = (q >> (8 * t + 4)) & 15;
        const int b_lo = (h >> (8 * t + 2 * j)) & 1, b_hi = (h >> (8 * t + 2 * j + 1)) & 1;
        lo[t] = d1 * (ql + 16 * b_lo) - c1;
        hi[t] = d2 * (qhv + 16 * b_hi) - c2;
    }
    const int64_t col = u * QK_K + 64 * j + off;
    fma_run4<N>(acc, x, w.K, col, lo[0], lo[1], lo[2], lo[3]);
    fma_run4<N>(acc, x, w.K, col + 32, hi[0], hi[1], hi[2], hi[3]);
}

// Q6_K planar. Lane l: half n = l/16 of the block, value pair l0 = (l%16)*2, l0+1 of each of the
// four 32-value quarters m (ggml's dequantize_row_q6_K order: y[l + 32m] of each 128-half).
template <int N>
__device__ __forceinline__ void unit_q6_K(const Matrix &w, int64_t m, int64_t u, int lane,
                                          const float *x, float (&acc)[N]) {
    const OldQ6Planes p = old_q6_planes(w.M, w.K);
    const int64_t blk = m * (w.K / QK_K) + u;
    const uint8_t *ql = w.data + p.ql + blk * 128;
    const uint8_t *qh = w.data + p.qh + blk * 64;
    const int8_t *sc = reinterpret_cast<const int8_t *>(w.data + p.sc + blk * 16);
    const float d = half_at(w.data + p.d + blk * 2);
    const int n = lane >> 4, l0 = (lane & 15) * 2, is = l0 >> 4;
    const uint32_t a = *reinterpret_cast<const uint16_t *>(ql + 64 * n + l0);
    const uint32_t b = *reinterpret_cast<const uint16_t *>(ql + 64 * n + 32 + l0);
    const uint32_t h = *reinterpret_cast<const uint16_t *>(qh + 32 * n + l0);
    float v[4][2];
#pragma unroll
    for (int dl = 0; dl < 2; ++dl) {
        const int qa = (a >> (8 * dl)) & 0xFF, qb = (b >> (8 * dl)) & 0xFF, hh = (h >> (8 * dl)) & 0xFF;
        const int q0 = ((qa & 15) | ((hh & 3) << 4)) - 32;
        const int q1 = ((qb & 15) | (((hh >> 2) & 3) << 4)) - 32;
        const int q2 = ((qa >> 4) | (((hh >> 4) & 3) << 4)) - 32;
        const int q3 = ((qb >> 4) | (((hh >> 6) & 3) << 4)) - 32;
        v[0][dl] = d * sc[8 * n + is + 0] * q0;
        v[1][dl] = d * sc[8 * n + is + 2] * q1;
        v[2][dl] = d * sc[8 * n + is + 4] * q2;
        v[3][dl] = d * sc[8 * n + is + 6] * q3;
    }
    const int64_t col = u * QK_K + 128 * n + l0;
#pragma unroll
    for (int q = 0; q < 4; ++q) fma_run2<N>(acc, x, w.K, col + 32 * q, v[q][0], v[q][1]);
}

// Q8_0 planar: lane l takes the 8 consecutive values at 8l of the super-block.
template <int N>
__device__ __forceinline__ void unit_q8_0(const Matrix &w, int64_t m, int64_t u, int lane,
                                          const float *x, float (&acc)[N]) {
    const Q8Planes p = q8_0_planes(w.M, w.K);
    const int64_t col = u * QK_K + lane * 8;
    const uint2 q = *reinterpret_cast<const uint2 *>(w.data + p.qs + m * w.K + col);
    const float d = half_at(w.data + p.d + (m * (w.K / QK8_0) + col / QK8_0) * 2);
    float v[8];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        v[t] = (int8_t)((q.x >> (8 * t)) & 0xFF) * d;
        v[4 + t] = (int8_t)((q.y >> (8 * t)) & 0xFF) * d;
    }
    fma_run4<N>(acc, x, w.K, col, v[0], v[1], v[2], v[3]);
    fma_run4<N>(acc, x, w.K, col + 4, v[4], v[5], v[6], v[7]);
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

template <int TYPE, int N>
__global__ void __launch_bounds__(32 * ROWS_PER_BLOCK)
matvec_kernel(const Matrix w, const float *__restrict__ x, float *__restrict__ y, bool accumulate) {
    const int64_t m = (int64_t)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (m >= w.M) return;
    float acc[N];
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    const int64_t n_units = (w.K + QK_K - 1) / QK_K;
    for (int64_t u = 0; u < n_units; ++u) {
        if constexpr (TYPE == TYPE_Q4_K) unit_q4_K<N>(w, m, u, lane, x, acc);
        else if constexpr (TYPE == TYPE_Q5_K) unit_q5_K<N>(w, m, u, lane, x, acc);
        else if constexpr (TYPE == TYPE_Q6_K) unit_q6_K<N>(w, m, u, lane, x, acc);
        else if constexpr (TYPE == TYPE_Q8_0) unit_q8_0<N>(w, m, u, lane, x, acc);
        else unit_float<TYPE, N>(w, m, u, lane, x, acc);
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
        float v = acc[n];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) {
            float *dst = y + n * w.M + m;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

template <int TYPE>
void launch_type(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, cudaStream_t st) {
    const dim3 grid((unsigned)((w.M + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK));
    const dim3 block(32 * ROWS_PER_BLOCK);
    switch (n_vec) {
        case 1: matvec_kernel<TYPE, 1><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 2: matvec_kernel<TYPE, 2><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 3: matvec_kernel<TYPE, 3><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 4: matvec_kernel<TYPE, 4><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 5: matvec_kernel<TYPE, 5><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 6: matvec_kernel<TYPE, 6><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 7: matvec_kernel<TYPE, 7><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        case 8: matvec_kernel<TYPE, 8><<<grid, block, 0, st>>>(w, x, y, accumulate); break;
        default: fail(OJ_ERR_INVALID_ARGUMENT, "matvec: vector count must be 1..8");
    }
}

// One value of row m, column k of W (scalar; used by the embedding lookup only).
__device__ float dequant_one(const Matrix &w, int64_t m, int64_t k) {
    switch (w.type) {
        case TYPE_F32: return reinterpret_cast<const float *>(w.data)[m * w.K + k];
        case TYPE_F16: return __half2float(reinterpret_cast<const __half *>(w.data)[m * w.K + k]);
        case TYPE_BF16: {
            const uint16_t r = reinterpret_cast<const uint16_t *>(w.data)[m * w.K + k];
            return __uint_as_float((uint32_t)r << 16);
        }
        case TYPE_Q8_0: {
            const Q8Planes p = q8_0_planes(w.M, w.K);
            const int8_t q = reinterpret_cast<const int8_t *>(w.data + p.qs)[m * w.K + k];
            return q * half_at(w.data + p.d + (m * (w.K / QK8_0) + k / QK8_0) * 2);
        }
        case TYPE_Q4_K:
        case TYPE_Q5_K: {
            const int bytes = w.type == TYPE_Q4_K ? 144 : 176;
            const uint8_t *b = w.data + (m * (w.K / QK_K) + k / QK_K) * bytes;
            const int i = (int)(k % QK_K);
            const int j = i / 64, within = i % 64, l = within % 32, is = 2 * j + (within >= 32);
            int sc, mn;
            scale_min_k4(is, b + 4, sc, mn);
            const uint8_t *qs = b + (w.type == TYPE_Q4_K ? 16 : 48) + 32 * j;
            int q = within < 32 ? (qs[l] & 15) : (qs[l] >> 4);
            if (w.type == TYPE_Q5_K) q += ((b[16 + l] >> is) & 1) * 16;
            return half_at(b) * sc * q - half_at(b + 2) * mn;
        }
        case TYPE_Q6_K: {
            const OldQ6Planes p = old_q6_planes(w.M, w.K);
            const int64_t blk = m * (w.K / QK_K) + k / QK_K;
            const int i = (int)(k % QK_K);
            const int n = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
            const uint8_t *ql = w.data + p.ql + blk * 128 + 64 * n;
            const uint8_t *qh = w.data + p.qh + blk * 64 + 32 * n;
            const int8_t *sc = reinterpret_cast<const int8_t *>(w.data + p.sc + blk * 16) + 8 * n;
            const int lowbyte = ql[l + 32 * (quarter & 1)];
            const int nib = quarter >= 2 ? (lowbyte >> 4) : (lowbyte & 15);
            const int q = (nib | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
            return half_at(w.data + p.d + blk * 2) * sc[l / 16 + 2 * quarter] * q;
        }
        default: return 0.0f;
    }
}

__global__ void embed_kernel(const Matrix w, const int32_t *__restrict__ tokens, float *__restrict__ y) {
    const int n = blockIdx.x;
    const int64_t row = tokens[n];
    for (int64_t k = threadIdx.x; k < w.K; k += blockDim.x) y[n * w.K + k] = dequant_one(w, row, k);
}

}  // namespace

inline void matvec(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, cudaStream_t st) {
    switch (w.type) {
        case TYPE_F32: launch_type<TYPE_F32>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_F16: launch_type<TYPE_F16>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_BF16: launch_type<TYPE_BF16>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_Q8_0: launch_type<TYPE_Q8_0>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_Q4_K: launch_type<TYPE_Q4_K>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_Q5_K: launch_type<TYPE_Q5_K>(w, x, y, n_vec, accumulate, st); break;
        case TYPE_Q6_K: launch_type<TYPE_Q6_K>(w, x, y, n_vec, accumulate, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, std::string("matvec: no kernel for type ") + type_name(w.type));
    }
    check_launch("matvec");
}

inline void embed_rows(const Matrix &w, const int32_t *tokens, float *y, int n, cudaStream_t st) {
    embed_kernel<<<n, 256, 0, st>>>(w, tokens, y);
    check_launch("embed_rows");
}

inline size_t device_layout_bytes(int type, int64_t K, int64_t M) {
    switch (type) {
        case TYPE_Q8_0: return q8_0_planes(M, K).total;
        case TYPE_Q6_K: return old_q6_planes(M, K).total;
        default: return (size_t)(K / type_block_values(type)) * type_block_bytes(type) * (size_t)M;
    }
}

inline std::vector<uint8_t> to_device_layout(int type, int64_t K, int64_t M, const uint8_t *src) {
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
        const OldQ6Planes p = old_q6_planes(M, K);
        const int64_t nblk = M * (K / QK_K);
        const block_q6_K *blocks = reinterpret_cast<const block_q6_K *>(src);
        for (int64_t i = 0; i < nblk; ++i) {
            std::memcpy(out.data() + p.ql + i * 128, blocks[i].ql, 128);
            std::memcpy(out.data() + p.qh + i * 64, blocks[i].qh, 64);
            std::memcpy(out.data() + p.sc + i * 16, blocks[i].scales, 16);
            std::memcpy(out.data() + p.d + i * 2, &blocks[i].d, 2);
        }
    } else {
        std::memcpy(out.data(), src, out.size());
    }
    return out;
}

}  // namespace oj_old
