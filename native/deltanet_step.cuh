// deltanet_step.cuh: one delta-rule step and one state row's recurrence, shared by deltanet.cu's
// kernels and tools/deltanet_chunked_bench.cu (its reference). The math: deltanet.cu's header.
#pragma once

#include <cstdint>

#include "openjet.h"
#include "reduce.cuh"
#include "tree.cuh"

namespace oj {
namespace {

// win[i] for a run-time i < N (unrolled selects: the window stays in registers).
template <int N>
__device__ __forceinline__ float pick(const float (&win)[N], int i) {
    float v = win[0];
#pragma unroll
    for (int q = 1; q < N; ++q) v = i == q ? win[q] : v;
    return v;
}

// One conv output: the window (oldest first) and the new input against the kernel's taps. Both
// the chain and the tree loops call it, so a tree node's output is bit for bit the chain's.
template <int KERNEL>
__device__ __forceinline__ float conv_tap(const float (&win)[KERNEL - 1], float in, const float (&wc)[KERNEL]) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KERNEL - 1; ++j) acc += win[j] * wc[j];
    acc += in * wc[KERNEL - 1];
    return silu(acc);
}

// Conv channel c (one thread): replays n_replay accepted inputs into the conv state (written back),
// then the n new positions' conv + SiLU outputs; `commit` (prefill) writes the state after them.
// parents != 0 (a draft tree, tree.cuh's word; never with commit): node t's window is the last
// KERNEL-1 inputs along its ancestors (parent first), the committed window filling the rest.
template <int KERNEL>
__device__ __forceinline__ void conv_channel(int c, const float *replay_in, int n_replay, const float *qkv, int n,
                                             const float *__restrict__ w, float *state, float *out, int C, bool commit,
                                             uint64_t parents = 0) {
    float win[KERNEL - 1], wc[KERNEL];
#pragma unroll
    for (int j = 0; j < KERNEL - 1; ++j) win[j] = state[(int64_t)c * (KERNEL - 1) + j];
    if (n_replay > 0) {
        for (int t = 0; t < n_replay; ++t) {
#pragma unroll
            for (int j = 0; j < KERNEL - 2; ++j) win[j] = win[j + 1];
            win[KERNEL - 2] = replay_in[(int64_t)t * C + c];
        }
#pragma unroll
        for (int j = 0; j < KERNEL - 1; ++j) state[(int64_t)c * (KERNEL - 1) + j] = win[j];
    }
#pragma unroll
    for (int j = 0; j < KERNEL; ++j) wc[j] = w[(int64_t)c * KERNEL + j];
    if (parents != 0) {
        for (int t = 0; t < n; ++t) {
            float tw[KERNEL - 1];
            int a = tree_parent(parents, t), used = 0;   // ancestors taken so far
#pragma unroll
            for (int j = KERNEL - 2; j >= 0; --j) {
                if (a >= 0) {
                    tw[j] = qkv[(int64_t)a * C + c];
                    a = tree_parent(parents, a);
                    ++used;
                } else {
                    tw[j] = pick<KERNEL - 1>(win, j + used);   // the committed inputs before the root
                }
            }
            out[(int64_t)t * C + c] = conv_tap<KERNEL>(tw, qkv[(int64_t)t * C + c], wc);
        }
        return;
    }
#pragma unroll 4   // a prefill pass loops over thousands of positions: keep loads in flight
    for (int t = 0; t < n; ++t) {
        const float in = qkv[(int64_t)t * C + c];
        out[(int64_t)t * C + c] = conv_tap<KERNEL>(win, in, wc);
#pragma unroll
        for (int j = 0; j < KERNEL - 2; ++j) win[j] = win[j + 1];
        win[KERNEL - 2] = in;
    }
    if (commit) {   // prefill: the new positions are final
#pragma unroll
        for (int j = 0; j < KERNEL - 1; ++j) state[(int64_t)c * (KERNEL - 1) + j] = win[j];
    }
}

// What one delta-rule step of state row j reads from position t: this lane's R key and query
// values, v_j, raw beta and alpha. Loaded one position ahead of the arithmetic (the loads do not
// depend on the state), so that a prefill pass's thousands of sequential steps do not each wait
// for their loads.
template <int R>
struct StepIn {
    float k[R], q[R];
    float v, beta_raw, alpha_raw;
};

template <int R>
__device__ __forceinline__ void load_step(StepIn<R> &in, const float *base, const float *beta,
                                          const float *alpha, int kh, int h, int j, int lane, int key_dim,
                                          bool want_q) {
    constexpr int S = R * 32;
    const float *q = base + kh * S;
    const float *k = base + key_dim + kh * S;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        in.k[r] = k[r * 32 + lane];
        in.q[r] = want_q ? q[r * 32 + lane] : 0.0f;
    }
    in.v = base[2 * key_dim + h * S + j];
    in.beta_raw = *beta;
    in.alpha_raw = *alpha;
}

// One delta-rule step of state row j (this lane's R values).
template <int R>
__device__ __forceinline__ float delta_step(float (&s)[R], const StepIn<R> &in, float bias, float a, bool want_out) {
    const float beta = sigmoid(in.beta_raw);
    const float x = in.alpha_raw + bias;
    const float softplus = x > 20.0f ? x : log1pf(expf(x));
    const float decay = expf(softplus * a);
    float kv = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) kv += s[r] * in.k[r];
    kv = warp_sum(kv);
    const float delta = (in.v - decay * kv) * beta;
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = decay * s[r] + in.k[r] * delta;
    if (!want_out) return 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) o += s[r] * in.q[r];
    return warp_sum(o);
}

// State row j of value head h, one warp (lane = its lane): replays the accepted positions of the
// previous evaluation into the state (written back), then runs this evaluation's positions for their
// outputs only (deltanet_recurrence_kernel, deltanet.cu). parents != 0 (a draft tree of n <=
// OJ_MAX_TREE_NODES nodes, tree.cuh's word; never with commit): node t steps from its parent's
// state, every node's row held in registers (nodes in topological order: parent < t).
template <int S>
__device__ __forceinline__ void recurrence_row(int h, int j, int lane, const float *replay_conv,
                                               const float *replay_beta, const float *replay_alpha,
                                               int n_replay, const float *conv_out,
                                               const float *beta_raw, const float *alpha_raw, int n,
                                               const float *__restrict__ dt_bias, const float *__restrict__ ssm_a,
                                               float *state, float *out, int C, int key_dim,
                                               int n_key_heads, int n_v_heads, bool commit, uint64_t parents = 0) {
    constexpr int R = S / 32;
    const int kh = h % n_key_heads;
    float *row = state + ((int64_t)h * S + j) * S;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = row[r * 32 + lane];
    const float bias = dt_bias[h], a = ssm_a[h];
    StepIn<R> cur, nxt;
    if (n_replay > 0) {
        load_step<R>(cur, replay_conv, replay_beta + h, replay_alpha + h, kh, h, j, lane, key_dim, false);
        for (int t = 0; t < n_replay; ++t) {
            if (t + 1 < n_replay)
                load_step<R>(nxt, replay_conv + (int64_t)(t + 1) * C, replay_beta + (t + 1) * n_v_heads + h,
                             replay_alpha + (t + 1) * n_v_heads + h, kh, h, j, lane, key_dim, false);
            delta_step<R>(s, cur, bias, a, false);
            cur = nxt;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) row[r * 32 + lane] = s[r];
    }
    if (parents != 0) {
        float node[OJ_MAX_TREE_NODES][R];   // the row after each node
#pragma unroll
        for (int t = 0; t < OJ_MAX_TREE_NODES; ++t) {
            if (t >= n) continue;   // (not break: the loop must unroll so that node[] stays in registers)
            const int p = tree_parent(parents, t);   // warp-uniform
            float x[R];
#pragma unroll
            for (int r = 0; r < R; ++r) x[r] = s[r];
#pragma unroll
            for (int q = 0; q < t; ++q)
                if (p == q) {
#pragma unroll
                    for (int r = 0; r < R; ++r) x[r] = node[q][r];
                }
            load_step<R>(cur, conv_out + (int64_t)t * C, beta_raw + t * n_v_heads + h, alpha_raw + t * n_v_heads + h, kh,
                         h, j, lane, key_dim, true);
            const float o = delta_step<R>(x, cur, bias, a, true);
            if (lane == 0) out[(int64_t)t * n_v_heads * S + h * S + j] = o;
#pragma unroll
            for (int r = 0; r < R; ++r) node[t][r] = x[r];
        }
        return;
    }
    if (n > 0) load_step<R>(cur, conv_out, beta_raw + h, alpha_raw + h, kh, h, j, lane, key_dim, true);
    for (int t = 0; t < n; ++t) {
        if (t + 1 < n)
            load_step<R>(nxt, conv_out + (int64_t)(t + 1) * C, beta_raw + (t + 1) * n_v_heads + h,
                         alpha_raw + (t + 1) * n_v_heads + h, kh, h, j, lane, key_dim, true);
        const float o = delta_step<R>(s, cur, bias, a, true);
        if (lane == 0) out[(int64_t)t * n_v_heads * S + h * S + j] = o;
        cur = nxt;
    }
    if (commit && n > 0) {   // prefill: the new positions are final
#pragma unroll
        for (int r = 0; r < R; ++r) row[r * 32 + lane] = s[r];
    }
}


}  // namespace
}  // namespace oj
