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
//   2. attention_partial: split-K flash decoding; block (2 heads of one KV head, position, split)
//      walks up to SPLIT cached positions (causal: position p sees 0..p) with an fp32 online
//      softmax per head, each K / V row loaded once for both heads. For q8_0
//      a lane's PER values lie in one block, so its partial dot takes the scale once.
//      Each warp takes its positions C = 4 at a time (all C K and V rows loaded before any is
//      used), so a warp has C rows in flight instead of one dependent row.
//   3. attention_combine: merges the splits, times sigmoid(gate).
// Draft trees (oj_verify_tree, tree.cuh's word): node i's K/V go to cache row pos0 + i as a chain's
// would, its RoPE position is pos0 + depth(i), and the partial kernel scans positions pos0 ..
// pos0 + depth(i) from its path's rows (tree_path_rows): the positions, rows and order of decoding
// the path one token at a time, so a tree node's attention is bit for bit the path's. A chain
// (word 0) reads row p for position p: the code as it was.
// Sequences (oj_eval_seqs, engine.cuh's SeqBatch): the SEQS instances take position n as the next
// of sequence seq[n] at pos[n], its cache planes kv_seq_bytes * seq[n] past sequence 0's; the same
// rows, splits and arithmetic as that sequence's own one-position pass, so its results are bit for
// bit the same.
// The KV type is a template parameter: the fp16 instances are the code they were before q8_0.
// Query head h reads KV head h / (n_head / n_head_kv). Numpy twin: ReferenceModel._attention
// (kv_q8_0=True rounds K/V through q8_0 the same way).
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attention_common.cuh"
#include "engine.cuh"
#include "pdl.cuh"
#include "reduce.cuh"

namespace oj {

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

// The block's warps' online-softmax states (m, l, acc over the lane's PER dims) of each of its G
// heads merged into that head's split partial: part_ml[slot + g * n_splits] = (M, L),
// part_acc[...] the D weighted sums (slot: the block's first head's).
template <int D, int G>
__device__ __forceinline__ void store_partial(const float (&m)[G], const float (&l)[G], const float (&acc)[G][D / 32],
                                              float *__restrict__ part_ml, float *__restrict__ part_acc, int64_t slot,
                                              int n_splits) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ float sm_m[G][PARTIAL_WARPS], sm_l[G][PARTIAL_WARPS], sm_acc[G][PARTIAL_WARPS][D];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm_m[g][warp] = m[g]; sm_l[g][warp] = l[g]; }
#pragma unroll
        for (int i = 0; i < PER; ++i) sm_acc[g][warp][lane * PER + i] = acc[g][i];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int64_t at = slot + (int64_t)g * n_splits;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < PARTIAL_WARPS; ++w) M = fmaxf(M, sm_m[g][w]);
        for (int t = threadIdx.x; t < D; t += blockDim.x) {
            float a = 0.0f;
            if (M != -INFINITY)
                for (int w = 0; w < PARTIAL_WARPS; ++w) a += sm_acc[g][w][t] * expf(sm_m[g][w] - M);
            part_acc[at * D + t] = a;
        }
        if (threadIdx.x == 0) {
            float L = 0.0f;
            if (M != -INFINITY)
                for (int w = 0; w < PARTIAL_WARPS; ++w) L += sm_l[g][w] * expf(sm_m[g][w] - M);
            part_ml[at * 2] = M;
            part_ml[at * 2 + 1] = L;
        }
    }
}

// grid (n, n_head + n_head_kv), block head_dim. Q8: k_cache/v_cache are int8 quant planes with
// k_scale/v_scale (else __half values and the scales unused).
// SEQS (oj_eval_seqs): position n is the next of sequence sb.seq[n] at sb.pos[n], its planes
// seq_bytes * sb.seq[n] bytes past the given ones (pos0 and tree unused).
template <bool Q8, bool SEQS>
__global__ void attention_prepare_kernel(const float *__restrict__ qg, const float *__restrict__ k,
                                         const float *__restrict__ v, const float *__restrict__ q_norm,
                                         const float *__restrict__ k_norm, float *__restrict__ q_rot,
                                         void *__restrict__ k_cache, void *__restrict__ v_cache,
                                         __half *__restrict__ k_scale, __half *__restrict__ v_scale,
                                         int n_head, int n_head_kv, int n_ctx, int pos0, float eps,
                                         RopeParams rp, uint64_t tree, SeqBatch sb, size_t seq_bytes,
                                         const PassArgs *dyn) {
    pdl_launch_dependents();
    pdl_wait();
    if (!SEQS && dyn) {
        pos0 = dyn->pos0;
        tree = dyn->tree;
    }
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
    const int row = SEQS ? sb.pos[n] : pos0 + n;   // the cache row; a draft-tree node's RoPE position is pos0 + its depth
    const int pos = !SEQS && tree ? pos0 + tree_depth(tree, n) : row;
    if constexpr (SEQS) {
        const size_t off = seq_bytes * sb.seq[n];
        k_cache = static_cast<char *>(k_cache) + off;
        v_cache = static_cast<char *>(v_cache) + off;
        if constexpr (Q8) {
            k_scale = reinterpret_cast<__half *>(reinterpret_cast<char *>(k_scale) + off);
            v_scale = reinterpret_cast<__half *>(reinterpret_cast<char *>(v_scale) + off);
        }
    }
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
        const int64_t at = ((int64_t)g * n_ctx + row) * D + t;
        const float vx = v[((int64_t)n * n_head_kv + g) * D + t];
        if constexpr (Q8) {
            const int64_t block = ((int64_t)g * n_ctx + row) * (D / 32) + (t >> 5);
            q8_0_store(y, static_cast<int8_t *>(k_cache) + at, k_scale + block);
            q8_0_store(vx, static_cast<int8_t *>(v_cache) + at, v_scale + block);
        } else {
            static_cast<__half *>(k_cache)[at] = __float2half(y);
            static_cast<__half *>(v_cache)[at] = __float2half(vx);
        }
    }
}

// grid (n_head / G, n, n_splits), block 32 * PARTIAL_WARPS; block x takes query heads G x ..
// G x + G - 1 (G divides n_head / n_head_kv: one KV head), each row of K and V loaded once for
// the G of them; each warp's positions taken C at a time (chunked_scan, attention_common.cuh, with
// the block's PARTIAL_WARPS warps interleaving row by row). Lane l holds dims [l*PER, l*PER + PER).
// SEQS: as attention_prepare_kernel's (position n scans 0..sb.pos[n] of its sequence's planes).
template <int D, bool Q8, int C, int G, bool SEQS>
__global__ void __launch_bounds__(32 * PARTIAL_WARPS)
attention_partial_chunked_kernel(const float *__restrict__ q_rot, const void *__restrict__ k_cache,
                                 const void *__restrict__ v_cache, const __half *__restrict__ k_scale,
                                 const __half *__restrict__ v_scale, float *__restrict__ part_ml,
                                 float *__restrict__ part_acc, int n_head, int n_head_kv, int n_ctx,
                                 int pos0, int n_splits, float scale, uint64_t tree, SeqBatch sb, size_t seq_bytes,
                                 const PassArgs *dyn) {
    pdl_launch_dependents();
    pdl_wait();
    if (!SEQS && dyn) {
        pos0 = dyn->pos0;
        tree = dyn->tree;
    }
    constexpr int PER = D / 32;
    using Bits = RowBits<Q8 ? PER : 2 * PER>;
    static_assert(sizeof(Bits) == (Q8 ? PER : 2 * PER), "one load per lane and row");
    const int h = blockIdx.x * G, n = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (n_head / n_head_kv);
    if constexpr (SEQS) {   // the sequence's own planes; its position reads its own row
        const size_t off = seq_bytes * sb.seq[n];
        k_cache = static_cast<const char *>(k_cache) + off;
        v_cache = static_cast<const char *>(v_cache) + off;
        if constexpr (Q8) {
            k_scale = reinterpret_cast<const __half *>(reinterpret_cast<const char *>(k_scale) + off);
            v_scale = reinterpret_cast<const __half *>(reinterpret_cast<const char *>(v_scale) + off);
        }
        pos0 = sb.pos[n];
        tree = 0;
    }
    const int len = SEQS ? pos0 + 1 : pos0 + tree_depth(tree, n) + 1;   // n for a chain
    const int begin = split * SPLIT, end = min(begin + SPLIT, len);
    float q[G][PER];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < PER; ++i) q[g][i] = q_rot[((int64_t)n * n_head + h + g) * D + lane * PER + i];
    const int64_t row0 = (int64_t)kvh * n_ctx;   // the KV head's first cache row
    const size_t elem = Q8 ? 1 : 2;
    const Bits *kb = reinterpret_cast<const Bits *>(static_cast<const char *>(k_cache) + (row0 * D + lane * PER) * elem);
    const Bits *vb = reinterpret_cast<const Bits *>(static_cast<const char *>(v_cache) + (row0 * D + lane * PER) * elem);
    const __half *ksb = k_scale + row0 * (D / 32) + lane * PER / 32;   // q8_0 only
    const __half *vsb = v_scale + row0 * (D / 32) + lane * PER / 32;
    float m[G], l[G], acc[G][PER];
    // a tree's nodes read their path's rows from pos0 on; a chain (up to 16 positions, past the 8
    // nibbles of a path) and a sequence's position read cache row p at position p
    chunked_scan<D, Q8, C, PARTIAL_WARPS, G>(q, kb, vb, ksb, vsb, begin + warp, end, scale, m, l, acc,
                                             tree ? pos0 : INT_MAX, tree_path_rows(tree, n));
    store_partial<D, G>(m, l, acc, part_ml, part_acc, ((int64_t)n * n_head + h) * n_splits + split, n_splits);
}

// Why C = 4: double buffered, a chunk's rows are held twice; at D = 256 fp16 that is 2 x 2 x C x 4
// registers of raw rows, and ptxas gives C = 4 96 registers (5 blocks of 4 warps per SM, 4 KB of
// K/V in flight per warp) and C = 8 164 (3 blocks per SM, too few for a decode grid of 24 x 32
// blocks at depth 8K to fit one wave). Measured against the one-position kernel it replaced
// (2026-11-30, bench/results/2026-11-30-attn-decode-chunk-a1829b8.txt): partial + combine at depth
// 8,192 45.0 us against 82.9, at 30,000 132.5 against 187.8.
constexpr int CHUNK = 4;

// Why G = 2 query heads a block (where n_head / n_head_kv is even; else 1): each K / V row loaded
// once serves two heads. On an H200 (2026-12-07, bench/results/2026-12-07-session19-h200.md, the
// same logits bit for bit) decode at depth 30,720 went from 106.0 to 108.8 tokens/s and the
// attention core over 8 positions from 0.582 to 0.475 ms, depth 0 unchanged. G = 3 (182 registers
// against G = 2's 142) tied at 30K and was slower over 5 and 8 positions; keeping G = 1 for small
// grids lost the 8-position gain.
constexpr int HEADS_PER_BLOCK = 2;

// grid (n_head, n), block head_dim: out = (sum over splits) / l * sigmoid(gate). The splits' (m, l)
// pairs are staged in shared memory COMBINE_CHUNK at a time (one round trip to L2 for all of them,
// not one per split and thread), and each thread loads its value of COMBINE_BATCH splits before it
// adds any, so a deep context (120 splits at 30K) costs a few L2 round trips instead of one per
// split; the sums run split by split in order, as they always did (the same bits). Measured on an H100
// (2026-12-07, bench/results/2026-12-07-session21-h100.md): decode at depth 30,720 97.7 -> 104.0
// tokens/s against the kernel that read each split's pair and values one dependent load at a time.
constexpr int COMBINE_CHUNK = 256, COMBINE_BATCH = 16;

__global__ void attention_combine_kernel(const float *__restrict__ part_ml, const float *__restrict__ part_acc,
                                         const float *__restrict__ qg, float *__restrict__ out,
                                         int n_head, int n_splits) {
    pdl_launch_dependents();
    pdl_wait();
    const int h = blockIdx.x, n = blockIdx.y, D = blockDim.x, t = threadIdx.x;
    const int64_t base = ((int64_t)n * n_head + h) * n_splits;
    const float2 *ml = reinterpret_cast<const float2 *>(part_ml) + base;
    __shared__ float2 sml[COMBINE_CHUNK];
    __shared__ float smax[COMBINE_CHUNK / 32];
    // M: the largest split maximum (a max: the same whatever order it is taken in)
    float M = -INFINITY;
    for (int c0 = 0; c0 < n_splits; c0 += COMBINE_CHUNK) {
        const int cn = min(COMBINE_CHUNK, n_splits - c0);
        float m = -INFINITY;
        for (int j = t; j < cn; j += D) m = fmaxf(m, ml[c0 + j].x);
        m = warp_max(m);
        if ((t & 31) == 0) smax[t >> 5] = m;
        __syncthreads();
        for (int w = 0; w < D / 32; ++w) M = fmaxf(M, smax[w]);
        __syncthreads();
    }
    float L = 0.0f, a = 0.0f;
    for (int c0 = 0; c0 < n_splits; c0 += COMBINE_CHUNK) {
        const int cn = min(COMBINE_CHUNK, n_splits - c0);
        for (int j = t; j < cn; j += D) sml[j] = ml[c0 + j];
        __syncthreads();
        for (int j0 = 0; j0 < cn; j0 += COMBINE_BATCH) {
            float v[COMBINE_BATCH];
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j)
                v[j] = j0 + j < cn ? part_acc[(base + c0 + j0 + j) * D + t] : 0.0f;
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) {
                if (j0 + j >= cn) break;
                const float ms = sml[j0 + j].x;
                if (ms == -INFINITY) continue;
                const float f = expf(ms - M);
                L += sml[j0 + j].y * f;
                a += v[j] * f;
            }
        }
        __syncthreads();
    }
    const float gate = qg[((int64_t)n * n_head * 2 + h * 2 + 1) * D + t];
    out[((int64_t)n * n_head + h) * D + t] = a / L * sigmoid(gate);
}

// seqs: oj_eval_seqs's positions (the SEQS instances, from the layer's sequence-0 planes), or
// nullptr (the selected sequence's planes, pos0 and tree).
template <int D, bool Q8, int G>
void launch_partial_g(int n, const Layer &L, const float *q_rot, Scratch &s, int H, int Hkv, int n_ctx, int pos0,
                      int n_splits, float scale, uint64_t tree, const SeqBatch *seqs, cudaStream_t st, const PassArgs *dyn) {
    const SeqBatch none{};
    const dim3 grid(H / G, n, n_splits);
    check_cuda(seqs ? launch(attention_partial_chunked_kernel<D, Q8, CHUNK, G, true>, grid, 32 * PARTIAL_WARPS, 0, st,
                             q_rot, L.kv_base.k_cache, L.kv_base.v_cache, L.kv_base.k_scale, L.kv_base.v_scale,
                             s.part_ml, s.part_acc, H, Hkv, n_ctx, 0, n_splits, scale, (uint64_t)0, *seqs,
                             L.kv_seq_bytes, (const PassArgs *)nullptr)
                    : launch(attention_partial_chunked_kernel<D, Q8, CHUNK, G, false>, grid, 32 * PARTIAL_WARPS, 0, st,
                             q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, s.part_ml, s.part_acc, H, Hkv, n_ctx,
                             pos0, n_splits, scale, tree, none, (size_t)0, dyn),
               "attention_partial");
}

template <int D, bool Q8>
void launch_partial(int n, const Layer &L, const float *q_rot, Scratch &s, int H, int Hkv, int n_ctx, int pos0,
                    int n_splits, float scale, uint64_t tree, const SeqBatch *seqs, cudaStream_t st, const PassArgs *dyn) {
    if ((H / Hkv) % HEADS_PER_BLOCK == 0)
        launch_partial_g<D, Q8, HEADS_PER_BLOCK>(n, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, tree, seqs, st, dyn);
    else
        launch_partial_g<D, Q8, 1>(n, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, tree, seqs, st, dyn);
}

// tree: tree.cuh's word, 0 for a chain (any n: a prefill pass too). seqs: as launch_partial's.
template <bool Q8>
void prepare_kv(const ModelDims &d, Layer &L, const float *qg, const float *k, const float *v, float *q_rot, int n,
                int pos0, int n_ctx, cudaStream_t st, uint64_t tree = 0, const SeqBatch *seqs = nullptr,
                const PassArgs *dyn = nullptr) {
    const int D = d.hp.head_dim, H = d.hp.n_head, Hkv = d.hp.n_head_kv;
    const SeqBatch none{};
    check_cuda(seqs ? launch(attention_prepare_kernel<Q8, true>, dim3(n, H + Hkv), D, D * sizeof(float), st, qg, k, v,
                             L.q_norm, L.k_norm, q_rot, L.kv_base.k_cache, L.kv_base.v_cache, L.kv_base.k_scale,
                             L.kv_base.v_scale, H, Hkv, n_ctx, 0, d.hp.rms_eps, rope_params(d), (uint64_t)0, *seqs,
                             L.kv_seq_bytes, (const PassArgs *)nullptr)
                    : launch(attention_prepare_kernel<Q8, false>, dim3(n, H + Hkv), D, D * sizeof(float), st, qg, k, v,
                             L.q_norm, L.k_norm, q_rot, L.k_cache, L.v_cache, L.k_scale, L.v_scale, H, Hkv, n_ctx, pos0,
                             d.hp.rms_eps, rope_params(d), tree, none, (size_t)0, dyn),
               "attention_prepare");
}

// Steps 2 and 3 for n <= OJ_MAX_POSITIONS positions at pos0.. (q_rot, qg and out point at the first);
// seqs: as launch_partial's (then as many splits as the furthest position needs).
template <bool Q8>
void decode_kv(const ModelDims &d, Layer &L, Scratch &s, const float *q_rot, const float *qg, float *out, int n,
               int pos0, int n_ctx, cudaStream_t st, uint64_t tree = 0, const SeqBatch *seqs = nullptr,
               const PassArgs *dyn = nullptr) {
    const int D = d.hp.head_dim, H = d.hp.n_head, Hkv = d.hp.n_head_kv;
    int end = pos0 + n;
    if (seqs) {
        end = 0;
        for (int t = 0; t < n; ++t) end = std::max(end, seqs->pos[t] + 1);
    }
    const int n_splits = std::max((end + SPLIT - 1) / SPLIT, seqs ? 0 : s.pass_splits);
    if (n_splits > s.max_splits) fail(OJ_ERR_CONTEXT_FULL, "attention: more splits than allocated");
    const float scale = 1.0f / sqrtf((float)D);
    switch (D) {
        case 64: launch_partial<64, Q8>(n, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, tree, seqs, st, dyn); break;
        case 128: launch_partial<128, Q8>(n, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, tree, seqs, st, dyn); break;
        case 256: launch_partial<256, Q8>(n, L, q_rot, s, H, Hkv, n_ctx, pos0, n_splits, scale, tree, seqs, st, dyn); break;
        default: fail(OJ_ERR_UNSUPPORTED, "attention.key_length must be 64, 128 or 256");
    }
    check_launch("attention_partial");
    check_cuda(launch(attention_combine_kernel, dim3(H, n), D, 0, st, s.part_ml, s.part_acc, qg, out, H, n_splits),
               "attention_combine");
}

template <bool Q8>
void attention_mix_kv(const ModelDims &d, Layer &L, Scratch &s, int n, int pos0, int n_ctx, cudaStream_t st,
                      uint64_t tree, const SeqBatch *seqs = nullptr, const PassArgs *dyn = nullptr) {
    prepare_kv<Q8>(d, L, s.qg, s.k, s.v, s.q_rot, n, pos0, n_ctx, st, tree, seqs, dyn);
    decode_kv<Q8>(d, L, s, s.q_rot, s.qg, s.attn_out, n, pos0, n_ctx, st, tree, seqs, dyn);
}

}  // namespace

void attention_mix(const ModelDims &d, Layer &L, Scratch &s, int n, int pos0, int n_ctx, cudaStream_t st,
                   uint64_t tree, const PassArgs *dyn) {
    switch (L.kv_type) {
        case OJ_KV_F16: attention_mix_kv<false>(d, L, s, n, pos0, n_ctx, st, tree, nullptr, dyn); break;
        case OJ_KV_Q8_0: attention_mix_kv<true>(d, L, s, n, pos0, n_ctx, st, tree, nullptr, dyn); break;
        default: fail(OJ_ERR_UNSUPPORTED, "KV cache type " + std::to_string(L.kv_type) + " has no attention kernel");
    }
}

void attention_mix_seqs(const ModelDims &d, Layer &L, Scratch &s, int n, const SeqBatch &b, int n_ctx, cudaStream_t st) {
    switch (L.kv_type) {
        case OJ_KV_F16: attention_mix_kv<false>(d, L, s, n, 0, n_ctx, st, 0, &b); break;
        case OJ_KV_Q8_0: attention_mix_kv<true>(d, L, s, n, 0, n_ctx, st, 0, &b); break;
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

}  // namespace oj
