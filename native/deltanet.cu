// deltanet.cu: the Gated DeltaNet mixer of one layer for 1..8 positions (llama.cpp's
// build_layer_attn_linear between the input projections and ssm_out).
//
// Order of the cycle, each a kernel below:
//   1. causal depthwise conv over [conv state | new qkv rows], SiLU; the conv state keeps the last
//      kernel-1 inputs ([conv_dim][kernel-1], oldest first, as ggml's conv_states);
//   2. L2 norm of every q and k head (x / sqrt(sum x^2 + eps)), q also times 1/sqrt(d_state): in
//      the conv kernel's q / k head blocks for decode-sized passes, a kernel of its own for prompts;
//   3. the delta rule per value head h (key head h % n_key_heads, ggml's tiled order):
//        decay = exp(softplus(alpha + dt_bias) * ssm_a), beta = sigmoid(beta_raw)
//        S = decay * S;  S += outer((v - S k) * beta, k);  o = S q
//      with S stored [h][value j][key i], one warp per row j;
//   4. RMSNorm of o per head times ssm_norm, times SiLU(z).
// The numpy twin is ReferenceModel._deltanet (openjet_plugin/testing/reference.py).
//
// Commit by replay (issue 6). Every evaluation is provisional: the conv and recurrence kernels
// read the committed state, run the new positions for their outputs and write NOTHING back. The
// per-position intermediates they need to advance the state (raw conv inputs; normed k, v; raw
// beta and alpha) stay in the layer's ring slot of that evaluation. oj_commit(a) only records
// "the first a positions of slot s are accepted"; the next evaluation (or a flush) first replays
// those a positions from slot s into the state, writes the state back, then runs its own
// positions from the other slot. Invariant: conv_state/ssm_state == the state after position
// n_past - 1 - replay_n, and slot replay_slot rows [0, replay_n) are exactly the intermediates of
// positions n_past - replay_n .. n_past - 1. The replay repeats the forward arithmetic exactly,
// so the committed state is bit-identical to stepping the accepted tokens one at a time.
//
// Draft trees (oj_verify_tree; the packed parents of tree.cuh, 0 for a chain): the kernels' TREE
// instances run node t's conv over the last kernel-1 inputs along its ancestors (the committed
// window filling the rest) and its recurrence from its parent's row, every node's row held in
// registers (n <= 8, nodes in topological order). Nothing is written back either. oj_commit_path
// moves the path's intermediates to rows 0..k-1 of the slot (compact_rows), after which the replay
// above commits them as it commits a chain's, bit-identical to stepping the path one at a time.
// The chain instances are the code as it was (the tree word is a constant 0 there).
//
// Sequences (oj_eval_seqs): one position each of up to 8 sequences, each sequence's state at its
// own offset (Layer::conv_base / ssm_base + seq * per-sequence floats). The *_seqs kernels run the
// chain code for one position with `commit` set, the state advanced in the pass: the arithmetic of a
// one-position evaluation plus its replay, so the state and outputs are bit for bit a one-sequence
// engine's.
//
// Prefill (deltanet_prefill) runs the same kernels over a whole pass (up to prefill_chunk
// positions, the recurrence looping over them with the state in registers) with `commit` set:
// the state after the last position is written back at the end, nothing is kept for a replay.

#include "deltanet_chunked.cuh"
#include "deltanet_step.cuh"
#include "pdl.cuh"
#include "engine.cuh"
#include "reduce.cuh"

namespace oj {

namespace {

// The L2 norm of one value of a q or k head (x / sqrt(sum x^2 + eps), q also times 1/sqrt(d_state))
// by a block of the head's S threads, thread i holding value i: deltanet_qk_norm_kernel's
// arithmetic, which the conv kernels below run in the same block_sum over the same S threads.
__device__ __forceinline__ void qk_norm_value(float *p, bool is_q, float eps, float q_scale) {
    const float v = *p;
    const float ss = block_sum(v * v);
    float y = v / sqrtf(ss + eps);
    if (is_q) y *= q_scale;
    *p = y;
}

// Block b of S threads (d_state) holds conv channels b S .. b S + S - 1, i.e. head b of the conv
// output (the q heads, then k, then v). norm_heads = 2 n_key_heads: the q / k head blocks also
// L2-norm their outputs for positions 0..n-1 (a block_sum a position, so only for decode-sized n;
// a prompt's pass takes deltanet_qk_norm_kernel, a block per position and head, with the same bits).
// TREE: the positions are a draft tree (`parents`, tree.cuh's word); the chain instance is the
// code it was before trees (parents is a constant 0 there).
template <int KERNEL, bool TREE>
__global__ void deltanet_conv_kernel(const float *__restrict__ replay_in, int n_replay,
                                     const float *__restrict__ qkv, int n, const float *__restrict__ w,
                                     float *__restrict__ state, float *__restrict__ out, int C, bool commit,
                                     uint64_t parents, int norm_heads, int n_key_heads, float eps, float q_scale,
                                     const PassArgs *dyn) {
    pdl_launch_dependents();
    pdl_wait();
    if (dyn) {
        n_replay = dyn->n_replay;
        parents = dyn->tree;
    }
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < C) conv_channel<KERNEL>(c, replay_in, n_replay, qkv, n, w, state, out, C, commit, TREE ? parents : 0);
    if ((int)blockIdx.x < norm_heads)   // the whole block (C is a multiple of S)
        for (int t = 0; t < n; ++t) qk_norm_value(out + (int64_t)t * C + c, (int)blockIdx.x < n_key_heads, eps, q_scale);
}

// oj_eval_seqs: grid (C / S, n), block S; position t is the next input of sequence sb.seq[t], its
// conv state at state0 + sb.seq[t] * seq_floats, advanced by it (one committed step of the chain
// code: the same arithmetic as a one-position evaluation and its replay); the q / k head blocks
// L2-norm their output as deltanet_conv_kernel does.
template <int KERNEL>
__global__ void deltanet_conv_seqs_kernel(const float *__restrict__ qkv, const float *__restrict__ w, float *state0,
                                          size_t seq_floats, float *__restrict__ out, int C, SeqBatch sb,
                                          int n_key_heads, float eps, float q_scale) {
    pdl_launch_dependents();
    pdl_wait();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    conv_channel<KERNEL>(c, nullptr, 0, qkv + (int64_t)t * C, 1, w, state0 + seq_floats * sb.seq[t],
                         out + (int64_t)t * C, C, true);
    if ((int)blockIdx.x < 2 * n_key_heads)
        qk_norm_value(out + (int64_t)t * C + c, (int)blockIdx.x < n_key_heads, eps, q_scale);
}

// grid (n, 2 * n_key_heads), block d_state: q heads first, then k heads, in the conv output (a
// prompt's pass; decode-sized passes norm in the conv kernel).
__global__ void deltanet_qk_norm_kernel(float *__restrict__ conv_out, int C, int n_key_heads,
                                        float eps, float q_scale) {
    pdl_launch_dependents();
    pdl_wait();
    const int t = blockIdx.x, hh = blockIdx.y, S = blockDim.x;
    qk_norm_value(conv_out + (int64_t)t * C + (int64_t)hh * S + threadIdx.x, hh < n_key_heads, eps, q_scale);
}

// grid (n_v_heads, S / 4), block 128: warp w owns state row j = blockIdx.y * 4 + w (recurrence_row).
template <int S, bool TREE>
__global__ void __launch_bounds__(128)
deltanet_recurrence_kernel(const float *__restrict__ replay_conv, const float *__restrict__ replay_beta,
                           const float *__restrict__ replay_alpha, int n_replay,
                           const float *__restrict__ conv_out, const float *__restrict__ beta_raw,
                           const float *__restrict__ alpha_raw, int n,
                           const float *__restrict__ dt_bias, const float *__restrict__ ssm_a,
                           float *__restrict__ state, float *__restrict__ out, int C, int key_dim,
                           int n_key_heads, int n_v_heads, bool commit, uint64_t parents, const PassArgs *dyn) {
    pdl_launch_dependents();
    pdl_wait();
    if (dyn) {
        n_replay = dyn->n_replay;
        parents = dyn->tree;
    }
    recurrence_row<S>(blockIdx.x, blockIdx.y * 4 + (threadIdx.x >> 5), threadIdx.x & 31, replay_conv, replay_beta,
                      replay_alpha, n_replay, conv_out, beta_raw, alpha_raw, n, dt_bias, ssm_a, state, out, C, key_dim,
                      n_key_heads, n_v_heads, commit, TREE ? parents : 0);
}

// oj_eval_seqs: grid (n_v_heads, S / 4, n), block 128; position t steps sequence sb.seq[t]'s state
// (state0 + sb.seq[t] * seq_floats) once and writes it back, as recurrence_row's committed chain code.
template <int S>
__global__ void __launch_bounds__(128)
deltanet_recurrence_seqs_kernel(const float *__restrict__ conv_out, const float *__restrict__ beta_raw,
                                const float *__restrict__ alpha_raw, const float *__restrict__ dt_bias,
                                const float *__restrict__ ssm_a, float *state0, size_t seq_floats,
                                float *__restrict__ out, int C, int key_dim, int n_key_heads, int n_v_heads, SeqBatch sb) {
    pdl_launch_dependents();
    pdl_wait();
    const int t = blockIdx.z;
    recurrence_row<S>(blockIdx.x, blockIdx.y * 4 + (threadIdx.x >> 5), threadIdx.x & 31, nullptr, nullptr, nullptr, 0,
                      conv_out + (int64_t)t * C, beta_raw + (int64_t)t * n_v_heads, alpha_raw + (int64_t)t * n_v_heads, 1,
                      dt_bias, ssm_a, state0 + seq_floats * sb.seq[t], out + (int64_t)t * n_v_heads * S, C, key_dim,
                      n_key_heads, n_v_heads, true);
}

// grid (n, n_v_heads), block d_state: o = rms_norm(o) * ssm_norm * silu(z), in place.
__global__ void deltanet_gated_norm_kernel(float *__restrict__ o, const float *__restrict__ z,
                                           const float *__restrict__ w, float eps) {
    pdl_launch_dependents();
    pdl_wait();
    const int S = blockDim.x, i = threadIdx.x;
    const int64_t off = ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * S + i;
    const float v = o[off];
    const float ss = block_sum(v * v);
    o[off] = v / sqrtf(ss / S + eps) * w[i] * silu(z[off]);
}

// Conv and recurrence for n_replay positions of ring slot `replay` and n new ones of slot `cur`
// (parents != 0: the n new ones are a draft tree, tree.cuh's word).
void conv_and_recurrence(const ModelDims &d, Layer &L, const RingSlot &replay, int n_replay,
                         const RingSlot &cur, int n, float *dn_out, bool commit, cudaStream_t st,
                         bool recurrence = true, uint64_t parents = 0, const PassArgs *dyn = nullptr) {
    const int C = d.ssm_conv_dim(), S = d.hp.ssm_d_state, Hk = d.hp.ssm_n_group, Hv = d.hp.ssm_dt_rank;
    const int key_dim = d.ssm_key_dim();
    const int threads = S, blocks = C / S;   // a block per head of the conv output
    const bool tree = parents != 0;
    // decode-sized passes norm q and k in the conv kernel (one launch fewer a layer); a prompt's in
    // a kernel of its own (a block per position and head), with the same bits
    const bool fused_norm = n <= OJ_MAX_POSITIONS;
    const float q_scale = 1.0f / sqrtf((float)S);
    if (tree && (commit || n > OJ_MAX_TREE_NODES)) fail(OJ_ERR_INVALID_ARGUMENT, "a draft tree is never committed in the pass");
    cudaError_t e = cudaSuccess;
#define OJ_CONV(K)                                                                                                  \
    e = launch(tree ? deltanet_conv_kernel<K, true> : deltanet_conv_kernel<K, false>, blocks, threads, 0, st, replay.qkv, \
               n_replay, cur.qkv, n, L.conv1d, L.conv_state, cur.conv, C, commit, parents, fused_norm ? 2 * Hk : 0, Hk, \
               d.hp.rms_eps, q_scale, dyn)
    switch (d.hp.ssm_conv_kernel) {
        case 2: OJ_CONV(2); break;
        case 3: OJ_CONV(3); break;
        case 4: OJ_CONV(4); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.conv_kernel must be 2, 3 or 4");
    }
#undef OJ_CONV
    check_cuda(e, "deltanet_conv");
    if (n > 0 && !fused_norm)
        check_cuda(launch(deltanet_qk_norm_kernel, dim3(n, 2 * Hk), S, 0, st, cur.conv, C, Hk, d.hp.rms_eps, q_scale),
                   "deltanet_qk_norm");
    if (!recurrence) return;
    const dim3 grid(Hv, S / 4);
#define OJ_RECURRENCE(SS)                                                                                         \
    e = launch(tree ? deltanet_recurrence_kernel<SS, true> : deltanet_recurrence_kernel<SS, false>, grid, 128, 0, st,  \
               replay.conv, replay.beta, replay.alpha, n_replay, cur.conv, cur.beta, cur.alpha, n, L.dt_bias, L.ssm_a,  \
               L.ssm_state, dn_out, C, key_dim, Hk, Hv, commit, parents, dyn)
    switch (S) {
        case 32: OJ_RECURRENCE(32); break;
        case 64: OJ_RECURRENCE(64); break;
        case 128: OJ_RECURRENCE(128); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.state_size must be 32, 64 or 128");
    }
#undef OJ_RECURRENCE
    check_cuda(e, "deltanet_recurrence");
}

}  // namespace

void deltanet_mix(const ModelDims &d, Layer &L, Scratch &s, int n, int slot, int replay_slot, int n_replay,
                  cudaStream_t st, uint64_t parents, const PassArgs *dyn) {
    conv_and_recurrence(d, L, L.ring[replay_slot], n_replay, L.ring[slot], n, s.dn_out, false, st, true, parents, dyn);
}

void deltanet_mix_seqs(const ModelDims &d, Layer &L, Scratch &s, int n, const RingSlot &cur, const SeqBatch &b,
                       cudaStream_t st) {
    const int C = d.ssm_conv_dim(), S = d.hp.ssm_d_state, Hk = d.hp.ssm_n_group, Hv = d.hp.ssm_dt_rank;
    const dim3 conv_grid(C / S, n);   // a block per head of the conv output and position
    const float q_scale = 1.0f / sqrtf((float)S);
    cudaError_t e = cudaSuccess;
#define OJ_CONV_SEQS(K)                                                                                     \
    e = launch(deltanet_conv_seqs_kernel<K>, conv_grid, S, 0, st, cur.qkv, L.conv1d, L.conv_base, L.conv_floats, \
               cur.conv, C, b, Hk, d.hp.rms_eps, q_scale)
    switch (d.hp.ssm_conv_kernel) {
        case 2: OJ_CONV_SEQS(2); break;
        case 3: OJ_CONV_SEQS(3); break;
        case 4: OJ_CONV_SEQS(4); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.conv_kernel must be 2, 3 or 4");
    }
#undef OJ_CONV_SEQS
    check_cuda(e, "deltanet_conv_seqs");
    const dim3 grid(Hv, S / 4, n);
#define OJ_RECURRENCE_SEQS(SS)                                                                                      \
    e = launch(deltanet_recurrence_seqs_kernel<SS>, grid, 128, 0, st, cur.conv, cur.beta, cur.alpha, L.dt_bias, L.ssm_a, \
               L.ssm_base, L.ssm_floats, s.dn_out, C, d.ssm_key_dim(), Hk, Hv, b)
    switch (S) {
        case 32: OJ_RECURRENCE_SEQS(32); break;
        case 64: OJ_RECURRENCE_SEQS(64); break;
        case 128: OJ_RECURRENCE_SEQS(128); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.state_size must be 32, 64 or 128");
    }
#undef OJ_RECURRENCE_SEQS
    check_cuda(e, "deltanet_recurrence_seqs");
}

void deltanet_gated_norm(float *o, const float *z, const float *w, int n, int n_heads, int S, float eps, cudaStream_t st) {
    check_cuda(launch(deltanet_gated_norm_kernel, dim3(n, n_heads), S, 0, st, o, z, w, eps), "deltanet_gated_norm");
}

// The chunked recurrence (deltanet_chunked.cuh) is the default since its first GPU run (7.2x the
// sequential kernel at 2,048 positions on the 27B shapes, state within 4.7e-4); shapes it has no
// kernel for, and OPENJET_PREFILL_DELTANET=sequential (read once per process), take the sequential one.
bool chunked_prefill(const ModelDims &d) {
    static const bool sequential = env_is("OPENJET_PREFILL_DELTANET", "sequential");
    const int ds = d.hp.ssm_d_state;
    return !sequential && (ds == 32 || ds == 64 || ds == 128) && d.hp.ssm_n_group > 0 &&
           d.hp.ssm_dt_rank % d.hp.ssm_n_group == 0;
}

void deltanet_prefill(const ModelDims &d, Layer &L, const float *qkv, float *conv, const float *beta,
                      const float *alpha, const float *z, float *out, int n, void *coef, size_t coef_bytes,
                      cudaStream_t st) {
    RingSlot cur;   // the prefill buffers in the shape of a ring slot; nothing to replay
    cur.qkv = const_cast<float *>(qkv);
    cur.conv = conv;
    cur.beta = const_cast<float *>(beta);
    cur.alpha = const_cast<float *>(alpha);
    const bool chunked = chunked_prefill(d);
    conv_and_recurrence(d, L, cur, 0, cur, n, out, true, st, !chunked);
    if (chunked) deltanet_chunked(d, L, conv, beta, alpha, out, n, coef, coef_bytes, st);
    deltanet_gated_norm_kernel<<<dim3(n, d.hp.ssm_dt_rank), d.hp.ssm_d_state, 0, st>>>(out, z, L.ssm_norm, d.hp.rms_eps);
    check_launch("deltanet_gated_norm");
}

void deltanet_replay(const ModelDims &d, Layer &L, int replay_slot, int n_replay, cudaStream_t st) {
    if (n_replay > 0) conv_and_recurrence(d, L, L.ring[replay_slot], n_replay, L.ring[replay_slot], 0, nullptr, false, st);
}

}  // namespace oj
