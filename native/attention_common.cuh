// attention_common.cuh: pieces of gated attention shared by attention.cu's and
// attention_prefill.cu's kernels: the IMROPE angle, a warp max, the q8_0 store of one block, and
// the chunked split-K scan of decode attention (chunked_scan and its row helpers).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "model_dims.h"

namespace oj {
namespace {

struct RopeParams {
    int n_rot;
    int sections[4];
    float freq_base;
};

inline RopeParams rope_params(const ModelDims &d) {
    RopeParams rp;
    rp.n_rot = d.hp.n_rot;
    for (int i = 0; i < 4; ++i) rp.sections[i] = d.hp.rope_sections[i];
    rp.freq_base = d.hp.rope_freq_base;
    return rp;
}

// Angle of pair i at text position pos (ggml_mrope_cache_init with is_imrope).
__device__ float imrope_angle(const RopeParams &rp, int i, int pos) {
    const int sect_dims = rp.sections[0] + rp.sections[1] + rp.sections[2] + rp.sections[3];
    const int sector = i % sect_dims;
    float coord;
    if (sector % 3 == 1 && sector < 3 * rp.sections[1]) coord = (float)pos;        // h
    else if (sector % 3 == 2 && sector < 3 * rp.sections[2]) coord = (float)pos;   // w
    else if (sector % 3 == 0 && sector < 3 * rp.sections[0]) coord = (float)pos;   // t
    else coord = 0.0f;                                                              // e
    return coord * powf(rp.freq_base, -2.0f * (float)i / (float)rp.n_rot);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One value x per lane, the warp's 32 lanes = one q8_0 block: the quant of x, and the block's
// scale to lane 0's *scale (ggml's quantize_row_q8_0_ref, so the numpy reference can repeat it).
__device__ __forceinline__ void q8_0_store(float x, int8_t *quant, __half *scale) {
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *quant = (int8_t)roundf(x * id);
    if ((threadIdx.x & 31) == 0) *scale = __float2half(d);
}

// One lane's PER values of one cached row as they lie in memory (PER fp16, or PER int8 quants):
// a single aligned load of 2 * PER (fp16) or PER (q8_0) bytes, converted to float only at use so
// that a chunk's C rows in flight cost C * 2 * PER / 4 registers, not C * PER.
template <int BYTES>
using RowBits = std::conditional_t<BYTES == 16, uint4,
                std::conditional_t<BYTES == 8, uint2, std::conditional_t<BYTES == 4, uint32_t, uint16_t>>>;

template <int PER, bool Q8>
__device__ __forceinline__ float row_dot(const float *q, const RowBits<Q8 ? PER : 2 * PER> &r) {
    float dot = 0.0f;
    if constexpr (Q8) {
        const int8_t *b = reinterpret_cast<const int8_t *>(&r);
#pragma unroll
        for (int i = 0; i < PER; ++i) dot += q[i] * (float)b[i];
    } else {
        const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) {
            const float2 kk = __half22float2(h[i]);
            dot += q[2 * i] * kk.x + q[2 * i + 1] * kk.y;
        }
    }
    return dot;
}

template <int PER, bool Q8>
__device__ __forceinline__ void row_accumulate(float *acc, float w, const RowBits<Q8 ? PER : 2 * PER> &r) {
    if constexpr (Q8) {
        const int8_t *b = reinterpret_cast<const int8_t *>(&r);
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] += w * (float)b[i];
    } else {
        const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) {
            const float2 vv = __half22float2(h[i]);
            acc[2 * i] += w * vv.x;
            acc[2 * i + 1] += w * vv.y;
        }
    }
}

// Warp sums of C values at once (C a power of two <= 32), a reduce-scatter butterfly: at each of
// the first log2(C) steps a lane keeps half of its values and adds its partner's copy of that
// half, sending the other half, so C = 8 sums take 4 + 2 + 1 + 2 = 9 shuffles instead of 5 * 8
// (and only one exp per lane follows, not C). Afterwards v[0] of lane l is the warp sum of
// value l / (32 / C): lanes [j * 32 / C, (j + 1) * 32 / C) hold sum j.
template <int C>
__device__ __forceinline__ float warp_sum_scatter(float (&v)[C]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int half = C / 2, o = 16; half >= 1; half >>= 1, o >>= 1) {
        const bool upper = lane & o;
#pragma unroll
        for (int j = 0; j < half; ++j) {
            const float keep = upper ? v[j + half] : v[j];
            const float send = upper ? v[j] : v[j + half];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
#pragma unroll
    for (int o = 16 / C; o >= 1; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    return v[0];
}

// One warp's C cached rows of a chunk, this lane's part: K and V bits (and the q8_0 scales of the
// lane's block). Positions p0 + j * STEP at or past `end` load nothing and hold zeros.
template <class Bits, int C>
struct ChunkRows {
    Bits k[C], v[C];
    float ks[C], vs[C];   // q8_0 only

    // Position p's row is cache row p, or for p >= map_from the tree's (chunked_scan).
    template <int D, bool Q8, int STEP>
    __device__ __forceinline__ void load(const Bits *kb, const Bits *vb, const __half *ksb, const __half *vsb, int p0,
                                         int end, int map_from, uint32_t rows) {
#pragma unroll
        for (int j = 0; j < C; ++j) {
            const int p = p0 + j * STEP;
            k[j] = Bits{};
            v[j] = Bits{};
            ks[j] = vs[j] = 0.0f;
            if (p < end) {
                const int r = p < map_from ? p : map_from + (int)((rows >> (4 * (p - map_from))) & 15u);
                k[j] = kb[(int64_t)r * 32];   // a row is D values = 32 lanes' Bits
                v[j] = vb[(int64_t)r * 32];
                if constexpr (Q8) {
                    ks[j] = __half2float(ksb[(int64_t)r * (D / 32)]);
                    vs[j] = __half2float(vsb[(int64_t)r * (D / 32)]);
                }
            }
        }
    }
};


// One warp's online softmax (m, l, acc over the lane's PER dims) for each of G query heads of one
// KV head over the cached positions first, first + STEP, ... < end, taken C at a time: positions
// p0 + j * STEP (j < C) of a chunk, p0 = first + i * C * STEP, so the block's STEP warps still
// interleave row by row. Per chunk: all C K rows and C V rows loaded once for the G heads
// (independent loads, issued together one chunk ahead; V does not depend on the scores); per head C
// dots, one butterfly for the C warp sums, one online-softmax step for the chunk (its max, one
// correction of l and acc), C weighted V rows added. Each head's operations and their order are
// those of a scan of that head alone, so G changes only how often a row is loaded, not a bit.
// Positions of the last chunk at or past `end` load nothing and score -inf (weight 0); the chunk's
// first position is always < end, so m_new is finite. attention_partial_chunked_kernel runs it
// (STEP = its 4 warps). q: each head's PER query values of this lane; kb / vb (ksb / vsb for q8_0)
// the KV head's rows at the lane's offset. Draft trees: positions p >= map_from are read from cache
// row map_from + nibble (p - map_from) of `rows` (tree_rows), so that a tree node scans its
// ancestors in the positions and order one-token-at-a-time decoding of its path would (the same
// warps, the same sums); a chain's map is the identity.
template <int D, bool Q8, int C, int STEP, int G>
__device__ __forceinline__ void chunked_scan(const float (&q)[G][D / 32], const RowBits<Q8 ? D / 32 : D / 16> *kb,
                                             const RowBits<Q8 ? D / 32 : D / 16> *vb, const __half *ksb,
                                             const __half *vsb, int first, int end, float scale, float (&m)[G],
                                             float (&l)[G], float (&acc)[G][D / 32], int map_from, uint32_t rows) {
    constexpr int PER = D / 32;
    constexpr int GROUP = 32 / C;   // lanes that hold one chunk position's score after the butterfly
    using Bits = RowBits<Q8 ? PER : 2 * PER>;
    const int lane = threadIdx.x & 31;
    const int mine = lane / GROUP;   // the chunk position whose score this lane ends up holding
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[g][i] = 0.0f;
    }
    // Double buffered: the next chunk's 2 C rows are loaded before this chunk is computed. Besides
    // hiding the loads behind the arithmetic, this is what keeps them together: without it ptxas
    // sinks most V loads below the dots (V has slack on the critical path), which waits for K
    // before issuing them, two memory latencies per chunk instead of one.
    constexpr int STRIDE = STEP * C;
    ChunkRows<Bits, C> cur, nxt;
    cur.load<D, Q8, STEP>(kb, vb, ksb, vsb, first, end, map_from, rows);
    for (int p0 = first; p0 < end; p0 += STRIDE) {
        nxt.load<D, Q8, STEP>(kb, vb, ksb, vsb, p0 + STRIDE, end, map_from, rows);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot[C];
#pragma unroll
            for (int j = 0; j < C; ++j) {
                dot[j] = row_dot<PER, Q8>(q[g], cur.k[j]);
                if constexpr (Q8) dot[j] *= cur.ks[j];
            }
            const float sum = warp_sum_scatter<C>(dot);
            const float sc = p0 + mine * STEP < end ? sum * scale : -INFINITY;
            float m_chunk = sc;
#pragma unroll
            for (int o = GROUP; o < 32; o <<= 1) m_chunk = fmaxf(m_chunk, __shfl_xor_sync(0xffffffffu, m_chunk, o));
            const float m_new = fmaxf(m[g], m_chunk);
            const float corr = expf(m[g] - m_new);
            const float w_mine = expf(sc - m_new);
            float w_sum = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[g][i] *= corr;
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const float w = __shfl_sync(0xffffffffu, w_mine, j * GROUP);
                w_sum += w;
                row_accumulate<PER, Q8>(acc[g], Q8 ? w * cur.vs[j] : w, cur.v[j]);
            }
            l[g] = l[g] * corr + w_sum;
            m[g] = m_new;
        }
        cur = nxt;
    }
}

}  // namespace
}  // namespace oj
