// dequant.cuh: scalar access to weights in the device layout (quant_blocks.cuh): the Q6_K byte
// rule, one fp16 from bytes, one value of a matrix (the embedding lookup of matvec.cu).
#pragma once

#include "engine.cuh"

namespace oj {

// Byte of lane t's 16-byte run for Q6_K value l (0..31) of half `half` of a super-block, in the
// regrouped q plane (quant_blocks.cuh): 16 * t + 4 * c + j with c = 2 * half + l / 16.
__host__ __device__ inline int q6_K_byte(int half, int l) {
    const int t = (l & 15) >> 2, c = 2 * half + (l >> 4), j = l & 3;
    return 16 * t + 4 * c + j;
}

namespace {

__device__ __forceinline__ float half_at(const uint8_t *p) {
    return __half2float(*reinterpret_cast<const __half *>(p));
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
            const uint8_t *b = w.data + (w.type == TYPE_Q4_K ? q4_K_offset(m, k / QK_K, w.K / QK_K)
                                                             : (m * (w.K / QK_K) + k / QK_K) * bytes);
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
            const Q6Planes p = q6_K_planes(w.M, w.K);
            const int64_t blk = m * (w.K / QK_K) + k / QK_K;
            const int i = (int)(k % QK_K);
            const int half = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
            const int64_t nb = w.K / QK_K;
            const uint8_t *q = w.data + p.q + q6_K_q_offset(m, k / QK_K, nb);
            const int off = q6_K_byte(half, l);
            const int lowbyte = q[64 * (quarter & 1) + off];
            const int nib = quarter >= 2 ? (lowbyte >> 4) : (lowbyte & 15);
            const int v = (nib | (((q[128 + off] >> (2 * quarter)) & 3) << 4)) - 32;
            const int8_t *sc = reinterpret_cast<const int8_t *>(w.data + p.sc + q6_K_sc_offset(m, k / QK_K, nb));
            return half_at(w.data + p.d + blk * 2) * sc[8 * half + l / 16 + 2 * quarter] * v;
        }
        default: return 0.0f;
    }
}

}  // namespace
}  // namespace oj
