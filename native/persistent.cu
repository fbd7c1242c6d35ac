// persistent.cu: the main model's forward over 1..8 positions (oj_verify's device work: embedding,
// every layer, the output norm, the head and its argmax) in ONE cooperative launch (issue 8), and
// oj_cycle's whole speculative cycle: that forward, acceptance, the MTP catch-up and the chained
// draft steps (build_cycle) in the same launch.
//
// The kernel walks a program of phases built once per (positions, ring slots, drafts, draft head)
// on the host. A phase
// holds one or more tasks; a task is a number of block-sized items (the matvec's row-tile blocks,
// a super-block of prepared x, a group of recurrence rows, ...). The resident blocks share a phase's
// items round-robin, then meet at a software grid barrier before the next phase. Per layer:
//   norm + prep  ->  projections  ->  mixer (DeltaNet: conv + q/k norms, recurrence; attention: q/k
//   norms + RoPE + K/V append, split-K partials)  ->  gated norm or split combine + prep  ->  output
//   projection (+ residual)  ->  norm + prep  ->  gate / up  ->  SwiGLU + prep  ->  down (+ residual)
// Every "prep" writes the next matvec's prepared x (matvec_f16.cuh's records, one per weight type the
// consumers have) from the producing arithmetic directly: the multi-kernel path's separate RMSNorm,
// SwiGLU, gated-norm, combine and prep kernels are fused into one phase each.
//
// The arithmetic is the multi-kernel path's: matvec_block (matvec_f16.cuh) with 8 warps and 2 stages
// on the copy engine, recurrence_row / conv_channel (deltanet_step.cuh), the same formulas for the
// norms, RoPE, q8_0 and the online softmax. Sums over a row run in a different order (a warp per
// vector instead of a block), so results agree to float rounding, not bit for bit.
//
// Safety: the barrier spins at most BARRIER_TIMEOUT_NS; past it the launch records the phase and
// every block leaves, and the engine reports an error instead of hanging. Data written in one phase
// and read in a later one is never read through the read-only (non-coherent) path: the barrier's
// acquire makes other SMs' writes visible to plain loads, and a proxy fence to the copy engine.
//
// Switches (persistent_settings.h, read at engine creation): OJ_PERSISTENT unset or "0" the
// multi-kernel path; "1" this kernel where the model and GPU fit (else the multi-kernel path;
// oj_persistent_info says why); "require" an error at creation where they do not.
// OJ_PERSISTENT_STAGES=3: the matvec rings 3 deep (default 2);
// OJ_PERSISTENT_SPLIT=model: each matvec's split-K from persistent_split (one 8-warp block per SM)
// instead of the multi-kernel path's pick. Run on the GPU: the default (bb68e4e) and both switches
// together (f833631); each alone has not run. OJ_PERSISTENT_PREFETCH=1: the phase before each matvec
// phase first prefetches into L2 the weights of the item each block takes first there (measured at
// eba489c: slower, 16.3 against 15.3 ms per position; off by default).
// OJ_PERSISTENT_PROFILE=FILE: a line of per-phase times per launch (scripts/persistent_profile.py).
#include <cuda.h>

#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "attention_common.cuh"
#include "deltanet_step.cuh"
#include "dequant.cuh"
#include "engine.cuh"
#include "matvec_f16.cuh"
#include "persistent_settings.h"
#include "reduce.cuh"

namespace oj {

namespace {

using mvf16::Args;

constexpr int THREADS = 256, WARPS = 8;
constexpr int ATTN_SPLIT = 256;                          // attention.cu's SPLIT
constexpr unsigned long long BARRIER_TIMEOUT_NS = 2000000000ull;

enum Kind : int {
    K_EMBED,          // x[t] = row tokens[t] of the embedding; items: n x ceil(E / 256)
    K_NORM_PREP,      // RMSNorm of in[0] rows (weight w0), optional store to out, prep; items: E / 256
    K_MATVEC,         // matvec_block over *mv; items: its blocks
    K_CONV_QK,        // conv (+ replay) of 256 channels, then L2 norms of their q / k heads
    K_RECUR,          // 8 state rows of one value head (recurrence_row)
    K_GATED_PREP,     // RMSNorm per d_state head x ssm_norm x SiLU(z), prep; items: value_dim / 256
    K_ATTN_KV,        // q / k RMSNorm + RoPE (q_rot, K / V append): 8 (position, head) pairs per item
    K_ATTN_PARTIAL,   // split-K partial of (head, position, split); items from the frame
    K_COMBINE_PREP,   // merge the splits x sigmoid(gate), prep; items: q_dim / 256
    K_SWIGLU_PREP,    // SiLU(gate) x up, prep; items: n_ff / 256
    K_ARGMAX,         // first index of the largest logit of a row (mapped through ids); items: n
    K_ACCEPT,         // oj_cycle: the drafts the main argmax confirms -> Cycle.k; one item
    K_PICK,           // oj_cycle: draft 1 and its MTP hidden row from catch-up row k; one item
};

// oj_cycle's results, written by the launch and read back by the host (and by later phases: k sets
// the chained draft steps' positions).
struct Cycle {
    int k;                        // drafts accepted
    int argmax[OJ_MAX_POSITIONS]; // the main model's argmax per verified position
    int drafts[OJ_MAX_POSITIONS]; // the next drafts
};

struct PrepTo {
    uint8_t *rec = nullptr;   // the workspace's records (ws + XP_OFF)
    int type = 0;             // their k order (the consumer's weight type)
};

// One task; the fields each kind reads are listed at its device function.
struct Task {
    int kind = 0;
    int type = 0;               // K_MATVEC: weight type
    int64_t items = 0;          // block items (K_ATTN_PARTIAL: per split, times the frame's splits)
    const Args *mv = nullptr;   // K_MATVEC (device address)
    Matrix mat;                 // K_EMBED
    const int32_t *tokens = nullptr;
    int32_t *iout = nullptr;
    const float *in[6] = {};
    const float *w0 = nullptr, *w1 = nullptr;
    float *out = nullptr, *state = nullptr;
    float *part_ml = nullptr, *part_acc = nullptr;
    void *kc = nullptr, *vc = nullptr;
    __half *ks = nullptr, *vs = nullptr;
    PrepTo prep[2];
    int n_prep = 0;
    int width = 0, C = 0, S = 0, key_dim = 0, Hk = 0, Hv = 0;
    int ksize = 0;              // K_CONV_QK: the conv kernel's taps; K_MATVEC: the rings' stages
    int H = 0, Hkv = 0, D = 0, n_ctx = 0, q8 = 0;
    float eps = 0.0f;
    RopeParams rope{};
    int seg = 0;                // whose positions (seg_of): 0 the verify, 1 the MTP catch-up, 2 a chained draft step
    int step = 0;               // seg 2: the step's offset past the next token's MTP position (1..)
    int rec_off = 0;            // K_NORM_PREP: super-block offset of its records (eh_proj's second half)
    int dyn_width = 0;          // K_ARGMAX: the width is the frame's n_ids (the restricted draft head)
};

struct Phase {
    int first = 0, count = 0;   // tasks [first, first + count)
    int prefetch = -1;          // the next matvec phase, whose weights this one prefetches into L2 (or -1)
};

// What changes from call to call of one program.
struct Frame {
    int n;          // positions
    int pos0;       // first position
    int n_replay;   // accepted positions of the replay slot owed to the DeltaNet state
    int n_splits;   // attention split-K blocks per (head, position)
    int prefetch;   // OJ_PERSISTENT_PREFETCH: phases prefetch their next matvec phase's first items
    int n_ids;      // oj_cycle with a restricted draft vocabulary: the draft head's live rows
    Cycle *cyc;     // oj_cycle's results (null for a verify)
};

// The positions a task works on. The verify's: the frame's. The MTP catch-up's: one row per verified
// position at MTP positions pos0 + 1..; a chained draft step's: one row at the next token's MTP
// position (pos0 + 1 + k, k from the acceptance phase) + step.
struct Seg {
    int n, pos0, n_splits;
};
__device__ __forceinline__ Seg seg_of(const Task &t, const Frame &f) {
    if (t.seg == 0) return {f.n, f.pos0, f.n_splits};
    int n = f.n, pos0 = f.pos0 + 1;
    if (t.seg == 2) {
        n = 1;
        pos0 += *reinterpret_cast<volatile const int *>(&f.cyc->k) + t.step;
    }
    return {n, pos0, (pos0 + n + ATTN_SPLIT - 1) / ATTN_SPLIT};
}

struct Sync {
    unsigned count, gen;
    int error, phase;
};

// ---------------------------------------------------------------------------------------------
// grid barrier

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(unsigned *p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every block of the grid arrives before any leaves (false: the barrier timed out, or another
// block's did; the caller leaves). Release: the block's writes (ordered before thread 0 by
// __syncthreads) are fenced before the arrival; acquire: thread 0 sees the new generation, fences,
// and the block's threads follow it past __syncthreads. The proxy fence orders them before the copy
// engine's reads (matvec_block's tensor and bulk copies of prepared x).
__device__ bool grid_barrier(Sync *s, int phase) {
    __shared__ int ok;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;" ::: "memory");   // this thread's writes, for the copy engine
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned g = ld_acquire(&s->gen);
        __threadfence();
        int good = 1;
        if (atomicAdd(&s->count, 1u) == gridDim.x - 1) {
            atomicExch(&s->count, 0u);
            __threadfence();
            st_release(&s->gen, g + 1);
        } else {
            const unsigned long long t0 = globaltimer();
            while (ld_acquire(&s->gen) == g) {
                if (*reinterpret_cast<volatile int *>(&s->error)) { good = 0; break; }
                if (globaltimer() - t0 > BARRIER_TIMEOUT_NS) {
                    if (atomicCAS(&s->error, 0, 1) == 0) s->phase = phase;
                    good = 0;
                    break;
                }
            }
        }
        __threadfence();
        ok = good;
    }
    __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
    return ok;
}

// ---------------------------------------------------------------------------------------------
// fused preps: this lane's 8 values of super-block u for vector v -> every record the task writes

__device__ __forceinline__ void prep_emit(const Task &t, const float (&xv)[8], int64_t u, int v, int lane) {
    u += t.rec_off;
    for (int i = 0; i < t.n_prep; ++i) {
        float c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = xv[j];
        uint8_t *rec = t.prep[i].rec + u * mvf16::REC;
        if (t.prep[i].type == TYPE_Q4_K) mvf16::prep_store<TYPE_Q4_K>(c, rec, v, lane);
        else mvf16::prep_store<TYPE_Q6_K>(c, rec, v, lane);
    }
}

// vectors past n: inverse scale 1, as prep_kernel leaves them
__device__ __forceinline__ void prep_pad(const Task &t, int64_t u, int v, int lane) {
    u += t.rec_off;
    if (lane == 0)
        for (int i = 0; i < t.n_prep; ++i) reinterpret_cast<float *>(t.prep[i].rec + u * mvf16::REC + mvf16::INV_OFF)[v] = 1.0f;
}

__device__ __forceinline__ void load8(const float *p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// K_EMBED: mat, tokens, out (x), width E.
__device__ void embed_item(const Task &t, const Frame &f, int64_t it) {
    const int64_t per = (t.width + THREADS - 1) / THREADS;
    const int pos = (int)(it / per);
    const int64_t k = (it % per) * THREADS + threadIdx.x;
    if (k < t.width) t.out[(int64_t)pos * t.width + k] = dequant_one(t.mat, t.tokens[pos], k);
}

// K_NORM_PREP: in[0] rows [n][width], w0 the norm weight, eps; out (optional) the normed rows.
// rms_norm_kernel's formula: x * (1 / sqrt(mean(x^2) + eps)) * w.
__device__ void norm_prep_item(const Task &t, const Frame &f, int64_t u) {
    const int v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (v >= seg_of(t, f).n) { prep_pad(t, u, v, lane); return; }
    const float *xr = t.in[0] + (int64_t)v * t.width;
    float ss = 0.0f;
    for (int i = lane * 4; i < t.width; i += 128) {
        const float4 q = *reinterpret_cast<const float4 *>(xr + i);
        ss += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
    }
    ss = warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss / t.width + t.eps);
    const int64_t base = u * QK_K + 8 * lane;
    float xv[8], w[8];
    load8(xr + base, xv);
    load8(t.w0 + base, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] = xv[j] * scale * w[j];
    if (t.out) {
        float4 *o = reinterpret_cast<float4 *>(t.out + (int64_t)v * t.width + base);
        o[0] = make_float4(xv[0], xv[1], xv[2], xv[3]);
        o[1] = make_float4(xv[4], xv[5], xv[6], xv[7]);
    }
    prep_emit(t, xv, u, v, lane);
}

// K_GATED_PREP: in[0] the recurrence output, in[1] z (both [n][width]), w0 ssm_norm (S values), eps.
// deltanet_gated_norm_kernel's formula per head of S values: o / sqrt(mean(o^2) + eps) * w * silu(z).
__device__ void gated_prep_item(const Task &t, const Frame &f, int64_t u) {
    const int v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (v >= seg_of(t, f).n) { prep_pad(t, u, v, lane); return; }
    const int64_t base = u * QK_K + 8 * lane;
    float o[8], z[8];
    load8(t.in[0] + (int64_t)v * t.width + base, o);
    load8(t.in[1] + (int64_t)v * t.width + base, z);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += o[j] * o[j];
    for (int off = t.S / 16; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);   // the head's S / 8 lanes
    const int i0 = (int)(base % t.S);
    const float den = sqrtf(ss / t.S + t.eps);
    float xv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] = o[j] / den * t.w0[i0 + j] * silu(z[j]);
    prep_emit(t, xv, u, v, lane);
}

// K_SWIGLU_PREP: in[0] gate, in[1] up ([n][width]): silu(gate) * up.
__device__ void swiglu_prep_item(const Task &t, const Frame &f, int64_t u) {
    const int v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (v >= seg_of(t, f).n) { prep_pad(t, u, v, lane); return; }
    const int64_t base = (int64_t)v * t.width + u * QK_K + 8 * lane;
    float g[8], up[8], xv[8];
    load8(t.in[0] + base, g);
    load8(t.in[1] + base, up);
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] = silu(g[j]) * up[j];
    prep_emit(t, xv, u, v, lane);
}

// K_COMBINE_PREP: part_ml / part_acc of H heads x D, in[0] qg ([n][H][2][D]; the gate is the second
// half): attention_combine_kernel's merge, out = sum / L * sigmoid(gate).
__device__ void combine_prep_item(const Task &t, const Frame &f, int64_t u) {
    const int v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const Seg g = seg_of(t, f);
    if (v >= g.n) { prep_pad(t, u, v, lane); return; }
    const int64_t col = u * QK_K + 8 * lane;
    const int h = (int)(col / t.D), d0 = (int)(col % t.D);
    const int64_t base = ((int64_t)v * t.H + h) * g.n_splits;
    float M = -INFINITY;
    for (int s = 0; s < g.n_splits; ++s) M = fmaxf(M, t.part_ml[(base + s) * 2]);
    float L = 0.0f, a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < g.n_splits; ++s) {
        const float ms = t.part_ml[(base + s) * 2];
        if (ms == -INFINITY) continue;
        const float fct = expf(ms - M);
        L += t.part_ml[(base + s) * 2 + 1] * fct;
        float acc[8];
        load8(t.part_acc + (base + s) * t.D + d0, acc);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] += acc[j] * fct;
    }
    float gate[8], xv[8];
    load8(t.in[0] + ((int64_t)v * t.H * 2 + h * 2 + 1) * t.D + d0, gate);
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] = a[j] / L * sigmoid(gate[j]);
    prep_emit(t, xv, u, v, lane);
}

// K_CONV_QK: in[0] this evaluation's raw conv inputs, in[1] the replay slot's, w0 conv1d, state the
// conv state, out the conv output ([n][C]); then the L2 norms of the q / k heads among the item's
// channels (deltanet_qk_norm_kernel: v / sqrt(sum v^2 + eps), q also x 1 / sqrt(S)).
template <int KS>
__device__ void conv_qk_item(const Task &t, const Frame &f, int64_t it) {
    const int c = (int)it * THREADS + threadIdx.x;
    if (c < t.C) conv_channel<KS>(c, t.in[1], f.n_replay, t.in[0], f.n, t.w0, t.state, t.out, t.C, false);
    __syncthreads();
    const int c0 = (int)it * THREADS, c1 = min(c0 + THREADS, 2 * t.key_dim);
    if (c0 >= c1) return;
    const int heads = (c1 - c0) / t.S, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float q_scale = 1.0f / sqrtf((float)t.S);
    for (int p = warp; p < f.n * heads; p += WARPS) {
        const int pos = p / heads, hh = c0 / t.S + p % heads;
        float *row = t.out + (int64_t)pos * t.C + (int64_t)hh * t.S;
        float x[4];
        float ss = 0.0f;
        for (int r = 0; r < t.S / 32; ++r) {
            x[r] = row[r * 32 + lane];
            ss += x[r] * x[r];
        }
        ss = warp_sum(ss);
        for (int r = 0; r < t.S / 32; ++r) {
            float y = x[r] / sqrtf(ss + t.eps);
            if (hh < t.Hk) y *= q_scale;
            row[r * 32 + lane] = y;
        }
    }
}

// K_RECUR: in[0..2] this slot's conv / beta / alpha, in[3..5] the replay slot's, w0 dt_bias, w1 ssm_a,
// state the ssm state, out the outputs [n][Hv][S].
template <int S>
__device__ void recur_item(const Task &t, const Frame &f, int64_t it) {
    const int groups = S / WARPS;
    const int h = (int)(it / groups), j = (int)(it % groups) * WARPS + (threadIdx.x >> 5);
    recurrence_row<S>(h, j, threadIdx.x & 31, t.in[3], t.in[4], t.in[5], f.n_replay, t.in[0], t.in[1], t.in[2], f.n,
                      t.w0, t.w1, t.state, t.out, t.C, t.key_dim, t.Hk, t.Hv, false);
}

// K_ATTN_KV: in[0] qg, in[1] k, in[2] v, w0 q_norm, w1 k_norm, out q_rot, kc / vc (+ ks / vs for
// q8_0) the caches, rope. attention_prepare_kernel's arithmetic with a warp per (position, head); a
// lane holds dims lane + 32 r, so a q8_0 block is the warp's r-th 32 values.
template <int D>
__device__ void attn_kv_item(const Task &t, const Frame &f, int64_t it, float *smem) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const Seg sg = seg_of(t, f);
    const int pairs = sg.n * (t.H + t.Hkv);
    const int p = (int)it * WARPS + warp;
    if (p >= pairs) return;
    float *buf = smem + warp * D;
    const int pos_i = p / (t.H + t.Hkv), hh = p % (t.H + t.Hkv);
    const bool is_q = hh < t.H;
    const int g = hh - t.H;
    const float *src = is_q ? t.in[0] + ((int64_t)pos_i * t.H * 2 + hh * 2) * D : t.in[1] + ((int64_t)pos_i * t.Hkv + g) * D;
    const float *nw = is_q ? t.w0 : t.w1;
    float x[PER];
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < PER; ++r) {
        x[r] = src[r * 32 + lane];
        ss += x[r] * x[r];
    }
    ss = warp_sum(ss);
#pragma unroll
    for (int r = 0; r < PER; ++r) buf[r * 32 + lane] = x[r] / sqrtf(ss / D + t.eps) * nw[r * 32 + lane];
    __syncwarp();
    const int pos = sg.pos0 + pos_i, half = t.rope.n_rot / 2;
#pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int i = r * 32 + lane;
        float y = buf[i];
        if (i < t.rope.n_rot) {
            const int ii = i < half ? i : i - half;
            float sn, cs;
            sincosf(imrope_angle(t.rope, ii, pos), &sn, &cs);
            const float x0 = buf[ii], x1 = buf[ii + half];
            y = i < half ? x0 * cs - x1 * sn : x0 * sn + x1 * cs;
        }
        if (is_q) {
            t.out[((int64_t)pos_i * t.H + hh) * D + i] = y;
        } else {
            const int64_t at = ((int64_t)g * t.n_ctx + pos) * D + i;
            const float vx = t.in[2][((int64_t)pos_i * t.Hkv + g) * D + i];
            if (t.q8) {
                const int64_t block = ((int64_t)g * t.n_ctx + pos) * (D / 32) + r;
                q8_0_store(y, static_cast<int8_t *>(t.kc) + at, t.ks + block);
                q8_0_store(vx, static_cast<int8_t *>(t.vc) + at, t.vs + block);
            } else {
                static_cast<__half *>(t.kc)[at] = __float2half(y);
                static_cast<__half *>(t.vc)[at] = __float2half(vx);
            }
        }
    }
    __syncwarp();   // buf is the warp's next pair's
}

// K_ATTN_PARTIAL: in[0] q_rot, the caches, part_ml / part_acc. attention_partial_kernel's online
// softmax with 8 warps on one split (positions begin + warp, + 8, ...), the warps merged as its
// store_partial merges its 4.
template <int D, bool Q8>
__device__ void attn_partial_item(const Task &t, const Frame &f, int64_t it, float *smem) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const Seg sg = seg_of(t, f);
    const int split = (int)(it % sg.n_splits);
    const int64_t rest = it / sg.n_splits;
    const int pos_i = (int)(rest % sg.n), h = (int)(rest / sg.n);
    const int g = h / (t.H / t.Hkv);
    const int len = sg.pos0 + pos_i + 1;
    const int begin = split * ATTN_SPLIT, end = min(begin + ATTN_SPLIT, len);
    const float scale = 1.0f / sqrtf((float)D);
    float q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = t.in[0][((int64_t)pos_i * t.H + h) * D + lane * PER + i];
    const int64_t row0 = (int64_t)g * t.n_ctx;
    // each warp's positions 4 at a time, double buffered (chunked_scan, attention_common.cuh: the
    // multi-kernel chunked partial's arithmetic with this block's 8 warps interleaving): 8 rows in
    // flight per warp instead of one dependent row (bench/results/2026-11-30-cycle-profile-q27b-
    // depth8192-60999ef.md: the one-row loop made at.partial 27% of a cycle at depth 8192)
    using Bits = RowBits<Q8 ? PER : 2 * PER>;
    const size_t elem = Q8 ? 1 : 2;
    const Bits *kb = reinterpret_cast<const Bits *>(static_cast<const char *>(t.kc) + (row0 * D + lane * PER) * elem);
    const Bits *vb = reinterpret_cast<const Bits *>(static_cast<const char *>(t.vc) + (row0 * D + lane * PER) * elem);
    const __half *ksb = t.ks + row0 * (D / 32) + lane * PER / 32;   // q8_0 only
    const __half *vsb = t.vs + row0 * (D / 32) + lane * PER / 32;
    float m, l, acc[PER];
    chunked_scan<D, Q8, 4, WARPS>(q, kb, vb, ksb, vsb, begin + warp, end, scale, m, l, acc);
    float *sm_m = smem, *sm_l = smem + WARPS, *sm_acc = smem + 2 * WARPS;
    if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
#pragma unroll
    for (int i = 0; i < PER; ++i) sm_acc[warp * D + lane * PER + i] = acc[i];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w]);
    const int64_t slot = ((int64_t)pos_i * t.H + h) * sg.n_splits + split;
    for (int d = threadIdx.x; d < D; d += THREADS) {
        float a = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < WARPS; ++w) a += sm_acc[w * D + d] * expf(sm_m[w] - M);
        t.part_acc[slot * D + d] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < WARPS; ++w) L += sm_l[w] * expf(sm_m[w] - M);
        t.part_ml[slot * 2] = M;
        t.part_ml[slot * 2 + 1] = L;
    }
    __syncthreads();   // smem is the next item's
}

// K_ARGMAX: in[0] logits [n][width], iout: argmax_kernel's rule (first index of the largest; NaN never
// wins); through tokens (the draft vocabulary's ids) when set, as map_ids does. dyn_width: the row's
// live width is the frame's n_ids (a restricted draft head keeps spare rows).
__device__ void argmax_item(const Task &t, const Frame &f, int64_t row, float *smem) {
    const float *xr = t.in[0] + row * t.width;
    const int width = t.dyn_width ? f.n_ids : t.width;
    float best = -FLT_MAX;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < width; i += THREADS) {
        const float v = xr[i];
        if (v > best) { best = v; idx = i; }
    }
    const int i = block_argmax(best, idx, smem, reinterpret_cast<int *>(smem + THREADS));
    if (threadIdx.x == 0) {
        const int best_i = i == 0x7fffffff ? 0 : i;
        t.iout[row] = t.tokens ? t.tokens[best_i] : best_i;
    }
    __syncthreads();
}

// K_ACCEPT: tokens the verified tokens, iout the main argmax (n rows): k = the leading drafts equal to
// the argmax at the position before them (speculative.verify_greedy); the argmax rows are copied for
// the host.
__device__ void accept_item(const Task &t, const Frame &f) {
    if (threadIdx.x != 0) return;
    int k = 0;
    while (k + 1 < f.n && t.tokens[k + 1] == t.iout[k]) ++k;
    for (int i = 0; i < f.n; ++i) f.cyc->argmax[i] = t.iout[i];
    f.cyc->k = k;
}

// K_PICK: iout the catch-up's draft argmax (token ids), in[0] its normed outputs [n][width]: draft 1
// is row k's argmax, and row k is the first chained step's hidden input (out).
__device__ void pick_item(const Task &t, const Frame &f) {
    const int k = *reinterpret_cast<volatile const int *>(&f.cyc->k);
    for (int i = threadIdx.x; i < t.width; i += THREADS) t.out[i] = t.in[0][(int64_t)k * t.width + i];
    if (threadIdx.x == 0) f.cyc->drafts[0] = t.iout[k];
}

__device__ __forceinline__ int64_t task_items(const Task &t, const Frame &f) {
    return t.kind == K_ATTN_PARTIAL ? t.items * seg_of(t, f).n_splits : t.items;
}

__device__ void run_item(const Task &t, const Frame &f, int64_t it, uint8_t *smem) {
    float *fs = reinterpret_cast<float *>(smem);
    switch (t.kind) {
        case K_EMBED: embed_item(t, f, it); break;
        case K_NORM_PREP: norm_prep_item(t, f, it); break;
        case K_MATVEC:
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            // the copy engine writes the rings next: order the block's earlier generic use of this
            // shared memory (the previous item's reduction, another phase's rows) before it
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            // The tensor maps live in global memory (the program), written by a host copy: the
            // tensormap proxy may hold a descriptor cached from an earlier program at the same
            // address (a freed engine's), so each issuing lane acquires the maps it will use
            // (PTX ISA: fence.proxy.tensormap, "modifying tensor maps in global memory").
            if ((threadIdx.x & 31) == 0) {
                const Args &a = *t.mv;
                for (int i = 0; i <= a.n_more; ++i) {
                    mvf16::tensormap_acquire(&a.map[i]);
                    if (t.type == TYPE_Q6_K) mvf16::tensormap_acquire(&a.map_sc[i]);
                }
            }
#endif
            if (t.ksize == 3) {   // the program's ring depth (program_for)
                if (t.type == TYPE_Q4_K) mvf16::matvec_block<TYPE_Q4_K, WARPS, 3, true>(*t.mv, (unsigned)it, smem);
                else mvf16::matvec_block<TYPE_Q6_K, WARPS, 3, true>(*t.mv, (unsigned)it, smem);
            } else {
                if (t.type == TYPE_Q4_K) mvf16::matvec_block<TYPE_Q4_K, WARPS, 2, true>(*t.mv, (unsigned)it, smem);
                else mvf16::matvec_block<TYPE_Q6_K, WARPS, 2, true>(*t.mv, (unsigned)it, smem);
            }
            __syncthreads();   // the rings are the next item's
            break;
        case K_CONV_QK:
            if (t.ksize == 2) conv_qk_item<2>(t, f, it);
            else if (t.ksize == 3) conv_qk_item<3>(t, f, it);
            else conv_qk_item<4>(t, f, it);
            __syncthreads();
            break;
        case K_RECUR:
            if (t.S == 32) recur_item<32>(t, f, it);
            else if (t.S == 64) recur_item<64>(t, f, it);
            else recur_item<128>(t, f, it);
            break;
        case K_GATED_PREP: gated_prep_item(t, f, it); break;
        case K_ATTN_KV:
            if (t.D == 64) attn_kv_item<64>(t, f, it, fs);
            else if (t.D == 128) attn_kv_item<128>(t, f, it, fs);
            else attn_kv_item<256>(t, f, it, fs);
            break;
        case K_ATTN_PARTIAL:
            if (t.q8) {
                if (t.D == 64) attn_partial_item<64, true>(t, f, it, fs);
                else if (t.D == 128) attn_partial_item<128, true>(t, f, it, fs);
                else attn_partial_item<256, true>(t, f, it, fs);
            } else {
                if (t.D == 64) attn_partial_item<64, false>(t, f, it, fs);
                else if (t.D == 128) attn_partial_item<128, false>(t, f, it, fs);
                else attn_partial_item<256, false>(t, f, it, fs);
            }
            break;
        case K_COMBINE_PREP: combine_prep_item(t, f, it); break;
        case K_SWIGLU_PREP: swiglu_prep_item(t, f, it); break;
        case K_ARGMAX: argmax_item(t, f, it, fs); break;
        case K_ACCEPT: accept_item(t, f); break;
        case K_PICK: pick_item(t, f); break;
        default: break;
    }
}

// prof (OJ_PERSISTENT_PROFILE): block 0 stamps the start and the end of every phase (the barrier
// after it, so the last phase gets one too) with the global timer.
__global__ void __launch_bounds__(THREADS, 1)
persistent_kernel(const Phase *phases, int n_phases, const Task *tasks, Frame f, Sync *sync,
                  unsigned long long *prof) {
    extern __shared__ __align__(128) uint8_t smem[];
    const bool stamp = prof && blockIdx.x == 0 && threadIdx.x == 0;
    if (stamp) prof[0] = globaltimer();
    for (int ph = 0; ph < n_phases; ++ph) {
        const Phase P = phases[ph];
        if (f.prefetch && P.prefetch >= 0) {   // the item this block takes first in the next matvec phase
            const Phase Q = phases[P.prefetch];
            int64_t r = blockIdx.x;
            for (int i = 0; i < Q.count; ++i) {
                const Task &t = tasks[Q.first + i];
                if (r < t.items) {
                    if (t.type == TYPE_Q4_K) mvf16::prefetch_block<TYPE_Q4_K>(*t.mv, (unsigned)r);
                    else mvf16::prefetch_block<TYPE_Q6_K>(*t.mv, (unsigned)r);
                    break;
                }
                r -= t.items;
            }
        }
        int64_t total = 0;
        for (int i = 0; i < P.count; ++i) total += task_items(tasks[P.first + i], f);
        for (int64_t it = blockIdx.x; it < total; it += gridDim.x) {
            int64_t r = it;
            int i = 0;
            for (; i + 1 < P.count; ++i) {
                const int64_t c = task_items(tasks[P.first + i], f);
                if (r < c) break;
                r -= c;
            }
            run_item(tasks[P.first + i], f, r, smem);
        }
        if (ph + 1 < n_phases || prof) {
            if (!grid_barrier(sync, ph)) return;
            if (stamp) prof[ph + 1] = globaltimer();
        }
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// host side

struct Persistent {
    int mode = 0;                // 0 off, 1 where it fits, 2 required
    bool active = false;         // the verify forward runs here
    std::string why;             // why not (or "" when active)
    uint8_t *ws[2] = {};         // matvec workspaces: split-K counters + partials + prepared x
    Sync *sync = nullptr;
    int *host_error = nullptr;   // pinned: Sync.error and .phase after each launch
    int n_sm = 0, optin = 0, regs = 0;
    int stages = 2;                    // OJ_PERSISTENT_STAGES: the matvec rings' depth (2 or 3)
    bool split_model = false;          // OJ_PERSISTENT_SPLIT=model: persistent_split, else pick's
    bool prefetch = false;             // OJ_PERSISTENT_PREFETCH=1: next matvec phase's weights into L2
    size_t smem_attr = 0;
    struct Program {
        void *dev = nullptr;
        const Phase *phases = nullptr;
        const Task *tasks = nullptr;
        int n_phases = 0;
        size_t smem = 0;
        int grid = 0, per_sm = 0;
        std::string shape;                 // oj_persistent_info's text for this program's launches
        int shape_grid = -1;               // the grid `shape` describes
        std::vector<std::string> labels;   // per phase (the profile's names)
        std::vector<double> bytes;         // per phase: weight bytes its matvecs stream
    };
    // key: positions, ring slot, replay slot, drafts (-1: a verify), draft head generation
    std::map<std::tuple<int, int, int, int, int>, Program> programs;   // (nodes stay put)
    const std::string *shape = nullptr;    // the last launch's program's shape
    std::string prof_path;             // OJ_PERSISTENT_PROFILE: a JSON line per launch appended there
    unsigned long long *prof = nullptr, *prof_host = nullptr;
    // oj_cycle (the MTP block in the same launch)
    bool cycle_fits = false;           // the MTP block's matrices fit too
    std::string cycle_why;             // why not
    Cycle *cyc = nullptr, *cyc_host = nullptr;
    float *h_chain = nullptr;          // [E]: a chained draft step's hidden input
    Matrix draft_head;                 // the restricted draft head's rows gathered (spare rows past n_ids), or absent
    int draft_gen = 0;                 // bumped when draft_head moves (the programs holding its maps are stale)
    ~Persistent() {
        if (host_error) cudaFreeHost(host_error);
        if (prof_host) cudaFreeHost(prof_host);
        if (cyc_host) cudaFreeHost(cyc_host);
    }
};

namespace {

// Why the persistent kernel cannot run this model on this GPU ("" when it can).
std::string unfit_reason(const Engine &e) {
    int major = 0, minor = 0, coop = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, e.device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, e.device);
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, e.device);
    if (major < 9)
        return "the GPU is compute capability " + std::to_string(major) + "." + std::to_string(minor) +
               "; the persistent kernel streams weights on the copy engine of 9.0+";
    if (!coop) return "the GPU does not support cooperative launches";
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, persistent_kernel) != cudaSuccess || fa.binaryVersion < 90) {
        cudaGetLastError();
        return "the library carries no sm_90 code for the persistent kernel";
    }
    auto check = [](const Matrix &w, const std::string &name) -> std::string {
        if (w.type != TYPE_Q4_K && w.type != TYPE_Q6_K)
            return "tensor " + name + " is " + type_name(w.type) + "; the persistent kernel takes Q4_K and Q6_K matrices";
        if (w.K % QK_K) return "tensor " + name + " has K = " + std::to_string(w.K) + ", not a multiple of 256";
        return "";
    };
    for (size_t il = 0; il < e.layers.size(); ++il) {
        const Layer &L = e.layers[il];
        const std::string p = "blk." + std::to_string(il) + ".";
        std::vector<std::pair<const Matrix *, std::string>> ms = {
            {&L.ffn_gate, "ffn_gate"}, {&L.ffn_up, "ffn_up"}, {&L.ffn_down, "ffn_down"}};
        if (L.recurrent) {
            ms.insert(ms.end(), {{&L.wqkv, "attn_qkv"}, {&L.wgate, "attn_gate"}, {&L.wbeta, "ssm_beta"},
                                 {&L.walpha, "ssm_alpha"}, {&L.wssm_out, "ssm_out"}});
        } else {
            ms.insert(ms.end(), {{&L.wq, "attn_q"}, {&L.wk, "attn_k"}, {&L.wv, "attn_v"}, {&L.wo, "attn_output"}});
        }
        for (auto &m : ms) {
            const std::string r = check(*m.first, p + m.second + ".weight");
            if (!r.empty()) return r;
        }
    }
    const std::string r = check(e.output.present() ? e.output : e.tok_embd, e.output.present() ? "output.weight" : "token_embd.weight");
    if (!r.empty()) return r;
    if (e.dims.hp.n_embd % QK_K) return "n_embd is not a multiple of 256";
    if (!matvec_f16_in_use()) return "OPENJET_MATVEC selects another decode matvec; the persistent kernel carries the fp16 one";
    return "";
}

struct Builder {
    Engine &e;
    int n;                     // verified positions
    int nv = 0;                // vectors of the phases being built (n, or 1 for a chained draft step)
    int seg = 0, step = 0;     // their Task::seg / step
    std::vector<Phase> phases;
    std::vector<Task> tasks;
    std::vector<Args> args;
    std::vector<int> arg_of;   // per task: index into args, or -1
    std::vector<std::string> labels;
    std::vector<double> bytes;
    std::string prefix;        // the current block's label prefix ("dn.", "at.", ...)

    void phase(std::initializer_list<Task> ts, const std::string &label) {
        labels.push_back(prefix + label);
        bytes.push_back(0.0);
        Phase p;
        p.first = (int)tasks.size();
        p.count = (int)ts.size();
        for (Task t : ts) {
            t.seg = seg;
            t.step = step;
            tasks.push_back(t);
            arg_of.push_back(-1);
        }
        phases.push_back(p);
    }

    // the distinct types among ws (in order of first appearance), at most 2
    static std::vector<int> types_of(const std::vector<const Matrix *> &ws) {
        std::vector<int> ts;
        for (const Matrix *w : ws)
            if (std::find(ts.begin(), ts.end(), w->type) == ts.end()) ts.push_back(w->type);
        return ts;
    }

    // a prep task's outputs for consumers ws: workspace i gets type i's order
    void prep_for(Task &t, const std::vector<const Matrix *> &ws) {
        const std::vector<int> ts = types_of(ws);
        t.n_prep = (int)ts.size();
        for (int i = 0; i < t.n_prep; ++i) {
            t.prep[i].rec = e.persistent->ws[i] + mvf16::XP_OFF;
            t.prep[i].type = ts[i];
        }
    }

    // the matvec phase of consumers ws (outputs ys), one task per type, workspace as prep_for
    void matvecs(const std::vector<const Matrix *> &ws, const std::vector<float *> &ys, bool accumulate,
                 const std::string &label) {
        const std::vector<int> ts = types_of(ws);
        double b = 0.0;
        for (const Matrix *w : ws) b += (double)device_layout_bytes(w->type, w->K, w->M);
        labels.push_back(prefix + label);
        bytes.push_back(b);
        Phase p;
        p.first = (int)tasks.size();
        p.count = (int)ts.size();
        for (size_t i = 0; i < ts.size(); ++i) {
            std::vector<Matrix> mw;
            std::vector<float *> my;
            for (size_t k = 0; k < ws.size(); ++k)
                if (ws[k]->type == ts[i]) mw.push_back(*ws[k]), my.push_back(ys[k]);
            Task t;
            t.kind = K_MATVEC;
            t.type = ts[i];
            args.push_back(mvf16::persistent_args(mw.data(), my.data(), (int)mw.size(), e.persistent->ws[i], nv, accumulate,
                                                  e.persistent->split_model ? e.persistent->n_sm : 0, t.items));
            tasks.push_back(t);
            arg_of.push_back((int)args.size() - 1);
        }
        phases.push_back(p);
        if (phases.size() >= 2) phases[phases.size() - 2].prefetch = (int)phases.size() - 1;
    }

    Task norm_prep(const float *x, const float *w, float *store, const std::vector<const Matrix *> &consumers) {
        Task t;
        t.kind = K_NORM_PREP;
        t.in[0] = x;
        t.w0 = w;
        t.out = store;
        t.width = e.dims.hp.n_embd;
        t.eps = e.dims.hp.rms_eps;
        t.items = t.width / QK_K;
        prep_for(t, consumers);
        return t;
    }
};

// A gated-attention layer's phases (the main model's or the MTP block's): norm + prep, q / k / v,
// q / k norms + RoPE + K/V append, split-K partials, combine + prep, output projection into s.x.
void attention_block(Engine &e, Builder &b, Layer &L) {
    const ModelDims &d = e.dims;
    Scratch &s = e.s;
    const std::vector<const Matrix *> in_w = {&L.wq, &L.wk, &L.wv};
    b.phase({b.norm_prep(s.x, L.attn_norm, nullptr, in_w)}, "norm_prep");
    b.matvecs(in_w, {s.qg, s.k, s.v}, false, "proj");
    Task k;
    k.kind = K_ATTN_KV;
    k.in[0] = s.qg, k.in[1] = s.k, k.in[2] = s.v;
    k.w0 = L.q_norm;
    k.w1 = L.k_norm;
    k.out = s.q_rot;
    k.kc = L.k_cache, k.vc = L.v_cache, k.ks = L.k_scale, k.vs = L.v_scale;
    k.q8 = L.kv_type == OJ_KV_Q8_0;
    k.H = d.hp.n_head, k.Hkv = d.hp.n_head_kv, k.D = d.hp.head_dim, k.n_ctx = e.n_ctx;
    k.eps = d.hp.rms_eps;
    k.rope = rope_params(d);
    k.items = ((int64_t)b.nv * (k.H + k.Hkv) + WARPS - 1) / WARPS;
    b.phase({k}, "kv");
    Task p = k;
    p.kind = K_ATTN_PARTIAL;
    p.in[0] = s.q_rot;
    p.part_ml = s.part_ml, p.part_acc = s.part_acc;
    p.items = (int64_t)k.H * b.nv;   // x the segment's splits
    b.phase({p}, "partial");
    Task c;
    c.kind = K_COMBINE_PREP;
    c.in[0] = s.qg;
    c.part_ml = s.part_ml, c.part_acc = s.part_acc;
    c.H = k.H, c.D = k.D;
    c.items = (int64_t)d.q_dim() / QK_K;
    b.prep_for(c, {&L.wo});
    b.phase({c}, "combine_prep");
    b.matvecs({&L.wo}, {s.x}, true, "out");
}

// The FFN's phases: norm + prep, gate / up, SwiGLU + prep, down into s.x.
void ffn_block(Engine &e, Builder &b, Layer &L) {
    Scratch &s = e.s;
    b.phase({b.norm_prep(s.x, L.post_norm, nullptr, {&L.ffn_gate, &L.ffn_up})}, "norm_prep");
    b.matvecs({&L.ffn_gate, &L.ffn_up}, {s.ffn_gate, s.ffn_up}, false, "gate_up");
    Task w;
    w.kind = K_SWIGLU_PREP;
    w.in[0] = s.ffn_gate;
    w.in[1] = s.ffn_up;
    w.width = e.dims.hp.n_ff;
    w.items = w.width / QK_K;
    b.prep_for(w, {&L.ffn_down});
    b.phase({w}, "swiglu_prep");
    b.matvecs({&L.ffn_down}, {s.x}, true, "down");
}

// A head: norm of s.x (stored to `store`) + prep, the matvec into logits, the argmax of each row
// into iout (through ids when set; dyn: the width is the frame's n_ids).
void head_block(Engine &e, Builder &b, const float *norm_w, float *store, const Matrix *head, float *logits, int32_t *iout,
                const int32_t *ids, bool dyn) {
    b.phase({b.norm_prep(e.s.x, norm_w, store, {head})}, "norm_prep");
    b.matvecs({head}, {logits}, false, "matvec");
    Task a;
    a.kind = K_ARGMAX;
    a.in[0] = logits;
    a.iout = iout;
    a.tokens = ids;
    a.dyn_width = dyn ? 1 : 0;
    a.width = (int)head->M;
    a.items = b.nv;
    b.phase({a}, "argmax");
}

void build(Engine &e, Builder &b, int slot, int rslot) {
    const ModelDims &d = e.dims;
    Scratch &s = e.s;
    const int n = b.n, E = d.hp.n_embd;
    b.nv = n;
    b.seg = 0;
    {
        Task t;
        t.kind = K_EMBED;
        t.mat = e.tok_embd;
        t.tokens = s.tokens;
        t.out = s.x;
        t.width = E;
        t.items = (int64_t)n * ((E + THREADS - 1) / THREADS);
        b.phase({t}, "embed");
    }
    for (Layer &L : e.layers) {
        if (!L.recurrent) {
            b.prefix = "at.";
            attention_block(e, b, L);
            b.prefix = "ffn.";
            ffn_block(e, b, L);
            continue;
        }
        b.prefix = "dn.";
        const RingSlot &cur = L.ring[slot], &rep = L.ring[rslot];
        const std::vector<const Matrix *> in_w = {&L.wqkv, &L.wgate, &L.wbeta, &L.walpha};
        b.phase({b.norm_prep(s.x, L.attn_norm, nullptr, in_w)}, "norm_prep");
        b.matvecs(in_w, {cur.qkv, s.z, cur.beta, cur.alpha}, false, "proj");
        const int C = d.ssm_conv_dim(), S = d.hp.ssm_d_state;
        Task c;
        c.kind = K_CONV_QK;
        c.in[0] = cur.qkv;
        c.in[1] = rep.qkv;
        c.w0 = L.conv1d;
        c.state = L.conv_state;
        c.out = cur.conv;
        c.C = C;
        c.ksize = d.hp.ssm_conv_kernel;
        c.S = S;
        c.key_dim = d.ssm_key_dim();
        c.Hk = d.hp.ssm_n_group;
        c.eps = d.hp.rms_eps;
        c.items = (C + THREADS - 1) / THREADS;
        b.phase({c}, "conv_qk");
        Task r;
        r.kind = K_RECUR;
        r.in[0] = cur.conv, r.in[1] = cur.beta, r.in[2] = cur.alpha;
        r.in[3] = rep.conv, r.in[4] = rep.beta, r.in[5] = rep.alpha;
        r.w0 = L.dt_bias;
        r.w1 = L.ssm_a;
        r.state = L.ssm_state;
        r.out = s.dn_out;
        r.C = C;
        r.S = S;
        r.key_dim = d.ssm_key_dim();
        r.Hk = d.hp.ssm_n_group;
        r.Hv = d.hp.ssm_dt_rank;
        r.items = (int64_t)r.Hv * (S / WARPS);
        b.phase({r}, "recurrence");
        Task g;
        g.kind = K_GATED_PREP;
        g.in[0] = s.dn_out;
        g.in[1] = s.z;
        g.w0 = L.ssm_norm;
        g.width = d.ssm_value_dim();
        g.S = S;
        g.eps = d.hp.rms_eps;
        g.items = g.width / QK_K;
        b.prep_for(g, {&L.wssm_out});
        b.phase({g}, "gated_prep");
        b.matvecs({&L.wssm_out}, {s.x}, true, "out");
        b.prefix = "ffn.";
        ffn_block(e, b, L);
    }
    b.prefix = "head.";
    head_block(e, b, e.output_norm, s.hidden + E, e.output.present() ? &e.output : &e.tok_embd, s.logits, s.argmax, nullptr,
               false);
}

// oj_cycle's phases after the verify's (issue 8): acceptance, the MTP block over one row per verified
// position (catch-up: MTP position pos0 + 1 + i from the main argmax i and the main hidden state of
// position pos0 + i; the rows up to the accepted k are the committed drafts' and the next token's,
// the rows past it are overwritten later and never read), draft 1 from row k, then n_draft - 1
// chained steps (one row each, h = the previous step's normed output). engine_mtp_eval's arithmetic.
void build_cycle(Engine &e, Builder &b, int n_draft, Cycle *cyc, float *h_chain) {
    const ModelDims &d = e.dims;
    Scratch &s = e.s;
    Mtp &m = e.mtp;
    const int E = d.hp.n_embd;
    const Persistent &P = *e.persistent;
    const bool restricted = P.draft_head.present();
    const Matrix *head = restricted ? &P.draft_head : m.head;
    const int32_t *ids = restricted ? s.draft_ids : nullptr;
    for (int j = 1; j <= n_draft; ++j) {
        b.seg = j == 1 ? 1 : 2;
        b.step = j - 1;
        b.nv = j == 1 ? b.n : 1;
        b.prefix = j == 1 ? "mtp." : "draft.";
        Task t;
        t.kind = K_EMBED;
        t.mat = *m.embed;
        t.tokens = j == 1 ? s.argmax : &cyc->drafts[j - 2];
        t.out = s.xn;
        t.width = E;
        t.items = (int64_t)b.nv * ((E + THREADS - 1) / THREADS);
        if (j == 1) {
            Task a;
            a.kind = K_ACCEPT;
            a.tokens = s.tokens;
            a.iout = s.argmax;
            a.items = 1;
            b.phase({a, t}, "accept_embed");
        } else {
            b.phase({t}, "embed");
        }
        // enorm(embedding) and hnorm(h) into the two halves of eh_proj's prepared x
        Task ne = b.norm_prep(s.xn, m.enorm, nullptr, {&m.eh_proj});
        Task nh = b.norm_prep(j == 1 ? s.hidden + E : h_chain, m.hnorm, nullptr, {&m.eh_proj});
        nh.rec_off = E / QK_K;
        b.phase({ne, nh}, "cat_prep");
        b.matvecs({&m.eh_proj}, {s.x}, false, "eh_proj");
        attention_block(e, b, m.block);
        ffn_block(e, b, m.block);
        if (j == 1) {
            head_block(e, b, m.head_norm, s.draft_hidden, head, s.draft_logits, s.draft_argmax, ids, restricted);
            Task k;
            k.kind = K_PICK;
            k.in[0] = s.draft_hidden;
            k.iout = s.draft_argmax;
            k.out = h_chain;
            k.width = E;
            k.items = 1;
            b.phase({k}, "pick");
        } else {
            head_block(e, b, m.head_norm, h_chain, head, s.draft_logits, &cyc->drafts[j - 1], ids, restricted);
        }
    }
    if (n_draft == 0) {   // acceptance alone
        b.seg = 0;
        b.prefix = "cycle.";
        Task a;
        a.kind = K_ACCEPT;
        a.tokens = s.tokens;
        a.iout = s.argmax;
        a.items = 1;
        b.phase({a}, "accept");
    }
}

// n_draft -1: oj_verify's forward; 0..: oj_cycle's with that many drafts
Persistent::Program &program_for(Engine &e, int n, int n_draft) {
    Persistent &P = *e.persistent;
    const auto key = std::make_tuple(n, e.slot, e.replay_slot, n_draft, n_draft > 0 ? P.draft_gen : 0);
    auto it = P.programs.find(key);
    if (it != P.programs.end()) return it->second;
    Builder b{e, n};
    build(e, b, e.slot, e.replay_slot);
    if (n_draft >= 0) build_cycle(e, b, n_draft, P.cyc, P.h_chain);
    // shared memory: the matvec rings of the types present, attention's per-warp rows and merge.
    // The rings take 2 stages; OJ_PERSISTENT_STAGES=3 takes 3 where they fit. Measured on the q27b
    // (f833631, scripts/persistent_profile.py): 3 stages made the FFN's matvecs ~10% slower (gate +
    // up 3.60 -> 3.99 ms per token, down 2.61 -> 2.87), as the multi-kernel harness had shown for
    // 8 warps x 3 stages on every group, so more bytes in flight per warp is not what they lack.
    size_t base = std::max((size_t)WARPS * (e.dims.hp.head_dim + 2) * 4 + 64, (size_t)THREADS * 8);
    auto rings = [&](int stages) {
        size_t m = base;
        for (const Task &t : b.tasks)
            if (t.kind == K_MATVEC) {
                const bool q4 = t.type == TYPE_Q4_K;
                m = std::max(m, stages == 3 ? (q4 ? mvf16::smem_bytes<TYPE_Q4_K, WARPS, 3>(n) : mvf16::smem_bytes<TYPE_Q6_K, WARPS, 3>(n))
                                            : (q4 ? mvf16::smem_bytes<TYPE_Q4_K, WARPS, 2>(n) : mvf16::smem_bytes<TYPE_Q6_K, WARPS, 2>(n)));
            }
        return m;
    };
    const int stages = P.stages == 3 && rings(3) <= (size_t)P.optin ? 3 : 2;
    const size_t smem = rings(stages);
    for (Task &t : b.tasks)
        if (t.kind == K_MATVEC) t.ksize = stages;
    // one allocation: the Args (64-byte aligned tensor maps), then the tasks, then the phases
    const size_t a_bytes = b.args.size() * sizeof(Args), t_bytes = b.tasks.size() * sizeof(Task);
    const size_t t_off = (a_bytes + 255) / 256 * 256, p_off = t_off + (t_bytes + 255) / 256 * 256;
    const size_t bytes = p_off + b.phases.size() * sizeof(Phase);
    uint8_t *dev = static_cast<uint8_t *>(e.alloc(bytes, e.memory.activations));
    const Args *dargs = reinterpret_cast<const Args *>(dev);
    for (size_t i = 0; i < b.tasks.size(); ++i)
        if (b.arg_of[i] >= 0) b.tasks[i].mv = dargs + b.arg_of[i];
    std::vector<uint8_t> host(bytes, 0);
    if (a_bytes) std::memcpy(host.data(), b.args.data(), a_bytes);
    std::memcpy(host.data() + t_off, b.tasks.data(), t_bytes);
    std::memcpy(host.data() + p_off, b.phases.data(), b.phases.size() * sizeof(Phase));
    // on the engine's stream: a plain cudaMemcpy from pageable memory returns once the bytes are
    // staged, and the legacy stream it runs on does not order the non-blocking engine stream, so the
    // first launch could read the program before it lands (seen: wrong results with 6 processes
    // sharing the GPU). The async copy stages the bytes before it returns and is stream-ordered.
    check_cuda(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, e.stream), "persistent kernel: program upload");
    Persistent::Program pr;
    pr.dev = dev;
    pr.tasks = reinterpret_cast<const Task *>(dev + t_off);
    pr.phases = reinterpret_cast<const Phase *>(dev + p_off);
    pr.n_phases = (int)b.phases.size();
    pr.labels = b.labels;
    pr.bytes = b.bytes;
    if (smem > (size_t)P.optin)
        fail(OJ_ERR_UNSUPPORTED, "persistent kernel: needs " + std::to_string(smem) + " bytes of shared memory per block, the GPU gives " +
                                     std::to_string(P.optin));
    // the attribute is the largest any program asks for (a later, smaller program must not lower it
    // under an earlier one's launches)
    P.smem_attr = std::max(P.smem_attr, smem);
    check_cuda(cudaFuncSetAttribute(persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)P.smem_attr),
               "persistent kernel: shared memory attribute");
    int per_sm = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, THREADS, smem),
               "persistent kernel: occupancy");
    if (per_sm < 1) fail(OJ_ERR_UNSUPPORTED, "persistent kernel: no block fits an SM");
    pr.smem = smem;
    pr.per_sm = per_sm;
    pr.grid = per_sm * P.n_sm;
    return P.programs.emplace(key, pr).first->second;
}

}  // namespace

namespace {

// One JSON line per launch: {"n", "drafts" (-1: a verify), "pos0", "grid", "phases": [[label, ns, weight bytes], ...]}
// (scripts/persistent_profile.py sums them per label).
void write_profile(Persistent &P, const Persistent::Program &pr, const Frame &f, int n_draft, cudaStream_t st) {
    check_cuda(cudaMemcpyAsync(P.prof_host, P.prof, (size_t)(pr.n_phases + 1) * 8, cudaMemcpyDeviceToHost, st),
               "persistent kernel: profile");
    check_cuda(cudaStreamSynchronize(st), "persistent kernel: profile");
    std::string line = "{\"n\": " + std::to_string(f.n) + ", \"drafts\": " + std::to_string(n_draft) + ", \"pos0\": " +
                       std::to_string(f.pos0) + ", \"grid\": " +
                       std::to_string(pr.grid) + ", \"phases\": [";
    for (int i = 0; i < pr.n_phases; ++i) {
        const unsigned long long ns = P.prof_host[i + 1] - P.prof_host[i];
        line += std::string(i ? ", " : "") + "[\"" + pr.labels[i] + "\", " + std::to_string(ns) + ", " +
                std::to_string((long long)pr.bytes[i]) + "]";
    }
    line += "]}\n";
    if (FILE *fp = std::fopen(P.prof_path.c_str(), "a")) {
        std::fputs(line.c_str(), fp);
        std::fclose(fp);
    }
}

}  // namespace

namespace {

// Why oj_cycle cannot run the MTP block in the launch ("" when it can).
std::string cycle_unfit_reason(const Engine &e) {
    if (!e.has_mtp) return "the model has no MTP block";
    const Mtp &m = e.mtp;
    const std::string p = "blk." + std::to_string(e.dims.hp.n_layer) + ".";
    const std::vector<std::pair<const Matrix *, std::string>> ms = {
        {&m.eh_proj, "nextn.eh_proj"}, {&m.block.wq, "attn_q"}, {&m.block.wk, "attn_k"}, {&m.block.wv, "attn_v"},
        {&m.block.wo, "attn_output"}, {&m.block.ffn_gate, "ffn_gate"}, {&m.block.ffn_up, "ffn_up"},
        {&m.block.ffn_down, "ffn_down"}, {m.head, "the draft head"}};
    for (auto &w : ms) {
        if (w.first->type != TYPE_Q4_K && w.first->type != TYPE_Q6_K)
            return "MTP tensor " + p + w.second + " is " + type_name(w.first->type) + "; the persistent kernel takes Q4_K and Q6_K";
        if (w.first->K % QK_K) return "MTP tensor " + p + w.second + " has K = " + std::to_string(w.first->K) + ", not a multiple of 256";
    }
    return "";
}

// The restricted draft head's rows ids[0..n) of `head`, gathered into rows 0..n of `out` (same type
// and K, out.M rows). Q4_K: rows of K / 256 blocks of 144 bytes; Q6_K: three planes (quant_blocks.cuh),
// each row-major.
__global__ void gather_rows_kernel(Matrix head, Matrix out, const int32_t *ids, int n) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const int64_t nb = head.K / QK_K, src = ids[r];
    auto copy = [&](size_t src_off, size_t dst_off, size_t row_bytes) {
        const uint8_t *a = head.data + src_off + (size_t)src * row_bytes;
        uint8_t *b = out.data + dst_off + (size_t)r * row_bytes;
        for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) b[i] = a[i];   // rare: bytes, any alignment
    };
    if (head.type == TYPE_Q4_K) {
        copy(0, 0, (size_t)nb * 144);
    } else {
        const Q6Planes ps = q6_K_planes(head.M, head.K), pd = q6_K_planes(out.M, out.K);
        copy(ps.q, pd.q, (size_t)nb * 192);
        copy(ps.sc, pd.sc, (size_t)nb * 16);
        copy(ps.d, pd.d, (size_t)nb * 2);
    }
}

}  // namespace

void persistent_init(Engine &e) {
    auto P = std::make_shared<Persistent>();
    const PersistentSettings st = persistent_settings();
    P->mode = st.mode;
    P->stages = st.stages;
    P->split_model = st.split_model;
    P->prefetch = st.prefetch;
    e.persistent = P;
    if (P->mode == 0) {
        P->why = "OJ_PERSISTENT is not set (the multi-kernel path is the default)";
        P->cycle_why = P->why;
        return;
    }
    P->why = unfit_reason(e);
    if (!P->why.empty()) {
        P->cycle_why = P->why;
        if (P->mode == 2) fail(OJ_ERR_UNSUPPORTED, "OJ_PERSISTENT=require: " + P->why);
        return;
    }
    P->cycle_why = cycle_unfit_reason(e);
    P->cycle_fits = P->cycle_why.empty();
    check_cuda(cudaDeviceGetAttribute(&P->n_sm, cudaDevAttrMultiProcessorCount, e.device), "persistent kernel: SM count");
    check_cuda(cudaDeviceGetAttribute(&P->optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, e.device), "persistent kernel: smem");
    int64_t K = e.dims.hp.n_embd;
    for (const Layer &L : e.layers) {
        K = std::max<int64_t>(K, L.ffn_down.K);
        if (L.recurrent) K = std::max<int64_t>(K, L.wssm_out.K);
        else K = std::max<int64_t>(K, L.wo.K);
    }
    if (P->cycle_fits) K = std::max<int64_t>({K, e.mtp.eh_proj.K, e.mtp.block.ffn_down.K, e.mtp.block.wo.K});
    for (uint8_t *&w : P->ws) {
        const size_t bytes = mvf16::workspace_bytes(K);
        w = static_cast<uint8_t *>(e.alloc(bytes, e.memory.activations));
        check_cuda(cudaMemsetAsync(w, 0, bytes, e.stream), "persistent kernel: workspace");
    }
    P->sync = static_cast<Sync *>(e.alloc(sizeof(Sync), e.memory.activations));
    check_cuda(cudaMemsetAsync(P->sync, 0, sizeof(Sync), e.stream), "persistent kernel: barrier");
    check_cuda(cudaMallocHost(&P->host_error, 2 * sizeof(int)), "persistent kernel: error word");
    P->cyc = static_cast<Cycle *>(e.alloc(sizeof(Cycle), e.memory.activations));
    check_cuda(cudaMemsetAsync(P->cyc, 0, sizeof(Cycle), e.stream), "persistent kernel: cycle");
    check_cuda(cudaMallocHost(&P->cyc_host, sizeof(Cycle)), "persistent kernel: cycle");
    P->h_chain = static_cast<float *>(e.alloc((size_t)e.dims.hp.n_embd * 4, e.memory.activations));
    if (!st.profile.empty()) {
        P->prof_path = st.profile;
        constexpr size_t STAMPS = 8192;
        P->prof = static_cast<unsigned long long *>(e.alloc(STAMPS * 8, e.memory.activations));
        check_cuda(cudaMallocHost(&P->prof_host, STAMPS * 8), "persistent kernel: profile");
    }
    cudaFuncAttributes fa{};
    check_cuda(cudaFuncGetAttributes(&fa, persistent_kernel), "persistent kernel: attributes");
    P->regs = fa.numRegs;
    P->active = true;
}

namespace {

// One launch of program (n, n_draft); waits for it and reports a timed-out barrier as an error.
void launch(Engine &e, int n, int n_draft) {
    Persistent &P = *e.persistent;
    Persistent::Program &pr = program_for(e, n, n_draft);
    Frame f;
    f.n = n;
    f.pos0 = e.n_past;
    f.n_replay = e.replay_n;
    f.n_splits = (e.n_past + n + ATTN_SPLIT - 1) / ATTN_SPLIT;
    f.prefetch = P.prefetch ? 1 : 0;
    f.n_ids = e.n_draft_ids;
    f.cyc = P.cyc;
    // the MTP rows reach position n_past + n + n_draft - 1 at most (oj_cycle checks it fits n_ctx)
    const int last = e.n_past + n + std::max(n_draft, 0);
    if ((last + ATTN_SPLIT - 1) / ATTN_SPLIT > e.s.max_splits) fail(OJ_ERR_CONTEXT_FULL, "attention: more splits than allocated");
    const Phase *phases = pr.phases;
    const Task *tasks = pr.tasks;
    int n_phases = pr.n_phases;
    Sync *sync = P.sync;
    unsigned long long *prof = P.prof;
    if (prof && pr.n_phases + 1 > 8192) prof = nullptr;
    void *params[] = {&phases, &n_phases, &tasks, &f, &sync, &prof};
    // The occupancy calculator's grid; a driver that co-schedules fewer blocks than it says
    // (cudaErrorCooperativeLaunchTooLarge, seen on the H200 machine) gets fewer: the items are
    // shared round-robin, so any grid >= 1 computes the same. The grid that launched is kept.
    for (;;) {
        const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void *>(persistent_kernel), dim3(pr.grid),
                                                            dim3(THREADS), params, pr.smem, e.stream);
        if (err == cudaSuccess) break;
        cudaGetLastError();   // not sticky: the next launch must not report it
        if (err != cudaErrorCooperativeLaunchTooLarge || pr.grid <= 1)
            check_cuda(err, ("persistent kernel: launch of " + std::to_string(pr.grid) + " blocks x " + std::to_string(THREADS) +
                             " threads, " + std::to_string(pr.smem) + " bytes of shared memory")
                                .c_str());
        pr.grid = pr.grid > P.n_sm ? P.n_sm : pr.grid - std::max(1, P.n_sm / 16);
        if (pr.grid < 1) pr.grid = 1;
    }
    if (pr.shape_grid != pr.grid) {   // written once per program (and grid), not per launch
        pr.shape = "active: " + std::to_string(pr.grid) + " blocks of " + std::to_string(THREADS) + " threads (" +
                   std::to_string(pr.per_sm) + " per SM by the occupancy calculator, " + std::to_string(P.n_sm) + " SMs), " +
                   std::to_string(pr.smem) + " bytes of shared memory, " + std::to_string(P.regs) + " registers, " +
                   std::to_string(pr.n_phases) + " phases at " + std::to_string(n) + " positions" +
                   (n_draft >= 0 ? " (a speculative cycle with " + std::to_string(n_draft) + " drafts)" : "");
        pr.shape_grid = pr.grid;
    }
    P.shape = &pr.shape;
    check_cuda(cudaMemcpyAsync(P.host_error, &P.sync->error, 2 * sizeof(int), cudaMemcpyDeviceToHost, e.stream),
               "persistent kernel: error word");
    if (n_draft >= 0)
        check_cuda(cudaMemcpyAsync(P.cyc_host, P.cyc, sizeof(Cycle), cudaMemcpyDeviceToHost, e.stream), "persistent kernel: cycle");
    check_cuda(cudaStreamSynchronize(e.stream), "persistent kernel");
    if (P.host_error[0]) {
        const int phase = P.host_error[1];
        // a left barrier leaves counters behind: start the next launch from zero
        check_cuda(cudaMemsetAsync(P.sync, 0, sizeof(Sync), e.stream), "persistent kernel: barrier reset");
        for (uint8_t *w : P.ws) check_cuda(cudaMemsetAsync(w, 0, mvf16::PART_OFF, e.stream), "persistent kernel: counters reset");
        fail(OJ_ERR_CUDA, "persistent kernel: a grid barrier timed out after phase " + std::to_string(phase) + " of " +
                              std::to_string(pr.n_phases) + " (blocks not co-resident, or a phase did not finish)");
    }
    if (prof) write_profile(P, pr, f, n_draft, e.stream);
}

}  // namespace

bool persistent_forward(Engine &e, int n) {
    if (!e.persistent || !e.persistent->active) return false;
    launch(e, n, -1);
    return true;
}

bool persistent_cycle_fits(const Engine &e, int n_draft) {
    return e.persistent && e.persistent->active && (n_draft == 0 || e.persistent->cycle_fits);
}

void persistent_cycle(Engine &e, int n, int n_draft, int &k, int32_t *argmax, int32_t *drafts) {
    launch(e, n, n_draft);
    const Cycle &c = *e.persistent->cyc_host;
    k = c.k;
    for (int i = 0; i < n; ++i) argmax[i] = c.argmax[i];
    for (int i = 0; i < n_draft; ++i) drafts[i] = c.drafts[i];
}

void persistent_draft_vocab(Engine &e, int n_ids) {
    if (!e.persistent || !e.persistent->active || !e.persistent->cycle_fits) return;
    Persistent &P = *e.persistent;
    if (n_ids == 0) {   // the whole vocabulary again: the programs of generation 0 take m.head
        P.draft_head = Matrix{};
        P.draft_gen = 0;
        return;
    }
    const Matrix &head = *e.mtp.head;
    if (!P.draft_head.present() || P.draft_head.M < n_ids) {
        // room for growth (the speculator adds the tokens it meets): whole 32-row tiles, 1/4 spare;
        // the programs of the old generation keep their memory (one per growth, a few hundred KB)
        const int64_t rows = std::min<int64_t>(head.M, ((int64_t)n_ids * 5 / 4 + 31) / 32 * 32);
        Matrix m = head;
        m.M = rows;
        const size_t bytes = device_layout_bytes(head.type, head.K, rows);
        m.data = static_cast<uint8_t *>(e.alloc(bytes, e.memory.weights));
        check_cuda(cudaMemsetAsync(m.data, 0, bytes, e.stream), "draft head");
        P.draft_head = m;
        P.draft_gen = P.draft_gen + 1 + (P.draft_gen == 0);   // never 0 (the whole vocabulary's)
    }
    gather_rows_kernel<<<n_ids, 256, 0, e.stream>>>(head, P.draft_head, e.s.draft_ids, n_ids);
    check_cuda(cudaGetLastError(), "draft head gather");
    check_cuda(cudaStreamSynchronize(e.stream), "draft head gather");
}

const char *persistent_why(const Engine &e) {
    if (!e.persistent) return "not initialised";
    return e.persistent->shape ? e.persistent->shape->c_str() : e.persistent->why.c_str();
}
bool persistent_active(const Engine &e) { return e.persistent && e.persistent->active; }

}  // namespace oj
