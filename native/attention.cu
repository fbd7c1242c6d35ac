// attention.cu: qwen35's gated attention for 1..8 positions (build_layer_attn between the
// projections and attn_output; the MTP block runs the same code on its own KV cache).
//
//   1. attention_prepare: per head RMSNorm of q (the first head_dim of each head's 2*head_dim
//      slice of attn_q; the second half is the output gate) and of k, times q_norm / k_norm;
//      RoPE on the first n_rot dims, NEOX pairs (i, i + n_rot/2), angle pos * base^(-2i/n_rot)
//      with llama.cpp's IMROPE sector rule (text: t = h = w = pos, e = 0); K and V appended to
//      the cache [n_head_kv][n_ctx][head_dim] at their positions, as fp16 or as q8_0 (one warp
//      = one 32-value block: warp amax, d = amax / 127, q = roundf(x * (1 / d)), ggml's
//      quantize_row_q8_0_ref; quants and scales in two planes, engine.cuh's Layer).
//   2. attention_partial: split-K flash decoding; block (head, position, split) walks up to
//      SPLIT cached positions (causal: position p sees 0..p) with an fp32 online softmax. For q8_0
//      a lane's PER values lie in one block, so its partial dot takes the scale once.
//      By default attention_partial_chunked_kernel runs (OJ_ATTN_CHUNK=0: the one-position kernel):
//      the same blocks and partials, but each warp takes its positions C at a time (all C K and V
//      rows loaded before any is used) so a warp has C rows in flight instead of one dependent row.
//   3. attention_combine: merges the splits, times sigmoid(gate).
// The KV type is a template parameter: the fp16 instances are the code they were before q8_0.
// Query head h reads KV head h / (n_head / n_head_kv). Numpy twin: ReferenceModel._attention
// (kv_q8_0=True rounds K/V through q8_0 the same way).
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attention_common.cuh"
#include "engine.cuh"
#include "reduce.cuh"

namespace oj {

int attention_chunk_setting(const char *value);   // below: OJ_ATTN_CHUNK's value -> chunk (0: off)

namespace {

constexpr int SPLIT = 256;        // cached positions per split-K block
constexpr int PARTIAL_WARPS = 4;

// PER consecutive int8 quants (PER = 2, 4, 8; src aligned to PER bytes) as floats, one load.
struct __align__(8) char8 { char4 lo, hi; };
template <int PER>
__device__ __forceinline__ void load_q8(const int8_t *src, float *out) {
    if constexpr (PER == 2) {
        const char2 c = *reinterpret_cast<const char2 *>(src);
        out[0] = c.x; out[1] = c.y;
    } else if constexpr (PER == 4) {
        const char4 c = *reinterpret_cast<const char4 *>(src);
        out[0] = c.x; out[1] = c.y; out[2] = c.z; out[3] = c.w;
    } else {
        static_assert(PER == 8, "head_dim / 32 must be 2, 4 or 8");
        const char8 c = *reinterpret_cast<const char8 *>(src);
        out[0] = c.lo.x; out[1] = c.lo.y; out[2] = c.lo.z; out[3] = c.lo.w;
        out[4] = c.hi.x; out[5] = c.hi.y; out[6] = c.hi.z; out[7] = c.hi.w;
    }
}

// The block's warps' online-softmax states (m, l, acc over the lane's PER dims) merged into the
// split's partial: part_ml[slot] = (M, L), part_acc[slot] the D weighted sums (both partial kernels).
template <int D>
__device__ __forceinline__ void store_partial(float m, float l, const float (&acc)[D / 32], float *__restrict__ part_ml,
                                              float *__restrict__ part_acc, int64_t slot) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ float sm_m[PARTIAL_WARPS], sm_l[PARTIAL_WARPS], sm_acc[PARTIAL_WARPS][D];
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < PER; ++i) sm_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < PARTIAL_WARPS; ++w) M = fmaxf(M, sm_m[w]);
    for (int t = threadIdx.x; t < D; t += blockDim.x) {
        float a = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < PARTIAL_WARPS; ++w) a += sm_acc[w][t] * expf(sm_m[w] - M);
        part_acc[slot * D + t] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < PARTIAL_WARPS; ++w) L += sm_l[w] * expf(sm_m[w] - M);
        part_ml[slot * 2] = M;
        part_ml[slot * 2 + 1] = L;
    }
}

// grid (n, n_head + n_head_kv), block head_dim. Q8: k_cache/v_cache are int8 quant planes with
// k_scale/v_scale (else __half values and the scales unused).
template <bool Q8>
__global__ void attention_prepare_kernel(const float *__restrict__ qg, const float *__restrict__ k,
                                         const float *__restrict__ v, const float *__restrict__ q_norm,
                                         const float *__restrict__ k_norm, float *__restrict__ q_rot,
                                         void *__restrict__ k_cache, void *__restrict__ v_cache,
                                         __half *__restrict__ k_scale, __half *__restrict__ v_scale,
                                         int n_head, int n_head_kv, int n_ctx, int pos0, float eps,
                                         RopeParams rp) {
    extern __shared__ float normed[];
    const int n = blockIdx.x, hh = blockIdx.y, D = blockDim.x, t = threadIdx.x;
    const bool is_q = hh < n_head;
    const int g = hh - n_head;
    const float *src = is_q ? qg + ((int64_t)n * n_head * 2 + hh * 2) * D
                            : k + ((int64_t)n * n_head_kv + g) * D;
    const float x = src[t];
    const float ss = block_sum(x * x);
    normed[t] = x / sqrtf(ss / D + eps) * (is_q ? q_norm[t] : k_norm[t]);
    __syncthreads();
    const int pos = pos0 + n;
    float y = normed[t];
    const int half = rp.n_rot / 2;
    if (t < rp.n_rot) {
        const int i = t < half ? t : t - half;
        float sn, cs;
        sincosf(imrope_angle(rp, i, pos), &sn, &cs);
        const float x0 = normed[i], x1 = normed[i + half];
        y = t < half ? x0 * cs - x1 * sn : x0 * sn + x1 * cs;
    }
    if (is_q) {
        q_rot[((int64_t)n * n_head + hh) * D + t] = y;
    } else {
        const int64_t at = ((int64_t)g * n_ctx + pos) * D + t;
        const float vx = v[((int64_t)n * n_head_kv + g) * D + t];
        if constexpr (Q8) {
            const int64_t block = ((int64_t)g * n_ctx + pos) * (D / 32) + (t >> 5);
            q8_0_store(y, static_cast<int8_t *>(k_cache) + at, k_scale + block);
            q8_0_store(vx, static_cast<int8_t *>(v_cache) + at, v_scale + block);
        } else {
            static_cast<__half *>(k_cache)[at] = __float2half(y);
            static_cast<__half *>(v_cache)[at] = __float2half(vx);
        }
    }
}

// grid (n_head, n, n_splits), block 32 * PARTIAL_WARPS. Lane l holds dims [l*PER, l*PER + PER).
template <int D, bool Q8>
__global__ void __launch_bounds__(32 * PARTIAL_WARPS)
attention_partial_kernel(const float *__restrict__ q_rot, const void *__restrict__ k_cache,
                         const void *__restrict__ v_cache, const __half *__restrict__ k_scale,
                         const __half *__restrict__ v_scale, float *__restrict__ part_ml,
                         float *__restrict__ part_acc, int n_head, int n_head_kv, int n_ctx,
                         int pos0, int n_splits, float scale) {
    constexpr int PER = D / 32;
    const int h = blockIdx.x, n = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = h / (n_head / n_head_kv);
    const int len = pos0 + n + 1;
    const int begin = split * SPLIT, end = min(begin + SPLIT, len);
    float q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = q_rot[((int64_t)n * n_head + h) * D + lane * PER + i];
    const int64_t row0 = (int64_t)g * n_ctx;   // the KV head's first cache row
    float m = -INFINITY, l = 0.0f, acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    if constexpr (Q8) {
        // per row: D int8 quants, D / 32 scales; lane's dims are in block lane * PER / 32
        const int8_t *kb = static_cast<const int8_t *>(k_cache) + row0 * D + lane * PER;
        const int8_t *vb = static_cast<const int8_t *>(v_cache) + row0 * D + lane * PER;
        const __half *ksb = k_scale + row0 * (D / 32) + lane * PER / 32;
        const __half *vsb = v_scale + row0 * (D / 32) + lane * PER / 32;
        for (int p = begin + warp; p < end; p += PARTIAL_WARPS) {
            float kk[PER], vv[PER];
            load_q8<PER>(kb + (int64_t)p * D, kk);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) dot += q[i] * kk[i];
            dot *= __half2float(ksb[(int64_t)p * (D / 32)]);
            const float sc = warp_sum(dot) * scale;
            const float m_new = fmaxf(m, sc);
            const float corr = expf(m - m_new), w = expf(sc - m_new);
            l = l * corr + w;
            load_q8<PER>(vb + (int64_t)p * D, vv);
            const float wd = w * __half2float(vsb[(int64_t)p * (D / 32)]);
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[i] = acc[i] * corr + wd * vv[i];
            m = m_new;
        }
    } else {
        const __half *kb = static_cast<const __half *>(k_cache) + row0 * D + lane * PER;
        const __half *vb = static_cast<const __half *>(v_cache) + row0 * D + lane * PER;
        for (int p = begin + warp; p < end; p += PARTIAL_WARPS) {
            const __half2 *kp = reinterpret_cast<const __half2 *>(kb + (int64_t)p * D);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < PER / 2; ++i) {
                const float2 kk = __half22float2(kp[i]);
                dot += q[2 * i] * kk.x + q[2 * i + 1] * kk.y;
            }
            const float sc = warp_sum(dot) * scale;
            const float m_new = fmaxf(m, sc);
            const float corr = expf(m - m_new), w = expf(sc - m_new);
            l = l * corr + w;
            const __half2 *vp = reinterpret_cast<const __half2 *>(vb + (int64_t)p * D);
#pragma unroll
            for (int i = 0; i < PER / 2; ++i) {
                const float2 vv = __half22float2(vp[i]);
                acc[2 * i] = acc[2 * i] * corr + w * vv.x;
                acc[2 * i + 1] = acc[2 * i + 1] * corr + w * vv.y;
            }
            m = m_new;
        }
    }
    store_partial<D>(m, l, acc, part_ml, part_acc, ((int64_t)n * n_head + h) * n_splits + split);
}

// attention_partial_kernel with each warp's positions taken C at a time (chunked_scan,
// attention_common.cuh, with the block's PARTIAL_WARPS warps interleaving row by row). Same grid,
// outputs and merge.
template <int D, bool Q8, int C>
__global__ void __launch_bounds__(32 * PARTIAL_WARPS)
attention_partial_chunked_kernel(const float *__restrict__ q_rot, const void *__restrict__ k_cache,
                                 const void *__restrict__ v_cache, const __half *__restrict__ k_scale,
                                 const __half *__restrict__ v_scale, float *__restrict__ part_ml,
                                 float *__restrict__ part_acc, int n_head, int n_head_kv, int n_ctx,
                                 int pos0, int n_splits, float scale) {
    constexpr int PER = D / 32;
    using Bits = RowBits<Q8 ? PER : 2 * PER>;
    static_assert(sizeof(Bits) == (Q8 ? PER : 2 * PER), "one load per lane and row");
    const int h = blockIdx.x, n = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = h / (n_head / n_head_kv);
    const int len = pos0 + n + 1;
    const int begin = split * SPLIT, end = min(begin + SPLIT, len);
    float q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = q_rot[((int64_t)n * n_head + h) * D + lane * PER + i];
    const int64_t row0 = (int64_t)g * n_ctx;   // the KV head's first cache row
    const size_t elem = Q8 ? 1 : 2;
    const Bits *kb = reinterpret_cast<const Bits *>(static_cast<const char *>(k_cache) + (row0 * D + lane * PER) * elem);
    const Bits *vb = reinterpret_cast<const Bits *>(static_cast<const char *>(v_cache) + (row0 * D + lane * PER) * elem);
    const __half *ksb = k_scale + row0 * (D / 32) + lane * PER / 32;   // q8_0 only
    const __half *vsb = v_scale + row0 * (D / 32) + lane * PER / 32;
    float m, l, acc[PER];
    chunked_scan<D, Q8, C, PARTIAL_WARPS>(q, kb, vb, ksb, vsb, begin + warp, end, scale, m, l, acc);
    store_partial<D>(m, l, acc, part_ml, part_acc, ((int64_t)n * n_head + h) * n_splits + split);
}

// K/V rows shared by the query heads of a KV group and the positions of the call (OJ_ATTN_CHUNK=group,
// opt-in, written 2026-11-30 without a GPU at hand; tools/attn_decode_bench.cu checks and times it
// as "grp"). The kernels above run a block per (query head, position, split), so every K/V row is
// read G * n times (G = n_head / n_head_kv: 30 times for the 27B's 6 heads and 5 positions), from
// L2 at best: at depth 30,000 one position's K/V (126 MB a layer) does not fit it. Here a block per
// (KV head, split) copies each tile of GT rows of K and V into shared memory once (cp.async, double
// buffered, rows past the block's last position zero-filled), and its 8 warps take the G * n
// queries (warp w: queries w, w + 8, ...; query j = position j / G, head g * G + j % G), each warp
// walking every row of the split for its queries C at a time (chunked_scan's arithmetic, rows in
// order instead of interleaved over warps). A query owns its whole split in one warp, so its state
// goes to the partial without a warp merge. Causal: query j's rows end at pos0 + j / G + 1; chunks
// at or past it are skipped (the chunk's first row is always inside). Same partials and combine.
constexpr int GT = 32;            // rows per shared-memory tile
constexpr int GROUP_WARPS = 8;
constexpr int GROUP_PATH = 16;    // partial_chunk's value for this kernel

__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// dynamic shared memory: 2 buffers x (K tile, V tile) of GT rows x D values
template <int D, bool Q8>
constexpr size_t group_smem_bytes() { return (size_t)2 * 2 * GT * D * (Q8 ? 1 : 2); }

template <int D, bool Q8, int QPW>
__global__ void __launch_bounds__(32 * GROUP_WARPS, 1)
attention_partial_group_kernel(const float *__restrict__ q_rot, const void *__restrict__ k_cache,
                               const void *__restrict__ v_cache, const __half *__restrict__ k_scale,
                               const __half *__restrict__ v_scale, float *__restrict__ part_ml,
                               float *__restrict__ part_acc, int n_head, int n_head_kv, int n_ctx, int pos0, int n,
                               int n_splits, float scale) {
    constexpr int PER = D / 32, C = 4, GROUP = 32 / C;
    constexpr size_t ELEM = Q8 ? 1 : 2, ROW = (size_t)D * ELEM, TILE = GT * ROW;
    using Bits = RowBits<Q8 ? PER : 2 * PER>;
    extern __shared__ __align__(16) uint8_t gsm[];
    const int g = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = n_head / n_head_kv, nq = G * n;
    const int begin = split * SPLIT, end = min(begin + SPLIT, pos0 + n);   // the block's last query's end
    const int64_t row0 = (int64_t)g * n_ctx;
    const uint8_t *kc = static_cast<const uint8_t *>(k_cache) + row0 * ROW;
    const uint8_t *vc = static_cast<const uint8_t *>(v_cache) + row0 * ROW;
    // this warp's queries: registers for q, the online-softmax state
    float q[QPW][PER], m[QPW], l[QPW], acc[QPW][PER];
    int qend[QPW];
#pragma unroll
    for (int k = 0; k < QPW; ++k) {
        const int j = warp + k * GROUP_WARPS;
        const int i = j < nq ? j / G : 0, h = g * G + (j < nq ? j % G : 0);
        qend[k] = j < nq ? min(begin + SPLIT, pos0 + i + 1) : begin;   // a missing query: no rows
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            q[k][e] = j < nq ? q_rot[((int64_t)i * n_head + h) * D + lane * PER + e] : 0.0f;
            acc[k][e] = 0.0f;
        }
        m[k] = -INFINITY;
        l[k] = 0.0f;
    }
    auto load_tile = [&](int t0, int buf) {   // rows t0 .. t0 + GT into buffer buf, 16 bytes per copy
        uint8_t *kd = gsm + (size_t)buf * 2 * TILE, *vd = kd + TILE;
        for (int c = threadIdx.x; c < (int)(TILE / 16); c += 32 * GROUP_WARPS) {
            const int r = c / (int)(ROW / 16);
            const bool valid = t0 + r < end;
            const size_t off = (size_t)(valid ? t0 + r : begin) * ROW + (size_t)(c % (int)(ROW / 16)) * 16;
            cp_async16(kd + (size_t)c * 16, kc + off, valid);
            cp_async16(vd + (size_t)c * 16, vc + off, valid);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    int buf = 0;
    if (begin < end) load_tile(begin, 0);
    for (int t0 = begin; t0 < end; t0 += GT, buf ^= 1) {
        if (t0 + GT < end) {
            load_tile(t0 + GT, buf ^ 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();   // the tile is every thread's copies
        const Bits *kt = reinterpret_cast<const Bits *>(gsm + (size_t)buf * 2 * TILE + lane * PER * ELEM);
        const Bits *vt = reinterpret_cast<const Bits *>(gsm + (size_t)buf * 2 * TILE + TILE + lane * PER * ELEM);
#pragma unroll
        for (int k = 0; k < QPW; ++k) {
            for (int r0 = 0; r0 < GT && t0 + r0 < qend[k]; r0 += C) {
                float dot[C];
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    dot[c] = row_dot<PER, Q8>(q[k], kt[(size_t)(r0 + c) * 32]);   // a row is 32 lanes' Bits
                    if constexpr (Q8) {   // rows past the block's end hold zeros; their scale row is clamped inside
                        const int64_t r = min(t0 + r0 + c, end - 1);
                        dot[c] *= __half2float(k_scale[(row0 + r) * (D / 32) + lane * PER / 32]);
                    }
                }
                const float sum = warp_sum_scatter<C>(dot);
                const int mine = lane / GROUP;
                const float sc = t0 + r0 + mine < qend[k] ? sum * scale : -INFINITY;
                float m_chunk = sc;
#pragma unroll
                for (int o = GROUP; o < 32; o <<= 1) m_chunk = fmaxf(m_chunk, __shfl_xor_sync(0xffffffffu, m_chunk, o));
                const float m_new = fmaxf(m[k], m_chunk);
                const float corr = expf(m[k] - m_new);
                const float w_mine = expf(sc - m_new);
                float w_sum = 0.0f;
#pragma unroll
                for (int e = 0; e < PER; ++e) acc[k][e] *= corr;
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const float w = __shfl_sync(0xffffffffu, w_mine, c * GROUP);
                    w_sum += w;
                    // masked rows weigh 0: their scale is never read
                    const float wv = Q8 && w != 0.0f
                                         ? w * __half2float(v_scale[(row0 + t0 + r0 + c) * (D / 32) + lane * PER / 32])
                                         : w;
                    row_accumulate<PER, Q8>(acc[k], wv, vt[(size_t)(r0 + c) * 32]);
                }
                l[k] = l[k] * corr + w_sum;
                m[k] = m_new;
            }
        }
        __syncthreads();   // every warp is done with this buffer before the next tile's copies land in it
    }
#pragma unroll
    for (int k = 0; k < QPW; ++k) {
        const int j = warp + k * GROUP_WARPS;
        if (j >= nq) continue;
        const int64_t slot = ((int64_t)(j / G) * n_head + g * G + j % G) * n_splits + split;
#pragma unroll
        for (int e = 0; e < PER; ++e) part_acc[slot * D + lane * PER + e] = acc[k][e];
        if (lane == 0) {
            part_ml[slot * 2] = m[k];
            part_ml[slot * 2 + 1] = l[k];
        }
    }
}

// OJ_ATTN_CHUNK, read at the first decode: unset or "1" the chunked kernel with CHUNK_DEFAULT (the
// default since its first GPU run, 2026-11-30 seventh session: partial + combine at depth 8,192
// 45.0 us against 82.9, at 30,000 132.5 against 187.8; bench/results/2026-11-30-attn-decode-chunk-*),
// "4" / "8" that chunk, "0" the one-position kernel, "group" attention_partial_group_kernel (opt-in, not
// yet run on a GPU). attention_force_chunk (the
// harness tools/attn_decode_bench.cu) overrides it. Why 4: double buffered, a chunk's rows are
// held twice; at D = 256 fp16 that is 2 x 2 x C x 4 registers of raw rows, and ptxas gives C = 4
// 96 registers (5 blocks of 4 warps per SM, 4 KB of K/V in flight per warp) and C = 8 164 (3
// blocks per SM, too few for a decode grid of 24 x 32 blocks at depth 8K to fit one wave).
constexpr int CHUNK_DEFAULT = 4;
int g_chunk = -1;   // -1: not yet read

int partial_chunk() {
    if (g_chunk < 0) {
        g_chunk = attention_chunk_setting(std::getenv("OJ_ATTN_CHUNK"));
    }
    return g_chunk;
}

// grid (n_head, n), block head_dim: out = (sum over splits) / l * sigmoid(gate).
__global__ void attention_combine_kernel(const float *__restrict__ part_ml, const float *__restrict__ part_acc,
                                         const float *__restrict__ qg, float *__restrict__ out,
                                         int n_head, int n_splits) {
    const int h = blockIdx.x, n = blockIdx.y, D = blockDim.x, t = threadIdx.x;
    const int64_t base = ((int64_t)n * n_head + h) * n_splits;
    float M = -INFINITY;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, part_ml[(base + s) * 2]);
    float L = 0.0f, a = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        const float ms = part_ml[(base + s) * 2];
        if (ms == -INFINITY) continue;
        const float f = expf(ms - M);
        L += part_ml[(base + s) * 2 + 1] * f;
        a += part_acc[(base + s) * D + t] * f;
    }
    const float gate = qg[((int64_t)n * n_head * 2 + h * 2 + 1) * D + t];
    out[((int64_t)n * n_head + h) * D + t] = a / L * sigmoid(gate);
}

template <int D, bool Q8, int QPW>
void launch_group(const Layer &L, const float *q_rot, Scratch &s, int H, int Hkv, int n_ctx, int pos0, int n,
                  int n_splits, float scale, cudaStream_t st) {
    constexpr size_t bytes = group_smem_bytes<D, Q8>();
    static const bool attr = [] {   // once per instance: past 48 KB of dynamic shared memory
        check_cuda(cudaFuncSetAttribute(attention_partial_group_kernel<D, Q8, QPW>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                   "attention_partial_group: shared memory attribute");
        return true;
    }();
    (void)attr;
    attention_partial_group_kernel<D, Q8, QPW><<<dim3(Hkv, n_splits), 32 * GROUP_WARPS, bytes, st>>>(
        q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, s.part_ml, s.part_acc, H, Hkv, n_ctx, pos0, n, n_splits,
        scale);
}

template <int D, bool Q8>
void launch_partial(dim3 grid, const Layer &L, const float *q_rot, Scratch &s, int H, int Hkv, int n_ctx, int pos0,
                    int n_splits, float scale, cudaStream_t st) {
    int path = partial_chunk();
    if (path == GROUP_PATH) {
        // a warp holds the q and state of up to 6 queries (G * n of them over 8 warps); more take c4
        const int qpw = (H / Hkv * (int)grid.y + GROUP_WARPS - 1) / GROUP_WARPS;
        if (qpw <= 2) return launch_group<D, Q8, 2>(L, q_rot, s, H, Hkv, n_ctx, pos0, (int)grid.y, n_splits, scale, st);
        if (qpw <= 6) return launch_group<D, Q8, 6>(L, q_rot, s, H, Hkv, n_ctx, pos0, (int)grid.y, n_splits, scale, st);
        path = 4;
    }
    switch (path) {
        case 4:
            attention_partial_chunked_kernel<D, Q8, 4><<<grid, 32 * PARTIAL_WARPS, 0, st>>>(
                q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, s.part_ml, s.part_acc, H, Hkv, n_ctx, pos0,
                n_splits, scale);
            return;
        case 8:
            attention_partial_chunked_kernel<D, Q8, 8><<<grid, 32 * PARTIAL_WARPS, 0, st>>>(
                q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, s.part_ml, s.part_acc, H, Hkv, n_ctx, pos0,
                n_splits, scale);
            return;
        default: break;
    }
    attention_partial_kernel<D, Q8><<<grid, 32 * PARTIAL_WARPS, 0, st>>>(
        q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, s.part_ml, s.part_acc, H, Hkv, n_ctx, pos0,
        n_splits, scale);
}

template <bool Q8>
void prepare_kv(const ModelDims &d, Layer &L, const float *qg, const float *k, const float *v, float *q_rot, int n,
                int pos0, int n_ctx, cudaStream_t st) {
    const int D = d.hp.head_dim, H = d.hp.n_head, Hkv = d.hp.n_head_kv;
    attention_prepare_kernel<Q8><<<dim3(n, H + Hkv), D, D * sizeof(float), st>>>(
        qg, k, v, L.q_norm, L.k_norm, q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, H, Hkv,
        n_ctx, pos0, d.hp.rms_eps, rope_params(d));
    check_launch("attention_prepare");
}

// Steps 2 and 3 for n <= OJ_MAX_POSITIONS positions at pos0.. (q_rot, qg and out point at the first).
template <bool Q8>
void decode_kv(const ModelDims &d, Layer &L, Scratch &s, const float *q_rot, const float *qg, float *out, int n,
               int pos0, int n_ctx, cudaStream_t st) {
    const int D = d.hp.head_dim, H = d.hp.n_head, Hkv = d.hp.n_head_kv;
    const int n_splits = (pos0 + n + SPLIT - 1) / SPLIT;
    if (n_splits > s.max_splits) fail(OJ_ERR_CONTEXT_FULL, "attention: more splits than allocated");
    const float scale = 1.0f / sqrtf((float)D);
    const dim3 grid(H, n, n_splits);
    switch (D) {
        case 64: launch_partial<64, Q8>(grid, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, st); break;
        case 128: launch_partial<128, Q8>(grid, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, st); break;
        case 256: launch_partial<256, Q8>(grid, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, "attention.key_length must be 64, 128 or 256");
    }
    check_launch("attention_partial");
    attention_combine_kernel<<<dim3(H, n), D, 0, st>>>(s.part_ml, s.part_acc, qg, out, H, n_splits);
    check_launch("attention_combine");
}

template <bool Q8>
void attention_mix_kv(const ModelDims &d, Layer &L, Scratch &s, int n, int pos0, int n_ctx, cudaStream_t st) {
    prepare_kv<Q8>(d, L, s.qg, s.k, s.v, s.q_rot, n, pos0, n_ctx, st);
    decode_kv<Q8>(d, L, s, s.q_rot, s.qg, s.attn_out, n, pos0, n_ctx, st);
}

}  // namespace

void attention_mix(const ModelDims &d, Layer &L, Scratch &s, int n, int pos0, int n_ctx, cudaStream_t st) {
    switch (L.kv_type) {
        case OJ_KV_F16: attention_mix_kv<false>(d, L, s, n, pos0, n_ctx, st); break;
        case OJ_KV_Q8_0: attention_mix_kv<true>(d, L, s, n, pos0, n_ctx, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, "KV cache type " + std::to_string(L.kv_type) + " has no attention kernel");
    }
}

void attention_prepare(const ModelDims &d, Layer &L, const float *qg, const float *k, const float *v,
                       float *q_rot, int n, int pos0, int n_ctx, cudaStream_t st) {
    switch (L.kv_type) {
        case OJ_KV_F16: prepare_kv<false>(d, L, qg, k, v, q_rot, n, pos0, n_ctx, st); break;
        case OJ_KV_Q8_0: prepare_kv<true>(d, L, qg, k, v, q_rot, n, pos0, n_ctx, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, "KV cache type " + std::to_string(L.kv_type) + " has no attention kernel");
    }
}

void attention_by_decode(const ModelDims &d, Layer &L, Scratch &s, const float *q_rot, const float *qg,
                         float *out, int n, int pos0, int n_ctx, cudaStream_t st) {
    const int H = d.hp.n_head, D = d.hp.head_dim;
    for (int i = 0; i < n; i += OJ_MAX_POSITIONS) {
        const int m = n - i < OJ_MAX_POSITIONS ? n - i : OJ_MAX_POSITIONS;
        const size_t row = (size_t)i * H * D;
        if (L.kv_type == OJ_KV_Q8_0) decode_kv<true>(d, L, s, q_rot + row, qg + 2 * row, out + row, m, pos0 + i, n_ctx, st);
        else decode_kv<false>(d, L, s, q_rot + row, qg + 2 * row, out + row, m, pos0 + i, n_ctx, st);
    }
}

int attention_splits_for(int n_ctx) { return (n_ctx + SPLIT - 1) / SPLIT; }

// The decode partial kernel for the harness (tools/attn_decode_bench.cu), which runs both in one
// process: 0 the one-position kernel, 4 or 8 the chunked kernel with that chunk, -1 back to
// OJ_ATTN_CHUNK (read at the next decode). The engine never calls it.
// OJ_ATTN_CHUNK's value (nullptr: unset, as "1") as the chunk partial_chunk takes; anything but unset, 0, 1,
// 4 or 8 is refused by name (tests/test_attn_decode_chunked.py checks both on the CPU).
int attention_chunk_setting(const char *value) {
    const std::string v = value ? value : "1";
    if (v == "0") return 0;
    if (v == "1") return CHUNK_DEFAULT;
    if (v == "4" || v == "8") return v[0] - '0';
    if (v == "group") return GROUP_PATH;
    fail(OJ_ERR_INVALID_ARGUMENT, "OJ_ATTN_CHUNK must be 0, 1, 4, 8 or group, not '" + v + "'");
}

void attention_force_chunk(int c) {
    if (c != -1 && c != 0 && c != 4 && c != 8 && c != GROUP_PATH)
        fail(OJ_ERR_INVALID_ARGUMENT, "attention_force_chunk: chunk must be -1, 0, 4, 8 or " + std::to_string(GROUP_PATH) +
                                          " (group), not " + std::to_string(c));
    g_chunk = c;
}

}  // namespace oj
