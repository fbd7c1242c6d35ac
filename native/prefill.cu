// prefill.cu: oj_prefill, the batched path for prompts and appended turns (issue 9).
//
// A prompt of n tokens goes through the model in passes of up to prefill_chunk positions; every
// kernel of a pass sees all of its positions at once:
//   - projections: gemm_f16.cuh (Q4_K / Q5_K / Q6_K / Q8_0 weights x P positions on the fp16
//     tensor cores; Q4_K and Q6_K on Hopper's wgmma, gemm_wgmma.cuh / gemm_wgmma_q6k.cuh, the
//     FFN's gate and up fused with SwiGLU, where the device and build allow,
//     OPENJET_PREFILL_GEMM=f16 keeping them on mma.sync; activations rounded to fp16 under one power-of-two scale per position, prepared
//     once per input for all the projections that read it) where it has a kernel, else gemm_prefill.cuh (the integer tensor cores, activations rounded to int8 per 32
//     values as llama.cpp's q8_1 does; OPENJET_PREFILL_GEMM=int8 forces it
//     everywhere); float weights and Q8_0 matrices whose K is not a multiple of 256 take matvec,
//     OJ_MAX_POSITIONS positions at a time;
//   - Gated DeltaNet: deltanet.cu's conv kernel over the pass, then the recurrence in chunks of 64
//     on the tensor cores (deltanet_chunked.cuh, the state advanced by every position and written
//     back once at the end of the pass); OPENJET_PREFILL_DELTANET=sequential runs the decode path's
//     recurrence kernel over the pass with `commit` set instead;
//   - attention: K/V of the pass appended first, then causal flash attention over the cache
//     (attention_prefill.cu); OPENJET_PREFILL_ATTN=decode runs the decode kernels instead,
//     OJ_MAX_POSITIONS queries at a time (the reference the flash kernel is checked against);
//   - the MTP block follows the main model over the same pass when its cache was in step on entry:
//     MTP position p from token p and the main model's final hidden state of p - 1.
// Only the last position's logits are computed (the decode cycle starts from them). The state
// left behind (K/V, conv and recurrent state, the hidden window, the MTP cache) is what evaluating
// the tokens one at a time leaves, up to the rounding of the projections' activations.
#include <algorithm>
#include <string>

#include "deltanet_chunked.cuh"
#include "engine.cuh"
#include "gemm_f16.cuh"
#include "gemm_wgmma.cuh"
#include "gemm_wgmma_q6k.cuh"
#include "gemm_prefill.cuh"

namespace oj {

namespace {

bool int8_gemm_fits(const Matrix &w) {
    const bool quant = w.type == TYPE_Q4_K || w.type == TYPE_Q5_K || w.type == TYPE_Q6_K || w.type == TYPE_Q8_0;
    return quant && w.K % gemm::KSTEP == 0;
}

// OPENJET_PREFILL_GEMM=int8: every quantised projection on the int8 GEMM (read once per process).
bool int8_gemm_only() {
    static const bool on = env_is("OPENJET_PREFILL_GEMM", "int8");
    return on;
}

// Q4_K and Q6_K on Hopper's wgmma (gemm_wgmma.cuh, gemm_wgmma_q6k.cuh: at 2,048 positions on the
// 27B shapes 526-578 and 316-371 TFLOP/s against gemm_f16's 226-231 and 97-168, the same
// arithmetic) where the device and the build allow it; OPENJET_PREFILL_GEMM=f16 keeps every type on
// gemm_f16's mma.sync (the reference the wgmma kernels were checked against). Asked for explicitly
// (OPENJET_PREFILL_GEMM=wgmma), a GPU or build without wgmma is an error, not a silent fallback.
bool wgmma_fits(const Matrix &w) {
    static const bool off = env_is("OPENJET_PREFILL_GEMM", "f16");
    static const bool asked = env_is("OPENJET_PREFILL_GEMM", "wgmma");
    const bool typed = w.type == TYPE_Q4_K || w.type == TYPE_Q6_K;
    if (off || !typed || w.K % QK_K != 0 || reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return false;
    if (gemmwg::wgmma_available()) return true;
    if (asked)
        fail(OJ_ERR_UNSUPPORTED, "OPENJET_PREFILL_GEMM=wgmma needs a cc 9.0 GPU (H100 / H200) and a build with sm_90a "
                                 "code (OPENJET_CUDA_ARCHS including 90)");
    return false;
}

// The FFN's gate and up, both Q4_K on wgmma, in one kernel whose epilogue applies SwiGLU
// (gemm_wgmma_q4k_swiglu: X loaded once for both, one launch instead of gate, up and the swiglu
// pass; bit-identical to them; 95 ms against 115 for the 27B's 65 uses at 2,048 positions).
bool fused_swiglu_fits(const Matrix &gate, const Matrix &up) {
    return gate.type == TYPE_Q4_K && up.type == TYPE_Q4_K && gate.K == up.K && gate.M == up.M && gemm_f16_supports(gate) &&
           gemm_f16_supports(up) && wgmma_fits(gate) && wgmma_fits(up);
}

// The input of one or more projections: P rows of K floats. The fp16 GEMM's prepared copy of it
// (gemmf16::prep_x into the workspace) serves every projection of that input in a row (the
// DeltaNet layer's qkv, gate, beta, alpha; attention's q, k, v; the FFN's gate and up).
struct Input {
    const float *x;
    int64_t K;
    int P;
    bool prepared = false;
};

// y[p][:] (+)= W x[p] for p < P: the fp16 GEMM where it has a kernel (activations rounded to
// fp16 under one power-of-two scale per position), else the int8 GEMM (int8 per 32 values), else
// matvec (float weights; Q8_0 with K % 256 != 0) OJ_MAX_POSITIONS positions at a time.
void project(Engine &e, const Matrix &w, Input &in, float *y, bool accumulate) {
    if (w.K != in.K) fail(OJ_ERR_INVALID_ARGUMENT, "prefill: a projection's K does not match its input");
    PrefillScratch &pf = e.pf;
    if (gemm_f16_supports(w) && !int8_gemm_only()) {
        if (!in.prepared) gemmf16::prep_x(in.x, in.K, in.P, pf.workspace, e.stream);
        in.prepared = true;
        if (wgmma_fits(w)) {
            if (w.type == TYPE_Q6_K)
                gemm_wgmma_q6k_run(w, pf.workspace, in.P, y, accumulate, e.stream);
            else
                gemmwg::run(w, pf.workspace, in.P, y, accumulate, e.stream);
        } else
            gemmf16::run(w, pf.workspace, in.P, y, accumulate, e.stream);
        return;
    }
    if (int8_gemm_fits(w)) {
        in.prepared = false;   // the int8 X overwrites the workspace
        gemm::gemm_prefill(w, in.x, in.P, y, accumulate, pf.workspace, pf.workspace_bytes, e.stream);
        return;
    }
    for (int i = 0; i < in.P; i += OJ_MAX_POSITIONS) {
        const int m = in.P - i < OJ_MAX_POSITIONS ? in.P - i : OJ_MAX_POSITIONS;
        matvec(w, in.x + (size_t)i * w.K, y + (size_t)i * w.M, m, accumulate, e.stream);
    }
}

void project(Engine &e, const Matrix &w, const float *x, float *y, int P, bool accumulate) {
    Input in{x, w.K, P};
    project(e, w, in, y, accumulate);
}

// OPENJET_PREFILL_ATTN=decode: the decode kernels (read once per process).
bool attention_by_decode_kernels() {
    static const bool on = env_is("OPENJET_PREFILL_ATTN", "decode");
    return on;
}

void attention_pass(Engine &e, Layer &L, int P, int pos0) {
    PrefillScratch &pf = e.pf;
    const ModelDims &d = e.dims;
    Input xn{pf.xn, e.dims.hp.n_embd, P};
    project(e, L.wq, xn, pf.qg, false);
    project(e, L.wk, xn, pf.k, false);
    project(e, L.wv, xn, pf.v, false);
    attention_prepare(d, L, pf.qg, pf.k, pf.v, pf.q_rot, P, pos0, e.n_ctx, e.stream);
    if (attention_by_decode_kernels())
        attention_by_decode(d, L, e.s, pf.q_rot, pf.qg, pf.attn_out, P, pos0, e.n_ctx, e.stream);
    else
        attention_prefill(d, L, pf.q_rot, pf.qg, pf.attn_out, P, pos0, e.n_ctx, e.stream, pf.attn_part,
                          pf.attn_part_bytes);
    project(e, L.wo, pf.attn_out, pf.x, P, true);
}

void deltanet_pass(Engine &e, Layer &L, int P) {
    PrefillScratch &pf = e.pf;
    Input xn{pf.xn, e.dims.hp.n_embd, P};
    project(e, L.wqkv, xn, pf.qkv, false);
    project(e, L.wgate, xn, pf.z, false);
    project(e, L.wbeta, xn, pf.beta, false);
    project(e, L.walpha, xn, pf.alpha, false);
    deltanet_prefill(e.dims, L, pf.qkv, pf.conv, pf.beta, pf.alpha, pf.z, pf.dn_out, P, pf.dn_coef, pf.dn_coef_bytes,
                     e.stream);
    project(e, L.wssm_out, pf.dn_out, pf.x, P, true);
}

void ffn_pass(Engine &e, Layer &L, int P) {
    PrefillScratch &pf = e.pf;
    const ModelDims &d = e.dims;
    rms_norm(pf.x, L.post_norm, pf.xn, P, d.hp.n_embd, d.hp.rms_eps, d.hp.n_embd, e.stream);
    Input xn{pf.xn, d.hp.n_embd, P};
    if (fused_swiglu_fits(L.ffn_gate, L.ffn_up)) {
        if (L.ffn_gate.K != xn.K) fail(OJ_ERR_INVALID_ARGUMENT, "prefill: ffn_gate's K does not match its input");
        gemmf16::prep_x(xn.x, xn.K, xn.P, pf.workspace, e.stream);
        gemm_wgmma_q4k_swiglu(L.ffn_gate, L.ffn_up, pf.workspace, P, pf.ffn_gate, e.stream);
    } else {
        project(e, L.ffn_gate, xn, pf.ffn_gate, false);
        project(e, L.ffn_up, xn, pf.ffn_up, false);
        swiglu(pf.ffn_gate, pf.ffn_up, (int64_t)P * d.hp.n_ff, e.stream);
    }
    project(e, L.ffn_down, pf.ffn_gate, pf.x, P, true);
}

// Layers [first, last) of a pass of P tokens (already in pf.tokens) at positions pos0..; the first
// layer embeds the tokens into pf.x, the model's last one writes the final hidden states. pf.hidden
// row 0 holds the main hidden state of pos0 - 1 on entry, rows 1..P those of the pass after the
// last layer. Between calls pf.x carries the pass (a piece in layers: oj_prefill_layers).
void main_layers(Engine &e, int P, int pos0, int first, int last) {
    PrefillScratch &pf = e.pf;
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    if (first == 0) embed_rows(e.tok_embd, pf.tokens, pf.x, P, e.stream);
    for (int il = first; il < last; ++il) {
        Layer &L = e.layers[il];
        rms_norm(pf.x, L.attn_norm, pf.xn, P, E, d.hp.rms_eps, E, e.stream);
        if (L.recurrent) deltanet_pass(e, L, P);
        else attention_pass(e, L, P, pos0);
        ffn_pass(e, L, P);
    }
    if (last == d.hp.n_layer) rms_norm(pf.x, e.output_norm, pf.hidden + E, P, E, d.hp.rms_eps, E, e.stream);
}

// The MTP block over the same pass: its cache gets positions pos0.. (engine_mtp_eval's math).
void mtp_pass(Engine &e, int P, int pos0) {
    PrefillScratch &pf = e.pf;
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Mtp &m = e.mtp;
    embed_rows(*m.embed, pf.tokens, pf.x, P, e.stream);
    rms_norm(pf.x, m.enorm, pf.cat, P, E, d.hp.rms_eps, 2 * E, e.stream);
    rms_norm(pf.hidden, m.hnorm, pf.cat + E, P, E, d.hp.rms_eps, 2 * E, e.stream);
    project(e, m.eh_proj, pf.cat, pf.x, P, false);
    rms_norm(pf.x, m.block.attn_norm, pf.xn, P, E, d.hp.rms_eps, E, e.stream);
    attention_pass(e, m.block, P, pos0);
    ffn_pass(e, m.block, P);
}

}  // namespace

void alloc_prefill(Engine &e, int chunk) {
    if (chunk == 0) return;
    if (chunk < 64 || chunk > OJ_MAX_PREFILL_CHUNK)
        fail(OJ_ERR_INVALID_ARGUMENT, "prefill_chunk is " + std::to_string(chunk) + "; allowed 0 (no oj_prefill) or 64.." +
                                          std::to_string(OJ_MAX_PREFILL_CHUNK));
    const ModelDims &d = e.dims;
    PrefillScratch &pf = e.pf;
    uint64_t &c = e.memory.prefill;
    const int64_t P = chunk, E = d.hp.n_embd;
    auto f = [&](int64_t count) { return static_cast<float *>(e.alloc(count * sizeof(float), c)); };
    pf.tokens = static_cast<int32_t *>(e.alloc(P * sizeof(int32_t), c));
    pf.x = f(P * E);
    pf.xn = f(P * E);
    pf.ffn_gate = f(2 * P * d.hp.n_ff);
    pf.ffn_up = pf.ffn_gate + P * d.hp.n_ff;
    pf.attn_part = pf.ffn_gate;
    pf.attn_part_bytes = (size_t)2 * P * d.hp.n_ff * sizeof(float);
    pf.z = f(P * d.ssm_value_dim());
    pf.dn_out = f(P * d.ssm_value_dim());
    pf.qkv = f(P * d.ssm_conv_dim());
    pf.conv = f(P * d.ssm_conv_dim());
    pf.beta = f(P * d.hp.ssm_dt_rank);
    pf.alpha = f(P * d.hp.ssm_dt_rank);
    pf.qg = f(P * 2 * d.q_dim());
    pf.k = f(P * d.kv_dim());
    pf.v = f(P * d.kv_dim());
    pf.q_rot = f(P * d.q_dim());
    pf.attn_out = f(P * d.q_dim());
    pf.cat = f(P * 2 * E);
    pf.hidden = f((P + 1) * E);
    // the int8 X of the widest input any projection of a pass takes
    const int64_t widest = std::max<int64_t>({E, 2 * E, d.hp.n_ff, d.ssm_value_dim(), d.q_dim()});
    pf.workspace_bytes = std::max(gemm::workspace_bytes(widest, P), gemm_f16_workspace_bytes(widest, P));
    pf.workspace = e.alloc(pf.workspace_bytes, c);
    // the chunked DeltaNet's per-chunk coefficients (unused under OPENJET_PREFILL_DELTANET=sequential)
    pf.dn_coef_bytes = deltanet_chunked_coef_bytes(d, chunk);
    pf.dn_coef = e.alloc(pf.dn_coef_bytes, c);
    pf.chunk = chunk;
}

namespace {

// The checks of oj_prefill and of a piece's first oj_prefill_layers (`what`): nothing has run yet.
void check_prefill(const Engine &e, const int32_t *tokens, int n, const char *what) {
    if (e.pf.chunk == 0)
        fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + " needs prefill buffers: create the engine with prefill_chunk > 0 (it was 0)");
    check_no_piece(e, -1, what);
    if (!tokens) fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": tokens is NULL");
    if (n < 1) fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + " of " + std::to_string(n) + " tokens; it takes 1 or more");
    const ModelDims &d = e.dims;
    for (int i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= d.hp.n_vocab)
            fail(OJ_ERR_INVALID_ARGUMENT, "token id " + std::to_string(tokens[i]) + " (prompt position " + std::to_string(i) +
                                              ") is outside the vocabulary [0, " + std::to_string(d.hp.n_vocab) + ")");
    if ((int64_t)e.n_past + n > e.n_ctx)
        fail(OJ_ERR_CONTEXT_FULL, std::to_string(e.n_past) + " + " + std::to_string(n) + " tokens exceed n_ctx " + std::to_string(e.n_ctx));
}

// Before the first pass: a pending verify counts as oj_commit(0), accepted positions still owed to
// the state go in, and pf.hidden row 0 = h of n_past - 1 (zeros at position 0). Returns whether
// the MTP block follows the prompt (its cache ends at n_past).
bool prefill_begin(Engine &e) {
    PrefillScratch &pf = e.pf;
    const int E = e.dims.hp.n_embd;
    e.uncommitted = 0;
    engine_flush(e);
    if (e.n_past == 0) check_cuda(cudaMemsetAsync(pf.hidden, 0, (size_t)E * 4, e.stream), "prefill hidden");
    else
        check_cuda(cudaMemcpyAsync(pf.hidden, e.s.hidden + (size_t)e.prev_row * E, (size_t)E * 4, cudaMemcpyDeviceToDevice,
                                   e.stream), "prefill hidden");
    return e.has_mtp && e.mtp_n_past == e.n_past;
}

// After the main model's last pass (last_P positions; the prompt began at `start`, n tokens): the
// MTP block's pass where it follows, then the hidden window as after a one-token oj_eval of the
// last position L (row 0 = h_{L-1}, row 1 = h_L) and L's logits and argmax.
void prefill_end(Engine &e, int start, int n, int last_P, bool mtp_follows) {
    PrefillScratch &pf = e.pf;
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    if (mtp_follows) mtp_pass(e, last_P, start + n - last_P);
    Scratch &s = e.s;
    check_cuda(cudaMemcpyAsync(s.hidden, pf.hidden + (size_t)(last_P - 1) * E, (size_t)2 * E * 4, cudaMemcpyDeviceToDevice,
                               e.stream), "hidden window");
    matvec(e.output.present() ? e.output : e.tok_embd, s.hidden + E, s.logits, 1, false, e.stream);
    argmax_rows(s.logits, s.argmax, 1, d.hp.n_vocab, s.rows, e.stream);
    check_cuda(cudaStreamSynchronize(e.stream), "prefill");
    e.n_past = start + n;
    e.last_start = e.n_past - 1;
    e.last_n = 1;
    e.result_rows = 1;
    e.prev_row = 1;
    e.replay_n = 0;
    e.uncommitted = 0;
    if (mtp_follows) {
        e.mtp_n_past = e.n_past;
        e.last_mtp_n = 0;   // no draft results: the next oj_mtp_eval makes them
    }
}

}  // namespace

void engine_prefill(Engine &e, const int32_t *tokens, int n) {
    check_prefill(e, tokens, n, "oj_prefill");
    PrefillScratch &pf = e.pf;
    const int E = e.dims.hp.n_embd;
    const bool mtp_follows = prefill_begin(e);
    const int start = e.n_past;
    int done = 0, last_P = 0;
    while (done < n) {
        const int P = n - done < pf.chunk ? n - done : pf.chunk;
        const int pos0 = start + done;
        check_cuda(cudaMemcpyAsync(pf.tokens, tokens + done, (size_t)P * sizeof(int32_t), cudaMemcpyHostToDevice, e.stream),
                   "copy tokens");
        main_layers(e, P, pos0, 0, e.dims.hp.n_layer);
        done += P;
        last_P = P;
        if (done < n) {
            if (mtp_follows) mtp_pass(e, P, pos0);
            // the next pass's row 0: h of its pos0 - 1
            check_cuda(cudaMemcpyAsync(pf.hidden, pf.hidden + (size_t)P * E, (size_t)E * 4, cudaMemcpyDeviceToDevice, e.stream),
                       "prefill hidden");
        }
    }
    prefill_end(e, start, n, last_P, mtp_follows);
}

void engine_prefill_layers(Engine &e, const int32_t *tokens, int n, int layers, int32_t *done) {
    PrefillScratch &pf = e.pf;
    const int n_layer = e.dims.hp.n_layer;
    if (layers < 1)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_prefill_layers: layers is " + std::to_string(layers) + "; it takes 1 or more");
    if (pf.piece_seq >= 0 && pf.piece_seq != e.cur_seq)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_prefill_layers: sequence " + std::to_string(pf.piece_seq) +
                                          "'s piece holds the prefill buffers (finish it with oj_prefill_layers on that "
                                          "sequence, or oj_reset it)");
    if (pf.piece_seq < 0) {
        check_prefill(e, tokens, n, "oj_prefill_layers");
        if (n > pf.chunk)
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_prefill_layers: a piece of " + std::to_string(n) +
                                              " tokens; at most prefill_chunk (" + std::to_string(pf.chunk) + ")");
    } else if (!tokens || n != (int)pf.piece_tokens.size() || !std::equal(tokens, tokens + n, pf.piece_tokens.begin())) {
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_prefill_layers: sequence " + std::to_string(e.cur_seq) + " has a piece of " +
                                          std::to_string(pf.piece_tokens.size()) + " tokens in flight at layer " +
                                          std::to_string(pf.piece_layers) + " of " + std::to_string(n_layer) +
                                          "; go on with the same tokens (or oj_reset the sequence)");
    }
    try {
        if (pf.piece_seq < 0) {
            pf.piece_mtp = prefill_begin(e);
            pf.piece_tokens.assign(tokens, tokens + n);
            pf.piece_pos0 = e.n_past;
            pf.piece_layers = 0;
            pf.piece_seq = e.cur_seq;
            check_cuda(cudaMemcpyAsync(pf.tokens, pf.piece_tokens.data(), (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                       e.stream), "copy tokens");
        }
        const int first = pf.piece_layers, last = std::min(n_layer, first + layers);
        main_layers(e, n, pf.piece_pos0, first, last);
        pf.piece_layers = last;
        if (last < n_layer) {
            check_cuda(cudaStreamSynchronize(e.stream), "oj_prefill_layers");
            *done = 0;
            return;
        }
        pf.piece_seq = -1;
        prefill_end(e, pf.piece_pos0, n, n, pf.piece_mtp);
        *done = 1;
    } catch (...) {
        // some layers of the sequence took the piece and others did not: its state is no
        // conversation's any more
        pf.piece_seq = -1;
        *done = -1;
        try {
            engine_reset(e);
        } catch (...) {
        }
        throw;
    }
}

void check_no_piece(const Engine &e, int seq, const char *what) {
    const PrefillScratch &pf = e.pf;
    if (pf.piece_seq < 0 || (seq >= 0 && seq != pf.piece_seq)) return;
    fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": sequence " + std::to_string(pf.piece_seq) +
                                      " has a prompt piece in flight (oj_prefill_layers, layer " +
                                      std::to_string(pf.piece_layers) + " of " + std::to_string(e.dims.hp.n_layer) +
                                      "): go on with it until it is done, or oj_reset that sequence");
}

}  // namespace oj
