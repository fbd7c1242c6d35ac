// engine.cuh: the engine's internal types and the launchers each kernel file provides.
// Internal code reports failures by throwing oj::Error; only api.cu's entry points catch, so no
// exception ever crosses the C boundary.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "model_dims.h"
#include "openjet.h"
#include "quant_blocks.cuh"
#include "tree.cuh"

namespace oj {

struct Error {
    int code;
    std::string message;
};

[[noreturn]] void fail(int code, const std::string &message);
// Turns a CUDA error into an Error (out of memory -> OJ_ERR_OUT_OF_MEMORY) naming `what`.
void check_cuda(cudaError_t err, const char *what);
// True when the environment variable `name` is set to `value`. The engine's switches
// (OPENJET_PREFILL_*) read it once per process: `static const bool on = env_is(...)`.
inline bool env_is(const char *name, const char *value) {
    const char *v = std::getenv(name);
    return v && std::strcmp(v, value) == 0;
}
// After a kernel launch: a launch error becomes an Error naming the kernel.
inline void check_launch(const char *kernel) { check_cuda(cudaGetLastError(), kernel); }

// A weight matrix on the device, in the layout of quant_blocks.cuh. K = ne[0] (inputs), M = ne[1].
struct Matrix {
    int type = -1;
    int64_t K = 0;
    int64_t M = 0;
    uint8_t *data = nullptr;
    bool present() const { return data != nullptr; }
};

// A draft-tree node's candidates as row_top leaves them: one copy back a node (oj_draft_tree).
struct TreeTop {
    int32_t id[OJ_TREE_MAX_CHILDREN];   // token ids, best first; -1 past the row's finite values
    float val[OJ_TREE_MAX_CHILDREN];    // their logits
    float max, sum;                     // the row's max and sum of exp(x - max) over its finite values
};

// oj_cycle_sampled (sample.cu): a row's top_k candidates as sample_top leaves them, and the
// distribution a draw was made from (the candidates left by top-p / min-p, with their
// probabilities), kept on the device for the next call's acceptance of that draft.
struct SampleTop {
    int32_t id[OJ_SAMPLE_TOP_MAX];      // token ids, (logit descending, id ascending)
    float val[OJ_SAMPLE_TOP_MAX];       // their logits
    int32_t n;                          // min(top_k, the row's finite values)
};
struct SampleDist {
    int32_t id[OJ_SAMPLE_TOP_MAX];
    double prob[OJ_SAMPLE_TOP_MAX];
    int32_t n;
};

// Row reductions over a vocabulary (argmax_rows, sample_top) run ROW_CHUNK values of a row a block,
// so that a row's 1 MB is read by tens of SMs, not one: each block leaves its partial result here
// and the last of a row's blocks to finish (counted in done, which it resets) merges them.
constexpr int ROW_CHUNK = 8192;
constexpr int ROW_MAX_BLOCKS = 64;   // rows of up to 524,288 values
struct ArgmaxPart {
    float val;
    int32_t idx;
};
struct RowScratch {
    ArgmaxPart *argmax_part = nullptr;   // [OJ_MAX_POSITIONS][ROW_MAX_BLOCKS]
    SampleTop *top_part = nullptr;       // [OJ_MAX_POSITIONS][ROW_MAX_BLOCKS]: indices within the row
    uint32_t *done = nullptr;            // [2][OJ_MAX_POSITIONS], zero between launches
};

// One evaluation's Gated DeltaNet intermediates for up to OJ_MAX_POSITIONS positions: what a
// replay needs to advance the state (deltanet.cu explains commit by replay).
struct RingSlot {
    float *qkv = nullptr;     // [N][conv_dim] raw conv inputs (the qkv projection)
    float *conv = nullptr;    // [N][conv_dim] conv + SiLU output, q and k heads L2-normed
    float *beta = nullptr;    // [N][n_v_heads] raw (before sigmoid)
    float *alpha = nullptr;   // [N][n_v_heads] raw (before softplus)
};

// One row compaction of oj_commit_path (engine.cu's compact_rows): rows path[i] -> rows i of a
// [rows][row_words] region starting at `base` (stride row_stride words).
struct CompactJob {
    uint32_t *base;
    int64_t row_stride;   // in 4-byte words
    int32_t row_words;
};

// One attention layer's KV planes (Layer's fields of the same names).
struct KvPlanes {
    void *k_cache = nullptr, *v_cache = nullptr;
    __half *k_scale = nullptr, *v_scale = nullptr;
};

// oj_eval_seqs (issue 29): position t of a pass is the next token of sequence seq[t], at its
// position pos[t]; the kernels' SEQS instances index each position's KV cache and recurrent state
// by it (base + seq[t] * the per-sequence stride), the other instances are the code they were.
struct SeqBatch {
    int32_t seq[OJ_MAX_POSITIONS];
    int32_t pos[OJ_MAX_POSITIONS];
};

// A chain pass's values that change from call to call (issue 25): the kernels of a captured pass
// (engine.cu, PassGraph) read them from device memory (Scratch::pass, written with the tokens before
// the graph's launch), so one graph serves every call of its shape. nullptr: the launch's own values.
struct PassArgs {
    int32_t pos0;       // the first position's cache row (n_past)
    int32_t n_replay;   // accepted positions of the other ring slot to replay first
    uint64_t tree;      // the positions' shape (tree.cuh's word; 0: a chain)
};

struct Layer {
    bool recurrent = false;
    float *attn_norm = nullptr, *post_norm = nullptr;
    Matrix ffn_gate, ffn_up, ffn_down;
    // gated attention (also the MTP block)
    Matrix wq, wk, wv, wo;
    float *q_norm = nullptr, *k_norm = nullptr;
    // KV cache of the selected sequence (engine_seq_select), values [n_head_kv][n_ctx][head_dim] of
    // type kv_type (oj_kv_type); sequence i's lies kv_seq_bytes * i bytes after sequence 0's (kv_base):
    // OJ_KV_F16: k_cache/v_cache hold __half. OJ_KV_Q8_0: they hold int8 quants in that shape and
    // k_scale/v_scale the fp16 scale of each 32 values, [n_head_kv][n_ctx][head_dim / 32]: ggml's
    // block_q8_0 split into a quant plane and a scale plane, so that a lane's quants are one aligned
    // load (a 34-byte block is only 2-byte aligned). Both planes live in one allocation.
    int kv_type = OJ_KV_F16;
    void *k_cache = nullptr, *v_cache = nullptr;
    __half *k_scale = nullptr, *v_scale = nullptr;
    KvPlanes kv_base;              // sequence 0's planes (all sequences' in one allocation each)
    size_t kv_seq_bytes = 0;       // one sequence's bytes of each allocation (K's, V's)
    // Gated DeltaNet
    Matrix wqkv, wgate, wbeta, walpha, wssm_out;
    float *conv1d = nullptr, *dt_bias = nullptr, *ssm_a = nullptr, *ssm_norm = nullptr;
    // the selected sequence's state; sequence i's at conv_base + i * conv_floats (ssm likewise)
    float *conv_state = nullptr;   // [conv_dim][kernel-1], oldest input first
    float *ssm_state = nullptr;    // [n_v_heads][d_state (value j)][d_state (key i)]
    float *conv_base = nullptr, *ssm_base = nullptr;
    size_t conv_floats = 0, ssm_floats = 0;
    RingSlot ring[2];              // evaluations alternate slots: one replays while one is written
    std::vector<RingSlot> rings;   // [n_seq][2]: every sequence's; ring = the selected one's
};

struct Mtp {
    Layer block;
    Matrix eh_proj;
    float *enorm = nullptr, *hnorm = nullptr, *head_norm = nullptr;
    const Matrix *embed = nullptr;   // nextn.embed_tokens or token_embd
    const Matrix *head = nullptr;    // nextn.shared_head_head or output
    Matrix own_embed, own_head;
};

// Activation buffers, sized for OJ_MAX_POSITIONS positions.
struct Scratch {
    int32_t *tokens = nullptr;                         // [N], then the pass's PassArgs
    PassArgs *pass = nullptr;                          // = tokens + OJ_MAX_POSITIONS: one copy sends both
    float *x = nullptr, *xn = nullptr;                 // residual stream, normed input [N][E]
    float *ffn_gate = nullptr, *ffn_up = nullptr;      // [N][n_ff]
    float *z = nullptr, *dn_out = nullptr;             // [N][value_dim]
    float *qg = nullptr;                               // [N][2 * q_dim]: query and gate per head
    float *k = nullptr, *v = nullptr;                  // [N][kv_dim]
    float *q_rot = nullptr, *attn_out = nullptr;       // [N][q_dim]
    float *part_ml = nullptr, *part_acc = nullptr;     // split-K partials
    int max_splits = 0;
    // A pass being captured (engine.cu, capture_pass): the attention split count its grids are built
    // for, attention_split_bucket's (>= the pass's own; 0: the pass's own). Splits past a position's
    // keys write (-inf, 0) and the combine skips them, as it skips the empty splits of the positions
    // before the last: the same bits as the pass's own count.
    int pass_splits = 0;
    float *cat = nullptr;                              // [N][2E] MTP input
    float *h_in = nullptr;                             // [N][E] MTP h
    float *logits = nullptr, *draft_logits = nullptr;  // [N][n_vocab]
    int32_t *argmax = nullptr, *draft_argmax = nullptr;
    int32_t *draft_chain = nullptr;                    // [N]: oj_cycle's drafts, made on the device
    int32_t *draft_ids = nullptr;                      // [n_vocab]: the draft vocabulary, when restricted
    float *hidden = nullptr;                           // [N+1][E]: row 0 = position before the batch
    float *draft_hidden = nullptr;                     // [N][E]
    float *tree_h = nullptr;                           // [N][E] oj_draft_tree: each node's MTP hidden
    TreeTop *tree_top = nullptr;                       // oj_draft_tree: a node's candidates (row_top)
    SampleTop *sample_top = nullptr;                   // [N] oj_cycle_sampled: each row's candidates
    SampleDist *sample_q = nullptr;                    // [n_seq][N]: each sequence's drafts' distributions
    int32_t *sample_out = nullptr;                     // [2]: the accepted drafts' count and the token drawn
    RowScratch rows;                                   // argmax_rows' and sample_top's partials
    int32_t *fault_probe = nullptr;
};

// Activation buffers of the batched prefill path (prefill.cu), sized for `chunk` positions;
// absent (chunk 0) unless oj_model_desc.prefill_chunk asked for them.
struct PrefillScratch {
    int chunk = 0;
    int32_t *tokens = nullptr;                         // [chunk]
    float *x = nullptr, *xn = nullptr;                 // [chunk][E]
    float *ffn_gate = nullptr, *ffn_up = nullptr;      // [chunk][n_ff], ffn_up right after ffn_gate
    // attention_prefill's segment partials: the FFN buffers, free while an attention pass runs
    float *attn_part = nullptr;                        // = ffn_gate
    size_t attn_part_bytes = 0;                        // both FFN buffers
    float *z = nullptr, *dn_out = nullptr;             // [chunk][value_dim]
    float *qkv = nullptr, *conv = nullptr;             // [chunk][conv_dim]: raw conv inputs, conv output
    float *beta = nullptr, *alpha = nullptr;           // [chunk][n_v_heads]
    float *qg = nullptr;                               // [chunk][2 * q_dim]
    float *k = nullptr, *v = nullptr;                  // [chunk][kv_dim]
    float *q_rot = nullptr, *attn_out = nullptr;       // [chunk][q_dim]
    float *cat = nullptr;                              // [chunk][2E]: the MTP block's input
    float *hidden = nullptr;                           // [chunk + 1][E]: row r = h of position pos0 + r - 1
    void *workspace = nullptr;                         // X of the GEMMs (gemm_f16.cuh, gemm_prefill.cuh)
    size_t workspace_bytes = 0;
    void *dn_coef = nullptr;                           // per-chunk coefficients of deltanet_chunked.cuh
    size_t dn_coef_bytes = 0;
    // A piece in layers (oj_prefill_layers): the sequence whose piece holds x, hidden and tokens
    // between calls (-1: none), its tokens, the layers done, its first position and whether the MTP
    // block follows it.
    int piece_seq = -1;
    std::vector<int32_t> piece_tokens;
    int piece_layers = 0;
    int piece_pos0 = 0;
    bool piece_mtp = false;
};

// A copy of the recurrent state and the hidden state at n_past (oj_checkpoint_save).
struct Checkpoint {
    int n_past = -1;          // -1: never saved
    float *data = nullptr;    // every DeltaNet layer's conv state then ssm state, then n_embd hidden
};

// oj_profile (engine.cu): CUDA events at the phase boundaries of the main model's verify pass, and
// the totals oj_profile_read hands out.
struct Profile {
    bool on = false;                   // oj_profile(1): events
    bool host = false;                 // oj_profile(1 or 2): the host time of each pass
    bool active = false;               // inside a profiled verify (the MTP block's calls stamp nothing)
    std::vector<cudaEvent_t> events;   // grown on demand, destroyed with the engine
    std::vector<int> phase;            // the phase begun at each event of this pass (-1: the pass's end)
    std::vector<uint64_t> launches;    // the thread's launch count at each event
    std::vector<uint64_t> bytes;       // the bytes of the phase begun there
    int used = 0;
    struct Total {
        int64_t calls = 0, launches = 0;
        double ms = 0;
        uint64_t bytes = 0;
    };
    Total total[OJ_MAX_PHASES];
    int passes = 0;
    double span_ms = 0;
    int host_passes = 0;
    double host_ms = 0;                // the passes' host time, start to last launch enqueued
};

// What a sequence (oj_seq_select) keeps of the engine's bookkeeping: the fields below, swapped in
// and out whole on a select; the device state it points at is rebound (bind_sequence).
struct SeqState {
    int n_past = 0;                   // committed positions
    int last_start = 0, last_n = 0;   // the last evaluation's first position and length
    // Commit by replay (deltanet.cu): the next evaluation writes ring slot `slot`; the first
    // replay_n positions of slot replay_slot are accepted but not yet in the recurrent state.
    int slot = 0, replay_slot = 1, replay_n = 0;
    int uncommitted = 0;              // positions of the last oj_verify awaiting oj_commit
    uint64_t tree = 0;                // the last verify's shape (tree.cuh; 0: a chain, oj_verify)
    int8_t tree_parent[OJ_MAX_POSITIONS] = {};   // its parents (host copy for oj_commit_path's checks)
    int prev_row = 0;                 // hidden-window row of position n_past - 1 after the last commit
    int mtp_n_past = 0, last_mtp_n = 0;
    float *hidden = nullptr;          // its hidden window (Scratch::hidden while selected)
    // The drafts the last oj_cycle_sampled drew (their distributions in Scratch::sample_q at this
    // sequence's rows), for the next call at n_past with `token` first; n_drafts -1: none (used once).
    int sampled_n_drafts = -1, sampled_n_past = 0;
    int32_t sampled_token = 0;
    int32_t sampled_drafts[OJ_MAX_POSITIONS] = {};
};

struct Engine : SeqState {
    ModelDims dims;
    int n_ctx = 0;
    int kv_type = OJ_KV_F16;          // oj_kv_type of every KV cache (main layers and MTP block)
    int device = 0;
    cudaStream_t stream = nullptr;

    Matrix tok_embd, output;
    float *output_norm = nullptr;
    std::vector<Layer> layers;
    bool has_mtp = false;
    Mtp mtp;
 Scratch s;
    PrefillScratch pf;

    // Sequences: the SeqState fields this Engine inherits are the selected sequence's; the others
    // wait in seqs (seqs[cur_seq] is stale while selected).
    int n_seq = 1, cur_seq = 0;
    std::vector<SeqState> seqs;
    int result_rows = 0;              // rows of s.logits / s.argmax the last pass wrote (any sequence)
    CompactJob *compact_jobs = nullptr;          // device table for oj_commit_path's row moves
    int compact_capacity = 0;
    int n_draft_ids = 0;              // 0: the draft head scores the whole vocabulary
    std::vector<Checkpoint> checkpoints;
    Profile prof;
    // Captured chain passes (engine.cu, run_pass): a pass's launches as one CUDA graph per shape,
    // replayed with the call's PassArgs; at most MAX_GRAPHS, the least recently used replaced.
    struct PassGraph {
        int n, slot, replay_slot, seq, splits;
        bool tree;                 // a draft tree's kernels (any tree of n nodes) or a chain's
        uint64_t workspaces;       // matvec_workspace_generation() when captured (a grown one is freed)
        cudaGraphExec_t exec;
        uint64_t used;
    };
    static constexpr int MAX_GRAPHS = 32;
    std::vector<PassGraph> graphs;
    uint64_t graph_clock = 0;
    int graph_failures = 0;        // captures that failed in a row; direct launches after GRAPH_TRIES
    int64_t graph_replays = 0, direct_passes = 0;   // oj_graph_stats
    int64_t graph_captures = 0;                      // captures made (new graphs and updates)
    double graph_capture_ms = 0;                     // their host time: capture, instantiate or update

    // oj_seq_state_save / load's copies (engine.cu, StateCopy): on copy_stream, beside the passes on
    // stream, through two pinned staging buffers allocated at the first copy; copy_mutex runs them
    // one at a time (oj_state_copy_wait may run on any thread).
    cudaStream_t copy_stream = nullptr;
    uint8_t *staging = nullptr;                  // [2][STATE_STAGING_BYTES] pinned host memory
    cudaEvent_t staged[2] = {};
    std::mutex copy_mutex;
    std::atomic<uint32_t> copy_busy{0};          // bit i: sequence i has a copy not yet waited for

    std::vector<void *> allocations;
    oj_memory_report memory{};
    std::string error;
    std::atomic<bool> failed{false};             // written by a wait on another thread too

    void *alloc(size_t bytes, uint64_t &counter);
    void release_all();
};

// engine.cu: model loading and the forward passes (throw Error on failure).
void engine_load(Engine &e, const oj_model_desc &desc);
void engine_reset(Engine &e);
void engine_verify(Engine &e, const int32_t *tokens, int n);   // provisional: commits nothing
void engine_commit(Engine &e, int n_accept);                    // keep the first n_accept
// oj_verify_tree / oj_commit_path (openjet.h): a draft tree, provisional; keep one path of it.
void engine_verify_tree(Engine &e, const int32_t *tokens, const int32_t *parent, int n);
void engine_commit_path(Engine &e, const int32_t *path, int n_path);
// oj_cycle: returns the accepted drafts' count; out_tokens[0..k], out_drafts[0..n_draft)
int engine_cycle(Engine &e, const int32_t *tokens, int n, int n_draft, int32_t *out_tokens, int32_t *out_drafts);
// oj_cycle_sampled: the same, every draw on the GPU under `p`
int engine_cycle_sampled(Engine &e, const int32_t *tokens, int n, int n_draft, const oj_sampling &p, int32_t *out_tokens,
                         int32_t *out_drafts);
void engine_eval(Engine &e, const int32_t *tokens, int n);     // verify + commit all
void engine_flush(Engine &e);                                   // replay pending positions now
void engine_set_draft_vocab(Engine &e, const int32_t *ids, int n);
// oj_seq_select / oj_eval_seqs (openjet.h).
void engine_seq_select(Engine &e, int seq);
void engine_eval_seqs(Engine &e, const int32_t *seqs, const int32_t *tokens, int n);
// oj_seq_state_size / save / load / oj_state_copy_wait (openjet.h): the selected sequence's whole
// state to and from host memory. save and load check, set up `c` and mark the sequence busy;
// state_copy_run moves the bytes (any thread) and clears the mark.
struct StateCopy {
    struct Segment {
        uint8_t *dev;
        size_t bytes;
    };
    Engine *e = nullptr;
    bool save = true;
    int seq = 0;
    uint8_t *host = nullptr;           // the copy's bytes after its header
    std::vector<Segment> segments;     // device memory in the copy's byte order
    cudaEvent_t start = nullptr;       // on stream: the work before the copy
};
uint64_t engine_seq_state_size(const Engine &e);
void engine_seq_state_save(Engine &e, void *out, uint64_t size, StateCopy &c);
void engine_seq_state_load(Engine &e, const void *data, uint64_t size, StateCopy &c);
void state_copy_run(StateCopy &c);
void state_copy_release(StateCopy &c);   // the busy mark and the event (after run, or instead of it)
// Refuses a call on sequence `seq` while a state copy of it is not waited for.
void check_not_copying(const Engine &e, int seq, const char *what);
void engine_checkpoint_save(Engine &e, int slot);
int engine_checkpoint_restore(Engine &e, int slot);   // returns the restored n_past
void engine_mtp_eval(Engine &e, const int32_t *tokens, int n, int pos0, int h_source, const float *h_host);
// oj_draft_tree: the number of nodes written
int engine_draft_tree(Engine &e, const oj_tree_request &rq, int32_t *tokens, int32_t *parent, double *prob, double *score,
                      int *steps_out);
// oj_profile / oj_profile_read (openjet.h); read returns the phase count written.
void engine_profile(Engine &e, int on);
int engine_profile_read(Engine &e, oj_phase *out, int capacity, int *passes, double *span_ms, double *host_ms);
// prefill.cu: oj_prefill (openjet.h), and its buffers (engine_load calls alloc_prefill).
void engine_prefill(Engine &e, const int32_t *tokens, int n);
// oj_prefill_layers (openjet.h), *done as it says.
void engine_prefill_layers(Engine &e, const int32_t *tokens, int n, int layers, int32_t *done);
void alloc_prefill(Engine &e, int chunk);
// Refuses a call on sequence `seq` (or, with seq -1, one that needs the prefill buffers) while a
// piece in layers holds them.
void check_no_piece(const Engine &e, int seq, const char *what);

// --- launchers (each in the file of its kernel) --------------------------------------------
// matvec.cu: y[n][m] (+)= sum_k W[m][k] x[n][k] for n < n_vec (1..16); W read once for all n.
void matvec(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, cudaStream_t st);
// matvec.cu: how many times a matvec workspace was replaced (a captured pass holds the old one's
// address: engine.cu captures again after a change).
uint64_t matvec_workspace_generation();
// matvec.cu: y_i[n][:] = W_i x[n] for the n matrices (same K) that read one x, e.g. a layer's
// projections of its normed input: on the fp16 path runs of up to 4 of one type share one prepared
// x and one launch (each output as its own matvec would give it at the launch's split), anything
// else one matvec each.
void matvec_group(const Matrix *const *w, float *const *y, int n, const float *x, int n_vec, cudaStream_t st);
// matvec.cu: matvec_group of rms_norm(x) * norm (the layer's input norm): where every member takes
// the fp16 path, the norm is computed inside its prep (no separate norm kernel, xn untouched), else
// rms_norm into xn first.
// sums: the launch that last wrote x was a residual writer that left its row tiles' sums of squares
// (matvec_residual, matvec_gated_norm, matvec_swiglu returning true): the prep sums K / 32 partials
// a vector instead of K squares.
void matvec_group_norm(const Matrix *const *w, float *const *y, int n, const float *x, const float *norm, float eps,
                       float *xn, int n_vec, cudaStream_t st, bool sums = false);
// matvec.cu: y += W x for the residual y (attn_output), leaving the sums of squares of y's row tiles
// for the next norm prep where the fp16 path takes it (returns whether it did).
bool matvec_residual(const Matrix &w, const float *x, float *y, int n_vec, cudaStream_t st);
// matvec.cu: y (+)= W (silu(gate) * up) (the FFN's down projection): SwiGLU inside the prep on the
// fp16 path, else computed into gate first.
// Both return whether they left y's row-tile sums of squares (accumulate, the fp16 path): see matvec_residual.
bool matvec_swiglu(const Matrix &w, float *gate, const float *up, float *y, int n_vec, bool accumulate, cudaStream_t st);
// matvec.cu: y (+)= W gated_norm(o) (DeltaNet's ssm_out of its normed, gated output: per head of S
// values rms-normed, times norm and silu(z)): inside the prep on the fp16 path, else
// deltanet_gated_norm in place first.
bool matvec_gated_norm(const Matrix &w, float *o, const float *z, const float *norm, int n_heads, int S, float eps, float *y,
                       int n_vec, bool accumulate, cudaStream_t st);
// matvec.cu: y[n][i] = W[rows[i]] . x[n] for i < n_rows (rows on the device): the draft head over
// a restricted vocabulary. y is [n_vec][n_rows].
void matvec_rows(const Matrix &w, const int32_t *rows, int n_rows, const float *x, float *y, int n_vec,
                 cudaStream_t st);
// matvec.cu: y[n][:] = row tokens[n] of W, dequantised (embedding lookup).
void embed_rows(const Matrix &w, const int32_t *tokens, float *y, int n, cudaStream_t st);
// matvec.cu: host-side rearrangement of a file tensor into the device layout; returns bytes.
std::vector<uint8_t> to_device_layout(int type, int64_t K, int64_t M, const uint8_t *src);
size_t device_layout_bytes(int type, int64_t K, int64_t M);

// elementwise.cu
void rms_norm(const float *x, const float *w, float *y, int n, int width, float eps,
              int y_stride, cudaStream_t st);
void swiglu(float *gate_inout, const float *up, int64_t count, cudaStream_t st);
// First index of each row's largest value (NaN never wins; a row with none: 0), ROW_CHUNK values a block.
void argmax_rows(const float *x, int32_t *out, int n, int width, const RowScratch &rs, cudaStream_t st);
// out[i] = ids[out[i]] for i < n (an argmax over a row subset back to token ids)
void map_ids(int32_t *out, const int32_t *ids, int n, cudaStream_t st);
void fault_probe(int32_t *out, cudaStream_t st);
// elementwise.cu: the k (1..OJ_TREE_MAX_CHILDREN) largest of one row of `width` values, descending (ties: the smaller
// index), indices mapped through ids when set (-1 past the finite values), and the row's max and
// sum of exp(x - max) over its finite values, into *out (oj_draft_tree's node candidates).
void row_top(const float *x, int width, const int32_t *ids, int k, TreeTop *out, cudaStream_t st);
// elementwise.cu: for each of n_jobs jobs, rows path[i] -> rows i (i < n_path; path[i] >= i, as
// a root-first path of a tree in topological order has): oj_commit_path's moves.
void compact_rows(const CompactJob *jobs, int n_jobs, int max_row_words, uint64_t path, int n_path, cudaStream_t st);

// sample.cu (oj_cycle_sampled): for each of n_rows rows of x (row_stride floats apart, `width`
// values), its min(k, finite values) largest (k 1..OJ_SAMPLE_TOP_MAX; ties: the smaller index),
// indices mapped through ids when set, into out[row].
void sample_top(const float *x, int64_t row_stride, int width, const int32_t *ids, int k, int n_rows, SampleTop *out,
                const RowScratch &rs, cudaStream_t st);
// sample.cu: the acceptance of n - 1 drafts (tokens[1..n), drawn from q[0..n-1)) against the rows'
// candidates cand[0..n) under p, then the token drawn: out[0] = drafts accepted, out[1] = the token.
void sample_verify(const SampleTop *cand, const int32_t *tokens, const SampleDist *q, int n, const oj_sampling &p,
                   int32_t *out, cudaStream_t st);
// sample.cu: a draw from cand's distribution under p with the stream's uniform `ctr`: the
// distribution into *q, the token into *token.
void sample_draft(const SampleTop *cand, const oj_sampling &p, int ctr, SampleDist *q, int32_t *token, cudaStream_t st);

// deltanet.cu: one Gated DeltaNet layer's mixer: first replays n_replay accepted positions of ring
// slot replay_slot into the state, then runs n new positions from ring slot `slot` (qkv, beta,
// alpha already projected there) to s.dn_out (before the gated norm), committing nothing.
// `tree`: the positions' shape (tree.cuh; 0: a chain; else a tree's conv windows and recurrences
// follow each node's ancestors).
// dyn: n_replay and the tree's word read from device memory instead (a captured pass; `tree` still
// picks the kernels: a chain's or a tree's).
void deltanet_mix(const ModelDims &d, Layer &L, Scratch &s, int n, int slot, int replay_slot, int n_replay,
                  cudaStream_t st, uint64_t tree = 0, const PassArgs *dyn = nullptr);
// deltanet.cu: the mixer for the positions of oj_eval_seqs, position t the next of sequence
// b.seq[t] (its conv and ssm state at Layer::conv_base / ssm_base + seq * the per-sequence floats),
// from ring slot `cur` to s.dn_out, each sequence's state ADVANCED by its position (committed in
// the pass, as prefill does; the sequences have nothing pending to replay).
void deltanet_mix_seqs(const ModelDims &d, Layer &L, Scratch &s, int n, const RingSlot &cur, const SeqBatch &b,
                       cudaStream_t st);
// deltanet.cu: o = rms_norm(o) * w * silu(z) per head of S values, in place ([n][n_heads][S]).
void deltanet_gated_norm(float *o, const float *z, const float *w, int n, int n_heads, int S, float eps, cudaStream_t st);
// deltanet.cu: the prefill form: n positions from raw conv inputs qkv (conv output to conv) and raw
// beta / alpha, ADVANCING the state by all of them (no ring slot, nothing pending), gated-normed
// outputs to out (z: the gate projection). The same kernels and arithmetic as deltanet_mix.
// The recurrence in chunks of 64 on the tensor cores (deltanet_chunked.cuh, `coef` its buffer);
// OPENJET_PREFILL_DELTANET=sequential, or a state size it has no kernel for: the sequential kernel.
void deltanet_prefill(const ModelDims &d, Layer &L, const float *qkv, float *conv, const float *beta,
                      const float *alpha, const float *z, float *out, int n, void *coef, size_t coef_bytes,
                      cudaStream_t st);
// deltanet.cu: only the replay (before reading the state back).
void deltanet_replay(const ModelDims &d, Layer &L, int replay_slot, int n_replay, cudaStream_t st);

// attention.cu: q/k norms, RoPE, KV append at pos0.., split-K decode, sigmoid gate:
// from s.qg/s.k/s.v to s.attn_out (before attn_output).
// `tree`: the positions' shape (tree.cuh; 0: a chain): node i's K/V at row pos0 + i, RoPE at pos0 +
// its depth, attention over the committed rows and its path's (tree_path_rows).
// dyn: pos0 and the tree's word read from device memory instead (a captured pass; the splits stay
// those of the pos0 given).
void attention_mix(const ModelDims &d, Layer &L, Scratch &s, int n, int pos0, int n_ctx,
                   cudaStream_t st, uint64_t tree = 0, const PassArgs *dyn = nullptr);
// attention.cu: attention_mix for the positions of oj_eval_seqs, position t at b.pos[t] in
// sequence b.seq[t]'s KV cache (Layer::kv_base + seq * kv_seq_bytes).
void attention_mix_seqs(const ModelDims &d, Layer &L, Scratch &s, int n, const SeqBatch &b, int n_ctx, cudaStream_t st);
// attention.cu: the first step alone for n positions of a prefill pass: q/k norms and RoPE to q_rot,
// K/V appended at pos0...
void attention_prepare(const ModelDims &d, Layer &L, const float *qg, const float *k, const float *v,
                       float *q_rot, int n, int pos0, int n_ctx, cudaStream_t st);
// attention.cu: the decode kernels over any n positions, OJ_MAX_POSITIONS at a time through the
// split-K buffers of s (the reference the prefill kernel is checked against; OPENJET_PREFILL_ATTN=decode).
void attention_by_decode(const ModelDims &d, Layer &L, Scratch &s, const float *q_rot, const float *qg,
                         float *out, int n, int pos0, int n_ctx, cudaStream_t st);
// attention_prefill.cu: causal flash attention for n positions pos0.. whose K/V are in the cache,
// on the tensor cores: out[i][h] = softmax(q k^T / sqrt(D)) v * sigmoid(gate). part / part_bytes:
// room for the split blocks' segment partials (a few blocks for many keys: a small prefill piece
// deep in the context), used when it fits and the blocks leave SMs idle; the result is the same
// bits either way. split: -1 decide so, 0 never, 1 always (fails where it cannot: the harness).
void attention_prefill(const ModelDims &d, const Layer &L, const float *q_rot, const float *qg, float *out,
                       int n, int pos0, int n_ctx, cudaStream_t st, float *part = nullptr, size_t part_bytes = 0,
                       int split = -1);
// attention.cu: split-K blocks needed per (head, position) at a context of n_ctx positions.
int attention_splits_for(int n_ctx);
// The split count a captured pass's attention grids take for a pass that needs `splits` (at most
// max_splits, the allocated): a power of two up to 8, then a multiple of 8, so that a graph serves
// 2,048 positions of growth past 2,048 instead of 256 (a new count is a capture and a graph update,
// ~4-5 ms of host time a shape), for at most 7 empty splits a position and head pair (their blocks
// find no keys and write (-inf, 0); the combine skips them). tools/pass_shape_check.cu prints it.
inline int attention_split_bucket(int splits, int max_splits) {
    int b = 1;
    if (splits <= 8)
        while (b < splits) b *= 2;
    else
        b = (splits + 7) / 8 * 8;
    return std::min(std::max(b, splits), max_splits);
}

}  // namespace oj
